//! The key/value cache: one slab per layer, with its own length, so that strategies that skip layers
//! (early exit) or try tokens speculatively (draft trees) can keep layers at different lengths and roll them
//! back. Each slot remembers the absolute position of its token (used for sliding-window masks), so slot index
//! and position may differ.
//!
//! Invariants: for every layer, slots `0..len` are valid; `len <= capacity`; a slot's K and V rows are
//! `kv_dim` and `kv_dim_v` values, stored as f16 (bits), the precision the attention reads them at (as ggml's
//! f16 cache): half the bytes of f32 for the attention to stream.

use crate::config::Config;
use crate::error::ModelError;

/// Cache of one layer.
#[derive(Clone, Debug)]
pub struct LayerCache {
    pub(crate) k: Vec<u16>,
    pub(crate) v: Vec<u16>,
    pub(crate) pos: Vec<u32>,
    pub(crate) len: usize,
}

/// Key/value cache for all layers of one sequence.
#[derive(Clone, Debug)]
pub struct KvCache {
    capacity: usize,
    kv_dim: usize,
    kv_dim_v: usize,
    layers: Vec<LayerCache>,
}

impl KvCache {
    /// An empty cache holding up to `capacity` tokens per layer. Memory is reserved lazily by the OS
    /// (zeroed allocations), so a large capacity costs only what is used.
    pub fn new(config: &Config, capacity: usize) -> KvCache {
        let kv_dim = config.kv_dim();
        let kv_dim_v = config.n_head_kv * config.head_dim_v;
        let layers = (0..config.n_layers)
            .map(|_| LayerCache {
                k: vec![0; capacity * kv_dim],
                v: vec![0; capacity * kv_dim_v],
                pos: vec![0; capacity],
                len: 0,
            })
            .collect();
        KvCache { capacity, kv_dim, kv_dim_v, layers }
    }

    /// Maximum number of slots per layer.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Valid slots in `layer`.
    pub fn len(&self, layer: usize) -> usize {
        self.layers[layer].len
    }

    /// Valid slots in layer 0 (the sequence length for dense decoding).
    pub fn seq_len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.len)
    }

    /// Whether no layer holds anything.
    pub fn is_empty(&self) -> bool {
        self.layers.iter().all(|l| l.len == 0)
    }

    /// Positions stored in `layer`'s valid slots.
    pub fn positions(&self, layer: usize) -> &[u32] {
        let l = &self.layers[layer];
        &l.pos[..l.len]
    }

    /// Drops every slot at index `>= len` in every layer.
    pub fn truncate(&mut self, len: usize) {
        for l in &mut self.layers {
            l.len = l.len.min(len);
        }
    }

    /// Drops every slot at index `>= len` in one layer.
    pub fn truncate_layer(&mut self, layer: usize, len: usize) {
        let l = &mut self.layers[layer];
        l.len = l.len.min(len);
    }

    /// Empties the cache.
    pub fn clear(&mut self) {
        self.truncate(0);
    }

    /// Keeps, of the slots from `start` on in `layer`, only those at `start + keep[i]` (ascending), moved to
    /// `start + i`. Used to keep the accepted path of a draft tree.
    pub fn compact_layer(&mut self, layer: usize, start: usize, keep: &[usize]) {
        let (kd, vd) = (self.kv_dim, self.kv_dim_v);
        let l = &mut self.layers[layer];
        let mut new_len = start;
        for &off in keep {
            let src = start + off;
            if src >= l.len {
                break;
            }
            if src != new_len {
                l.k.copy_within(src * kd..(src + 1) * kd, new_len * kd);
                l.v.copy_within(src * vd..(src + 1) * vd, new_len * vd);
                l.pos[new_len] = l.pos[src];
            }
            new_len += 1;
        }
        l.len = new_len;
    }

    /// [`KvCache::compact_layer`] on every layer.
    pub fn compact(&mut self, start: usize, keep: &[usize]) {
        for layer in 0..self.layers.len() {
            self.compact_layer(layer, start, keep);
        }
    }

    /// A new cache of `capacity` slots holding a copy of this one's first `len` slots of every layer (a reused
    /// prompt prefix: the server's prefix cache). `len` is cut to what every layer holds and to `capacity`.
    pub fn prefix_copy(&self, len: usize, capacity: usize) -> KvCache {
        let len = self.layers.iter().map(|l| l.len).min().unwrap_or(0).min(len).min(capacity);
        let (kd, vd) = (self.kv_dim, self.kv_dim_v);
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let mut k = vec![0; capacity * kd];
                let mut v = vec![0; capacity * vd];
                let mut pos = vec![0; capacity];
                k[..len * kd].copy_from_slice(&l.k[..len * kd]);
                v[..len * vd].copy_from_slice(&l.v[..len * vd]);
                pos[..len].copy_from_slice(&l.pos[..len]);
                LayerCache { k, v, pos, len }
            })
            .collect();
        KvCache { capacity, kv_dim: kd, kv_dim_v: vd, layers }
    }

    /// Bytes one slot takes over all layers (keys, values and position).
    pub fn bytes_per_slot(&self) -> usize {
        self.layers.len() * ((self.kv_dim + self.kv_dim_v) * 2 + 4)
    }

    /// Checks that `n` more slots fit in `layer`.
    pub(crate) fn check_room(&self, layer: usize, n: usize) -> Result<(), ModelError> {
        let needed = self.layers[layer].len + n;
        if needed > self.capacity {
            return Err(ModelError::ContextFull { needed, capacity: self.capacity });
        }
        Ok(())
    }

    pub(crate) fn layer(&self, layer: usize) -> &LayerCache {
        &self.layers[layer]
    }

    pub(crate) fn layer_mut(&mut self, layer: usize) -> &mut LayerCache {
        &mut self.layers[layer]
    }
}
