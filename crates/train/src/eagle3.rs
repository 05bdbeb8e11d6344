//! EAGLE-3-style draft heads trained by us: one decoder layer (attention over the head's own rows of the whole
//! context, then a feed-forward block) on three fused target layers, written in the published EAGLE-3 layout
//! (`config.json` + `model.safetensors`) so that [`decode::speculative::PublishedProposer`] runs them.
//!
//! ```text
//! g = fc · [x_l1 ; x_l2 ; x_l3]                          the residual stream entering three target layers
//! a = [input_norm(embed(token)) ; hidden_norm(g)]        2d wide
//! h = g + o_proj(attn(a)),  h += mlp(post_norm(h))       causal attention over rows 0..=i, RoPE at position i
//! logits = lm_head · norm(h)                             over the reduced draft vocabulary (`d2t`)
//! ```
//! Row `i` of a sequence pairs the target's layer inputs at `i` with token `i + 1` and predicts token `i + 2`
//! (step 1). Step `s > 1` ("training-time test", as EAGLE-3 trains): the same row feeds the previous step's `h` in
//! place of `g` with token `i + s`, at position `i + s - 1`, predicting token `i + s + 1`; its query attends to the
//! step-1 rows `0..=i` (the committed context at inference) and to the row's own earlier steps (its ancestors in
//! the tree) and itself — exactly the keys a depth-`s - 1` tree node sees in the proposer.
//!
//! Training works on whole sequences (batches of sequences of similar length, padded), so every row sees the whole
//! context before it, as at inference. The fused inputs are scaled per dimension by their RMS over the training
//! data (the residual stream has a few very large dimensions); the scale is folded into `fc` when the file is
//! written.

use crate::data::DraftData;
use crate::head::rms_norm;
use crate::head::Lcg;
use crate::{cross_entropy, draft_vocabulary, record_training, report_start, resumed_epoch, run_epochs};
use crate::{shuffle_for_epoch, EmbTable};
use crate::{Acceptance, Schedule, TrainError, Trainee};
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

/// Sizes of an EAGLE-3 head.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Eagle3Shape {
    pub d: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub ff: usize,
    /// Draft vocabulary size.
    pub vocab: usize,
    /// Target layers whose inputs are fused (`n_layers` = the last layer's output).
    pub layers: Vec<usize>,
}

/// Settings of [`train_eagle3`].
#[derive(Clone, Debug)]
pub struct Eagle3Options {
    pub vocab: usize,
    pub ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub epochs: usize,
    /// Tokens per batch (whole sequences are packed up to it; a longer sequence makes a batch of its own).
    pub batch_tokens: usize,
    pub lr: f64,
    pub lr_end: f64,
    /// Draft steps unrolled per row (1 = teacher-forced only).
    pub steps: usize,
    pub seed: u64,
    /// Checkpoint folder (resumed from when it holds a checkpoint).
    pub checkpoint: std::path::PathBuf,
    pub progress: bool,
}

/// The trainable head.
pub struct Eagle3Net {
    pub shape: Eagle3Shape,
    eps: f64,
    rope_theta: f32,
    /// Per-dimension input scale of the fused rows (1 / RMS over the training data), `[k·d]`.
    in_scale: Tensor,
    vars: Vec<(&'static str, Var)>,
}

/// Tensor names in the published layout, in [`Eagle3Net::vars`] order.
const NAMES: [&str; 14] = [
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    // Not a parameter: written from `in_scale` for checkpoints only.
    "specee.in_scale",
];

/// `x · wᵀ` for `x` `[n, in]`.
fn linear(x: &Tensor, w: &Var) -> candle_core::Result<Tensor> {
    x.matmul(&w.t()?)
}

/// One batch of whole sequences, `b` rows of `t` positions (padded), step-major.
struct SeqBatch {
    b: usize,
    t: usize,
    /// Fused target rows, scaled, `[b·t, k·d]`.
    aux: Tensor,
    /// Per step: embeddings of the step's input tokens `[b·t, d]`, labels `[b·t]` (draft ids) and their mask.
    emb: Vec<Tensor>,
    label: Vec<Tensor>,
    mask: Vec<Tensor>,
    /// Additive causal mask `[t, t]` (0 where key ≤ query, a large negative number elsewhere).
    causal: Tensor,
}

/// What to score in [`Eagle3Net::unroll`]'s caller: per row of the batch, sequence and position.
struct RowMap {
    seq: Vec<usize>,
    pos: Vec<usize>,
}

impl Eagle3Net {
    /// A fresh head. `head_rows` (`vocab × d`) are the target's head rows of the draft vocabulary, `out_norm` its
    /// final norm weights and `rms` the RMS of each fused dimension: the net starts as "the feature stays" (`g` is
    /// the last fused row, the target's final residual when the last layer is `n_layers`; attention and MLP add
    /// nothing), like our MLP heads.
    pub fn new(
        shape: Eagle3Shape,
        eps: f64,
        rope_theta: f32,
        head_rows: &[f32],
        out_norm: &[f32],
        rms: &[f32],
        seed: u64,
    ) -> Result<Eagle3Net, TrainError> {
        let dev = Device::Cpu;
        let Eagle3Shape { d, n_head, n_head_kv, head_dim, ff, vocab, ref layers } = shape;
        let k = layers.len();
        let mut rng = Lcg(seed);
        let mut normal = |n: usize, scale: f32| (0..n).map(|_| rng.normal() * scale).collect::<Vec<f32>>();
        let mut fc = normal(d * k * d, 0.01);
        for r in 0..d {
            fc[r * k * d + (k - 1) * d + r] += rms[(k - 1) * d + r];
        }
        let (qd, kvd) = (n_head * head_dim, n_head_kv * head_dim);
        let att = 1.0 / ((2 * d) as f32).sqrt();
        let values: Vec<(Vec<f32>, Vec<usize>)> = vec![
            (fc, vec![d, k * d]),
            (vec![1.0; d], vec![d]),
            (vec![1.0; d], vec![d]),
            (normal(qd * 2 * d, att), vec![qd, 2 * d]),
            (normal(kvd * 2 * d, att), vec![kvd, 2 * d]),
            (normal(kvd * 2 * d, att), vec![kvd, 2 * d]),
            (vec![0.0; d * qd], vec![d, qd]),
            (vec![1.0; d], vec![d]),
            (normal(ff * d, 1.0 / (d as f32).sqrt()), vec![ff, d]),
            (normal(ff * d, 1.0 / (d as f32).sqrt()), vec![ff, d]),
            (vec![0.0; d * ff], vec![d, ff]),
            (out_norm.to_vec(), vec![d]),
            (head_rows.to_vec(), vec![vocab, d]),
        ];
        let mut vars = Vec::new();
        for ((v, dims), name) in values.into_iter().zip(NAMES) {
            vars.push((name, Var::from_tensor(&Tensor::from_vec(v, dims, &dev)?)?));
        }
        let in_scale = Tensor::from_vec(rms.iter().map(|r| 1.0 / r.max(1e-6)).collect::<Vec<f32>>(), k * d, &dev)?;
        Ok(Eagle3Net { shape, eps, rope_theta, in_scale, vars })
    }

    /// The parameters.
    pub fn vars(&self) -> Vec<Var> {
        self.vars.iter().map(|(_, v)| v.clone()).collect()
    }

    fn var(&self, i: usize) -> &Var {
        &self.vars[i].1
    }

    /// cos and sin `[t, head_dim / 2]` for positions `offset..offset + t`.
    fn rope_tables(&self, t: usize, offset: usize) -> candle_core::Result<(Tensor, Tensor)> {
        let inv = model::blocks::rope_inv_freq(self.rope_theta, self.shape.head_dim);
        let half = inv.len();
        let (mut cos, mut sin) = (vec![0f32; t * half], vec![0f32; t * half]);
        for p in 0..t {
            model::blocks::rope_angles(
                (p + offset) as u32,
                &inv,
                &mut cos[p * half..(p + 1) * half],
                &mut sin[p * half..(p + 1) * half],
            );
        }
        Ok((Tensor::from_vec(cos, (t, half), &Device::Cpu)?, Tensor::from_vec(sin, (t, half), &Device::Cpu)?))
    }

    /// `[b·t, heads·hd]` → `[b, heads, t, hd]`, RoPE (rotate-half) applied when `rope` is given.
    fn split_heads(
        &self,
        x: &Tensor,
        b: usize,
        t: usize,
        heads: usize,
        rope: Option<&(Tensor, Tensor)>,
    ) -> candle_core::Result<Tensor> {
        let hd = self.shape.head_dim;
        let x = x.reshape((b, t, heads, hd))?.transpose(1, 2)?.contiguous()?;
        let Some((cos, sin)) = rope else { return Ok(x) };
        let half = hd / 2;
        let (x1, x2) = (x.narrow(3, 0, half)?, x.narrow(3, half, half)?);
        let (c, s) = (cos.reshape((1, 1, t, half))?, sin.reshape((1, 1, t, half))?);
        let r1 = (x1.broadcast_mul(&c)? - x2.broadcast_mul(&s)?)?;
        let r2 = (x2.broadcast_mul(&c)? + x1.broadcast_mul(&s)?)?;
        Tensor::cat(&[r1, r2], 3)
    }

    /// KV heads repeated to the query heads (`[b, kv, t, hd]` → `[b, heads, t, hd]`).
    fn repeat_kv(&self, x: Tensor) -> candle_core::Result<Tensor> {
        let group = self.shape.n_head / self.shape.n_head_kv;
        if group == 1 {
            return Ok(x);
        }
        let (b, kv, t, hd) = x.dims4()?;
        x.unsqueeze(2)?.broadcast_as((b, kv, group, t, hd))?.contiguous()?.reshape((b, kv * group, t, hd))
    }

    /// Runs `steps` unrolled steps over a batch; returns per step the logits `[b·t, N]`.
    fn unroll(&self, batch: &SeqBatch, steps: usize) -> candle_core::Result<Vec<Tensor>> {
        let (b, t) = (batch.b, batch.t);
        let Eagle3Shape { n_head, n_head_kv, head_dim, .. } = self.shape;
        let scale = 1.0 / (head_dim as f64).sqrt();
        let aux = batch.aux.broadcast_mul(&self.in_scale)?;
        let mut g = linear(&aux, self.var(0))?;
        let (mut ctx_k, mut ctx_v) = (None::<Tensor>, None::<Tensor>);
        let (mut own_k, mut own_v): (Vec<Tensor>, Vec<Tensor>) = (Vec::new(), Vec::new());
        let mut out = Vec::new();
        for s in 0..steps {
            let e = rms_norm(&batch.emb[s], self.var(1).as_tensor(), self.eps)?;
            let hn = rms_norm(&g, self.var(2).as_tensor(), self.eps)?;
            let a = Tensor::cat(&[&e, &hn], 1)?;
            let rope = self.rope_tables(t, s)?;
            let q = self.split_heads(&linear(&a, self.var(3))?, b, t, n_head, Some(&rope))?;
            let k = self.repeat_kv(self.split_heads(&linear(&a, self.var(4))?, b, t, n_head_kv, Some(&rope))?)?;
            let v = self.repeat_kv(self.split_heads(&linear(&a, self.var(5))?, b, t, n_head_kv, None)?)?;
            let att = if s == 0 {
                let scores = (q.matmul(&k.transpose(2, 3)?.contiguous()?)? * scale)?.broadcast_add(&batch.causal)?;
                let p = candle_nn::ops::softmax(&scores, D::Minus1)?;
                let att = p.matmul(&v)?;
                (ctx_k, ctx_v) = (Some(k), Some(v));
                att
            } else {
                let (ck, cv) = (ctx_k.as_ref().unwrap(), ctx_v.as_ref().unwrap());
                own_k.push(k);
                own_v.push(v);
                let ctx = (q.matmul(&ck.transpose(2, 3)?.contiguous()?)? * scale)?.broadcast_add(&batch.causal)?;
                let mut parts = vec![ctx];
                for ok in &own_k {
                    parts.push(((&q * ok)?.sum_keepdim(3)? * scale)?);
                }
                let p = candle_nn::ops::softmax(&Tensor::cat(&parts, 3)?, D::Minus1)?;
                let mut att = p.narrow(3, 0, t)?.contiguous()?.matmul(cv)?;
                for (j, ov) in own_v.iter().enumerate() {
                    att = (att + p.narrow(3, t + j, 1)?.broadcast_mul(ov)?)?;
                }
                att
            };
            let att = att.transpose(1, 2)?.contiguous()?.reshape((b * t, n_head * head_dim))?;
            let mut h = (&g + linear(&att, self.var(6))?)?;
            let n = rms_norm(&h, self.var(7).as_tensor(), self.eps)?;
            let gate = linear(&n, self.var(8))?.silu()?;
            let up = linear(&n, self.var(9))?;
            h = (h + linear(&(gate * up)?, self.var(10))?)?;
            out.push(linear(&rms_norm(&h, self.var(11).as_tensor(), self.eps)?, self.var(12))?);
            g = h;
        }
        Ok(out)
    }

    /// Writes the head in the published EAGLE-3 layout: `dir/config.json` and `dir/model.safetensors` (F16 for
    /// the shipped head, F32 for checkpoints, which also keep the input scale unfolded). `vocab_size` is the
    /// target's.
    pub fn save(
        &self,
        dir: &Path,
        d2t: &[u32],
        vocab_size: usize,
        dtype: DType,
        checkpoint: bool,
        metadata: HashMap<String, String>,
    ) -> Result<(), TrainError> {
        std::fs::create_dir_all(dir).map_err(|e| TrainError::Io(dir.display().to_string(), e))?;
        let s = &self.shape;
        let ids: Vec<String> = s.layers.iter().map(|l| (l.max(&1) - 1).to_string()).collect();
        let config = format!(
            "{{\"architectures\": [\"LlamaForCausalLMEagle3\"], \"hidden_size\": {}, \"num_attention_heads\": {}, \
             \"num_key_value_heads\": {}, \"head_dim\": {}, \"intermediate_size\": {}, \"rms_norm_eps\": {}, \
             \"rope_theta\": {}, \"draft_vocab_size\": {}, \"vocab_size\": {vocab_size}, \"eagle_config\": \
             {{\"eagle_aux_hidden_state_layer_ids\": [{}]}}}}\n",
            s.d,
            s.n_head,
            s.n_head_kv,
            s.head_dim,
            s.ff,
            self.eps,
            self.rope_theta,
            s.vocab,
            ids.join(", ")
        );
        let config_path = dir.join("config.json");
        std::fs::write(&config_path, config).map_err(|e| TrainError::Io(config_path.display().to_string(), e))?;
        let mut blobs: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for (i, (name, var)) in self.vars.iter().enumerate() {
            let mut t = var.as_tensor().clone();
            if i == 0 && !checkpoint {
                t = t.broadcast_mul(&self.in_scale.unsqueeze(0)?)?;
            }
            blobs.push(crate::head::tensor_blob(name, &t, dtype)?);
        }
        if checkpoint {
            blobs.push(crate::head::tensor_blob(NAMES[13], &self.in_scale, DType::F32)?);
        }
        crate::head::write_head_file(&dir.join("model.safetensors"), blobs, d2t, metadata)
    }

    /// Loads a checkpoint written by [`Eagle3Net::save`] into this net (shapes must match); returns its metadata
    /// and `d2t`.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<(HashMap<String, String>, Vec<u32>), TrainError> {
        let path = dir.join("model.safetensors");
        let bytes = std::fs::read(&path).map_err(|e| TrainError::Io(path.display().to_string(), e))?;
        let fmt = |e: safetensors::SafeTensorError| TrainError::Format(format!("{}: {e}", path.display()));
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(fmt)?;
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(fmt)?;
        let floats = |name: &str, dims: &[usize]| -> Result<Tensor, TrainError> {
            let view = st.tensor(name).map_err(fmt)?;
            if view.shape() != dims {
                return Err(TrainError::Format(format!(
                    "{}: `{name}` has shape {:?}, expected {dims:?}",
                    path.display(),
                    view.shape()
                )));
            }
            let v: Vec<f32> = view.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            Ok(Tensor::from_vec(v, dims, &Device::Cpu)?)
        };
        for (name, var) in &self.vars {
            var.set(&floats(name, var.dims())?)?;
        }
        self.in_scale = floats(NAMES[13], self.in_scale.dims())?;
        let d2t = st.tensor("d2t").map_err(fmt)?;
        let d2t = d2t
            .data()
            .chunks_exact(8)
            .enumerate()
            .map(|(j, c)| (j as i64 + i64::from_le_bytes(c.try_into().unwrap())) as u32)
            .collect();
        Ok((header.metadata().clone().unwrap_or_default(), d2t))
    }
}

/// RMS of each fused dimension over (up to 20,000 rows of) `data`.
fn aux_rms(data: &DraftData) -> Vec<f32> {
    let w = data.aux_width;
    let mut sum = vec![0f64; w];
    let mut row = vec![0f32; w];
    let rows: Vec<usize> =
        (0..data.n_sequences()).flat_map(|s| data.sequence(s).start..data.sequence(s).end - 1).collect();
    let stride = (rows.len() / 20_000).max(1);
    let mut n = 0usize;
    for &i in rows.iter().step_by(stride) {
        data.aux_row(i, &mut row);
        sum.iter_mut().zip(&row).for_each(|(s, &x)| *s += (x as f64) * (x as f64));
        n += 1;
    }
    sum.iter().map(|s| ((s / n.max(1) as f64).sqrt() as f32).max(1e-3)).collect()
}

/// Groups sequences (those with at least 3 tokens) into batches of similar length, at most `budget` rows each.
fn plan_batches(data: &DraftData, budget: usize) -> Vec<Vec<usize>> {
    let mut seqs: Vec<usize> = (0..data.n_sequences()).filter(|&s| data.sequence(s).len() >= 3).collect();
    seqs.sort_by_key(|&s| (data.sequence(s).len(), s));
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    for s in seqs {
        let t = data.sequence(s).len() - 1;
        if !cur.is_empty() && (cur.len() + 1) * t > budget {
            out.push(std::mem::take(&mut cur));
        }
        cur.push(s);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Builds the batch of sequences `seqs`: row `i` of a sequence holds the fused rows at `i`; step `s` reads token
/// `i + 1 + s` and is labelled with token `i + 2 + s` where that exists and is in the draft vocabulary.
fn make_batch(
    table: &EmbTable,
    data: &DraftData,
    seqs: &[usize],
    t2d: &HashMap<u32, u32>,
    steps: usize,
) -> Result<(SeqBatch, RowMap), TrainError> {
    let dev = Device::Cpu;
    let b = seqs.len();
    let t = seqs.iter().map(|&s| data.sequence(s).len() - 1).max().unwrap_or(1);
    let w = data.aux_width;
    let mut aux = vec![0f32; b * t * w];
    let mut map = RowMap { seq: vec![usize::MAX; b * t], pos: vec![0; b * t] };
    for (r, &s) in seqs.iter().enumerate() {
        let range = data.sequence(s);
        for i in 0..range.len() - 1 {
            data.aux_row(range.start + i, &mut aux[(r * t + i) * w..(r * t + i + 1) * w]);
            map.seq[r * t + i] = s;
            map.pos[r * t + i] = i;
        }
    }
    let mut batch = SeqBatch {
        b,
        t,
        aux: Tensor::from_vec(aux, (b * t, w), &dev)?,
        emb: Vec::new(),
        label: Vec::new(),
        mask: Vec::new(),
        causal: Tensor::from_vec(
            (0..t * t).map(|x| if x % t <= x / t { 0f32 } else { -1e9 }).collect::<Vec<f32>>(),
            (t, t),
            &dev,
        )?,
    };
    let d = data.d;
    for step in 0..steps {
        let (mut emb, mut label, mut mask) = (vec![0f32; b * t * d], vec![0u32; b * t], vec![0f32; b * t]);
        for (r, &s) in seqs.iter().enumerate() {
            let range = data.sequence(s);
            for i in 0..range.len() - 1 {
                let at = |k: usize| (range.start + k < range.end).then(|| data.tokens[range.start + k]);
                // Past the sequence's end (later steps of its last rows) any token will do: the row is unlabelled.
                let token = at(i + 1 + step).unwrap_or(data.tokens[range.end - 1]);
                emb[(r * t + i) * d..(r * t + i + 1) * d].copy_from_slice(table.row(token));
                if let Some(j) = at(i + 2 + step).and_then(|tok| t2d.get(&tok)) {
                    label[r * t + i] = *j;
                    mask[r * t + i] = 1.0;
                }
            }
        }
        batch.emb.push(Tensor::from_vec(emb, (b * t, d), &dev)?);
        batch.label.push(Tensor::from_vec(label, b * t, &dev)?);
        batch.mask.push(Tensor::from_vec(mask, b * t, &dev)?);
    }
    Ok((batch, map))
}

/// Held-out acceptance, as [`crate::train_draft`] reports it: over rows whose first label (token `i + 2`) the
/// model generated and that have room for two steps.
fn evaluate(
    net: &Eagle3Net,
    table: &EmbTable,
    data: &DraftData,
    t2d: &HashMap<u32, u32>,
) -> Result<(Acceptance, f64), TrainError> {
    let (mut total, mut top1, mut top3, mut both) = (0usize, 0usize, 0usize, 0usize);
    let (mut loss_sum, mut batches) = (0f64, 0usize);
    for seqs in plan_batches(data, 4096) {
        let (batch, map) = make_batch(table, data, &seqs, t2d, 2)?;
        let logits = net.unroll(&batch, 2)?;
        let loss = ((cross_entropy(&logits[0], &batch.label[0], &batch.mask[0])?
            + cross_entropy(&logits[1], &batch.label[1], &batch.mask[1])?)?
            / 2.0)?;
        loss_sum += loss.to_scalar::<f32>()? as f64;
        batches += 1;
        let (l0, l1) = (logits[0].to_vec2::<f32>()?, logits[1].to_vec2::<f32>()?);
        let (lab0, lab1) = (batch.label[0].to_vec1::<u32>()?, batch.label[1].to_vec1::<u32>()?);
        let (m0, m1) = (batch.mask[0].to_vec1::<f32>()?, batch.mask[1].to_vec1::<f32>()?);
        for r in 0..map.seq.len() {
            let s = map.seq[r];
            if s == usize::MAX {
                continue;
            }
            let range = data.sequence(s);
            let i = range.start + map.pos[r];
            if i + 3 >= range.end || i + 2 < data.generated_from(s) {
                continue;
            }
            total += 1;
            let best = |row: &[f32]| (0..row.len()).max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a))).unwrap();
            let ok0 = m0[r] > 0.0 && best(&l0[r]) as u32 == lab0[r];
            let rank = l0[r].iter().filter(|&&v| v > l0[r][lab0[r] as usize]).count();
            top1 += ok0 as usize;
            top3 += (m0[r] > 0.0 && rank < 3) as usize;
            both += (ok0 && m1[r] > 0.0 && best(&l1[r]) as u32 == lab1[r]) as usize;
        }
    }
    if total == 0 {
        return Err(TrainError::Invalid("held-out data has no generated tokens (chat records)".into()));
    }
    let acc = Acceptance {
        top1: top1 as f64 / total as f64,
        top3: top3 as f64 / total as f64,
        top1_step2: if top1 > 0 { both as f64 / top1 as f64 } else { 0.0 },
    };
    Ok((acc, loss_sum / batches.max(1) as f64))
}

/// The target's final-norm weights (its final norm of a vector of ones).
fn output_norm(model: &model::Model) -> Vec<f32> {
    let d = model.config.n_embd;
    let mut out = vec![0f32; d];
    model.final_norm(&vec![1.0; d], &mut out);
    let fix = (1.0 + model.config.rms_eps).sqrt();
    out.iter().map(|v| v * fix).collect()
}

/// The EAGLE-3 head's side of [`run_epochs`]: batches of whole sequences, shuffled as batches.
struct Eagle3Trainee<'a, S> {
    net: &'a Eagle3Net,
    opt: AdamW,
    batches: Vec<Vec<usize>>,
    steps: usize,
    seed: u64,
    train: &'a DraftData,
    heldout: &'a DraftData,
    t2d: &'a HashMap<u32, u32>,
    table: &'a EmbTable,
    save: S,
}

impl<S: FnMut(usize) -> Result<(), TrainError>> Trainee for Eagle3Trainee<'_, S> {
    fn batches(&self) -> usize {
        self.batches.len()
    }
    fn shuffle(&mut self, epoch: usize) {
        shuffle_for_epoch(&mut self.batches, self.seed, epoch);
    }
    fn train_batch(&mut self, i: usize, lr: f64) -> Result<f64, TrainError> {
        self.opt.set_learning_rate(lr);
        let (batch, _) = make_batch(self.table, self.train, &self.batches[i], self.t2d, self.steps)?;
        let logits = self.net.unroll(&batch, self.steps)?;
        let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu)?;
        for (s, l) in logits.iter().enumerate() {
            loss = (loss + cross_entropy(l, &batch.label[s], &batch.mask[s])?)?;
        }
        let loss = (loss / self.steps as f64)?;
        self.opt.backward_step(&loss)?;
        Ok(loss.to_scalar::<f32>()? as f64)
    }
    fn evaluate(&mut self) -> Result<(Acceptance, f64), TrainError> {
        evaluate(self.net, self.table, self.heldout, self.t2d)
    }
    fn checkpoint(&mut self, epoch: usize) -> Result<(), TrainError> {
        (self.save)(epoch)
    }
}

/// Trains an EAGLE-3-style head for `model` on `train` (its aux rows are the inputs of `layers`), evaluating on
/// `heldout` after every epoch, and writes it to the folder `out` (published layout, F16).
pub fn train_eagle3(
    model: &model::Model,
    train: &DraftData,
    heldout: &DraftData,
    layers: &[usize],
    out: &Path,
    opts: &Eagle3Options,
    mut metadata: HashMap<String, String>,
) -> Result<crate::TrainReport, TrainError> {
    let c = &model.config;
    let d = c.n_embd;
    if layers.len() != 3 || layers.iter().any(|&l| l == 0 || l > c.n_layers) {
        return Err(TrainError::Invalid(format!(
            "an EAGLE-3 head fuses the inputs of 3 target layers in 1..={} (got {layers:?})",
            c.n_layers
        )));
    }
    if train.d != d || heldout.d != d || train.aux_width != 3 * d || heldout.aux_width != 3 * d {
        return Err(TrainError::Invalid(format!(
            "the data must carry the model's features and 3 fused rows of width {d} (has {} / {} aux floats)",
            train.aux_width, heldout.aux_width
        )));
    }
    if opts.n_head == 0 || opts.n_head_kv == 0 || opts.n_head % opts.n_head_kv != 0 || d % opts.n_head != 0 {
        return Err(TrainError::Invalid(format!(
            "{} heads / {} KV heads do not fit hidden size {d}",
            opts.n_head, opts.n_head_kv
        )));
    }
    if (d / opts.n_head) % 2 != 0 {
        return Err(TrainError::Invalid("the head dimension must be even (RoPE)".into()));
    }
    let start = Instant::now();
    let vocab = draft_vocabulary(train, opts.vocab);
    let t2d: HashMap<u32, u32> = vocab.iter().enumerate().map(|(j, &t)| (t, j as u32)).collect();
    let mut head_rows = vec![0f32; vocab.len() * d];
    for (j, &t) in vocab.iter().enumerate() {
        model.head_row(t, &mut head_rows[j * d..(j + 1) * d])?;
    }
    let shape = Eagle3Shape {
        d,
        n_head: opts.n_head,
        n_head_kv: opts.n_head_kv,
        head_dim: d / opts.n_head,
        ff: opts.ff,
        vocab: vocab.len(),
        layers: layers.to_vec(),
    };
    let rope_theta = c.rope_base;
    let mut net = Eagle3Net::new(
        shape,
        c.rms_eps as f64,
        rope_theta,
        &head_rows,
        &output_norm(model),
        &aux_rms(train),
        opts.seed,
    )?;
    let mut first_epoch = 0;
    if opts.checkpoint.join("model.safetensors").exists() {
        first_epoch = resumed_epoch(&opts.checkpoint, net.load_checkpoint(&opts.checkpoint)?, &vocab)?;
    }
    let table = EmbTable::new(model, &[train, heldout])?;
    let batches = plan_batches(train, opts.batch_tokens);
    let positions: usize = batches.iter().flatten().map(|&s| train.sequence(s).len() - 1).sum();
    if batches.is_empty() {
        return Err(TrainError::Invalid("no training sequences (too short?)".into()));
    }
    let opt = AdamW::new(net.vars(), ParamsAdamW { lr: opts.lr, weight_decay: 0.0, ..Default::default() })?;
    let (before, before_loss) = evaluate(&net, &table, heldout, &t2d)?;
    let what = format!(
        "EAGLE-3 head, layers {layers:?}, draft vocabulary {} tokens; {positions} training rows in {} batches",
        vocab.len(),
        batches.len()
    );
    report_start(&what, &before, before_loss);
    let schedule = Schedule { lr: opts.lr, lr_end: opts.lr_end, epochs: opts.epochs, progress: opts.progress };
    let mut trainee = Eagle3Trainee {
        net: &net,
        opt,
        batches,
        steps: opts.steps,
        seed: opts.seed,
        train,
        heldout,
        t2d: &t2d,
        table: &table,
        save: |epoch: usize| {
            let meta = HashMap::from([("epoch".to_string(), (epoch + 1).to_string())]);
            net.save(&opts.checkpoint, &vocab, c.vocab_size, DType::F32, true, meta)
        },
    };
    let last = run_epochs(&schedule, first_epoch, before, start, &mut trainee)?;
    let settings = format!(
        "vocab={} ff={} heads={}/{} batch_tokens={} lr={} lr_end={} steps={} seed={}",
        opts.vocab,
        opts.ff,
        opts.n_head,
        opts.n_head_kv,
        opts.batch_tokens,
        opts.lr,
        opts.lr_end,
        opts.steps,
        opts.seed
    );
    record_training(&mut metadata, opts.epochs, positions, &last, settings);
    net.save(out, &vocab, c.vocab_size, DType::F16, false, metadata)?;
    Ok(crate::TrainReport {
        epochs_run: opts.epochs.saturating_sub(first_epoch),
        train_positions: positions,
        heldout: last,
        seconds: start.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use decode::speculative::tree::{DraftTree, TreeConfig};
    use decode::speculative::{DraftContext, Proposer, PublishedHead, PublishedProposer};

    /// Sequences where each next token follows from the previous one, with noise as the three fused rows: a head
    /// learns the next token from its token input.
    fn synthetic(model: &model::Model, n_seq: usize, len: usize, seed: u64) -> DraftData {
        crate::tests::with_noise_aux(crate::tests::synthetic(model, n_seq, len, seed), 3, seed + 100)
    }

    /// Logits of step 1 and step 2 at row `i` of the one sequence of `seq`, by target token (candle, the F32
    /// net).
    fn candle_logits(
        net: &Eagle3Net,
        model: &model::Model,
        seq: &DraftData,
        i: usize,
        d2t: &[u32],
    ) -> Vec<HashMap<u32, f32>> {
        let t2d: HashMap<u32, u32> = d2t.iter().enumerate().map(|(j, &t)| (t, j as u32)).collect();
        let table = EmbTable::new(model, &[seq]).unwrap();
        let (batch, _) = make_batch(&table, seq, &[0], &t2d, 2).unwrap();
        let logits = net.unroll(&batch, 2).unwrap();
        (0..2)
            .map(|s| {
                let row = logits[s].get(i).unwrap().to_vec1::<f32>().unwrap();
                row.iter().enumerate().map(|(j, &l)| (d2t[j], l)).collect()
            })
            .collect()
    }

    #[test]
    fn eagle3_heads_train_resume_and_run_as_trained_in_the_published_proposer() {
        let model = model::testing::tiny_model("llama", None, 3, 64);
        let (train, heldout) = (synthetic(&model, 120, 20, 1), synthetic(&model, 8, 20, 2));
        let dir = std::env::temp_dir().join(format!("specee-train-eagle3-{}", std::process::id()));
        let out = dir.join("head");
        let opts = Eagle3Options {
            vocab: 64,
            ff: 48,
            n_head: 4,
            n_head_kv: 2,
            epochs: 3,
            batch_tokens: 19,
            lr: 1e-2,
            lr_end: 0.1,
            steps: 2,
            seed: 1,
            checkpoint: dir.join("ckpt"),
            progress: false,
        };
        let layers = [1, 2, 3];
        assert!(matches!(
            train_eagle3(&model, &train, &heldout, &[1, 2], &out, &opts, HashMap::new()),
            Err(TrainError::Invalid(_))
        ));
        let report = train_eagle3(&model, &train, &heldout, &layers, &out, &opts, HashMap::new()).unwrap();
        assert_eq!(report.epochs_run, 3);
        assert!(report.heldout.top1 > 0.9, "held-out top-1 {}", report.heldout.top1);
        assert!(report.heldout.top1_step2 > 0.9, "held-out step-2 top-1 {}", report.heldout.top1_step2);
        let more = Eagle3Options { epochs: 4, ..opts.clone() };
        assert_eq!(train_eagle3(&model, &train, &heldout, &layers, &out, &more, HashMap::new()).unwrap().epochs_run, 1);

        // Random weights (a trained head would answer from the token alone), then the written folder, run by the
        // published proposer (Q8_0, its own attention cache), must draft what the F32 candle net drafts: step 1
        // at the root's row and step 2 below it, at every prefix length of a held-out sequence.
        let vocab = draft_vocabulary(&train, 64);
        let shape = Eagle3Shape {
            d: 32,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 8,
            ff: 48,
            vocab: vocab.len(),
            layers: layers.to_vec(),
        };
        let ones = vec![1.0; 96];
        let mut net = Eagle3Net::new(
            shape,
            model.config.rms_eps as f64,
            model.config.rope_base,
            &vec![0.0; vocab.len() * 32],
            &ones[..32],
            &ones,
            5,
        )
        .unwrap();
        net.load_checkpoint(&opts.checkpoint).unwrap();
        let mut rng = Lcg(7);
        for (i, var) in net.vars().iter().enumerate() {
            // Norm weights around 1; projections small enough that attention stays soft (a near one-hot softmax
            // would turn Q8_0 rounding into different drafts).
            let (scale, mean) = match i {
                1 | 2 | 7 | 11 => (0.3, 1.0),
                3..=5 => (0.1, 0.0),
                12 => (0.5, 0.0),
                _ => (0.2, 0.0),
            };
            let values: Vec<f32> = (0..var.elem_count()).map(|_| rng.normal() * scale + mean).collect();
            var.set(&Tensor::from_vec(values, var.dims(), &Device::Cpu).unwrap()).unwrap();
        }
        let random = dir.join("random");
        net.save(&random, &vocab, 64, DType::F32, false, HashMap::new()).unwrap();
        let head = PublishedHead::load(&random).unwrap();
        let pool = kernels::ThreadPool::new(1);
        let (mut worst, mut exact, mut total) = (0f32, 0, 0);
        let pairs: Vec<(std::ops::Range<usize>, usize)> =
            (0..8).flat_map(|s| (3..19).map(move |n| (s, n))).map(|(s, n)| (heldout.sequence(s), n)).collect();
        for (seq_range, n) in pairs {
            let mut proposer = PublishedProposer::new(
                head.clone(),
                &model,
                TreeConfig { depth: 2, top_k: 1, budget: 2, min_prob: 0.0 },
            )
            .unwrap();
            let tokens = &heldout.tokens[seq_range.start..seq_range.start + n];
            let mut features = vec![0f32; (n - 1) * 96];
            for i in 0..n - 1 {
                heldout.aux_row(seq_range.start + i, &mut features[i * 96..(i + 1) * 96]);
            }
            let ctx = DraftContext {
                model: &model,
                pool: &pool,
                tokens,
                features: &features,
                feature_width: 96,
                stable_prefix: 0,
            };
            let mut tree = DraftTree::new(tokens[n - 1]);
            proposer.propose(&ctx, &mut tree).unwrap();
            let drafted: Vec<u32> = tree.nodes()[1..].iter().map(|node| node.token).collect();
            assert_eq!(drafted.len(), 2);
            // The candle side: the sequence up to the root, then the drafted first token, then anything.
            let mut seq = DraftData { d: 32, aux_width: 96, ..Default::default() };
            let mut toks = tokens.to_vec();
            toks.extend([drafted[0], 0]);
            let mut aux: Vec<u16> = heldout.aux[seq_range.start * 96..(seq_range.start + n - 1) * 96].to_vec();
            aux.resize((n + 2) * 96, 0);
            seq.push(&toks, &vec![0.0; (n + 1) * 32], 0);
            seq.aux = aux;
            // Each drafted token must be candle's best or within Q8_0 rounding of it (logits are ~5 here; a wrong
            // position, key set or input moves them by whole units).
            for (step, logits) in candle_logits(&net, &model, &seq, n - 2, &vocab).iter().enumerate() {
                let best = logits.values().copied().fold(f32::NEG_INFINITY, f32::max);
                let short = best - logits[&drafted[step]];
                worst = worst.max(short);
                exact += (short == 0.0) as usize;
                total += 1;
            }
        }
        assert!(worst < 0.2, "a drafted token's logit is {worst} below candle's best");
        assert!(exact * 10 >= total * 9, "only {exact} of {total} drafts are candle's best");
        std::fs::remove_dir_all(&dir).ok();
    }
}
