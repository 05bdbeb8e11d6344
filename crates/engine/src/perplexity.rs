//! Perplexity exactly as llama.cpp's `llama-perplexity` computes it: the text is tokenized (BOS as the model
//! says, special-token text not parsed), cut into chunks of `ctx` tokens; each chunk is evaluated from an
//! empty cache (its first token replaced by BOS where the model adds one), and the second half of each chunk
//! is scored: the logits at position `j` (for `ctx/2 <= j < ctx-1`) predict token `j+1`.

use crate::error::EngineError;
use crate::session::Engine;
use decode::DenseDecoder;

/// Result of [`perplexity`].
#[derive(Clone, Debug)]
pub struct Perplexity {
    pub ppl: f64,
    /// Standard error of the perplexity estimate (as llama.cpp prints it after `±`).
    pub stderr: f64,
    pub chunks: usize,
    pub tokens_scored: usize,
    pub seconds: f64,
}

/// Log-softmax probability of `target` under `logits`, computed in f64.
pub fn log_prob(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    logits[target as usize] as f64 - max - sum.ln()
}

/// `text` tokenized as llama.cpp's perplexity tool does and cut into chunks of `ctx` tokens (at most `max_chunks`;
/// 0 = all), each starting with BOS where the model adds one. Fails if not even one chunk fits.
pub fn text_chunks(engine: &Engine, text: &str, ctx: usize, max_chunks: usize) -> Result<Vec<Vec<u32>>, EngineError> {
    let tokens = engine.tokenizer.encode(text, true, false);
    if tokens.len() < ctx {
        return Err(EngineError::TextTooShort { tokens: tokens.len(), needed: ctx, ctx });
    }
    let mut n_chunks = tokens.len() / ctx;
    if max_chunks > 0 {
        n_chunks = n_chunks.min(max_chunks);
    }
    let bos = engine.tokenizer.bos().filter(|_| engine.tokenizer.add_bos());
    Ok((0..n_chunks)
        .map(|c| {
            let mut ids = tokens[c * ctx..(c + 1) * ctx].to_vec();
            if let Some(b) = bos {
                ids[0] = b;
            }
            ids
        })
        .collect())
}

/// Perplexity of `text` with chunks of `ctx` tokens; `max_chunks` limits the work (0 = all);
/// `progress(done, total)` is called after each chunk.
pub fn perplexity(
    engine: &Engine,
    text: &str,
    ctx: usize,
    threads: usize,
    max_chunks: usize,
    mut progress: impl FnMut(usize, usize, f64),
) -> Result<Perplexity, EngineError> {
    let start = std::time::Instant::now();
    if ctx < 4 {
        return Err(EngineError::TextTooShort { tokens: 0, needed: 4, ctx });
    }
    let chunks = text_chunks(engine, text, ctx, max_chunks)?;
    let n_chunks = chunks.len();
    let first = ctx / 2;
    let vocab = engine.model.config.vocab_size;
    let mut dec = DenseDecoder::new(&engine.model, ctx, threads);
    let (mut nll, mut nll2, mut count) = (0f64, 0f64, 0usize);
    for (chunk, ids) in chunks.iter().enumerate() {
        dec.reset();
        let logits = dec.feed_all_logits(ids)?;
        for j in first..ctx - 1 {
            let lp = log_prob(&logits[j * vocab..(j + 1) * vocab], ids[j + 1]);
            nll -= lp;
            nll2 += lp * lp;
            count += 1;
        }
        let running = (nll / count as f64).exp();
        progress(chunk + 1, n_chunks, running);
    }
    let mean = nll / count as f64;
    let ppl = mean.exp();
    let var = nll2 / count as f64 - mean * mean;
    let stderr = if var > 0.0 && count > 1 { (var / (count - 1) as f64).sqrt() * ppl } else { 0.0 };
    Ok(Perplexity { ppl, stderr, chunks: n_chunks, tokens_scored: count, seconds: start.elapsed().as_secs_f64() })
}
