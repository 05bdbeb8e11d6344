//! A loaded model with its tokenizer, and generation with stop rules and timings — shared by the CLI and the
//! server. Prompts are tokenized as llama.cpp does (special-token text parsed, BOS where the model asks for
//! it); `--chat` prompts are first rendered with the model's own chat template.

use crate::constraint::Constraint;
use crate::error::EngineError;
use crate::logprobs::{token_logprobs, TokenLogprobs};
use decode::{DenseDecoder, Sampler, SamplingParams, TokenConstraint};
use model::Model;
use std::path::Path;
use std::time::Instant;
use tokenizer::{chat, StreamDecoder, Tokenizer};

/// A model and its tokenizer.
pub struct Engine {
    pub model: Model,
    pub tokenizer: Tokenizer,
    /// llguidance's view of the vocabulary, built on first use ([`Engine::grammar_env`]).
    pub(crate) grammar: std::sync::OnceLock<crate::constraint::GrammarEnv>,
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateParams {
    /// Maximum number of new tokens.
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Stop at end-of-generation tokens (on by default).
    pub stop_at_eog: bool,
    /// Stop strings: generation ends when the text contains one (it is cut off).
    pub stop: Vec<String>,
    /// Where each generated token came from is appended here, just before its text reaches the `on_text`
    /// callback (the chat page and `specee chat` show it); `None`: not recorded.
    pub trace: Option<TraceSink>,
    /// A grammar the output must follow (`--json-schema`, `--grammar`, `response_format`): dense and eagle
    /// follow it (eagle's output equals constrained dense's); generation ends where the grammar does.
    pub grammar: Option<crate::constraint::GrammarSpec>,
    /// Report each generated token's log probability with this many most likely alternatives (0 to
    /// [`crate::logprobs::MAX_TOP_LOGPROBS`]) in [`Generation::logprobs`] and the traces; dense and the tree
    /// modes (the early-exit modes refuse it). Costs one full head pass per token in greedy modes.
    pub logprobs: Option<usize>,
    /// Jump-forward under a grammar in dense decoding ([`JumpForward`]; eagle ignores it: it drafts what the
    /// grammar forces and verifies it).
    pub jump_forward: JumpForward,
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_tokens: 128,
            sampling: SamplingParams::greedy(),
            stop_at_eog: true,
            stop: Vec::new(),
            trace: None,
            grammar: None,
            logprobs: None,
            jump_forward: JumpForward::Checked,
        }
    }
}

/// What dense decoding under a grammar does with the tokens the grammar forces next (a schema's keys, `", "`):
/// llguidance's canonical tokens for the bytes no choice can change.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum JumpForward {
    /// Fed as extra rows of one forward, each kept only where it is what the model would have chosen at the row
    /// before it: the output is exactly that of decoding without jump-forward, in fewer forwards.
    #[default]
    Checked,
    /// Fed as extra rows and committed as they are: a little faster, but the model might not have picked those
    /// tokens, so the output (never its grammar) can differ.
    Unchecked,
    /// One forward per token.
    Off,
}

impl JumpForward {
    /// `checked`, `unchecked` or `off`.
    pub fn parse(name: &str) -> Option<JumpForward> {
        match name {
            "checked" => Some(JumpForward::Checked),
            "unchecked" => Some(JumpForward::Unchecked),
            "off" => Some(JumpForward::Off),
            _ => None,
        }
    }
}

/// How a generated token was produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenSource {
    /// One forward of the target model for this token alone (dense, early exit, or a verify step that accepted
    /// no draft).
    Plain,
    /// A draft-head token the target accepted.
    Draft,
    /// A prompt-lookup (n-gram or datastore) token the target accepted.
    Lookup,
    /// The target's own token after the accepted drafts of a verify step.
    Bonus,
    /// A token the grammar forced, fed as an extra row of a forward instead of a step of its own
    /// ([`JumpForward`]).
    Forced,
}

impl TokenSource {
    /// Short name (`plain`, `draft`, `lookup`, `bonus`), as the server's stream extension spells it.
    pub fn name(self) -> &'static str {
        match self {
            TokenSource::Plain => "plain",
            TokenSource::Draft => "draft",
            TokenSource::Lookup => "lookup",
            TokenSource::Bonus => "bonus",
            TokenSource::Forced => "forced",
        }
    }
}

/// One generated token and how it was made.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenTrace {
    pub token: u32,
    /// The text it completed (empty while it ends inside a UTF-8 character; the token that completes the
    /// character carries it). Concatenated, the traces' texts are the generated text.
    pub text: String,
    pub source: TokenSource,
    /// Layers the forward that decided it ran (the model's depth unless it exited early).
    pub layers: u16,
    /// Its log probability and alternatives, when [`GenerateParams::logprobs`] asks for them.
    pub logprobs: Option<TokenLogprobs>,
}

/// Shared list of [`TokenTrace`]s a generation appends to (the reader drains it from the `on_text` callback).
pub type TraceSink = std::sync::Arc<std::sync::Mutex<Vec<TokenTrace>>>;

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// Hit `max_tokens`.
    Length,
    /// The context (`ctx`) filled up before `max_tokens`.
    ContextFull,
    /// An end-of-generation token or a stop string.
    Stop,
    /// The callback asked to stop.
    Cancelled,
}

/// Speeds of one generation.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timings {
    pub prompt_tokens: usize,
    /// Prompt tokens run through the model in `prompt_seconds`: all of them, except in the tree modes, whose first
    /// step takes the prompt's last token as its root (so a 1-token prompt prefills nothing and has no rate).
    pub prefilled_tokens: usize,
    pub prompt_seconds: f64,
    pub decode_tokens: usize,
    pub decode_seconds: f64,
    /// Generated tokens the grammar forced and jump-forward committed without a model step of their own.
    pub forced_tokens: usize,
}

impl Timings {
    pub fn prompt_tokens_per_s(&self) -> f64 {
        rate(self.prefilled_tokens, self.prompt_seconds)
    }
    pub fn decode_tokens_per_s(&self) -> f64 {
        rate(self.decode_tokens, self.decode_seconds)
    }
}

fn rate(n: usize, s: f64) -> f64 {
    if n > 0 && s > 0.0 {
        n as f64 / s
    } else {
        0.0
    }
}

/// The result of [`Engine::generate`].
#[derive(Clone, Debug)]
pub struct Generation {
    pub prompt_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
    pub timings: Timings,
    /// One entry per generated id, when [`GenerateParams::logprobs`] asked for them.
    pub logprobs: Option<Vec<TokenLogprobs>>,
}

impl Engine {
    /// Loads model and tokenizer from one GGUF file.
    pub fn load(path: impl AsRef<Path>) -> Result<Engine, EngineError> {
        let path = path.as_ref();
        if !path.exists() {
            return Err(EngineError::ModelNotFound(path.to_path_buf()));
        }
        let model = Model::load(path)?;
        let tokenizer = Tokenizer::from_gguf(model.gguf())?;
        Ok(Engine { model, tokenizer, grammar: std::sync::OnceLock::new() })
    }

    /// The text the model sees for `prompt`: itself, or with `chat` one user message rendered by the model's
    /// chat template with the assistant turn opened.
    pub fn render_prompt(&self, prompt: &str, chat: bool) -> Result<String, EngineError> {
        if !chat {
            return Ok(prompt.to_string());
        }
        self.render_chat(&[chat::Message::new("user", prompt)])
    }

    /// `Err` naming both models when the artifact at `path` (its `metadata`) was made for another model than this
    /// one, loaded from `model_path` ([`crate::identity::ModelIdentity::check`]).
    pub fn check_made_for(
        &self,
        what: &'static str,
        path: &Path,
        metadata: &std::collections::HashMap<String, String>,
        model_path: &Path,
    ) -> Result<(), EngineError> {
        let model = crate::identity::ModelIdentity::of(model_path, &self.model);
        crate::identity::ModelIdentity::check(metadata, &model).map_err(|source| EngineError::OtherModel {
            what,
            path: path.to_path_buf(),
            source,
        })
    }

    /// Renders a conversation with the model's chat template, opening the assistant's turn.
    pub fn render_chat(&self, messages: &[chat::Message]) -> Result<String, EngineError> {
        self.render_chat_with_tools(messages, None)
    }

    /// [`Engine::render_chat`] with OpenAI-style `tools` for the template's tools section.
    pub fn render_chat_with_tools(
        &self,
        messages: &[chat::Message],
        tools: Option<&serde_json::Value>,
    ) -> Result<String, EngineError> {
        let template = self.tokenizer.chat_template().ok_or(EngineError::NoChatTemplate)?;
        let piece = |id: Option<u32>| {
            id.map(|t| String::from_utf8_lossy(self.tokenizer.token_bytes(t)).into_owned()).unwrap_or_default()
        };
        let (bos, eos) = (piece(self.tokenizer.bos()), piece(self.tokenizer.eos()));
        Ok(chat::render_with_tools(template, messages, tools, true, &bos, &eos)?)
    }

    /// Whether the model's chat template has a tools section (`tools` requests need one).
    pub fn chat_template_supports_tools(&self) -> bool {
        self.tokenizer.chat_template().is_some_and(chat::template_supports_tools)
    }

    /// Token ids of a rendered prompt, as llama.cpp tokenizes prompts (specials parsed, BOS as the model says).
    pub fn tokenize_prompt(&self, text: &str) -> Vec<u32> {
        self.tokenizer.encode(text, true, true)
    }

    /// Generates up to `params.max_tokens` tokens after `prompt_ids` with dense decoding. `on_text` receives
    /// each complete piece of text as it is produced and returns `false` to stop early.
    pub fn generate(
        &self,
        prompt_ids: &[u32],
        params: &GenerateParams,
        ctx: usize,
        threads: usize,
        on_text: impl FnMut(&str) -> bool,
    ) -> Result<Generation, EngineError> {
        check_prompt(prompt_ids, ctx)?;
        let capacity = (prompt_ids.len() + params.max_tokens).min(ctx);
        let mut dec = DenseDecoder::new(&self.model, capacity, threads);
        self.decode_dense(&mut dec, prompt_ids, params, on_text)
    }

    /// The dense generation loop: feeds `prompt_ids` after what `dec` already holds (a conversation's earlier
    /// turns), then decodes until the stop rules, `params.max_tokens` or `dec`'s capacity end it.
    pub(crate) fn decode_dense(
        &self,
        dec: &mut DenseDecoder<'_>,
        prompt_ids: &[u32],
        params: &GenerateParams,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<Generation, EngineError> {
        let capacity = dec.capacity();
        let sampler = Sampler::new(params.sampling.clone());
        let mut out = Emitter::new(self, params, prompt_ids.len());
        let mut history: Vec<u32> = dec.tokens().to_vec();
        history.extend_from_slice(prompt_ids);

        let mut constraint = params.grammar.as_ref().map(|g| self.constraint(g)).transpose()?;
        let mut pick = Picker {
            greedy: params.sampling.is_greedy(),
            sampler,
            scratch: Vec::new(),
            argmax: Vec::new(),
            rows: Vec::new(),
            rows_ready: false,
        };
        // Log probabilities come from the raw logits of the forward that made the token (a full head pass).
        let entry = |dec: &mut DenseDecoder, row: usize, token: u32| {
            params.logprobs.map(|k| token_logprobs(dec.row_logits(row), token, k))
        };
        let t0 = Instant::now();
        let mut next = pick.step(dec, prompt_ids, &history, constraint.as_mut())?;
        let mut next_entry = entry(dec, prompt_ids.len() - 1, next);
        out.timings.prompt_seconds = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let layers = self.model.config.n_layers;
        // Jump-forward: what the grammar forces after a token (keys, separators) goes into the same forward as
        // extra rows instead of one forward each. Checked, each forced token is kept only where it is what the
        // model would have chosen at the row before it (its argmax or the best allowed token, or the sampler's
        // draw, made in the same order as without jumping); the first that is not is replaced by the model's
        // choice and the rest dropped, so the output is exactly that of decoding without jump-forward.
        // Unchecked, the forced tokens are committed as they are.
        let mut ids = Vec::new();
        while out.generated.len() < params.max_tokens {
            if !out.push_traced(next, TokenSource::Plain, layers, next_entry.take(), &mut on_text) {
                break;
            }
            history.push(next);
            ids.clear();
            ids.push(next);
            let mut finished = false;
            if let Some(c) = constraint.as_mut() {
                c.commit(next)?;
                finished = c.is_finished();
                if !finished && params.jump_forward != JumpForward::Off {
                    let room =
                        (params.max_tokens - out.generated.len()).min(capacity.saturating_sub(dec.tokens().len() + 1));
                    ids.extend(c.forced().into_iter().take(room));
                }
            }
            let forced = ids.len() - 1;
            if forced == 0 {
                if finished {
                    out.finish = FinishReason::Stop;
                    break;
                }
                if out.generated.len() == params.max_tokens {
                    break;
                }
                if dec.tokens().len() >= capacity {
                    out.finish = FinishReason::ContextFull;
                    break;
                }
                next = pick.step(dec, &ids, &history, constraint.as_mut())?;
                next_entry = entry(dec, 0, next);
                continue;
            }
            let c = constraint.as_mut().expect("forced tokens come from a grammar");
            let base = dec.tokens().len();
            let mut accepted = 0;
            let mut decided = false;
            if params.jump_forward == JumpForward::Unchecked {
                for &f in &ids[1..] {
                    c.commit(f)?;
                    history.push(f);
                    accepted += 1;
                    if c.is_finished() {
                        break;
                    }
                }
                ids.truncate(1 + accepted);
                let spent = out.generated.len() + accepted >= params.max_tokens;
                if !(c.is_finished() || spent) {
                    next = pick.step(dec, &ids, &history, Some(c))?;
                    next_entry = entry(dec, accepted, next);
                    decided = true;
                } else if params.logprobs.is_some() {
                    // Nothing comes after the forced tokens, but their log probabilities need their rows.
                    dec.feed_rows(&ids, false, &mut pick.argmax)?;
                }
            } else {
                dec.feed_rows(&ids, pick.greedy, &mut pick.argmax)?;
                pick.rows_ready = false;
                for row in 0..=forced {
                    let choice = pick.at_row(dec, row, &history, c)?;
                    if row < forced && choice == ids[row + 1] {
                        c.commit(choice)?;
                        history.push(choice);
                        accepted += 1;
                        if c.is_finished() {
                            break;
                        }
                    } else {
                        next = choice;
                        next_entry = entry(dec, row, choice);
                        decided = true;
                        break;
                    }
                }
                dec.truncate(base + 1 + accepted);
            }
            finished = c.is_finished();
            let mut stopped = false;
            for row in 0..accepted {
                let f = ids[row + 1];
                if !out.push_traced(f, TokenSource::Forced, layers, entry(dec, row, f), &mut on_text) {
                    stopped = true;
                    break;
                }
            }
            if stopped {
                break;
            }
            if finished {
                out.finish = FinishReason::Stop;
                break;
            }
            if !decided || out.generated.len() >= params.max_tokens {
                break;
            }
        }
        Ok(out.finish(prompt_ids, t1, &mut on_text))
    }
}

/// How dense decoding picks a token from a forward: greedy settings without a penalty need only the argmax (the
/// head screen), everything else the logits; under a grammar the token is the best allowed one (the screen's
/// when allowed, else from the logits) or a sample among the allowed ones.
struct Picker {
    greedy: bool,
    sampler: Sampler,
    scratch: Vec<f32>,
    /// Every row's argmax after [`DenseDecoder::feed_rows`] (greedy).
    argmax: Vec<u32>,
    /// Every row's full logits after it, computed in one product the first time a row needs them.
    rows: Vec<f32>,
    rows_ready: bool,
}

impl Picker {
    /// Feeds `ids` and picks the token after the last.
    fn step(
        &mut self,
        dec: &mut DenseDecoder,
        ids: &[u32],
        history: &[u32],
        constraint: Option<&mut Constraint>,
    ) -> Result<u32, EngineError> {
        Ok(match (self.greedy, constraint) {
            (true, None) => dec.feed_greedy(ids)?,
            (false, None) => self.sampler.sample(dec.feed(ids)?, history),
            (true, Some(c)) => {
                let argmax = dec.feed_greedy(ids)?;
                let full = |out: &mut Vec<f32>| {
                    out.clear();
                    out.extend_from_slice(dec.last_logits());
                };
                decode::constraint::constrained_argmax(argmax, c, full, &mut self.scratch)?
            }
            (false, Some(c)) => {
                self.scratch.clear();
                self.scratch.extend_from_slice(dec.feed(ids)?);
                c.mask(&mut self.scratch)?;
                self.sampler.sample(&self.scratch, history)
            }
        })
    }

    /// Picks the token after row `row` of the last [`DenseDecoder::feed_rows`] (`history`: the tokens up to it).
    fn at_row(
        &mut self,
        dec: &mut DenseDecoder,
        row: usize,
        history: &[u32],
        c: &mut Constraint,
    ) -> Result<u32, EngineError> {
        if self.greedy {
            let (rows, ready) = (&mut self.rows, &mut self.rows_ready);
            let full = |out: &mut Vec<f32>| {
                if !*ready {
                    dec.all_row_logits(rows);
                    *ready = true;
                }
                let v = dec.model().config.vocab_size;
                out.clear();
                out.extend_from_slice(&rows[row * v..(row + 1) * v]);
            };
            return Ok(decode::constraint::constrained_argmax(self.argmax[row], c, full, &mut self.scratch)?);
        }
        if !self.rows_ready {
            dec.all_row_logits(&mut self.rows);
            self.rows_ready = true;
        }
        let v = dec.model().config.vocab_size;
        self.scratch.clear();
        self.scratch.extend_from_slice(&self.rows[row * v..(row + 1) * v]);
        c.mask(&mut self.scratch)?;
        Ok(self.sampler.sample(&self.scratch, history))
    }
}

/// The prompt checks every generation mode makes: not empty, shorter than the context.
pub(crate) fn check_prompt(prompt_ids: &[u32], ctx: usize) -> Result<(), EngineError> {
    if prompt_ids.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    if prompt_ids.len() >= ctx {
        return Err(EngineError::PromptTooLong { prompt: prompt_ids.len(), ctx });
    }
    Ok(())
}

/// What one generation has produced so far, with the stop rules of [`GenerateParams`]: shared by dense and
/// speculative generation, which differ only in how tokens are produced, and by the server's batch scheduler,
/// which produces the tokens of many generations at once.
pub struct Emitter<'e> {
    engine: &'e Engine,
    stop_at_eog: bool,
    stop: Vec<String>,
    trace: Option<TraceSink>,
    /// Entries of the generated tokens, when asked for.
    logprobs: Option<Vec<TokenLogprobs>>,
    stream: StreamDecoder,
    text: String,
    /// Tokens emitted so far.
    pub generated: Vec<u32>,
    /// Why generation ended (meaningful once [`Emitter::push`] returned `false`, else `Length`).
    pub finish: FinishReason,
    pub timings: Timings,
}

impl<'e> Emitter<'e> {
    /// An emitter applying `params`' stop rules to the generation after a prompt of `prompt_tokens` tokens.
    pub fn new(engine: &'e Engine, params: &GenerateParams, prompt_tokens: usize) -> Self {
        Emitter {
            engine,
            stop_at_eog: params.stop_at_eog,
            stop: params.stop.clone(),
            trace: params.trace.clone(),
            logprobs: params.logprobs.map(|_| Vec::new()),
            stream: StreamDecoder::default(),
            text: String::new(),
            generated: Vec::new(),
            finish: FinishReason::Length,
            timings: Timings { prompt_tokens, prefilled_tokens: prompt_tokens, ..Default::default() },
        }
    }

    /// Takes the next token, made by one full forward ([`TokenSource::Plain`]); returns `false` when generation
    /// must end (end of generation, a stop string, or `on_text` asking to stop), with [`Emitter::finish`] set
    /// accordingly.
    pub fn push(&mut self, token: u32, on_text: &mut impl FnMut(&str) -> bool) -> bool {
        let layers = self.engine.model.config.n_layers;
        self.push_traced(token, TokenSource::Plain, layers, None, on_text)
    }

    /// [`Emitter::push`] for a token made by `source` with `layers` layers run, with its log probabilities
    /// when the generation asks for them (`None` there leaves the token without an entry).
    pub fn push_traced(
        &mut self,
        token: u32,
        source: TokenSource,
        layers: usize,
        logprobs: Option<TokenLogprobs>,
        on_text: &mut impl FnMut(&str) -> bool,
    ) -> bool {
        if self.stop_at_eog && self.engine.tokenizer.is_eog(token) {
            self.finish = FinishReason::Stop;
            return false;
        }
        self.generated.push(token);
        self.timings.forced_tokens += usize::from(source == TokenSource::Forced);
        let piece = self.stream.push(&self.engine.tokenizer, token);
        if let (Some(all), Some(entry)) = (self.logprobs.as_mut(), logprobs.as_ref()) {
            all.push(entry.clone());
        }
        if let Some(sink) = &self.trace {
            let layers = layers.min(u16::MAX as usize) as u16;
            let text = piece.clone();
            let trace = TokenTrace { token, text, source, layers, logprobs };
            sink.lock().unwrap_or_else(|p| p.into_inner()).push(trace);
        }
        self.text.push_str(&piece);
        if let Some(cut) = find_stop(&self.text, &self.stop) {
            self.text.truncate(cut);
            self.finish = FinishReason::Stop;
            return false;
        }
        if !piece.is_empty() && !on_text(&piece) {
            self.finish = FinishReason::Cancelled;
            return false;
        }
        true
    }

    /// Flushes the stream and returns the generation; `decode_start` is when decoding began.
    pub fn finish(
        mut self,
        prompt_ids: &[u32],
        decode_start: Instant,
        on_text: &mut impl FnMut(&str) -> bool,
    ) -> Generation {
        self.timings.decode_seconds = decode_start.elapsed().as_secs_f64();
        self.timings.decode_tokens = self.generated.len();
        if self.finish != FinishReason::Stop || self.stop.is_empty() {
            let rest = self.stream.flush();
            if !rest.is_empty() {
                on_text(&rest);
                self.text.push_str(&rest);
            }
        }
        Generation {
            prompt_ids: prompt_ids.to_vec(),
            generated_ids: self.generated,
            text: self.text,
            finish: self.finish,
            timings: self.timings,
            logprobs: self.logprobs,
        }
    }
}

/// Byte offset of the earliest stop string in `text`.
fn find_stop(text: &str, stops: &[String]) -> Option<usize> {
    stops.iter().filter(|s| !s.is_empty()).filter_map(|s| text.find(s.as_str())).min()
}
