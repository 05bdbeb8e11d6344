//! Per-sequence scratch memory and the thread pool: everything the forward pass writes besides the hidden
//! state and the KV cache. Buffers grow to the largest batch seen and are then reused, so steady-state
//! decoding allocates nothing.

use kernels::{MatmulScratch, ThreadPool};

/// Scratch buffers and threads for [`crate::Model`]'s step API.
pub struct Workspace {
    pub(crate) pool: ThreadPool,
    pub(crate) mm: MatmulScratch,
    pub(crate) h: Vec<f32>,
    pub(crate) q: Vec<f32>,
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
    pub(crate) att: Vec<f32>,
    pub(crate) o: Vec<f32>,
    pub(crate) gate: Vec<f32>,
    pub(crate) up: Vec<f32>,
    pub(crate) scores: Vec<f32>,
    pub(crate) cos: Vec<f32>,
    pub(crate) sin: Vec<f32>,
    /// Normed hidden rows for the head.
    pub(crate) normed: Vec<f32>,
    /// Logits of the last head call.
    pub(crate) logits: Vec<f32>,
}

impl Workspace {
    /// A workspace computing with `n_threads` threads (at least 1).
    pub fn new(n_threads: usize) -> Workspace {
        Workspace {
            pool: ThreadPool::new(n_threads.max(1)),
            mm: MatmulScratch::default(),
            h: Vec::new(),
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            att: Vec::new(),
            o: Vec::new(),
            gate: Vec::new(),
            up: Vec::new(),
            scores: Vec::new(),
            cos: Vec::new(),
            sin: Vec::new(),
            normed: Vec::new(),
            logits: Vec::new(),
        }
    }

    /// The thread pool.
    pub fn pool(&self) -> &ThreadPool {
        &self.pool
    }

    /// Number of threads.
    pub fn n_threads(&self) -> usize {
        self.pool.n_threads()
    }
}

/// Grows `v` to at least `n` elements (never shrinks).
pub(crate) fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}
