//! Multi-turn conversations (`specee chat`): the messages so far, rendered with the model's chat template, and a
//! decoder whose KV cache is kept between turns, so that a turn runs only the tokens its cache does not already
//! hold — the new user message, and whatever of the last answer the template renders differently from how it
//! was generated.
//!
//! Each turn renders the whole conversation, takes the longest common prefix of its tokens and the cached ones,
//! rolls the decoder back to it and feeds the rest. The result is exactly a fresh prefill of the conversation
//! (rows are batch-invariant: a token's K/V do not depend on how many tokens were run with it), so greedy
//! answers equal `specee generate --messages` of the same conversation. The early-exit modes (`specee`,
//! `specee-eagle`) leave some layers of exited tokens without K/V, so they re-prefill the conversation each turn
//! instead.
//!
//! When the conversation no longer fits the context (its tokens plus room for the answer), the oldest turns go
//! first (a user message with the answer after it), the system prompt stays; [`Turn::dropped_messages`] says how
//! many went.

use crate::early_exit::SpecEeSetup;
use crate::error::EngineError;
use crate::session::{Engine, GenerateParams, Generation};
use crate::speculative::AnyProposer;
use decode::specee::{MergedDecoder, SpecEeDecoder};
use decode::speculative::SpeculativeDecoder;
use decode::DenseDecoder;
use tokenizer::chat::Message;

/// The decoder a conversation keeps, one per decoding mode.
pub enum ChatDecoder<'e> {
    Dense(DenseDecoder<'e>),
    /// `eagle` and `ngram`.
    Tree(Box<SpeculativeDecoder<'e, AnyProposer>>),
    Specee(Box<SpecEeDecoder<'e>>),
    Merged(Box<MergedDecoder<'e>>),
}

impl<'e> ChatDecoder<'e> {
    /// A dense decoder for a context of `ctx` tokens.
    pub fn dense(engine: &'e Engine, ctx: usize, threads: usize) -> Self {
        ChatDecoder::Dense(DenseDecoder::new(&engine.model, ctx, threads))
    }

    /// A tree speculative decoder (`eagle`, `ngram`) drafting with `proposer`.
    pub fn tree(
        engine: &'e Engine,
        ctx: usize,
        threads: usize,
        proposer: AnyProposer,
        params: &GenerateParams,
    ) -> Self {
        let dec = SpeculativeDecoder::new(&engine.model, ctx, threads, proposer, params.sampling.clone());
        ChatDecoder::Tree(Box::new(dec))
    }

    /// An early-exit decoder (`specee`).
    pub fn specee(engine: &'e Engine, ctx: usize, threads: usize, setup: &'e SpecEeSetup) -> Self {
        ChatDecoder::Specee(Box::new(setup.decoder(engine, ctx, threads)))
    }

    /// Early exit inside tree verification (`specee-eagle`).
    pub fn merged(engine: &'e Engine, ctx: usize, threads: usize, setup: &'e SpecEeSetup) -> Self {
        ChatDecoder::Merged(Box::new(setup.merged_decoder(engine, ctx, threads)))
    }

    /// Generates the answer after the prompt `ids` (which must fit the context), reusing the cached state of
    /// the longest prefix `ids` shares with what the decoder holds and running the rest ([`Turn::reused_tokens`]
    /// says how much was reused). The answer is what a fresh decoder would write after `ids`.
    pub fn continue_with(
        &mut self,
        engine: &Engine,
        ids: Vec<u32>,
        params: &GenerateParams,
        on_text: impl FnMut(&str) -> bool,
    ) -> Result<Turn, EngineError> {
        let ctx = self.capacity();
        crate::session::check_prompt(&ids, ctx)?;
        let shared = ids.iter().zip(self.tokens()).take_while(|(a, b)| a == b).count();
        // At least the last prompt token runs: its logits give the first answer token.
        let reused_tokens = self.keep(shared.min(ids.len() - 1));
        let feed = &ids[reused_tokens..];
        let params = GenerateParams { max_tokens: params.max_tokens.min(ctx - ids.len()), ..params.clone() };
        let before = self.counters();
        let mut generation = match self {
            ChatDecoder::Dense(d) => engine.decode_dense(d, feed, &params, on_text)?,
            ChatDecoder::Tree(d) => engine.generate_tree(d.as_mut(), feed, &params, ctx, on_text)?,
            ChatDecoder::Specee(d) => {
                crate::early_exit::greedy_only(&params, "specee")?;
                engine.decode_specee(d, feed, &params, on_text)?
            }
            ChatDecoder::Merged(d) => {
                crate::early_exit::greedy_only(&params, "specee-eagle")?;
                engine.generate_tree(d.as_mut(), feed, &params, ctx, on_text)?
            }
        };
        let after = self.counters();
        generation.timings.prompt_tokens = ids.len();
        generation.prompt_ids = ids;
        let ratio = |a: usize, b: usize| if b > 0 { a as f64 / b as f64 } else { 0.0 };
        let forwards = after.forwards - before.forwards;
        let acceptance_length = (forwards > 0).then(|| ratio(after.committed - before.committed, forwards));
        let layer_steps = after.layer_tokens - before.layer_tokens;
        let layers_per_token = if layer_steps > 0 {
            ratio(after.layers - before.layers, layer_steps)
        } else {
            engine.model.config.n_layers as f64
        };
        Ok(Turn {
            generation,
            reused_tokens,
            dropped_messages: 0,
            target_forwards: forwards,
            acceptance_length,
            layers_per_token,
        })
    }

    /// Tokens whose state the decoder holds (for the tree decoders: committed tokens, the last one not yet run).
    fn tokens(&self) -> &[u32] {
        match self {
            ChatDecoder::Dense(d) => d.tokens(),
            ChatDecoder::Tree(d) => d.tokens(),
            ChatDecoder::Specee(d) => d.tokens(),
            ChatDecoder::Merged(d) => d.tokens(),
        }
    }

    fn capacity(&self) -> usize {
        match self {
            ChatDecoder::Dense(d) => d.capacity(),
            ChatDecoder::Tree(d) => d.capacity(),
            ChatDecoder::Specee(d) => d.capacity(),
            ChatDecoder::Merged(d) => d.capacity(),
        }
    }

    /// Rolls back to the first `len` tokens; returns how many it kept (the early-exit decoders keep none).
    fn keep(&mut self, len: usize) -> usize {
        match self {
            ChatDecoder::Dense(d) => {
                d.truncate(len);
                len.min(d.tokens().len())
            }
            ChatDecoder::Tree(d) => {
                d.truncate(len);
                len.min(d.tokens().len())
            }
            ChatDecoder::Specee(d) => {
                d.reset();
                0
            }
            ChatDecoder::Merged(d) => {
                d.reset();
                0
            }
        }
    }

    /// The mode's counters, as running sums (differences of two give one turn's).
    fn counters(&self) -> Counters {
        match self {
            ChatDecoder::Dense(_) => Counters::default(),
            ChatDecoder::Tree(d) => {
                let s = d.stats();
                Counters { forwards: s.target_forwards, committed: s.committed_tokens, ..Default::default() }
            }
            ChatDecoder::Specee(d) => {
                let s = d.stats();
                Counters { layer_tokens: s.tokens, layers: s.layers, ..Default::default() }
            }
            ChatDecoder::Merged(d) => {
                let s = d.stats();
                Counters {
                    forwards: s.speculative.target_forwards,
                    committed: s.speculative.committed_tokens,
                    layer_tokens: s.speculative.target_forwards,
                    layers: s.layers,
                }
            }
        }
    }
}

/// Running sums of a decoder's counters.
#[derive(Clone, Copy, Debug, Default)]
struct Counters {
    forwards: usize,
    committed: usize,
    /// Steps (`specee`: tokens; `specee-eagle`: tree forwards) and the layers they ran.
    layer_tokens: usize,
    layers: usize,
}

/// What one turn did.
#[derive(Clone, Debug)]
pub struct Turn {
    /// The answer (`prompt_ids`: the whole rendered conversation before it).
    pub generation: Generation,
    /// Prompt tokens whose KV came from the cache (not run again).
    pub reused_tokens: usize,
    /// Oldest messages dropped so that the conversation fits the context.
    pub dropped_messages: usize,
    /// Full-model forwards of the tree modes' verify steps.
    pub target_forwards: usize,
    /// Tokens committed per target forward (the tree modes).
    pub acceptance_length: Option<f64>,
    /// Layers run per decoded token (per tree forward in `specee-eagle`).
    pub layers_per_token: f64,
}

/// A conversation with one model: its messages and a decoder holding their KV cache.
pub struct Conversation<'e> {
    engine: &'e Engine,
    decoder: ChatDecoder<'e>,
    messages: Vec<Message>,
}

impl<'e> Conversation<'e> {
    /// An empty conversation decoding with `decoder` (its capacity is the context size).
    pub fn new(engine: &'e Engine, decoder: ChatDecoder<'e>) -> Self {
        Conversation { engine, decoder, messages: Vec::new() }
    }

    /// The messages so far (a system prompt first, if there is one).
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// Replaces the conversation (`/load`); the cache keeps what the new one shares with the old.
    pub fn set_messages(&mut self, messages: Vec<Message>) {
        self.messages = messages;
    }

    /// Sets (or with `None` removes) the system prompt, keeping the rest of the conversation.
    pub fn set_system(&mut self, text: Option<&str>) {
        if self.messages.first().is_some_and(|m| m.role == "system") {
            self.messages.remove(0);
        }
        if let Some(text) = text {
            self.messages.insert(0, Message::new("system", text));
        }
    }

    /// Forgets every message but the system prompt.
    pub fn reset(&mut self) {
        self.messages.retain(|m| m.role == "system");
    }

    /// Context size in tokens.
    pub fn ctx(&self) -> usize {
        self.decoder.capacity()
    }

    /// Tokens the cache holds now.
    pub fn cached_tokens(&self) -> usize {
        self.decoder.tokens().len()
    }

    /// Adds the user's `text` and generates the assistant's answer (streamed to `on_text`, which returns `false`
    /// to stop it: the partial answer stays in the conversation). On an error the user message is taken back.
    pub fn say(
        &mut self,
        text: &str,
        params: &GenerateParams,
        on_text: impl FnMut(&str) -> bool,
    ) -> Result<Turn, EngineError> {
        self.messages.push(Message::new("user", text));
        let result = self.answer(params, on_text);
        if result.is_err() {
            self.messages.pop();
        }
        result
    }

    fn answer(&mut self, params: &GenerateParams, on_text: impl FnMut(&str) -> bool) -> Result<Turn, EngineError> {
        let (ids, dropped_messages) = self.fit(params.max_tokens)?;
        let mut turn = self.decoder.continue_with(self.engine, ids, params, on_text)?;
        turn.dropped_messages = dropped_messages;
        self.messages.push(Message::new("assistant", turn.generation.text.clone()));
        Ok(turn)
    }

    /// The conversation's tokens (assistant turn opened), after dropping the oldest turns until they leave room
    /// for `min(max_tokens, ctx / 2)` answer tokens; and how many messages were dropped. `Err` when even the
    /// system prompt and the last user message alone do not fit the context.
    fn fit(&mut self, max_tokens: usize) -> Result<(Vec<u32>, usize), EngineError> {
        let ctx = self.decoder.capacity();
        let room = max_tokens.min(ctx / 2).max(1);
        let mut dropped = 0;
        loop {
            let ids = self.engine.tokenize_prompt(&self.engine.render_chat(&self.messages)?);
            if ids.is_empty() {
                return Err(EngineError::EmptyPrompt);
            }
            if ids.len() + room <= ctx {
                return Ok((ids, dropped));
            }
            // The oldest message that is neither the system prompt nor the new user message goes, with the
            // answer after it when it is a user message.
            let first = usize::from(self.messages.first().is_some_and(|m| m.role == "system"));
            if first + 1 >= self.messages.len() {
                if ids.len() < ctx {
                    return Ok((ids, dropped));
                }
                return Err(EngineError::PromptTooLong { prompt: ids.len(), ctx });
            }
            let was_user = self.messages[first].role == "user";
            self.messages.remove(first);
            dropped += 1;
            if was_user && first + 1 < self.messages.len() && self.messages[first].role == "assistant" {
                self.messages.remove(first);
                dropped += 1;
            }
        }
    }
}

/// Parses a conversation saved as OpenAI-style JSON messages (`[{"role": …, "content": …}, …]`, or an object
/// with a `messages` array): what `/load` and `generate --messages` read.
pub fn parse_messages(json: &str) -> Result<Vec<Message>, String> {
    let value: serde_json::Value = serde_json::from_str(json).map_err(|e| format!("not JSON: {e}"))?;
    let list = match &value {
        serde_json::Value::Array(a) => a,
        serde_json::Value::Object(o) => match o.get("messages") {
            Some(serde_json::Value::Array(a)) => a,
            _ => return Err("expected an array of messages, or an object with a \"messages\" array".into()),
        },
        _ => return Err("expected an array of messages, or an object with a \"messages\" array".into()),
    };
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let field = |name: &str| match m.get(name) {
                Some(serde_json::Value::String(s)) => Ok(s.clone()),
                _ => Err(format!("message {i}: \"{name}\" must be a string")),
            };
            let role = field("role")?;
            if !matches!(role.as_str(), "system" | "user" | "assistant") {
                return Err(format!("message {i}: role \"{role}\" is not system, user or assistant"));
            }
            Ok(Message::new(role, field("content")?))
        })
        .collect()
}

/// The messages as OpenAI-style JSON (what `/save` writes).
pub fn messages_json(messages: &[Message]) -> String {
    serde_json::to_string_pretty(messages).unwrap_or_else(|_| "[]".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_bad_files_are_explained() {
        let m = vec![Message::new("system", "Be brief."), Message::new("user", "Hi \"there\"\n")];
        assert_eq!(parse_messages(&messages_json(&m)).unwrap(), m);
        assert_eq!(parse_messages(r#"{"messages": [{"role": "user", "content": "x"}]}"#).unwrap().len(), 1);
        assert!(parse_messages("[{").unwrap_err().starts_with("not JSON"));
        assert!(parse_messages("42").unwrap_err().contains("array of messages"));
        assert_eq!(parse_messages(r#"[{"role": "user"}]"#).unwrap_err(), "message 0: \"content\" must be a string");
        assert!(parse_messages(r#"[{"role": "tool", "content": "x"}]"#).unwrap_err().contains("not system"));
    }
}
