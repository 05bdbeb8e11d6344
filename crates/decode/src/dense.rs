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

    /// Appends `tokens`; with `argmax`, puts in `out` the greedy token after each of them (the argmax of every
    /// row's logits, through the head's screen as [`DenseDecoder::feed_greedy`]). [`DenseDecoder::row_logits`]
    /// gives a row's full logits.
    pub fn feed_rows(&mut self, tokens: &[u32], argmax: bool, out: &mut Vec<u32>) -> Result<(), ModelError> {
        self.model.forward(tokens, &mut self.kv, &mut self.ws, &mut self.hidden, Logits::None)?;
        self.tokens.extend_from_slice(tokens);
        out.clear();
        if !argmax {
            return Ok(());
        }
        let (n, d) = (tokens.len(), self.model.config.n_embd);
        let mut normed = vec![0.0; n * d];
        for (row, o) in self.hidden.chunks_exact(d).zip(normed.chunks_exact_mut(d)) {
            self.model.final_norm(row, o);
        }
        out.resize(n, 0);
        self.model.head_argmax(&normed, n, out, &mut self.ws);
        Ok(())
    }

    /// Full logits after the last token of the last feed (e.g. after [`DenseDecoder::feed_greedy`], when the
    /// greedy token is not enough); empty before any feed.
    pub fn last_logits(&mut self) -> &[f32] {
        let rows = self.hidden.len() / self.model.config.n_embd;
        self.row_logits(rows.wrapping_sub(1))
    }

    /// Full logits after row `row` of the last feed (the distribution of the token after its `row`-th token),
    /// computed from the hidden state that feed left; empty when the feed had no such row.
    pub fn row_logits(&mut self, row: usize) -> &[f32] {
        let d = self.model.config.n_embd;
        let v = self.model.config.vocab_size;
        if row >= self.hidden.len() / d {
            return &[];
        }
        let mut normed = vec![0.0; d];
        self.model.final_norm(&self.hidden[row * d..(row + 1) * d], &mut normed);
        self.logits.resize(v, 0.0);
        self.model.head_full(&normed, 1, &mut self.logits, &mut self.ws);
        &self.logits
    }

    /// Full logits after every row of the last feed (`rows × vocab` into `out`), in one product over the head.
    pub fn all_row_logits(&mut self, out: &mut Vec<f32>) {
        let (d, v) = (self.model.config.n_embd, self.model.config.vocab_size);
        let n = self.hidden.len() / d;
        let mut normed = vec![0.0; n * d];
        for (row, o) in self.hidden.chunks_exact(d).zip(normed.chunks_exact_mut(d)) {
            self.model.final_norm(row, o);
        }
        out.resize(n * v, 0.0);
        self.model.head_full(&normed, n, out, &mut self.ws);
    }

    /// Appends `tokens` and returns the logits of every one of them (`n × vocab`), e.g. for perplexity.
    pub fn feed_all_logits(&mut self, tokens: &[u32]) -> Result<&[f32], ModelError> {
        let logits = self.model.forward(tokens, &mut self.kv, &mut self.ws, &mut self.hidden, Logits::All)?;
        self.tokens.extend_from_slice(tokens);
        Ok(logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_argmax_and_row_logits_after_a_greedy_feed_are_those_of_feed_all_logits() {
        let model = model::testing::tiny_model("llama", None, 5, 64);
        let ids = [3u32, 17, 40, 9];
        let mut all = DenseDecoder::new(&model, 16, 2);
        let want = all.feed_all_logits(&ids).unwrap().to_vec();
        let mut dec = DenseDecoder::new(&model, 16, 2);
        let argmax = dec.feed_greedy(&ids).unwrap();
        let mut rows = Vec::new();
        DenseDecoder::new(&model, 16, 2).feed_rows(&ids, true, &mut rows).unwrap();
        for row in 0..ids.len() {
            assert_eq!(rows[row], crate::sampling::argmax(&want[row * 64..(row + 1) * 64]), "row {row}");
            let got = dec.row_logits(row).to_vec();
            let exp = &want[row * 64..(row + 1) * 64];
            let gap = got.iter().zip(exp).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(gap < 1e-4, "row {row}: {gap}");
        }
        let mut every = Vec::new();
        dec.all_row_logits(&mut every);
        let gap = every.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(gap < 1e-4, "all rows: {gap}");
        let row3 = dec.row_logits(3).to_vec();
        assert_eq!(dec.last_logits(), row3.as_slice());
        assert_eq!(crate::sampling::argmax(dec.last_logits()), argmax);
        assert!(dec.row_logits(4).is_empty());
    }
}
