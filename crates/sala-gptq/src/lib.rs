//! # sala-gptq
//!
//! The facade of the sala-quant workspace: it composes the format, solver, model, smoothing,
//! calibration and export crates into the two production recipes for MiniCPM-SALA (and Llama).
//!
//! - [`plan`]: which linear gets which treatment, checked against the serving loaders' rules
//!   before any compute ([`QuantPlan`]);
//! - [`options`]: everything a run is told ([`QuantizeOptions`]), with the original defaults;
//! - [`pipeline`]: the layer-by-layer data path ([`Pipeline`]): capture, smooth, solve, write,
//!   propagate; then verify;
//! - [`smoothing`]: SmoothQuant groups from the model's wiring, folded exactly;
//! - [`evaluate`]: running an exported checkpoint (either format) for comparisons;
//! - [`report`]: what happened, per linear and per layer ([`Report`]);
//! - [`progress`]: callbacks for progress bars.
//!
//! Users depend on this crate alone: the crates it composes are re-exported below.

mod error;
pub mod evaluate;
mod hidden;
pub mod options;
pub mod pipeline;
pub mod plan;
pub mod progress;
pub mod report;
pub mod smoothing;

pub use error::{PipelineError, PlanError};
pub use hidden::HiddenStates;
pub use options::{GptqOptions, QuantizeOptions};
pub use pipeline::{Pipeline, Sample};
pub use plan::{
    LayerBits, Nvfp4Coverage, PlanOptions, PlannedLinear, QuantPlan, Recipe, Treatment,
};
pub use progress::{NoProgress, Progress, Stage};
pub use report::{LayerReport, LinearReport, Report};

pub use sala_calib as calib;
pub use sala_export as export;
pub use sala_formats as formats;
pub use sala_hessian as hessian;
pub use sala_model as model;
pub use sala_smooth as smooth;
/// The CPU backend used by default (Burn's ndarray backend, f32).
pub type CpuBackend = burn_ndarray::NdArray<f32>;
