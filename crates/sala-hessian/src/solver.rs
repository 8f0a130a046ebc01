//! The solve stage's seam: a quantization pipeline (`sala-gptq`'s) hands each quantized
//! linear's host weights and host statistics to a [`LinearSolver`]. [`CpuSolver`] (the
//! default) runs this crate's solvers (faer + rayon); `sala-kernels`' `DeviceSolver` runs the
//! column loop and the block search on a GPU and is tested against [`CpuSolver`].
//!
//! Everything crosses the seam on the host, in the layouts `sala-hessian` documents:
//! weights row-major `[out, inp]` f32, Hessians `[inp, inp]` f64, the NVFP4 diagonal `[inp]`
//! f32. Packing, smoothing, global scales and reports stay in the pipeline.

use std::sync::Mutex;
use std::time::Instant;

use crate::block_search::{diagonal_error, max_calibration_diagonal_error};
use crate::{
    Gptq, GptqConfig, Hessian, HessianError, IntGrid, Nvfp4BlockSearch, Nvfp4Gptq, Nvfp4GptqResult,
    Nvfp4SearchResult, QuantizedLinear, Rtn,
};

/// The diagonal proxy output errors beside an NVFP4 block search
/// ([`LinearSolver::search_nvfp4_with_errors`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Nvfp4SearchErrors {
    /// `Σ_r Σ_j d_j (w − q)²` of the search's result.
    pub error: f64,
    /// The same of max calibration (the report's baseline), when asked for.
    pub max_calibration: Option<f64>,
}

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

    /// [`search_nvfp4`](Self::search_nvfp4) with the diagonal proxy errors
    /// ([`diagonal_error`] under `diag_h`) of its result and, with `baseline`, of max
    /// calibration (the report's figures). Default: both on the host, max calibration's on a
    /// thread of its own beside the search. A device solver computes them where the weights
    /// already are.
    #[allow(clippy::too_many_arguments)]
    fn search_nvfp4_with_errors(
        &self,
        search: &Nvfp4BlockSearch,
        baseline: bool,
        weights: &[f32],
        rows: usize,
        cols: usize,
        diag_h: &[f32],
        global_scale: f32,
    ) -> Result<(Nvfp4SearchResult, Nvfp4SearchErrors), HessianError> {
        std::thread::scope(|scope| {
            let max_calibration = baseline.then(|| {
                scope.spawn(|| max_calibration_diagonal_error(weights, global_scale, diag_h))
            });
            let found = self.search_nvfp4(search, weights, rows, cols, diag_h, global_scale)?;
            let error = diagonal_error(weights, &found.dequantized, diag_h);
            let max_calibration = match max_calibration {
                Some(handle) => Some(
                    handle
                        .join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?,
                ),
                None => None,
            };
            Ok((
                found,
                Nvfp4SearchErrors {
                    error,
                    max_calibration,
                },
            ))
        })
    }

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

    /// Seconds per named step of the work since the last call (uploads, factor, column loop,
    /// downloads, host finishing…), for the report; a solver that does not time its steps
    /// returns none (the default).
    fn take_step_seconds(&self) -> Vec<(&'static str, f64)> {
        Vec::new()
    }
}

/// Wall seconds per named step of a solver's work, summed until taken: what a
/// [`LinearSolver::take_step_seconds`] returns. Steps keep the order of their first use.
#[derive(Debug, Default)]
pub struct StepSeconds {
    totals: Mutex<Vec<(&'static str, f64)>>,
}

impl StepSeconds {
    /// Adds `seconds` to `step`.
    pub fn add(&self, step: &'static str, seconds: f64) {
        // A poisoned lock only means another thread panicked while adding: the figures stay
        // usable.
        let mut totals = self.totals.lock().unwrap_or_else(|e| e.into_inner());
        match totals.iter_mut().find(|(name, _)| *name == step) {
            Some((_, total)) => *total += seconds,
            None => totals.push((step, seconds)),
        }
    }

    /// Runs `f` and adds its wall time to `step`.
    pub fn time<T>(&self, step: &'static str, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let value = f();
        self.add(step, start.elapsed().as_secs_f64());
        value
    }

    /// The seconds of `step` so far (0 when it never ran).
    pub fn total(&self, step: &str) -> f64 {
        let totals = self.totals.lock().unwrap_or_else(|e| e.into_inner());
        totals
            .iter()
            .find(|(name, _)| *name == step)
            .map_or(0.0, |(_, total)| *total)
    }

    /// The totals so far, which start again from zero.
    pub fn take(&self) -> Vec<(&'static str, f64)> {
        std::mem::take(&mut *self.totals.lock().unwrap_or_else(|e| e.into_inner()))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_seconds_sum_per_step_in_first_use_order_and_restart_when_taken() {
        let steps = StepSeconds::default();
        steps.add("factor", 0.5);
        let value = steps.time("column loop", || 7);
        steps.add("factor", 0.25);
        assert_eq!(value, 7);
        assert_eq!(steps.total("factor"), 0.75);
        assert_eq!(steps.total("never"), 0.0);
        let taken = steps.take();
        let names: Vec<&str> = taken.iter().map(|(name, _)| *name).collect();
        assert_eq!(names, ["factor", "column loop"]);
        assert!(taken[1].1 >= 0.0);
        assert!(steps.take().is_empty());
    }
}
