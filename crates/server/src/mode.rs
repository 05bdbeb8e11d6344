//! Decoding modes a request may select (`--mode`, or `{"specee": {"mode": …}}` per request), and what each
//! reports to the metrics: layers executed per generated token (the "exit layer") and tokens per forward
//! step (the "acceptance length"). Only `dense` exists yet; later modes (early exit, speculative trees) add a
//! variant here, a branch in [`crate::scheduler`]'s dispatch, and their statistics.

use engine::Generation;

/// A decoding strategy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    /// Every token through every layer: the lossless reference.
    Dense,
}

impl Mode {
    /// Every mode this server can run, in the order metrics list them.
    pub const ALL: &'static [Mode] = &[Mode::Dense];

    /// The name used on the command line, in requests and as the metrics' `mode` label.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Dense => "dense",
        }
    }

    /// The mode called `name`.
    pub fn parse(name: &str) -> Option<Mode> {
        Mode::ALL.iter().copied().find(|m| m.name() == name)
    }

    /// The names of all modes, comma-separated (for error messages).
    pub fn names() -> String {
        Mode::ALL.iter().map(|m| m.name()).collect::<Vec<_>>().join(", ")
    }

    /// What one finished generation contributes to this mode's statistics.
    pub fn decode_stats(self, generation: &Generation, n_layers: usize) -> DecodeStats {
        let tokens = generation.generated_ids.len() as u64;
        match self {
            // Dense runs all layers for every token and produces one token per forward step.
            Mode::Dense => DecodeStats { tokens, layers: tokens * n_layers as u64, steps: tokens },
        }
    }
}

/// Sums from which the metrics derive the average exit layer (`layers / tokens`) and the average acceptance
/// length (`tokens / steps`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Generated tokens.
    pub tokens: u64,
    /// Layers executed, summed over generated tokens (a token that exits after layer `i` counts `i + 1`).
    pub layers: u64,
    /// Forward steps of the full model (verification passes for speculative modes).
    pub steps: u64,
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
        assert_eq!(Mode::names(), "dense");
    }
}
