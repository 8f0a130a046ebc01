//! The kernels against their CPU references, on CubeCL's wgpu runtime (lavapipe in CI), or
//! on CUDA when the `cuda` feature is on.
//!
//! One test binary (one link) for every kernel; small matrices so that the whole suite runs
//! in seconds on a software Vulkan driver.

mod attention;
mod block_search;
mod channel_stats;
mod common;
#[cfg(feature = "cuda")]
mod cusolver;
mod flash_attention;
mod flip;
mod gates;
mod gemm;
mod gla;
#[cfg(feature = "cuda")]
mod gla_mma;
mod gptq;
mod hessian;
mod hessian_ops;
#[cfg(feature = "cuda")]
mod hopper_attention;
#[cfg(feature = "cuda")]
mod linears;
mod memory;
#[cfg(feature = "cuda")]
mod ptx_cache;
mod softmax;
mod solver;
#[cfg(feature = "cuda")]
mod stream_ordering;
#[cfg(feature = "cuda")]
mod transfer;
mod weight_error;
