//! The per-layer exit predictors and their file (`specee-exit-1`), and the 12 features they read.
//!
//! Features at layer `i` for candidates `C` (the draft head's top [`CANDIDATES`] tokens), exactly as
//! ../shared/DESIGN.md §4: `s` = the candidates' logits through the final norm and their head rows, `p =
//! softmax(s)`, `d = p − p_prev` with `p_prev` the `p` of the previously *evaluated* layer of the same token (`d =
//! p` at the first one). Predictor: `sigmoid(w2 · relu(W1 x + b1) + b2)`, `x = [s, p, d]`, 512 hidden units.
//! Beyond the published design, a predictor may read 4 more features, `[s, p, d, q]` with `q` the draft head's
//! log-probabilities of the candidates (how sure the draft was; free, and the same at every layer), and 2 more,
//! `[s, p, d, q, u]` with `u` = [`layer_update`] of the layer just run: the cosine between the residual stream
//! entering and leaving it and the size of its update relative to the result (how much the layer still changes;
//! "saturation" in the early-exit literature; O(d), free next to the head rows).
//!
//! File (safetensors, F32): `layers [K]` (I32: which layers have a predictor), `w1 [K, H, F]` (F = 12, 16 or 18
//! features), `b1 [K, H]`,
//! `w2 [K, H]`, `b2 [K]`. Metadata: `format = specee-exit-1`, `n_layers`, `offline` (the offline layer set,
//! comma-separated), `window`, `offsets` (comma-separated), `threshold` (for verified exits),
//! `threshold_unverified` (for exits that emit the best candidate without a full head), optionally `temperature`
//! (comma-separated, one per layer: an exit's full-vocabulary logits are divided by its layer's temperature, so
//! the distribution it reports or samples from is calibrated; greedy choices do not change), plus informational
//! keys (`base_model`, how it was trained).

use std::collections::HashMap;
use std::path::Path;

/// Candidate tokens per step (the draft head's top 4, as published).
pub const CANDIDATES: usize = 4;
/// Floats per feature vector as published (`[s, p, d]`).
pub const N_FEATURES: usize = 3 * CANDIDATES;
/// Floats per feature vector with the draft's log-probabilities (`[s, p, d, q]`).
pub const DRAFT_FEATURES: usize = N_FEATURES + CANDIDATES;
/// Floats of [`layer_update`].
pub const UPDATE_FEATURES: usize = 2;
/// Floats per feature vector with the layer's update as well (`[s, p, d, q, u]`).
pub const MAX_FEATURES: usize = DRAFT_FEATURES + UPDATE_FEATURES;
/// The feature counts a predictor may read (the first `n_in` of the feature vector).
pub const FEATURE_COUNTS: [usize; 3] = [N_FEATURES, DRAFT_FEATURES, MAX_FEATURES];
/// The file's format tag.
pub const FORMAT: &str = "specee-exit-1";

/// What can go wrong loading predictors.
#[derive(Debug, thiserror::Error)]
pub enum PredictorError {
    #[error("reading {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("not a safetensors file: {0}")]
    Format(String),
    #[error("exit predictor file has no tensor `{0}`")]
    Missing(String),
    #[error("exit predictor tensor `{name}` has shape {got:?}, expected {want:?}")]
    Shape { name: String, got: Vec<usize>, want: Vec<usize> },
    #[error("exit predictor format `{0}` is not `{FORMAT}`")]
    UnknownFormat(String),
    #[error("exit predictors are for a {file}-layer model, this model has {model} layers")]
    Layers { file: usize, model: usize },
    #[error("bad metadata `{key}`: {why}")]
    Metadata { key: String, why: String },
}

/// One layer's MLP (`n_in → hidden → 1`).
#[derive(Clone, Debug)]
pub struct Mlp {
    /// Features read: one of [`FEATURE_COUNTS`] (the first `n_in` of the feature vector).
    pub n_in: usize,
    /// `hidden × n_in`, row-major.
    pub w1: Vec<f32>,
    pub b1: Vec<f32>,
    pub w2: Vec<f32>,
    pub b2: f32,
}

impl Mlp {
    /// Hidden units.
    pub fn hidden(&self) -> usize {
        self.b1.len()
    }

    /// The exit probability for one feature vector (its first `n_in` entries).
    pub fn predict(&self, x: &[f32]) -> f32 {
        let x = &x[..self.n_in];
        let mut z = self.b2;
        for ((w, b), w2) in self.w1.chunks_exact(self.n_in).zip(&self.b1).zip(&self.w2) {
            let h = b + w.iter().zip(x).map(|(a, b)| a * b).sum::<f32>();
            if h > 0.0 {
                z += h * w2;
            }
        }
        1.0 / (1.0 + (-z).exp())
    }
}

/// The exit schedule's settings (two levels: an offline layer set, plus layers near recent exits).
#[derive(Clone, Debug, PartialEq)]
pub struct ScheduleConfig {
    /// Layers always evaluated.
    pub offline: Vec<usize>,
    /// How many recent exit layers feed the online set.
    pub window: usize,
    /// Offsets around each recent exit layer added to the online set.
    pub offsets: Vec<i32>,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        ScheduleConfig { offline: Vec::new(), window: 5, offsets: vec![-2, 0, 2] }
    }
}

/// The trained predictors of one model.
#[derive(Clone, Debug)]
pub struct ExitPredictors {
    /// Layers of the model.
    pub n_layers: usize,
    /// Predictor of each layer (None: never evaluated).
    pub layers: Vec<Option<Mlp>>,
    pub schedule: ScheduleConfig,
    /// Exit threshold when the exit is verified with a full head.
    pub threshold: f32,
    /// Exit threshold when the best candidate is emitted without a full head.
    pub threshold_unverified: f32,
    /// Temperature of each layer's exit logits (empty: 1 everywhere; see the module header).
    pub temperature: Vec<f32>,
    /// Informational metadata.
    pub metadata: HashMap<String, String>,
}

/// How much a layer changed the residual stream: `[cos(h_in, h_out), ‖h_out − h_in‖ / ‖h_out‖]` (`[1, 0]` for a
/// zero vector). Accumulated in f64 so training traces and inference agree to the last bit.
pub fn layer_update(h_in: &[f32], h_out: &[f32]) -> [f32; UPDATE_FEATURES] {
    let (mut dot, mut nin, mut nout, mut ndiff) = (0f64, 0f64, 0f64, 0f64);
    for (&a, &b) in h_in.iter().zip(h_out) {
        let (a, b) = (a as f64, b as f64);
        dot += a * b;
        nin += a * a;
        nout += b * b;
        ndiff += (b - a) * (b - a);
    }
    if nin == 0.0 || nout == 0.0 {
        return [1.0, 0.0];
    }
    [(dot / (nin * nout).sqrt()) as f32, (ndiff / nout).sqrt() as f32]
}

/// The features of one evaluated layer: `[s, softmax(s), softmax(s) − p_prev, draft_lp, update]` (the published
/// 12, the draft's 4 log-probabilities, the layer's [`layer_update`]). Returns them and `softmax(s)`.
pub fn features(
    s: &[f32; CANDIDATES],
    p_prev: Option<&[f32; CANDIDATES]>,
    draft_lp: &[f32; CANDIDATES],
    update: &[f32; UPDATE_FEATURES],
) -> ([f32; MAX_FEATURES], [f32; CANDIDATES]) {
    let max = s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut p = [0f32; CANDIDATES];
    let mut sum = 0.0;
    for (pi, &si) in p.iter_mut().zip(s) {
        *pi = (si - max).exp();
        sum += *pi;
    }
    p.iter_mut().for_each(|v| *v /= sum);
    let mut x = [0f32; MAX_FEATURES];
    x[..CANDIDATES].copy_from_slice(s);
    x[N_FEATURES..DRAFT_FEATURES].copy_from_slice(draft_lp);
    x[DRAFT_FEATURES..].copy_from_slice(update);
    x[CANDIDATES..2 * CANDIDATES].copy_from_slice(&p);
    for j in 0..CANDIDATES {
        x[2 * CANDIDATES + j] = p[j] - p_prev.map_or(0.0, |q| q[j]);
    }
    (x, p)
}

fn parse_list<T: std::str::FromStr>(key: &str, v: &str) -> Result<Vec<T>, PredictorError> {
    v.split(',')
        .filter(|x| !x.trim().is_empty())
        .map(|x| {
            x.trim().parse().map_err(|_| PredictorError::Metadata { key: key.into(), why: format!("bad number `{x}`") })
        })
        .collect()
}

fn f32_tensor(st: &safetensors::SafeTensors<'_>, name: &str, want: &[usize]) -> Result<Vec<f32>, PredictorError> {
    let t = st.tensor(name).map_err(|_| PredictorError::Missing(name.into()))?;
    if t.shape() != want || t.dtype() != safetensors::Dtype::F32 {
        return Err(PredictorError::Shape { name: name.into(), got: t.shape().to_vec(), want: want.to_vec() });
    }
    Ok(t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

impl ExitPredictors {
    /// Loads a predictor file.
    pub fn load(path: impl AsRef<Path>) -> Result<ExitPredictors, PredictorError> {
        let path = path.as_ref();
        let bytes =
            std::fs::read(path).map_err(|source| PredictorError::Io { path: path.display().to_string(), source })?;
        ExitPredictors::from_bytes(&bytes)
    }

    /// Parses a predictor file.
    pub fn from_bytes(bytes: &[u8]) -> Result<ExitPredictors, PredictorError> {
        let (_, meta) =
            safetensors::SafeTensors::read_metadata(bytes).map_err(|e| PredictorError::Format(e.to_string()))?;
        let metadata: HashMap<String, String> = meta.metadata().clone().unwrap_or_default();
        match metadata.get("format") {
            Some(f) if f == FORMAT => {}
            Some(f) => return Err(PredictorError::UnknownFormat(f.clone())),
            None => return Err(PredictorError::Missing("format (metadata)".into())),
        }
        let get = |key: &str| -> Result<&String, PredictorError> {
            metadata.get(key).ok_or_else(|| PredictorError::Missing(format!("{key} (metadata)")))
        };
        let num = |key: &str| -> Result<f32, PredictorError> {
            get(key)?.parse().map_err(|_| PredictorError::Metadata { key: key.into(), why: "not a number".into() })
        };
        let n_layers = num("n_layers")? as usize;
        let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| PredictorError::Format(e.to_string()))?;
        let lt = st.tensor("layers").map_err(|_| PredictorError::Missing("layers".into()))?;
        let k = lt.shape().first().copied().unwrap_or(0);
        if lt.shape() != [k] || lt.dtype() != safetensors::Dtype::I32 {
            return Err(PredictorError::Shape { name: "layers".into(), got: lt.shape().to_vec(), want: vec![k] });
        }
        let ids: Vec<usize> =
            lt.data().chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize).collect();
        let b1t = st.tensor("b1").map_err(|_| PredictorError::Missing("b1".into()))?;
        let h = b1t.shape().get(1).copied().unwrap_or(0);
        let w1t = st.tensor("w1").map_err(|_| PredictorError::Missing("w1".into()))?;
        let f = w1t.shape().get(2).copied().unwrap_or(0);
        if !FEATURE_COUNTS.contains(&f) {
            return Err(PredictorError::Shape {
                name: "w1".into(),
                got: w1t.shape().to_vec(),
                want: vec![k, h, N_FEATURES],
            });
        }
        let w1 = f32_tensor(&st, "w1", &[k, h, f])?;
        let b1 = f32_tensor(&st, "b1", &[k, h])?;
        let w2 = f32_tensor(&st, "w2", &[k, h])?;
        let b2 = f32_tensor(&st, "b2", &[k])?;
        let mut layers = vec![None; n_layers];
        for (j, &il) in ids.iter().enumerate() {
            if il >= n_layers {
                return Err(PredictorError::Metadata {
                    key: "layers".into(), why: format!("layer {il} ≥ {n_layers}")
                });
            }
            layers[il] = Some(Mlp {
                n_in: f,
                w1: w1[j * h * f..(j + 1) * h * f].to_vec(),
                b1: b1[j * h..(j + 1) * h].to_vec(),
                w2: w2[j * h..(j + 1) * h].to_vec(),
                b2: b2[j],
            });
        }
        let schedule = ScheduleConfig {
            offline: parse_list("offline", get("offline")?)?,
            window: num("window")? as usize,
            offsets: parse_list("offsets", get("offsets")?)?,
        };
        if let Some(&bad) = schedule.offline.iter().find(|&&l| l >= n_layers) {
            return Err(PredictorError::Metadata { key: "offline".into(), why: format!("layer {bad} ≥ {n_layers}") });
        }
        let temperature: Vec<f32> = match metadata.get("temperature") {
            Some(v) => parse_list("temperature", v)?,
            None => Vec::new(),
        };
        if !temperature.is_empty()
            && (temperature.len() != n_layers || temperature.iter().any(|t| !(t.is_finite() && *t > 0.0)))
        {
            return Err(PredictorError::Metadata {
                key: "temperature".into(),
                why: format!("need {n_layers} positive numbers, got {temperature:?}"),
            });
        }
        Ok(ExitPredictors {
            n_layers,
            layers,
            schedule,
            threshold: num("threshold")?,
            threshold_unverified: num("threshold_unverified")?,
            temperature,
            metadata,
        })
    }

    /// No predictors at all for an `n_layers`-layer model (a decoder built with them never exits: used to trace
    /// training data).
    pub fn empty(n_layers: usize) -> ExitPredictors {
        ExitPredictors {
            n_layers,
            layers: vec![None; n_layers],
            schedule: ScheduleConfig::default(),
            threshold: 0.5,
            threshold_unverified: 0.9,
            temperature: Vec::new(),
            metadata: HashMap::new(),
        }
    }

    /// The temperature of layer `il`'s exit logits (1 when the file has none).
    pub fn temperature(&self, il: usize) -> f32 {
        self.temperature.get(il).copied().unwrap_or(1.0)
    }

    /// Divides exit logits of layer `il` by its temperature (nothing when it is 1).
    pub fn calibrate(&self, il: usize, logits: &mut [f32]) {
        let t = self.temperature(il);
        if t != 1.0 {
            let inv = 1.0 / t;
            logits.iter_mut().for_each(|z| *z *= inv);
        }
    }

    /// Checks that the predictors were trained for a model with `n_layers` layers.
    pub fn check_fits(&self, n_layers: usize) -> Result<(), PredictorError> {
        if self.n_layers != n_layers {
            return Err(PredictorError::Layers { file: self.n_layers, model: n_layers });
        }
        Ok(())
    }

    /// Serializes to the bytes of a safetensors file (informational `extra` metadata added).
    pub fn to_bytes(&self) -> Result<Vec<u8>, PredictorError> {
        use safetensors::tensor::TensorView;
        let present: Vec<(usize, &Mlp)> =
            self.layers.iter().enumerate().filter_map(|(i, m)| m.as_ref().map(|m| (i, m))).collect();
        let k = present.len();
        let h = present.first().map_or(0, |(_, m)| m.hidden());
        let f = present.first().map_or(N_FEATURES, |(_, m)| m.n_in);
        if present.iter().any(|(_, m)| m.hidden() != h || m.n_in != f) {
            return Err(PredictorError::Metadata { key: "layers".into(), why: "predictors differ in shape".into() });
        }
        let f32s = |v: Vec<f32>| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let ids: Vec<u8> = present.iter().flat_map(|(i, _)| (*i as i32).to_le_bytes()).collect();
        let w1 = f32s(present.iter().flat_map(|(_, m)| m.w1.iter().copied()).collect());
        let b1 = f32s(present.iter().flat_map(|(_, m)| m.b1.iter().copied()).collect());
        let w2 = f32s(present.iter().flat_map(|(_, m)| m.w2.iter().copied()).collect());
        let b2 = f32s(present.iter().map(|(_, m)| m.b2).collect());
        let err = |e: safetensors::SafeTensorError| PredictorError::Format(e.to_string());
        let views = vec![
            ("layers", TensorView::new(safetensors::Dtype::I32, vec![k], &ids).map_err(err)?),
            ("w1", TensorView::new(safetensors::Dtype::F32, vec![k, h, f], &w1).map_err(err)?),
            ("b1", TensorView::new(safetensors::Dtype::F32, vec![k, h], &b1).map_err(err)?),
            ("w2", TensorView::new(safetensors::Dtype::F32, vec![k, h], &w2).map_err(err)?),
            ("b2", TensorView::new(safetensors::Dtype::F32, vec![k], &b2).map_err(err)?),
        ];
        let join = |v: &[String]| v.join(",");
        let mut metadata = self.metadata.clone();
        metadata.insert("format".into(), FORMAT.into());
        metadata.insert("n_layers".into(), self.n_layers.to_string());
        metadata
            .insert("offline".into(), join(&self.schedule.offline.iter().map(|l| l.to_string()).collect::<Vec<_>>()));
        metadata.insert("window".into(), self.schedule.window.to_string());
        metadata
            .insert("offsets".into(), join(&self.schedule.offsets.iter().map(|l| l.to_string()).collect::<Vec<_>>()));
        metadata.insert("threshold".into(), self.threshold.to_string());
        metadata.insert("threshold_unverified".into(), self.threshold_unverified.to_string());
        metadata.remove("temperature");
        if !self.temperature.is_empty() {
            metadata.insert(
                "temperature".into(),
                join(&self.temperature.iter().map(|t| t.to_string()).collect::<Vec<_>>()),
            );
        }
        safetensors::serialize(views, Some(metadata)).map_err(err)
    }

    /// Writes the file (atomically: a temporary file renamed into place).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), PredictorError> {
        let path = path.as_ref();
        let io = |source| PredictorError::Io { path: path.display().to_string(), source };
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, self.to_bytes()?).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Predictors with random weights on every layer (for tests).
    pub(crate) fn random_predictors(n_layers: usize, hidden: usize, seed: u64) -> ExitPredictors {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let mut next = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.5
        };
        let layers = (0..n_layers)
            .map(|_| {
                Some(Mlp {
                    n_in: MAX_FEATURES,
                    w1: (0..hidden * MAX_FEATURES).map(|_| next()).collect(),
                    b1: (0..hidden).map(|_| next()).collect(),
                    w2: (0..hidden).map(|_| next()).collect(),
                    b2: next(),
                })
            })
            .collect();
        ExitPredictors {
            n_layers,
            layers,
            schedule: ScheduleConfig { offline: vec![0, 1], ..ScheduleConfig::default() },
            threshold: 0.5,
            threshold_unverified: 0.9,
            temperature: Vec::new(),
            metadata: HashMap::new(),
        }
    }

    #[test]
    fn features_are_logits_probabilities_and_deltas() {
        let s = [2.0, 1.0, 0.0, -1.0];
        let q = [-0.1, -2.0, -3.0, -4.0];
        let u = [0.9, 0.4];
        let (x, p) = features(&s, None, &q, &u);
        assert_eq!(&x[..4], &s);
        assert_eq!(&x[12..16], &q);
        assert_eq!(&x[16..], &u);
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(p[0] > p[1] && p[1] > p[2]);
        assert_eq!(&x[8..12], &p, "first evaluated layer: delta = p");
        let (x2, p2) = features(&[0.0; 4], Some(&p), &q, &u);
        assert!(p2.iter().all(|&v| (v - 0.25).abs() < 1e-6));
        for j in 0..4 {
            assert!((x2[8 + j] - (0.25 - p[j])).abs() < 1e-6);
        }
    }

    #[test]
    fn layer_update_is_cosine_and_relative_change() {
        // h_out = h_in + a perpendicular vector of the same length: cos 1/√2, |Δ|/|h_out| = 1/√2.
        let u = layer_update(&[3.0, 0.0, 0.0], &[3.0, 3.0, 0.0]);
        assert!((u[0] - 0.5f32.sqrt()).abs() < 1e-6 && (u[1] - 0.5f32.sqrt()).abs() < 1e-6, "{u:?}");
        // An unchanged stream, a scaled one, and the zero vector.
        assert_eq!(layer_update(&[1.0, -2.0], &[1.0, -2.0]), [1.0, 0.0]);
        let u = layer_update(&[1.0, -2.0], &[2.0, -4.0]);
        assert!((u[0] - 1.0).abs() < 1e-6 && (u[1] - 0.5).abs() < 1e-6, "{u:?}");
        assert_eq!(layer_update(&[0.0, 0.0], &[1.0, 0.0]), [1.0, 0.0]);
    }

    #[test]
    fn mlp_matches_a_hand_computation() {
        let mut w1 = vec![0.0; 2 * N_FEATURES];
        w1[0] = 1.0; // unit 0 reads s0
        w1[N_FEATURES + 1] = -1.0; // unit 1 reads −s1
        let m = Mlp { n_in: N_FEATURES, w1, b1: vec![0.0, 0.5], w2: vec![2.0, 3.0], b2: -1.0 };
        let mut x = [0.0; N_FEATURES];
        x[0] = 1.5;
        x[1] = 1.0; // unit 1: −1 + 0.5 < 0 → relu 0
        let want = 1.0 / (1.0 + (-(2.0 * 1.5 - 1.0f32)).exp());
        assert!((m.predict(&x) - want).abs() < 1e-6);
    }

    #[test]
    fn file_round_trips_and_bad_files_are_refused() {
        let p = random_predictors(6, 8, 1);
        let bytes = p.to_bytes().unwrap();
        let q = ExitPredictors::from_bytes(&bytes).unwrap();
        assert_eq!(q.n_layers, 6);
        assert_eq!(q.schedule, p.schedule);
        assert_eq!(q.threshold, 0.5);
        assert!(q.layers[5].is_some() && q.layers[0].is_some());
        let x = [0.3; MAX_FEATURES];
        assert_eq!(q.layers[2].as_ref().unwrap().predict(&x), p.layers[2].as_ref().unwrap().predict(&x));
        assert!(matches!(q.check_fits(7), Err(PredictorError::Layers { file: 6, model: 7 })));
        assert!(q.temperature.is_empty() && q.temperature(3) == 1.0);
        let t = ExitPredictors { temperature: vec![1.0, 2.0, 0.5, 1.25, 3.0, 1.0], ..p.clone() };
        let q = ExitPredictors::from_bytes(&t.to_bytes().unwrap()).unwrap();
        assert_eq!(q.temperature, t.temperature);
        let mut z = [2.0, -4.0];
        q.calibrate(1, &mut z);
        assert_eq!(z, [1.0, -2.0]);
        let bad = ExitPredictors { temperature: vec![1.0; 5], ..p.clone() };
        assert!(matches!(ExitPredictors::from_bytes(&bad.to_bytes().unwrap()), Err(PredictorError::Metadata { .. })));
        assert!(matches!(ExitPredictors::from_bytes(b"nonsense"), Err(PredictorError::Format(_))));
    }
}
