//! # sala-eval
//!
//! What quantization costs a MiniCPM-SALA model, measured against the original:
//!
//! - [`metrics`]: per-token log-softmax statistics — perplexity, KL(original ‖ quantized),
//!   top-1 agreement — accumulated into [`Metrics`];
//! - [`sequences`]: held-out token streams cut into sequences of growing length (buckets);
//! - [`model`]: a checkpoint directory (original or quantized, either format) loaded once and
//!   run through `sala-model`'s [`LayerRunner`](sala_gptq::model::LayerRunner);
//! - [`compare`]: both models on every sequence, per length bucket ([`EvalReport`]);
//! - [`drift`]: the long-context drift test: the error of each lightning layer's GLA state and
//!   output as the input grows, with the growth exponent `p` of `error ∝ N^p`.

pub mod compare;
pub mod drift;
mod error;
pub mod metrics;
pub mod model;
pub mod sequences;

pub use compare::{evaluate, BucketReport, EvalReport};
pub use drift::{drift, DriftInput, DriftOptions, DriftPoint, LayerDrift};
pub use error::EvalError;
pub use metrics::{Metrics, MetricsAccumulator};
pub use model::LoadedModel;
pub use sequences::{split_sequences, Sequence};
