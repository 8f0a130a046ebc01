//! The upper Cholesky factor of `H⁻¹` on cuSOLVER, in two `n³/3` passes.
//!
//! With `P` the reversal permutation, factor `H' = P·H·P = L·Lᵀ` and set `U = P·L⁻¹·P`. Then
//! `H = (P·L·P)(P·L·P)ᵀ`, `P·L·P` is upper triangular, `U = (P·L·P)⁻¹` is upper triangular
//! with a positive diagonal, and `Uᵀ·U = (P·L·P)⁻ᵀ(P·L·P)⁻¹ = H⁻¹`: `U` is *the* upper
//! Cholesky factor of `H⁻¹` (unique), the one IST-DASLab gets in three passes
//! (`chol(cholesky_inverse(chol(H)), upper)`) and `sala_hessian::CholeskyInverse` in two.
//!
//! Layout: for a row-major buffer, `P·M·P` is the buffer reversed (element `k` ↔ `n²−1−k`).
//! cuSOLVER reads the buffer as column-major, i.e. as the transpose. Factoring the reversed
//! `H'` (symmetric) with `uplo = UPPER` gives `H' = RᵀR` with `R` upper in column-major terms;
//! the row-major reading of that triangle is `Rᵀ = L`, lower, with `H' = L·Lᵀ`. Inverting it
//! in place (`trtri`, `UPPER`) leaves `R⁻¹`, whose row-major reading is `L⁻¹` (lower). Reversing
//! the buffer once more gives row-major `U = P·L⁻¹·P`; the other triangle of the buffer holds
//! what cuSOLVER did not touch (the reversed input), so the strict lower triangle of the result
//! is set to zero in the same pass.
//!
//! The triangular inverse is blocked: cuSOLVER's `trtri` ran at 6.5 TFLOP/s on a 16384-wide
//! factor (150 ms, against 58 ms for `potrf`). Above [`TRTRI_BLOCK`] columns the inverse of
//! `R = [R₁₁ R₁₂; 0 R₂₂]` is `[X₁₁ −X₁₁·R₁₂·X₂₂; 0 X₂₂]` with `X₁₁`, `X₂₂` the inverses of the
//! diagonal blocks (recursively): the off-diagonal block takes two triangular products (cuBLAS
//! `trmm`, in place), which run at the matrix-product rate.

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Handle;
use cudarc::cublas::sys as blas;
use cudarc::cusolver::sys::{self, cublasDiagType_t, cublasFillMode_t, cudaDataType};
use std::sync::Arc;

use super::blas::blas_error;
use super::{device_ptr, dim_i32, guarded, handle_ptr, libs, sync_client, LibStream};
use crate::device::{DeviceVec, MatrixView};
use crate::error::KernelError;
use crate::flip::reversed;
use crate::solver::DeviceFactorizer;

/// A cuSOLVER dense handle bound to its own stream on the device's primary context, with a
/// cuBLAS handle on the same stream (the blocked triangular inverse's products).
#[derive(Debug)]
pub struct Cusolver {
    lib: LibStream,
    handle: sys::cusolverDnHandle_t,
    blas: blas::cublasHandle_t,
}

// SAFETY: as for `Cublas`: calls take `&self` and finish before returning; the handle is
// destroyed only in `drop`.
unsafe impl Send for Cusolver {}
// SAFETY: see `Send`.
unsafe impl Sync for Cusolver {}

impl Cusolver {
    /// Loads cuSOLVER (an error naming the missing library or dependency if it cannot be
    /// loaded) and creates a handle on a new stream of device `ordinal`.
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        libs::require("cusolver", "inverse_upper_cusolver")?;
        libs::require("cublas", "inverse_upper_cusolver")?;
        guarded("cuSOLVER handle", || {
            let lib = LibStream::new(ordinal)?;
            lib.bind()?;
            let handle =
                cudarc::cusolver::result::dn_create().map_err(solver_error("cusolverDnCreate"))?;
            let blas = match cudarc::cublas::result::create_handle() {
                Ok(blas) => blas,
                Err(e) => {
                    // SAFETY: created above, destroyed once.
                    unsafe {
                        let _ = cudarc::cusolver::result::dn_destroy(handle);
                    }
                    return Err(blas_error("cublasCreate")(e));
                }
            };
            let solver = Self { lib, handle, blas };
            let stream = solver.lib.stream().cu_stream();
            // SAFETY: the handles were just created; the stream belongs to the same context.
            unsafe {
                cudarc::cusolver::result::dn_set_stream(solver.handle, stream as _)
                    .map_err(solver_error("cusolverDnSetStream"))?;
                cudarc::cublas::result::set_stream(solver.blas, stream as _)
                    .map_err(blas_error("cublasSetStream"))?;
            }
            Ok(solver)
        })
    }
}

impl Drop for Cusolver {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once; errors at teardown are ignored.
        unsafe {
            let _ = cudarc::cusolver::result::dn_destroy(self.handle);
            let _ = cudarc::cublas::result::destroy_handle(self.blas);
        }
    }
}

fn solver_error(
    what: &'static str,
) -> impl Fn(cudarc::cusolver::result::CusolverError) -> KernelError {
    move |e| KernelError::Launch {
        what,
        message: format!("{e:?}"),
    }
}

/// [`inverse_upper_cusolver`] as the [`DeviceFactorizer`] of GPTQ's damped Hessians inside
/// [`DeviceSolver`](crate::DeviceSolver): the factor stays on the device for the column loop.
pub struct CusolverFactorizer {
    solver: Arc<Cusolver>,
}

impl CusolverFactorizer {
    /// A factorizer with `solver`'s handle.
    pub fn new(solver: Arc<Cusolver>) -> Self {
        Self { solver }
    }
}

impl DeviceFactorizer<CudaRuntime> for CusolverFactorizer {
    fn upper_factor_on_device(
        &self,
        client: &ComputeClient<CudaRuntime>,
        a: &MatrixView,
    ) -> Result<Option<MatrixView>, KernelError> {
        match inverse_upper_cusolver(client, &self.solver, a) {
            Ok(u) => Ok(Some(u)),
            Err(KernelError::NotPositiveDefinite { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// `U`, the upper Cholesky factor of `H⁻¹` (`Uᵀ·U = H⁻¹`, strict lower triangle zero), as a
/// new dense `n × n` f32 matrix, from the symmetric positive definite `h` `n × n` (damping
/// already added; only its values are read, the window is left unchanged).
///
/// One `potrf` and one `trtri` (f32) on the reversed matrix, see the module docs. A matrix
/// that is not positive definite gives an error naming the first failing column in `h`'s
/// order. The factor is not scanned for overflow (a near-singular `h` can give huge values):
/// callers compare it with a reference or check the GPTQ loss.
pub fn inverse_upper_cusolver(
    client: &ComputeClient<CudaRuntime>,
    solver: &Cusolver,
    h: &MatrixView,
) -> Result<MatrixView, KernelError> {
    inverse_upper_cusolver_timed(client, solver, h).map(|(u, _)| u)
}

/// Wall-clock seconds of the phases of one [`inverse_upper_cusolver_timed`] call (each phase
/// ends with a synchronization, so the times do not overlap).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct InverseTimings {
    /// Reversing `h` into the work buffer, workspace query and allocation.
    pub prepare_s: f64,
    /// The Cholesky factorization (`potrf`) and the read of its `info`.
    pub potrf_s: f64,
    /// The triangular inverse (`trtri`) and the read of its `info`.
    pub trtri_s: f64,
    /// Reversing the result back and zeroing its lower triangle.
    pub finish_s: f64,
}

/// [`inverse_upper_cusolver`], also returning how long each phase took.
pub fn inverse_upper_cusolver_timed(
    client: &ComputeClient<CudaRuntime>,
    solver: &Cusolver,
    h: &MatrixView,
) -> Result<(MatrixView, InverseTimings), KernelError> {
    let mut timings = InverseTimings::default();
    let mut clock = std::time::Instant::now();
    let mut lap = || {
        let now = std::time::Instant::now();
        let seconds = now.duration_since(clock).as_secs_f64();
        clock = now;
        seconds
    };
    h.check("inverse h")?;
    let n = h.rows;
    if h.cols != n {
        return Err(KernelError::shape(
            "inverse",
            format!("h is {}×{}, not square", h.rows, h.cols),
        ));
    }
    if n == 0 {
        return Ok((MatrixView::zeros(client, 0, 0)?, timings));
    }
    let n_i32 = dim_i32("inverse n", n)?;
    let work = reversed(client, h, false)?;
    let info = DeviceVec::<u32>::zeros(client, 1)?;
    let work_ptr = device_ptr(client, &work)?;
    let info_ptr = handle_ptr(client, &info.handle)?;
    ready(client, solver)?;

    // potrf (column-major UPPER on the reversed matrix).
    let mut lwork: i32 = 0;
    call("cusolverDnSpotrf_bufferSize", || {
        // SAFETY: `work_ptr` addresses n·n f32 of a live buffer, lda = n.
        unsafe {
            sys::cusolverDnSpotrf_bufferSize(
                solver.handle,
                cublasFillMode_t::CUBLAS_FILL_MODE_UPPER,
                n_i32,
                work_ptr as *mut f32,
                n_i32,
                &mut lwork,
            )
        }
    })?;
    let (workspace, workspace_ptr) = alloc_workspace(client, solver, lwork.max(0) as usize * 4)?;
    timings.prepare_s = lap();
    call("cusolverDnSpotrf", || {
        // SAFETY: as above; the workspace holds `lwork` f32 and `info` one i32.
        unsafe {
            sys::cusolverDnSpotrf(
                solver.handle,
                cublasFillMode_t::CUBLAS_FILL_MODE_UPPER,
                n_i32,
                work_ptr as *mut f32,
                n_i32,
                workspace_ptr as *mut f32,
                lwork,
                info_ptr as *mut i32,
            )
        }
    })?;
    let potrf_info = finished_info(client, solver, &info, "cusolverDnSpotrf")?;
    if potrf_info > 0 {
        // The leading minor of order `potrf_info` of the reversed matrix failed: its last
        // column is column `n − potrf_info` of `h`.
        return Err(KernelError::NotPositiveDefinite {
            column: n - potrf_info as usize,
        });
    }
    drop(workspace);
    timings.potrf_s = lap();

    // The inverse of the factor (column-major UPPER, non-unit diagonal), in place.
    let factor = UpperFactor {
        ptr: work_ptr,
        lda: n,
    };
    invert_upper(client, solver, &factor, &info, 0, n)?;
    timings.trtri_s = lap();
    let u = reversed(client, &work, true)?;
    sync_client(client)?;
    timings.finish_s = lap();
    Ok((u, timings))
}

/// Diagonal blocks up to this many columns are inverted by cuSOLVER's `trtri`; larger ones are
/// split in two (module docs).
const TRTRI_BLOCK: usize = 1024;

/// A column-major upper triangular `lda × lda` f32 matrix at device address `ptr`.
struct UpperFactor {
    ptr: u64,
    lda: usize,
}

impl UpperFactor {
    /// The device address of element `(row, col)`.
    fn at(&self, row: usize, col: usize) -> u64 {
        self.ptr + ((row + col * self.lda) * std::mem::size_of::<f32>()) as u64
    }
}

/// Inverts, in place, the diagonal block of `r` that starts at `(start, start)` and spans
/// `m` columns (module docs): `trtri` up to [`TRTRI_BLOCK`] columns, else both halves
/// recursively and the off-diagonal block by two `trmm`. `info` is `trtri`'s scratch.
fn invert_upper(
    client: &ComputeClient<CudaRuntime>,
    solver: &Cusolver,
    r: &UpperFactor,
    info: &DeviceVec<u32>,
    start: usize,
    m: usize,
) -> Result<(), KernelError> {
    if m <= TRTRI_BLOCK {
        return trtri_block(client, solver, r, info, start, m);
    }
    // The first half a multiple of 64 columns, so that the products' blocks stay aligned.
    let m1 = (m / 2).div_ceil(64) * 64;
    let m2 = m - m1;
    let (second, lda) = (start + m1, dim_i32("inverse lda", r.lda)?);
    invert_upper(client, solver, r, info, start, m1)?;
    invert_upper(client, solver, r, info, second, m2)?;
    let (m1_i32, m2_i32) = (dim_i32("inverse block", m1)?, dim_i32("inverse block", m2)?);
    let r12 = r.at(start, second);
    // R₁₂ ← R₁₂·X₂₂, then R₁₂ ← −X₁₁·R₁₂.
    let block = (r12, m1_i32, m2_i32, lda);
    trmm_in_place(solver, Side::Right, 1.0, r.at(second, second), block)?;
    trmm_in_place(solver, Side::Left, -1.0, r.at(start, start), block)?;
    solver.lib.synchronize("cublasStrmm")
}

/// Which side of the block [`trmm_in_place`] multiplies the triangle on.
#[derive(Clone, Copy)]
enum Side {
    Left,
    Right,
}

/// `B ← alpha·T·B` (`Side::Left`) or `B ← alpha·B·T` (`Side::Right`) with `T` the upper
/// triangle (non-unit diagonal) at device address `triangle`, and `B` the `(ptr, rows, cols,
/// lda)` column-major block, on the solver's stream. cuBLAS's `trmm` is out of place and
/// writes in place when `C = B`.
fn trmm_in_place(
    solver: &Cusolver,
    side: Side,
    alpha: f32,
    triangle: u64,
    (b, rows, cols, lda): (u64, i32, i32, i32),
) -> Result<(), KernelError> {
    let (mode, what) = match side {
        Side::Left => (
            blas::cublasSideMode_t::CUBLAS_SIDE_LEFT,
            "cublasStrmm (left)",
        ),
        Side::Right => (
            blas::cublasSideMode_t::CUBLAS_SIDE_RIGHT,
            "cublasStrmm (right)",
        ),
    };
    blas_call(what, || {
        // SAFETY: the caller's triangle and block lie inside one live buffer of the solver's
        // device; `alpha` outlives the call, which the caller synchronizes.
        unsafe {
            blas::cublasStrmm_v2(
                solver.blas,
                mode,
                blas::cublasFillMode_t::CUBLAS_FILL_MODE_UPPER,
                blas::cublasOperation_t::CUBLAS_OP_N,
                blas::cublasDiagType_t::CUBLAS_DIAG_NON_UNIT,
                rows,
                cols,
                &alpha,
                triangle as *const f32,
                lda,
                b as *const f32,
                lda,
                b as *mut f32,
                lda,
            )
        }
    })
}

/// `trtri` on the diagonal block of `r` at `(start, start)`, `m` columns, in place.
fn trtri_block(
    client: &ComputeClient<CudaRuntime>,
    solver: &Cusolver,
    r: &UpperFactor,
    info: &DeviceVec<u32>,
    start: usize,
    m: usize,
) -> Result<(), KernelError> {
    let block = r.at(start, start);
    let info_ptr = handle_ptr(client, &info.handle)?;
    let (mut dev_bytes, mut host_bytes) = (0usize, 0usize);
    call("cusolverDnXtrtri_bufferSize", || {
        // SAFETY: `block` addresses an m × m block (leading dimension lda) of a live buffer;
        // the sizes are written to two host integers.
        unsafe {
            sys::cusolverDnXtrtri_bufferSize(
                solver.handle,
                cublasFillMode_t::CUBLAS_FILL_MODE_UPPER,
                cublasDiagType_t::CUBLAS_DIAG_NON_UNIT,
                m as i64,
                cudaDataType::CUDA_R_32F,
                block as *mut _,
                r.lda as i64,
                &mut dev_bytes,
                &mut host_bytes,
            )
        }
    })?;
    let mut host_workspace = vec![0u8; host_bytes.max(1)];
    let (dev_workspace, dev_workspace_ptr) = alloc_workspace(client, solver, dev_bytes)?;
    call("cusolverDnXtrtri", || {
        // SAFETY: the device workspace holds `dev_bytes`, the host one `host_bytes`; the
        // host buffer outlives the call, whose stream is synchronized right after.
        unsafe {
            sys::cusolverDnXtrtri(
                solver.handle,
                cublasFillMode_t::CUBLAS_FILL_MODE_UPPER,
                cublasDiagType_t::CUBLAS_DIAG_NON_UNIT,
                m as i64,
                cudaDataType::CUDA_R_32F,
                block as *mut _,
                r.lda as i64,
                dev_workspace_ptr as *mut _,
                dev_bytes,
                host_workspace.as_mut_ptr().cast(),
                host_bytes,
                info_ptr as *mut i32,
            )
        }
    })?;
    let trtri_info = finished_info(client, solver, info, "cusolverDnXtrtri")?;
    drop(dev_workspace);
    if trtri_info > 0 {
        return Err(KernelError::unsupported(
            "triangular inverse",
            format!(
                "trtri: zero diagonal at position {} of the factor",
                start + trtri_info as usize
            ),
        ));
    }
    Ok(())
}

/// One cuBLAS call `what`: a panic inside it and a status other than success both become
/// errors naming the call.
fn blas_call(
    what: &'static str,
    f: impl FnOnce() -> blas::cublasStatus_t,
) -> Result<(), KernelError> {
    guarded(what, || f().result().map_err(blas_error(what)))
}

/// Makes what CubeCL queued (kernels, and the stream-ordered allocations behind the pointers
/// about to be handed over) finish before cuSOLVER's own stream reads it, and makes the
/// library's context current on this thread (CubeCL may have run on another).
fn ready(client: &ComputeClient<CudaRuntime>, solver: &Cusolver) -> Result<(), KernelError> {
    sync_client(client)?;
    solver.lib.bind()
}

/// A device workspace of `bytes` (at least 4, so that a size of zero still gives a valid
/// pointer) and its address, [`ready`] for the cuSOLVER call it is for. Keep the handle
/// alive until that call has been synchronized.
fn alloc_workspace(
    client: &ComputeClient<CudaRuntime>,
    solver: &Cusolver,
    bytes: usize,
) -> Result<(Handle, u64), KernelError> {
    let buffer = client.empty(bytes.max(4));
    let ptr = handle_ptr(client, &buffer)?;
    ready(client, solver)?;
    Ok((buffer, ptr))
}

/// One cuSOLVER call `what`: a panic inside it (a library or symbol that does not load) and a
/// status other than success both become errors naming the call.
fn call(what: &'static str, f: impl FnOnce() -> sys::cusolverStatus_t) -> Result<(), KernelError> {
    guarded(what, || f().result().map_err(solver_error(what)))
}

/// Waits for the call `what` on the library's stream, then reads the `info` it wrote: an
/// invalid argument (negative) is an error, a failure of the routine itself (positive, its
/// meaning the routine's) is returned for the caller to report.
fn finished_info(
    client: &ComputeClient<CudaRuntime>,
    solver: &Cusolver,
    info: &DeviceVec<u32>,
    what: &'static str,
) -> Result<i32, KernelError> {
    solver.lib.synchronize(what)?;
    let value = read_info(client, info)?;
    check_info(what, value)?;
    Ok(value)
}

/// The `info` integer cuSOLVER wrote.
fn read_info(
    client: &ComputeClient<CudaRuntime>,
    info: &DeviceVec<u32>,
) -> Result<i32, KernelError> {
    let values = info.download(client)?;
    Ok(values.first().copied().unwrap_or(0) as i32)
}

/// A negative `info` is an invalid argument (a bug here, not bad input).
fn check_info(what: &'static str, info: i32) -> Result<(), KernelError> {
    if info < 0 {
        return Err(KernelError::Launch {
            what,
            message: format!("parameter {} had an illegal value", -info),
        });
    }
    Ok(())
}
