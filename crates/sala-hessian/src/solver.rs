//! The solve stage's seam: a quantization pipeline (`sala-gptq`'s) hands each quantized
//! linear's host weights and host statistics to a [`LinearSolver`]. [`CpuSolver`] (the
//! default) runs this crate's solvers (faer + rayon); `sala-kernels`' `DeviceSolver` runs the
//! column loop and the block search on a GPU and is tested against [`CpuSolver`].
//!
//! Everything crosses the seam on the host, in the layouts `sala-hessian` documents:
//! weights row-major `[out, inp]` f32, Hessians `[inp, inp]` f64, the NVFP4 diagonal `[inp]`
//! f32. Packing, smoothing, global scales and reports stay in the pipeline.

use crate::{
    Gptq, GptqConfig, Hessian, HessianError, IntGrid, Nvfp4BlockSearch, Nvfp4Gptq, Nvfp4GptqResult,
    Nvfp4SearchResult, QuantizedLinear, Rtn,
};

/// Quantizes one linear from its host weights and statistics.
pub trait LinearSolver {
    /// A short name for reports and progress (`cpu`, `cuda`, …).
    fn name(&self) -> &str;

    /// GPTQ of `weights` `[out, inp]` (row-major f32) with the smoothed Hessian `h`
    /// `[inp, inp]` under `config` (grid, block size, act-order, damping, failure policy,
    /// proxy error): what [`Gptq::solve`] returns — codes, group parameters, `g_idx`, the
    /// dequantized weight, the loss, the proxy output error and the damping retries.
    fn solve_gptq(
        &self,
        config: &GptqConfig,
        weights: &[f32],
        out: usize,
        inp: usize,
        h: &Hessian<f64>,
    ) -> Result<QuantizedLinear, HessianError>;

    /// Round-to-nearest on `grid` (the `--rtn` path and the baseline the report compares
    /// against), with its proxy output error under `h`. Default: [`Rtn`] on the host.
    fn quantize_rtn(
        &self,
        grid: IntGrid,
        weights: &[f32],
        out: usize,
        inp: usize,
        h: &Hessian<f64>,
    ) -> Result<QuantizedLinear, HessianError> {
        Rtn::new(grid)?.quantize(weights, out, inp, Some(h))
    }

    /// The NVFP4 block-scale search of `weights` `[rows, cols]` weighted by the diagonal
    /// Hessian `diag_h` `[cols]` (`E[x²]`, smoothed) with the tensor's (or fused group's)
    /// `global_scale`: what [`Nvfp4BlockSearch::search`] returns.
    fn search_nvfp4(
        &self,
        search: &Nvfp4BlockSearch,
        weights: &[f32],
        rows: usize,
        cols: usize,
        diag_h: &[f32],
        global_scale: f32,
    ) -> Result<Nvfp4SearchResult, HessianError>;

    /// GPTQ on the NVFP4 grid of `weights` `[rows, cols]` with the smoothed Hessian `h`
    /// `[cols, cols]` and the tensor's (or fused group's) `global_scale`: what
    /// [`Nvfp4Gptq::solve`] returns. Default: the host's loop (no device implements it yet).
    fn solve_nvfp4_gptq(
        &self,
        solver: &Nvfp4Gptq,
        weights: &[f32],
        rows: usize,
        cols: usize,
        h: &Hessian<f64>,
        global_scale: f32,
    ) -> Result<Nvfp4GptqResult, HessianError> {
        solver.solve(weights, rows, cols, h, global_scale)
    }
}

/// The host solvers of `sala-hessian` (faer + rayon): the reference and the default.
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuSolver;

impl LinearSolver for CpuSolver {
    fn name(&self) -> &str {
        "cpu"
    }

    fn solve_gptq(
        &self,
        config: &GptqConfig,
        weights: &[f32],
        out: usize,
        inp: usize,
        h: &Hessian<f64>,
    ) -> Result<QuantizedLinear, HessianError> {
        Gptq::new(*config)?.solve(weights, out, inp, h)
    }

    fn search_nvfp4(
        &self,
        search: &Nvfp4BlockSearch,
        weights: &[f32],
        rows: usize,
        cols: usize,
        diag_h: &[f32],
        global_scale: f32,
    ) -> Result<Nvfp4SearchResult, HessianError> {
        search.search(weights, rows, cols, diag_h, global_scale)
    }
}
