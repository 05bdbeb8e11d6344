//! Shared helpers of the decode integration tests: tiny random-weight models written with the GGUF writer, dense
//! greedy reference runs, and paths of the real models and the reference outputs.
#![allow(dead_code)]

use decode::sampling::argmax;
use decode::DenseDecoder;
use model::Model;
use std::path::PathBuf;

pub const VOCAB: usize = 96;
/// A tiny `arch` model with random F32 weights (see [`model::testing::tiny_model`]), vocabulary [`VOCAB`].
pub fn tiny_model(arch: &str, window: Option<usize>, seed: u64) -> Model {
    model::testing::tiny_model(arch, window, seed, VOCAB)
}

/// Dense greedy decoding: `n` tokens after `prompt`, as the engine does it (prompt in one batch, then one token
/// per forward, argmax each time).
pub fn dense_greedy(model: &Model, prompt: &[u32], n: usize, threads: usize) -> Vec<u32> {
    let mut dec = DenseDecoder::new(model, prompt.len() + n + 1, threads);
    let mut out = Vec::with_capacity(n);
    let mut next = argmax(dec.feed(prompt).expect("dense prefill"));
    while out.len() < n {
        out.push(next);
        if out.len() < n {
            next = argmax(dec.feed(&[next]).expect("dense step"));
        }
    }
    out
}

pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn reference_dir() -> PathBuf {
    std::env::var_os("SPECEE_REFERENCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("../shared/reference"))
}

pub fn models_dir() -> PathBuf {
    std::env::var_os("SPECEE_MODELS_DIR").map(PathBuf::from).unwrap_or_else(|| workspace_root().join("models"))
}
