//! The solve stage's seam for Hessians that stay where the statistics accumulated them: on
//! the device of the pipeline's backend. A [`ResidentSolver`] takes the statistics' own
//! tensor, so that only the weights, the codes and a few figures cross the bus (on CUDA:
//! `sala-kernels`' `DeviceSolver::solve_gptq_resident`). Without one, a device Hessian is
//! downloaded and solved by the pipeline's `LinearSolver` as a host Hessian.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use sala_hessian::{GptqConfig, HessianError, IntGrid, QuantizedLinear};

/// GPTQ on a Hessian in the device memory of backend `B`.
pub trait ResidentSolver<B: Backend> {
    /// A short name for reports (`cuda`, …).
    fn name(&self) -> &str;

    /// GPTQ of `weights` `[out, inp]` (row-major f32, host) with the normalized, smoothed
    /// Hessian `h` `[inp, inp]` (f32 on the device; its lower triangle is the one factored):
    /// what `LinearSolver::solve_gptq` returns for the same Hessian on the host, up to f32
    /// summation orders. `h` is left as it is.
    fn solve_gptq(
        &self,
        config: &GptqConfig,
        weights: &[f32],
        out: usize,
        inp: usize,
        h: &Tensor<B, 2>,
    ) -> Result<QuantizedLinear, HessianError>;

    /// Round-to-nearest of `weights` on `grid` (the `--rtn` path and the report's baseline)
    /// with its proxy output error under the device Hessian `h`.
    fn quantize_rtn(
        &self,
        grid: IntGrid,
        weights: &[f32],
        out: usize,
        inp: usize,
        h: &Tensor<B, 2>,
    ) -> Result<QuantizedLinear, HessianError>;

    /// Seconds per named step since the last call, as [`sala_hessian::LinearSolver`]'s
    /// `take_step_seconds`; none by default.
    fn take_step_seconds(&self) -> Vec<(&'static str, f64)> {
        Vec::new()
    }
}
