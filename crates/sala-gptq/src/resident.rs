//! The solve stage's seam for Hessians that stay where the statistics accumulated them: on
//! the device of the pipeline's backend. A [`ResidentSolver`] takes the statistics' own
//! tensor, so that only the weights, the codes and a few figures cross the bus (on CUDA:
//! `sala-kernels`' `DeviceSolver::solve_gptq_resident`). Without one, a device Hessian is
//! downloaded and solved by the pipeline's `LinearSolver` as a host Hessian.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use sala_formats::{BlockScales, Nvfp4Matrix};
use sala_hessian::{
    GptqConfig, HessianError, IntGrid, Nvfp4Gptq, Nvfp4GptqResult, QuantizedLinear, UnfinishedGptq,
};

/// A device Hessian handed to a [`ResidentSolver`]'s GPTQ solve, and whether the caller's
/// next GPTQ solve reads it too.
pub struct ResidentHessian<'a, B: Backend> {
    /// `[inp, inp]` f32 on the device, normalized and smoothed (its lower triangle is the one
    /// factored).
    pub tensor: &'a Tensor<B, 2>,
    /// The next GPTQ solve (integer or NVFP4) reads this Hessian too (another linear of the
    /// same input, such as q/k/v or gate/up): a solver may keep what it computed of the
    /// Hessian alone (GPTQ's damped factor, `inp²` f32 of device memory) for that solve,
    /// which frees it.
    pub read_next: bool,
}

impl<B: Backend> Clone for ResidentHessian<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for ResidentHessian<'_, B> {}

/// GPTQ on a Hessian in the device memory of backend `B`.
pub trait ResidentSolver<B: Backend> {
    /// A short name for reports (`cuda`, …).
    fn name(&self) -> &str;

    /// GPTQ of `weights` `[out, inp]` (row-major f32, host) with the device Hessian `h`:
    /// what `LinearSolver::solve_gptq` returns for the same Hessian on the host, up to f32
    /// summation orders. `h` is left as it is. The device's work is done when it returns;
    /// the host's finishing may be left to the caller ([`UnfinishedGptq::finish`]), who can
    /// run it beside the next linear's solve.
    fn solve_gptq(
        &self,
        config: &GptqConfig,
        weights: &[f32],
        out: usize,
        inp: usize,
        h: ResidentHessian<'_, B>,
    ) -> Result<UnfinishedGptq, HessianError>;

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

    /// [`solve_gptq`](Self::solve_gptq), and the proxy output error of round-to-nearest on
    /// `baseline` under the same Hessian (the report's baseline), with the seconds the
    /// baseline took: a solver that uploads the weights once for both overrides it. Default:
    /// the two calls.
    fn solve_gptq_with_baseline(
        &self,
        config: &GptqConfig,
        baseline: IntGrid,
        weights: &[f32],
        out: usize,
        inp: usize,
        h: ResidentHessian<'_, B>,
    ) -> Result<WithBaseline, HessianError> {
        let quantized = self.solve_gptq(config, weights, out, inp, h)?;
        let start = std::time::Instant::now();
        let baseline_proxy_error = self
            .quantize_rtn(baseline, weights, out, inp, h.tensor)?
            .proxy_error;
        Ok(WithBaseline {
            quantized,
            baseline_proxy_error,
            baseline_seconds: start.elapsed().as_secs_f64(),
        })
    }

    /// GPTQ on the NVFP4 grid of `weights` `[rows, cols]` (row-major f32, host) with the
    /// device Hessian `h` and the global scale `global_scale`: what
    /// `LinearSolver::solve_nvfp4_gptq` returns for the same Hessian on the host, up to f32
    /// summation orders, its proxy error included. `h` is left as it is.
    fn solve_nvfp4_gptq(
        &self,
        solver: &Nvfp4Gptq,
        weights: &[f32],
        rows: usize,
        cols: usize,
        h: ResidentHessian<'_, B>,
        global_scale: f32,
    ) -> Result<Nvfp4GptqResult, HessianError>;

    /// [`solve_nvfp4_gptq`](Self::solve_nvfp4_gptq), and the proxy output error of max
    /// calibration under the same Hessian (the report's baseline), with the seconds the
    /// baseline took: a solver that uploads the weights once for both overrides it. Default:
    /// max calibration on the host, its error through [`proxy_error`](Self::proxy_error).
    fn solve_nvfp4_gptq_with_baseline(
        &self,
        solver: &Nvfp4Gptq,
        weights: &[f32],
        rows: usize,
        cols: usize,
        h: ResidentHessian<'_, B>,
        global_scale: f32,
    ) -> Result<Nvfp4WithBaseline, HessianError> {
        let quantized = self.solve_nvfp4_gptq(solver, weights, rows, cols, h, global_scale)?;
        let start = std::time::Instant::now();
        let max = Nvfp4Matrix::quantize(weights, rows, cols, global_scale, BlockScales::Max)?;
        let baseline_proxy_error = self.proxy_error(weights, &max.dequantize(), h.tensor)?;
        Ok(Nvfp4WithBaseline {
            quantized,
            baseline_proxy_error,
            baseline_seconds: start.elapsed().as_secs_f64(),
        })
    }

    /// `tr(D·H·Dᵀ)`, `D = W − Q`, of `weights` and `dequantized` (row-major `[rows, cols]`,
    /// host) under the device Hessian `h` `[cols, cols]`: the report's baselines.
    fn proxy_error(
        &self,
        weights: &[f32],
        dequantized: &[f32],
        h: &Tensor<B, 2>,
    ) -> Result<f64, HessianError>;

    /// Seconds per named step since the last call, as [`sala_hessian::LinearSolver`]'s
    /// `take_step_seconds`; none by default.
    fn take_step_seconds(&self) -> Vec<(&'static str, f64)> {
        Vec::new()
    }
}

/// GPTQ's result with the report's round-to-nearest baseline
/// ([`ResidentSolver::solve_gptq_with_baseline`]).
#[derive(Debug)]
pub struct WithBaseline {
    /// The GPTQ result, its host finishing possibly still to do.
    pub quantized: UnfinishedGptq,
    /// The baseline's proxy output error `tr(D·H·Dᵀ)`.
    pub baseline_proxy_error: Option<f64>,
    /// Wall seconds spent on the baseline (part of the call's).
    pub baseline_seconds: f64,
}

/// GPTQ on the NVFP4 grid with the report's max-calibration baseline
/// ([`ResidentSolver::solve_nvfp4_gptq_with_baseline`]).
#[derive(Debug)]
pub struct Nvfp4WithBaseline {
    /// The GPTQ result.
    pub quantized: Nvfp4GptqResult,
    /// The baseline's proxy output error `tr(D·H·Dᵀ)`.
    pub baseline_proxy_error: f64,
    /// Wall seconds spent on the baseline (part of the call's).
    pub baseline_seconds: f64,
}
