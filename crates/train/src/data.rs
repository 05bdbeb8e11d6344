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
    parse_records(&text, path)
}

/// [`read_records`] on a file's text (`path` names it in errors).
pub fn parse_records(text: &str, path: &Path) -> Result<Vec<Record>, TrainError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let bad = |why: &str| TrainError::BadRecord { file: path.display().to_string(), line: i + 1, why: why.into() };
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| bad(&e.to_string()))?;
        if let Some(messages) = engine::bench::json_messages(&v) {
            out.push(Record::Chat(messages.map_err(|e| bad(&e))?));
        } else if let Some(t) = v.get("text").and_then(|t| t.as_str()) {
            out.push(Record::Text(t.to_string()));
        } else {
            return Err(bad("neither `messages` nor `text`"));
        }
    }
    Ok(out)
}

/// A conversation as the model's chat template renders it; for a model without one (a base model such as
/// Gemma-3-270m) a plain `User: …` / `Assistant:` transcript, which a base model continues as an answer.
pub fn render_chat(engine: &Engine, messages: &[tokenizer::chat::Message]) -> Result<String, TrainError> {
    match engine.render_chat(messages) {
        Err(engine::EngineError::NoChatTemplate) => {
            let mut text = String::new();
            for m in messages {
                let role = if m.role == "assistant" { "Assistant" } else { "User" };
                text.push_str(&format!("{role}: {}\n", m.content));
            }
            text.push_str("Assistant:");
            Ok(text)
        }
        other => Ok(other?),
    }
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
    /// Per sequence, where the model's own generated tokens start (its end for texts). Empty in files from
    /// before it existed (then every position counts as generated).
    pub gen_starts: Vec<u32>,
    /// Floats per row of [`DraftData::aux`] (0: none).
    pub aux_width: usize,
    /// Extra feature rows for fused heads, as f16 bits (`tokens.len() × aux_width`): the residual stream entering
    /// some layers (see [`trace_layer_inputs`]); the last row of each sequence is zero like the features'.
    pub aux: Vec<u16>,
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

    /// Where the generated part of sequence `s` starts (see [`DraftData::gen_starts`]).
    pub fn generated_from(&self, s: usize) -> usize {
        self.gen_starts.get(s).map_or(self.seq_starts[s] as usize, |&g| g as usize)
    }

    /// Feature row of position `i`, as f32.
    pub fn feature(&self, i: usize, out: &mut [f32]) {
        for (o, &h) in out.iter_mut().zip(&self.features[i * self.d..(i + 1) * self.d]) {
            *o = half::f16::from_bits(h).to_f32();
        }
    }

    /// Aux row of position `i`, as f32.
    pub fn aux_row(&self, i: usize, out: &mut [f32]) {
        let w = self.aux_width;
        for (o, &h) in out.iter_mut().zip(&self.aux[i * w..(i + 1) * w]) {
            *o = half::f16::from_bits(h).to_f32();
        }
    }

    /// Appends one sequence (`features` has a row per token but the last) whose first `prompt_len` tokens were
    /// given and the rest generated by the model.
    pub fn push(&mut self, tokens: &[u32], features: &[f32], prompt_len: usize) {
        if self.seq_starts.is_empty() {
            self.seq_starts.push(0);
        }
        self.gen_starts.push((self.tokens.len() + prompt_len.min(tokens.len())) as u32);
        self.tokens.extend_from_slice(tokens);
        self.features.extend(features.iter().map(|&v| half::f16::from_f32(v).to_bits()));
        self.features.resize(self.tokens.len() * self.d, 0);
        self.seq_starts.push(self.tokens.len() as u32);
    }

    /// Appends every sequence of `other` (collected from the same model: same hidden size).
    pub fn append(&mut self, other: &DraftData) -> Result<(), TrainError> {
        if other.n_sequences() == 0 {
            return Ok(());
        }
        if self.n_sequences() == 0 {
            self.d = other.d;
        } else if self.d != other.d {
            return Err(TrainError::Invalid(format!(
                "draft data of hidden size {} cannot be joined with data of hidden size {}",
                other.d, self.d
            )));
        }
        if self.n_sequences() > 0 && self.aux_width != other.aux_width {
            return Err(TrainError::Invalid("draft data with and without fused-layer rows cannot be joined".into()));
        }
        // Files from before `gen_starts` existed count every position as generated: spell that out so the
        // joined data keeps one entry per sequence.
        if self.gen_starts.is_empty() {
            self.gen_starts = self.seq_starts.iter().take(self.n_sequences()).copied().collect();
        }
        let base = self.tokens.len() as u32;
        if self.seq_starts.is_empty() {
            self.seq_starts.push(0);
        }
        let others_gen = (0..other.n_sequences()).map(|s| other.generated_from(s) as u32);
        self.gen_starts.extend(others_gen.map(|g| g + base));
        self.seq_starts.extend(other.seq_starts[1..].iter().map(|&s| s + base));
        self.tokens.extend_from_slice(&other.tokens);
        self.features.extend_from_slice(&other.features);
        self.aux_width = other.aux_width;
        self.aux.extend_from_slice(&other.aux);
        Ok(())
    }

    /// Writes the data as safetensors, with the key of what it was collected from ([`crate::cache`]).
    pub fn save(&self, path: &Path, key: &crate::cache::CacheKey) -> Result<(), TrainError> {
        use safetensors::tensor::TensorView;
        use safetensors::Dtype;
        let tok: Vec<u8> = self.tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let feat: Vec<u8> = self.features.iter().flat_map(|t| t.to_le_bytes()).collect();
        let starts: Vec<u8> = self.seq_starts.iter().flat_map(|t| t.to_le_bytes()).collect();
        let gens: Vec<u8> = self.gen_starts.iter().flat_map(|t| t.to_le_bytes()).collect();
        let err = |e: safetensors::SafeTensorError| TrainError::Format(e.to_string());
        let views = vec![
            ("tokens", TensorView::new(Dtype::U32, vec![self.tokens.len()], &tok).map_err(err)?),
            ("features", TensorView::new(Dtype::F16, vec![self.tokens.len(), self.d], &feat).map_err(err)?),
            ("seq_starts", TensorView::new(Dtype::U32, vec![self.seq_starts.len()], &starts).map_err(err)?),
            ("gen_starts", TensorView::new(Dtype::U32, vec![self.gen_starts.len()], &gens).map_err(err)?),
        ];
        let mut meta = key.to_metadata();
        meta.insert("format".to_string(), "specee-draft-data-1".to_string());
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
            gen_starts: st.tensor("gen_starts").map(|t| u32s(t.data())).unwrap_or_default(),
            ..Default::default()
        })
    }
}

/// A proposer that drafts nothing but asks for features: a [`SpeculativeDecoder`] with it decodes densely and
/// keeps every committed token's feature row.
struct FeaturesOnly(FeatureSource);

impl Proposer for FeaturesOnly {
    fn feature_source(&self) -> FeatureSource {
        self.0.clone()
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
    /// Records run side by side, each in its own cache, one forward for all of them per step (1: one at a
    /// time). The output is the same whatever the number: only the speed changes (on Qwen2.5-Coder 0.5B, 8 rows
    /// cost ~1.7× one).
    pub batch: usize,
}

/// What a record asks of the model, tokenized and cut to `max_input`; `None` for records too short to use.
fn record_input(engine: &Engine, record: &Record, max_input: usize) -> Result<Option<(Vec<u32>, bool)>, TrainError> {
    let (mut ids, generate) = match record {
        Record::Chat(messages) => (engine.tokenize_prompt(&render_chat(engine, messages)?), true),
        Record::Text(text) => (engine.tokenize_prompt(text), false),
    };
    ids.truncate(max_input);
    Ok((ids.len() >= 3).then_some((ids, generate)))
}

/// One record in flight in [`collect`].
struct Running {
    /// Index of the record.
    index: usize,
    tokens: Vec<u32>,
    /// Tokens given (the rest were generated).
    prompt_len: usize,
    generate: bool,
    /// Feature rows of the tokens run so far.
    features: Vec<f32>,
    /// Tokens to run in the next forward.
    pending: std::ops::Range<usize>,
    kv: model::KvCache,
}

/// A record [`collect`] is done with.
struct Finished {
    tokens: Vec<u32>,
    features: Vec<f32>,
    prompt_len: usize,
}

/// Runs the target over `records`, [`CollectOptions::batch`] at a time, calling `progress(done, tokens_so_far)`
/// as each finishes. Chat records are answered greedily (up to `max_new` tokens or end of generation), texts
/// teacher-forced; every token but the last of each sequence gets its feature (the final-normed hidden state).
/// The result is in record order and does not depend on the batch size.
pub fn collect(
    engine: &Engine,
    records: &[Record],
    opts: CollectOptions,
    mut progress: impl FnMut(usize, usize),
) -> Result<DraftData, TrainError> {
    let model = &engine.model;
    let d = model.config.n_embd;
    let ctx = opts.max_input + opts.max_new + 8;
    let mut ws = model::Workspace::new(opts.threads);
    let mut finished: Vec<Option<Finished>> = (0..records.len()).map(|_| None).collect();
    let mut queue = 0..records.len();
    let (mut done, mut tokens_done) = (0, 0);
    let mut running: Vec<Running> = Vec::new();
    let mut spare_caches: Vec<model::KvCache> = Vec::new();
    let (mut hidden, mut normed, mut last_rows, mut next) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    loop {
        while running.len() < opts.batch.max(1) {
            let Some(index) = queue.next() else { break };
            match record_input(engine, &records[index], opts.max_input)? {
                None => {
                    done += 1;
                    progress(done, tokens_done);
                }
                Some((tokens, generate)) => {
                    let mut kv = spare_caches.pop().unwrap_or_else(|| model.new_cache(ctx));
                    kv.clear();
                    // A text runs all its tokens but the last; a chat prompt all of them (the last one's output
                    // is the first answer token).
                    let pending = 0..tokens.len() - usize::from(!generate);
                    let prompt_len = tokens.len();
                    running.push(Running { index, tokens, prompt_len, generate, features: Vec::new(), pending, kv });
                }
            }
        }
        if running.is_empty() {
            break;
        }
        let (inputs, mut kvs): (Vec<&[u32]>, Vec<&mut model::KvCache>) =
            running.iter_mut().map(|r| (&r.tokens[r.pending.clone()], &mut r.kv)).unzip();
        let rows = inputs.iter().map(|t| t.len()).sum::<usize>();
        model.forward_batch(&inputs, &mut kvs, &mut ws, &mut hidden)?;
        normed.resize(rows * d, 0.0);
        model.final_norm(&hidden[..rows * d], &mut normed[..rows * d]);
        // Every generating record's next token, from its last row, in one head product.
        last_rows.clear();
        let mut row = 0;
        for r in &mut running {
            let m = r.pending.len();
            r.features.extend_from_slice(&normed[row * d..(row + m) * d]);
            if r.generate {
                last_rows.extend_from_slice(&normed[(row + m - 1) * d..(row + m) * d]);
            }
            row += m;
        }
        let generating = last_rows.len() / d;
        next.resize(generating, 0u32);
        if generating > 0 {
            model.head_argmax(&last_rows, generating, &mut next, &mut ws);
        }
        let mut answers = next.iter();
        let mut still = Vec::with_capacity(running.len());
        for mut r in running.drain(..) {
            let finished_now = if r.generate {
                let &t = answers.next().expect("one answer per generating record");
                r.tokens.push(t);
                r.pending = r.tokens.len() - 1..r.tokens.len();
                r.tokens.len() - r.prompt_len >= opts.max_new || engine.tokenizer.is_eog(t)
            } else {
                true
            };
            if finished_now {
                if !r.generate {
                    r.prompt_len = r.tokens.len();
                }
                done += 1;
                tokens_done += r.tokens.len();
                let index = r.index;
                finished[index] = Some(Finished { tokens: r.tokens, features: r.features, prompt_len: r.prompt_len });
                spare_caches.push(r.kv);
                progress(done, tokens_done);
            } else {
                still.push(r);
            }
        }
        running = still;
    }
    let mut data = DraftData { d, ..Default::default() };
    for r in finished.into_iter().flatten() {
        data.push(&r.tokens, &r.features, r.prompt_len);
    }
    Ok(data)
}

/// [`collect`] one record at a time through the speculative decoder with a proposer that drafts nothing: the
/// plain definition of what `collect` computes, kept as its test oracle.
#[doc(hidden)]
pub fn collect_one_by_one(engine: &Engine, records: &[Record], opts: CollectOptions) -> Result<DraftData, TrainError> {
    let model = &engine.model;
    let mut data = DraftData { d: model.config.n_embd, ..Default::default() };
    let ctx = opts.max_input + opts.max_new + 8;
    let mut dec = SpeculativeDecoder::new(
        model,
        ctx,
        opts.threads,
        FeaturesOnly(FeatureSource::FinalNorm),
        SamplingParams::greedy(),
    );
    for record in records {
        let Some((ids, generate)) = record_input(engine, record, opts.max_input)? else { continue };
        dec.reset();
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
        let prompt_len = if generate { ids.len() } else { dec.tokens().len() };
        data.push(dec.tokens(), dec.features(), prompt_len);
    }
    Ok(data)
}

/// The residual stream entering each of `layers` at every position of `data` (teacher-forced over its token
/// sequences, as the feature rows were collected), as [`DraftData::aux`] rows; `progress(done)` after each
/// sequence.
pub fn trace_layer_inputs(
    model: &model::Model,
    data: &DraftData,
    layers: &[usize],
    threads: usize,
    mut progress: impl FnMut(usize),
) -> Result<Vec<u16>, TrainError> {
    if let Some(&l) = layers.iter().find(|&&l| l > model.config.n_layers) {
        return Err(TrainError::Invalid(format!("layer {l} is past the model's {} layers", model.config.n_layers)));
    }
    let w = layers.len() * model.config.n_embd;
    let longest = (0..data.n_sequences()).map(|s| data.sequence(s).len()).max().unwrap_or(0);
    let source = FeatureSource::LayerInputs(layers.to_vec());
    let mut dec = SpeculativeDecoder::new(model, longest + 1, threads, FeaturesOnly(source), SamplingParams::greedy());
    let mut aux = Vec::with_capacity(data.tokens.len() * w);
    for s in 0..data.n_sequences() {
        dec.reset();
        dec.feed(&data.tokens[data.sequence(s)])?;
        aux.extend(dec.features().iter().map(|&v| half::f16::from_f32(v).to_bits()));
        aux.resize(data.seq_starts[s + 1] as usize * w, 0);
        progress(s + 1);
    }
    Ok(aux)
}

/// Writes aux rows ([`trace_layer_inputs`]) for `layers` as safetensors, with the key of what they were traced
/// from ([`crate::cache`]).
pub fn save_aux(
    path: &Path,
    aux: &[u16],
    rows: usize,
    layers: &[usize],
    key: &crate::cache::CacheKey,
) -> Result<(), TrainError> {
    use safetensors::tensor::TensorView;
    let bytes: Vec<u8> = aux.iter().flat_map(|t| t.to_le_bytes()).collect();
    let err = |e: safetensors::SafeTensorError| TrainError::Format(e.to_string());
    let width = aux.len() / rows.max(1);
    let view = TensorView::new(safetensors::Dtype::F16, vec![rows, width], &bytes).map_err(err)?;
    let layers = layers.iter().map(|l| l.to_string()).collect::<Vec<_>>().join(",");
    let mut meta = key.to_metadata();
    meta.extend([("format".to_string(), "specee-draft-aux-1".to_string()), ("layers".into(), layers)]);
    safetensors::serialize_to_file(vec![("aux", view)], Some(meta), path).map_err(err)
}

/// Reads aux rows written by [`save_aux`]: `(rows as f16 bits, width)`.
pub fn load_aux(path: &Path) -> Result<(Vec<u16>, usize), TrainError> {
    let bytes = std::fs::read(path).map_err(|e| TrainError::Io(path.display().to_string(), e))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| TrainError::Format(e.to_string()))?;
    let t = st.tensor("aux").map_err(|_| TrainError::Format(format!("{}: no `aux`", path.display())))?;
    let width = t.shape().get(1).copied().unwrap_or(0);
    Ok((t.data().chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect(), width))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_round_trips_through_safetensors() {
        let mut data = DraftData { d: 2, ..Default::default() };
        data.push(&[1, 2, 3], &[0.5, -1.0, 2.0, 0.25], 1);
        data.push(&[7, 8], &[1.5, 3.0], 2);
        assert_eq!(data.n_sequences(), 2);
        assert_eq!(data.sequence(1), 3..5);
        assert_eq!((data.generated_from(0), data.generated_from(1)), (1, 5));
        let path = std::env::temp_dir().join(format!("specee-draft-data-{}.safetensors", std::process::id()));
        data.save(&path, &crate::cache::CacheKey::new()).unwrap();
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
    fn appended_data_equals_data_collected_in_one_go() {
        let seqs: [(&[u32], &[f32], usize); 3] =
            [(&[1, 2, 3], &[0.5, -1.0, 2.0, 0.25], 1), (&[7, 8], &[1.5, 3.0], 2), (&[4, 5, 6], &[1.0; 4], 0)];
        let mut whole = DraftData { d: 2, ..Default::default() };
        seqs.iter().for_each(|(t, f, p)| whole.push(t, f, *p));
        let (mut a, mut b) = (DraftData { d: 2, ..Default::default() }, DraftData { d: 2, ..Default::default() });
        seqs[..1].iter().for_each(|(t, f, p)| a.push(t, f, *p));
        seqs[1..].iter().for_each(|(t, f, p)| b.push(t, f, *p));
        let mut joined = DraftData::default();
        joined.append(&a).unwrap();
        joined.append(&b).unwrap();
        assert_eq!(joined, whole);
        assert_eq!((joined.sequence(2), joined.generated_from(1)), (5..8, 5));
        // A file from before `gen_starts` existed: all its positions count as generated after the join too.
        let mut old = a.clone();
        old.gen_starts.clear();
        old.append(&b).unwrap();
        assert_eq!((old.generated_from(0), old.generated_from(1), old.generated_from(2)), (0, 5, 5));
        let wide = DraftData {
            d: 3,
            tokens: vec![1],
            features: vec![0; 3],
            seq_starts: vec![0, 1],
            gen_starts: vec![0],
            ..Default::default()
        };
        assert!(matches!(joined.append(&wide), Err(TrainError::Invalid(_))));
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
