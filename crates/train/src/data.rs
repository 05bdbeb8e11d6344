//! Training data for draft heads: token sequences with the target's feature (final-normed hidden state) at
//! every position, collected by running the target itself.
//!
//! Input records are JSON lines: `{"messages": [{"role": "user", "content": ...}, ...]}` (rendered with the
//! model's chat template and answered by the model, greedily, so the head learns the model's own continuations)
//! or `{"text": ...}` (raw text, teacher-forced). `scripts/draft_data.py` writes such files.
//!
//! Saved as safetensors: `tokens` (U32 `[T]`), `features` (F16 `[T, d]`; the last row of each sequence is
//! zero: the target never ran that token), `seq_starts` (U32 `[S + 1]`).

use crate::TrainError;
use decode::speculative::{DraftContext, FeatureSource, Proposer};
use decode::speculative::{DraftTree, SpeculativeError};
use decode::{SamplingParams, SpeculativeDecoder};
use engine::Engine;
use std::collections::HashMap;
use std::path::Path;

/// One input record.
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    /// A conversation; the model writes the next assistant turn.
    Chat(Vec<tokenizer::chat::Message>),
    /// Raw text.
    Text(String),
}

/// Reads a JSON-lines file of records (blank lines skipped).
pub fn read_records(path: &Path) -> Result<Vec<Record>, TrainError> {
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::Io(path.display().to_string(), e))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let bad = |why: &str| TrainError::BadRecord { file: path.display().to_string(), line: i + 1, why: why.into() };
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| bad(&e.to_string()))?;
        if let Some(msgs) = v.get("messages").and_then(|m| m.as_array()) {
            let mut messages = Vec::new();
            for m in msgs {
                let role = m.get("role").and_then(|r| r.as_str()).ok_or_else(|| bad("message without a role"))?;
                let content =
                    m.get("content").and_then(|c| c.as_str()).ok_or_else(|| bad("message without content"))?;
                messages.push(tokenizer::chat::Message::new(role, content));
            }
            out.push(Record::Chat(messages));
        } else if let Some(t) = v.get("text").and_then(|t| t.as_str()) {
            out.push(Record::Text(t.to_string()));
        } else {
            return Err(bad("neither `messages` nor `text`"));
        }
    }
    Ok(out)
}

/// Token sequences with their feature rows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DraftData {
    /// Hidden size.
    pub d: usize,
    /// Every sequence's tokens, concatenated.
    pub tokens: Vec<u32>,
    /// Feature rows as f16 bits (`tokens.len() × d`).
    pub features: Vec<u16>,
    /// Start of each sequence in `tokens`, then the total length.
    pub seq_starts: Vec<u32>,
}

impl DraftData {
    /// Number of sequences.
    pub fn n_sequences(&self) -> usize {
        self.seq_starts.len().saturating_sub(1)
    }

    /// The token range of sequence `s`.
    pub fn sequence(&self, s: usize) -> std::ops::Range<usize> {
        self.seq_starts[s] as usize..self.seq_starts[s + 1] as usize
    }

    /// Feature row of position `i`, as f32.
    pub fn feature(&self, i: usize, out: &mut [f32]) {
        for (o, &h) in out.iter_mut().zip(&self.features[i * self.d..(i + 1) * self.d]) {
            *o = half::f16::from_bits(h).to_f32();
        }
    }

    /// Appends one sequence (`features` has a row per token but the last).
    pub fn push(&mut self, tokens: &[u32], features: &[f32]) {
        if self.seq_starts.is_empty() {
            self.seq_starts.push(0);
        }
        self.tokens.extend_from_slice(tokens);
        self.features.extend(features.iter().map(|&v| half::f16::from_f32(v).to_bits()));
        self.features.resize(self.tokens.len() * self.d, 0);
        self.seq_starts.push(self.tokens.len() as u32);
    }

    /// Writes the data as safetensors.
    pub fn save(&self, path: &Path) -> Result<(), TrainError> {
        use safetensors::tensor::TensorView;
        use safetensors::Dtype;
        let tok: Vec<u8> = self.tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let feat: Vec<u8> = self.features.iter().flat_map(|t| t.to_le_bytes()).collect();
        let starts: Vec<u8> = self.seq_starts.iter().flat_map(|t| t.to_le_bytes()).collect();
        let err = |e: safetensors::SafeTensorError| TrainError::Format(e.to_string());
        let views = vec![
            ("tokens", TensorView::new(Dtype::U32, vec![self.tokens.len()], &tok).map_err(err)?),
            ("features", TensorView::new(Dtype::F16, vec![self.tokens.len(), self.d], &feat).map_err(err)?),
            ("seq_starts", TensorView::new(Dtype::U32, vec![self.seq_starts.len()], &starts).map_err(err)?),
        ];
        let meta = HashMap::from([("format".to_string(), "specee-draft-data-1".to_string())]);
        safetensors::serialize_to_file(views, Some(meta), path).map_err(err)
    }

    /// Reads data written by [`DraftData::save`].
    pub fn load(path: &Path) -> Result<DraftData, TrainError> {
        let bytes = std::fs::read(path).map_err(|e| TrainError::Io(path.display().to_string(), e))?;
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| TrainError::Format(e.to_string()))?;
        let get =
            |name: &str| st.tensor(name).map_err(|_| TrainError::Format(format!("{}: no `{name}`", path.display())));
        let u32s = |b: &[u8]| b.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
        let features = get("features")?;
        let d = features.shape().get(1).copied().unwrap_or(0);
        Ok(DraftData {
            d,
            tokens: u32s(get("tokens")?.data()),
            features: features.data().chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect(),
            seq_starts: u32s(get("seq_starts")?.data()),
        })
    }
}

/// A proposer that drafts nothing but asks for final-norm features: a [`SpeculativeDecoder`] with it decodes
/// densely and keeps every committed token's feature.
struct FeaturesOnly;

impl Proposer for FeaturesOnly {
    fn feature_source(&self) -> FeatureSource {
        FeatureSource::FinalNorm
    }
    fn propose(&mut self, _: &DraftContext<'_>, _: &mut DraftTree) -> Result<(), SpeculativeError> {
        Ok(())
    }
}

/// Limits of [`collect`].
#[derive(Clone, Copy, Debug)]
pub struct CollectOptions {
    /// Tokens the model generates per chat record (at most; it stops at end of generation).
    pub max_new: usize,
    /// Tokens kept of a prompt or text (the beginning).
    pub max_input: usize,
    pub threads: usize,
}

/// Runs the target over `records`, calling `progress(done, tokens_so_far)` after each.
pub fn collect(
    engine: &Engine,
    records: &[Record],
    opts: CollectOptions,
    mut progress: impl FnMut(usize, usize),
) -> Result<DraftData, TrainError> {
    let model = &engine.model;
    let mut data = DraftData { d: model.config.n_embd, ..Default::default() };
    let ctx = opts.max_input + opts.max_new + 8;
    let mut dec = SpeculativeDecoder::new(model, ctx, opts.threads, FeaturesOnly, SamplingParams::greedy());
    for (i, record) in records.iter().enumerate() {
        dec.reset();
        let (mut ids, generate) = match record {
            Record::Chat(messages) => (engine.tokenize_prompt(&engine.render_chat(messages)?), true),
            Record::Text(text) => (engine.tokenize_prompt(text), false),
        };
        ids.truncate(opts.max_input);
        if ids.len() < 3 {
            progress(i + 1, data.tokens.len());
            continue;
        }
        dec.feed(&ids)?;
        if generate {
            let mut produced = 0;
            while produced < opts.max_new {
                let step = dec.step()?;
                produced += step.len();
                if step.iter().any(|&t| engine.tokenizer.is_eog(t)) {
                    break;
                }
            }
        }
        data.push(dec.tokens(), dec.features());
        progress(i + 1, data.tokens.len());
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_round_trips_through_safetensors() {
        let mut data = DraftData { d: 2, ..Default::default() };
        data.push(&[1, 2, 3], &[0.5, -1.0, 2.0, 0.25]);
        data.push(&[7, 8], &[1.5, 3.0]);
        assert_eq!(data.n_sequences(), 2);
        assert_eq!(data.sequence(1), 3..5);
        let path = std::env::temp_dir().join(format!("specee-draft-data-{}.safetensors", std::process::id()));
        data.save(&path).unwrap();
        let back = DraftData::load(&path).unwrap();
        std::fs::remove_file(&path).ok();
        assert_eq!(back, data);
        let mut row = [0.0; 2];
        back.feature(1, &mut row);
        assert_eq!(row, [2.0, 0.25]);
        back.feature(2, &mut row);
        assert_eq!(row, [0.0, 0.0]);
    }

    #[test]
    fn records_parse_and_bad_lines_are_reported() {
        let path = std::env::temp_dir().join(format!("specee-records-{}.jsonl", std::process::id()));
        std::fs::write(&path, "{\"text\": \"hi\"}\n\n{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}]}\n")
            .unwrap();
        let recs = read_records(&path).unwrap();
        assert_eq!(recs[0], Record::Text("hi".into()));
        assert!(matches!(&recs[1], Record::Chat(m) if m.len() == 1));
        std::fs::write(&path, "{\"text\": \"hi\"}\n{\"prompt\": 3}\n").unwrap();
        let err = read_records(&path).unwrap_err().to_string();
        std::fs::remove_file(&path).ok();
        assert!(err.contains(":2"), "{err}");
    }
}
