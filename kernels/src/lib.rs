//! # sala-kernels
//!
//! CubeCL kernels of the calibration mathematics, generic over the runtime (wgpu in tests and
//! CI, CUDA in production), each with the contract of its CPU reference in `sala-hessian`:
//!
//! - [`device`]: f32 matrix windows in device memory ([`MatrixView`]) and flat vectors;
//! - [`gemm`]: the [`Gemm`] trait (`C ← β·C + α·op(A)·op(B)`) and its portable
//!   implementation [`CubeGemm`] (cubek-matmul);
//! - [`gates`]: fused elementwise gates ([`gates::swiglu`], [`gates::sigmoid_gate`]), norms
//!   ([`gates::rms_norm`], the per-head [`gates::rms_norm_rope`], the gated
//!   [`gates::rms_norm_gate`]) and the scaled residual, with the bf16 rounding points of the
//!   unfused chain;
//! - [`channel_stats`]: weighted sums of squares and of absolute values and the maxima of
//!   absolute values per column of an input, in one pass ([`channel_stats::channel_sums`]);
//! - [`hessian`]: `H ← H + w·XᵀX` ([`accumulate_xtx`]), and how a symmetric product splits
//!   into block GEMMs ([`xtx_lower_blocks`]);
//! - [`hessian_ops`]: what GPTQ reads of a Hessian that stays on the device (diagonal,
//!   finiteness, the damped permuted copy, the proxy error's row dots);
//! - [`gptq`]: the GPTQ lazy-block solve ([`gptq_solve`]);
//! - [`block_search`]: the NVFP4 block-scale search ([`nvfp4_block_search`]);
//! - [`nvfp4_gptq`]: GPTQ's column loop on the NVFP4 grid, each block's scale searched when
//!   the loop reaches it ([`nvfp4_gptq_solve`]);
//! - [`weight_error`]: a weight uploaded once in GPTQ's loop order ([`gather_columns`]) and
//!   the weight error `W − Q` of GPTQ, of round-to-nearest and of NVFP4 codes where `W` is
//!   ([`gptq_weight_error`], [`rtn_weight_error`], [`nvfp4_weight_error`]), for the proxy
//!   error on the device, and NVFP4's diagonal proxy error ([`nvfp4_diagonal_error`]);
//! - [`solver`]: [`DeviceSolver`], the pipeline's `LinearSolver` seam on the device, and GPTQ
//!   on a device Hessian ([`DeviceSolver::solve_gptq_resident`], [`DeviceFactorizer`]);
//! - [`flip`]: `P·M·P`, `P` the reversal ([`flip::reversed`]), for the cuSOLVER
//!   route to GPTQ's factor;
//! - [`attention`]: causal grouped-query flash attention over packed variable-length
//!   sequences ([`causal_gqa_attention`]);
//! - [`flash_attention`]: the same attention on the tensor cores (manual bf16 `mma`, CUDA),
//!   where the runtime offers them ([`flash_attention_bf16`]);
//! - [`gla`]: chunked Simple GLA (one constant decay per head) over packed sequences on the
//!   tensor cores, in f32 precision ([`simple_gla_bf16`]);
//! - [`softmax`]: the causally masked row softmax of blocked (cuBLAS) attention
//!   ([`causal_softmax_rows`]);
//! - `cuda` (feature `cuda`): NVIDIA's libraries on CubeCL's buffers (cuBLAS GEMMs, the
//!   linears of several weights that read one input queued together, and Hessians; the
//!   cuSOLVER inverse; the driver's staged copies), `HopperAttention`, the attention on
//!   Hopper's warpgroup instructions and tensor memory accelerator (optionally with a sigmoid
//!   output gate in its epilogue), and `MmaGla`, the Simple GLA on `mma.sync` with its fragments in registers
//!   (both CUDA C++ compiled by NVRTC);
//! - [`error`]: the one error type, [`KernelError`].

pub mod attention;
pub mod block_search;
pub mod channel_stats;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod error;
pub mod flash_attention;
pub mod flip;
pub mod gates;
pub mod gemm;
pub mod gla;
pub mod gptq;
pub mod hessian;
pub mod hessian_ops;
mod launch;
pub mod nvfp4_gptq;
pub mod softmax;
pub mod solver;
pub mod weight_error;

pub use attention::{attention_tiling, causal_gqa_attention, AttentionShape, AttentionTiling};
pub use block_search::{nvfp4_block_search, DeviceBlockSearch};
pub use device::{DeviceVec, Element, MatrixView};
pub use error::KernelError;
pub use flash_attention::{flash_attention_bf16, flash_attention_supported, FlashTiling};
pub use gemm::{CubeGemm, Gemm};
pub use gla::{simple_gla_bf16, simple_gla_supported, GlaShape, GlaTiling};
pub use gptq::{gptq_solve, DeviceGptqConfig, DeviceGptqResult};
pub use hessian::{accumulate_xtx, xtx_lower_blocks, XtxBlocking, XtxBlocks};
pub use nvfp4_gptq::{nvfp4_gptq_solve, DeviceNvfp4Gptq};
pub use softmax::{causal_softmax_rows, SoftmaxShape};
pub use solver::{DeviceFactorizer, DeviceSolver, ResidentHessian, RtnBaseline, Transfer};
pub use weight_error::{
    gather_columns, gptq_weight_error, nvfp4_diagonal_error, nvfp4_weight_error, rtn_weight_error,
};

/// A fingerprint of this crate's kernel sources (16 hex digits, computed at build time): key
/// an on-disk cache of compiled kernels by it. CubeCL's own PTX cache keys a kernel by its
/// name and compile-time arguments, not its body, so a cache shared across builds would run
/// the old code of a kernel that changed.
pub const KERNELS_SOURCE_FINGERPRINT: &str = env!("SALA_KERNELS_SOURCE_FINGERPRINT");

/// The CubeCL version these kernels are written against (pinned `=0.10.0`).
pub use cubecl;
