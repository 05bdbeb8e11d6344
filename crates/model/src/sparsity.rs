//! Activation sparsity (TEAL, ICLR 2025; issue #39): before each weight product of a layer, the entries of its
//! input rows whose magnitude is below a threshold fitted offline for that layer and matrix are set to zero. A
//! zero input entry multiplies a whole column of the weights by nothing, so a kernel laid out by columns could skip
//! reading it; with today's row-major kernels the zeroing only *simulates* that (same kernels, zeroed inputs), which
//! is what measures the quality side of the trade.
//!
//! Four inputs per layer ([`Site`]): the attention-normed row (into Q, K and V), the attention output (into O), the
//! feed-forward-normed row (into gate and up) and the gated product (into down). The thresholds come from
//! [`ActHistograms`]: per layer and site, a histogram of `log2 |x|` recorded on calibration text with the dense
//! model, from which [`ActHistograms::thresholds`] reads the magnitude below which a share `s` of the entries lies.
//! The same `s` at every site is also the share of every matrix's columns (so of the layers' weight bytes) a
//! column-skipping kernel would not read: the model-wide sparsity.
//!
//! [`BlockSparsity`] is the structured variant (an experiment): per row, the blocks of 32 inputs with the smallest
//! norm are zeroed, optionally with the channels grouped by mean magnitude ([`ActHistograms::channel_orders`]).
//! Dense kernels could skip those blocks without another weight layout; measured far worse in quality
//! (heads/README.md).

/// Which weight product an activation feeds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Site {
    /// The attention-normed row, into Q, K and V.
    Qkv = 0,
    /// The attention output, into O.
    O = 1,
    /// The feed-forward-normed row, into gate and up.
    GateUp = 2,
    /// The gated product, into down.
    Down = 3,
}

/// Sites per layer.
pub const SITES: usize = 4;

impl Site {
    pub const ALL: [Site; SITES] = [Site::Qkv, Site::O, Site::GateUp, Site::Down];

    pub fn name(self) -> &'static str {
        match self {
            Site::Qkv => "qkv",
            Site::O => "o",
            Site::GateUp => "gate_up",
            Site::Down => "down",
        }
    }
}

/// Magnitude thresholds per layer and [`Site`]: an input entry with `|x| < t` is zeroed (`t = 0`: none is); or,
/// with `blocks`, block sparsity instead.
#[derive(Clone, Debug, PartialEq)]
pub struct ActThresholds {
    pub layers: Vec<[f32; SITES]>,
    /// Block sparsity (an experiment, issue #39): when set, the thresholds are not used; each input row is cut into
    /// blocks of `size` consecutive entries and the share `share[site]` of them with the smallest L2 norm is
    /// zeroed. A dense kernel can skip an all-zero block of activations (its quantized block sums to nothing)
    /// without any change of weight layout, which element sparsity cannot offer.
    pub blocks: Option<BlockSparsity>,
}

/// Per-row block sparsity ([`ActThresholds::blocks`]).
#[derive(Clone, Debug, PartialEq)]
pub struct BlockSparsity {
    /// Entries per block (32: one quantization block of the legacy types).
    pub size: usize,
    /// The share of each row's blocks zeroed, per [`Site`].
    pub share: [f64; SITES],
    /// Blocks of consecutive inputs (`None`), or of consecutive entries of a permutation of the inputs per layer
    /// and site (`order[il][site]`, e.g. [`ActHistograms::channel_orders`]: inputs often small side by side), as
    /// a model whose weight columns were permuted the same way at load would hold them.
    pub order: Option<std::sync::Arc<Vec<[Vec<u32>; SITES]>>>,
}

impl ActThresholds {
    /// The threshold of layer `il` at `site` (0 past the last layer).
    #[inline]
    pub fn get(&self, il: usize, site: Site) -> f32 {
        self.layers.get(il).map_or(0.0, |t| t[site as usize])
    }
}

/// Zeroes the entries of `x` whose magnitude is below `t`; returns how many it zeroed.
#[inline]
pub fn sparsify(x: &mut [f32], t: f32) -> usize {
    let mut zeroed = 0;
    for v in x.iter_mut() {
        let small = v.abs() < t;
        zeroed += small as usize;
        if small {
            *v = 0.0;
        }
    }
    zeroed
}

/// Zeroes, in each of the `rows` rows of `x`, the `share` of its blocks of `size` entries with the smallest L2
/// norm (ties broken by position; a row's trailing partial block is never zeroed); returns the entries zeroed.
/// With `order` (a permutation of a row's entries), block `b` is the entries `order[b · size .. (b + 1) · size]`.
pub fn sparsify_blocks(x: &mut [f32], rows: usize, size: usize, share: f64, order: Option<&[u32]>) -> usize {
    if rows == 0 || size == 0 || share <= 0.0 {
        return 0;
    }
    let width = x.len() / rows;
    let nb = width / size;
    let k = ((share.min(1.0) * nb as f64).round() as usize).min(nb);
    if k == 0 {
        return 0;
    }
    let order = order.filter(|o| o.len() == width);
    let members = |b: usize| match order {
        Some(o) => o[b * size..(b + 1) * size].iter().map(|&i| i as usize).collect::<Vec<_>>(),
        None => (b * size..(b + 1) * size).collect(),
    };
    let blocks: Vec<Vec<usize>> = (0..nb).map(members).collect();
    let mut norms: Vec<(f32, usize)> = Vec::with_capacity(nb);
    for row in x.chunks_exact_mut(width) {
        norms.clear();
        norms.extend(blocks.iter().map(|b| b.iter().map(|&i| row[i] * row[i]).sum::<f32>()).zip(0..));
        if k < nb {
            norms.select_nth_unstable_by(k, |a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        }
        for &(_, b) in &norms[..k] {
            blocks[b].iter().for_each(|&i| row[i] = 0.0);
        }
    }
    rows * k * size
}

/// Histogram bins per layer and site: `log2 |x|` from [`LOG2_MIN`] in steps of `1 / PER_OCTAVE`.
pub const BINS: usize = 1280;
const PER_OCTAVE: f32 = 32.0;
/// `log2` of the lower edge of bin 1 (bin 0 also holds zeros and anything smaller); the last bin holds
/// everything from `2^(LOG2_MIN + (BINS - 1) / PER_OCTAVE) = 2^15.97` up.
pub const LOG2_MIN: f32 = -24.0;

/// Counts of `log2 |x|` per layer and [`Site`] ([`BINS`] bins each), recorded by a [`crate::Workspace`] while
/// [`crate::Workspace::record_activations`] is on.
#[derive(Clone, Debug, PartialEq)]
pub struct ActHistograms {
    pub n_layers: usize,
    /// `counts[(il * SITES + site) * BINS + bin]`.
    pub counts: Vec<u64>,
    /// `channel_abs[il * SITES + site][i]`: Σ |x_i| over the recorded rows (per input channel; not saved to files).
    pub channel_abs: Vec<Vec<f64>>,
}

#[inline]
fn bin_of(v: f32) -> usize {
    let a = v.abs();
    if a.is_nan() || a <= 0.0 {
        return 0;
    }
    let b = (a.log2() - LOG2_MIN) * PER_OCTAVE + 1.0;
    if b < 1.0 {
        0
    } else {
        (b as usize).min(BINS - 1)
    }
}

/// The lower edge of bin `b` (`b ≥ 1`).
fn lower_edge(b: usize) -> f32 {
    (LOG2_MIN + (b - 1) as f32 / PER_OCTAVE).exp2()
}

impl ActHistograms {
    pub fn new(n_layers: usize) -> ActHistograms {
        ActHistograms {
            n_layers,
            counts: vec![0; n_layers * SITES * BINS],
            channel_abs: vec![Vec::new(); n_layers * SITES],
        }
    }

    /// Adds the entries of `x` (`rows` rows: the input of `site` in layer `il`).
    pub fn record(&mut self, il: usize, site: Site, x: &[f32], rows: usize) {
        if il >= self.n_layers {
            return;
        }
        let hist = &mut self.counts[(il * SITES + site as usize) * BINS..][..BINS];
        for &v in x {
            hist[bin_of(v)] += 1;
        }
        if let Some(width) = x.len().checked_div(rows).filter(|&w| w > 0) {
            let sums = &mut self.channel_abs[il * SITES + site as usize];
            sums.resize(width, 0.0);
            for row in x.chunks_exact(width) {
                sums.iter_mut().zip(row).for_each(|(s, v)| *s += f64::from(v.abs()));
            }
        }
    }

    /// Per layer and site, the input channels from the smallest mean magnitude to the largest (channels never
    /// recorded: an empty order).
    pub fn channel_orders(&self) -> Vec<[Vec<u32>; SITES]> {
        (0..self.n_layers)
            .map(|il| {
                Site::ALL.map(|site| {
                    let sums = &self.channel_abs[il * SITES + site as usize];
                    let mut order: Vec<u32> = (0..sums.len() as u32).collect();
                    order.sort_by(|&a, &b| sums[a as usize].total_cmp(&sums[b as usize]).then(a.cmp(&b)));
                    order
                })
            })
            .collect()
    }

    /// Adds another recording of the same model.
    pub fn merge(&mut self, other: &ActHistograms) {
        assert_eq!(self.counts.len(), other.counts.len(), "histograms of different models");
        self.counts.iter_mut().zip(&other.counts).for_each(|(a, b)| *a += b);
        for (a, b) in self.channel_abs.iter_mut().zip(&other.channel_abs) {
            if a.len() < b.len() {
                a.resize(b.len(), 0.0);
            }
            a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
        }
    }

    /// Entries recorded for layer `il` at `site`.
    pub fn total(&self, il: usize, site: Site) -> u64 {
        self.counts[(il * SITES + site as usize) * BINS..][..BINS].iter().sum()
    }

    /// The magnitude below which a share `s` (0..1) of layer `il`'s entries at `site` lies, interpolated
    /// geometrically inside its bin; 0 for `s ≤ 0` or an empty histogram.
    pub fn threshold(&self, il: usize, site: Site, s: f64) -> f32 {
        let hist = &self.counts[(il * SITES + site as usize) * BINS..][..BINS];
        let total: u64 = hist.iter().sum();
        if s <= 0.0 || total == 0 {
            return 0.0;
        }
        let want = s.min(1.0) * total as f64;
        let mut below = 0f64;
        for (b, &c) in hist.iter().enumerate() {
            let next = below + c as f64;
            if next >= want && c > 0 {
                if b == 0 {
                    return lower_edge(1);
                }
                let frac = ((want - below) / c as f64).clamp(0.0, 1.0) as f32;
                return lower_edge(b) * (frac / PER_OCTAVE).exp2();
            }
            below = next;
        }
        f32::INFINITY
    }

    /// The same share `s` at every layer and site (see the module doc).
    pub fn thresholds(&self, s: f64) -> ActThresholds {
        self.thresholds_per_site([s; SITES])
    }

    /// Share `s[site]` at every layer (0: that input stays dense).
    pub fn thresholds_per_site(&self, s: [f64; SITES]) -> ActThresholds {
        ActThresholds {
            layers: (0..self.n_layers)
                .map(|il| Site::ALL.map(|site| self.threshold(il, site, s[site as usize])))
                .collect(),
            blocks: None,
        }
    }
}

/// Row groups [`ActCounts`] measures the union of non-zeros over: a tree verification or a batch reads a weight
/// column unless its input is zero in *every* row.
pub const GROUPS: [usize; 3] = [2, 4, 8];

/// Zeroed and seen input entries per [`Site`], summed over layers: the sparsity a run actually had; and per
/// [`GROUPS`] size `g`, over consecutive groups of `g` rows of each product, the columns whose input was zero in
/// all `g` rows (`group_zeroed`) of those seen (`group_seen`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ActCounts {
    pub zeroed: [u64; SITES],
    pub seen: [u64; SITES],
    pub group_zeroed: [[u64; GROUPS.len()]; SITES],
    pub group_seen: [[u64; GROUPS.len()]; SITES],
}

impl ActCounts {
    /// Adds the zeroed `x` (`rows` rows) of `site`, of which `zeroed` entries were zeroed.
    pub fn add(&mut self, site: Site, x: &[f32], rows: usize, zeroed: usize) {
        let s = site as usize;
        self.zeroed[s] += zeroed as u64;
        self.seen[s] += x.len() as u64;
        if rows == 0 {
            return;
        }
        let w = x.len() / rows;
        for (k, &g) in GROUPS.iter().enumerate() {
            for group in x.chunks_exact(g * w) {
                let all_zero = (0..w).filter(|&c| (0..g).all(|r| group[r * w + c] == 0.0)).count();
                self.group_zeroed[s][k] += all_zero as u64;
                self.group_seen[s][k] += w as u64;
            }
        }
    }

    /// [`ActCounts::share`] of the columns a group of `GROUPS[k]` rows would not read.
    pub fn group_share(&self, k: usize, weights: [f64; SITES]) -> f64 {
        let z: f64 = (0..SITES).map(|i| self.group_zeroed[i][k] as f64 * weights[i]).sum();
        let n: f64 = (0..SITES).map(|i| self.group_seen[i][k] as f64 * weights[i]).sum();
        z / n.max(1.0)
    }

    /// The share of zeroed entries at `site`, or over all sites weighted by the columns each feeds (`weights`: the
    /// rows of the matrices an entry of each site multiplies, e.g. `q + k + v` dims for [`Site::Qkv`]).
    pub fn share(&self, site: Option<Site>, weights: [f64; SITES]) -> f64 {
        match site {
            Some(s) => self.zeroed[s as usize] as f64 / (self.seen[s as usize] as f64).max(1.0),
            None => {
                let z: f64 = (0..SITES).map(|i| self.zeroed[i] as f64 * weights[i]).sum();
                let n: f64 = (0..SITES).map(|i| self.seen[i] as f64 * weights[i]).sum();
                z / n.max(1.0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sparsity_zeroes_the_smallest_blocks_of_each_row() {
        // Two rows of three blocks of 2 (norms² row 0: 25, 1, 8; row 1: 0, 50, 2) and a trailing entry.
        let mut x = vec![3.0, 4.0, 1.0, 0.0, 2.0, -2.0, 9.0, 0.0, 0.0, 5.0, 5.0, 1.0, 1.0, 9.0];
        assert_eq!(sparsify_blocks(&mut x, 2, 2, 0.5, None), 8);
        assert_eq!(x, [3.0, 4.0, 0.0, 0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 5.0, 5.0, 0.0, 0.0, 9.0]);
        let mut y = vec![1.0; 64];
        assert_eq!(sparsify_blocks(&mut y, 1, 32, 0.0, None), 0);
        assert_eq!(sparsify_blocks(&mut y, 1, 32, 1.0, None), 64);
        assert!(y.iter().all(|&v| v == 0.0));
        // Permuted blocks: {0, 3} and {1, 2} of [1, 5, 5, 1]: the first is the smaller.
        let mut z = vec![1.0, 5.0, 5.0, 1.0];
        assert_eq!(sparsify_blocks(&mut z, 1, 2, 0.5, Some(&[0, 3, 1, 2])), 2);
        assert_eq!(z, [0.0, 5.0, 5.0, 0.0]);
        // Channel orders follow the recorded mean magnitudes.
        let mut h = ActHistograms::new(1);
        h.record(0, Site::O, &[3.0, -1.0, 2.0, 0.5, 1.0, 1.0], 2);
        assert_eq!(h.channel_orders()[0][Site::O as usize], [1, 2, 0]);
        assert!(h.channel_orders()[0][Site::Qkv as usize].is_empty());
    }

    #[test]
    fn sparsify_zeroes_exactly_the_small_entries() {
        let mut x = [0.5, -0.05, 0.1, -2.0, 0.0, 0.09];
        assert_eq!(sparsify(&mut x, 0.1), 3);
        assert_eq!(x, [0.5, 0.0, 0.1, -2.0, 0.0, 0.0]);
        assert_eq!(sparsify(&mut x, 0.0), 0);
    }

    #[test]
    fn thresholds_cut_the_requested_share_of_recorded_values() {
        // 10,000 magnitudes spread over four decades, some negative: the fitted threshold for s must zero a share
        // within a bin's width (2^(1/32), ~2%) of s on the same values.
        let values: Vec<f32> = (0..10_000)
            .map(|i| {
                let m = 10f32.powf(-3.0 + 4.0 * ((i * 7919) % 10_000) as f32 / 10_000.0);
                if i % 3 == 0 {
                    -m
                } else {
                    m
                }
            })
            .collect();
        let mut h = ActHistograms::new(2);
        h.record(1, Site::Down, &values, 1);
        assert_eq!(h.total(1, Site::Down), 10_000);
        assert_eq!(h.total(0, Site::Down), 0);
        for s in [0.1, 0.25, 0.5, 0.9] {
            let t = h.threshold(1, Site::Down, s);
            let got = sparsify(&mut values.clone(), t) as f64 / values.len() as f64;
            assert!((got - s).abs() < 0.01, "s {s}: threshold {t} zeroes {got}");
        }
        let t = h.thresholds(0.5);
        assert_eq!(t.get(0, Site::Down), 0.0, "nothing recorded: no threshold");
        assert!(t.get(1, Site::Down) > 0.0);
        assert_eq!(h.threshold(1, Site::Down, 0.0), 0.0);
    }

    #[test]
    fn bins_cover_zero_tiny_and_huge_values() {
        assert_eq!(bin_of(0.0), 0);
        assert_eq!(bin_of(f32::NAN), 0);
        assert_eq!(bin_of(1e-30), 0);
        assert_eq!(bin_of(1e30), BINS - 1);
        assert_eq!(bin_of(-1.0), bin_of(1.0));
        let b = bin_of(1.0);
        assert!(lower_edge(b) <= 1.0 && 1.0 < lower_edge(b + 1));
    }

    #[test]
    fn counts_weigh_sites_by_the_columns_they_feed() {
        let c = ActCounts { zeroed: [10, 0, 0, 50], seen: [100, 100, 100, 100], ..Default::default() };
        assert_eq!(c.share(Some(Site::Qkv), [1.0; 4]), 0.1);
        assert!((c.share(None, [1.0; 4]) - 0.15).abs() < 1e-12);
        assert!((c.share(None, [0.0, 0.0, 0.0, 1.0]) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn groups_count_the_columns_zero_in_every_row() {
        // 4 rows × 3 columns: column 0 zero in all rows, column 1 in rows 0 and 1, column 2 never.
        let x = [0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 2.0, 1.0, 0.0, 3.0, 1.0];
        let mut c = ActCounts::default();
        c.add(Site::O, &x, 4, 6);
        assert_eq!(c.zeroed[1], 6);
        assert_eq!(c.seen[1], 12);
        // pairs: rows 0-1 share columns 0 and 1, rows 2-3 column 0; the one group of 4 column 0; no group of 8.
        assert_eq!((c.group_zeroed[1][0], c.group_seen[1][0]), (3, 6));
        assert_eq!((c.group_zeroed[1][1], c.group_seen[1][1]), (1, 3));
        assert_eq!((c.group_zeroed[1][2], c.group_seen[1][2]), (0, 0));
        assert!((c.group_share(0, [1.0; SITES]) - 0.5).abs() < 1e-12);
    }
}
