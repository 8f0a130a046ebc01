//! # sala-gptq
//!
//! The facade of the sala-quant workspace: it composes the format, solver, model, smoothing,
//! calibration and export crates into the two production recipes for MiniCPM-SALA (and Llama).
//!
//! - [`plan`]: which linear gets which treatment, checked against the serving loaders' rules
//!   before any compute ([`QuantPlan`]);
//! - [`options`]: everything a run is told ([`QuantizeOptions`]), with the original defaults;
//! - [`pipeline`]: a whole run into a checkpoint ([`Pipeline`]), then verify;
//! - [`budget`]: the device-memory budget planned before any compute: pack sizes, where the
//!   hidden states live, a refusal naming a sample too long for it ([`MemoryPlan`]);
//! - [`packing`]: which samples run through a layer together ([`pack_samples`]);
//! - [`data_parallel`]: the plan of a calibration spread over several GPUs (samples and
//!   solve owners balanced per device) and what its reductions compute (no transport yet);
//! - [`engine`]: the layer-by-layer data path ([`LayerEngine`]) shared by the pipeline and the
//!   synthetic benchmark: capture, accumulate, smooth, solve, write, propagate;
//! - [`solver`]: the solve stage's seam ([`LinearSolver`]; [`CpuSolver`] by default, a GPU
//!   solver plugs in with [`Pipeline::with_solver`]);
//! - [`io`]: where weights come from ([`WeightSource`]) and where layers go ([`LayerSink`]);
//! - [`synthetic`]: a full-size model with random weights for throughput and memory
//!   measurements, and the projection of a full run from a few layers;
//! - [`forward_bench`]: one layer's capture and propagate passes timed per case (packs of
//!   short samples, one long sample), fixed and per-token cost apart, and the projection of a
//!   full run's forward passes;
//! - [`smoothing`]: SmoothQuant groups from the model's wiring, folded exactly;
//! - [`evaluate`]: running an exported checkpoint (either format) for comparisons;
//! - [`report`]: what happened, per linear and per layer ([`Report`]);
//! - resumable runs ([`QuantizeOptions::resume`]): each completed layer's state in the staging
//!   directory, a manifest with the run's fingerprint, and the continuation of a stopped run;
//! - [`progress`]: callbacks for progress bars.
//!
//! Users depend on this crate alone: the crates it composes are re-exported below.

mod alpha_search;
pub mod budget;
pub mod data_parallel;
pub mod engine;
mod error;
pub mod evaluate;
pub mod forward_bench;
mod hidden;
pub mod io;
pub mod options;
pub mod packing;
pub mod pipeline;
pub mod plan;
pub mod progress;
pub mod report;
pub mod resident;
mod resume;
pub mod smoothing;
mod stats;
pub mod synthetic;

pub use budget::{BudgetError, LayerFootprint, MemoryPlan, Statistics};
pub use engine::{EngineTotals, LayerEngine, MemoryProbe, Sample};
pub use error::{PipelineError, PlanError};
pub use hidden::{HiddenBudget, HiddenLocation, HiddenStates};
pub use io::{CheckpointSink, CheckpointSource, Discard, LayerSink, SolvedLinear, WeightSource};
pub use options::{
    GptqOptions, Nvfp4Solver, QuantizeOptions, Smoothing, DEFAULT_DAMP_PERCENT, DEFAULT_MLP_ROWS,
    DEFAULT_PACK_TOKENS,
};
pub use packing::pack_samples;
pub use pipeline::{Pipeline, StagedRun};
pub use plan::{
    GptqLoader, LayerBits, LoaderTarget, LoaderVerdict, Nvfp4Coverage, PlanOptions, PlannedLinear,
    QuantPlan, Recipe, Treatment,
};
pub use progress::{NoProgress, Progress, Stage};
pub use report::{
    ErrorHessian, LayerOps, LayerReport, LinearReport, Report, ReportSummary, ReportTable,
    StageSeconds, StageTotals,
};
pub use resident::{Nvfp4WithBaseline, ResidentHessian, ResidentSolver, WithBaseline};
pub use resume::file_hash;
/// The solve stage's seam (from `sala-hessian`).
pub use sala_hessian::solver::{self, CpuSolver, LinearSolver};
pub use synthetic::{Projection, SyntheticModel, SyntheticReport, SyntheticRun};

pub use sala_calib as calib;
pub use sala_export as export;
pub use sala_formats as formats;
pub use sala_hessian as hessian;
pub use sala_model as model;
pub use sala_smooth as smooth;
/// The CPU backend used by default (Burn's ndarray backend, f32).
pub type CpuBackend = burn_ndarray::NdArray<f32>;

/// The GPU backend (feature `cuda`): burn-cuda with bf16 storage; run it with
/// [`model::Numerics::Bf16Storage`], and give the pipeline [`model::cuda_memory`] as its
/// memory probe.
#[cfg(feature = "cuda")]
pub use sala_model::{
    configure_cuda_runtime, cuda_memory, kernel_cache_dir, CudaBackend, CudaDevice,
};
