//! Early exits from a model's reasoning (issue #30): generation that may cut the chain of thought short at a
//! paragraph boundary and go straight to the answer.
//!
//! Both exits decide only at a boundary of the [`ReasoningProfile`] (`\n\n`) while the reasoning is still open;
//! cutting emits the profile's `exit_text` (`</think>`, or "Therefore, the final answer is $\boxed{"), after
//! which the answer follows by normal decoding:
//! - **DEER** (training-free, [`ReasoningExit::Deer`]): at each boundary the decoder forces a *trial answer*
//!   (the exit text, then greedy decoding until the answer is complete, [`Engine::trial_answer`]) on top of the
//!   cache and rolls it back by truncation; it exits when the trial's tokens have a mean top probability above
//!   the threshold.
//! - **SpecExit** ([`ReasoningExit::SpecExit`]): signal heads on the draft features ([`crate::signals`]).
//!
//! Every exit runs on a [`SpeculativeDecoder`] — `--mode eagle` with its head, `--mode dense` with
//! [`AnyProposer::Dense`] (nothing drafted; the final-normed feature rows kept, which the trial's probabilities
//! and the signal heads read) — so a step commits one or more tokens, and the tokens a step committed past a
//! boundary where a trial ran are dropped and decoded again (greedy: the same tokens).
//!
//! [`Engine::reasoning_trace`] records what training and the offline ceilings need: the full greedy trace, a
//! trial answer at every boundary of its reasoning, and the feature row of every generated token.

use crate::error::EngineError;
use crate::reasoning::ReasoningProfile;
use crate::session::{check_prompt, Engine, GenerateParams, Generation};
use crate::speculative::{speculative_error, tree_capacity, AnyProposer};
use decode::speculative::{SpeculativeDecoder, SpeculativeStats};
use model::Workspace;

/// Most tokens a trial answer may take after the exit text.
pub const TRIAL_TOKENS: usize = 16;

/// How the reasoning may be cut short.
#[derive(Clone, Debug, Default)]
pub enum ReasoningExit {
    /// Never: plain generation.
    #[default]
    None,
    /// DEER: exit at a boundary whose trial answer's mean top probability exceeds `threshold`.
    Deer { threshold: f32 },
    /// SpecExit: exit at a boundary once the smoothed signals pass the policy's thresholds.
    SpecExit(std::sync::Arc<crate::signals::SignalHead>, crate::signals::ExitPolicy),
}

impl ReasoningExit {
    /// The name `--reasoning-exit` takes.
    pub fn name(&self) -> &'static str {
        match self {
            ReasoningExit::None => "none",
            ReasoningExit::Deer { .. } => "deer",
            ReasoningExit::SpecExit(..) => "specexit",
        }
    }
}

/// A forced answer at a boundary.
#[derive(Clone, Debug, PartialEq)]
pub struct Trial {
    /// The answer tokens after the exit text.
    pub tokens: Vec<u32>,
    /// Exit text and answer.
    pub text: String,
    /// The answer parsed from `text` (strictly, as [`ReasoningProfile::answer`]).
    pub answer: Option<f64>,
    /// Mean over the answer tokens of the model's top probability (DEER's confidence).
    pub mean_max_prob: f32,
}

/// What a generation with a reasoning exit did.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReasoningStats {
    /// Trial answers forced (DEER).
    pub trials: usize,
    /// Tokens run through the model for them (exit text and answers).
    pub trial_tokens: usize,
    /// Generated tokens when the reasoning was cut (`None`: it was not).
    pub exited_at: Option<usize>,
    /// The decoder's counters (trials included).
    pub speculative: SpeculativeStats,
}

/// A full reasoning trace with a trial answer at each boundary of its reasoning ([`Engine::reasoning_trace`]).
#[derive(Clone, Debug)]
pub struct ReasoningTrace {
    pub generation: Generation,
    /// `(generated tokens up to and including the boundary, the trial answer forced there)`, in order.
    pub trials: Vec<(usize, Trial)>,
    /// The final-normed feature row (`n_embd`) of each generated token but the last, in order.
    pub features: Vec<f32>,
}

/// Finds paragraph boundaries and the end of the reasoning in a growing generated text.
pub(crate) struct ReasoningText<'p> {
    profile: &'p ReasoningProfile,
    bytes: Vec<u8>,
    open: bool,
}

impl<'p> ReasoningText<'p> {
    pub(crate) fn new(profile: &'p ReasoningProfile) -> Self {
        ReasoningText { profile, bytes: Vec::new(), open: true }
    }

    /// Appends a token's bytes; returns whether the token ends a boundary of the still open reasoning.
    pub(crate) fn push(&mut self, piece: &[u8]) -> bool {
        self.bytes.extend_from_slice(piece);
        if !self.open {
            return false;
        }
        if self.profile.reasoning_end(&self.bytes).is_some() {
            self.open = false;
            return false;
        }
        !piece.is_empty() && self.bytes.ends_with(self.profile.boundary.as_bytes())
    }

    /// Whether the reasoning has not ended yet.
    pub(crate) fn open(&self) -> bool {
        self.open
    }

    /// Marks the reasoning as ended (after an exit).
    pub(crate) fn close(&mut self) {
        self.open = false;
    }
}

impl Engine {
    /// The token ids of a profile's exit text (no BOS, specials parsed: `</think>` is one token).
    pub fn exit_ids(&self, profile: &ReasoningProfile) -> Vec<u32> {
        self.tokenizer.encode(&profile.exit_text, false, true)
    }

    /// Forces a trial answer on top of `dec`'s committed tokens — the exit text, then greedy decoding until the
    /// answer is complete ([`ReasoningProfile::answer_complete`]), an end-of-generation token, or
    /// [`TRIAL_TOKENS`] — and rolls the decoder back to where it was. The probabilities come from the decoder's
    /// final-normed feature rows through the full output head (`ws`: a workspace for that).
    pub fn trial_answer(
        &self,
        dec: &mut SpeculativeDecoder<'_, AnyProposer>,
        profile: &ReasoningProfile,
        exit_ids: &[u32],
        ws: &mut Workspace,
    ) -> Result<Trial, EngineError> {
        let at = dec.tokens().len();
        let result = self.run_trial(dec, profile, exit_ids, ws);
        dec.truncate(at);
        result
    }

    fn run_trial(
        &self,
        dec: &mut SpeculativeDecoder<'_, AnyProposer>,
        profile: &ReasoningProfile,
        exit_ids: &[u32],
        ws: &mut Workspace,
    ) -> Result<Trial, EngineError> {
        let d = self.model.config.n_embd;
        let width = dec.proposer().feature_source_width(d);
        if width == 0 {
            return Err(EngineError::Unsupported("trial answers need the decoder's feature rows".into()));
        }
        dec.feed(exit_ids).map_err(speculative_error)?;
        let first = dec.tokens().len();
        let mut text = profile.exit_text.clone();
        let mut tokens = Vec::new();
        'steps: while tokens.len() < TRIAL_TOKENS && dec.tokens().len() < dec.capacity() {
            let new = dec.step_at_most(TRIAL_TOKENS - tokens.len()).map_err(speculative_error)?.to_vec();
            for t in new {
                if self.tokenizer.is_eog(t) {
                    break 'steps;
                }
                tokens.push(t);
                text.push_str(&String::from_utf8_lossy(self.tokenizer.token_bytes(t)));
                if profile.answer_complete(&text) {
                    break 'steps;
                }
            }
        }
        // Token `first - 1 + i` (the last exit token, then the answer) predicts answer token `i`.
        let feats = dec.features();
        let vocab = self.model.config.vocab_size;
        let mut normed = Vec::with_capacity(tokens.len() * d);
        for i in 0..tokens.len() {
            let row = first - 1 + i;
            normed.extend_from_slice(&feats[row * width..row * width + d]);
        }
        let mut logits = vec![0f32; tokens.len() * vocab];
        if !tokens.is_empty() {
            self.model.head_full(&normed, tokens.len(), &mut logits, ws);
        }
        let probs: Vec<f32> = logits.chunks_exact(vocab).map(top_probability).collect();
        let mean_max_prob = if probs.is_empty() { 0.0 } else { probs.iter().sum::<f32>() / probs.len() as f32 };
        let answer = profile.answer(&text);
        Ok(Trial { tokens, text, answer, mean_max_prob })
    }

    /// A decoder for a reasoning exit: `proposer`'s tree decoding with a cache for the prompt, `params.max_tokens`
    /// and a trial past them.
    fn reasoning_decoder(
        &self,
        prompt_ids: &[u32],
        params: &GenerateParams,
        ctx: usize,
        threads: usize,
        proposer: AnyProposer,
    ) -> Result<SpeculativeDecoder<'_, AnyProposer>, EngineError> {
        check_prompt(prompt_ids, ctx)?;
        if proposer.feature_source_width(self.model.config.n_embd) == 0 {
            return Err(EngineError::Unsupported(
                "reasoning exits run with --mode dense or eagle (they read the final-normed feature rows)".into(),
            ));
        }
        let capacity = tree_capacity(prompt_ids, params, ctx);
        Ok(SpeculativeDecoder::new(&self.model, capacity, threads, proposer, params.sampling.clone()))
    }

    /// Generation in which `exit` may cut the reasoning (as `profile` delimits it) short; with
    /// [`ReasoningExit::None`] the tokens are those of plain greedy generation.
    #[allow(clippy::too_many_arguments)]
    pub fn generate_reasoning(
        &self,
        prompt_ids: &[u32],
        params: &GenerateParams,
        ctx: usize,
        threads: usize,
        proposer: AnyProposer,
        profile: &ReasoningProfile,
        exit: &ReasoningExit,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<(Generation, ReasoningStats), EngineError> {
        if !params.sampling.is_greedy() {
            return Err(EngineError::Unsupported("reasoning exits decode greedily (temperature 0)".into()));
        }
        let mut dec = self.reasoning_decoder(prompt_ids, params, ctx, threads, proposer)?;
        let capacity = dec.capacity();
        let exit_ids = self.exit_ids(profile);
        let mut ws = Workspace::new(threads);
        let mut stats = ReasoningStats::default();
        let mut signals = crate::signals::Smoothed::default();
        let mut reasoning = ReasoningText::new(profile);
        let (mut out, t1) = self.start_tree(&mut dec, prompt_ids, params)?;
        let d = self.model.config.n_embd;
        'outer: while out.generated.len() < params.max_tokens {
            if dec.tokens().len() > capacity {
                out.finish = crate::FinishReason::ContextFull;
                break;
            }
            let before = dec.tokens().len();
            let mut new =
                dec.step_at_most(params.max_tokens - out.generated.len()).map_err(speculative_error)?.to_vec();
            // The last boundary of the open reasoning among the new tokens (index into `new`).
            let mut cut = None;
            if reasoning.open() && !matches!(exit, ReasoningExit::None) {
                let boundary = self.last_boundary(&reasoning, &new);
                match exit {
                    ReasoningExit::None => {}
                    ReasoningExit::Deer { threshold } => {
                        if let Some(k) = boundary {
                            dec.truncate(before + k + 1);
                            new.truncate(k + 1);
                            let trial = self.trial_answer(&mut dec, profile, &exit_ids, &mut ws)?;
                            stats.trials += 1;
                            stats.trial_tokens += exit_ids.len() + trial.tokens.len();
                            if trial.mean_max_prob > *threshold {
                                cut = Some(k + 1);
                            }
                        }
                    }
                    ReasoningExit::SpecExit(head, policy) => {
                        // The feature rows this step added: its root and accepted drafts.
                        let width = dec.proposer().feature_source_width(d);
                        let feats = dec.features();
                        let rows = feats.len() / width;
                        let step: Vec<[f32; 3]> = ((before - 1)..rows)
                            .map(|r| head.signals(&feats[r * width..r * width + d], r + 1 - prompt_ids.len()))
                            .collect();
                        signals.update(&step, policy.alpha);
                        if boundary.is_some() && policy.passes(&signals) {
                            cut = boundary.map(|k| k + 1);
                        }
                    }
                }
            }
            let keep = cut.unwrap_or(new.len());
            for &t in &new[..keep] {
                reasoning.push(self.tokenizer.token_bytes(t));
                if !out.push(t, &mut on_text) {
                    break 'outer;
                }
            }
            if let Some(c) = cut {
                stats.exited_at = Some(out.generated.len());
                reasoning.close();
                dec.truncate(before + c);
                dec.feed(&exit_ids).map_err(speculative_error)?;
                for &t in &exit_ids {
                    if out.generated.len() >= params.max_tokens || !out.push(t, &mut on_text) {
                        break 'outer;
                    }
                }
            }
        }
        stats.speculative = *dec.stats();
        Ok((out.finish(prompt_ids, t1, &mut on_text), stats))
    }

    /// The index in `new` of the last token that ends a boundary of the still open reasoning (`reasoning` is
    /// not advanced).
    fn last_boundary(&self, reasoning: &ReasoningText<'_>, new: &[u32]) -> Option<usize> {
        let mut probe = ReasoningText { profile: reasoning.profile, bytes: reasoning.bytes.clone(), open: true };
        let mut last = None;
        for (k, &t) in new.iter().enumerate() {
            if probe.push(self.tokenizer.token_bytes(t)) {
                last = Some(k);
            }
            if !probe.open() {
                break;
            }
        }
        last
    }

    /// The model's full greedy reasoning on `prompt_ids` (as `proposer` decodes it: identical for dense and
    /// eagle) with a trial answer at every boundary of the reasoning (forced after the whole trace is decoded,
    /// from the last boundary back, each rolled back by truncation) and the feature rows of the generated tokens.
    pub fn reasoning_trace(
        &self,
        prompt_ids: &[u32],
        params: &GenerateParams,
        ctx: usize,
        threads: usize,
        proposer: AnyProposer,
        profile: &ReasoningProfile,
    ) -> Result<ReasoningTrace, EngineError> {
        let mut dec = self.reasoning_decoder(prompt_ids, params, ctx, threads, proposer)?;
        let mut reasoning = ReasoningText::new(profile);
        let mut boundaries = Vec::new();
        let (mut out, t1) = self.start_tree(&mut dec, prompt_ids, params)?;
        'outer: while out.generated.len() < params.max_tokens && dec.tokens().len() <= dec.capacity() {
            let new = dec.step_at_most(params.max_tokens - out.generated.len()).map_err(speculative_error)?.to_vec();
            for t in new {
                if !out.push(t, &mut |_: &str| true) {
                    break 'outer;
                }
                if reasoning.push(self.tokenizer.token_bytes(t)) {
                    boundaries.push(out.generated.len());
                }
            }
        }
        let generation = out.finish(prompt_ids, t1, &mut |_: &str| true);
        let n = generation.generated_ids.len();
        let (p, d) = (prompt_ids.len(), self.model.config.n_embd);
        let width = dec.proposer().feature_source_width(d);
        let rows = (dec.features().len() / width).min(p + n - 1);
        let features: Vec<f32> =
            (p..rows).flat_map(|r| dec.features()[r * width..r * width + d].iter().copied()).collect();
        // Trials from the last boundary back: each truncation only drops what the later trials needed.
        let exit_ids = self.exit_ids(profile);
        let mut ws = Workspace::new(1);
        let mut trials = Vec::with_capacity(boundaries.len());
        for &b in boundaries.iter().rev() {
            dec.truncate(p + b);
            trials.push((b, self.trial_answer(&mut dec, profile, &exit_ids, &mut ws)?));
        }
        trials.reverse();
        Ok(ReasoningTrace { generation, trials, features })
    }
}

/// The largest softmax probability of a logits row.
fn top_probability(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
    1.0 / sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_probability_is_the_softmax_maximum() {
        assert!((top_probability(&[0.0, 0.0]) - 0.5).abs() < 1e-6);
        let p = top_probability(&[3.0, 1.0, -2.0]);
        let want = 3f32.exp() / (3f32.exp() + 1f32.exp() + (-2f32).exp());
        assert!((p - want).abs() < 1e-6);
    }

    #[test]
    fn boundaries_count_only_inside_the_open_reasoning() {
        let profile = ReasoningProfile::parse(include_str!("../../../profiles/boxed.json"), "boxed".as_ref()).unwrap();
        let mut r = ReasoningText::new(&profile);
        let pieces: [&[u8]; 7] = [b"First", b".\n\n", b"Then", b"\n", b"\n", b"So \\boxed{3}", b".\n\n"];
        let ends: Vec<bool> = pieces.iter().map(|p| r.push(p)).collect();
        // "\n" then "\n" ends a boundary at the second piece; after the answer's paragraph none counts.
        assert_eq!(ends, [false, true, false, false, true, false, false]);
        assert!(!r.open());
    }
}
