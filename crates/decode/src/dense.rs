//! Dense decoding: every token runs through every layer. This is the lossless reference for all other
//! strategies (their greedy output must equal this one's, or be measured against it).

use model::{KvCache, Logits, Model, ModelError, Workspace};

/// Autoregressive decoding through the full model, one sequence.
pub struct DenseDecoder<'m> {
    model: &'m Model,
    kv: KvCache,
    ws: Workspace,
    hidden: Vec<f32>,
    /// Logits of [`DenseDecoder::last_logits`].
    logits: Vec<f32>,
    /// Tokens currently in the cache.
    tokens: Vec<u32>,
}

impl<'m> DenseDecoder<'m> {
    /// A decoder with a context of `ctx` tokens and `threads` threads.
    pub fn new(model: &'m Model, ctx: usize, threads: usize) -> Self {
        DenseDecoder {
            model,
            kv: model.new_cache(ctx),
            ws: Workspace::new(threads),
            hidden: Vec::new(),
            logits: Vec::new(),
            tokens: Vec::new(),
        }
    }

    /// The model.
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// Tokens in the cache so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Context capacity.
    pub fn capacity(&self) -> usize {
        self.kv.capacity()
    }

    /// Forgets everything.
    pub fn reset(&mut self) {
        self.kv.clear();
        self.tokens.clear();
    }

    /// Rolls the sequence back to its first `len` tokens.
    pub fn truncate(&mut self, len: usize) {
        self.kv.truncate(len);
        self.tokens.truncate(len);
    }

    /// Appends `tokens` (a prompt, or one sampled token) and returns the logits after the last one.
    pub fn feed(&mut self, tokens: &[u32]) -> Result<&[f32], ModelError> {
        let logits = self.model.forward(tokens, &mut self.kv, &mut self.ws, &mut self.hidden, Logits::Last)?;
        self.tokens.extend_from_slice(tokens);
        Ok(logits)
    }

    /// Appends `tokens` and returns the greedy next token: the argmax of the logits [`DenseDecoder::feed`] would
    /// return, without computing them ([`Model::forward_argmax`]).
    pub fn feed_greedy(&mut self, tokens: &[u32]) -> Result<u32, ModelError> {
        let next = self.model.forward_argmax(tokens, &mut self.kv, &mut self.ws, &mut self.hidden)?;
        self.tokens.extend_from_slice(tokens);
        Ok(next)
    }

    /// Full logits after the last token of the last feed (e.g. after [`DenseDecoder::feed_greedy`], when the
    /// greedy token is not enough); empty before any feed.
    pub fn last_logits(&mut self) -> &[f32] {
        let d = self.model.config.n_embd;
        let v = self.model.config.vocab_size;
        if self.hidden.len() < d {
            return &[];
        }
        let last = &self.hidden[self.hidden.len() - d..];
        let mut normed = vec![0.0; d];
        self.model.final_norm(last, &mut normed);
        self.logits.resize(v, 0.0);
        self.model.head_full(&normed, 1, &mut self.logits, &mut self.ws);
        &self.logits
    }

    /// Appends `tokens` and returns the logits of every one of them (`n × vocab`), e.g. for perplexity.
    pub fn feed_all_logits(&mut self, tokens: &[u32]) -> Result<&[f32], ModelError> {
        let logits = self.model.forward(tokens, &mut self.kv, &mut self.ws, &mut self.hidden, Logits::All)?;
        self.tokens.extend_from_slice(tokens);
        Ok(logits)
    }
}
