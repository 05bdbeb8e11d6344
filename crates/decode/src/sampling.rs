//! Sampling: the chain `repetition penalty → top-k → top-p → min-p → temperature → draw`, as llama.cpp orders
//! its default samplers. A temperature of zero (or below) means greedy argmax. The random generator is a
//! SplitMix64-seeded xoshiro256** of our own, so a seed gives the same tokens on every platform.

/// User-facing sampling settings.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `<= 0` is greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (`0` = all).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p` (`1.0` = all).
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely one's (`0.0` = off).
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of recently seen tokens by this (`1.0` = off).
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Default::default() }
    }
    /// Whether these settings always pick the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 && self.repeat_penalty == 1.0
    }
}

/// xoshiro256** seeded through SplitMix64.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^ (x >> 31)
        };
        Rng { s: [next(), next(), next(), next()] }
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// Index of the largest value (the first one on ties); `0` for an empty slice.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best as u32
}

/// A sampler with its own random state and candidate buffer.
#[derive(Clone, Debug)]
pub struct Sampler {
    pub params: SamplingParams,
    rng: Rng,
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        let rng = Rng::new(params.seed);
        Sampler { params, rng, candidates: Vec::new() }
    }

    /// Picks the next token from `logits`, given the tokens seen so far (for the repetition penalty).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let p = &self.params;
        if p.temperature <= 0.0 && p.repeat_penalty == 1.0 {
            return argmax(logits);
        }
        self.candidates.clear();
        self.candidates.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        if p.repeat_penalty != 1.0 {
            let start = history.len().saturating_sub(p.repeat_last_n);
            let mut seen: Vec<u32> = history[start..].to_vec();
            seen.sort_unstable();
            seen.dedup();
            for t in seen {
                if let Some(c) = self.candidates.get_mut(t as usize) {
                    c.1 = if c.1 > 0.0 { c.1 / p.repeat_penalty } else { c.1 * p.repeat_penalty };
                }
            }
        }
        if p.temperature <= 0.0 {
            return self.candidates.iter().fold((0u32, f32::NEG_INFINITY), |b, &c| if c.1 > b.1 { c } else { b }).0;
        }
        let by_logit_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        // Top-k.
        let k = if p.top_k == 0 { self.candidates.len() } else { p.top_k.min(self.candidates.len()) };
        if k < self.candidates.len() {
            self.candidates.select_nth_unstable_by(k - 1, by_logit_desc);
            self.candidates.truncate(k);
        }
        self.candidates.sort_unstable_by(by_logit_desc);
        // Probabilities at temperature 1 for the top-p / min-p cuts (as llama.cpp does before temperature).
        let max = self.candidates[0].1;
        let mut probs: Vec<f32> = self.candidates.iter().map(|c| (c.1 - max).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= sum);
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, q) in probs.iter().enumerate() {
                cum += q;
                if cum >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p;
            keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
        }
        self.candidates.truncate(keep.max(1));
        // Temperature and draw.
        let inv_t = 1.0 / p.temperature;
        let weights: Vec<f32> = self.candidates.iter().map(|c| ((c.1 - max) * inv_t).exp()).collect();
        let total: f32 = weights.iter().sum();
        let mut r = self.rng.next_f32() * total;
        for (c, w) in self.candidates.iter().zip(&weights) {
            if r < *w {
                return c.0;
            }
            r -= w;
        }
        self.candidates.last().map_or(0, |c| c.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_argmax() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, 2.9, -1.0], &[]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_different_seed_differs() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37 % 11) as f32) * 0.3).collect();
        let params =
            SamplingParams { temperature: 1.5, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 7, ..Default::default() };
        let draw = |p: SamplingParams| {
            let mut s = Sampler::new(p);
            (0..50).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(draw(params.clone()), draw(params.clone()));
        assert_ne!(draw(params.clone()), draw(SamplingParams { seed: 8, ..params }));
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut s = Sampler::new(SamplingParams { temperature: 2.0, top_k: 1, ..Default::default() });
        for _ in 0..20 {
            assert_eq!(s.sample(&[0.0, 1.0, 0.9], &[]), 1);
        }
    }

    #[test]
    fn min_p_removes_unlikely_tokens() {
        let mut s =
            Sampler::new(SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.5, ..Default::default() });
        // token 2 has probability e^-5 relative to token 0: always cut.
        for _ in 0..200 {
            assert_ne!(s.sample(&[5.0, 4.9, 0.0], &[]), 2);
        }
    }

    #[test]
    fn top_p_keeps_nucleus() {
        let mut s =
            Sampler::new(SamplingParams { temperature: 1.0, top_k: 0, top_p: 0.5, min_p: 0.0, ..Default::default() });
        for _ in 0..200 {
            assert_eq!(s.sample(&[10.0, 0.0, 0.0, 0.0], &[]), 0);
        }
    }

    #[test]
    fn sampling_follows_distribution() {
        // p = softmax([0, ln 3]) = [0.25, 0.75]
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 1,
            ..Default::default()
        });
        let n = 20000;
        let ones = (0..n).filter(|_| s.sample(&[0.0, 3f32.ln()], &[]) == 1).count();
        let frac = ones as f64 / n as f64;
        assert!((frac - 0.75).abs() < 0.02, "{frac}");
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let mut s = Sampler::new(SamplingParams { temperature: 0.0, repeat_penalty: 2.0, ..Default::default() });
        assert_eq!(s.sample(&[3.0, 2.0], &[0]), 1);
        assert_eq!(s.sample(&[3.0, 2.0], &[1]), 0);
    }
}
