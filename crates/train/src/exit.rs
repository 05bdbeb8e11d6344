//! Training SpecEE's per-layer exit predictors (../shared/DESIGN.md §4.7).
//!
//! 1. **Collect** ([`collect_exit`]): the model decodes at full depth ([`SpecEeDecoder::step_trace`]) — its own
//!    greedy answers to chat prompts, or texts teacher-forced — and after every layer we keep the logits of the
//!    draft head's [`CANDIDATES`] tokens (computed exactly as at inference: final norm, four head rows). The
//!    label of (token, layer) is whether the best candidate at that layer is the model's final top-1: then
//!    exiting there with the best candidate emits what dense decoding would. The last layer has a predictor
//!    too: there it decides whether the full-vocabulary head can be skipped (label: the top-1 is a candidate).
//! 2. **Train** ([`train_exit`]): one `12 → hidden → 1` MLP per layer, binary cross-entropy, Adam. The delta
//!    features compare against the previous *evaluated* layer, which at inference is whatever the schedule ran
//!    before: each training sample draws that gap (1–`max_gap` layers back, or none = first evaluated layer).
//!    Validation: every fifth record (by record index), never trained on.
//! 3. **Schedule** ([`choose_schedule`]): simulate exits on the validation tokens with every predictor active;
//!    the offline set is the layers where most exits happen; the unverified threshold is the lowest that keeps
//!    simulated agreement with dense at or above the target.

use crate::data::{CollectOptions, Record};
use crate::head::Lcg;
use crate::TrainError;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use decode::specee::predictor::features;
use decode::specee::{
    ExitPredictors, Mlp, ScheduleConfig, SpecEeConfig, SpecEeDecoder, CANDIDATES, DRAFT_FEATURES, FEATURE_COUNTS,
    MAX_FEATURES, UPDATE_FEATURES,
};
use decode::speculative::DraftHead;
use engine::Engine;
use std::path::Path;

/// Traced decoding steps: per token, the candidates' logits after every layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExitData {
    /// Layers of the model.
    pub n_layers: usize,
    /// `tokens × n_layers × CANDIDATES` logits.
    pub s: Vec<f32>,
    /// `tokens × n_layers × UPDATE_FEATURES`: each layer's `layer_update` (empty in traces from before it
    /// existed; then only 12- and 16-feature predictors can be trained).
    pub upd: Vec<f32>,
    /// `tokens × CANDIDATES` candidate ids.
    pub cand: Vec<u32>,
    /// `tokens × CANDIDATES` draft log-probabilities of the candidates.
    pub cand_lp: Vec<f32>,
    /// The model's full-depth top-1 for each token.
    pub target: Vec<u32>,
    /// Index of the record each token came from.
    pub group: Vec<u32>,
}

impl ExitData {
    /// Traced tokens.
    pub fn len(&self) -> usize {
        self.target.len()
    }

    pub fn is_empty(&self) -> bool {
        self.target.is_empty()
    }

    /// Layers with a predictor (all of them; the last one's decides whether to skip the full head).
    pub fn n_pred(&self) -> usize {
        self.n_layers
    }

    /// Candidate logits of token `t` after layer `l`.
    pub fn logits(&self, t: usize, l: usize) -> &[f32; CANDIDATES] {
        let i = (t * self.n_pred() + l) * CANDIDATES;
        self.s[i..i + CANDIDATES].try_into().expect("CANDIDATES floats")
    }

    /// The candidate emitted by an exit of token `t` after layer `l` (the best candidate there).
    pub fn best(&self, t: usize, l: usize) -> u32 {
        let s = self.logits(t, l);
        let j = (0..CANDIDATES).fold(0, |b, j| if s[j] > s[b] { j } else { b });
        self.cand[t * CANDIDATES + j]
    }

    /// Layer `l`'s update for token `t` (`[1, 0]`, "no change", in traces without updates).
    pub fn update(&self, t: usize, l: usize) -> [f32; UPDATE_FEATURES] {
        let i = (t * self.n_pred() + l) * UPDATE_FEATURES;
        self.upd.get(i..i + UPDATE_FEATURES).map_or([1.0, 0.0], |u| u.try_into().expect("UPDATE_FEATURES floats"))
    }

    /// Draft log-probabilities of token `t`'s candidates.
    pub fn draft_lp(&self, t: usize) -> &[f32; CANDIDATES] {
        self.cand_lp[t * CANDIDATES..(t + 1) * CANDIDATES].try_into().expect("CANDIDATES floats")
    }

    /// Whether exiting token `t` after layer `l` emits the dense top-1.
    pub fn label(&self, t: usize, l: usize) -> bool {
        self.best(t, l) == self.target[t]
    }

    /// Whether token `t`'s dense top-1 is among its candidates at all.
    pub fn reachable(&self, t: usize) -> bool {
        self.cand[t * CANDIDATES..(t + 1) * CANDIDATES].contains(&self.target[t])
    }

    /// Whether token `t` belongs to the validation split (every fifth record).
    pub fn is_validation(&self, t: usize) -> bool {
        self.group[t].is_multiple_of(5)
    }

    /// Appends `other` (a trace of another record file of the same model) after this one. Its record indices
    /// (`group`) start at the next multiple of 5 past this trace's last record, so each file keeps its own
    /// validation split (its every fifth record), as when it was traced alone.
    pub fn append(&mut self, other: &ExitData) -> Result<(), TrainError> {
        if self.is_empty() {
            *self = other.clone();
            return Ok(());
        }
        if other.is_empty() {
            return Ok(());
        }
        if other.n_layers != self.n_layers || other.upd.is_empty() != self.upd.is_empty() {
            return Err(TrainError::Format(format!(
                "traces do not fit together: {} layers{} against {} layers{}",
                self.n_layers,
                if self.upd.is_empty() { " without layer updates" } else { "" },
                other.n_layers,
                if other.upd.is_empty() { " without layer updates" } else { "" },
            )));
        }
        let next = self.group.iter().max().map_or(0, |&g| g + 1);
        let offset = next.div_ceil(5) * 5;
        self.s.extend_from_slice(&other.s);
        self.upd.extend_from_slice(&other.upd);
        self.cand.extend_from_slice(&other.cand);
        self.cand_lp.extend_from_slice(&other.cand_lp);
        self.target.extend_from_slice(&other.target);
        self.group.extend(other.group.iter().map(|&g| g + offset));
        Ok(())
    }

    /// Writes the trace as safetensors, with the key of what it was traced from ([`crate::cache`]).
    pub fn save(&self, path: &Path, key: &crate::cache::CacheKey) -> Result<(), TrainError> {
        use safetensors::tensor::TensorView;
        use safetensors::Dtype;
        let t = self.len();
        let bytes_f32: Vec<u8> = self.s.iter().flat_map(|v| v.to_le_bytes()).collect();
        let lp: Vec<u8> = self.cand_lp.iter().flat_map(|v| v.to_le_bytes()).collect();
        let upd: Vec<u8> = self.upd.iter().flat_map(|v| v.to_le_bytes()).collect();
        let u32s = |v: &[u32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let (cand, target, group) = (u32s(&self.cand), u32s(&self.target), u32s(&self.group));
        let err = |e: safetensors::SafeTensorError| TrainError::Format(e.to_string());
        let mut views = vec![
            ("s", TensorView::new(Dtype::F32, vec![t, self.n_pred(), CANDIDATES], &bytes_f32).map_err(err)?),
            ("cand", TensorView::new(Dtype::U32, vec![t, CANDIDATES], &cand).map_err(err)?),
            ("cand_lp", TensorView::new(Dtype::F32, vec![t, CANDIDATES], &lp).map_err(err)?),
            ("target", TensorView::new(Dtype::U32, vec![t], &target).map_err(err)?),
            ("group", TensorView::new(Dtype::U32, vec![t], &group).map_err(err)?),
        ];
        if !self.upd.is_empty() {
            views.push((
                "upd",
                TensorView::new(Dtype::F32, vec![t, self.n_pred(), UPDATE_FEATURES], &upd).map_err(err)?,
            ));
        }
        let mut meta = key.to_metadata();
        meta.insert("n_layers".to_string(), self.n_layers.to_string());
        safetensors::serialize_to_file(views, Some(meta), path).map_err(err)
    }

    pub fn load(path: &Path) -> Result<ExitData, TrainError> {
        let bytes = std::fs::read(path).map_err(|e| TrainError::Io(path.display().to_string(), e))?;
        let bad = |why: String| TrainError::Format(format!("{}: {why}", path.display()));
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| bad(e.to_string()))?;
        let n_layers = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get("n_layers"))
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad("no n_layers".into()))?;
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
        let raw = |name: &str| -> Result<Vec<[u8; 4]>, TrainError> {
            let t = st.tensor(name).map_err(|_| bad(format!("no tensor {name}")))?;
            Ok(t.data().chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]).collect())
        };
        let data = ExitData {
            n_layers,
            s: raw("s")?.into_iter().map(f32::from_le_bytes).collect(),
            upd: if st.names().contains(&"upd") {
                raw("upd")?.into_iter().map(f32::from_le_bytes).collect()
            } else {
                Vec::new()
            },
            cand: raw("cand")?.into_iter().map(u32::from_le_bytes).collect(),
            cand_lp: raw("cand_lp")?.into_iter().map(f32::from_le_bytes).collect(),
            target: raw("target")?.into_iter().map(u32::from_le_bytes).collect(),
            group: raw("group")?.into_iter().map(u32::from_le_bytes).collect(),
        };
        let t = data.len();
        if data.s.len() != t * data.n_pred() * CANDIDATES
            || data.cand.len() != t * CANDIDATES
            || data.cand_lp.len() != t * CANDIDATES
            || data.group.len() != t
            || !(data.upd.is_empty() || data.upd.len() == t * data.n_pred() * UPDATE_FEATURES)
        {
            return Err(bad("tensor sizes disagree".into()));
        }
        Ok(data)
    }
}

/// Traces the model over `records` (see the module header), calling `progress(done, tokens)` after each.
/// Chat records are answered greedily (at most `max_new` tokens, stopping at end of generation); texts are
/// teacher-forced after their first 16 tokens (at most `max_input` tokens). With `perfect_head` every record is
/// traced twice, the second time with each step's dense top-1 forced among the candidates
/// ([`SpecEeDecoder::force_candidate`]): the data of a perfect draft head, whose [`oracle`] is the ceiling of
/// early exit on the model whatever head gives the candidates. With `keep_states = Some((from, out))`, `out`
/// receives the normed hidden state after every layer from `from` on of every traced token, in f16 (tokens ×
/// layers × `n_embd`, in trace order; [`SpecEeDecoder::keep_states`]).
pub fn collect_exit(
    engine: &Engine,
    head: &DraftHead,
    records: &[Record],
    opts: CollectOptions,
    perfect_head: bool,
    keep_states: Option<(usize, &mut Vec<half::f16>)>,
    mut progress: impl FnMut(usize, usize),
) -> Result<ExitData, TrainError> {
    let model = &engine.model;
    let n_layers = model.config.n_layers;
    let ctx = opts.max_input + opts.max_new + 8;
    let predictors = ExitPredictors::empty(n_layers);
    let mut dec = SpecEeDecoder::new(model, ctx, opts.threads, head, &predictors, SpecEeConfig::default());
    let mut data = ExitData { n_layers, ..Default::default() };
    dec.keep_states(keep_states.as_ref().map(|(from, _)| *from));
    for (i, record) in records.iter().enumerate() {
        let (mut ids, chat) = match record {
            Record::Chat(messages) => (engine.tokenize_prompt(&crate::data::render_chat(engine, messages)?), true),
            Record::Text(text) => (engine.tokenize_prompt(text), false),
        };
        ids.truncate(opts.max_input);
        let prompt_len = if chat { ids.len() } else { 16.min(ids.len()) };
        if prompt_len < 2 || (!chat && ids.len() <= prompt_len) {
            progress(i + 1, data.len());
            continue;
        }
        let mut trace = |data: &mut ExitData, forced: Option<&[u32]>| -> Result<(), TrainError> {
            dec.reset();
            let mut next = dec.feed(&ids[..prompt_len])?;
            let steps = if chat { opts.max_new } else { ids.len() - prompt_len };
            for k in 0..steps {
                let token = if chat { next } else { ids[prompt_len + k] };
                if chat && engine.tokenizer.is_eog(token) {
                    break;
                }
                if let Some(&f) = forced.and_then(|f| f.get(k)) {
                    dec.force_candidate(f);
                }
                let step = dec.step_trace(token, &mut data.s, &mut data.upd)?;
                data.cand.extend_from_slice(&step.candidates);
                data.cand_lp.extend_from_slice(&step.draft_log_probs);
                data.target.push(step.token);
                data.group.push(i as u32);
                next = step.token;
            }
            Ok(())
        };
        if perfect_head {
            let mut dense = ExitData { n_layers, ..Default::default() };
            trace(&mut dense, None)?;
            trace(&mut data, Some(&dense.target))?;
        } else {
            trace(&mut data, None)?;
        }
        progress(i + 1, data.len());
    }
    if let Some((_, states)) = keep_states {
        *states = dec.take_states();
    }
    Ok(data)
}

/// Writes states kept by [`collect_exit`] as raw little-endian f16, streamed (a states file can be gigabytes: no
/// second copy as bytes).
pub fn save_states(path: &Path, states: &[half::f16]) -> Result<(), TrainError> {
    use std::io::Write;
    let io = |e| TrainError::Io(path.display().to_string(), e);
    let mut w = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    for v in states {
        w.write_all(&v.to_le_bytes()).map_err(io)?;
    }
    w.flush().map_err(io)
}

/// Temperatures tried by [`calibrate_temperatures`]: 0.25 to 16, log-spaced (ratio 2^(1/8)).
fn temperature_grid() -> Vec<f32> {
    (-16..=32).map(|k| 2f32.powf(k as f32 / 8.0)).collect()
}

/// Exact terms per row in [`RowNll`]; the rest of the vocabulary is binned.
const EXACT_TOP: usize = 256;
/// Bin width (in logits) and number of bins below the row's largest logit for the rest.
const BIN: f32 = 0.25;
const BINS: usize = 320;

/// One row of logits reduced to what `NLL(T) = logsumexp(z / T) − z_next / T` needs at any temperature: the
/// largest [`EXACT_TOP`] logits exactly and the rest as a histogram ([`BIN`]-wide bins below the largest, the
/// lowest bin holding everything further down), all relative to the largest logit.
struct RowNll {
    top: Vec<f32>,
    hist: Vec<u32>,
    next: f32,
}

impl RowNll {
    fn new(logits: &[f32], next: usize, scratch: &mut Vec<f32>) -> RowNll {
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &z| m.max(z));
        scratch.clear();
        scratch.extend(logits.iter().map(|&z| z - max));
        let k = EXACT_TOP.min(scratch.len());
        let cut = scratch.len() - k;
        if cut > 0 {
            scratch.select_nth_unstable_by(cut, |a, b| a.total_cmp(b));
        }
        let mut hist = vec![0u32; BINS];
        for &z in &scratch[..cut] {
            hist[((-z / BIN) as usize).min(BINS - 1)] += 1;
        }
        RowNll { top: scratch[cut..].to_vec(), hist, next: logits[next] - max }
    }

    fn nll(&self, t: f32) -> f64 {
        let inv = 1.0 / t as f64;
        let mut sum: f64 = self.top.iter().map(|&z| (z as f64 * inv).exp()).sum();
        for (b, &c) in self.hist.iter().enumerate().filter(|(_, &c)| c > 0) {
            sum += c as f64 * (-(b as f64 + 0.5) * BIN as f64 * inv).exp();
        }
        sum.ln() - self.next as f64 * inv
    }
}

/// Per-layer temperatures for exit logits ([`ExitPredictors::temperature`]): for every layer but the last, the
/// temperature from a log-spaced grid that minimizes the mean negative log-likelihood of the next token of
/// `records` (teacher-forced: texts from their 17th token, chat records over the model's own greedy answer,
/// generated here with at most `max_new` tokens) under the full-vocabulary logits read at that layer (final norm,
/// head). Intermediate layers' logits are badly over-confident (SmolLM2: 9–49 nats for tokens that cost dense 2),
/// which is what an exit reports for perplexity or samples from. Returns the temperatures (the last layer's is 1)
/// and, per layer, the mean NLL at temperature 1 and at the chosen one.
pub fn calibrate_temperatures(
    engine: &Engine,
    records: &[Record],
    opts: CollectOptions,
    mut progress: impl FnMut(usize, usize),
) -> Result<(Vec<f32>, Vec<(f64, f64)>), TrainError> {
    use model::{KvCache, Mask, Workspace};
    let model = &engine.model;
    let (d, v, n_layers) = (model.config.n_embd, model.config.vocab_size, model.config.n_layers);
    let grid = temperature_grid();
    let mut sums = vec![0f64; n_layers * grid.len()];
    let mut rows = 0usize;
    let mut dense = decode::DenseDecoder::new(model, opts.max_input + opts.max_new + 8, opts.threads);
    let mut ws = Workspace::new(opts.threads);
    let (mut hidden, mut normed, mut logits, mut scratch) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (i, record) in records.iter().enumerate() {
        let (mut ids, chat) = match record {
            Record::Chat(messages) => (engine.tokenize_prompt(&crate::data::render_chat(engine, messages)?), true),
            Record::Text(text) => (engine.tokenize_prompt(text), false),
        };
        ids.truncate(opts.max_input);
        let first = if chat { ids.len().saturating_sub(1) } else { 16 };
        if chat && ids.len() >= 2 {
            dense.reset();
            let mut next = decode::sampling::argmax(dense.feed(&ids)?);
            for _ in 0..opts.max_new {
                if engine.tokenizer.is_eog(next) {
                    break;
                }
                ids.push(next);
                next = decode::sampling::argmax(dense.feed(&[next])?);
            }
        }
        if ids.len() < first + 2 {
            progress(i + 1, rows);
            continue;
        }
        // Every layer over the whole sequence; the scored rows are those whose next token is known.
        let n = ids.len();
        let scored = first..n - 1;
        let m = scored.len();
        let positions: Vec<u32> = (0..n as u32).collect();
        let mut kv = KvCache::new(&model.config, n);
        hidden.resize(n * d, 0.0);
        model.embed(&ids, &mut hidden)?;
        normed.resize(m * d, 0.0);
        logits.resize(m * v, 0.0);
        for il in 0..n_layers - 1 {
            model.layer(il, &mut hidden, &positions, Mask::Causal, &mut kv, &mut ws)?;
            model.final_norm(&hidden[first * d..(n - 1) * d], &mut normed);
            model.head_full(&normed, m, &mut logits, &mut ws);
            for (r, j) in scored.clone().enumerate() {
                let row = RowNll::new(&logits[r * v..(r + 1) * v], ids[j + 1] as usize, &mut scratch);
                for (g, &t) in grid.iter().enumerate() {
                    sums[il * grid.len() + g] += row.nll(t);
                }
            }
        }
        rows += m;
        progress(i + 1, rows);
    }
    if rows == 0 {
        return Err(TrainError::Invalid("no record gave a scored position to calibrate on".into()));
    }
    let mut temps = vec![1.0; n_layers];
    let mut report = vec![(0.0, 0.0); n_layers];
    let unit = grid.iter().position(|&t| t == 1.0).expect("the grid holds 1");
    for il in 0..n_layers - 1 {
        let nll = &sums[il * grid.len()..(il + 1) * grid.len()];
        let best = (0..grid.len()).fold(unit, |b, g| if nll[g] < nll[b] { g } else { b });
        temps[il] = grid[best];
        report[il] = (nll[unit] / rows as f64, nll[best] / rows as f64);
    }
    Ok((temps, report))
}

/// Settings of [`train_exit`].
#[derive(Clone, Debug)]
pub struct ExitTrainOptions {
    /// Hidden units per predictor (512 as published).
    pub hidden: usize,
    pub epochs: usize,
    pub batch: usize,
    pub lr: f64,
    pub seed: u64,
    /// Largest gap (in layers) to the previously evaluated layer drawn for the delta features.
    pub max_gap: usize,
    /// Features per predictor: one of [`FEATURE_COUNTS`] (published 12; plus the draft's log-probs; plus the
    /// layer's update).
    pub n_features: usize,
    /// Train only on the training tokens of records with an index below this (0: all). The validation split
    /// stays every fifth record of all the data, so runs with different caps are compared on the same tokens.
    pub train_records: usize,
}

impl Default for ExitTrainOptions {
    fn default() -> Self {
        ExitTrainOptions {
            hidden: 512,
            epochs: 8,
            batch: 1024,
            lr: 1e-3,
            seed: 1,
            max_gap: 4,
            n_features: DRAFT_FEATURES,
            train_records: 0,
        }
    }
}

/// Validation figures of one layer's predictor at threshold 0.5.
#[derive(Clone, Copy, Debug, Default)]
pub struct LayerReport {
    pub layer: usize,
    /// Training samples.
    pub train: usize,
    /// Share of validation samples whose label is positive (exiting here would be right).
    pub positive_rate: f64,
    pub precision: f64,
    pub recall: f64,
}

/// The feature vector of token `t` at layer `l` with the previous evaluated layer `gap` layers back (0: none).
fn sample_features(data: &ExitData, t: usize, l: usize, gap: usize) -> [f32; MAX_FEATURES] {
    let q = data.draft_lp(t);
    let u = data.update(t, l);
    let prev = (gap > 0 && l >= gap).then(|| features(data.logits(t, l - gap), None, q, &u).1);
    features(data.logits(t, l), prev.as_ref(), q, &u).0
}

/// Mean binary cross-entropy of logits `z` against labels `y`, in the stable form
/// `max(z, 0) − z·y + ln(1 + e^−|z|)`. (candle's `binary_cross_entropy_with_logit` takes the log of a sigmoid, which
/// saturates on confident logits: ln 0 → NaN gradients, and a layer whose labels are nearly all one way ended up
/// never firing.)
pub(crate) fn bce_with_logits(z: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    let soft = (z.abs()?.neg()?.exp()? + 1.0)?.log()?;
    ((z.relu()? - (z * y)?)? + soft)?.mean_all()
}

/// Smallest standard deviation a feature is scaled by (a near-constant feature would otherwise get huge
/// folded weights and the predictor would extrapolate wildly on held-out values).
const MIN_STD: f32 = 0.05;

/// Mean and standard deviation (at least [`MIN_STD`]) of each of the `nf` feature columns.
pub(crate) fn column_stats(x: &[f32], nf: usize) -> (Vec<f32>, Vec<f32>) {
    let n = (x.len() / nf).max(1) as f64;
    let (mut sum, mut sq) = (vec![0f64; nf], vec![0f64; nf]);
    for row in x.chunks_exact(nf) {
        for f in 0..nf {
            sum[f] += row[f] as f64;
            sq[f] += (row[f] as f64).powi(2);
        }
    }
    let mut mean = vec![0f32; nf];
    let mut std = vec![0f32; nf];
    for f in 0..nf {
        let m = sum[f] / n;
        mean[f] = m as f32;
        std[f] = ((sq[f] / n - m * m).max(0.0).sqrt() as f32).max(MIN_STD);
    }
    (mean, std)
}

/// Trains one predictor per layer. `log` receives one line per layer.
pub fn train_exit(
    data: &ExitData,
    opts: &ExitTrainOptions,
    mut log: impl FnMut(&str),
) -> Result<(Vec<Option<Mlp>>, Vec<LayerReport>), TrainError> {
    if data.is_empty() {
        return Err(TrainError::Invalid("no traced tokens to train on".into()));
    }
    let dev = Device::Cpu;
    let (mut train_t, val_t): (Vec<usize>, Vec<usize>) = (0..data.len()).partition(|&t| !data.is_validation(t));
    if opts.train_records > 0 {
        train_t.retain(|&t| (data.group[t] as usize) < opts.train_records);
    }
    if train_t.is_empty() || val_t.is_empty() {
        return Err(TrainError::Invalid("need at least 5 records (every fifth is held out for validation)".into()));
    }
    let nf = opts.n_features;
    if !FEATURE_COUNTS.contains(&nf) {
        return Err(TrainError::Invalid(format!("features per predictor must be one of {FEATURE_COUNTS:?}")));
    }
    if nf == MAX_FEATURES && data.upd.is_empty() {
        return Err(TrainError::Invalid(format!(
            "{MAX_FEATURES} features need the layers' updates, which this trace (from an older version) lacks: \
             delete it to trace again, or train with fewer features"
        )));
    }
    let mut layers = vec![None; data.n_layers];
    let mut reports = Vec::new();
    let mut rng = Lcg(opts.seed);
    for l in 0..data.n_pred() {
        let gap = |rng: &mut Lcg| -> usize {
            if rng.uniform() < 0.2 {
                0
            } else {
                1 + (rng.next_u64() % opts.max_gap.max(1) as u64) as usize
            }
        };
        let build = |ts: &[usize], rng: &mut Lcg| -> (Vec<f32>, Vec<f32>) {
            let mut x = Vec::with_capacity(ts.len() * nf);
            let mut y = Vec::with_capacity(ts.len());
            for &t in ts {
                x.extend_from_slice(&sample_features(data, t, l, gap(rng))[..nf]);
                y.push(if data.label(t, l) { 1.0 } else { 0.0 });
            }
            (x, y)
        };
        let (mut xt, yt) = build(&train_t, &mut rng);
        let (xv, yv) = build(&val_t, &mut rng);
        // Standardize the features for training (raw logits are large and differ by layer), and fold the
        // scaling into the first layer afterwards so inference reads raw features.
        let (mean, std) = column_stats(&xt, nf);
        for x in xt.chunks_exact_mut(nf) {
            for f in 0..nf {
                x[f] = (x[f] - mean[f]) / std[f];
            }
        }
        let mut varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
        let l1 = candle_nn::linear(nf, opts.hidden, vb.pp("l1"))?;
        let l2 = candle_nn::linear(opts.hidden, 1, vb.pp("l2"))?;
        // Our own seeded initialization (uniform ±1/√fan_in, as candle's default) so training is reproducible.
        for (name, fan_in, shape) in [
            ("l1.weight", nf, vec![opts.hidden, nf]),
            ("l1.bias", nf, vec![opts.hidden]),
            ("l2.weight", opts.hidden, vec![1, opts.hidden]),
            ("l2.bias", opts.hidden, vec![1]),
        ] {
            let bound = 1.0 / (fan_in as f32).sqrt();
            let n: usize = shape.iter().product();
            let values: Vec<f32> = (0..n).map(|_| (rng.uniform() * 2.0 - 1.0) * bound).collect();
            varmap.set_one(name, Tensor::from_vec(values, shape, &dev)?)?;
        }
        let params = ParamsAdamW { lr: opts.lr, weight_decay: 0.0, ..Default::default() };
        let mut opt = AdamW::new(varmap.all_vars(), params)?;
        let n = yt.len();
        let mut order: Vec<usize> = (0..n).collect();
        for _ in 0..opts.epochs {
            for i in (1..n).rev() {
                order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            for chunk in order.chunks(opts.batch.max(1)) {
                let mut xb = Vec::with_capacity(chunk.len() * nf);
                let mut yb = Vec::with_capacity(chunk.len());
                for &i in chunk {
                    xb.extend_from_slice(&xt[i * nf..(i + 1) * nf]);
                    yb.push(yt[i]);
                }
                let x = Tensor::from_vec(xb, (chunk.len(), nf), &dev)?;
                let y = Tensor::from_vec(yb, chunk.len(), &dev)?;
                let z = l2.forward(&l1.forward(&x)?.relu()?)?.squeeze(1)?;
                let loss = bce_with_logits(&z, &y)?;
                opt.backward_step(&loss)?;
            }
        }
        let mut w1: Vec<f32> = l1.weight().flatten_all()?.to_vec1()?;
        let mut b1: Vec<f32> = l1.bias().expect("linear has a bias").to_vec1()?;
        for (w, b) in w1.chunks_exact_mut(nf).zip(b1.iter_mut()) {
            for f in 0..nf {
                w[f] /= std[f];
                *b -= w[f] * mean[f];
            }
        }
        let mlp = Mlp {
            n_in: nf,
            w1,
            b1,
            w2: l2.weight().flatten_all()?.to_vec1()?,
            b2: l2.bias().expect("linear has a bias").to_vec1::<f32>()?[0],
        };
        let (mut tp, mut fp, mut fn_) = (0usize, 0usize, 0usize);
        for (x, &y) in xv.chunks_exact(nf).zip(&yv) {
            let fire = mlp.predict(x) > 0.5;
            match (fire, y > 0.5) {
                (true, true) => tp += 1,
                (true, false) => fp += 1,
                (false, true) => fn_ += 1,
                _ => {}
            }
        }
        let ratio = |a: usize, b: usize| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let report = LayerReport {
            layer: l,
            train: n,
            positive_rate: ratio(yv.iter().filter(|&&y| y > 0.5).count(), yv.len()),
            precision: ratio(tp, tp + fp),
            recall: ratio(tp, tp + fn_),
        };
        log(&format!(
            "layer {l:>2}: {n} samples, validation: right-to-exit {:.3}, precision {:.3}, recall {:.3}",
            report.positive_rate, report.precision, report.recall
        ));
        reports.push(report);
        layers[l] = Some(mlp);
    }
    Ok((layers, reports))
}

/// The outcome of simulated exits at one threshold on the validation tokens (every predictor active, each
/// comparing against the layer before it).
#[derive(Clone, Debug, Default)]
pub struct Simulation {
    pub threshold: f32,
    /// Tokens that exited before the last layer.
    pub exit_rate: f64,
    /// Mean layers run per token.
    pub avg_layers: f64,
    /// Share of tokens whose emitted token equals dense top-1.
    pub agreement: f64,
    /// Exit counts per layer (index `n_layers − 1`: exit after the last layer without the full head; index
    /// `n_layers`: the full head ran).
    pub histogram: Vec<usize>,
}

/// Simulates exits of the validation tokens at `threshold` with `layers`' predictors.
pub fn simulate(data: &ExitData, layers: &[Option<Mlp>], threshold: f32) -> Simulation {
    let mut hist = vec![0usize; data.n_layers + 1];
    let (mut tokens, mut right, mut layer_sum) = (0usize, 0usize, 0usize);
    for t in (0..data.len()).filter(|&t| data.is_validation(t)) {
        tokens += 1;
        let mut exit = None;
        let mut prev: Option<[f32; CANDIDATES]> = None;
        for l in 0..data.n_pred() {
            let Some(mlp) = &layers[l] else { continue };
            let (x, p) = features(data.logits(t, l), prev.as_ref(), data.draft_lp(t), &data.update(t, l));
            prev = Some(p);
            if mlp.predict(&x) > threshold {
                exit = Some(l);
                break;
            }
        }
        match exit {
            Some(l) => {
                hist[l] += 1;
                layer_sum += l + 1;
                right += usize::from(data.label(t, l));
            }
            None => {
                hist[data.n_layers] += 1;
                layer_sum += data.n_layers;
                right += 1;
            }
        }
    }
    let per = |x: usize| if tokens == 0 { 0.0 } else { x as f64 / tokens as f64 };
    Simulation {
        threshold,
        exit_rate: per(tokens - hist[data.n_layers]),
        avg_layers: per(layer_sum),
        agreement: per(right),
        histogram: hist,
    }
}

/// The layer after which a perfect predictor exits token `t`: the earliest from which the best candidate stays the
/// dense top-1 through the last layer (`n_layers` when the top-1 is not a candidate: no exit).
fn oracle_exit(data: &ExitData, t: usize) -> usize {
    let mut exit = data.n_layers;
    for l in (0..data.n_pred()).rev() {
        if !data.label(t, l) {
            break;
        }
        exit = l;
    }
    exit
}

/// What a perfect predictor would do on the validation tokens: exit every token at [`oracle_exit`]. The
/// ceiling of early exit with these candidates on this model.
pub fn oracle(data: &ExitData) -> Simulation {
    let mut hist = vec![0usize; data.n_layers + 1];
    let (mut tokens, mut layer_sum) = (0usize, 0usize);
    for t in (0..data.len()).filter(|&t| data.is_validation(t)) {
        tokens += 1;
        let exit = oracle_exit(data, t);
        hist[exit] += 1;
        layer_sum += (exit + 1).min(data.n_layers);
    }
    let per = |x: usize| if tokens == 0 { 0.0 } else { x as f64 / tokens as f64 };
    Simulation {
        threshold: 0.0,
        exit_rate: per(tokens - hist[data.n_layers]),
        avg_layers: per(layer_sum),
        agreement: 1.0,
        histogram: hist,
    }
}

/// Layers a perfect predictor runs per forward that commits `k` consecutive tokens at once (a speculative tree's
/// accepted path): a forward stops only when every one of them settled, so this is the mean over the validation
/// split's windows of `k` consecutive tokens of one record of their largest [`oracle_exit`] layer count. The
/// ceiling of early exit inside tree verification (`--mode specee-eagle`) at acceptance length `k`.
pub fn oracle_window_layers(data: &ExitData, k: usize) -> f64 {
    let layers: Vec<usize> = (0..data.len()).map(|t| (oracle_exit(data, t) + 1).min(data.n_layers)).collect();
    let (mut windows, mut sum) = (0usize, 0usize);
    for t in (0..data.len()).filter(|&t| data.is_validation(t) && t + k <= data.len()) {
        if k > 0 && data.group[t + k - 1] == data.group[t] {
            windows += 1;
            sum += layers[t..t + k].iter().max().copied().unwrap_or(0);
        }
    }
    if windows == 0 {
        0.0
    } else {
        sum as f64 / windows as f64
    }
}

/// Chooses the schedule and the unverified threshold (see the module header): the lowest threshold of
/// `grid` whose simulated agreement is at least `target_agreement` (the highest of the grid if none is), and the
/// most frequent exit layers at that threshold covering `coverage` of the exits (at most `max_offline`).
pub fn choose_schedule(
    data: &ExitData,
    layers: &[Option<Mlp>],
    grid: &[f32],
    target_agreement: f64,
    coverage: f64,
    max_offline: usize,
) -> (ScheduleConfig, Simulation, Vec<Simulation>) {
    let sims: Vec<Simulation> = grid.iter().map(|&th| simulate(data, layers, th)).collect();
    let chosen = sims.iter().find(|s| s.agreement >= target_agreement).or(sims.last()).cloned().unwrap_or_default();
    let mut by_count: Vec<(usize, usize)> =
        chosen.histogram.iter().copied().enumerate().take(data.n_pred()).filter(|&(_, c)| c > 0).collect();
    by_count.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let total: usize = by_count.iter().map(|&(_, c)| c).sum();
    let mut offline = Vec::new();
    let mut covered = 0;
    for (l, c) in by_count {
        if offline.len() >= max_offline || (total > 0 && covered as f64 >= coverage * total as f64) {
            break;
        }
        offline.push(l);
        covered += c;
    }
    offline.sort_unstable();
    (ScheduleConfig { offline, ..ScheduleConfig::default() }, chosen, sims)
}

/// 3×5 pixel digits for the plot's labels.
const DIGITS: [[u8; 5]; 10] = [
    [7, 5, 5, 5, 7],
    [2, 6, 2, 2, 7],
    [7, 1, 7, 4, 7],
    [7, 1, 7, 1, 7],
    [5, 5, 7, 1, 1],
    [7, 4, 7, 1, 7],
    [7, 4, 7, 5, 7],
    [7, 1, 1, 1, 1],
    [7, 5, 7, 5, 7],
    [7, 5, 7, 1, 7],
];

/// Calls `put(x, y)` for every pixel of the digits of `s` (other characters are skipped) drawn at `(x0, y0)` in
/// [`DIGITS`]' font at double size: 8 pixels a digit, 10 high.
pub(crate) fn draw_digits(s: &str, x0: i64, y0: i64, put: &mut dyn FnMut(i64, i64)) {
    for (k, ch) in s.chars().filter_map(|c| c.to_digit(10)).enumerate() {
        for (row, bits) in DIGITS[ch as usize].iter().enumerate() {
            for col in 0..3 {
                if bits & (4 >> col) != 0 {
                    for (dx, dy) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
                        put(x0 + k as i64 * 8 + col * 2 + dx, y0 + row as i64 * 2 + dy);
                    }
                }
            }
        }
    }
}

/// Writes a bar chart of `counts` (one bar per layer; the last bar, in grey, is "ran the full head") as PNG,
/// layer numbers under every fifth bar and the largest count at the top left.
pub fn plot_histogram(counts: &[usize], path: &Path) -> Result<(), TrainError> {
    const BAR: usize = 14;
    const H: usize = 200;
    const MARGIN: usize = 24;
    let w = MARGIN * 2 + counts.len() * BAR;
    let h = H + MARGIN * 2;
    let mut img = vec![255u8; w * h * 3];
    let mut put = |x: usize, y: usize, c: [u8; 3], img: &mut Vec<u8>| {
        if x < w && y < h {
            img[(y * w + x) * 3..(y * w + x) * 3 + 3].copy_from_slice(&c);
        }
    };
    let text =
        |s: &str, x0: usize, y0: usize, img: &mut Vec<u8>, put: &mut dyn FnMut(usize, usize, [u8; 3], &mut Vec<u8>)| {
            draw_digits(s, x0 as i64, y0 as i64, &mut |x, y| put(x as usize, y as usize, [0, 0, 0], img));
        };
    let max = counts.iter().copied().max().unwrap_or(0).max(1);
    for (i, &c) in counts.iter().enumerate() {
        let bar_h = c * H / max;
        let color = if i + 1 == counts.len() { [150, 150, 150] } else { [40, 90, 200] };
        for x in MARGIN + i * BAR + 1..MARGIN + (i + 1) * BAR - 1 {
            for y in MARGIN + H - bar_h..MARGIN + H {
                put(x, y, color, &mut img);
            }
        }
        if i % 5 == 0 {
            text(&i.to_string(), MARGIN + i * BAR, MARGIN + H + 6, &mut img, &mut put);
        }
    }
    for x in MARGIN..w - MARGIN {
        put(x, MARGIN + H, [0, 0, 0], &mut img);
    }
    text(&max.to_string(), 4, 4, &mut img, &mut put);
    write_png(path, w, h, &img)
}

/// Writes `w × h` RGB pixels (`img`, row by row) as an 8-bit PNG.
pub(crate) fn write_png(path: &Path, w: usize, h: usize, img: &[u8]) -> Result<(), TrainError> {
    let file = std::fs::File::create(path).map_err(|e| TrainError::Io(path.display().to_string(), e))?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), w as u32, h as u32);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let err = |e: png::EncodingError| TrainError::Format(format!("{}: {e}", path.display()));
    enc.write_header().map_err(err)?.write_image_data(img).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Synthetic traces: the right candidate (index 0) takes the lead at layer `settle(t)`.
    fn synthetic(n_tokens: usize, n_layers: usize) -> ExitData {
        let mut data = ExitData { n_layers, ..Default::default() };
        let mut rng = Lcg(3);
        for t in 0..n_tokens {
            let settle = 2 + (t * 7) % (n_layers - 3);
            for l in 0..n_layers {
                let lead = if l >= settle { 3.0 + l as f32 * 0.3 } else { -1.0 };
                data.s.extend_from_slice(&[lead + rng.uniform(), rng.uniform(), rng.uniform(), rng.uniform()]);
                data.upd.extend_from_slice(&[rng.uniform(), rng.uniform()]);
            }
            data.cand.extend_from_slice(&[10, 11, 12, 13]);
            data.cand_lp.extend_from_slice(&[-0.5, -1.5, -2.5, -3.5]);
            data.target.push(10);
            data.group.push((t / 8) as u32);
        }
        data
    }

    #[test]
    fn appended_traces_keep_each_files_validation_split() {
        let (a, b) = (synthetic(8 * 7, 6), synthetic(8 * 3, 6));
        let mut joined = a.clone();
        joined.append(&b).unwrap();
        assert_eq!(joined.len(), a.len() + b.len());
        // `a` has records 0..=6, so `b`'s start at 10: its record 0 stays validation, its record 1 does not.
        assert_eq!(&joined.group[a.len()..a.len() + 9], &[10, 10, 10, 10, 10, 10, 10, 10, 11]);
        let val = |d: &ExitData, r: std::ops::Range<usize>| r.filter(|&t| d.is_validation(t)).count();
        assert_eq!(val(&joined, 0..a.len()), val(&a, 0..a.len()));
        assert_eq!(val(&joined, a.len()..joined.len()), val(&b, 0..b.len()));
        let at = a.len() * 6 * CANDIDATES;
        assert_eq!(&joined.s[at..], &b.s[..]);
        assert_eq!(joined.logits(a.len() + 3, 2), b.logits(3, 2));
        assert_eq!(&joined.upd[a.len() * 6 * UPDATE_FEATURES..], &b.upd[..]);
        let mut empty = ExitData::default();
        empty.append(&b).unwrap();
        assert_eq!(empty, b);
        let mut other = synthetic(8, 5);
        assert!(other.append(&b).is_err(), "traces of models with different depths must not join");
    }

    #[test]
    fn reduced_rows_give_the_exact_nll_at_every_temperature() {
        let mut rng = Lcg(5);
        let logits: Vec<f32> =
            (0..5000).map(|i| (rng.uniform() * 30.0 - 20.0) + if i == 7 { 12.0 } else { 0.0 }).collect();
        let row = RowNll::new(&logits, 42, &mut Vec::new());
        for t in temperature_grid() {
            let max = logits.iter().fold(f32::NEG_INFINITY, |m, &z| m.max(z)) as f64;
            let lse = max / t as f64 + logits.iter().map(|&z| ((z as f64 - max) / t as f64).exp()).sum::<f64>().ln();
            let want = lse - logits[42] as f64 / t as f64;
            // Binning moves a tail logit by at most half a bin: a relative error of BIN / 2T on its weight.
            let tol = 1e-6 + (BIN as f64 / (2.0 * t as f64)).exp() - 1.0;
            assert!((row.nll(t) - want).abs() <= tol * want.abs().max(1.0), "T {t}: {} vs {want}", row.nll(t));
        }
    }

    #[test]
    fn predictors_learn_when_the_answer_settles() {
        let data = synthetic(800, 12);
        let opts = ExitTrainOptions {
            hidden: 32,
            epochs: 40,
            batch: 128,
            lr: 1e-2,
            n_features: MAX_FEATURES,
            ..Default::default()
        };
        let (layers, reports) = train_exit(&data, &opts, |_| {}).unwrap();
        assert_eq!(reports.len(), 12);
        // A trace without the layers' updates (an older file) trains 16 features but refuses 18.
        let old = ExitData { upd: Vec::new(), ..data.clone() };
        assert!(train_exit(&old, &ExitTrainOptions { n_features: MAX_FEATURES, ..opts.clone() }, |_| {}).is_err());
        assert!(layers[11].is_some() && layers[0].is_some());
        // Late layers are always right to exit; early layers never (settle ≥ 2).
        assert!(reports[10].recall > 0.95, "{:?}", reports[10]);
        assert_eq!(reports[0].positive_rate, 0.0);
        let (schedule, chosen, sims) = choose_schedule(&data, &layers, &[0.5, 0.9], 0.95, 0.9, 4);
        assert!(chosen.agreement >= 0.95, "{sims:?}");
        assert!(!schedule.offline.is_empty() && schedule.offline.len() <= 4);
        assert!(chosen.avg_layers < 12.0);
        assert_eq!(chosen.histogram.iter().sum::<usize>(), (0..800).filter(|&t| data.is_validation(t)).count());
        // The oracle exits every token exactly where it settles.
        let o = oracle(&data);
        assert_eq!(o.exit_rate, 1.0);
        let val: Vec<usize> = (0..800).filter(|&t| data.is_validation(t)).collect();
        let want = val.iter().map(|&t| (3 + (t * 7) % 9) as f64).sum::<f64>() / val.len() as f64;
        assert!((o.avg_layers - want).abs() < 1e-9, "{} vs {want}", o.avg_layers);
        assert!(chosen.avg_layers >= o.avg_layers);
        // Windows of one token are the oracle itself; of two, the later settling of each consecutive pair in a
        // record (records are 8 tokens: pairs from positions 0..7 of each).
        assert!((oracle_window_layers(&data, 1) - o.avg_layers).abs() < 1e-9);
        let settle = |t: usize| 3 + (t * 7) % 9;
        let pairs: Vec<usize> = val.iter().filter(|&&t| t % 8 < 7).map(|&t| settle(t).max(settle(t + 1))).collect();
        let want2 = pairs.iter().sum::<usize>() as f64 / pairs.len() as f64;
        assert!((oracle_window_layers(&data, 2) - want2).abs() < 1e-9, "{} vs {want2}", oracle_window_layers(&data, 2));
    }

    #[test]
    fn bce_is_finite_and_correct_on_confident_logits() {
        let dev = Device::Cpu;
        let z = Tensor::new(&[200f32, -200.0, 0.0, 2.0], &dev).unwrap();
        let y = Tensor::new(&[1f32, 1.0, 0.0, 0.0], &dev).unwrap();
        let got: f32 = bce_with_logits(&z, &y).unwrap().to_scalar().unwrap();
        // Per element: 0, 200, ln 2, 2 + ln(1 + e^-2).
        let want = (0.0 + 200.0 + 2f32.ln() + 2.0 + (1.0 + (-2f32).exp()).ln()) / 4.0;
        assert!((got - want).abs() < 1e-4, "{got} vs {want}");
    }

    #[test]
    fn data_round_trips_and_plot_is_a_png() {
        let data = synthetic(20, 6);
        let dir = std::env::temp_dir().join(format!("specee-exit-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("d.safetensors");
        data.save(&path, &crate::cache::CacheKey::new()).unwrap();
        assert_eq!(ExitData::load(&path).unwrap(), data);
        let png_path = dir.join("h.png");
        plot_histogram(&[3, 0, 12, 5, 7, 1], &png_path).unwrap();
        let bytes = std::fs::read(&png_path).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
