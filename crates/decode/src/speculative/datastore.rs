//! Datastore lookup (REST, He et al., 2024, "REST: Retrieval-Based Speculative Decoding", arXiv:2311.08252, made
//! small): what the model itself wrote after the same n tokens in its greedy answers to other prompts. A model's
//! answers repeat its own phrasing across prompts ("The `ls` command is a command-line tool used to …", code
//! fences, list openings), which neither the draft head (a few percent of top-1 short on such runs) nor the
//! context lookup (the phrase has not occurred in *this* context yet) drafts several tokens deep.
//!
//! The table maps a hash of the last `n` tokens (`min_n ≤ n ≤ max_n`) to the token that most often followed them
//! in the data, with its frequency as the draft probability; a lookup tries the longest suffix first. Only the
//! model's own generated tokens are predicted (prompts and raw text are context, never targets), so the store
//! drafts the model's style, not the prompts'. A hash collision or a stale entry only costs a rejected draft
//! token: verification keeps decoding lossless.
//!
//! Measured on SmolLM2 (`heads/README.md`): beside the shipped head it raises τ by up to 0.15 but adds more
//! verified rows than that saves on 2 cores (the head learned the same phrases), so no store is shipped.
//!
//! File (safetensors, `format` = `specee-datastore-1`): `keys` (U64 `[E]`, sorted), `next` (U32 `[E]`),
//! `prob` (F32 `[E]`); metadata `min_n`, `max_n`, `n_vocab` (the model's, checked on load) plus what
//! `specee build-datastore` records of the build (`model`, `data`, `generated_tokens`, `min_count`, `min_prob`).

use std::collections::HashMap;
use std::path::Path;

/// Errors reading a datastore.
#[derive(Debug, thiserror::Error)]
pub enum DatastoreError {
    #[error("cannot read {0}: {1}")]
    Io(String, std::io::Error),
    #[error("not a datastore: {0}")]
    Format(String),
    #[error("the datastore was built for a vocabulary of {built} tokens; this model has {model}")]
    Vocab { built: usize, model: usize },
}

/// What [`Datastore::build`] keeps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BuildOptions {
    /// Shortest suffix stored.
    pub min_n: usize,
    /// Longest suffix stored.
    pub max_n: usize,
    /// N-grams seen fewer times are left out.
    pub min_count: u32,
    /// N-grams whose most frequent follower has a lower share are left out (they draft mostly wrong tokens, and
    /// every drafted token is a verified row).
    pub min_prob: f32,
}

impl Default for BuildOptions {
    fn default() -> Self {
        BuildOptions { min_n: 2, max_n: 6, min_count: 1, min_prob: 0.0 }
    }
}

/// The n-gram table.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Datastore {
    /// Shortest suffix looked up.
    pub min_n: usize,
    /// Longest suffix looked up.
    pub max_n: usize,
    /// Vocabulary size of the model whose answers built it.
    pub n_vocab: usize,
    keys: Vec<u64>,
    next: Vec<u32>,
    prob: Vec<f32>,
    /// Build facts kept in the file's metadata.
    pub metadata: Vec<(String, String)>,
}

/// Hash of an n-gram (`n` is mixed in, so suffixes of different lengths never share a key).
fn ngram_key(tokens: impl Iterator<Item = u32>, n: usize) -> u64 {
    let mut h = 0x9e37_79b9_7f4a_7c15u64 ^ n as u64;
    for t in tokens {
        h = (h.rotate_left(23) ^ u64::from(t)).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    // Final avalanche (splitmix64's), so nearby n-grams spread over the sorted keys.
    h ^= h >> 31;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^ (h >> 29)
}

impl Datastore {
    /// Builds the table from token sequences, each `(tokens, from)`: the tokens at positions `from..` are
    /// predicted, from the up to `max_n` tokens before each (which may reach into the prompt).
    pub fn build<'a>(
        sequences: impl IntoIterator<Item = (&'a [u32], usize)>,
        options: BuildOptions,
        n_vocab: usize,
    ) -> Datastore {
        let min_n = options.min_n.max(1);
        let max_n = options.max_n.max(min_n);
        let mut counts: HashMap<u64, HashMap<u32, u32>> = HashMap::new();
        for (tokens, from) in sequences {
            for t in from.max(1)..tokens.len() {
                for n in min_n..=max_n.min(t) {
                    let key = ngram_key(tokens[t - n..t].iter().copied(), n);
                    *counts.entry(key).or_default().entry(tokens[t]).or_default() += 1;
                }
            }
        }
        let mut entries: Vec<(u64, u32, f32)> = counts
            .into_iter()
            .filter_map(|(key, next)| {
                let total: u32 = next.values().sum();
                // The most frequent follower; ties to the smaller token id, so a build is deterministic.
                let (&token, &count) = next.iter().max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))?;
                let prob = count as f32 / total as f32;
                (total >= options.min_count && prob >= options.min_prob).then_some((key, token, prob))
            })
            .collect();
        entries.sort_unstable_by_key(|e| e.0);
        Datastore {
            min_n,
            max_n,
            n_vocab,
            keys: entries.iter().map(|e| e.0).collect(),
            next: entries.iter().map(|e| e.1).collect(),
            prob: entries.iter().map(|e| e.2).collect(),
            metadata: Vec::new(),
        }
    }

    /// Number of n-grams stored.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The stored follower of the longest suffix of `context ++ extra` (at most `max_n` tokens, at least `min_n`)
    /// that the table holds, with its probability.
    pub fn next(&self, context: &[u32], extra: &[u32]) -> Option<(u32, f32)> {
        let len = context.len() + extra.len();
        for n in (self.min_n..=self.max_n.min(len)).rev() {
            let from_extra = n.min(extra.len());
            let tokens = context[context.len() - (n - from_extra)..].iter().chain(&extra[extra.len() - from_extra..]);
            if let Ok(i) = self.keys.binary_search(&ngram_key(tokens.copied(), n)) {
                return Some((self.next[i], self.prob[i]));
            }
        }
        None
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        use safetensors::tensor::TensorView;
        use safetensors::Dtype;
        let keys: Vec<u8> = self.keys.iter().flat_map(|k| k.to_le_bytes()).collect();
        let next: Vec<u8> = self.next.iter().flat_map(|t| t.to_le_bytes()).collect();
        let prob: Vec<u8> = self.prob.iter().flat_map(|p| p.to_le_bytes()).collect();
        let e = self.len();
        let tensors = [
            ("keys", TensorView::new(Dtype::U64, vec![e], &keys).expect("sizes match")),
            ("next", TensorView::new(Dtype::U32, vec![e], &next).expect("sizes match")),
            ("prob", TensorView::new(Dtype::F32, vec![e], &prob).expect("sizes match")),
        ];
        let mut meta: HashMap<String, String> = self.metadata.iter().cloned().collect();
        meta.insert("format".into(), "specee-datastore-1".into());
        meta.insert("min_n".into(), self.min_n.to_string());
        meta.insert("max_n".into(), self.max_n.to_string());
        meta.insert("n_vocab".into(), self.n_vocab.to_string());
        safetensors::serialize(tensors, Some(meta)).expect("serializing in memory cannot fail")
    }

    /// Writes the file.
    pub fn save(&self, path: &Path) -> Result<(), DatastoreError> {
        std::fs::write(path, self.to_bytes()).map_err(|e| DatastoreError::Io(path.display().to_string(), e))
    }

    /// Parses a file's bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Datastore, DatastoreError> {
        let bad = |why: String| DatastoreError::Format(why);
        let (_, header) = safetensors::SafeTensors::read_metadata(bytes).map_err(|e| bad(e.to_string()))?;
        let meta = header.metadata().clone().unwrap_or_default();
        if meta.get("format").map(String::as_str) != Some("specee-datastore-1") {
            return Err(bad("no `format: specee-datastore-1` in its metadata".into()));
        }
        let number = |key: &str| -> Result<usize, DatastoreError> {
            meta.get(key).and_then(|v| v.parse().ok()).ok_or_else(|| bad(format!("metadata `{key}` missing")))
        };
        let (min_n, max_n, n_vocab) = (number("min_n")?, number("max_n")?, number("n_vocab")?);
        if min_n == 0 || max_n < min_n || max_n > 64 {
            return Err(bad(format!("suffix lengths {min_n}..={max_n}")));
        }
        let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| bad(e.to_string()))?;
        // A 1-D tensor of `dtype`, its little-endian values decoded by `from`.
        fn values<const W: usize, T>(
            st: &safetensors::SafeTensors<'_>,
            name: &str,
            dtype: safetensors::Dtype,
            from: fn([u8; W]) -> T,
        ) -> Result<Vec<T>, DatastoreError> {
            let bad = |why: String| DatastoreError::Format(format!("tensor `{name}`{why}"));
            let t = st.tensor(name).map_err(|_| bad(" missing".into()))?;
            if t.dtype() != dtype || t.shape().len() != 1 || t.data().len() != t.shape()[0] * W {
                return Err(bad(format!(": {:?} {:?}", t.dtype(), t.shape())));
            }
            Ok(t.data().chunks_exact(W).map(|c| from(c.try_into().expect("W bytes"))).collect())
        }
        use safetensors::Dtype;
        let keys = values(&st, "keys", Dtype::U64, u64::from_le_bytes)?;
        let next = values(&st, "next", Dtype::U32, u32::from_le_bytes)?;
        let prob = values(&st, "prob", Dtype::F32, f32::from_le_bytes)?;
        if next.len() != keys.len() || prob.len() != keys.len() {
            return Err(bad("`keys`, `next` and `prob` differ in length".into()));
        }
        if !keys.windows(2).all(|w| w[0] < w[1]) {
            return Err(bad("`keys` not sorted".into()));
        }
        if next.iter().any(|&t| t as usize >= n_vocab) || prob.iter().any(|p| !(*p > 0.0 && *p <= 1.0)) {
            return Err(bad("a token outside its vocabulary or a probability outside (0, 1]".into()));
        }
        let mut metadata: Vec<(String, String)> = meta.into_iter().collect();
        metadata.sort();
        Ok(Datastore { min_n, max_n, n_vocab, keys, next, prob, metadata })
    }

    /// Reads a file and checks it was built for a model with `n_vocab` tokens.
    pub fn load(path: &Path, n_vocab: usize) -> Result<Datastore, DatastoreError> {
        let bytes = std::fs::read(path).map_err(|e| DatastoreError::Io(path.display().to_string(), e))?;
        let ds = Datastore::from_bytes(&bytes)?;
        if ds.n_vocab != n_vocab {
            return Err(DatastoreError::Vocab { built: ds.n_vocab, model: n_vocab });
        }
        Ok(ds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(min_n: usize, max_n: usize, min_count: u32, min_prob: f32) -> BuildOptions {
        BuildOptions { min_n, max_n, min_count, min_prob }
    }

    fn store() -> Datastore {
        // Prompts 100.., answers 1..: "1 2 3" is followed by 4 twice and by 5 once.
        let seqs: Vec<(Vec<u32>, usize)> =
            vec![(vec![100, 101, 1, 2, 3, 4, 9], 2), (vec![102, 1, 2, 3, 4], 1), (vec![103, 7, 2, 3, 5], 1)];
        Datastore::build(seqs.iter().map(|(t, f)| (t.as_slice(), *f)), options(2, 3, 1, 0.0), 200)
    }

    #[test]
    fn longest_suffix_wins_and_counts_give_the_probability() {
        let ds = store();
        // "2 3" was followed by 4, 4, 5: 4 with probability 2/3.
        assert_eq!(ds.next(&[50, 2, 3], &[]), Some((4, 2.0 / 3.0)));
        // "7 2 3" only by 5: the 3-gram beats the 2-gram.
        assert_eq!(ds.next(&[7, 2, 3], &[]), Some((5, 1.0)));
        // The suffix may run into the draft path.
        assert_eq!(ds.next(&[7], &[2, 3]), Some((5, 1.0)));
        // Nothing stored for "3 9", and 1-grams are below min_n.
        assert_eq!(ds.next(&[3, 9], &[]), None);
        assert_eq!(ds.next(&[3], &[]), None);
    }

    #[test]
    fn prompt_tokens_are_context_never_targets() {
        let seqs = [(&[100u32, 101, 102, 1, 2][..], 3)];
        let ds = Datastore::build(seqs, options(2, 3, 1, 0.0), 200);
        // 102 followed "100 101" inside the prompt: not a target.
        assert_eq!(ds.next(&[100, 101], &[]), None);
        // The prompt's end is context for the answer's tokens.
        assert_eq!(ds.next(&[101, 102], &[]), Some((1, 1.0)));
        assert_eq!(ds.next(&[102], &[1]), Some((2, 1.0)));
        assert_eq!(ds.len(), 4, "two suffix lengths for each of the two answer tokens");
    }

    #[test]
    fn min_count_and_min_prob_drop_rare_and_uncertain_ngrams() {
        let seqs = [(&[1u32, 2, 3, 4, 1, 2, 3, 5, 8, 9][..], 0)];
        let ds = Datastore::build(seqs, options(2, 2, 2, 0.0), 10);
        assert_eq!(ds.next(&[2, 3], &[]), Some((4, 0.5)), "a tie goes to the smaller token");
        assert_eq!(ds.next(&[8, 9], &[]), None);
        assert_eq!(ds.len(), 2, "1 2 and 2 3 were seen twice");
        let ds = Datastore::build(seqs, options(2, 2, 1, 0.6), 10);
        assert_eq!(ds.next(&[2, 3], &[]), None, "followed by 4 and 5 alike");
        assert_eq!(ds.next(&[1, 2], &[]), Some((3, 1.0)));
    }

    #[test]
    fn round_trips_and_rejects_bad_files() {
        let mut ds = store();
        ds.metadata.push(("sequences".into(), "3".into()));
        let back = Datastore::from_bytes(&ds.to_bytes()).unwrap();
        assert_eq!(back.keys, ds.keys);
        assert_eq!(back.next(&[7, 2, 3], &[]), Some((5, 1.0)));
        assert!(back.metadata.contains(&("sequences".into(), "3".into())));
        assert!(matches!(Datastore::from_bytes(b"junk"), Err(DatastoreError::Format(_))));
        let dir = std::env::temp_dir().join(format!("specee-ds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ds.safetensors");
        ds.save(&path).unwrap();
        assert!(Datastore::load(&path, 200).is_ok());
        let err = Datastore::load(&path, 300).unwrap_err().to_string();
        assert!(err.contains("200") && err.contains("300"), "{err}");
        assert!(matches!(Datastore::load(&dir.join("none"), 200), Err(DatastoreError::Io(..))));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
