//! The key/value cache: one slab per layer, with its own length, so that strategies that skip layers
//! (early exit) or try tokens speculatively (draft trees) can keep layers at different lengths and roll them
//! back. Each slot remembers the absolute position of its token (used for sliding-window masks), so slot index
//! and position may differ.
//!
//! Invariants: for every layer, slots `0..len` are valid; `len <= capacity`; a slot's K and V rows are
//! `kv_dim` and `kv_dim_v` values, stored as f16 (bits), the precision the attention reads them at (as ggml's
//! f16 cache): half the bytes of f32 for the attention to stream.
//!
//! Layout: **KV head major** — a layer's keys are `n_head_kv` runs of `capacity` slots of `head_dim` values
//! (`k[h · capacity · head_dim + slot · head_dim + i]`), the values likewise, so that an attention task, which
//! reads one KV head over every visible slot, streams one contiguous run instead of a `head_dim`-wide piece of
//! every `kv_dim`-wide slot row (llama.cpp's slot-major layout, ours until session 64). [`KvCache::strides`] tells
//! the attention where a slot of a head starts.

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
    /// KV heads, and the width of one head's key and value.
    n_head_kv: usize,
    head_dim: usize,
    head_dim_v: usize,
    layers: Vec<LayerCache>,
}

/// Where a cached key or value starts: slot `s` of KV head `h` at `h · head + s · slot` (f16 elements).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strides {
    pub slot: usize,
    pub head: usize,
}

impl KvCache {
    /// An empty cache holding up to `capacity` tokens per layer. Memory is reserved lazily by the OS
    /// (zeroed allocations), so a large capacity costs only what is used.
    pub fn new(config: &Config, capacity: usize) -> KvCache {
        let (kv_dim, kv_dim_v) = (config.kv_dim(), config.n_head_kv * config.head_dim_v);
        let layers = (0..config.n_layers)
            .map(|_| LayerCache {
                k: vec![0; capacity * kv_dim],
                v: vec![0; capacity * kv_dim_v],
                pos: vec![0; capacity],
                len: 0,
            })
            .collect();
        KvCache {
            capacity,
            n_head_kv: config.n_head_kv,
            head_dim: config.head_dim,
            head_dim_v: config.head_dim_v,
            layers,
        }
    }

    /// Where slot `s` of KV head `h` starts in a layer's keys and values (see the module's layout).
    pub(crate) fn strides(&self) -> (Strides, Strides) {
        (
            Strides { slot: self.head_dim, head: self.capacity * self.head_dim },
            Strides { slot: self.head_dim_v, head: self.capacity * self.head_dim_v },
        )
    }

    /// Writes `positions.len()` new slots at the end of `layer`: keys `k` (`n × kv_dim`, slot-major as the
    /// projections make them) and values `v` (`n × kv_dim_v`), already rounded to f16 values, and their positions.
    /// The caller checked the room ([`KvCache::check_room`]).
    pub(crate) fn append(&mut self, layer: usize, k: &[f32], v: &[f32], positions: &[u32]) {
        use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
        let (cap, nh, hd, hdv) = (self.capacity, self.n_head_kv, self.head_dim, self.head_dim_v);
        debug_assert!(k.len() == positions.len() * nh * hd && v.len() == positions.len() * nh * hdv);
        let l = &mut self.layers[layer];
        let base = l.len;
        // Exact: the values are f16 values. The slice conversions use F16C where the CPU has it.
        let put = |dst: &mut [u16], src: &[f32]| dst.reinterpret_cast_mut::<half::f16>().convert_from_f32_slice(src);
        for (r, (kr, vr)) in k.chunks_exact(nh * hd).zip(v.chunks_exact(nh * hdv)).enumerate() {
            let s = base + r;
            for h in 0..nh {
                put(&mut l.k[h * cap * hd + s * hd..][..hd], &kr[h * hd..(h + 1) * hd]);
                put(&mut l.v[h * cap * hdv + s * hdv..][..hdv], &vr[h * hdv..(h + 1) * hdv]);
            }
        }
        l.pos[base..base + positions.len()].copy_from_slice(positions);
        l.len = base + positions.len();
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
        let (cap, nh, hd, hdv) = (self.capacity, self.n_head_kv, self.head_dim, self.head_dim_v);
        let l = &mut self.layers[layer];
        let mut new_len = start;
        for &off in keep {
            let src = start + off;
            if src >= l.len {
                break;
            }
            if src != new_len {
                for h in 0..nh {
                    let (k0, v0) = (h * cap * hd, h * cap * hdv);
                    l.k.copy_within(k0 + src * hd..k0 + (src + 1) * hd, k0 + new_len * hd);
                    l.v.copy_within(v0 + src * hdv..v0 + (src + 1) * hdv, v0 + new_len * hdv);
                }
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
        let (old, nh, hd, hdv) = (self.capacity, self.n_head_kv, self.head_dim, self.head_dim_v);
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let mut k = vec![0; capacity * nh * hd];
                let mut v = vec![0; capacity * nh * hdv];
                let mut pos = vec![0; capacity];
                for h in 0..nh {
                    k[h * capacity * hd..][..len * hd].copy_from_slice(&l.k[h * old * hd..][..len * hd]);
                    v[h * capacity * hdv..][..len * hdv].copy_from_slice(&l.v[h * old * hdv..][..len * hdv]);
                }
                pos[..len].copy_from_slice(&l.pos[..len]);
                LayerCache { k, v, pos, len }
            })
            .collect();
        KvCache { capacity, layers, ..*self }
    }

    /// Bytes one slot takes over all layers (keys, values and position).
    pub fn bytes_per_slot(&self) -> usize {
        self.layers.len() * (self.n_head_kv * (self.head_dim + self.head_dim_v) * 2 + 4)
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
}

#[cfg(test)]
mod tests {
    /// Slot `s`'s key and value rows (all KV heads, in head order) of layer `il`, read through the layout.
    fn rows(kv: &super::KvCache, il: usize, s: usize) -> (Vec<u16>, Vec<u16>) {
        let (ks, vs) = kv.strides();
        let l = kv.layer(il);
        let mut out = (Vec::new(), Vec::new());
        for h in 0..kv.n_head_kv {
            out.0.extend_from_slice(&l.k[h * ks.head + s * ks.slot..][..kv.head_dim]);
            out.1.extend_from_slice(&l.v[h * vs.head + s * vs.slot..][..kv.head_dim_v]);
        }
        out
    }

    /// Appending slot-major rows, compacting to a path and copying a prefix into another capacity keep every
    /// KV head's key and value of every kept slot (the layout is KV head major, so each moves per head).
    #[test]
    fn appending_compacting_and_copying_keep_every_heads_rows() {
        let m = crate::testing::tiny_model("llama", None, 1, 64);
        let c = &m.config;
        assert!(c.n_head_kv > 1, "the test needs several KV heads");
        let (kvd, vd) = (c.kv_dim(), c.n_head_kv * c.head_dim_v);
        let mut kv = m.new_cache(16);
        let value = |s: usize, i: usize| half::f16::from_f32((s * 1000 + i) as f32 / 64.0);
        let n = 7;
        let k: Vec<f32> = (0..n * kvd).map(|j| value(j / kvd, j % kvd).to_f32()).collect();
        let v: Vec<f32> = (0..n * vd).map(|j| value(j / vd, 500 + j % vd).to_f32()).collect();
        let positions: Vec<u32> = (0..n as u32).collect();
        for il in 0..c.n_layers {
            kv.append(il, &k, &v, &positions);
        }
        let want = |s: usize| {
            let bits = |x: &[f32]| x.iter().map(|&f| half::f16::from_f32(f).to_bits()).collect::<Vec<_>>();
            (bits(&k[s * kvd..(s + 1) * kvd]), bits(&v[s * vd..(s + 1) * vd]))
        };
        for s in 0..n {
            assert_eq!(rows(&kv, 1, s), want(s), "appended slot {s}");
        }
        let copy = kv.prefix_copy(5, 9);
        kv.compact(2, &[1, 3, 4]);
        assert_eq!(kv.positions(0), &[0, 1, 3, 5, 6]);
        for (s, from) in [0, 1, 3, 5, 6].into_iter().enumerate() {
            assert_eq!(rows(&kv, 0, s), want(from), "compacted slot {s}");
        }
        assert_eq!((copy.seq_len(), copy.capacity()), (5, 9));
        for s in 0..5 {
            assert_eq!(rows(&copy, c.n_layers - 1, s), want(s), "copied slot {s}");
        }
    }
}
