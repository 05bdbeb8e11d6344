//! The policy role: given the target's logits at every node of a verified [`DraftTree`], decide which path to
//! keep and which token the target adds after it (the *bonus* token).
//!
//! - **Greedy** ([`accept_greedy`], or [`accept_greedy_tokens`] from the target's greedy tokens alone): from the
//!   root, step into the first child whose token is the target's own greedy choice at the current node; stop when
//!   none is; the choice there is the bonus. The committed tokens are therefore exactly the ones dense greedy
//!   decoding would produce.
//! - **Sampling** ([`accept_sampled`]): recursive rejection sampling over the children of the current node
//!   (SpecInfer's multi-draft verification; Jeon et al., 2024, "Recursive Speculative Decoding"). With `p` the
//!   target distribution still to match and the children tried in order:
//!   - children chosen deterministically (top-k): accept child `x` with probability `p(x)`, else set `p(x) = 0`
//!     and renormalise (the draft is a point mass on `x`);
//!   - children sampled without replacement from a draft distribution `q`: accept `x` with probability
//!     `min(1, p(x) / q(x))`, else `p ← norm(max(0, p − q))`, and `q ← q` without `x`, renormalised.
//!
//!   When a child is accepted the walk continues below it with the target's fresh distribution there; when all
//!   are rejected the bonus is drawn from what remains of `p`. Each committed token is then distributed exactly
//!   as the target's sampler would draw it, whatever the draft proposed.

use super::distribution::{greedy_choice, target_distribution, DistributionScratch};
use super::tree::{DraftTree, ROOT};
use crate::sampling::{Rng, SamplingParams};

/// The outcome of verifying one tree.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Acceptance {
    /// Accepted nodes, root first (so `path.len() - 1` draft tokens were accepted); ascending indices.
    pub path: Vec<usize>,
    /// The target's token after the last accepted node.
    pub bonus: u32,
}

/// Reusable buffers for acceptance.
#[derive(Clone, Debug, Default)]
pub struct AcceptanceScratch {
    dist: DistributionScratch,
    p: Vec<f32>,
    q: Vec<f32>,
    residual: Vec<f32>,
    history: Vec<u32>,
}

/// The target's logits at every node of a verified tree: row `i` (of `vocab` floats) follows node `i`.
#[derive(Clone, Copy, Debug)]
pub struct NodeLogits<'a> {
    pub data: &'a [f32],
    pub vocab: usize,
}

impl<'a> NodeLogits<'a> {
    /// Logits after node `i`.
    pub fn row(&self, i: usize) -> &'a [f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
}

/// Starts a walk at the root: the path holds only the root, the penalty history the committed tokens.
fn begin(history: &[u32], scratch: &mut AcceptanceScratch, out: &mut Acceptance) {
    out.path.clear();
    out.path.push(ROOT);
    scratch.history.clear();
    scratch.history.extend_from_slice(history);
}

/// Greedy acceptance. `logits` holds a row for every node of `tree`; `history` is the committed tokens, root
/// included (for the repetition penalty).
pub fn accept_greedy(
    tree: &DraftTree,
    logits: NodeLogits<'_>,
    params: &SamplingParams,
    history: &[u32],
    scratch: &mut AcceptanceScratch,
    out: &mut Acceptance,
) {
    begin(history, scratch, out);
    let AcceptanceScratch { dist, history, .. } = scratch;
    walk_greedy(tree, out, history, |node, history| greedy_choice(params, logits.row(node), history, dist));
}

/// Greedy acceptance from the target's greedy token at every node (`choices[i]` after node `i`, e.g. from
/// [`model::Model::head_argmax`]), for settings without a repetition penalty: the same walk as
/// [`accept_greedy`] without any logits.
pub fn accept_greedy_tokens(tree: &DraftTree, choices: &[u32], out: &mut Acceptance) {
    out.path.clear();
    out.path.push(ROOT);
    walk_greedy(tree, out, &mut Vec::new(), |node, _| choices[node]);
}

/// The greedy walk: from the root into the child whose token is `choice(node, history)`, until no child
/// matches; that choice is the bonus. `out.path` holds the root on entry.
fn walk_greedy(
    tree: &DraftTree,
    out: &mut Acceptance,
    history: &mut Vec<u32>,
    mut choice: impl FnMut(usize, &[u32]) -> u32,
) {
    let mut node = ROOT;
    loop {
        let token = choice(node, history);
        match tree.children(node).find(|&c| tree.node(c).token == token) {
            Some(child) => {
                node = child;
                out.path.push(child);
                history.push(token);
            }
            None => {
                out.bonus = token;
                return;
            }
        }
    }
}

/// Sampling acceptance (see the module header), drawing from `rng`. Arguments as for [`accept_greedy`].
pub fn accept_sampled(
    tree: &DraftTree,
    logits: NodeLogits<'_>,
    params: &SamplingParams,
    history: &[u32],
    rng: &mut Rng,
    scratch: &mut AcceptanceScratch,
    out: &mut Acceptance,
) {
    begin(history, scratch, out);
    let mut node = ROOT;
    'walk: loop {
        let row = logits.row(node);
        target_distribution(params, row, &scratch.history, &mut scratch.dist, &mut scratch.p);
        let p = &mut scratch.p;
        let q = &mut scratch.q;
        let sampled_from = tree.child_distribution(node);
        if let Some(dist) = sampled_from {
            q.clear();
            q.resize(logits.vocab, 0.0);
            for &(t, w) in dist {
                if let Some(slot) = q.get_mut(t as usize) {
                    *slot += w.max(0.0);
                }
            }
            normalise(q);
        }
        for child in tree.children(node) {
            let x = tree.node(child).token as usize;
            let Some(&px) = p.get(x) else { continue };
            let u = rng.next_f32();
            if sampled_from.is_some() {
                let qx = q[x];
                if qx <= 0.0 {
                    // The draft claims it could not have drawn this child: skip it rather than trust it.
                    continue;
                }
                if u < px / qx {
                    node = child;
                    out.path.push(child);
                    scratch.history.push(x as u32);
                    continue 'walk;
                }
                let residual = &mut scratch.residual;
                residual.clear();
                residual.extend(p.iter().zip(q.iter()).map(|(&pv, &qv)| (pv - qv).max(0.0)));
                // p ≤ q everywhere means p = q: rejection had probability 0 and only rounding got us here, so
                // p stays as it is.
                if normalise(residual) {
                    std::mem::swap(p, residual);
                }
                q[x] = 0.0;
                normalise(q);
            } else {
                if u < px {
                    node = child;
                    out.path.push(child);
                    scratch.history.push(x as u32);
                    continue 'walk;
                }
                let before = px;
                p[x] = 0.0;
                if !normalise(p) {
                    p[x] = before;
                }
            }
        }
        out.bonus = draw(p, rng);
        return;
    }
}

/// Scales `v` to sum to 1; `false` (and `v` untouched) when its sum is not positive.
fn normalise(v: &mut [f32]) -> bool {
    let sum: f64 = v.iter().map(|&x| x as f64).sum();
    if sum.is_nan() || sum <= 0.0 {
        return false;
    }
    let inv = (1.0 / sum) as f32;
    v.iter_mut().for_each(|x| *x *= inv);
    true
}

/// Draws an index with probability proportional to `p`.
fn draw(p: &[f32], rng: &mut Rng) -> u32 {
    let total: f32 = p.iter().sum();
    let mut r = rng.next_f32() * total;
    let mut last = 0;
    for (i, &w) in p.iter().enumerate() {
        if w > 0.0 {
            if r < w {
                return i as u32;
            }
            r -= w;
            last = i;
        }
    }
    last as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    const V: usize = 6;

    /// Logits rows for a tree, from per-node probability vectors.
    fn logits_of(rows: &[[f32; V]]) -> Vec<f32> {
        rows.iter().flat_map(|r| r.iter().map(|p| if *p > 0.0 { p.ln() } else { -1e9 })).collect()
    }

    fn sampling() -> SamplingParams {
        SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, ..Default::default() }
    }

    #[test]
    fn greedy_follows_the_matching_child_and_adds_the_bonus() {
        // root → {1: tok 3, 2: tok 4}; 2 → {3: tok 0}; 3 → {}.
        let mut t = DraftTree::new(5);
        t.push(ROOT, 3, -0.1);
        let b = t.push(ROOT, 4, -0.2);
        t.push(b, 0, -0.3);
        let mut rows = [[0.0f32; V]; 4];
        rows[0][4] = 1.0; // target picks 4 at the root (node 2)
        rows[1][1] = 1.0;
        rows[2][0] = 1.0; // then 0 (node 3)
        rows[3][2] = 1.0; // then 2: the bonus
        let mut out = Acceptance::default();
        accept_greedy(
            &t,
            NodeLogits { data: &logits_of(&rows), vocab: V },
            &SamplingParams::greedy(),
            &[5],
            &mut AcceptanceScratch::default(),
            &mut out,
        );
        assert_eq!(out, Acceptance { path: vec![0, 2, 3], bonus: 2 });
    }

    /// Exact check of losslessness on one level: the first committed token's frequencies equal the target's,
    /// for deterministic children and for children sampled without replacement from a draft distribution.
    #[test]
    fn rejection_sampling_reproduces_the_target_distribution() {
        let target = [0.05f32, 0.4, 0.25, 0.2, 0.1, 0.0];
        let draft = [(0u32, 0.5f32), (2, 0.3), (4, 0.1), (5, 0.1)];
        for sampled in [false, true] {
            let mut rng = Rng::new(42);
            let mut draft_rng = Rng::new(7);
            let n = 60_000;
            let mut freq = [0f64; V];
            let mut accepted = 0usize;
            for _ in 0..n {
                let mut t = DraftTree::new(1);
                if sampled {
                    // Two children drawn without replacement from the draft distribution.
                    let mut left: Vec<(u32, f32)> = draft.to_vec();
                    for _ in 0..2 {
                        let total: f32 = left.iter().map(|x| x.1).sum();
                        let mut r = draft_rng.next_f32() * total;
                        let mut pick = left.len() - 1;
                        for (i, x) in left.iter().enumerate() {
                            if r < x.1 {
                                pick = i;
                                break;
                            }
                            r -= x.1;
                        }
                        t.push(ROOT, left.remove(pick).0, -1.0);
                    }
                    t.set_child_distribution(ROOT, draft.to_vec());
                } else {
                    // A poor deterministic draft: tokens 0, 5 (impossible), 2.
                    for tok in [0, 5, 2] {
                        t.push(ROOT, tok, -1.0);
                    }
                }
                let rows: Vec<[f32; V]> = (0..t.len()).map(|_| target).collect();
                let mut out = Acceptance::default();
                accept_sampled(
                    &t,
                    NodeLogits { data: &logits_of(&rows), vocab: V },
                    &sampling(),
                    &[1],
                    &mut rng,
                    &mut AcceptanceScratch::default(),
                    &mut out,
                );
                let first = if out.path.len() > 1 { t.node(out.path[1]).token } else { out.bonus };
                accepted += out.path.len() - 1;
                freq[first as usize] += 1.0 / n as f64;
            }
            for (i, (&f, &p)) in freq.iter().zip(&target).enumerate() {
                assert!((f - p as f64).abs() < 0.01, "sampled children {sampled}: token {i}: {f} vs {p}");
            }
            assert!(accepted > n / 4, "the draft is accepted sometimes ({accepted})");
        }
    }
}
