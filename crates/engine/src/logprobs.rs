//! Log probabilities of generated tokens (`--logprobs`, the server's `logprobs` / `top_logprobs`): the target
//! model's own distribution at the step that produced each token — the raw logits' log-softmax, before any
//! grammar mask, penalty or temperature, as vLLM reports them by default. Dense decoding takes them from its last
//! forward; the tree modes from the verification row of each committed token's parent, so eagle's equal dense's.

/// Most alternatives a token's entry may list (OpenAI's limit for `top_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One generated token's log probability and the most likely alternatives at its step.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// The `k` most likely tokens at this step, most likely first (ties: lower id first); may include `token`.
    pub top: Vec<(u32, f32)>,
}

/// The entry of `token` given the full `logits` of its step, with the `top` most likely alternatives (at most
/// [`MAX_TOP_LOGPROBS`]). The normaliser is summed in `f64`, so values agree across modes to float rounding.
pub fn token_logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    let lp = |t: u32| logits.get(t as usize).map_or(f32::NEG_INFINITY, |&l| (l as f64 - lse) as f32);
    let k = top.min(MAX_TOP_LOGPROBS).min(logits.len());
    let mut best: Vec<u32> = Vec::with_capacity(k + 1);
    if k > 0 {
        // One pass keeping the k best (k ≤ 20 of a vocabulary of 10⁵): no allocation per candidate.
        let better = |a: u32, b: u32| {
            logits[a as usize] > logits[b as usize] || (logits[a as usize] == logits[b as usize] && a < b)
        };
        for (t, &l) in logits.iter().enumerate() {
            let t = t as u32;
            if best.len() == k && l < logits[best[k - 1] as usize] {
                continue;
            }
            let at = best.partition_point(|&b| better(b, t));
            if at < k {
                best.insert(at, t);
                best.truncate(k);
            }
        }
    }
    TokenLogprobs { token, logprob: lp(token), top: best.into_iter().map(|t| (t, lp(t))).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_of_the_token_and_the_best_alternatives_in_order() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let e = token_logprobs(&logits, 2, 3);
        assert!((e.logprob as f64 - (2.0 - z.ln())).abs() < 1e-6);
        // Ties keep the lower id first.
        assert_eq!(e.top.iter().map(|&(t, _)| t).collect::<Vec<_>>(), vec![1, 3, 2]);
        assert!((e.top[0].1 as f64 - (3.0 - z.ln())).abs() < 1e-6);
        let total: f64 = logits.iter().map(|&l| (l as f64 - z.ln()).exp()).sum();
        assert!((total - 1.0).abs() < 1e-9);
        assert!(token_logprobs(&logits, 0, 0).top.is_empty());
        assert_eq!(token_logprobs(&logits, 0, 100).top.len(), 5, "at most the vocabulary");
        assert_eq!(token_logprobs(&[0.0; 64], 0, 100).top.len(), MAX_TOP_LOGPROBS);
    }

    #[test]
    fn huge_logits_do_not_overflow() {
        let e = token_logprobs(&[1e30, 0.0, -1e30], 0, 2);
        assert_eq!(e.logprob, 0.0);
        assert!(e.top[1].1 < -1e29);
    }
}
