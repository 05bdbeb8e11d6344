//! Activation sparsity's calibration file and its quality curve (issue #39; the zeroing itself is
//! [`model::sparsity`]).
//!
//! - [`fit`]: runs the dense model over calibration text (chunks as `specee perplexity` cuts them) recording a
//!   histogram of every layer's four matrix inputs; [`save`] writes them as safetensors (`histograms`, `u64` as
//!   `F64` counts, `[n_layers, 4, BINS]`) with the model's identity, and [`load`] refuses another model's file in
//!   one line. Any target sparsity's thresholds come from the histograms ([`model::ActHistograms::thresholds`]).
//! - [`curve`]: teacher-forced quality against sparsity on held-out text: per target, the perplexity, the share of
//!   scored positions whose top-1 equals dense's, and the sparsity the run actually had (model-wide, weighted by
//!   the weight bytes each input entry multiplies, per site, and over groups of consecutive rows), with the decode
//!   speed-up it would allow if skipped bytes were not read ([`bytes_ceiling`]).

use crate::error::EngineError;
use crate::identity::ModelIdentity;
use crate::perplexity::{log_prob, text_chunks};
use crate::session::Engine;
use model::sparsity::{BINS, SITES};
use model::{ActHistograms, KvCache, Logits, Site, Workspace};
use std::collections::HashMap;
use std::path::Path;

/// The `format` metadata of a calibration file.
pub const FORMAT: &str = "specee-act-sparsity-v1";

/// Records the matrix-input histograms of `engine`'s dense model over `text` (chunks of `ctx` tokens, at most
/// `max_chunks`, 0 = all); `progress(done, total)` after each chunk.
pub fn fit(
    engine: &Engine,
    text: &str,
    ctx: usize,
    max_chunks: usize,
    threads: usize,
    mut progress: impl FnMut(usize, usize),
) -> Result<ActHistograms, EngineError> {
    let model = &engine.model;
    if model.act_sparsity().is_some() {
        return Err(EngineError::Unsupported("fit activation thresholds on the dense model".into()));
    }
    let chunks = text_chunks(engine, text, ctx, max_chunks)?;
    let mut ws = Workspace::new(threads);
    ws.record_activations(model.config.n_layers);
    let mut kv = KvCache::new(&model.config, ctx);
    let mut hidden = Vec::new();
    for (i, ids) in chunks.iter().enumerate() {
        kv.clear();
        model.forward(ids, &mut kv, &mut ws, &mut hidden, Logits::None)?;
        progress(i + 1, chunks.len());
    }
    Ok(ws.take_recording().expect("recording was started"))
}

/// Writes `hist` with `engine`'s identity (loaded from `model_path`) and `extra` metadata (how it was made).
pub fn save(
    path: &Path,
    hist: &ActHistograms,
    engine: &Engine,
    model_path: &Path,
    extra: &[(String, String)],
) -> Result<(), EngineError> {
    let io = |e: std::io::Error| EngineError::Io { path: path.to_path_buf(), source: e };
    let identity = ModelIdentity::of(model_path, &engine.model).fingerprinted(model_path).map_err(io)?;
    let mut meta: HashMap<String, String> = identity.to_metadata().into_iter().collect();
    meta.insert("format".into(), FORMAT.into());
    meta.insert("n_layers".into(), hist.n_layers.to_string());
    meta.insert("sites".into(), Site::ALL.map(|s| s.name()).join(","));
    meta.extend(extra.iter().cloned());
    let bytes: Vec<u8> = hist.counts.iter().flat_map(|&c| (c as f64).to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F64, vec![hist.n_layers, SITES, BINS], &bytes)
        .map_err(|e| EngineError::Unsupported(e.to_string()))?;
    let out = safetensors::serialize(vec![("histograms", view)], Some(meta))
        .map_err(|e| EngineError::Unsupported(e.to_string()))?;
    std::fs::write(path, out).map_err(io)
}

/// Reads a calibration file made for `engine`'s model (loaded from `model_path`): another model's, a file of
/// another format or a damaged one is a one-line error naming the file.
pub fn load(path: &Path, engine: &Engine, model_path: &Path) -> Result<ActHistograms, EngineError> {
    let bytes = std::fs::read(path).map_err(|e| EngineError::Io { path: path.to_path_buf(), source: e })?;
    let bad = |why: String| EngineError::Unsupported(format!("activation-sparsity file {}: {why}", path.display()));
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| bad(e.to_string()))?;
    let metadata: HashMap<String, String> = meta.metadata().clone().unwrap_or_default();
    match metadata.get("format") {
        Some(f) if f == FORMAT => {}
        Some(f) => return Err(bad(format!("format '{f}': not made by `specee sparsity fit` (expected '{FORMAT}')"))),
        None => {
            return Err(bad(format!("no format metadata (not made by `specee sparsity fit`; expected '{FORMAT}')")))
        }
    }
    engine.check_made_for("activation-sparsity file", path, &metadata, model_path)?;
    let n_layers = engine.model.config.n_layers;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
    let t = st.tensor("histograms").map_err(|_| bad("no 'histograms' tensor".into()))?;
    if t.dtype() != safetensors::Dtype::F64 || t.shape() != [n_layers, SITES, BINS] {
        return Err(bad(format!(
            "'histograms' is {:?} {:?}, expected F64 [{n_layers}, {SITES}, {BINS}]",
            t.dtype(),
            t.shape()
        )));
    }
    let counts = t.data().chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().unwrap()).max(0.0) as u64).collect();
    Ok(ActHistograms { n_layers, counts, channel_abs: vec![Vec::new(); n_layers * SITES] })
}

/// Bytes of the layers' weight matrices each [`Site`] feeds (Q+K+V, O, gate+up, down, summed over layers) and of
/// the output head: what one decode token reads. They weigh [`model::ActCounts::share`] into the share of the
/// layers' weight bytes a column-skipping kernel would not read.
pub fn site_bytes(model: &model::Model) -> ([f64; SITES], f64) {
    let bytes = |m: &model::weights::Matrix| (m.rows * m.row_bytes()) as f64;
    let mut sites = [0f64; SITES];
    for lw in &model.weights.layers {
        sites[Site::Qkv as usize] += bytes(&lw.wq) + bytes(&lw.wk) + bytes(&lw.wv);
        sites[Site::O as usize] += bytes(&lw.wo);
        sites[Site::GateUp as usize] += bytes(&lw.w_gate) + bytes(&lw.w_up);
        sites[Site::Down as usize] += bytes(&lw.w_down);
    }
    (sites, bytes(&model.weights.output))
}

/// The decode speed-up over dense if a token read only the weight bytes whose inputs are non-zero: the bytes
/// ceiling (`skipped`: the share of layer bytes skipped, weighted as [`site_bytes`]).
pub fn bytes_ceiling(model: &model::Model, skipped: f64) -> f64 {
    let (sites, head) = site_bytes(model);
    let layers: f64 = sites.iter().sum();
    (layers + head) / (layers * (1.0 - skipped) + head)
}

/// One target sparsity of a [`curve`].
#[derive(Clone, Debug)]
pub struct CurvePoint {
    /// The share fitted for at each [`Site`] (0: dense there).
    pub target: [f64; SITES],
    /// The share of the layers' weight bytes whose input was zero on the evaluated text ([`site_bytes`]).
    pub achieved: f64,
    /// [`bytes_ceiling`] at `achieved`: one row's decode speed-up over dense if those bytes were not read.
    pub ceiling: f64,
    /// The same per [`Site`].
    pub per_site: [f64; SITES],
    /// [`CurvePoint::achieved`] for groups of [`model::sparsity::GROUPS`] consecutive rows (a column is read
    /// unless its input is zero in every row of the group).
    pub groups: [f64; model::sparsity::GROUPS.len()],
    pub ppl: f64,
    /// Scored positions whose top-1 equals dense's.
    pub agreement: f64,
}

/// How [`curve`] turns a target share per [`Site`] into zeroed inputs.
#[derive(Clone, Debug)]
pub enum Sparsifier<'a> {
    /// Magnitude thresholds from a calibration file ([`ActHistograms::thresholds_per_site`]): element sparsity.
    Fitted(&'a ActHistograms),
    /// Per row, the share of blocks of this many consecutive inputs with the smallest norm
    /// ([`model::BlockSparsity`]): no calibration; with channel orders (from a recording's
    /// [`ActHistograms::channel_orders`]), blocks of channels of similar mean magnitude instead.
    Blocks(usize, Option<std::sync::Arc<Vec<[Vec<u32>; SITES]>>>),
}

impl Sparsifier<'_> {
    fn settings(&self, n_layers: usize, target: [f64; SITES]) -> model::ActThresholds {
        match self {
            Sparsifier::Fitted(hist) => hist.thresholds_per_site(target),
            Sparsifier::Blocks(size, order) => model::ActThresholds {
                layers: vec![[0.0; SITES]; n_layers],
                blocks: Some(model::BlockSparsity { size: *size, share: target, order: order.clone() }),
            },
        }
    }
}

/// What [`curve`] measured.
#[derive(Clone, Debug)]
pub struct Curve {
    pub positions: usize,
    pub ppl_dense: f64,
    pub points: Vec<CurvePoint>,
    pub seconds: f64,
}

/// Teacher-forced quality of every `targets` setting (a share per [`Site`], applied by `how`) on `text`,
/// chunked as `specee perplexity` (the second half of each chunk scored); `progress(done, total)` per chunk forward.
/// The model is dense again afterwards.
pub fn curve(
    engine: &mut Engine,
    how: Sparsifier<'_>,
    targets: &[[f64; SITES]],
    text: &str,
    ctx: usize,
    max_chunks: usize,
    threads: usize,
    mut progress: impl FnMut(usize, usize),
) -> Result<Curve, EngineError> {
    let start = std::time::Instant::now();
    let chunks = text_chunks(engine, text, ctx, max_chunks)?;
    let (first, vocab) = (ctx / 2, engine.model.config.vocab_size);
    let weights = site_bytes(&engine.model).0;
    let total = chunks.len() * (targets.len() + 1);
    let mut ws = Workspace::new(threads);
    let mut kv = KvCache::new(&engine.model.config, ctx);
    let mut hidden = Vec::new();
    let mut done = 0;
    // One pass per setting (dense first): the top-1 of each scored position and the summed NLL.
    let mut pass = |engine: &Engine, ws: &mut Workspace| -> Result<(Vec<u32>, f64), EngineError> {
        let (mut top, mut nll) = (Vec::new(), 0f64);
        for ids in &chunks {
            kv.clear();
            let logits = engine.model.forward(ids, &mut kv, ws, &mut hidden, Logits::All)?;
            for j in first..ctx - 1 {
                let row = &logits[j * vocab..(j + 1) * vocab];
                top.push(decode::sampling::argmax(row));
                nll -= log_prob(row, ids[j + 1]);
            }
            done += 1;
            progress(done, total);
        }
        Ok((top, nll))
    };
    engine.model.set_act_sparsity(None)?;
    let (dense_top, dense_nll) = pass(engine, &mut ws)?;
    let positions = dense_top.len();
    let mut points = Vec::with_capacity(targets.len());
    let mut sparse = || -> Result<(), EngineError> {
        for &target in targets {
            engine.model.set_act_sparsity(Some(how.settings(engine.model.config.n_layers, target)))?;
            ws.reset_act_counts();
            let (top, nll) = pass(engine, &mut ws)?;
            let counts = ws.act_counts();
            let achieved = counts.share(None, weights);
            points.push(CurvePoint {
                target,
                achieved,
                ceiling: bytes_ceiling(&engine.model, achieved),
                per_site: Site::ALL.map(|s| counts.share(Some(s), weights)),
                groups: std::array::from_fn(|k| counts.group_share(k, weights)),
                ppl: (nll / positions as f64).exp(),
                agreement: top.iter().zip(&dense_top).filter(|(a, b)| a == b).count() as f64 / positions as f64,
            });
        }
        Ok(())
    };
    let result = sparse();
    engine.model.set_act_sparsity(None)?;
    result?;
    Ok(Curve {
        positions,
        ppl_dense: (dense_nll / positions as f64).exp(),
        points,
        seconds: start.elapsed().as_secs_f64(),
    })
}
