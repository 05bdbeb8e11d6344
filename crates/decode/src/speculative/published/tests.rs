//! Published heads: synthetic checkpoints written in every published layout (safetensors and PyTorch zip
//! archives), loading and its errors, drafting against a plain re-implementation, and losslessness.

use super::*;
use crate::speculative::proposer::{DraftContext, Proposer};
use crate::speculative::tree::{DraftTree, TreeConfig};
use crate::{SamplingParams, SpeculativeDecoder};
use std::io::Write;

const D: usize = 32;
const FF: usize = 48;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HD: usize = D / HEADS;
const DRAFT_VOCAB: usize = 16;
const VOCAB: usize = 64;

/// A raw tensor for the writers.
#[derive(Clone)]
enum Raw {
    F32(Vec<f32>, Vec<usize>),
    I64(Vec<i64>, Vec<usize>),
    Bool(Vec<bool>, Vec<usize>),
}

struct Rng(u64);
impl Rng {
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
            })
            .collect()
    }
}

/// A random checkpoint by its authors' tensor names: EAGLE-1 (`layers.0.*`, `fc` with bias, extra keys the
/// authors' files carry) or EAGLE-3 (`midlayer.*`, or with `model_prefix` the `model.layers.0.*` layout).
fn checkpoint(version: EagleVersion, model_prefix: bool, seed: u64) -> Vec<(String, Raw)> {
    let mut r = Rng(seed);
    let mut f = |shape: &[usize], scale: f32| Raw::F32(r.vec(shape.iter().product(), scale), shape.to_vec());
    let eagle3 = version == EagleVersion::Eagle3;
    let att_in = if eagle3 { 2 * D } else { D };
    let layer = match (eagle3, model_prefix) {
        (true, false) => "midlayer.",
        (true, true) => "model.layers.0.",
        (false, _) => "layers.0.",
    };
    let top = if model_prefix { "model." } else { "" };
    let mut t: Vec<(String, Raw)> = vec![
        (format!("{top}fc.weight"), f(&[D, if eagle3 { 3 * D } else { 2 * D }], 0.3)),
        (format!("{layer}self_attn.q_proj.weight"), f(&[HEADS * HD, att_in], 0.4)),
        (format!("{layer}self_attn.k_proj.weight"), f(&[KV_HEADS * HD, att_in], 0.4)),
        (format!("{layer}self_attn.v_proj.weight"), f(&[KV_HEADS * HD, att_in], 0.4)),
        (format!("{layer}self_attn.o_proj.weight"), f(&[D, HEADS * HD], 0.3)),
        (format!("{layer}mlp.gate_proj.weight"), f(&[FF, D], 0.3)),
        (format!("{layer}mlp.up_proj.weight"), f(&[FF, D], 0.3)),
        (format!("{layer}mlp.down_proj.weight"), f(&[D, FF], 0.3)),
        (format!("{layer}post_attention_layernorm.weight"), f(&[D], 1.5)),
        // Carried by published files, read by nobody here.
        (format!("{top}embed_tokens.weight"), f(&[VOCAB, D], 1.0)),
        (format!("{layer}input_layernorm.weight"), f(&[D], 1.5)),
    ];
    if eagle3 {
        t.push((format!("{layer}hidden_norm.weight"), f(&[D], 1.5)));
        t.push((format!("{top}norm.weight"), f(&[D], 1.5)));
        t.push(("lm_head.weight".into(), f(&[DRAFT_VOCAB, D], 2.0)));
        // Draft id j → target token 3j + 1.
        t.push(("d2t".into(), Raw::I64((0..DRAFT_VOCAB as i64).map(|j| 2 * j + 1).collect(), vec![DRAFT_VOCAB])));
        t.push(("t2d".into(), Raw::Bool((0..VOCAB).map(|i| i % 3 == 1).collect(), vec![VOCAB])));
    } else {
        t.push((format!("{top}fc.bias"), f(&[D], 0.1)));
    }
    t
}

fn config_json(version: EagleVersion) -> String {
    let extra =
        if version == EagleVersion::Eagle3 { format!(", \"draft_vocab_size\": {DRAFT_VOCAB}") } else { String::new() };
    format!(
        "{{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": {D}, \"intermediate_size\": {FF}, \
         \"num_attention_heads\": {HEADS}, \"num_key_value_heads\": {KV_HEADS}, \"rms_norm_eps\": 1e-5, \
         \"rope_theta\": 10000.0, \"vocab_size\": {VOCAB}, \"bias\": true{extra}}}"
    )
}

fn write_safetensors(path: &Path, tensors: &[(String, Raw)]) {
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;
    let bytes: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, raw)| match raw {
            Raw::F32(v, s) => (name.clone(), Dtype::F32, s.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            Raw::I64(v, s) => (name.clone(), Dtype::I64, s.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            Raw::Bool(v, s) => (name.clone(), Dtype::BOOL, s.clone(), v.iter().map(|&b| b as u8).collect()),
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> =
        bytes.iter().map(|(n, t, s, b)| (n.clone(), TensorView::new(*t, s.clone(), b).unwrap())).collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// `torch.save(state_dict)` as PyTorch writes it: a zip archive with `archive/data.pkl` (pickle protocol 2: a
/// dict of `torch._utils._rebuild_tensor_v2(persistent storage, offset, size, stride, requires_grad, hooks)`)
/// and one raw little-endian file per storage under `archive/data/`.
fn write_pytorch(path: &Path, tensors: &[(String, Raw)]) {
    fn unicode(p: &mut Vec<u8>, s: &str) {
        p.push(b'X');
        p.extend_from_slice(&(s.len() as u32).to_le_bytes());
        p.extend_from_slice(s.as_bytes());
    }
    fn int(p: &mut Vec<u8>, v: usize) {
        p.push(b'J');
        p.extend_from_slice(&(v as i32).to_le_bytes());
    }
    fn tuple(p: &mut Vec<u8>, vals: &[usize]) {
        p.push(b'(');
        vals.iter().for_each(|&v| int(p, v));
        p.push(b't');
    }
    let mut zip = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
    let opts = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    let mut pkl = vec![0x80, 2, b'}', b'('];
    for (key, (name, raw)) in tensors.iter().enumerate() {
        let (storage, shape, data): (&str, &Vec<usize>, Vec<u8>) = match raw {
            Raw::F32(v, s) => ("FloatStorage", s, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            Raw::I64(v, s) => ("LongStorage", s, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            Raw::Bool(v, s) => ("BoolStorage", s, v.iter().map(|&b| b as u8).collect()),
        };
        let numel: usize = shape.iter().product();
        let strides: Vec<usize> = (0..shape.len()).map(|i| shape[i + 1..].iter().product()).collect();
        unicode(&mut pkl, name);
        pkl.extend_from_slice(b"ctorch._utils\n_rebuild_tensor_v2\n(");
        pkl.push(b'(');
        unicode(&mut pkl, "storage");
        pkl.extend_from_slice(format!("ctorch\n{storage}\n").as_bytes());
        unicode(&mut pkl, &key.to_string());
        unicode(&mut pkl, "cpu");
        int(&mut pkl, numel);
        pkl.extend_from_slice(b"tQ");
        int(&mut pkl, 0);
        tuple(&mut pkl, shape);
        tuple(&mut pkl, &strides);
        pkl.extend_from_slice(&[0x89, b'}', b't', b'R']);
        zip.start_file(format!("archive/data/{key}"), opts).unwrap();
        zip.write_all(&data).unwrap();
    }
    pkl.extend_from_slice(b"u.");
    zip.start_file("archive/data.pkl", opts).unwrap();
    zip.write_all(&pkl).unwrap();
    zip.start_file("archive/version", opts).unwrap();
    zip.write_all(b"3\n").unwrap();
    zip.finish().unwrap();
}

/// A fresh folder holding a checkpoint; `bin` picks `pytorch_model.bin` over `model.safetensors`.
fn checkpoint_dir(tag: &str, version: EagleVersion, tensors: &[(String, Raw)], bin: bool) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("specee-published-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), config_json(version)).unwrap();
    if bin {
        write_pytorch(&dir.join("pytorch_model.bin"), tensors);
    } else {
        write_safetensors(&dir.join("model.safetensors"), tensors);
    }
    dir
}

/// The checkpoint's tensors by normalized name (what the loader should see).
fn normalized(tensors: &[(String, Raw)]) -> HashMap<String, Raw> {
    tensors.iter().map(|(n, r)| (normalize_name(n), r.clone())).collect()
}

fn head_of(tensors: &[(String, Raw)], version: EagleVersion, quantize: bool) -> PublishedHead {
    let t: Tensors = normalized(tensors)
        .into_iter()
        .map(|(n, r)| match r {
            Raw::F32(v, s) => (n, (TensorData::Float(v), s)),
            Raw::I64(v, s) => (n, (TensorData::Int(v), s)),
            Raw::Bool(_, s) => (n, (TensorData::Other("BOOL".into()), s)),
        })
        .collect();
    PublishedHead::from_tensors(t, &HeadConfig::parse(&config_json(version)).unwrap(), quantize).unwrap()
}

/// Everything a head computes with, as one comparable list.
fn fingerprint(h: &PublishedHead) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> =
        [&h.fc, &h.q, &h.k, &h.v, &h.o, &h.gate, &h.up, &h.down].iter().map(|m| m.view().data.to_vec()).collect();
    for v in [&h.post_norm, &h.input_norm, &h.hidden_norm, &h.norm, &h.inv_freq] {
        out.push(v.iter().flat_map(|x| x.to_le_bytes()).collect());
    }
    out.push(h.d2t.iter().flat_map(|x| x.to_le_bytes()).collect());
    out.push(h.lm_head.as_ref().map(|m| m.view().data.to_vec()).unwrap_or_default());
    out
}

#[test]
fn every_published_layout_loads_to_the_same_head() {
    // EAGLE-1/2: safetensors and pytorch_model.bin, by folder and by file.
    let e1 = checkpoint(EagleVersion::Eagle1, false, 3);
    let st = checkpoint_dir("e1-st", EagleVersion::Eagle1, &e1, false);
    let bin = checkpoint_dir("e1-bin", EagleVersion::Eagle1, &e1, true);
    let a = PublishedHead::load(&st).unwrap();
    let b = PublishedHead::load(bin.join("pytorch_model.bin")).unwrap();
    assert_eq!(a.version, EagleVersion::Eagle1);
    assert_eq!((a.n_embd, a.n_head, a.n_head_kv, a.head_dim, a.n_ff), (D, HEADS, KV_HEADS, HD, FF));
    assert!(a.fc_bias.is_some() && a.d2t.is_empty());
    assert_eq!(fingerprint(&a), fingerprint(&b));
    assert_eq!(a.fc_bias, b.fc_bias);

    // EAGLE-3: `midlayer.*` and `model.layers.0.*`, safetensors and .bin (its bool `t2d` is skipped).
    let m = checkpoint(EagleVersion::Eagle3, false, 4);
    let p = checkpoint(EagleVersion::Eagle3, true, 4);
    let heads = [
        PublishedHead::load(checkpoint_dir("e3-mid", EagleVersion::Eagle3, &m, false)).unwrap(),
        PublishedHead::load(checkpoint_dir("e3-model", EagleVersion::Eagle3, &p, false)).unwrap(),
        PublishedHead::load(checkpoint_dir("e3-bin", EagleVersion::Eagle3, &m, true)).unwrap(),
    ];
    for h in &heads {
        assert_eq!(h.version, EagleVersion::Eagle3);
        assert_eq!(h.d2t.len(), DRAFT_VOCAB);
        assert_eq!(h.d2t[5], 3 * 5 + 1);
        assert_eq!(fingerprint(h), fingerprint(&heads[0]));
    }
    assert!(is_published(&st) && is_published(&bin.join("pytorch_model.bin")));
    assert!(is_published(&st.join("model.safetensors")));
    // specee's own head format is not a published checkpoint.
    let own = st.join("own.safetensors");
    std::fs::write(&own, crate::speculative::eagle::tests::random_head_bytes(D, 64, 16, 1)).unwrap();
    assert!(!is_published(&own));
    for dir in [st, bin] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn bad_checkpoints_give_clear_errors() {
    let base = checkpoint(EagleVersion::Eagle1, false, 5);
    // A projection of the wrong width names the tensor and both shapes.
    let mut bad = base.clone();
    bad.iter_mut().filter(|(n, _)| n == "layers.0.self_attn.k_proj.weight").for_each(|(_, r)| {
        *r = Raw::F32(vec![0.0; 3 * HD * D], vec![3 * HD, D]);
    });
    let dir = checkpoint_dir("bad-shape", EagleVersion::Eagle1, &bad, false);
    let err = PublishedHead::load(&dir).unwrap_err();
    assert!(
        matches!(&err, PublishedHeadError::Shape { name, got, want } if name == "layers.0.self_attn.k_proj.weight"
            && got == &vec![3 * HD, D] && want == &vec![KV_HEADS * HD, D]),
        "{err}"
    );
    // A missing tensor.
    let missing: Vec<_> = base.iter().filter(|(n, _)| !n.contains("down_proj")).cloned().collect();
    let dir = checkpoint_dir("missing", EagleVersion::Eagle1, &missing, false);
    assert!(matches!(PublishedHead::load(&dir), Err(PublishedHeadError::Missing(n)) if n.contains("down_proj")));
    // No config, no weights, not a checkpoint.
    std::fs::remove_file(dir.join("config.json")).unwrap();
    assert!(matches!(PublishedHead::load(&dir), Err(PublishedHeadError::Config { .. })));
    std::fs::write(dir.join("config.json"), config_json(EagleVersion::Eagle1)).unwrap();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert!(matches!(PublishedHead::load(&dir), Err(PublishedHeadError::NoWeights(_))));
    std::fs::write(dir.join("pytorch_model.bin"), b"not a zip archive").unwrap();
    assert!(matches!(PublishedHead::load(&dir), Err(PublishedHeadError::Weights { .. })));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(HeadConfig::parse("{\"hidden_size\": 32}").unwrap_err().contains("num_attention_heads"));
    assert!(HeadConfig::parse("{\"num_attention_heads\": 4, \"num_key_value_heads\": 3}").is_err());
    assert!(HeadConfig::parse("{\"num_attention_heads\": 4, \"rope_scaling\": {\"type\": \"yarn\"}}").is_err());

    // Heads that do not fit the model.
    let head = head_of(&base, EagleVersion::Eagle1, true);
    let narrow = model::testing::tiny_model("llama", None, 1, 32);
    assert!(matches!(head.check_fits(&narrow), Err(PublishedHeadError::Vocab { head: 64, model: 32 })));
    let e3 = head_of(&checkpoint(EagleVersion::Eagle3, false, 6), EagleVersion::Eagle3, true);
    assert!(matches!(e3.check_fits(&narrow), Err(PublishedHeadError::BadMapping { index: 11, token: 34, vocab: 32 })));
    let fits = model::testing::tiny_model("llama", None, 1, VOCAB);
    head.check_fits(&fits).unwrap();
    e3.check_fits(&fits).unwrap();
}

// ---------------------------------------------------------------------------------------------------------
// A plain re-implementation of both designs, straight from the tensors, for whole sequences.

fn get<'a>(t: &'a HashMap<String, Raw>, name: &str) -> &'a [f32] {
    match &t[name] {
        Raw::F32(v, _) => v,
        _ => panic!("{name}"),
    }
}

fn mat_vec(w: &[f32], x: &[f32]) -> Vec<f32> {
    w.chunks_exact(x.len()).map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}

fn norm(x: &[f32], w: &[f32]) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let s = 1.0 / (ms + 1e-5).sqrt();
    x.iter().zip(w).map(|(v, w)| v * s * w).collect()
}

fn rotate(x: &mut [f32], pos: usize) {
    let half = x.len() / 2;
    for i in 0..half {
        let theta = pos as f32 * 10000f32.powf(-2.0 * i as f32 / x.len() as f32);
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * theta.cos() - b * theta.sin();
        x[i + half] = a * theta.sin() + b * theta.cos();
    }
}

/// Runs `rows` (token, input, from_target) causally at positions 0.. and returns each row's `h` and logits.
fn reference(
    t: &HashMap<String, Raw>,
    eagle3: bool,
    model: &Model,
    rows: &[(u32, Vec<f32>, bool)],
) -> Vec<(Vec<f32>, Vec<f32>)> {
    let l = "layers.0.";
    let w = |n: &str| get(t, &format!("{l}{n}"));
    let mut keys: Vec<Vec<f32>> = Vec::new();
    let mut values: Vec<Vec<f32>> = Vec::new();
    let mut out = Vec::new();
    for (pos, (token, input, from_target)) in rows.iter().enumerate() {
        let mut emb = vec![0.0; D];
        model.embed(&[*token], &mut emb).unwrap();
        let (g, a) = if eagle3 {
            let g = if *from_target { mat_vec(get(t, "fc.weight"), input) } else { input.clone() };
            let mut a = norm(&emb, w("input_layernorm.weight"));
            a.extend(norm(&g, w("hidden_norm.weight")));
            (g, a)
        } else {
            let cat: Vec<f32> = emb.iter().chain(input).copied().collect();
            let g: Vec<f32> =
                mat_vec(get(t, "fc.weight"), &cat).iter().zip(get(t, "fc.bias")).map(|(a, b)| a + b).collect();
            (g.clone(), g)
        };
        let mut q = mat_vec(w("self_attn.q_proj.weight"), &a);
        let mut k = mat_vec(w("self_attn.k_proj.weight"), &a);
        q.chunks_exact_mut(HD).for_each(|h| rotate(h, pos));
        k.chunks_exact_mut(HD).for_each(|h| rotate(h, pos));
        keys.push(k);
        values.push(mat_vec(w("self_attn.v_proj.weight"), &a));
        let mut att = vec![0.0; HEADS * HD];
        for h in 0..HEADS {
            let kv = h / (HEADS / KV_HEADS);
            let qh = &q[h * HD..(h + 1) * HD];
            let s: Vec<f32> = keys
                .iter()
                .map(|k| {
                    qh.iter().zip(&k[kv * HD..(kv + 1) * HD]).map(|(a, b)| a * b).sum::<f32>() / (HD as f32).sqrt()
                })
                .collect();
            let mx = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = s.iter().map(|x| (x - mx).exp()).collect();
            let z: f32 = e.iter().sum();
            for (p, v) in e.iter().zip(&values) {
                for i in 0..HD {
                    att[h * HD + i] += p / z * v[kv * HD + i];
                }
            }
        }
        let mut hid: Vec<f32> = g.iter().zip(mat_vec(w("self_attn.o_proj.weight"), &att)).map(|(a, b)| a + b).collect();
        let n = norm(&hid, w("post_attention_layernorm.weight"));
        let gate = mat_vec(w("mlp.gate_proj.weight"), &n);
        let up = mat_vec(w("mlp.up_proj.weight"), &n);
        let act: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
        hid.iter_mut().zip(mat_vec(w("mlp.down_proj.weight"), &act)).for_each(|(h, d)| *h += d);
        let logits = if eagle3 {
            mat_vec(get(t, "lm_head.weight"), &norm(&hid, get(t, "norm.weight")))
        } else {
            (0..VOCAB as u32)
                .map(|id| {
                    let mut row = vec![0.0; D];
                    model.head_row(id, &mut row).unwrap();
                    row.iter().zip(&hid).map(|(a, b)| a * b).sum()
                })
                .collect()
        };
        out.push((hid, logits));
    }
    out
}

fn log_softmax_at(logits: &[f32], j: usize) -> f32 {
    let mx = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    logits[j] - mx - logits.iter().map(|x| (x - mx).exp()).sum::<f32>().ln()
}

/// Random committed tokens and target features of width `fw`.
fn context_data(n: usize, fw: usize, seed: u64) -> (Vec<u32>, Vec<f32>) {
    let mut r = Rng(seed);
    let tokens = r.vec(n, 1.0).iter().map(|x| ((x + 1.0) * 31.9) as u32 % VOCAB as u32).collect();
    (tokens, r.vec((n - 1) * fw, 1.0))
}

fn context<'a>(
    model: &'a Model,
    pool: &'a kernels::ThreadPool,
    tokens: &'a [u32],
    features: &'a [f32],
    feature_width: usize,
    stable_prefix: usize,
) -> DraftContext<'a> {
    DraftContext { model, pool, tokens, features, feature_width, stable_prefix }
}

#[test]
fn drafts_match_a_plain_reimplementation_and_the_cache_changes_nothing() {
    let model = model::testing::tiny_model("llama", None, 7, VOCAB);
    let pool = kernels::ThreadPool::new(2);
    for version in [EagleVersion::Eagle1, EagleVersion::Eagle3] {
        let raw = checkpoint(version, false, 11);
        let t = normalized(&raw);
        let eagle3 = version == EagleVersion::Eagle3;
        // Budget = every candidate: the tree keeps nodes down to depth 4.
        let config = TreeConfig { depth: 4, top_k: 2, budget: 14, min_prob: 0.0 };
        let mut cached = PublishedProposer::new(head_of(&raw, version, false), &model, config.clone()).unwrap();
        let fw = cached.feature_source().width(D);
        assert_eq!(fw, if eagle3 { 3 * D } else { D });
        let (tokens, features) = context_data(14, fw, 99 + eagle3 as u64);
        // Another sequence sharing only the first 8 tokens (and their 7 feature rows): a rollback.
        let (mut other, mut other_features) = context_data(14, fw, 7 + eagle3 as u64);
        other[..8].copy_from_slice(&tokens[..8]);
        other_features[..7 * fw].copy_from_slice(&features[..7 * fw]);
        // Grow the context as the decoder would, keeping the draft cache between calls; roll back to 8 tokens.
        let mut tree = DraftTree::new(0);
        for (n, stable) in [(6, 0), (11, 6), (12, 11)] {
            tree.reset(other[n - 1]);
            cached
                .propose(&context(&model, &pool, &other[..n], &other_features[..(n - 1) * fw], fw, stable), &mut tree)
                .unwrap();
        }
        for (n, stable) in [(10, 8), (14, 10)] {
            tree.reset(tokens[n - 1]);
            cached
                .propose(&context(&model, &pool, &tokens[..n], &features[..(n - 1) * fw], fw, stable), &mut tree)
                .unwrap();
        }
        // A fresh proposer on the final context drafts the same tree.
        let mut fresh = PublishedProposer::new(head_of(&raw, version, false), &model, config).unwrap();
        let mut again = DraftTree::new(tokens[13]);
        fresh.propose(&context(&model, &pool, &tokens, &features, fw, 0), &mut again).unwrap();
        assert_eq!(tree.depth(), 4, "{version:?}");
        assert_eq!(tree.nodes(), again.nodes(), "{version:?}: cached vs fresh");

        // Every node's log-probability from a plain causal re-run of committed rows + the node's path.
        let committed: Vec<(u32, Vec<f32>, bool)> =
            (0..13).map(|i| (tokens[i + 1], features[i * fw..(i + 1) * fw].to_vec(), true)).collect();
        for v in 1..tree.len() {
            let mut path = vec![v];
            while tree.node(*path.last().unwrap()).parent != 0 {
                path.push(tree.node(*path.last().unwrap()).parent);
            }
            path.reverse();
            let mut rows = committed.clone();
            for &u in &path[..path.len() - 1] {
                let prev = reference(&t, eagle3, &model, &rows).pop().unwrap().0;
                rows.push((tree.node(u).token, prev, false));
            }
            let logits = reference(&t, eagle3, &model, &rows).pop().unwrap().1;
            let token = tree.node(v).token;
            let j = if eagle3 { fresh.head().d2t.iter().position(|&x| x == token).unwrap() } else { token as usize };
            let want = log_softmax_at(&logits, j);
            let got = tree.node(v).log_prob;
            assert!((want - got).abs() < 1e-3, "{version:?} node {v} (depth {}): {got} vs {want}", path.len());
        }
    }
}

#[test]
fn published_heads_are_lossless_on_a_tiny_model() {
    let model = model::testing::tiny_model("llama", None, 13, VOCAB);
    let n = 40;
    let want = crate::test_util::dense_greedy(&model, n);
    for version in [EagleVersion::Eagle1, EagleVersion::Eagle3] {
        let head = head_of(&checkpoint(version, false, 17), version, true);
        // With the lookup chain `--mode eagle` adds: its nodes are verified like the head's.
        let proposer = PublishedProposer::new(head, &model, PublishedProposer::default_tree()).unwrap().with_lookup(3);
        let mut dec = SpeculativeDecoder::new(&model, 128, 2, proposer, SamplingParams::greedy());
        let got = crate::test_util::speculative_greedy(&mut dec, n);
        assert_eq!(got, want, "{version:?}");
        assert!(dec.stats().drafted_nodes > 0, "{version:?}: the head drafted nothing");
    }
}

#[test]
fn published_heads_draft_the_lookup_chain_too() {
    let model = model::testing::tiny_model("llama", None, 13, VOCAB);
    let pool = kernels::ThreadPool::new(1);
    let head = head_of(&checkpoint(EagleVersion::Eagle3, false, 17), EagleVersion::Eagle3, true);
    // What followed `5 6 7` earlier is `8 9 10 11`: the chain drafts it below the root 7.
    let tokens = [1, 5, 6, 7, 8, 9, 10, 11, 2, 5, 6, 7];
    let features = vec![0.5; (tokens.len() - 1) * 3 * D];
    let ctx = context(&model, &pool, &tokens, &features, 3 * D, 0);
    let chain_of = |proposer: &mut PublishedProposer| {
        let mut tree = DraftTree::new(7);
        proposer.propose(&ctx, &mut tree).unwrap();
        let deepest = (0..tree.len()).max_by_key(|&i| tree.node(i).depth).unwrap();
        let mut path = Vec::new();
        tree.path_tokens(deepest, &mut path);
        path
    };
    let config = TreeConfig { depth: 1, top_k: 1, budget: 1, min_prob: 0.0 };
    let mut plain = PublishedProposer::new(head.clone(), &model, config.clone()).unwrap();
    assert_eq!(chain_of(&mut plain).len(), 1, "without a chain the tree is the head's one node");
    let mut with = PublishedProposer::new(head, &model, config).unwrap().with_lookup(3);
    assert_eq!(chain_of(&mut with), [8, 9, 10]);
}

#[test]
fn llama3_rope_scaling_changes_only_low_frequencies() {
    let text = "{\"num_attention_heads\": 4, \"rope_theta\": 500000.0, \"rope_scaling\": {\"rope_type\": \"llama3\", \
                \"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, \
                \"original_max_position_embeddings\": 8192}}";
    let c = HeadConfig::parse(text).unwrap();
    let mut f = model::blocks::rope_inv_freq(500000.0, 128);
    let plain = f.clone();
    c.rope_scaling.unwrap().apply(&mut f);
    assert_eq!(f[0], plain[0]); // wavelength 2π: untouched
    assert!((f[63] - plain[63] / 8.0).abs() < 1e-12); // longest wavelength: divided by the factor
    assert!(f.iter().zip(&plain).all(|(a, b)| a <= b && *a >= b / 8.0 - 1e-12));
}
