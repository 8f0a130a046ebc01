//! # sala-hessian
//!
//! The calibration mathematics of both SALA recipes, on the CPU (faer + rayon):
//!
//! - [`hessian`]: `H = Σ XᵀX` streamed from activation batches (per-sample or per-token
//!   normalization, mergeable partials) and the per-channel statistics `E[x²]`, `E[|x|]`,
//!   `max|x|` (sala-smooth's `ChannelStats`, adapted to this crate's errors and batch types);
//! - [`inverse`]: the damped Cholesky inverse with retries, as the upper factor GPTQ needs;
//! - [`gptq`]: the GPTQ solver (lazy blocks, groups, act-order, static groups);
//! - [`rtn`]: round-to-nearest with the same outputs (baseline and fallback);
//! - [`block_search`]: the NVFP4 E4M3 block-scale search weighted by the diagonal Hessian;
//! - [`nvfp4_gptq`]: GPTQ on the NVFP4 grid (block scales searched as the loop reaches them);
//! - [`solver`]: the seam a pipeline solves through ([`LinearSolver`]; [`CpuSolver`] runs
//!   the solvers above, a GPU implementation plugs in);
//! - [`layout`]: square matrices between row-major buffers and faer, tiled and parallel;
//! - [`reference`](mod@reference): textbook versions that the optimised paths (and GPU kernels) are tested
//!   against.
//!
//! Weights are row-major `[out_features, in_features]` f32 slices with explicit shapes;
//! Hessians are `[in, in]` in f32 or f64 ([`HessianScalar`]). Every bad input is a
//! [`HessianError`].

pub mod block_search;
mod error;
pub mod gptq;
pub mod hessian;
pub mod inverse;
pub mod layout;
pub mod nvfp4_gptq;
mod quantized;
pub mod reference;
pub mod rtn;
mod scalar;
pub mod solver;

pub use block_search::{
    diagonal_error, max_calibration_diagonal_error, Nvfp4BlockSearch, Nvfp4SearchResult,
};
pub use error::HessianError;
/// The faer version this crate's matrices ([`Hessian::as_mat`], [`CholeskyInverse::upper`])
/// come from.
pub use faer;
pub use gptq::{
    BlockedLoop, ColumnProblem, ColumnSolution, DampingAttempt, FailurePolicy, Gptq,
    GptqColumnLoop, GptqConfig, GptqPreparation, UnfinishedGptq,
};
pub use hessian::{
    ChannelStats, ChannelStatsAccumulator, Hessian, HessianAccumulator, Normalization,
};
pub use inverse::{CholeskyInverse, Damping, FaerFactorizer, UpperFactorizer};
pub use nvfp4_gptq::{Nvfp4ColumnLoop, Nvfp4Columns, Nvfp4Gptq, Nvfp4GptqResult, Nvfp4Preparation};
pub use quantized::{proxy_error, IntGrid, Method, QuantizedLinear};
pub use rtn::Rtn;
pub use sala_formats::{ClipSearch, IntScheme, QuantParams};
pub use scalar::{Activation, HessianScalar};
pub use solver::{CpuSolver, LinearSolver, Nvfp4SearchErrors, StepSeconds};
