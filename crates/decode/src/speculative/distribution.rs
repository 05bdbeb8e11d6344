//! The target's next-token distribution as a full probability vector: exactly the distribution that
//! [`crate::Sampler::sample`] draws from (repetition penalty → top-k → top-p → min-p → temperature), which
//! rejection sampling needs in the open. Kept in step with `sampling.rs` by a test that compares this vector
//! with the sampler's empirical frequencies.

use crate::sampling::{argmax, SamplingParams};

/// Scratch for [`target_distribution`].
#[derive(Clone, Debug, Default)]
pub struct DistributionScratch {
    candidates: Vec<(u32, f32)>,
    probs: Vec<f32>,
    seen: Vec<u32>,
}

/// Writes into `out` (resized to the vocabulary) the probability of every token under `params`, given `logits`
/// and the tokens seen so far (`history`, for the repetition penalty). Greedy settings give a point mass.
pub fn target_distribution(
    params: &SamplingParams,
    logits: &[f32],
    history: &[u32],
    scratch: &mut DistributionScratch,
    out: &mut Vec<f32>,
) {
    out.clear();
    out.resize(logits.len(), 0.0);
    if logits.is_empty() {
        return;
    }
    let c = &mut scratch.candidates;
    c.clear();
    c.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
    apply_repeat_penalty(params, history, &mut scratch.seen, c);
    if params.temperature <= 0.0 {
        let best = c.iter().fold((0u32, f32::NEG_INFINITY), |b, &x| if x.1 > b.1 { x } else { b }).0;
        out[best as usize] = 1.0;
        return;
    }
    let by_logit_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let k = if params.top_k == 0 { c.len() } else { params.top_k.min(c.len()) };
    if k < c.len() {
        c.select_nth_unstable_by(k - 1, by_logit_desc);
        c.truncate(k);
    }
    c.sort_unstable_by(by_logit_desc);
    let max = c[0].1;
    let probs = &mut scratch.probs;
    probs.clear();
    probs.extend(c.iter().map(|x| (x.1 - max).exp()));
    let sum: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|q| *q /= sum);
    let mut keep = probs.len();
    if params.top_p < 1.0 {
        let mut cum = 0.0;
        for (i, q) in probs.iter().enumerate() {
            cum += q;
            if cum >= params.top_p {
                keep = i + 1;
                break;
            }
        }
    }
    if params.min_p > 0.0 {
        let floor = probs[0] * params.min_p;
        keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
    }
    c.truncate(keep.max(1));
    let inv_t = 1.0 / params.temperature;
    let mut total = 0f32;
    for x in c.iter() {
        let w = ((x.1 - max) * inv_t).exp();
        out[x.0 as usize] = w;
        total += w;
    }
    for x in c.iter() {
        out[x.0 as usize] /= total;
    }
}

/// The token greedy settings pick (argmax after the repetition penalty); the sampler's choice when
/// `params.temperature <= 0`.
pub fn greedy_choice(
    params: &SamplingParams,
    logits: &[f32],
    history: &[u32],
    scratch: &mut DistributionScratch,
) -> u32 {
    if params.repeat_penalty == 1.0 {
        return argmax(logits);
    }
    let c = &mut scratch.candidates;
    c.clear();
    c.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
    apply_repeat_penalty(params, history, &mut scratch.seen, c);
    c.iter().fold((0u32, f32::NEG_INFINITY), |b, &x| if x.1 > b.1 { x } else { b }).0
}

fn apply_repeat_penalty(params: &SamplingParams, history: &[u32], seen: &mut Vec<u32>, c: &mut [(u32, f32)]) {
    if params.repeat_penalty == 1.0 {
        return;
    }
    let start = history.len().saturating_sub(params.repeat_last_n);
    seen.clear();
    seen.extend_from_slice(&history[start..]);
    seen.sort_unstable();
    seen.dedup();
    for &t in seen.iter() {
        if let Some(x) = c.get_mut(t as usize) {
            x.1 = if x.1 > 0.0 { x.1 / params.repeat_penalty } else { x.1 * params.repeat_penalty };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Sampler;

    #[test]
    fn matches_the_samplers_frequencies() {
        let logits: Vec<f32> = (0..40).map(|i| ((i * 37 % 11) as f32) * 0.4 - (i as f32) * 0.05).collect();
        let history = [3u32, 5, 3, 8];
        let settings = [
            SamplingParams { temperature: 0.8, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 3, ..Default::default() },
            SamplingParams { temperature: 1.3, top_k: 6, top_p: 0.9, min_p: 0.05, seed: 4, ..Default::default() },
            SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.7,
                min_p: 0.0,
                repeat_penalty: 1.5,
                seed: 5,
                ..Default::default()
            },
        ];
        for params in settings {
            let mut p = Vec::new();
            target_distribution(&params, &logits, &history, &mut DistributionScratch::default(), &mut p);
            assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-5);
            let mut s = Sampler::new(params.clone());
            let n = 40_000;
            let mut freq = vec![0f64; logits.len()];
            for _ in 0..n {
                freq[s.sample(&logits, &history) as usize] += 1.0 / n as f64;
            }
            for (t, (&f, &q)) in freq.iter().zip(&p).enumerate() {
                assert!((f - q as f64).abs() < 0.012, "{params:?}: token {t}: sampled {f}, computed {q}");
                if q == 0.0 {
                    assert_eq!(f, 0.0, "token {t} is outside the computed support");
                }
            }
        }
    }

    #[test]
    fn greedy_is_a_point_mass_on_the_penalised_argmax() {
        let params = SamplingParams { temperature: 0.0, repeat_penalty: 2.0, ..Default::default() };
        let mut p = Vec::new();
        let mut scratch = DistributionScratch::default();
        target_distribution(&params, &[3.0, 2.0], &[0], &mut scratch, &mut p);
        assert_eq!(p, vec![0.0, 1.0]);
        assert_eq!(greedy_choice(&params, &[3.0, 2.0], &[0], &mut scratch), 1);
        assert_eq!(greedy_choice(&SamplingParams::greedy(), &[3.0, 2.0], &[0], &mut scratch), 0);
    }
}
