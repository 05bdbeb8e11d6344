//! Prompt-lookup proposer: drafts what followed the latest n-gram earlier in the context (Saxena, 2023, "prompt
//! lookup decoding"; llama.cpp's `ngram` speculative modes). Free to run and strong wherever the output repeats
//! its input — code edits, retrieval-augmented answers, summaries, lists.
//!
//! For a path (committed tokens followed by the draft tokens above a tree node) it finds the longest suffix of
//! `max_n..=min_n` tokens that also occurs earlier in the committed tokens, and counts which tokens followed those
//! occurrences: `count / total` is the draft's next-token distribution (ties go to the most recent occurrence).
//! [`build_dynamic_tree`] turns that into an EAGLE-2 tree, so competing continuations become branches. Where the
//! context holds no match, a [`Datastore`] (the model's own answers to other prompts), if given, drafts instead.

use super::datastore::Datastore;
use super::proposer::{DraftContext, Proposer};
use super::tree::{build_dynamic_tree, DraftSource, DraftTree, TreeConfig, ROOT};
use super::SpeculativeError;
use std::sync::Arc;

/// Settings of the n-gram proposer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NgramConfig {
    /// Longest suffix tried.
    pub max_n: usize,
    /// Shortest suffix accepted as a match (1 drafts after any repeated token: many wasted nodes).
    pub min_n: usize,
    /// Only the last `window` committed tokens are searched (bounds the cost on long contexts).
    pub window: usize,
    /// Tree sizes.
    pub tree: TreeConfig,
}

impl Default for NgramConfig {
    /// Narrow trees: on SmolLM2 over the 12 reference prompts, top-k 2 / budget 8 keeps the τ of the default
    /// EAGLE-sized tree (1.20) with a fifth fewer verified rows; lookup rarely offers more than two good branches.
    fn default() -> Self {
        NgramConfig {
            max_n: 4,
            min_n: 2,
            window: 4096,
            tree: TreeConfig { depth: 5, top_k: 2, budget: 8, min_prob: 0.0 },
        }
    }
}

/// The prompt-lookup proposer.
#[derive(Clone, Debug, Default)]
pub struct NgramProposer {
    /// Settings.
    pub config: NgramConfig,
    /// Consulted where the context offers no match.
    pub datastore: Option<Arc<Datastore>>,
    path: Vec<u32>,
    /// Whether the last [`NgramProposer::continuations`] came from the datastore.
    from_store: bool,
    suffix: Vec<u32>,
    counts: Vec<(u32, u32, usize)>,
    next: Vec<(u32, f32)>,
}

impl NgramProposer {
    /// A proposer with these settings.
    pub fn new(config: NgramConfig) -> NgramProposer {
        NgramProposer { config, ..Default::default() }
    }

    /// Also drafts from `datastore` where the context offers no match.
    pub fn with_datastore(mut self, datastore: Option<Arc<Datastore>>) -> NgramProposer {
        self.datastore = datastore;
        self
    }

    /// Candidate next tokens after `context ++ extra`, as `(token, log_prob)`, most likely first: what followed
    /// the longest matching suffix in the context, else the datastore's entry (one token), else nothing.
    pub fn continuations(&mut self, context: &[u32], extra: &[u32], out: &mut Vec<(u32, f32)>) {
        out.clear();
        self.from_store = false;
        let start = context.len().saturating_sub(self.config.window);
        let searched = &context[start..];
        let max_n = self.config.max_n.min(context.len() + extra.len());
        for n in (self.config.min_n.max(1)..=max_n).rev() {
            // The last n tokens of context ++ extra.
            self.suffix.clear();
            let from_extra = n.min(extra.len());
            self.suffix.extend_from_slice(&context[context.len() - (n - from_extra)..]);
            self.suffix.extend_from_slice(&extra[extra.len() - from_extra..]);
            // (token, count, most recent index) of what followed each earlier occurrence.
            self.counts.clear();
            for end in (n..searched.len()).rev() {
                if searched[end - n..end] == self.suffix[..] {
                    let next = searched[end];
                    match self.counts.iter_mut().find(|c| c.0 == next) {
                        Some(c) => c.1 += 1,
                        None => self.counts.push((next, 1, end)),
                    }
                }
            }
            if self.counts.is_empty() {
                continue;
            }
            let total: u32 = self.counts.iter().map(|c| c.1).sum();
            self.counts.sort_by(|a, b| b.1.cmp(&a.1).then(b.2.cmp(&a.2)));
            out.extend(self.counts.iter().map(|&(t, c, _)| (t, (c as f32 / total as f32).ln())));
            return;
        }
        if let Some((token, prob)) = self.datastore.as_ref().and_then(|d| d.next(context, extra)) {
            out.push((token, prob.ln()));
            self.from_store = true;
        }
    }
}

impl NgramProposer {
    /// Adds the lookup's greedy chain of up to `depth` tokens under `tree`'s root (the last of `tokens`, the
    /// committed tokens): where a node of the chain is already in the tree (another proposer drafted it) the chain
    /// continues below that node, otherwise it grows a new branch. Nothing is added where the context offers no
    /// match. Returns the number of nodes added; the chain's tokens stay in `self.path`.
    pub fn extend_chain(&mut self, tokens: &[u32], tree: &mut DraftTree, depth: usize) -> usize {
        let (mut node, mut added) = (ROOT, 0);
        let mut path = std::mem::take(&mut self.path);
        let mut next = std::mem::take(&mut self.next);
        path.clear();
        for _ in 0..depth {
            self.continuations(tokens, &path, &mut next);
            let Some(&(token, log_prob)) = next.first() else { break };
            let existing = tree.children(node).find(|&c| tree.node(c).token == token);
            node = match existing {
                Some(child) => child,
                // The datastore only follows and deepens the other proposer's paths: where that proposer drafted
                // something else, it is usually right and a competing store branch is a wasted row.
                None if self.from_store && tree.children(node).next().is_some() => break,
                None => {
                    added += 1;
                    tree.push_from(node, token, log_prob, DraftSource::Lookup)
                }
            };
            path.push(token);
        }
        (self.path, self.next) = (path, next);
        added
    }
}

/// A prompt-lookup chain to hang beside another proposer's tree ([`NgramProposer::extend_chain`]) whose length
/// adapts: it doubles (up to [`LookupChain::GROWTH`] × the base) each time the previous chain was accepted whole,
/// and falls back to the base after a miss. Text that repeats at length (a model looping, code being copied)
/// then costs few verification steps, while a chain that keeps failing verifies only the base's rows.
#[derive(Clone, Debug, Default)]
pub struct LookupChain {
    /// Chain length after a miss (0: no chain).
    pub base: usize,
    len: usize,
    /// Its `path` holds the last chain drafted.
    lookup: NgramProposer,
    /// The committed length when the last chain was drafted.
    committed: usize,
}

impl LookupChain {
    /// The longest chain, as a multiple of the base.
    pub const GROWTH: usize = 4;

    /// A chain of `base` tokens after a miss (0: none).
    pub fn new(base: usize) -> LookupChain {
        LookupChain { base, len: base, ..Default::default() }
    }

    /// Drafts from `datastore` where the context offers no match ([`NgramProposer::with_datastore`]).
    pub fn with_datastore(mut self, datastore: Option<Arc<Datastore>>) -> LookupChain {
        self.lookup.datastore = datastore;
        self
    }

    /// Adds the chain (at most `cap` tokens) under `tree`'s root, the last of the committed `tokens`; returns the
    /// number of nodes added.
    pub fn extend(&mut self, tokens: &[u32], tree: &mut DraftTree, cap: usize) -> usize {
        if self.base == 0 {
            return 0;
        }
        // The tokens committed since the last chain was drafted below the then root start with it if it was
        // accepted whole (the bonus token follows).
        let fresh = tokens.get(self.committed..).filter(|_| self.committed > 0).unwrap_or(&[]);
        let last = &self.lookup.path;
        let whole = !last.is_empty() && fresh.len() > last.len() && fresh.starts_with(last);
        self.len = if whole { (2 * self.len).min(Self::GROWTH * self.base) } else { self.base };
        self.committed = tokens.len();
        self.lookup.extend_chain(tokens, tree, self.len.min(cap))
    }
}

impl Proposer for NgramProposer {
    fn propose(&mut self, context: &DraftContext<'_>, tree: &mut DraftTree) -> Result<(), SpeculativeError> {
        let config = self.config.tree;
        let tokens = context.tokens;
        let mut path = std::mem::take(&mut self.path);
        let result = build_dynamic_tree(&config, tree, |pool, frontier, children| {
            for &node in frontier {
                pool.path_tokens(node, &mut path);
                let mut kids = Vec::new();
                self.continuations(tokens, &path, &mut kids);
                children.push(kids);
            }
            Ok(())
        });
        self.path = path;
        tree.set_all_sources(DraftSource::Lookup);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_longest_match_and_counts_followers() {
        let mut p = NgramProposer::default();
        let mut out = Vec::new();
        // "5 6" was followed by 7 twice and by 9 once; the longer suffix "4 5 6" only by 9.
        let ctx = [5, 6, 7, 1, 5, 6, 7, 2, 4, 5, 6, 9, 3, 5, 6];
        p.continuations(&ctx, &[], &mut out);
        assert_eq!(out[0].0, 7);
        assert_eq!(out[1].0, 9);
        assert!((out[0].1 - (2f32 / 3.0).ln()).abs() < 1e-6);
        let ctx2 = [4, 5, 6, 9, 3, 4, 5, 6];
        p.continuations(&ctx2, &[], &mut out);
        assert_eq!(out, vec![(9, 0.0)]);
        // The suffix may run into the draft path.
        p.continuations(&ctx2[..6], &[5, 6], &mut out);
        assert_eq!(out, vec![(9, 0.0)]);
    }

    #[test]
    fn no_match_proposes_nothing() {
        let mut p = NgramProposer::default();
        let mut out = vec![(1, 0.0)];
        p.continuations(&[1, 2, 3, 4], &[], &mut out);
        assert!(out.is_empty());
        let mut tree = DraftTree::new(4);
        let (model, pool) = (model::testing::tiny_model("llama", None, 1, 64), kernels::ThreadPool::new(1));
        let ctx = DraftContext {
            model: &model,
            pool: &pool,
            tokens: &[1, 2, 3, 4],
            features: &[],
            feature_width: 0,
            stable_prefix: 0,
        };
        p.propose(&ctx, &mut tree).unwrap();
        assert!(tree.is_empty());
    }

    #[test]
    fn lookup_chain_merges_into_an_existing_tree() {
        let mut p = NgramProposer::default();
        // "3 4" was followed by "5 6 7" earlier; the root is the last 4.
        let tokens = [1, 3, 4, 5, 6, 7, 8, 3, 4];
        // The head drafted 5 (agreeing) and 9: the chain continues below 5 with 6 and 7.
        let mut tree = DraftTree::new(4);
        let five = tree.push(ROOT, 5, -0.1);
        tree.push(ROOT, 9, -2.0);
        assert_eq!(p.extend_chain(&tokens, &mut tree, 3), 2);
        assert_eq!(tree.len(), 5);
        let six = tree.children(five).next().unwrap();
        assert_eq!(tree.node(six).token, 6);
        assert_eq!(tree.children(six).map(|c| tree.node(c).token).collect::<Vec<_>>(), vec![7]);
        // A head that drafted something else gets a separate branch; depth bounds the chain.
        let mut tree = DraftTree::new(4);
        tree.push(ROOT, 9, -0.1);
        assert_eq!(p.extend_chain(&tokens, &mut tree, 2), 2);
        let tokens_below_root: Vec<u32> = tree.children(ROOT).map(|c| tree.node(c).token).collect();
        assert_eq!(tokens_below_root, vec![9, 5]);
        assert_eq!(tree.depth(), 2);
        // No match: nothing added.
        let mut tree = DraftTree::new(2);
        assert_eq!(p.extend_chain(&[7, 8, 2], &mut tree, 3), 0);
        assert!(tree.is_empty());
    }

    #[test]
    fn the_datastore_drafts_where_the_context_has_no_match() {
        // The model once answered "… 5 6 7 8"; this context never saw "5 6".
        let answers = [(&[90u32, 5, 6, 7, 8][..], 1)];
        let store = Arc::new(Datastore::build(answers, Default::default(), 100));
        let mut p = NgramProposer::default().with_datastore(Some(store.clone()));
        let mut out = Vec::new();
        p.continuations(&[1, 2, 5, 6], &[], &mut out);
        assert_eq!(out, vec![(7, 0.0)]);
        // A context match wins over the store.
        p.continuations(&[5, 6, 9, 5, 6], &[], &mut out);
        assert_eq!(out, vec![(9, 0.0)]);
        // The chain mixes both, step by step: the store gives 7 and 8 after "5 6".
        let mut chain = LookupChain::new(3).with_datastore(Some(store));
        let mut tree = DraftTree::new(6);
        assert_eq!(chain.extend(&[1, 2, 5, 6], &mut tree, usize::MAX), 2);
        let mut path = Vec::new();
        tree.path_tokens(tree.len() - 1, &mut path);
        assert_eq!(path, [7, 8]);
        // Without the store nothing is drafted.
        assert_eq!(LookupChain::new(3).extend(&[1, 2, 5, 6], &mut DraftTree::new(6), usize::MAX), 0);
        // The store follows the head's path (the head drafted 7: 8 goes below it) but never branches off it (the
        // head drafted 9: nothing added).
        let mut chain = LookupChain::new(3).with_datastore(p.datastore.clone());
        let mut tree = DraftTree::new(6);
        let seven = tree.push(ROOT, 7, -0.5);
        assert_eq!(chain.extend(&[1, 2, 5, 6], &mut tree, usize::MAX), 1);
        assert_eq!(tree.children(seven).map(|c| tree.node(c).token).collect::<Vec<_>>(), [8]);
        let mut tree = DraftTree::new(6);
        tree.push(ROOT, 9, -0.5);
        assert_eq!(chain.extend(&[1, 2, 5, 6], &mut tree, usize::MAX), 0);
        assert_eq!(tree.len(), 2, "the root and 9");
    }

    #[test]
    fn lookup_chain_doubles_while_accepted_and_resets_after_a_miss() {
        let cycle: Vec<u32> = (10..30).collect();
        let mut tokens: Vec<u32> = cycle.iter().chain(&cycle[..3]).copied().collect();
        let mut chain = LookupChain::new(2);
        let grow = |tokens: &[u32], chain: &mut LookupChain, cap: usize| {
            let mut tree = DraftTree::new(*tokens.last().unwrap());
            let added = chain.extend(tokens, &mut tree, cap);
            let mut path = Vec::new();
            tree.path_tokens(tree.len() - 1, &mut path);
            assert_eq!(added, path.len());
            path
        };
        assert_eq!(grow(&tokens, &mut chain, usize::MAX), [13, 14]);
        // Accepted whole (then the bonus 15): the next chain is twice as long.
        tokens.extend([13, 14, 15]);
        assert_eq!(grow(&tokens, &mut chain, usize::MAX), [16, 17, 18, 19]);
        tokens.extend([16, 17, 18, 19, 20]);
        assert_eq!(grow(&tokens, &mut chain, usize::MAX).len(), 8, "doubled again");
        tokens.extend(&cycle[11..20]);
        tokens.extend(&cycle[..1]);
        assert_eq!(grow(&tokens, &mut chain, usize::MAX).len(), 8, "at most GROWTH × base");
        // Only part of it accepted: back to the base; the cap bounds any chain.
        tokens.extend([11, 12]);
        assert_eq!(grow(&tokens, &mut chain, usize::MAX), [13, 14]);
        assert_eq!(grow(&tokens, &mut chain, 1), [13]);
        assert!(LookupChain::new(0).extend(&tokens, &mut DraftTree::new(12), usize::MAX) == 0);
    }

    #[test]
    fn repeated_text_gives_a_deep_chain() {
        let mut p = NgramProposer::default();
        let tokens: Vec<u32> = [10, 11, 12, 13, 14, 15, 16, 17, 10, 11].to_vec();
        let (model, pool) = (model::testing::tiny_model("llama", None, 1, 64), kernels::ThreadPool::new(1));
        let ctx = DraftContext {
            model: &model,
            pool: &pool,
            tokens: &tokens,
            features: &[],
            feature_width: 0,
            stable_prefix: 0,
        };
        let mut tree = DraftTree::new(11);
        p.propose(&ctx, &mut tree).unwrap();
        let deepest = (0..tree.len()).max_by_key(|&i| tree.node(i).depth).unwrap();
        let mut path = Vec::new();
        tree.path_tokens(deepest, &mut path);
        assert_eq!(path, vec![12, 13, 14, 15, 16]);
    }
}
