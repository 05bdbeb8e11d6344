//! SpecEE early exit at the engine level: finding a model's shipped predictors, generation with
//! `--mode specee` and `--mode specee-eagle` (early exit inside EAGLE tree verification; same stop rules,
//! streaming and timings as dense), and the quality tool behind `specee eval` (teacher-forced agreement and
//! perplexity against dense, free-running agreement on prompts) for both.
//!
//! Predictors: `--exit FILE`, or the model's shipped ones: `heads/<model file stem>.exit.safetensors`.

use crate::error::EngineError;
use crate::perplexity::{log_prob, text_chunks};
use crate::session::{check_prompt, Emitter, Engine, GenerateParams, Generation, TokenSource};
use crate::speculative::{shipped_path, tree_capacity};
use decode::sampling::argmax;
use decode::specee::{ExitPredictors, MergedDecoder, MergedStats, SpecEeConfig, SpecEeDecoder, SpecEeStats};
use decode::speculative::{DraftHead, EagleProposer, TreeConfig};
use decode::{DenseDecoder, TokenConstraint};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The shipped predictor file for the model at `model_path` (whether or not it exists).
pub fn default_exit_path(model_path: &Path) -> PathBuf {
    shipped_path(model_path, "exit")
}

/// Loads exit predictors (`path`, or the model's shipped ones) and checks that they fit the model.
pub fn load_predictors(engine: &Engine, model_path: &Path, path: Option<&Path>) -> Result<ExitPredictors, EngineError> {
    let path = path.map(Path::to_path_buf).unwrap_or_else(|| default_exit_path(model_path));
    if !path.exists() {
        return Err(EngineError::NoExitPredictors(path));
    }
    let p = ExitPredictors::load(&path).map_err(|source| EngineError::ExitPredictors { path: path.clone(), source })?;
    engine.check_made_for("exit predictors", &path, &p.metadata, model_path)?;
    p.check_fits(engine.model.config.n_layers)
        .map_err(|source| EngineError::ExitPredictors { path: path.clone(), source })?;
    Ok(p)
}

/// What `--mode specee` and `--mode specee-eagle` run with: the draft head for candidates (and trees), the
/// predictors and the settings.
#[derive(Clone, Debug)]
pub struct SpecEeSetup {
    /// Shared, not copied, by every decoder (a server's requests).
    pub head: std::sync::Arc<DraftHead>,
    pub predictors: ExitPredictors,
    pub config: SpecEeConfig,
    /// Draft tree sizes of `specee-eagle` (default: [`SpecEeSetup::default_tree`]).
    pub tree: Option<TreeConfig>,
    /// Longest prompt-lookup chain `specee-eagle` drafts beside the head's tree (usually
    /// [`EagleProposer::DEFAULT_LOOKUP`]; 0: none).
    pub lookup: usize,
    /// What the lookup chain falls back on where the context has no match.
    pub datastore: Option<std::sync::Arc<decode::speculative::Datastore>>,
}

impl SpecEeSetup {
    /// A decoder for `capacity` tokens (borrowing the head and predictors: nothing is copied per generation).
    pub fn decoder<'m>(&'m self, engine: &'m Engine, capacity: usize, threads: usize) -> SpecEeDecoder<'m> {
        SpecEeDecoder::new(&engine.model, capacity, threads, &self.head, &self.predictors, self.config)
    }

    /// Default draft tree of `specee-eagle`: [`EagleProposer::default_tree`], whatever tree the head carries
    /// ([`decode::speculative::DraftHead::tree`], which `--mode eagle` uses): deeper chains were measured for
    /// eagle only, and a forward stops early only when every node on the accepted path has settled.
    pub fn default_tree() -> TreeConfig {
        EagleProposer::default_tree()
    }

    /// The tree sizes `specee-eagle` drafts with: `tree`, else [`SpecEeSetup::default_tree`].
    pub fn merged_tree(&self) -> TreeConfig {
        self.tree.unwrap_or_else(Self::default_tree)
    }

    /// A `specee-eagle` decoder for `capacity` tokens (room for a draft tree included by the caller).
    pub fn merged_decoder<'m>(&'m self, engine: &'m Engine, capacity: usize, threads: usize) -> MergedDecoder<'m> {
        let tree = self.merged_tree();
        MergedDecoder::new(&engine.model, capacity, threads, self.head.clone(), tree, &self.predictors, self.config)
            .with_lookup(self.lookup)
            .with_datastore(self.datastore.clone())
    }

    /// The exit threshold the decoder will use.
    pub fn threshold(&self) -> f32 {
        self.config.threshold_for(&self.predictors)
    }
}

use crate::speculative::speculative_error as specee_error;

/// Early exit has no full distribution to sample from: refuse sampling (and log probabilities) for `mode`.
pub(crate) fn greedy_only(params: &GenerateParams, mode: &str) -> Result<(), EngineError> {
    if params.logprobs.is_some() {
        // Its tokens come from truncated forwards: the full model's distribution is not at hand.
        let why = format!("--mode {mode} cannot report log probabilities (use --mode dense or eagle)");
        return Err(EngineError::Unsupported(why));
    }
    if params.sampling.is_greedy() {
        Ok(())
    } else {
        Err(EngineError::Unsupported(format!("--mode {mode} decodes greedily only (use --temp 0)")))
    }
}

impl Engine {
    /// [`Engine::generate`] with SpecEE early exit (greedy only; lossy — quality is measured by `specee eval`).
    /// Returns the early-exit counters too.
    pub fn generate_specee(
        &self,
        prompt_ids: &[u32],
        params: &GenerateParams,
        ctx: usize,
        threads: usize,
        setup: &SpecEeSetup,
        on_text: impl FnMut(&str) -> bool,
    ) -> Result<(Generation, SpecEeStats), EngineError> {
        greedy_only(params, "specee")?;
        check_prompt(prompt_ids, ctx)?;
        let capacity = (prompt_ids.len() + params.max_tokens).min(ctx);
        let mut dec = setup.decoder(self, capacity, threads);
        let g = self.decode_specee(&mut dec, prompt_ids, params, on_text)?;
        Ok((g, *dec.stats()))
    }

    /// The `specee` generation loop: feeds `prompt_ids` (every layer) after what `dec` holds, then steps with
    /// early exit until the stop rules, `params.max_tokens` or `dec`'s capacity end it.
    pub(crate) fn decode_specee(
        &self,
        dec: &mut SpecEeDecoder<'_>,
        prompt_ids: &[u32],
        params: &GenerateParams,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<Generation, EngineError> {
        let capacity = dec.capacity();
        let mut constraint = params.grammar.as_ref().map(|g| self.constraint(g)).transpose()?;
        let mut out = Emitter::new(self, params, prompt_ids.len());
        let t0 = Instant::now();
        let mut next = dec.feed(prompt_ids).map_err(specee_error)?;
        if let Some(c) = constraint.as_mut() {
            next = dec.constrain_fed(next, c).map_err(specee_error)?;
        }
        let mut layers = self.model.config.n_layers;
        out.timings.prompt_seconds = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        while out.generated.len() < params.max_tokens {
            if !out.push_traced(next, TokenSource::Plain, layers, None, &mut on_text) {
                break;
            }
            if let Some(c) = constraint.as_mut() {
                c.commit(next)?;
                if c.is_finished() {
                    out.finish = crate::FinishReason::Stop;
                    break;
                }
            }
            if out.generated.len() == params.max_tokens {
                break;
            }
            if dec.tokens().len() >= capacity {
                out.finish = crate::FinishReason::ContextFull;
                break;
            }
            let step = match constraint.as_mut() {
                Some(c) => dec.step_constrained(next, c),
                None => dec.step(next, false),
            }
            .map_err(specee_error)?;
            (next, layers) = (step.token, step.layers);
        }
        Ok(out.finish(prompt_ids, t1, &mut on_text))
    }

    /// [`Engine::generate`] with `--mode specee-eagle`: EAGLE tree speculative decoding whose tree forward
    /// stops at the layer where the predictors settle the accepted path (greedy only; lossy).
    pub fn generate_merged(
        &self,
        prompt_ids: &[u32],
        params: &GenerateParams,
        ctx: usize,
        threads: usize,
        setup: &SpecEeSetup,
        on_text: impl FnMut(&str) -> bool,
    ) -> Result<(Generation, MergedStats), EngineError> {
        greedy_only(params, "specee-eagle")?;
        check_prompt(prompt_ids, ctx)?;
        let capacity = tree_capacity(prompt_ids, params, ctx);
        let mut dec = setup.merged_decoder(self, capacity, threads);
        let g = self.generate_tree(&mut dec, prompt_ids, params, capacity, on_text)?;
        Ok((g, *dec.stats()))
    }
}

/// The early-exit counters of a run, in the units `specee eval` and `specee bench` report.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExitSummary {
    /// Layers run per token (`specee`) or per tree forward (`specee-eagle`, where every forward runs the whole
    /// tree to that depth).
    pub avg_layers: f64,
    /// Share of tokens (`specee`) or tree forwards (`specee-eagle`) settled by a predictor.
    pub exit_rate: f64,
    /// Predictor evaluations per committed token.
    pub predictor_calls_per_token: f64,
    /// Failed `--verify full` checks per committed token.
    pub verify_failures_per_token: f64,
}

impl From<&SpecEeStats> for ExitSummary {
    fn from(s: &SpecEeStats) -> ExitSummary {
        ExitSummary {
            avg_layers: s.avg_layers(),
            exit_rate: s.exit_rate(),
            predictor_calls_per_token: s.predictor_calls_per_token(),
            verify_failures_per_token: s.verify_failures_per_token(),
        }
    }
}

impl From<&MergedStats> for ExitSummary {
    fn from(s: &MergedStats) -> ExitSummary {
        ExitSummary {
            avg_layers: s.avg_layers(),
            exit_rate: s.early_stop_rate(),
            predictor_calls_per_token: s.per_token(s.predictor_calls),
            verify_failures_per_token: s.per_token(s.verify_failures),
        }
    }
}

/// Which early-exit mode a quality evaluation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExitMode {
    /// `--mode specee`: autoregressive early exit.
    Specee,
    /// `--mode specee-eagle`: early exit inside EAGLE tree verification.
    Merged,
}

/// Teacher-forced quality of early exit against dense on a text (see [`eval_text`]).
#[derive(Clone, Debug, Default)]
pub struct TextEval {
    /// Positions scored.
    pub positions: usize,
    /// Share of positions where the mode's next token equals dense top-1.
    pub agreement: f64,
    pub ppl_dense: f64,
    /// Perplexity of the mode's distribution (the full logits at the layer where it chose the token).
    pub ppl_mode: f64,
    pub exits: ExitSummary,
    pub seconds: f64,
}

/// Teacher-forced evaluation, chunked as llama.cpp's perplexity: chunks of `ctx` tokens from an empty cache,
/// the first half fed as a prompt (densely), then every later token run by the mode, which predicts the next
/// one; the same positions are scored for dense. For `specee-eagle` each position is the root of a tree drafted
/// from the true prefix and the mode's token is the one its step would commit first
/// ([`MergedDecoder::step_forced`]). `max_chunks` limits the work (0: all); `progress(done, total)`.
#[allow(clippy::too_many_arguments)]
pub fn eval_text(
    engine: &Engine,
    setup: &SpecEeSetup,
    which: ExitMode,
    text: &str,
    ctx: usize,
    threads: usize,
    max_chunks: usize,
    mut progress: impl FnMut(usize, usize),
) -> Result<TextEval, EngineError> {
    let start = Instant::now();
    if ctx < 8 {
        return Err(EngineError::TextTooShort { tokens: 0, needed: 8, ctx });
    }
    let chunks = text_chunks(engine, text, ctx, max_chunks)?;
    let n_chunks = chunks.len();
    let first = ctx / 2;
    let vocab = engine.model.config.vocab_size;
    let mut dense = DenseDecoder::new(&engine.model, ctx, threads);
    let mut specee = setup.decoder(engine, ctx, threads);
    let mut merged = setup.merged_decoder(engine, ctx + 64, threads);
    let (mut agree, mut count, mut nll_dense, mut nll_mode) = (0usize, 0usize, 0f64, 0f64);
    let mut dense_top = Vec::with_capacity(ctx);
    let mut dense_lp = Vec::with_capacity(ctx);
    for (chunk, ids) in chunks.iter().enumerate() {
        // Dense: logits at every position, in blocks (Gemma's vocabulary makes a whole chunk's logits large).
        dense.reset();
        dense_top.clear();
        dense_lp.clear();
        for block in ids.chunks(32) {
            let logits = dense.feed_all_logits(block)?;
            for r in 0..block.len() {
                let j = dense_top.len();
                let row = &logits[r * vocab..(r + 1) * vocab];
                dense_top.push(argmax(row));
                dense_lp.push(if j + 1 < ctx { log_prob(row, ids[j + 1]) } else { 0.0 });
            }
        }
        match which {
            ExitMode::Specee => {
                specee.reset();
                specee.feed(&ids[..first]).map_err(specee_error)?;
            }
            ExitMode::Merged => {
                merged.reset();
                merged.feed(&ids[..=first]).map_err(specee_error)?;
            }
        }
        for j in first..ctx - 1 {
            let (token, logits) = match which {
                ExitMode::Specee => {
                    let step = specee.step(ids[j], true).map_err(specee_error)?;
                    (step.token, specee.logits())
                }
                ExitMode::Merged => {
                    let token = merged.step_forced(ids[j + 1]).map_err(specee_error)?;
                    (token, merged.root_logits())
                }
            };
            agree += usize::from(token == dense_top[j]);
            nll_mode -= log_prob(logits, ids[j + 1]);
            nll_dense -= dense_lp[j];
            count += 1;
        }
        progress(chunk + 1, n_chunks);
    }
    let per = |x: f64| if count == 0 { 0.0 } else { x / count as f64 };
    Ok(TextEval {
        positions: count,
        agreement: per(agree as f64),
        ppl_dense: per(nll_dense).exp(),
        ppl_mode: per(nll_mode).exp(),
        exits: match which {
            ExitMode::Specee => specee.stats().into(),
            ExitMode::Merged => merged.stats().into(),
        },
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Free-running greedy agreement of early exit with dense on prompts.
#[derive(Clone, Debug, Default)]
pub struct PromptEval {
    pub prompts: usize,
    /// Tokens generated per prompt (at most).
    pub n_tokens: usize,
    /// Mean length of the prefix the mode's output shares with dense.
    pub mean_matching_prefix: f64,
    /// Share of prompts whose whole output equals dense.
    pub exact_match: f64,
    pub exits: ExitSummary,
}

/// Generates up to `n` tokens for each prompt with dense and with the mode (greedy, no stop at end of
/// generation so every prompt counts fully) and compares them.
pub fn eval_prompts(
    engine: &Engine,
    setup: &SpecEeSetup,
    which: ExitMode,
    prompts: &[Vec<u32>],
    n: usize,
    threads: usize,
    mut progress: impl FnMut(usize, usize),
) -> Result<PromptEval, EngineError> {
    let params = GenerateParams { max_tokens: n, stop_at_eog: false, ..Default::default() };
    let (mut prefix_sum, mut exact) = (0usize, 0usize);
    let (mut specee, mut merged) = (SpecEeStats::default(), MergedStats::default());
    for (i, ids) in prompts.iter().enumerate() {
        let ctx = ids.len() + n + 1;
        let dense = engine.generate(ids, &params, ctx, threads, |_| true)?;
        let g = match which {
            ExitMode::Specee => {
                let (g, st) = engine.generate_specee(ids, &params, ctx, threads, setup, |_| true)?;
                specee.add(&st);
                g
            }
            ExitMode::Merged => {
                let (g, st) = engine.generate_merged(ids, &params, ctx + 64, threads, setup, |_| true)?;
                merged.add(&st);
                g
            }
        };
        let prefix = dense.generated_ids.iter().zip(&g.generated_ids).take_while(|(a, b)| a == b).count();
        prefix_sum += prefix;
        exact += usize::from(g.generated_ids == dense.generated_ids);
        progress(i + 1, prompts.len());
    }
    let k = prompts.len().max(1) as f64;
    Ok(PromptEval {
        prompts: prompts.len(),
        n_tokens: n,
        mean_matching_prefix: prefix_sum as f64 / k,
        exact_match: exact as f64 / k,
        exits: match which {
            ExitMode::Specee => (&specee).into(),
            ExitMode::Merged => (&merged).into(),
        },
    })
}
