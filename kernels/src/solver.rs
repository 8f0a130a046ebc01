//! [`DeviceSolver`]: `sala-hessian`'s [`LinearSolver`] with GPTQ's column loop
//! ([`gptq_solve`]), the NVFP4 block search ([`nvfp4_block_search`]) and GPTQ on the NVFP4
//! grid ([`nvfp4_gptq_solve`], with its proxy error) on a CubeCL device, and GPTQ on a Hessian
//! that never leaves the device ([`DeviceSolver::solve_gptq_resident`]).
//!
//! With a host Hessian, GPTQ's preparation (checks, dead columns, act-order, the damped
//! inverse with its retries, static groups) and finishing (un-permuting, dequantization, proxy
//! error) are the host solver's own ([`Gptq::solve_with_loop`]), so a device result differs
//! from [`CpuSolver`]'s only by f32 summation orders in the loop. With a device Hessian the
//! same preparation and finishing run from its downloaded diagonal ([`Gptq::prepare`],
//! [`Gptq::finish`]); the damped permuted copy, its factor, the column loop and the proxy
//! error stay on the device. Static groups keep the host loop (their parameters come from the
//! original weight; the kernel computes them at group starts).
//!
//! [`CpuSolver`]: sala_hessian::CpuSolver

use std::sync::{Arc, Mutex};

use cubecl::prelude::*;
use rayon::prelude::*;
use sala_formats::{ClipSearch, IntQuantizer};
use sala_hessian::faer::Mat;
use sala_hessian::layout::square_to_row_major;
use sala_hessian::IntGrid;
use sala_hessian::{
    BlockedLoop, ColumnProblem, ColumnSolution, DampingAttempt, FaerFactorizer, FailurePolicy,
    Gptq, GptqColumnLoop, GptqConfig, GptqPreparation, Hessian, HessianError, HessianScalar,
    LinearSolver, Nvfp4BlockSearch, Nvfp4ColumnLoop, Nvfp4Columns, Nvfp4Gptq, Nvfp4GptqResult,
    Nvfp4SearchErrors, Nvfp4SearchResult, QuantizedLinear, Rtn, StepSeconds, UnfinishedGptq,
    UpperFactorizer,
};

use crate::block_search::{nvfp4_block_search, DeviceBlockSearch};
use crate::device::{DeviceVec, MatrixView};
use crate::error::KernelError;
use crate::gemm::Gemm;
use crate::gptq::{gptq_solve, DeviceGptqConfig, DeviceGptqResult, MAX_BLOCK};
use crate::hessian_ops::{damped_permuted, diagonal, first_non_finite, row_dots};
use crate::nvfp4_gptq::nvfp4_gptq_solve;
use crate::weight_error::{
    gather_columns, gptq_weight_error, nvfp4_diagonal_error, nvfp4_weight_error, rtn_weight_error,
};

/// GPTQ's damped factor computed where the matrix is: `U`, the upper Cholesky factor of
/// `a⁻¹` (`Uᵀ·U = a⁻¹`, strict lower triangle zero), of the symmetric device matrix `a`.
pub trait DeviceFactorizer<R: Runtime>: Send + Sync {
    /// `Ok(None)` when `a` is not positive definite (the caller retries with more damping);
    /// `Err` for a failure of the factorizer itself. `a` may be overwritten.
    fn upper_factor_on_device(
        &self,
        client: &ComputeClient<R>,
        a: &MatrixView,
    ) -> Result<Option<MatrixView>, KernelError>;
}

/// How host matrices reach the device and codes come back: CubeCL's own copies
/// ([`MatrixView::upload`], [`DeviceVec::download`]) by default, faster ones where the runtime
/// has them (the driver's copies on CUDA).
pub trait Transfer<R: Runtime>: Send + Sync {
    /// A new dense `[rows, cols]` matrix holding the row-major `data`.
    fn upload(
        &self,
        client: &ComputeClient<R>,
        data: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<MatrixView, KernelError>;

    /// The values of `v`, once the work queued on `client` is done.
    fn download_u32(
        &self,
        client: &ComputeClient<R>,
        v: &DeviceVec<u32>,
    ) -> Result<Vec<u32>, KernelError> {
        v.download(client)
    }

    /// The values of `v`, once the work queued on `client` is done.
    fn download_f32(
        &self,
        client: &ComputeClient<R>,
        v: &DeviceVec<f32>,
    ) -> Result<Vec<f32>, KernelError> {
        v.download(client)
    }
}

/// CubeCL's own copies.
pub(crate) struct CubeTransfer;

impl<R: Runtime> Transfer<R> for CubeTransfer {
    fn upload(
        &self,
        client: &ComputeClient<R>,
        data: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<MatrixView, KernelError> {
        MatrixView::upload(client, data, rows, cols)
    }
}

/// A [`DeviceFactorizer`] as an [`UpperFactorizer`] for host Hessians: uploads `a`, downloads
/// `U`.
struct Uploading<R: Runtime> {
    client: ComputeClient<R>,
    inner: Arc<dyn DeviceFactorizer<R>>,
}

impl<R: Runtime> UpperFactorizer for Uploading<R> {
    fn upper_factor(&self, a: &[f32], n: usize) -> Result<Option<Mat<f32>>, HessianError> {
        let a = MatrixView::upload(&self.client, a, n, n)?;
        match self.inner.upper_factor_on_device(&self.client, &a)? {
            Some(u) => Ok(Some(sala_hessian::layout::square_from_row_major(
                &u.download(&self.client)?,
                n,
            )?)),
            None => Ok(None),
        }
    }
}

/// The proxy output error of round-to-nearest beside a GPTQ solve (the report's baseline),
/// from [`DeviceSolver::solve_gptq_resident_with_baseline`], or of max calibration beside
/// GPTQ on the NVFP4 grid ([`DeviceSolver::solve_nvfp4_gptq_resident_with_baseline`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RtnBaseline {
    /// `tr(D·H·Dᵀ)`, `D = W − RTN(W)`.
    pub proxy_error: f64,
    /// Wall seconds it took, the device work included.
    pub seconds: f64,
}

/// A device Hessian for [`DeviceSolver::solve_gptq_resident_unfinished`], and whether the
/// caller's next solve reads it too.
#[derive(Debug, Clone, Copy)]
pub struct ResidentHessian<'a> {
    /// `[inp, inp]` f32 in the solver's device memory, normalized and smoothed.
    pub matrix: &'a MatrixView,
    /// The next GPTQ solve reads this Hessian too (another linear of the same input): the
    /// solver keeps this solve's damped factor (`inp²` f32 of device memory) for it. That
    /// solve uses it if its loop order and damping are the same, and frees it either way.
    pub read_next: bool,
}

impl<'a> From<&'a MatrixView> for ResidentHessian<'a> {
    /// A Hessian read by this solve alone.
    fn from(matrix: &'a MatrixView) -> Self {
        Self {
            matrix,
            read_next: false,
        }
    }
}

/// GPTQ's damped factor kept from one solve for the next solve of the same Hessian
/// ([`ResidentHessian::read_next`]), with what it was computed from.
struct KeptFactor {
    /// `diag(H)` as the solve downloaded it: a Hessian with another diagonal is another one.
    diag: Vec<f64>,
    /// The loop order the factor is permuted to.
    order: Vec<usize>,
    /// The damping schedule it was found with.
    damping: sala_hessian::Damping,
    /// `U`, upper Cholesky factor of the damped, permuted `H⁻¹`.
    upper: MatrixView,
    /// Which damping attempt gave it.
    attempt: DampingAttempt,
}

impl KeptFactor {
    /// Whether this factor is the one a solve of a Hessian with diagonal `diag`, loop order
    /// `order` and schedule `damping` would compute.
    fn serves(&self, diag: &[f64], order: &[usize], damping: &sala_hessian::Damping) -> bool {
        self.diag == diag && self.order == order && self.damping == *damping
    }
}

/// A [`LinearSolver`] whose column loop and block search run on `client`'s device, with
/// `gemm` for GPTQ's trailing updates and the proxy error's product.
pub struct DeviceSolver<R: Runtime, G: Gemm<R>> {
    client: ComputeClient<R>,
    gemm: G,
    /// The proxy errors' GEMM when it is not `gemm` ([`DeviceSolver::with_proxy_gemm`]).
    proxy_gemm: Option<G>,
    name: String,
    factorizer: Option<Box<dyn UpperFactorizer>>,
    device_factorizer: Option<Arc<dyn DeviceFactorizer<R>>>,
    transfer: Arc<dyn Transfer<R>>,
    steps: StepSeconds,
    /// The last resident solve's factor, when its caller said the next solve reads the same
    /// Hessian.
    kept_factor: Mutex<Option<KeptFactor>>,
}

impl<R: Runtime, G: Gemm<R>> DeviceSolver<R, G> {
    /// A solver on `client` named `name` in reports (`cuda`, `wgpu`, …).
    pub fn new(client: ComputeClient<R>, gemm: G, name: impl Into<String>) -> Self {
        Self {
            client,
            gemm,
            proxy_gemm: None,
            name: name.into(),
            factorizer: None,
            device_factorizer: None,
            transfer: Arc::new(CubeTransfer),
            steps: StepSeconds::default(),
            kept_factor: Mutex::new(None),
        }
    }

    /// Seconds per step since the last call (see [`LinearSolver::take_step_seconds`]).
    pub fn take_step_seconds(&self) -> Vec<(&'static str, f64)> {
        self.steps.take()
    }

    /// Runs `f`, waits for the device work it queued and charges both to `step`.
    fn timed<T>(
        &self,
        step: &'static str,
        f: impl FnOnce() -> Result<T, HessianError>,
    ) -> Result<T, HessianError> {
        self.steps.time(step, || {
            let value = f()?;
            cubecl::future::block_on(self.client.sync())
                .map_err(|e| HessianError::Device(format!("device sync after {step}: {e:?}")))?;
            Ok(value)
        })
    }

    /// Computes the proxy output errors `tr(D·H·Dᵀ)` (the report's figures, GPTQ's and the
    /// baselines') with `gemm` instead of the column loop's: a faster, less exact product
    /// (TF32 on CUDA) where the loop's error propagation needs full f32. Nothing the solver
    /// decides reads a proxy error.
    pub fn with_proxy_gemm(mut self, gemm: G) -> Self {
        self.proxy_gemm = Some(gemm);
        self
    }

    /// Moves weights and the proxy error's differences to the device, and codes back, with
    /// `transfer`.
    pub fn with_transfer(mut self, transfer: Arc<dyn Transfer<R>>) -> Self {
        self.transfer = transfer;
        self
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<MatrixView, KernelError> {
        self.transfer.upload(&self.client, data, rows, cols)
    }

    /// Factors GPTQ's damped Hessians with the host-side `factorizer` instead of faer (for
    /// device Hessians too: the damped copy then goes to the host and `U` back).
    pub fn with_factorizer(mut self, factorizer: Box<dyn UpperFactorizer>) -> Self {
        self.factorizer = Some(factorizer);
        self.device_factorizer = None;
        self
    }

    /// Factors GPTQ's damped Hessians on the device with `factorizer` (cuSOLVER on CUDA),
    /// for host Hessians (uploaded) and device Hessians alike.
    pub fn with_device_factorizer(mut self, factorizer: Arc<dyn DeviceFactorizer<R>>) -> Self {
        self.factorizer = Some(Box::new(Uploading {
            client: self.client.clone(),
            inner: factorizer.clone(),
        }));
        self.device_factorizer = Some(factorizer);
        self
    }

    /// GPTQ of `weights` `[out, inp]` (row-major f32, host) against the Hessian `h`
    /// `[inp, inp]` f32 in this solver's device memory (normalized and smoothed; its lower
    /// triangle is read for the factor, the whole matrix for the proxy error). What
    /// [`LinearSolver::solve_gptq`] returns for the same Hessian on the host, up to f32
    /// summation orders; only `diag(H)`, the weights, the codes and a few figures cross the
    /// bus. `h` is left as it is.
    pub fn solve_gptq_resident(
        &self,
        config: &GptqConfig,
        weights: &[f32],
        out: usize,
        inp: usize,
        h: &MatrixView,
    ) -> Result<QuantizedLinear, HessianError> {
        Ok(self
            .solve_gptq_resident_with_baseline(config, None, weights, out, inp, h)?
            .0)
    }

    /// [`solve_gptq_resident`](Self::solve_gptq_resident), and with `baseline` the proxy
    /// output error `tr(D·H·Dᵀ)` of round-to-nearest on that grid (the report's baseline) from
    /// the same upload of the weights: on the device for a grid without a clipping search,
    /// else [`quantize_rtn_resident`](Self::quantize_rtn_resident)'s.
    pub fn solve_gptq_resident_with_baseline(
        &self,
        config: &GptqConfig,
        baseline: Option<IntGrid>,
        weights: &[f32],
        out: usize,
        inp: usize,
        h: &MatrixView,
    ) -> Result<(QuantizedLinear, Option<RtnBaseline>), HessianError> {
        let (unfinished, baseline) =
            self.solve_gptq_resident_unfinished(config, baseline, weights, out, inp, h.into())?;
        let q = self.steps.time("finish (host)", || unfinished.finish())?;
        Ok((q, baseline))
    }

    /// [`solve_gptq_resident_with_baseline`](Self::solve_gptq_resident_with_baseline) up to
    /// the host's finishing, which the caller may run on another thread while this solver
    /// goes on with the next linear: everything on the device is done when it returns.
    ///
    /// Linears that read one Hessian (q/k/v, gate/up) share its damped factor when the
    /// caller says so ([`ResidentHessian::read_next`]): the factor depends on the Hessian,
    /// the loop order and the damping alone, so the shared one is bit for bit the factor
    /// the next solve would compute.
    pub fn solve_gptq_resident_unfinished(
        &self,
        config: &GptqConfig,
        baseline: Option<IntGrid>,
        weights: &[f32],
        out: usize,
        inp: usize,
        h: ResidentHessian<'_>,
    ) -> Result<(UnfinishedGptq, Option<RtnBaseline>), HessianError> {
        // A kept factor serves this solve or none: it is freed here either way.
        let kept = self.take_kept_factor();
        let ResidentHessian {
            matrix: h,
            read_next,
        } = h;
        let gptq = Gptq::new(*config)?;
        let client = &self.client;
        let (diag, prepared) = self.timed("prepare", || {
            let diag = self.checked_diagonal(h, inp)?;
            let prepared = gptq.prepare(weights, out, inp, &diag)?;
            Ok((diag, prepared))
        })?;
        // The original weights stay on the device until the proxy errors are known.
        let w_view = self.timed("upload weights", || Ok(self.upload(weights, out, inp)?))?;
        let baseline = match baseline {
            Some(grid) => {
                let start = std::time::Instant::now();
                let proxy_error = self.baseline_proxy_error(grid, weights, &w_view, h)?;
                let seconds = start.elapsed().as_secs_f64();
                Some(RtnBaseline {
                    proxy_error,
                    seconds,
                })
            }
            None => None,
        };
        if config.static_groups && config.grid.group_size.is_some() {
            // Static groups keep the host loop: the Hessian comes to the host.
            let host = Hessian::<f32>::from_row_major(inp, &h.download(client)?)?;
            let q = gptq.solve_with_loop(weights, out, inp, &host, self)?;
            return Ok((UnfinishedGptq::finished(q), baseline));
        }
        let factor = self.shared_factor(kept, h, &prepared, &config.damping, &diag)?;
        let Some((upper, attempt)) = factor else {
            return match config.on_failure {
                FailurePolicy::Error => Err(config.damping.exhausted(prepared.mean_diag)),
                FailurePolicy::Rtn => {
                    let mut q = gptq.rtn_fallback::<f32>(weights, out, inp, None)?;
                    if config.proxy_error {
                        q.proxy_error = Some(self.timed("proxy error", || {
                            self.proxy_error(h, weights, &q.dequantized, out, inp)
                        })?);
                    }
                    Ok((UnfinishedGptq::finished(q), baseline))
                }
            };
        };
        let w_loop = self.timed("loop weights", || {
            let sources: Vec<Option<usize>> = prepared
                .order
                .iter()
                .map(|&j| (!prepared.dead[j]).then_some(j))
                .collect();
            Ok(gather_columns(client, &w_view, &sources)?)
        })?;
        let loop_config = loop_config(
            gptq.quantizer(),
            prepared.group_size,
            config.block_size,
            config.grid.clip,
        );
        let clip_weights = prepared.clip_weights_in_loop_order();
        let result = self.run_columns(&w_loop, &upper, &loop_config, clip_weights.as_deref())?;
        drop(w_loop);
        if read_next {
            self.keep_factor(KeptFactor {
                order: prepared.order.clone(),
                damping: config.damping,
                upper,
                attempt,
                diag,
            });
        }
        let proxy = match config.proxy_error {
            true => Some(self.timed("proxy error", || {
                let d = gptq_weight_error(client, &w_view, &result, &prepared.order)?;
                self.proxy_error_of(&d, h)
            })?),
            false => None,
        };
        drop(w_view);
        let sol = self.download_columns(result)?;
        Ok((
            gptq.unfinished(out, prepared, sol, attempt, proxy),
            baseline,
        ))
    }

    /// GPTQ on the NVFP4 grid of `weights` `[rows, cols]` (row-major f32, host) against the
    /// device Hessian `h` (`[cols, cols]` f32, normalized and smoothed; its lower triangle is
    /// factored): what [`LinearSolver::solve_nvfp4_gptq`] returns for the same Hessian on the
    /// host, up to f32 summation orders. The damped factor, the column loop and the proxy
    /// error run on the device; only `diag(H)`, the weights, the codes and the scales cross
    /// the bus. A factor is shared between the linears of one Hessian as in
    /// [`solve_gptq_resident_unfinished`](Self::solve_gptq_resident_unfinished).
    pub fn solve_nvfp4_gptq_resident(
        &self,
        solver: &Nvfp4Gptq,
        weights: &[f32],
        rows: usize,
        cols: usize,
        h: ResidentHessian<'_>,
        global_scale: f32,
    ) -> Result<Nvfp4GptqResult, HessianError> {
        let (q, _) = self.solve_nvfp4_gptq_resident_with_baseline(
            solver,
            false,
            weights,
            rows,
            cols,
            h,
            global_scale,
        )?;
        Ok(q)
    }

    /// [`solve_nvfp4_gptq_resident`](Self::solve_nvfp4_gptq_resident), and with `baseline`
    /// the proxy output error of max calibration (every block scale `amax / (6 · global)`,
    /// the report's baseline) under the same Hessian. The weights are uploaded once: the
    /// baseline's codes, both weight errors and both proxy errors are computed on the device.
    #[allow(clippy::too_many_arguments)]
    pub fn solve_nvfp4_gptq_resident_with_baseline(
        &self,
        solver: &Nvfp4Gptq,
        baseline: bool,
        weights: &[f32],
        rows: usize,
        cols: usize,
        h: ResidentHessian<'_>,
        global_scale: f32,
    ) -> Result<(Nvfp4GptqResult, Option<RtnBaseline>), HessianError> {
        let kept = self.take_kept_factor();
        let ResidentHessian {
            matrix: h,
            read_next,
        } = h;
        let (diag, prepared) = self.timed("prepare", || {
            let diag = self.checked_diagonal(h, cols)?;
            let prepared = solver.prepare(weights, rows, cols, &diag, global_scale)?;
            Ok((diag, prepared))
        })?;
        // The original weights stay on the device until the proxy errors are known.
        let w_view = self.timed("upload weights", || Ok(self.upload(weights, rows, cols)?))?;
        let baseline = match baseline {
            true => {
                let start = std::time::Instant::now();
                let proxy_error = self.timed("baseline proxy error", || {
                    self.max_calibration_proxy_error(solver, &w_view, h, global_scale)
                })?;
                Some(RtnBaseline {
                    proxy_error,
                    seconds: start.elapsed().as_secs_f64(),
                })
            }
            false => None,
        };
        let proxy = |q: &[f32]| {
            self.timed("proxy error", || {
                self.proxy_error(h, weights, q, rows, cols)
            })
        };
        let columns = &prepared.columns;
        let Some((upper, attempt)) =
            self.shared_factor(kept, h, columns, &solver.damping, &diag)?
        else {
            let q = match solver.on_failure {
                FailurePolicy::Error => Err(solver.damping.exhausted(columns.mean_diag)),
                FailurePolicy::Rtn => solver.search_fallback(weights, &prepared, proxy),
            }?;
            return Ok((q, baseline));
        };
        let w_loop = self.timed("loop weights", || {
            let sources: Vec<Option<usize>> =
                (0..cols).map(|j| (!columns.dead[j]).then_some(j)).collect();
            Ok(gather_columns(&self.client, &w_view, &sources)?)
        })?;
        let found = self.timed("column loop", || {
            Ok(nvfp4_gptq_solve(
                &self.client,
                &self.gemm,
                &w_loop,
                &upper,
                &prepared.channel_weights,
                global_scale,
                &solver.search,
                solver.lazy_block(cols),
            )?)
        })?;
        drop(w_loop);
        if read_next {
            self.keep_factor(KeptFactor {
                order: columns.order.clone(),
                damping: solver.damping,
                upper,
                attempt,
                diag,
            });
        }
        let proxy_error = self.timed("proxy error", || {
            let d = nvfp4_weight_error(
                &self.client,
                &w_view,
                &found.codes,
                &found.block_scales,
                global_scale,
            )?;
            self.proxy_error_of(&d, h)
        })?;
        drop(w_view);
        let sol = self.timed("download codes", || {
            Ok(found.download_with(&self.client, self.transfer.as_ref())?)
        })?;
        let q = solver.finish(&prepared, sol, attempt.retries, |_| Ok(proxy_error))?;
        Ok((q, baseline))
    }

    /// Max calibration of the device weight `view` (every block scale `amax / (6 · global)`):
    /// `search` with its first candidate alone (queued; its result on the device).
    fn max_calibration_on_device(
        &self,
        view: &MatrixView,
        search: &Nvfp4BlockSearch,
        global_scale: f32,
    ) -> Result<DeviceBlockSearch, HessianError> {
        let max = Nvfp4BlockSearch {
            iters: 1,
            ..*search
        };
        // One candidate: the channel weights cannot change the choice.
        self.search_on_device(view, &max, &vec![0.0; view.cols], global_scale)
    }

    /// The block search of the device weight `view` (queued; its result on the device).
    fn search_on_device(
        &self,
        view: &MatrixView,
        search: &Nvfp4BlockSearch,
        diag_h: &[f32],
        global_scale: f32,
    ) -> Result<DeviceBlockSearch, HessianError> {
        Ok(nvfp4_block_search(
            &self.client,
            view,
            diag_h,
            global_scale,
            search,
        )?)
    }

    /// The proxy output error under `h` of max calibration of the device weight `w` on
    /// `solver`'s grid: the block search with one candidate (`amax / (6 · global)`), its
    /// weight error and `tr(D·H·Dᵀ)`, all on the device.
    fn max_calibration_proxy_error(
        &self,
        solver: &Nvfp4Gptq,
        w: &MatrixView,
        h: &MatrixView,
        global_scale: f32,
    ) -> Result<f64, HessianError> {
        let found = self.max_calibration_on_device(w, &solver.search, global_scale)?;
        let d = nvfp4_weight_error(
            &self.client,
            w,
            &found.codes,
            &found.block_scales,
            global_scale,
        )?;
        self.proxy_error_of(&d, h)
    }

    /// `tr(D·H·Dᵀ)`, `D = W − Q`, of `weights` and `dequantized` (`[rows, cols]`, host) under
    /// the device Hessian `h` `[cols, cols]`: the proxy output error of any quantized weight
    /// (the report's baselines), computed where `h` is.
    pub fn proxy_error_resident(
        &self,
        weights: &[f32],
        dequantized: &[f32],
        h: &MatrixView,
    ) -> Result<f64, HessianError> {
        let cols = h.cols;
        check_weights_against(weights, dequantized, h)?;
        self.timed("proxy error", || {
            self.proxy_error(h, weights, dequantized, weights.len() / cols, cols)
        })
    }

    /// The proxy output error of round-to-nearest on `grid` of the weights `w` (on the device,
    /// `weights` on the host) under `h`: `W − Q` on the device for a plain grid.
    fn baseline_proxy_error(
        &self,
        grid: IntGrid,
        weights: &[f32],
        w: &MatrixView,
        h: &MatrixView,
    ) -> Result<f64, HessianError> {
        if grid.clip.is_some() {
            let q = self.quantize_rtn_resident(grid, weights, w.rows, w.cols, h)?;
            return q
                .proxy_error
                .ok_or_else(|| HessianError::Device("no baseline proxy error".into()));
        }
        Rtn::new(grid)?;
        let quantizer = grid.quantizer()?;
        let group_size = grid.effective_group_size(w.cols)?;
        self.timed("baseline proxy error", || {
            let d = rtn_weight_error(&self.client, w, quantizer, group_size)?;
            self.proxy_error_of(&d, h)
        })
    }

    /// Round-to-nearest of `weights` on `grid` (host) with its proxy output error under the
    /// device Hessian `h` `[inp, inp]` (on the device): [`LinearSolver::quantize_rtn`] for a
    /// Hessian that stays on the device.
    pub fn quantize_rtn_resident(
        &self,
        grid: IntGrid,
        weights: &[f32],
        out: usize,
        inp: usize,
        h: &MatrixView,
    ) -> Result<QuantizedLinear, HessianError> {
        if (h.rows, h.cols) != (inp, inp) {
            return Err(HessianError::DimensionMismatch {
                what: "hessian dimension vs weight columns",
                left: h.rows,
                right: inp,
            });
        }
        // A clipping search weighs columns by diag(H), as on the host.
        let diag = match grid.clip {
            Some(_) => Some(diagonal(&self.client, h)?.download(&self.client)?),
            None => None,
        };
        let mut q = self.steps.time("baseline rtn (host)", || {
            Rtn::new(grid)?.quantize_weighted(weights, out, inp, diag.as_deref())
        })?;
        q.proxy_error = Some(self.timed("baseline proxy error", || {
            self.proxy_error(h, weights, &q.dequantized, out, inp)
        })?);
        Ok(q)
    }

    /// `diag(h)` of the device Hessian `h`, checked to be `[inp, inp]` and finite (the first
    /// non-finite element is reported by position).
    fn checked_diagonal(&self, h: &MatrixView, inp: usize) -> Result<Vec<f64>, HessianError> {
        if (h.rows, h.cols) != (inp, inp) {
            return Err(HessianError::DimensionMismatch {
                what: "hessian dimension vs weight columns",
                left: h.rows,
                right: inp,
            });
        }
        let client = &self.client;
        if let Some((row, col)) = first_non_finite(client, h)? {
            let value = h.window(row, col, 1, 1)?.download(client)?[0];
            return Err(HessianError::NonFinite {
                what: "hessian",
                row,
                col,
                value: value as f64,
            });
        }
        let diag = diagonal(client, h)?.download(client)?;
        Ok(diag.into_iter().map(f64::from).collect())
    }

    /// GPTQ's damped factor of `h` for `prepared`'s loop order: `kept` when it is that factor,
    /// else factored now ([`damped_factor`](Self::damped_factor)).
    fn shared_factor(
        &self,
        kept: Option<KeptFactor>,
        h: &MatrixView,
        prepared: &GptqPreparation,
        damping: &sala_hessian::Damping,
        diag: &[f64],
    ) -> Result<Option<(MatrixView, DampingAttempt)>, HessianError> {
        match kept.filter(|k| k.serves(diag, &prepared.order, damping)) {
            Some(kept) => Ok(Some((kept.upper, kept.attempt))),
            None => self.timed("factor", || self.damped_factor(h, prepared, damping, diag)),
        }
    }

    /// The factor kept by the last solve, if any, now no longer kept.
    fn take_kept_factor(&self) -> Option<KeptFactor> {
        // A poisoned lock only means a solve panicked while holding it; the slot itself is
        // always whole.
        let mut slot = self.kept_factor.lock().unwrap_or_else(|e| e.into_inner());
        slot.take()
    }

    /// Keeps `factor` for the next resident solve.
    fn keep_factor(&self, factor: KeptFactor) {
        let mut slot = self.kept_factor.lock().unwrap_or_else(|e| e.into_inner());
        *slot = Some(factor);
    }

    /// The damping schedule on the device: the damped permuted copy of `h`, factored, until a
    /// factor exists and is finite. `None` when every attempt failed.
    fn damped_factor(
        &self,
        h: &MatrixView,
        prepared: &GptqPreparation,
        damping: &sala_hessian::Damping,
        diag: &[f64],
    ) -> Result<Option<(MatrixView, DampingAttempt)>, HessianError> {
        let fixed = prepared.fixed_diagonal_in_loop_order(diag);
        for (retries, percdamp) in damping.relative_dampings().enumerate() {
            let damp = percdamp * prepared.mean_diag;
            let damped: Vec<f32> = fixed.iter().map(|&d| (d + damp) as f32).collect();
            let a = damped_permuted(&self.client, h, &prepared.order, &damped)?;
            let Some(u) = self.factor(&a)? else {
                continue;
            };
            if first_non_finite(&self.client, &u)?.is_none() {
                return Ok(Some((u, DampingAttempt { retries, percdamp })));
            }
        }
        Ok(None)
    }

    /// One factorization of the device matrix `a`: on the device when a device factorizer is
    /// set, else on the host (the given factorizer or faer).
    fn factor(&self, a: &MatrixView) -> Result<Option<MatrixView>, HessianError> {
        if let Some(f) = &self.device_factorizer {
            return Ok(f.upper_factor_on_device(&self.client, a)?);
        }
        let n = a.rows;
        let host = a.download(&self.client)?;
        let upper = match &self.factorizer {
            Some(f) => f.upper_factor(&host, n)?,
            None => FaerFactorizer.upper_factor(&host, n)?,
        };
        Ok(match upper {
            Some(u) => Some(self.upload(&square_to_row_major(u.as_ref()), n, n)?),
            None => None,
        })
    }

    /// `tr(D·H·Dᵀ)`, `D = W − Q`, with `H` on the device and `D` computed on the host.
    fn proxy_error(
        &self,
        h: &MatrixView,
        weights: &[f32],
        dequantized: &[f32],
        out: usize,
        inp: usize,
    ) -> Result<f64, HessianError> {
        let delta: Vec<f32> = weights
            .par_iter()
            .zip(dequantized)
            .map(|(&w, &q)| w - q)
            .collect();
        self.proxy_error_of(&self.upload(&delta, out, inp)?, h)
    }

    /// `tr(D·H·Dᵀ)` of the device matrices `d` `[out, inp]` and `h` `[inp, inp]`: one GEMM
    /// `D·H` and the row dots of `D` with it (f32 on the device, the rows summed in f64).
    fn proxy_error_of(&self, d: &MatrixView, h: &MatrixView) -> Result<f64, HessianError> {
        let dh = MatrixView::zeros(&self.client, d.rows, d.cols)?;
        let gemm = self.proxy_gemm.as_ref().unwrap_or(&self.gemm);
        gemm.gemm(&self.client, 1.0, d, false, h, false, 0.0, &dh)?;
        let dots = row_dots(&self.client, d, &dh)?;
        Ok(dots.iter().map(|&v| v as f64).sum())
    }

    /// GPTQ's column loop on the device, its result read back: [`run_columns`] and
    /// [`download_columns`].
    ///
    /// [`run_columns`]: Self::run_columns
    /// [`download_columns`]: Self::download_columns
    fn solve_columns(
        &self,
        w: &MatrixView,
        u: &MatrixView,
        config: &DeviceGptqConfig,
        clip_weights: Option<&[f32]>,
    ) -> Result<ColumnSolution, HessianError> {
        let result = self.run_columns(w, u, config, clip_weights)?;
        self.download_columns(result)
    }

    /// GPTQ's column loop on the device: `w` (loop order, overwritten) against the factor `u`,
    /// with the clipping search's column weights `[inp]` (loop order) when it has one.
    fn run_columns(
        &self,
        w: &MatrixView,
        u: &MatrixView,
        config: &DeviceGptqConfig,
        clip_weights: Option<&[f32]>,
    ) -> Result<DeviceGptqResult, HessianError> {
        let clip_weights = clip_weights.map(|c| DeviceVec::upload(&self.client, c));
        self.timed("column loop", || {
            Ok(gptq_solve(
                &self.client,
                &self.gemm,
                w,
                u,
                config,
                clip_weights.as_ref(),
            )?)
        })
    }

    /// The codes (as bytes), parameters and column losses of a device result, on the host.
    fn download_columns(&self, result: DeviceGptqResult) -> Result<ColumnSolution, HessianError> {
        let host = self.timed("download codes", || {
            let codes = result
                .codes
                .download_low_bytes_with(&self.client, self.transfer.as_ref())?;
            Ok(result.download_with_codes(&self.client, codes)?)
        })?;
        Ok(ColumnSolution {
            codes: host.codes,
            params_rows: host.params,
            column_loss: host.column_loss.iter().map(|&l| l as f64).collect(),
        })
    }
}

/// Checks that `weights` and `dequantized` are one `[rows, cols]` matrix for the square
/// Hessian `h` `[cols, cols]`.
fn check_weights_against(
    weights: &[f32],
    dequantized: &[f32],
    h: &MatrixView,
) -> Result<(), HessianError> {
    let mismatch = |what, left, right| HessianError::DimensionMismatch { what, left, right };
    if h.rows != h.cols {
        return Err(mismatch("hessian rows vs columns", h.rows, h.cols));
    }
    if h.cols == 0 || weights.len() % h.cols != 0 {
        return Err(mismatch(
            "weight elements vs hessian dimension",
            weights.len(),
            h.cols,
        ));
    }
    if dequantized.len() != weights.len() {
        return Err(mismatch(
            "dequantized vs original weight elements",
            dequantized.len(),
            weights.len(),
        ));
    }
    Ok(())
}

/// The kernel's options for `quantizer`'s grid with groups of `group_size`, the configured
/// lazy block (clamped to the kernel's: the block only changes f32 summation orders) and the
/// clipping search.
fn loop_config(
    quantizer: IntQuantizer,
    group_size: usize,
    block_size: usize,
    clip: Option<ClipSearch>,
) -> DeviceGptqConfig {
    DeviceGptqConfig {
        bits: quantizer.bits(),
        group_size: Some(group_size),
        scheme: quantizer.scheme(),
        block: block_size.min(MAX_BLOCK),
        clip,
    }
}

impl<R: Runtime, G: Gemm<R>> LinearSolver for DeviceSolver<R, G> {
    fn name(&self) -> &str {
        &self.name
    }

    fn take_step_seconds(&self) -> Vec<(&'static str, f64)> {
        self.steps.take()
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
        let view = self.timed("upload weights", || Ok(self.upload(weights, rows, cols)?))?;
        let found = self.timed("block search", || {
            self.search_on_device(&view, search, diag_h, global_scale)
        })?;
        self.timed("download codes", || {
            Ok(found.download_with(&self.client, self.transfer.as_ref())?)
        })
    }

    /// The search, its diagonal proxy error and max calibration's on the device, from one
    /// upload of the weights; only the result's codes, scales and two sums cross back.
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
        let view = self.timed("upload weights", || Ok(self.upload(weights, rows, cols)?))?;
        let diag = DeviceVec::upload(&self.client, diag_h);
        let error_of = |found: &DeviceBlockSearch| -> Result<f64, HessianError> {
            let client = &self.client;
            let (codes, scales) = (&found.codes, &found.block_scales);
            let rows = nvfp4_diagonal_error(client, &view, codes, scales, &diag, global_scale)?;
            Ok(rows.iter().map(|&v| f64::from(v)).sum())
        };
        let max_calibration = match baseline {
            true => Some(self.timed("baseline error", || {
                error_of(&self.max_calibration_on_device(&view, search, global_scale)?)
            })?),
            false => None,
        };
        let found = self.timed("block search", || {
            self.search_on_device(&view, search, diag_h, global_scale)
        })?;
        let error = self.timed("error", || error_of(&found))?;
        let result = self.timed("download codes", || {
            Ok(found.download_with(&self.client, self.transfer.as_ref())?)
        })?;
        let errors = Nvfp4SearchErrors {
            error,
            max_calibration,
        };
        Ok((result, errors))
    }

    /// The column loop and the proxy error on the device ([`nvfp4_gptq_solve`]), the damped
    /// Hessian factored by this solver's factorizer (cuSOLVER on CUDA) where it has one.
    fn solve_nvfp4_gptq(
        &self,
        solver: &Nvfp4Gptq,
        weights: &[f32],
        rows: usize,
        cols: usize,
        h: &Hessian<f64>,
        global_scale: f32,
    ) -> Result<Nvfp4GptqResult, HessianError> {
        solver.solve_with_loop(weights, rows, cols, h, global_scale, self)
    }
}

impl<R: Runtime, G: Gemm<R>> Nvfp4ColumnLoop for DeviceSolver<R, G> {
    fn run(
        &self,
        columns: &Nvfp4Columns<'_>,
        block: usize,
        w: &mut [f32],
    ) -> Result<ColumnSolution<u8>, HessianError> {
        let (rows, cols) = (columns.rows, columns.cols);
        let (w_view, u_view) = self.timed("upload weights", || {
            let w_view = self.upload(w, rows, cols)?;
            let u_view = self.upload(&square_to_row_major(columns.upper), cols, cols)?;
            Ok((w_view, u_view))
        })?;
        let found = self.timed("column loop", || {
            Ok(nvfp4_gptq_solve(
                &self.client,
                &self.gemm,
                &w_view,
                &u_view,
                columns.channel_weights,
                columns.global_scale,
                columns.search,
                block,
            )?)
        })?;
        self.timed("download codes", || {
            Ok(found.download_with(&self.client, self.transfer.as_ref())?)
        })
    }

    fn factorizer(&self) -> Option<&dyn UpperFactorizer> {
        self.factorizer.as_deref()
    }

    /// On the device: `H` uploaded in f32, `D = W − Q` from the host.
    fn proxy_error<T: HessianScalar>(
        &self,
        weights: &[f32],
        dequantized: &[f32],
        cols: usize,
        h: &Hessian<T>,
    ) -> Result<f64, HessianError> {
        self.timed("proxy error", || {
            let values: Vec<f32> = h.to_row_major().into_iter().map(T::to_f32).collect();
            let h = self.upload(&values, cols, cols)?;
            let rows = weights.len() / cols.max(1);
            self.proxy_error(&h, weights, dequantized, rows, cols)
        })
    }
}

impl<R: Runtime, G: Gemm<R>> GptqColumnLoop for DeviceSolver<R, G> {
    fn run(
        &self,
        problem: &ColumnProblem<'_>,
        w: &mut [f32],
    ) -> Result<ColumnSolution, HessianError> {
        // The kernels compute the group parameters from the current weights: static groups
        // (from the original ones) run the host loop.
        if problem.static_groups.is_some() {
            return BlockedLoop.run(problem, w);
        }
        let (out, inp) = (problem.out, problem.inp);
        let (w_view, u_view) = self.timed("upload weights", || {
            let w_view = self.upload(w, out, inp)?;
            let u_view = self.upload(&square_to_row_major(problem.upper), inp, inp)?;
            Ok((w_view, u_view))
        })?;
        let (clip, clip_weights) = problem.clip.unzip();
        let config = loop_config(
            problem.quantizer,
            problem.group_size,
            problem.block_size,
            clip,
        );
        self.solve_columns(&w_view, &u_view, &config, clip_weights)
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
