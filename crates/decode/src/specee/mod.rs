//! # SpecEE: speculative early exit (../shared/DESIGN.md §4)
//!
//! A draft head proposes a few likely next tokens; after chosen layers, a tiny per-layer MLP reads 12 numbers
//! computed from just those candidates' logits and decides whether the answer is already settled; if so the
//! remaining layers are skipped.
//!
//! - [`predictor`]: the features, the per-layer MLPs and their file (`specee-exit-1`).
//! - [`schedule`]: which layers evaluate their predictor (offline set + layers near recent exits).
//! - [`SpecEeDecoder`]: the decoding loop, its KV policies for skipped layers ([`KvPolicy`]) and exit
//!   verification variants ([`Verify`]).
//! - [`MergedDecoder`]: the same exits inside EAGLE tree verification (`--mode specee-eagle`, merged mapping).
//!
//! Reference: Xu et al., "SpecEE: Accelerating Large Language Model Inference with Speculative Early Exiting"
//! (ISCA 2025, arXiv:2504.08850).

mod decoder;
mod merged;
pub mod predictor;
pub mod schedule;

pub use decoder::{KvPolicy, SpecEeConfig, SpecEeDecoder, SpecEeStats, Step, Verify};
pub use merged::{MergedDecoder, MergedStats};
pub use predictor::{
    ExitPredictors, Mlp, PredictorError, ScheduleConfig, CANDIDATES, DRAFT_FEATURES, FEATURE_COUNTS, MAX_FEATURES,
    N_FEATURES, UPDATE_FEATURES,
};
pub use schedule::Scheduler;
