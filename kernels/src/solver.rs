//! [`DeviceSolver`]: `sala-hessian`'s [`LinearSolver`] with GPTQ's column loop
//! ([`gptq_solve`]) and the NVFP4 block search ([`nvfp4_block_search`]) on a CubeCL device.
//!
//! GPTQ's preparation (checks, dead columns, act-order, the damped inverse with its retries,
//! static groups) and finishing (un-permuting, dequantization, proxy error) are the host
//! solver's own ([`Gptq::solve_with_loop`]), so a device result differs from [`CpuSolver`]'s
//! only by f32 summation orders in the loop. Static groups keep the host loop (their
//! parameters come from the original weight; the kernel computes them at group starts).
//!
//! [`CpuSolver`]: sala_hessian::CpuSolver

use cubecl::prelude::*;
use sala_hessian::layout::square_to_row_major;
use sala_hessian::{
    BlockedLoop, ColumnProblem, ColumnSolution, Gptq, GptqColumnLoop, GptqConfig, Hessian,
    HessianError, LinearSolver, Nvfp4BlockSearch, Nvfp4SearchResult, QuantizedLinear,
    UpperFactorizer,
};

use crate::block_search::nvfp4_block_search;
use crate::device::MatrixView;
use crate::error::KernelError;
use crate::gemm::Gemm;
use crate::gptq::{gptq_solve, DeviceGptqConfig, MAX_BLOCK};

/// A [`LinearSolver`] whose column loop and block search run on `client`'s device, with
/// `gemm` for GPTQ's trailing updates.
pub struct DeviceSolver<R: Runtime, G: Gemm<R>> {
    client: ComputeClient<R>,
    gemm: G,
    name: String,
    factorizer: Option<Box<dyn UpperFactorizer>>,
}

impl<R: Runtime, G: Gemm<R>> DeviceSolver<R, G> {
    /// A solver on `client` named `name` in reports (`cuda`, `wgpu`, …).
    pub fn new(client: ComputeClient<R>, gemm: G, name: impl Into<String>) -> Self {
        Self {
            client,
            gemm,
            name: name.into(),
            factorizer: None,
        }
    }

    /// Factors GPTQ's damped Hessians with `factorizer` instead of faer on the host.
    pub fn with_factorizer(mut self, factorizer: Box<dyn UpperFactorizer>) -> Self {
        self.factorizer = Some(factorizer);
        self
    }
}

impl<R: Runtime, G: Gemm<R>> LinearSolver for DeviceSolver<R, G> {
    fn name(&self) -> &str {
        &self.name
    }

    fn solve_gptq(
        &self,
        config: &GptqConfig,
        weights: &[f32],
        out: usize,
        inp: usize,
        h: &Hessian<f64>,
    ) -> Result<QuantizedLinear, HessianError> {
        Gptq::new(*config)?.solve_with_loop(weights, out, inp, h, self)
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
        let run = || -> Result<Nvfp4SearchResult, KernelError> {
            let view = MatrixView::upload(&self.client, weights, rows, cols)?;
            nvfp4_block_search(&self.client, &view, diag_h, global_scale, search)?
                .download(&self.client)
        };
        Ok(run()?)
    }
}

impl<R: Runtime, G: Gemm<R>> GptqColumnLoop for DeviceSolver<R, G> {
    fn run(
        &self,
        problem: &ColumnProblem<'_>,
        w: &mut [f32],
    ) -> Result<ColumnSolution, HessianError> {
        if problem.static_groups.is_some() {
            return BlockedLoop.run(problem, w);
        }
        let (out, inp) = (problem.out, problem.inp);
        let run = || -> Result<ColumnSolution, KernelError> {
            let w_view = MatrixView::upload(&self.client, w, out, inp)?;
            let u_view =
                MatrixView::upload(&self.client, &square_to_row_major(problem.upper), inp, inp)?;
            let config = DeviceGptqConfig {
                bits: problem.quantizer.bits(),
                group_size: Some(problem.group_size),
                scheme: problem.quantizer.scheme(),
                // The lazy block only changes f32 summation orders: clamp to the kernel's.
                block: problem.block_size.min(MAX_BLOCK),
            };
            let host = gptq_solve(&self.client, &self.gemm, &w_view, &u_view, &config)?
                .download(&self.client)?;
            Ok(ColumnSolution {
                codes: host.codes,
                params_rows: host.params,
                column_loss: host.column_loss.iter().map(|&l| l as f64).collect(),
            })
        };
        Ok(run()?)
    }

    fn factorizer(&self) -> Option<&dyn UpperFactorizer> {
        self.factorizer.as_deref()
    }
}

impl From<KernelError> for HessianError {
    /// The solver seam's error: validation errors keep their type, device failures become
    /// [`HessianError::Device`].
    fn from(e: KernelError) -> Self {
        match e {
            KernelError::Hessian(e) => e,
            KernelError::Format(e) => HessianError::Format(e),
            other => HessianError::Device(other.to_string()),
        }
    }
}
