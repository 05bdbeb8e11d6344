//! Helpers shared by the unit tests of the decoding strategies: the dense greedy reference and a speculative run
//! of the same length on the tiny random models of `model::testing`.

use crate::sampling::argmax;
use crate::speculative::{Proposer, SpeculativeDecoder};
use crate::DenseDecoder;
use model::Model;

/// The prompt every tiny-model test continues.
pub(crate) const PROMPT: [u32; 8] = [1, 7, 3, 9, 4, 4, 12, 5];

/// `n` tokens of dense greedy decoding after [`PROMPT`].
pub(crate) fn dense_greedy(model: &Model, n: usize) -> Vec<u32> {
    let mut dense = DenseDecoder::new(model, 128, 2);
    let mut out = Vec::new();
    let mut next = argmax(dense.feed(&PROMPT).unwrap());
    for _ in 0..n {
        out.push(next);
        next = argmax(dense.feed(&[next]).unwrap());
    }
    out
}

/// `n` tokens of `dec` after [`PROMPT`].
pub(crate) fn speculative_greedy<P: Proposer>(dec: &mut SpeculativeDecoder<'_, P>, n: usize) -> Vec<u32> {
    dec.feed(&PROMPT).unwrap();
    let mut got = Vec::new();
    while got.len() < n {
        got.extend_from_slice(dec.step_at_most(n - got.len()).unwrap());
    }
    got
}
