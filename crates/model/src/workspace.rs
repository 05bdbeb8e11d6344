//! Per-sequence scratch memory and the thread pool: everything the forward pass writes besides the hidden
//! state and the KV cache. Buffers grow to the largest batch seen and are then reused, so steady-state
//! decoding allocates nothing.

use crate::sparsity::{ActCounts, ActHistograms};
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
    /// Histograms of the layers' matrix inputs, while [`Workspace::record_activations`] is on.
    pub(crate) act_record: Option<Box<ActHistograms>>,
    /// Input entries zeroed by the model's activation sparsity ([`crate::Model::set_act_sparsity`]) and seen.
    pub(crate) act_counts: ActCounts,
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
            act_record: None,
            act_counts: ActCounts::default(),
        }
    }

    /// Starts recording histograms of every layer's matrix inputs (before any sparsity zeroes them) for a model of
    /// `n_layers` layers, dropping any recording in progress.
    pub fn record_activations(&mut self, n_layers: usize) {
        self.act_record = Some(Box::new(ActHistograms::new(n_layers)));
    }

    /// Ends the recording and returns it.
    pub fn take_recording(&mut self) -> Option<ActHistograms> {
        self.act_record.take().map(|b| *b)
    }

    /// Input entries the model's activation sparsity zeroed and saw through this workspace so far.
    pub fn act_counts(&self) -> ActCounts {
        self.act_counts
    }

    /// Sets [`Workspace::act_counts`] back to zero.
    pub fn reset_act_counts(&mut self) {
        self.act_counts = ActCounts::default();
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
