//! Decoding modes a request may select (`--mode`, or `{"specee": {"mode": …}}` per request), what each needs
//! loaded ([`ModeResources`]), and what each reports to the metrics: layers executed per generated token (the
//! "exit layer") and tokens per full-model forward step (the "acceptance length").

use engine::early_exit::SpecEeSetup;
use engine::Generation;

/// A decoding strategy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    /// Every token through every layer: the lossless reference.
    Dense,
    /// Tree speculative decoding with the model's draft head: lossless (greedy output identical to dense,
    /// sampling from the same distribution).
    Eagle,
    /// Speculative early exit with the model's exit predictors: lossy, greedy only.
    Specee,
    /// The same early exit inside eagle's tree verification (merged mapping): lossy, greedy only.
    SpeceeEagle,
}

impl Mode {
    /// Every mode this server knows, in the order metrics list them.
    pub const ALL: &'static [Mode] = &[Mode::Dense, Mode::Eagle, Mode::Specee, Mode::SpeceeEagle];

    /// The name used on the command line, in requests and as the metrics' `mode` label.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Dense => "dense",
            Mode::Eagle => "eagle",
            Mode::Specee => "specee",
            Mode::SpeceeEagle => "specee-eagle",
        }
    }

    /// Whether the mode decodes greedily only.
    pub fn greedy_only(self) -> bool {
        matches!(self, Mode::Specee | Mode::SpeceeEagle)
    }

    /// Whether the mode can follow a grammar with these settings: dense always, eagle when greedy (its output
    /// then equals constrained dense's), the early-exit modes (greedy only anyway: an exit the grammar forbids
    /// is refused).
    pub fn follows_grammar(self, sampling: &decode::SamplingParams) -> bool {
        match self {
            Mode::Dense => true,
            Mode::Eagle | Mode::Specee | Mode::SpeceeEagle => sampling.is_greedy(),
        }
    }

    /// Whether the mode can report log probabilities under the full model: dense, and eagle from its
    /// verification rows (equal to dense's); not the early-exit modes, whose tokens come from truncated forwards.
    pub fn reports_logprobs(self) -> bool {
        matches!(self, Mode::Dense | Mode::Eagle)
    }

    /// The mode called `name`.
    pub fn parse(name: &str) -> Option<Mode> {
        Mode::ALL.iter().copied().find(|m| m.name() == name)
    }

    /// The names of all modes, comma-separated (for error messages).
    pub fn names() -> String {
        Mode::ALL.iter().map(|m| m.name()).collect::<Vec<_>>().join(", ")
    }
}

/// What the modes beyond dense run with, loaded once at start: the draft head (`eagle`) and the early-exit setup
/// (`specee`: head, predictors, settings). A mode whose part is missing is refused per request with a 400.
#[derive(Clone, Default)]
pub struct ModeResources {
    /// Shared by every `eagle` request (never copied per request).
    pub draft: Option<std::sync::Arc<decode::speculative::DraftHead>>,
    pub specee: Option<SpecEeSetup>,
    /// What `eagle` requests' lookup chains fall back on (the `specee` setup holds its own).
    pub datastore: Option<std::sync::Arc<decode::speculative::Datastore>>,
}

impl std::fmt::Debug for ModeResources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModeResources")
            .field("draft", &self.draft.is_some())
            .field("specee", &self.specee.is_some())
            .field("datastore", &self.datastore.is_some())
            .finish()
    }
}

impl ModeResources {
    /// The tree `eagle` requests draft with: the head's own, else the default (`None` without a head).
    pub fn eagle_tree(&self) -> Option<decode::speculative::TreeConfig> {
        self.draft.as_ref().map(|h| decode::speculative::EagleProposer::tree_for(h, None))
    }

    /// The modes these resources can run (dense always).
    pub fn available(&self) -> Vec<Mode> {
        Mode::ALL
            .iter()
            .copied()
            .filter(|m| match m {
                Mode::Dense => true,
                Mode::Eagle => self.draft.is_some(),
                Mode::Specee | Mode::SpeceeEagle => self.specee.is_some(),
            })
            .collect()
    }

    /// Why `mode` cannot run here, if it cannot.
    pub fn missing(&self, mode: Mode) -> Option<&'static str> {
        match mode {
            Mode::Dense => None,
            Mode::Eagle => self.draft.is_none().then_some(
                "no draft head was loaded for this model (ship heads/<model>.draft.safetensors or start with --draft FILE)",
            ),
            Mode::Specee | Mode::SpeceeEagle => self.specee.is_none().then_some(
                "no draft head and exit predictors were loaded for this model (heads/<model>.{draft,exit}.safetensors, \
                 or --draft FILE --exit FILE)",
            ),
        }
    }
}

/// Sums from which the metrics derive the average exit layer (`layers / tokens`) and the average acceptance
/// length (`tokens / steps`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DecodeStats {
    /// Generated tokens.
    pub tokens: u64,
    /// Layers executed, summed over generated tokens (a token that exits after layer `i` counts `i + 1`).
    pub layers: u64,
    /// Forward steps of the full model (verification passes for speculative modes).
    pub steps: u64,
    /// The draft tree the tree modes drafted with (`None` for dense and `specee`).
    pub tree: Option<decode::speculative::TreeConfig>,
}

impl DecodeStats {
    /// A dense generation: all layers for every token, one token per forward step.
    pub fn dense(generation: &Generation, n_layers: usize) -> DecodeStats {
        let tokens = generation.generated_ids.len() as u64;
        DecodeStats { tokens, layers: tokens * n_layers as u64, steps: tokens, tree: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for &m in Mode::ALL {
            assert_eq!(Mode::parse(m.name()), Some(m));
        }
        assert_eq!(Mode::parse("turbo"), None);
        assert_eq!(Mode::names(), "dense, eagle, specee, specee-eagle");
        let none = ModeResources::default();
        assert_eq!(none.available(), vec![Mode::Dense]);
        assert!(none.missing(Mode::Eagle).unwrap().contains("draft head"));
        assert!(none.missing(Mode::Dense).is_none());
    }
}
