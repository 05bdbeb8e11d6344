//! Generation with a speculative decoding mode (`--mode eagle|ngram`), with the same stop rules, streaming and
//! timings as dense [`Engine::generate`], plus the speculative counters (τ, draft and verify time).
//!
//! Draft heads: `--draft FILE`, or the head shipped for the model: `heads/<model file stem>.draft.safetensors`
//! in the repository (beside `models/`). `--mode eagle --draft DIR` also takes a published EAGLE-1/2/3
//! checkpoint of a Llama-family model (a folder with `config.json` and `model.safetensors` or
//! `pytorch_model.bin`): see [`load_eagle`].
//!
//! Datastores (the n-gram table of the model's own answers that the lookup chain falls back on, see
//! [`decode::speculative::datastore`]): `--datastore FILE`, or the shipped `heads/<model file stem>.datastore.safetensors`
//! when present.

use crate::error::EngineError;
use crate::session::{check_prompt, Emitter, Engine, GenerateParams, Generation, TokenSource};
use decode::speculative::{
    Datastore, DraftHead, DraftSource, EagleProposer, NgramProposer, Proposer, PublishedHead, PublishedProposer,
    SpeculativeDecoder, SpeculativeStats, TreeConfig,
};
use decode::TokenConstraint;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// How tokens are produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Mode {
    /// One target forward per token.
    #[default]
    Dense,
    /// Tree speculative decoding with a trained EAGLE-style draft head (lossless).
    Eagle,
    /// Tree speculative decoding with prompt lookup (lossless).
    Ngram,
    /// SpecEE early exit with trained per-layer predictors (lossy; greedy).
    Specee,
    /// SpecEE early exit inside EAGLE tree verification ("merged mapping"; lossy; greedy).
    SpeceeEagle,
}

impl Mode {
    /// The name `--mode` takes.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Dense => "dense",
            Mode::Eagle => "eagle",
            Mode::Ngram => "ngram",
            Mode::Specee => "specee",
            Mode::SpeceeEagle => "specee-eagle",
        }
    }

    /// Whether the mode's greedy output is identical to dense greedy.
    pub fn is_lossless(self) -> bool {
        !matches!(self, Mode::Specee | Mode::SpeceeEagle)
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        match s {
            "dense" => Ok(Mode::Dense),
            "eagle" => Ok(Mode::Eagle),
            "ngram" => Ok(Mode::Ngram),
            "specee" => Ok(Mode::Specee),
            "specee-eagle" => Ok(Mode::SpeceeEagle),
            other => Err(format!("unknown mode `{other}` (dense, eagle, ngram, specee or specee-eagle)")),
        }
    }
}

/// The folder of shipped draft heads.
pub fn heads_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../heads");
    dir.canonicalize().unwrap_or(dir)
}

/// The shipped file of `kind` (`draft`, `exit`) for the model at `model_path`:
/// `heads/<model file stem>.<kind>.safetensors` (whether or not it exists).
pub fn shipped_path(model_path: &Path, kind: &str) -> PathBuf {
    let stem = model_path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    heads_dir().join(format!("{stem}.{kind}.safetensors"))
}

/// The shipped head for the model at `model_path` (whether or not it exists).
pub fn default_head_path(model_path: &Path) -> PathBuf {
    shipped_path(model_path, "draft")
}

/// Whether a generation that names no mode runs eagle: for greedy decoding when a draft head is at hand, since
/// its output is identical to dense and it is faster on both default models (1.2–1.3× SmolLM2, ~2.6× Gemma,
/// `heads/README.md`); not for sampling, which accepts fewer drafts (SmolLM2 at temperature 0.8: τ 1.4–1.7,
/// 0.87–1.04× dense), nor with a repetition penalty, which needs every node's logits. `generate` and the server's
/// `--mode auto` both decide by it.
pub fn auto_runs_eagle(head_available: bool, sampling: &decode::SamplingParams) -> bool {
    head_available && sampling.is_greedy()
}

/// The mode `generate` runs when none is asked for ([`auto_runs_eagle`], with the head `draft` or the model's
/// shipped one).
pub fn auto_mode(model_path: &Path, draft: Option<&Path>, sampling: &decode::SamplingParams) -> Mode {
    let head = draft.map(Path::to_path_buf).unwrap_or_else(|| default_head_path(model_path));
    if auto_runs_eagle(head.exists(), sampling) {
        Mode::Eagle
    } else {
        Mode::Dense
    }
}

/// The datastore to draft from: `path` (which must load), else the model's shipped one if there is one, else
/// none.
pub fn load_datastore(
    engine: &Engine,
    model_path: &Path,
    path: Option<&Path>,
) -> Result<Option<std::sync::Arc<Datastore>>, EngineError> {
    let path = match path {
        Some(p) => p.to_path_buf(),
        None => match shipped_path(model_path, "datastore") {
            shipped if shipped.exists() => shipped,
            _ => return Ok(None),
        },
    };
    let store = Datastore::load(&path, engine.model.config.vocab_size)
        .map_err(|source| EngineError::Datastore { path: path.clone(), source })?;
    engine.check_made_for("datastore", &path, &store.metadata.iter().cloned().collect(), model_path)?;
    Ok(Some(std::sync::Arc::new(store)))
}

/// Loads a draft head (`path`, or the model's shipped one) and checks that it fits the model.
pub fn load_head(engine: &Engine, model_path: &Path, path: Option<&Path>) -> Result<DraftHead, EngineError> {
    let path = path.map(Path::to_path_buf).unwrap_or_else(|| default_head_path(model_path));
    if !path.exists() {
        return Err(EngineError::NoDraftHead(path));
    }
    if decode::speculative::published::is_published(&path) {
        return Err(EngineError::Unsupported(format!(
            "{} is a published EAGLE checkpoint, which drafts whole trees with its own attention cache; it works \
             with --mode eagle. This mode needs a head in specee's own format (`specee train-draft`)",
            path.display()
        )));
    }
    let head = DraftHead::load(&path).map_err(|source| EngineError::DraftHead { path: path.clone(), source })?;
    engine.check_made_for("draft head", &path, &head.metadata, model_path)?;
    head.check_fits(&engine.model).map_err(|source| EngineError::DraftHead { path: path.clone(), source })?;
    Ok(head)
}

/// The `--mode eagle` proposer: a published EAGLE-1/2/3 checkpoint when `path` is one (a folder with
/// `config.json`, or its weights file; see [`decode::speculative::published`]), otherwise a head in specee's own
/// format (`path`, or the model's shipped one). `tree` overrides the kind's default tree sizes.
pub fn load_eagle(
    engine: &Engine,
    model_path: &Path,
    path: Option<&Path>,
    tree: Option<TreeConfig>,
) -> Result<AnyProposer, EngineError> {
    if let Some(p) = path.filter(|p| p.exists() && decode::speculative::published::is_published(p)) {
        let err = |source| EngineError::PublishedHead { path: p.to_path_buf(), source };
        let head = PublishedHead::load(p).map_err(err)?;
        let tree = tree.unwrap_or_else(PublishedProposer::default_tree);
        let proposer = PublishedProposer::new(head, &engine.model, tree).map_err(err)?;
        return Ok(AnyProposer::Published(Box::new(proposer.with_lookup(EagleProposer::DEFAULT_LOOKUP))));
    }
    Ok(AnyProposer::eagle(load_head(engine, model_path, path)?, tree, None))
}

/// A proposer for one of the speculative modes.
pub enum AnyProposer {
    Eagle(Box<EagleProposer>),
    /// A published EAGLE-1/2/3 checkpoint.
    Published(Box<PublishedProposer>),
    Ngram(NgramProposer),
    /// Drafts nothing (each step verifies its root alone: dense decoding) but keeps the final-normed feature rows,
    /// which reasoning exits read ([`crate::reasoning_exit`]).
    Dense,
}

impl Proposer for AnyProposer {
    fn feature_source(&self) -> decode::speculative::FeatureSource {
        match self {
            AnyProposer::Eagle(p) => p.feature_source(),
            AnyProposer::Published(p) => p.feature_source(),
            AnyProposer::Ngram(p) => p.feature_source(),
            AnyProposer::Dense => decode::speculative::FeatureSource::FinalNorm,
        }
    }
    fn needs_feature_history(&self) -> bool {
        match self {
            AnyProposer::Eagle(p) => p.needs_feature_history(),
            AnyProposer::Published(p) => p.needs_feature_history(),
            AnyProposer::Ngram(p) => p.needs_feature_history(),
            AnyProposer::Dense => false,
        }
    }
    fn propose(
        &mut self,
        context: &decode::speculative::DraftContext<'_>,
        tree: &mut decode::speculative::DraftTree,
    ) -> Result<(), decode::speculative::SpeculativeError> {
        match self {
            AnyProposer::Eagle(p) => p.propose(context, tree),
            AnyProposer::Published(p) => p.propose(context, tree),
            AnyProposer::Ngram(p) => p.propose(context, tree),
            AnyProposer::Dense => Ok(()),
        }
    }
}

impl AnyProposer {
    /// The width of the feature rows the decoder keeps for this proposer when they start with the final-normed
    /// state (what reasoning exits read); 0 when they do not (n-gram drafting, EAGLE-3 checkpoints).
    pub fn feature_source_width(&self, n_embd: usize) -> usize {
        let source = self.feature_source();
        if source.final_norm_slot().is_some() {
            source.width(n_embd)
        } else {
            0
        }
    }

    /// An EAGLE proposer with `head`, tree sizes `tree` (default: the head's own, [`DraftHead::tree`], else
    /// [`EagleProposer::default_tree`]) and the default prompt-lookup chain ([`EagleProposer::DEFAULT_LOOKUP`]),
    /// falling back on `datastore`.
    pub fn eagle(
        head: impl Into<std::sync::Arc<DraftHead>>,
        tree: Option<TreeConfig>,
        datastore: Option<std::sync::Arc<Datastore>>,
    ) -> AnyProposer {
        let head = head.into();
        let tree = EagleProposer::tree_for(&head, tree);
        let mut proposer = EagleProposer::new(head, tree).with_lookup(EagleProposer::DEFAULT_LOOKUP);
        proposer.lookup = std::mem::take(&mut proposer.lookup).with_datastore(datastore);
        AnyProposer::Eagle(Box::new(proposer))
    }

    /// The tree sizes this proposer drafts with (`--json`'s `speculative.tree`); none for [`AnyProposer::Dense`].
    pub fn tree(&self) -> Option<TreeConfig> {
        match self {
            AnyProposer::Eagle(p) => Some(p.tree),
            AnyProposer::Published(p) => Some(p.tree),
            AnyProposer::Ngram(p) => Some(p.config.tree),
            AnyProposer::Dense => None,
        }
    }

    /// Sets the lookup chain (its base length, 0: none, and datastore) of an `eagle` proposer, or the datastore
    /// of an `ngram` one.
    pub fn set_lookup(&mut self, base: usize, datastore: Option<std::sync::Arc<Datastore>>) {
        let chain = decode::speculative::LookupChain::new(base).with_datastore(datastore.clone());
        match self {
            AnyProposer::Eagle(p) => p.lookup = chain,
            AnyProposer::Published(p) => p.lookup = chain,
            AnyProposer::Ngram(p) => p.datastore = datastore,
            AnyProposer::Dense => {}
        }
    }
}

impl Engine {
    /// [`Engine::generate`] with tree speculative decoding: greedy output is identical to dense greedy, sampled
    /// output follows the same distribution. Returns the speculative counters too.
    pub fn generate_speculative(
        &self,
        prompt_ids: &[u32],
        params: &GenerateParams,
        ctx: usize,
        threads: usize,
        proposer: AnyProposer,
        on_text: impl FnMut(&str) -> bool,
    ) -> Result<(Generation, SpeculativeStats), EngineError> {
        check_prompt(prompt_ids, ctx)?;
        let capacity = tree_capacity(prompt_ids, params, ctx);
        let mut dec = SpeculativeDecoder::new(&self.model, capacity, threads, proposer, params.sampling.clone());
        let g = self.generate_tree(&mut dec, prompt_ids, params, capacity, on_text)?;
        Ok((g, *dec.stats()))
    }

    /// How every tree generation starts: feeds the prompt (its last token becomes the first step's root) and
    /// returns the emitter with the prompt's timings and the time decoding began.
    pub(crate) fn start_tree<'e>(
        &'e self,
        dec: &mut impl TreeSteps,
        prompt_ids: &[u32],
        params: &'e GenerateParams,
    ) -> Result<(Emitter<'e>, Instant), EngineError> {
        let mut out = Emitter::new(self, params, prompt_ids.len());
        let t0 = Instant::now();
        dec.feed(prompt_ids).map_err(speculative_error)?;
        out.timings.prompt_seconds = t0.elapsed().as_secs_f64();
        out.timings.prefilled_tokens = prompt_ids.len().saturating_sub(1);
        Ok((out, Instant::now()))
    }

    /// The generation loop of every tree mode: feeds the prompt (its last token becomes the first step's root, so
    /// the first verification yields token 1), then steps `dec` until the emitter is done or the cache is full.
    pub(crate) fn generate_tree(
        &self,
        dec: &mut impl TreeSteps,
        prompt_ids: &[u32],
        params: &GenerateParams,
        capacity: usize,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<Generation, EngineError> {
        let mut constraint = params.grammar.as_ref().map(|g| self.constraint(g)).transpose()?;
        let (mut out, t1) = self.start_tree(dec, prompt_ids, params)?;
        // Reused across steps: the step's tokens (copied out of `dec`, which `accepted_sources` borrows next).
        let (mut sources, mut step, mut logits) = (Vec::new(), Vec::new(), Vec::new());
        'outer: while out.generated.len() < params.max_tokens {
            // The cache holds every committed token but the last (the next root), so a step fits while
            // `committed <= capacity`: like dense, generation fills the cache and emits one token more.
            if dec.committed() > capacity {
                out.finish = crate::FinishReason::ContextFull;
                break;
            }
            let layers_before = dec.layers_run();
            step.clear();
            let at_most = params.max_tokens - out.generated.len();
            let committed = match constraint.as_mut() {
                Some(c) => dec.step_constrained(at_most, c),
                None => dec.step_at_most(at_most),
            };
            step.extend_from_slice(committed.map_err(speculative_error)?);
            let layers = dec.layers_run() - layers_before;
            dec.accepted_sources(&mut sources);
            for (i, &next) in step.iter().enumerate() {
                let source = match sources.get(i) {
                    Some(DraftSource::Head) => TokenSource::Draft,
                    Some(DraftSource::Lookup) => TokenSource::Lookup,
                    None if sources.is_empty() => TokenSource::Plain,
                    None => TokenSource::Bonus,
                };
                // The target's distribution at the token's parent row of this step's verification.
                let entry = match params.logprobs {
                    Some(k) => {
                        dec.committed_logits(i, &mut logits).map_err(speculative_error)?;
                        Some(crate::logprobs::token_logprobs(&logits, next, k))
                    }
                    None => None,
                };
                if !out.push_traced(next, source, layers, entry, &mut on_text) {
                    break 'outer;
                }
            }
            // The step stops at the grammar's end (its last token is then the bonus).
            if constraint.as_ref().is_some_and(|c| c.is_finished()) {
                out.finish = crate::FinishReason::Stop;
                break;
            }
        }
        Ok(out.finish(prompt_ids, t1, &mut on_text))
    }
}

/// Cache capacity of a tree mode: the prompt, the tokens to generate and room for a whole draft tree past the
/// last one, within the context.
pub(crate) fn tree_capacity(prompt_ids: &[u32], params: &GenerateParams, ctx: usize) -> usize {
    (prompt_ids.len() + params.max_tokens + 64).min(ctx)
}

/// A decoder that commits one or more tokens per step (tree speculative decoding, with or without early exit).
pub(crate) trait TreeSteps {
    /// Appends tokens to the committed context.
    fn feed(&mut self, tokens: &[u32]) -> Result<(), decode::speculative::SpeculativeError>;
    /// Committed tokens so far.
    fn committed(&self) -> usize;
    /// One step committing at most `max_tokens` tokens.
    fn step_at_most(&mut self, max_tokens: usize) -> Result<&[u32], decode::speculative::SpeculativeError>;
    /// [`TreeSteps::step_at_most`] under a grammar (`constraint` follows every committed token); by default not
    /// supported.
    fn step_constrained(
        &mut self,
        _max_tokens: usize,
        _constraint: &mut dyn decode::TokenConstraint,
    ) -> Result<&[u32], decode::speculative::SpeculativeError> {
        Err(decode::speculative::SpeculativeError::Proposer("this mode cannot follow a grammar".into()))
    }
    /// Who drafted the accepted drafts of the last step (its committed tokens but the last), into `out`.
    fn accepted_sources(&self, out: &mut Vec<DraftSource>);
    /// Layers run per tree forward, summed over the forwards so far.
    fn layers_run(&self) -> usize;
    /// The target's full logits before the `i`-th token the last step committed, into `out` (for log
    /// probabilities); by default not available.
    fn committed_logits(
        &mut self,
        _i: usize,
        _out: &mut Vec<f32>,
    ) -> Result<(), decode::speculative::SpeculativeError> {
        Err(decode::speculative::SpeculativeError::Proposer("this mode cannot report log probabilities".into()))
    }
}

impl<P: Proposer> TreeSteps for SpeculativeDecoder<'_, P> {
    fn feed(&mut self, tokens: &[u32]) -> Result<(), decode::speculative::SpeculativeError> {
        SpeculativeDecoder::feed(self, tokens)
    }
    fn committed(&self) -> usize {
        self.tokens().len()
    }
    fn step_at_most(&mut self, max_tokens: usize) -> Result<&[u32], decode::speculative::SpeculativeError> {
        SpeculativeDecoder::step_at_most(self, max_tokens)
    }
    fn step_constrained(
        &mut self,
        max_tokens: usize,
        constraint: &mut dyn decode::TokenConstraint,
    ) -> Result<&[u32], decode::speculative::SpeculativeError> {
        SpeculativeDecoder::step_constrained(self, max_tokens, constraint)
    }
    fn accepted_sources(&self, out: &mut Vec<DraftSource>) {
        out.clear();
        out.extend(SpeculativeDecoder::accepted_sources(self));
    }
    fn layers_run(&self) -> usize {
        self.stats().target_forwards * self.model().config.n_layers
    }
    fn committed_logits(&mut self, i: usize, out: &mut Vec<f32>) -> Result<(), decode::speculative::SpeculativeError> {
        SpeculativeDecoder::committed_logits(self, i, out)
    }
}

impl TreeSteps for decode::specee::MergedDecoder<'_> {
    fn feed(&mut self, tokens: &[u32]) -> Result<(), decode::speculative::SpeculativeError> {
        decode::specee::MergedDecoder::feed(self, tokens)
    }
    fn committed(&self) -> usize {
        self.tokens().len()
    }
    fn step_at_most(&mut self, max_tokens: usize) -> Result<&[u32], decode::speculative::SpeculativeError> {
        decode::specee::MergedDecoder::step_at_most(self, max_tokens)
    }
    fn step_constrained(
        &mut self,
        max_tokens: usize,
        constraint: &mut dyn decode::TokenConstraint,
    ) -> Result<&[u32], decode::speculative::SpeculativeError> {
        decode::specee::MergedDecoder::step_constrained(self, max_tokens, constraint)
    }
    fn accepted_sources(&self, out: &mut Vec<DraftSource>) {
        out.clear();
        out.extend(decode::specee::MergedDecoder::accepted_sources(self));
    }
    fn layers_run(&self) -> usize {
        self.stats().layers
    }
}

/// A decoding error as an engine error (model errors keep their type).
pub fn speculative_error(e: decode::speculative::SpeculativeError) -> EngineError {
    match e {
        decode::speculative::SpeculativeError::Model(m) => EngineError::Model(m),
        other => EngineError::Speculative(other.to_string()),
    }
}
