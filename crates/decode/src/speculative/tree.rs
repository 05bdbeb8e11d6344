//! Draft trees: [`DraftTree`] (the root — the last committed token — plus drafted nodes in topological order,
//! each with its parent, depth and draft log-probabilities), the ancestor mask and positions the verifier needs,
//! and [`build_dynamic_tree`], the EAGLE-2 dynamic tree builder (Li et al., 2024, arXiv:2406.16858, Alg. 1):
//! expand the `top_k` nodes with the best cumulative log-probability at each depth, keep every candidate they
//! produce, and finally rerank all candidates to a node `budget`.

/// Index of the root in every [`DraftTree`].
pub const ROOT: usize = 0;

/// One node of a draft tree.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DraftNode {
    /// The drafted token (for the root: the last committed token).
    pub token: u32,
    /// Index of the parent node, always smaller than this node's index (the root is its own parent).
    pub parent: usize,
    /// Distance from the root (the root has depth 0).
    pub depth: usize,
    /// The draft's log-probability of `token` after its parent (0 for the root).
    pub log_prob: f32,
    /// Sum of `log_prob` along the path from the root: the draft's confidence that the whole path is right.
    pub score: f32,
}

/// Who drafted a node: what the chat page and `specee chat` show for each accepted token.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DraftSource {
    /// The draft head (or any model-based proposer).
    #[default]
    Head,
    /// Prompt lookup: an n-gram match in the context or the datastore.
    Lookup,
}

/// A draft tree: node 0 is the root, every other node comes after its parent (topological order), so any prefix
/// of the node list is itself a tree.
#[derive(Clone, Debug)]
pub struct DraftTree {
    nodes: Vec<DraftNode>,
    /// Who drafted each node (the root: [`DraftSource::Head`], meaningless).
    sources: Vec<DraftSource>,
    /// Per node: when its children were *sampled* without replacement from a draft distribution, that
    /// distribution as `(token, probability)` pairs. `None`: the children were chosen deterministically (top-k),
    /// which rejection sampling treats as a point mass on each child in turn.
    child_distributions: Vec<Option<Vec<(u32, f32)>>>,
}

impl DraftTree {
    /// A tree holding only its root.
    pub fn new(root_token: u32) -> DraftTree {
        let mut tree = DraftTree { nodes: Vec::new(), sources: Vec::new(), child_distributions: Vec::new() };
        tree.reset(root_token);
        tree
    }

    /// Empties the tree down to a new root.
    pub fn reset(&mut self, root_token: u32) {
        self.nodes.clear();
        self.sources.clear();
        self.child_distributions.clear();
        self.nodes.push(DraftNode { token: root_token, parent: ROOT, depth: 0, log_prob: 0.0, score: 0.0 });
        self.sources.push(DraftSource::Head);
        self.child_distributions.push(None);
    }

    /// Adds a child of `parent` and returns its index.
    ///
    /// # Panics
    /// If `parent` is not a node of the tree (a bug in the proposer, not bad input).
    pub fn push(&mut self, parent: usize, token: u32, log_prob: f32) -> usize {
        self.push_from(parent, token, log_prob, DraftSource::Head)
    }

    /// [`DraftTree::push`] for a node drafted by `source`.
    pub fn push_from(&mut self, parent: usize, token: u32, log_prob: f32, source: DraftSource) -> usize {
        assert!(parent < self.nodes.len(), "draft tree: parent {parent} of a new node does not exist");
        let p = self.nodes[parent];
        self.nodes.push(DraftNode { token, parent, depth: p.depth + 1, log_prob, score: p.score + log_prob });
        self.sources.push(source);
        self.child_distributions.push(None);
        self.nodes.len() - 1
    }

    /// Who drafted node `i`.
    pub fn source(&self, i: usize) -> DraftSource {
        self.sources[i]
    }

    /// Marks every drafted node as drafted by `source` (a proposer that is all one kind).
    pub fn set_all_sources(&mut self, source: DraftSource) {
        self.sources[1..].fill(source);
    }

    /// Declares that the children of `node` were sampled without replacement from `distribution`
    /// (`(token, probability)` pairs, probabilities summing to 1), in the order they were pushed.
    pub fn set_child_distribution(&mut self, node: usize, distribution: Vec<(u32, f32)>) {
        self.child_distributions[node] = Some(distribution);
    }

    /// How the children of `node` were drawn (see [`DraftTree::set_child_distribution`]).
    pub fn child_distribution(&self, node: usize) -> Option<&[(u32, f32)]> {
        self.child_distributions[node].as_deref()
    }

    /// Number of nodes, root included.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the tree holds only its root.
    pub fn is_empty(&self) -> bool {
        self.nodes.len() <= 1
    }

    /// All nodes, root first.
    pub fn nodes(&self) -> &[DraftNode] {
        &self.nodes
    }

    /// One node.
    pub fn node(&self, i: usize) -> &DraftNode {
        &self.nodes[i]
    }

    /// The root's token.
    pub fn root_token(&self) -> u32 {
        self.nodes[ROOT].token
    }

    /// Children of `node`, in the order they were added.
    pub fn children(&self, node: usize) -> impl Iterator<Item = usize> + '_ {
        (node + 1..self.nodes.len()).filter(move |&j| self.nodes[j].parent == node)
    }

    /// Largest depth in the tree.
    pub fn depth(&self) -> usize {
        self.nodes.iter().map(|n| n.depth).max().unwrap_or(0)
    }

    /// Tokens on the path from just below the root down to `node` (empty for the root).
    pub fn path_tokens(&self, node: usize, out: &mut Vec<u32>) {
        out.clear();
        let mut i = node;
        while i != ROOT {
            out.push(self.nodes[i].token);
            i = self.nodes[i].parent;
        }
        out.reverse();
    }

    /// Keeps the first `n` nodes (at least the root); they form a tree because parents come first.
    pub fn truncate(&mut self, n: usize) {
        self.nodes.truncate(n.max(1));
        self.sources.truncate(n.max(1));
        self.child_distributions.truncate(n.max(1));
    }

    /// Drops every node deeper than `max_depth` (and so all its descendants).
    pub fn prune_deeper_than(&mut self, max_depth: usize) {
        if self.depth() <= max_depth {
            return;
        }
        self.retain(|_, node| node.depth <= max_depth);
    }

    /// Keeps the root and the nodes `keep(index, node)` accepts whose parent is kept (a dropped node takes its
    /// descendants with it); order and sources are kept, indices renumbered.
    pub fn retain(&mut self, mut keep: impl FnMut(usize, &DraftNode) -> bool) {
        let mut remap = vec![usize::MAX; self.nodes.len()];
        let mut kept = Vec::with_capacity(self.nodes.len());
        let mut kept_dists = Vec::with_capacity(self.nodes.len());
        let mut kept_sources = Vec::with_capacity(self.nodes.len());
        for (i, node) in self.nodes.iter().enumerate() {
            let parent_kept = i == ROOT || remap[node.parent] != usize::MAX;
            if parent_kept && (i == ROOT || keep(i, node)) {
                remap[i] = kept.len();
                kept.push(DraftNode { parent: remap[node.parent], ..*node });
                kept_dists.push(self.child_distributions[i].take());
                kept_sources.push(self.sources[i]);
            }
        }
        self.nodes = kept;
        self.sources = kept_sources;
        self.child_distributions = kept_dists;
    }

    /// Drops the nodes whose path (after the root) `constraint` forbids; a kept node's parent is kept too, as a
    /// path's prefix is valid when the path is. Returns which of the nodes before the call were kept.
    pub fn retain_allowed(&mut self, constraint: &mut dyn crate::TokenConstraint) -> Vec<bool> {
        let mut path = Vec::new();
        let valid: Vec<bool> = (0..self.len())
            .map(|i| {
                self.path_tokens(i, &mut path);
                constraint.valid_prefix(&path) == path.len()
            })
            .collect();
        self.retain(|i, _| valid[i]);
        valid
    }

    /// The `len × len` ancestor mask: `mask[j * len + m]` is true iff node `m` is node `j` or one of its ancestors.
    pub fn ancestor_mask(&self, mask: &mut Vec<bool>) {
        let n = self.nodes.len();
        mask.clear();
        mask.resize(n * n, false);
        for j in 0..n {
            mask[j * n + j] = true;
            if j != ROOT {
                // A parent's row already holds all of its ancestors.
                let p = self.nodes[j].parent;
                let (before, row) = mask.split_at_mut(j * n);
                row[..n].iter_mut().zip(&before[p * n..p * n + n]).for_each(|(dst, &src)| *dst |= src);
            }
        }
    }

    /// Absolute positions of the nodes when the root sits at position `root_position`.
    pub fn positions(&self, root_position: u32, out: &mut Vec<u32>) {
        out.clear();
        out.extend(self.nodes.iter().map(|n| root_position + n.depth as u32));
    }
}

/// Sizes of a draft tree. The defaults suit a 2-core CPU, where every extra verified node costs real time;
/// EAGLE-2 uses depth 5–7, top-k 10 and a budget of 60 on a GPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TreeConfig {
    /// Maximum depth (draft tokens on one path).
    pub depth: usize,
    /// Nodes expanded per depth, and children kept per expanded node.
    pub top_k: usize,
    /// Maximum number of drafted nodes (the root not included).
    pub budget: usize,
    /// Confidence floor: a node whose path probability (the product of the draft's probabilities from the root)
    /// is below this is neither kept nor expanded, so a step the draft doubts verifies fewer rows, or only the
    /// root (0: the budget alone decides). On a CPU every verified row costs time, so a node the draft itself
    /// gives little chance is not worth its row.
    pub min_prob: f32,
}

impl Default for TreeConfig {
    fn default() -> Self {
        TreeConfig { depth: 5, top_k: 4, budget: 20, min_prob: 0.0 }
    }
}

impl std::str::FromStr for TreeConfig {
    type Err = String;

    /// `DEPTH,TOP_K,BUDGET[,MIN_PROB]` (`--tree`, and a draft head's recommended tree in its metadata); a missing
    /// MIN_PROB is 0. The error says which part is wrong.
    fn from_str(s: &str) -> Result<TreeConfig, String> {
        let parts: Vec<&str> = s.split(',').map(str::trim).collect();
        let count = |x: &str| x.parse::<usize>().map_err(|_| format!("bad number `{x}`"));
        match parts[..] {
            [d, k, b] | [d, k, b, _] => {
                let min_prob = match parts.get(3) {
                    None => 0.0,
                    Some(p) => match p.parse::<f32>() {
                        Ok(v) if (0.0..=1.0).contains(&v) => v,
                        _ => return Err(format!("MIN_PROB: expected a probability in [0, 1], got `{p}`")),
                    },
                };
                Ok(TreeConfig { depth: count(d)?, top_k: count(k)?, budget: count(b)?, min_prob })
            }
            _ => Err("expected DEPTH,TOP_K,BUDGET[,MIN_PROB]".into()),
        }
    }
}

impl std::fmt::Display for TreeConfig {
    /// The form [`TreeConfig::from_str`](std::str::FromStr) reads.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{},{},{},{}", self.depth, self.top_k, self.budget, self.min_prob)
    }
}

/// Builds an EAGLE-2 dynamic tree under `tree`'s root (which it resets to that root first).
///
/// `expand(pool, frontier, children)` is the draft model: for each node index in `frontier` (nodes of `pool`, a
/// tree of every candidate so far, whose root is `tree`'s root), it pushes onto `children` one list of
/// `(token, log_prob)` candidates for that node's next token (any length, any order). At each depth the builder
/// keeps the `top_k` best children of every expanded node, then expands the `top_k` new nodes with the best
/// cumulative log-probability at the next depth; at the end the `budget` best candidates overall (by
/// cumulative log-probability, ties to the shallower and earlier node) become the tree. Children whose cumulative
/// probability is below `min_prob` are dropped as they come.
pub fn build_dynamic_tree<E>(
    config: &TreeConfig,
    tree: &mut DraftTree,
    expand: impl FnMut(&DraftTree, &[usize], &mut Vec<Vec<(u32, f32)>>) -> Result<(), E>,
) -> Result<(), E> {
    build_dynamic_tree_traced(config, tree, &mut Vec::new(), expand)
}

/// [`build_dynamic_tree`], also leaving in `origin[i]` the index in `expand`'s candidate pool of tree node `i`
/// (so a caller can find what it computed for that node while expanding).
pub fn build_dynamic_tree_traced<E>(
    config: &TreeConfig,
    tree: &mut DraftTree,
    origin: &mut Vec<usize>,
    mut expand: impl FnMut(&DraftTree, &[usize], &mut Vec<Vec<(u32, f32)>>) -> Result<(), E>,
) -> Result<(), E> {
    let root_token = tree.root_token();
    let mut pool = DraftTree::new(root_token);
    let mut frontier = vec![ROOT];
    let mut children: Vec<Vec<(u32, f32)>> = Vec::new();
    let mut fresh: Vec<usize> = Vec::new();
    let floor = if config.min_prob > 0.0 { config.min_prob.ln() } else { f32::NEG_INFINITY };
    for _ in 0..config.depth {
        if frontier.is_empty() || config.top_k == 0 {
            break;
        }
        children.clear();
        expand(&pool, &frontier, &mut children)?;
        fresh.clear();
        for (&parent, kids) in frontier.iter().zip(children.iter_mut()) {
            kids.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            kids.dedup_by_key(|k| k.0);
            let base = pool.nodes[parent].score;
            for &(token, log_prob) in kids.iter().take(config.top_k).filter(|k| base + k.1 >= floor) {
                fresh.push(pool.push(parent, token, log_prob));
            }
        }
        // Stable sort: among equal scores the earlier node (child of a better parent) wins.
        fresh.sort_by(|&a, &b| pool.nodes[b].score.total_cmp(&pool.nodes[a].score));
        fresh.truncate(config.top_k);
        frontier.clear();
        frontier.extend_from_slice(&fresh);
    }
    select_best(&pool, config.budget, tree, origin);
    Ok(())
}

/// Rebuilds `out` from the `budget` best nodes of `pool` (ancestor-closed, in `pool`'s order); `origin[i]` is
/// the pool index of `out`'s node `i`.
fn select_best(pool: &DraftTree, budget: usize, out: &mut DraftTree, origin: &mut Vec<usize>) {
    let mut order: Vec<usize> = (1..pool.len()).collect();
    order.sort_by(|&a, &b| {
        let (na, nb) = (&pool.nodes[a], &pool.nodes[b]);
        nb.score.total_cmp(&na.score).then(na.depth.cmp(&nb.depth)).then(a.cmp(&b))
    });
    let mut chosen = vec![false; pool.len()];
    chosen[ROOT] = true;
    let mut taken = 0;
    for i in order {
        if taken == budget {
            break;
        }
        // Log-probabilities are at most 0, so a parent scores at least as well as its child and comes first;
        // the check only guards against positive "log-probabilities" from a careless draft.
        if chosen[pool.nodes[i].parent] {
            chosen[i] = true;
            taken += 1;
        }
    }
    out.reset(pool.root_token());
    origin.clear();
    origin.push(ROOT);
    let mut remap = vec![ROOT; pool.len()];
    for i in 1..pool.len() {
        if chosen[i] {
            let n = pool.nodes[i];
            remap[i] = out.push_from(remap[n.parent], n.token, n.log_prob, pool.sources[i]);
            origin.push(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_sizes_parse_and_print_back() {
        let t: TreeConfig = "6,1,6,0.4".parse().unwrap();
        assert_eq!(t, TreeConfig { depth: 6, top_k: 1, budget: 6, min_prob: 0.4 });
        assert_eq!(t.to_string().parse::<TreeConfig>().unwrap(), t);
        assert_eq!(
            " 2, 1 ,2".parse::<TreeConfig>().unwrap(),
            TreeConfig { depth: 2, top_k: 1, budget: 2, min_prob: 0.0 }
        );
        for (bad, why) in [
            ("2,1", "expected DEPTH"),
            ("2,x,2", "bad number `x`"),
            ("2,1,2,1.5", "MIN_PROB"),
            ("2,1,2,nan", "MIN_PROB"),
        ] {
            let err = bad.parse::<TreeConfig>().unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    /// Root, two children (1, 2), a grandchild 3 under 2 and a great-grandchild 4 under 3.
    fn sample_tree() -> DraftTree {
        let mut t = DraftTree::new(7);
        t.push(ROOT, 10, -0.5);
        let b = t.push(ROOT, 11, -1.0);
        let c = t.push(b, 12, -0.1);
        t.push(c, 13, -0.2);
        t
    }

    #[test]
    fn sources_follow_their_nodes_through_pruning_and_selection() {
        let mut t = sample_tree();
        let d = t.push_from(ROOT, 20, -0.05, DraftSource::Lookup);
        t.push_from(d, 21, -0.05, DraftSource::Lookup);
        assert_eq!(t.source(1), DraftSource::Head);
        assert_eq!(t.source(d), DraftSource::Lookup);
        t.prune_deeper_than(1);
        let kept: Vec<(u32, DraftSource)> = (1..t.len()).map(|i| (t.node(i).token, t.source(i))).collect();
        assert_eq!(kept, [(10, DraftSource::Head), (11, DraftSource::Head), (20, DraftSource::Lookup)]);
        t.truncate(2);
        t.set_all_sources(DraftSource::Lookup);
        assert_eq!(t.source(1), DraftSource::Lookup);
        t.reset(3);
        assert_eq!(t.push(ROOT, 4, -0.1), 1);
        assert_eq!(t.source(1), DraftSource::Head);
    }

    #[test]
    fn mask_holds_exactly_ancestors_and_self() {
        let t = sample_tree();
        let mut m = Vec::new();
        t.ancestor_mask(&mut m);
        let n = t.len();
        let rows: Vec<Vec<usize>> = (0..n).map(|j| (0..n).filter(|&k| m[j * n + k]).collect()).collect();
        assert_eq!(rows, vec![vec![0], vec![0, 1], vec![0, 2], vec![0, 2, 3], vec![0, 2, 3, 4]]);
    }

    #[test]
    fn positions_follow_depth_and_scores_accumulate() {
        let t = sample_tree();
        let mut p = Vec::new();
        t.positions(40, &mut p);
        assert_eq!(p, vec![40, 41, 41, 42, 43]);
        assert!((t.node(4).score - (-1.3)).abs() < 1e-6);
        let mut path = Vec::new();
        t.path_tokens(4, &mut path);
        assert_eq!(path, vec![11, 12, 13]);
        assert_eq!(t.children(ROOT).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(t.depth(), 3);
    }

    #[test]
    fn pruning_by_depth_keeps_a_valid_tree() {
        let mut t = sample_tree();
        t.prune_deeper_than(1);
        assert_eq!(t.len(), 3);
        assert!(t.nodes().iter().all(|n| n.depth <= 1 && n.parent == ROOT));
    }

    /// A made-up draft: the children of a path are tokens `last + 1 ..= last + 4` with log-probabilities
    /// `-(i + 1) * 0.5`, except that paths through token 2 are very likely.
    fn toy_expand(pool: &DraftTree, frontier: &[usize], out: &mut Vec<Vec<(u32, f32)>>) -> Result<(), ()> {
        for &f in frontier {
            let last = pool.node(f).token;
            let mut kids: Vec<(u32, f32)> = (0..4).map(|i| (last + 1 + i, -(i as f32 + 1.0) * 0.5)).collect();
            if last == 1 {
                kids[0].1 = -0.01; // token 2
            }
            out.push(kids);
        }
        Ok(())
    }

    #[test]
    fn dynamic_tree_respects_budget_depth_and_prefers_likely_paths() {
        let config = TreeConfig { depth: 4, top_k: 2, budget: 6, min_prob: 0.0 };
        let mut t = DraftTree::new(0);
        build_dynamic_tree(&config, &mut t, toy_expand).unwrap();
        assert_eq!(t.len(), 7);
        assert!(t.depth() <= 4);
        for (i, n) in t.nodes().iter().enumerate().skip(1) {
            assert!(n.parent < i);
            assert!(n.score <= t.node(n.parent).score);
        }
        // Best first child is token 1 (-0.5), then token 2 under it (-0.51): the path 1 → 2 must be there.
        let one = t.children(ROOT).find(|&c| t.node(c).token == 1).unwrap();
        assert!(t.children(one).any(|c| t.node(c).token == 2));
        // Only the top 2 children of the root were candidates at all.
        assert!(t.children(ROOT).all(|c| t.node(c).token <= 2));
        // The traced build gives the same tree and where each node came from in the pool.
        let (mut traced, mut origin) = (DraftTree::new(0), Vec::new());
        let mut pool_tokens = vec![0u32];
        build_dynamic_tree_traced(&config, &mut traced, &mut origin, |pool, f: &[usize], out| {
            pool_tokens = pool.nodes().iter().map(|n| n.token).collect();
            toy_expand(pool, f, out)
        })
        .unwrap();
        assert_eq!(traced.nodes(), t.nodes());
        assert_eq!(origin.len(), t.len());
        assert!(origin.windows(2).all(|w| w[0] < w[1]), "{origin:?}");
        // The last expansion's pool lacks the final children, but every expanded node's token matches.
        for (i, &o) in origin.iter().enumerate() {
            if o < pool_tokens.len() {
                assert_eq!(pool_tokens[o], t.node(i).token);
            }
        }
    }

    #[test]
    fn confidence_floor_drops_unlikely_nodes() {
        // toy_expand's children have probabilities e^-0.5 ≈ 0.61, e^-1 ≈ 0.37, …; the path 1 → 2 scores -0.51.
        let mut config = TreeConfig { depth: 4, top_k: 2, budget: 6, min_prob: 0.5 };
        let mut t = DraftTree::new(0);
        build_dynamic_tree(&config, &mut t, toy_expand).unwrap();
        let tokens: Vec<u32> = t.nodes().iter().skip(1).map(|n| n.token).collect();
        assert_eq!(tokens, vec![1, 2], "only nodes with path probability ≥ 0.5");
        assert!(t.nodes().iter().all(|n| n.score >= 0.5f32.ln()));
        // A floor above every draft probability leaves only the root; a zero floor changes nothing.
        config.min_prob = 0.9;
        build_dynamic_tree(&config, &mut t, toy_expand).unwrap();
        assert!(t.is_empty());
        config.min_prob = 0.0;
        build_dynamic_tree(&config, &mut t, toy_expand).unwrap();
        assert_eq!(t.len(), 7);
    }

    #[test]
    fn dynamic_tree_with_no_candidates_is_just_the_root() {
        let mut t = DraftTree::new(5);
        build_dynamic_tree(&TreeConfig::default(), &mut t, |_, f: &[usize], out: &mut Vec<Vec<(u32, f32)>>| {
            out.extend(f.iter().map(|_| Vec::new()));
            Ok::<(), ()>(())
        })
        .unwrap();
        assert!(t.is_empty());
        assert_eq!(t.root_token(), 5);
    }

    #[test]
    fn retain_drops_a_node_with_its_descendants_and_keeps_sources_in_order() {
        let mut t = sample_tree();
        t.push_from(1, 12, -0.2, DraftSource::Lookup);
        // Drop node 2 (token 11): its grandchild 3 and great-grandchild 4 go with it.
        t.retain(|_, n| n.token != 11);
        let tokens: Vec<u32> = t.nodes().iter().map(|n| n.token).collect();
        assert_eq!(tokens, [7, 10, 12]);
        assert_eq!(t.node(2).parent, 1);
        assert_eq!(t.source(2), DraftSource::Lookup);
        t.retain(|_, _| false);
        assert_eq!(t.len(), 1, "the root always stays");
    }
}
