//! Grammar constraints on the committed tokens, as the decoders see them: a [`TokenConstraint`] says which tokens
//! may come next and follows the tokens committed. `decode` stays free of any grammar engine; the engine crate
//! implements the trait with llguidance (`engine::constraint`).
//!
//! The committed token under a constraint is the best *allowed* token: for greedy settings the argmax of the
//! logits with every forbidden token at −∞ ([`constrained_argmax`]). When the unconstrained argmax is allowed it
//! is that token, so the decoders first take the cheap greedy screen and compute full logits only when the
//! grammar forbids its choice.

/// A grammar the generated tokens must follow. Its state is "every token committed so far".
pub trait TokenConstraint {
    /// Sets to `-inf` the logits (`vocab` long) of every token the grammar forbids next.
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), ConstraintError>;
    /// Whether the grammar allows `token` next.
    fn allows(&mut self, token: u32) -> Result<bool, ConstraintError>;
    /// Commits `token` (which must be allowed).
    fn commit(&mut self, token: u32) -> Result<(), ConstraintError>;
    /// How many of `tokens`, in order after the committed ones, the grammar accepts; the state is unchanged.
    fn valid_prefix(&mut self, tokens: &[u32]) -> usize;
    /// Whether the grammar is finished: nothing but end-of-generation may follow.
    fn is_finished(&self) -> bool;
    /// Tokens the grammar forces next whatever the model would say (a schema's keys, `", "`), in the model's own
    /// tokenization; tree decoding drafts them (the target still verifies them). Default: none.
    fn forced(&mut self) -> Vec<u32> {
        Vec::new()
    }
}

/// A constraint that failed (the grammar engine's message).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("grammar: {0}")]
pub struct ConstraintError(pub String);

/// The greedy token under `constraint`: `argmax` (the unconstrained greedy token) when the grammar allows it,
/// else the argmax of the full logits `full_logits` writes into `scratch`, masked. Errs when the grammar allows
/// no token at all.
pub fn constrained_argmax(
    argmax: u32,
    constraint: &mut dyn TokenConstraint,
    full_logits: impl FnOnce(&mut Vec<f32>),
    scratch: &mut Vec<f32>,
) -> Result<u32, ConstraintError> {
    if constraint.allows(argmax)? {
        return Ok(argmax);
    }
    full_logits(scratch);
    masked_argmax(constraint, scratch)
}

/// Argmax of `logits` after masking them with `constraint` (first index on ties, as the unconstrained argmax).
pub fn masked_argmax(constraint: &mut dyn TokenConstraint, logits: &mut [f32]) -> Result<u32, ConstraintError> {
    constraint.mask(logits)?;
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in logits.iter().enumerate() {
        if x > f32::NEG_INFINITY && best.map_or(true, |(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    best.map(|(i, _)| i as u32).ok_or_else(|| ConstraintError("the grammar allows no token here".into()))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A toy grammar for tests: the allowed tokens after each number of committed tokens (`None`: any).
    pub struct Script {
        pub allowed: Vec<Option<Vec<u32>>>,
        pub committed: Vec<u32>,
    }

    impl Script {
        fn allowed_at(&self, i: usize, t: u32) -> bool {
            match self.allowed.get(i) {
                Some(Some(set)) => set.contains(&t),
                Some(None) => true,
                None => false,
            }
        }
    }

    impl TokenConstraint for Script {
        fn mask(&mut self, logits: &mut [f32]) -> Result<(), ConstraintError> {
            let i = self.committed.len();
            for (t, x) in logits.iter_mut().enumerate() {
                if !self.allowed_at(i, t as u32) {
                    *x = f32::NEG_INFINITY;
                }
            }
            Ok(())
        }
        fn allows(&mut self, token: u32) -> Result<bool, ConstraintError> {
            Ok(self.allowed_at(self.committed.len(), token))
        }
        fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
            if !self.allowed_at(self.committed.len(), token) {
                return Err(ConstraintError(format!("token {token} not allowed")));
            }
            self.committed.push(token);
            Ok(())
        }
        fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
            let n = self.committed.len();
            tokens.iter().enumerate().take_while(|&(k, &t)| self.allowed_at(n + k, t)).count()
        }
        fn is_finished(&self) -> bool {
            self.committed.len() >= self.allowed.len()
        }
        fn forced(&mut self) -> Vec<u32> {
            let n = self.committed.len();
            let single = |k: usize| match self.allowed.get(k) {
                Some(Some(set)) if set.len() == 1 => Some(set[0]),
                _ => None,
            };
            (n..).map_while(single).collect()
        }
    }

    #[test]
    fn the_unconstrained_argmax_is_kept_when_allowed_else_the_best_allowed_token() {
        let logits = [0.5f32, 3.0, 1.0, 2.0];
        let mut c = Script { allowed: vec![None, Some(vec![0, 2, 3])], committed: vec![] };
        let mut scratch = Vec::new();
        assert_eq!(constrained_argmax(1, &mut c, |_| panic!("logits not needed"), &mut scratch).unwrap(), 1);
        c.commit(1).unwrap();
        assert_eq!(constrained_argmax(1, &mut c, |s| *s = logits.to_vec(), &mut scratch).unwrap(), 3);
        c.commit(3).unwrap();
        assert!(c.is_finished());
        let e = constrained_argmax(1, &mut c, |s| *s = logits.to_vec(), &mut scratch).unwrap_err();
        assert_eq!(e.to_string(), "grammar: the grammar allows no token here");
    }

    /// A grammar over the tiny models' 64-token vocabulary: at step k only tokens ≡ k (mod 3), every fifth step
    /// free, `len` tokens in all.
    pub(crate) fn modular(len: usize) -> Script {
        let allowed = (0..len).map(|k| (k % 5 != 4).then(|| (0..64u32).filter(|t| t % 3 == k as u32 % 3).collect()));
        Script { allowed: allowed.collect(), committed: vec![] }
    }

    fn forced_clone(s: &Script) -> Script {
        Script { allowed: s.allowed.clone(), committed: s.committed.clone() }
    }

    /// Constrained dense greedy decoding after the tests' prompt until the grammar ends.
    pub(crate) fn dense_constrained(model: &model::Model, mut c: Script) -> Vec<u32> {
        let mut dense = crate::DenseDecoder::new(model, 128, 2);
        let mut scratch = Vec::new();
        let mut out = Vec::new();
        let mut ids = crate::test_util::PROMPT.to_vec();
        while !c.is_finished() {
            let argmax = dense.feed_greedy(&ids).unwrap();
            let full = |o: &mut Vec<f32>| *o = dense.last_logits().to_vec();
            let t = constrained_argmax(argmax, &mut c, full, &mut scratch).unwrap();
            c.commit(t).unwrap();
            out.push(t);
            ids = vec![t];
        }
        out
    }

    #[test]
    fn constrained_tree_decoding_commits_exactly_what_constrained_dense_does_and_stops_at_the_grammars_end() {
        use crate::speculative::{OracleProposer, SpeculativeDecoder};
        use crate::SamplingParams;
        let model = model::testing::tiny_model("llama", None, 11, 64);
        let len = 30;
        let want = dense_constrained(&model, modular(len));
        assert_eq!(want.len(), len);
        let free = crate::test_util::dense_greedy(&model, len);
        assert_ne!(want, free, "the grammar must change the output for this test to mean anything");
        // Drafts of the constrained answer (all accepted), and of the unconstrained one (forbidden ones dropped).
        for (reference, name) in [(&want, "constrained"), (&free, "unconstrained")] {
            let full: Vec<u32> = crate::test_util::PROMPT.iter().chain(reference.iter()).copied().collect();
            let proposer = OracleProposer::new(full, 3, 2, 64);
            let mut dec = SpeculativeDecoder::new(&model, 128, 2, proposer, SamplingParams::greedy());
            dec.feed(&crate::test_util::PROMPT).unwrap();
            let mut c = modular(len);
            let mut got = Vec::new();
            while !c.is_finished() {
                got.extend_from_slice(dec.step_constrained(usize::MAX, &mut c).unwrap());
            }
            assert_eq!(got, want, "drafts of the {name} answer");
            assert_eq!(c.committed, want);
            if name == "constrained" {
                assert!(dec.stats().acceptance_length() > 2.5, "τ {}", dec.stats().acceptance_length());
            }
        }
        // Forced tokens are drafted: where the grammar allows one token per step for 6 steps, a decoder without
        // any proposer still commits them in one forward (and exactly what dense commits).
        let mut forced = modular(len);
        for k in 3..9 {
            forced.allowed[k] = Some(vec![(k as u32 * 7) % 64]);
        }
        let want = dense_constrained(&model, Script { committed: vec![], ..forced_clone(&forced) });
        let proposer = OracleProposer::new(vec![], 3, 0, 64);
        let mut dec = SpeculativeDecoder::new(&model, 128, 2, proposer, SamplingParams::greedy());
        dec.feed(&crate::test_util::PROMPT).unwrap();
        let mut got = Vec::new();
        while !forced.is_finished() {
            let step = dec.step_constrained(usize::MAX, &mut forced).unwrap();
            if got.len() == 3 {
                assert_eq!(step.len(), 7, "the six forced tokens and the bonus after them in one step");
            }
            got.extend_from_slice(step);
        }
        assert_eq!(got, want);
        // Sampling settings are refused, not silently treated as greedy.
        let proposer = OracleProposer::new(vec![], 3, 0, 64);
        let mut dec = SpeculativeDecoder::new(
            &model,
            128,
            2,
            proposer,
            SamplingParams { temperature: 0.8, ..SamplingParams::greedy() },
        );
        dec.feed(&crate::test_util::PROMPT).unwrap();
        assert!(matches!(
            dec.step_constrained(4, &mut modular(4)),
            Err(crate::speculative::SpeculativeError::ConstrainedSampling)
        ));
    }
}
