//! Oracle proposer: replays a known token sequence (e.g. a dense greedy run of the same prompt) as the correct
//! path of the tree, with deliberately wrong siblings (and wrong grandchildren under them) placed *before* the
//! correct node. Greedy acceptance then takes the full depth every step (τ = depth + 1), and the accepted path
//! sits in non-adjacent slots of the verified batch, which exercises KV-cache compaction. Meant for tests and for
//! measuring the best case of a tree size; it proposes nothing once the context leaves the known sequence.

use super::proposer::{DraftContext, Proposer};
use super::tree::{DraftTree, ROOT};
use super::SpeculativeError;

/// Proposes the continuation of a known sequence, with wrong siblings.
#[derive(Clone, Debug)]
pub struct OracleProposer {
    /// The known sequence (prompt followed by its continuation).
    pub reference: Vec<u32>,
    /// Correct tokens drafted per step.
    pub depth: usize,
    /// Wrong siblings before each correct node (each with one wrong child of its own, above the last level).
    pub wrong_siblings: usize,
    /// Vocabulary size (wrong tokens are drawn below it).
    pub vocab: u32,
}

impl OracleProposer {
    /// An oracle for `reference`, drafting `depth` correct tokens with `wrong_siblings` decoys at every level.
    pub fn new(reference: Vec<u32>, depth: usize, wrong_siblings: usize, vocab: usize) -> OracleProposer {
        OracleProposer { reference, depth, wrong_siblings, vocab: vocab.max(2) as u32 }
    }

    fn wrong(&self, right: u32, k: usize) -> u32 {
        // Any token but `right`; k = 0, 1, … give different ones.
        let t = (right as u64 + 1 + k as u64 * 7919) % self.vocab as u64;
        if t as u32 == right {
            (right + 1) % self.vocab
        } else {
            t as u32
        }
    }
}

impl Proposer for OracleProposer {
    fn propose(&mut self, context: &DraftContext<'_>, tree: &mut DraftTree) -> Result<(), SpeculativeError> {
        let n = context.tokens.len();
        if n > self.reference.len() || self.reference[..n] != *context.tokens {
            return Ok(());
        }
        let mut parent = ROOT;
        let right_path = &self.reference[n..self.reference.len().min(n + self.depth)];
        for (level, &right) in right_path.iter().enumerate() {
            for k in 0..self.wrong_siblings {
                let w = tree.push(parent, self.wrong(right, k), -1.0);
                if level + 1 < self.depth {
                    tree.push(w, self.wrong(right, k + 1), -1.0);
                }
            }
            parent = tree.push(parent, right, -0.1);
        }
        Ok(())
    }
}
