//! SpecExit's signal heads (issue #30, ../shared/DESIGN.md §6): from the final-normed feature row the draft
//! head already reads, and the position in the reasoning, three signals — confidence (sigmoid: would an answer
//! forced here be the one the full reasoning reaches), progress (sigmoid: share of the reasoning done) and
//! remaining (exp of a log count: reasoning tokens still to come) — and the exit policy that reads them.
//!
//! File (`specee train-reasoning-exit` writes it; safetensors, f32): `w1` `[hidden, n_embd + 1]`, `b1`
//! `[hidden]`, `w2` `[3, hidden]`, `b2` `[3]`; the input is the feature row followed by `ln(1 + t) / 8` (`t`:
//! generated tokens up to and including the row's token). Metadata: `format` = [`FORMAT`], the base model's
//! identity (checked as for draft heads) and the policy the training chose (`alpha`, `confidence`, `progress`,
//! `remaining`).

use crate::error::EngineError;
use std::collections::HashMap;
use std::path::Path;

/// The `format` metadata value of a signal-head file.
pub const FORMAT: &str = "specee-reasoning-signals-1";

/// Scale of the position input: `ln(1 + t) / POSITION_SCALE`.
pub const POSITION_SCALE: f32 = 8.0;

/// A trained `n_embd + 1 → hidden → 3` MLP.
#[derive(Clone, Debug)]
pub struct SignalHead {
    pub n_embd: usize,
    pub hidden: usize,
    pub w1: Vec<f32>,
    pub b1: Vec<f32>,
    pub w2: Vec<f32>,
    pub b2: Vec<f32>,
    pub metadata: HashMap<String, String>,
}

/// When SpecExit cuts: the EWMA weight of each step's signals, and the thresholds the smoothed signals must pass
/// (confidence and progress above, remaining below).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExitPolicy {
    pub alpha: f32,
    pub confidence: f32,
    pub progress: f32,
    pub remaining: f32,
}

impl Default for ExitPolicy {
    /// The published policy: α 0.1, confidence > 0.8, progress > 0.3, remaining < 200.
    fn default() -> Self {
        ExitPolicy { alpha: 0.1, confidence: 0.8, progress: 0.3, remaining: 200.0 }
    }
}

impl ExitPolicy {
    /// Whether the smoothed signals allow an exit.
    pub fn passes(&self, s: &Smoothed) -> bool {
        s.value.is_some_and(|[c, p, r]| c > self.confidence && p > self.progress && r < self.remaining)
    }

    /// The policy stored in a signal-head file's metadata (the published default for what is missing).
    pub fn from_metadata(m: &HashMap<String, String>) -> ExitPolicy {
        let d = ExitPolicy::default();
        let get = |k: &str, v: f32| m.get(k).and_then(|s| s.parse().ok()).unwrap_or(v);
        ExitPolicy {
            alpha: get("alpha", d.alpha),
            confidence: get("confidence", d.confidence),
            progress: get("progress", d.progress),
            remaining: get("remaining", d.remaining),
        }
    }

    /// The policy as metadata entries.
    pub fn to_metadata(&self) -> Vec<(String, String)> {
        [
            ("alpha", self.alpha),
            ("confidence", self.confidence),
            ("progress", self.progress),
            ("remaining", self.remaining),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }
}

/// The exponentially smoothed signals of a generation (none before its first step).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Smoothed {
    pub value: Option<[f32; 3]>,
}

impl Smoothed {
    /// Folds in one step: the mean of its rows' signals, weighted `alpha` against the history.
    pub fn update(&mut self, rows: &[[f32; 3]], alpha: f32) {
        if rows.is_empty() {
            return;
        }
        let mut mean = [0f32; 3];
        for r in rows {
            for k in 0..3 {
                mean[k] += r[k] / rows.len() as f32;
            }
        }
        self.value = Some(match self.value {
            None => mean,
            Some(v) => std::array::from_fn(|k| alpha * mean[k] + (1.0 - alpha) * v[k]),
        });
    }
}

impl SignalHead {
    /// Loads a signal-head file; any defect is a one-line error naming the file.
    pub fn load(path: &Path) -> Result<SignalHead, EngineError> {
        let bytes = std::fs::read(path).map_err(|e| EngineError::Io { path: path.to_path_buf(), source: e })?;
        SignalHead::from_bytes(&bytes, path)
    }

    /// Parses the bytes of a signal-head file (`path` names it in errors).
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<SignalHead, EngineError> {
        let bad = |why: String| EngineError::Profile(format!("signal heads {}: {why}", path.display()));
        let (_, meta) = safetensors::SafeTensors::read_metadata(bytes).map_err(|e| bad(e.to_string()))?;
        let metadata: HashMap<String, String> = meta.metadata().clone().unwrap_or_default();
        if metadata.get("format").map(String::as_str) != Some(FORMAT) {
            return Err(bad(format!("not a signal-head file (metadata format is not {FORMAT})")));
        }
        let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| bad(e.to_string()))?;
        let tensor = |name: &str| -> Result<(Vec<usize>, Vec<f32>), EngineError> {
            let t = st.tensor(name).map_err(|_| bad(format!("no tensor {name}")))?;
            if t.dtype() != safetensors::Dtype::F32 {
                return Err(bad(format!("{name} is {:?}, not F32", t.dtype())));
            }
            let v = t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            Ok((t.shape().to_vec(), v))
        };
        let (s1, w1) = tensor("w1")?;
        let (sb1, b1) = tensor("b1")?;
        let (s2, w2) = tensor("w2")?;
        let (sb2, b2) = tensor("b2")?;
        let [hidden, inputs] = s1[..] else { return Err(bad(format!("w1 has shape {s1:?}, not [hidden, inputs]"))) };
        if inputs < 2 || sb1 != [hidden] || s2 != [3, hidden] || sb2 != [3] {
            return Err(bad(format!("shapes w1 {s1:?}, b1 {sb1:?}, w2 {s2:?}, b2 {sb2:?} do not fit together")));
        }
        let head = SignalHead { n_embd: inputs - 1, hidden, w1, b1, w2, b2, metadata };
        if head.w1.iter().chain(&head.w2).chain(&head.b1).chain(&head.b2).any(|x| !x.is_finite()) {
            return Err(bad("holds a non-finite weight".into()));
        }
        Ok(head)
    }

    /// Loads `path` and checks it was made for the model at `model_path`, with the model's width.
    pub fn load_for(engine: &crate::Engine, path: &Path, model_path: &Path) -> Result<SignalHead, EngineError> {
        let head = SignalHead::load(path)?;
        engine.check_made_for("signal heads", path, &head.metadata, model_path)?;
        if head.n_embd != engine.model.config.n_embd {
            return Err(EngineError::Profile(format!(
                "signal heads {}: made for feature rows of {} values, the model has {}",
                path.display(),
                head.n_embd,
                engine.model.config.n_embd
            )));
        }
        Ok(head)
    }

    /// The raw outputs for one feature row at reasoning position `t`.
    pub fn raw(&self, row: &[f32], t: usize) -> [f32; 3] {
        let mut x = Vec::with_capacity(self.n_embd + 1);
        x.extend_from_slice(&row[..self.n_embd]);
        x.push((1.0 + t as f32).ln() / POSITION_SCALE);
        self.raw_input(&x)
    }

    /// The raw outputs for a whole input (`n_embd + 1` values: the feature row, then the position input).
    pub fn raw_input(&self, x: &[f32]) -> [f32; 3] {
        let n = self.n_embd + 1;
        let h: Vec<f32> = (0..self.hidden)
            .map(|j| {
                let w = &self.w1[j * n..(j + 1) * n];
                (w.iter().zip(x).map(|(a, b)| a * b).sum::<f32>() + self.b1[j]).max(0.0)
            })
            .collect();
        std::array::from_fn(|k| {
            self.w2[k * self.hidden..(k + 1) * self.hidden].iter().zip(&h).map(|(a, b)| a * b).sum::<f32>() + self.b2[k]
        })
    }

    /// Confidence, progress and remaining tokens for one feature row at reasoning position `t`.
    pub fn signals(&self, row: &[f32], t: usize) -> [f32; 3] {
        let [c, p, r] = self.raw(row, t);
        [sigmoid(c), sigmoid(p), r.exp()]
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smoothing_starts_at_the_first_step_and_weights_later_ones_by_alpha() {
        let mut s = Smoothed::default();
        s.update(&[[1.0, 0.0, 100.0], [0.0, 0.0, 300.0]], 0.5);
        assert_eq!(s.value, Some([0.5, 0.0, 200.0]));
        s.update(&[[1.0, 1.0, 0.0]], 0.5);
        assert_eq!(s.value, Some([0.75, 0.5, 100.0]));
        s.update(&[], 0.5);
        assert_eq!(s.value, Some([0.75, 0.5, 100.0]));
        let p = ExitPolicy { alpha: 0.5, confidence: 0.7, progress: 0.4, remaining: 150.0 };
        assert!(p.passes(&s));
        assert!(!ExitPolicy { progress: 0.6, ..p }.passes(&s));
        assert!(!p.passes(&Smoothed::default()));
        assert_eq!(ExitPolicy::from_metadata(&p.to_metadata().into_iter().collect()), p);
    }
}
