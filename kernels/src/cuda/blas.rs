//! cuBLAS on CubeCL buffers: [`CublasGemm`] (the [`Gemm`] trait) and [`xtx_bf16`].
//!
//! cuBLAS is column-major and our matrices are row-major. A row-major `r × c` buffer with
//! row stride `s` *is* the column-major `c × r` matrix of its transpose with leading
//! dimension `s`, so the row-major product `C = op(A)·op(B)` is computed as the column-major
//! product `Cᵀ = op(B)ᵀ·op(A)ᵀ`: B is passed first, A second, the flags unchanged, and the
//! roles of m and n swapped.

use std::sync::{Arc, Mutex};

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use cubecl::server::Handle;
use cudarc::cublas::sys::{
    self, cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType,
};

use super::blas_lt::{LtSlot, LtState};
use super::{device_ptr, dim_i32, guarded, handle_ptr, libs, LibStream, StreamOrdering};
use crate::device::MatrixView;
use crate::error::KernelError;
use crate::gemm::{check_gemm_shapes, Gemm};
use crate::hessian::{xtx_lower_blocks, XtxBlocking, XtxBlocks};

/// How cuBLAS may compute an FP32 product.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp32Math {
    /// Plain FP32 multiply-adds, no reduced-precision internals
    /// (`CUBLAS_COMPUTE_32F_PEDANTIC`): what GPTQ's error propagation is specified with.
    #[default]
    Pedantic,
    /// Inputs rounded to TF32 on the tensor cores, FP32 accumulation
    /// (`CUBLAS_COMPUTE_32F_FAST_TF32`): faster, ~10-bit mantissas.
    Tf32,
}

impl Fp32Math {
    fn compute_type(self) -> cublasComputeType_t {
        match self {
            Fp32Math::Pedantic => cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC,
            Fp32Math::Tf32 => cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        }
    }
}

/// A cuBLAS handle bound to its own stream on the device's primary context.
#[derive(Debug)]
pub struct Cublas {
    lib: LibStream,
    handle: sys::cublasHandle_t,
    /// cuBLASLt's handle and workspace on the same stream, made at the first product that
    /// needs them ([`linear_residual_bf16`](super::linear_residual_bf16)).
    lt: Mutex<Option<LtState>>,
    /// The multiprocessors the products are sized for (0: all; see [`Cublas::with_ordering`]).
    sm_count_target: i32,
}

// SAFETY: a cuBLAS handle may be used from any thread; every call below takes `&self` and only
// queues work on the handle's stream (ordered with CubeCL's by `LibStream`), and the handle is
// only destroyed in `drop`.
unsafe impl Send for Cublas {}
// SAFETY: see `Send`; concurrent calls from two threads would share the stream, which cuBLAS
// allows (it serialises them on the stream).
unsafe impl Sync for Cublas {}

impl Cublas {
    /// Loads cuBLAS (an error naming the missing library if it cannot be loaded) and creates
    /// a handle on a new stream of device `ordinal` (0 for the first GPU, as CubeCL's
    /// `CudaDevice::default()`).
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        libs::require("cublas", "CublasGemm, xtx_bf16")?;
        guarded("cuBLAS handle", || {
            let lib = LibStream::new(ordinal)?;
            lib.bind()?;
            let handle =
                cudarc::cublas::result::create_handle().map_err(blas_error("cublasCreate"))?;
            // SAFETY: `handle` was just created and the stream belongs to the same context.
            unsafe {
                cudarc::cublas::result::set_stream(handle, lib.stream().cu_stream() as _)
                    .map_err(blas_error("cublasSetStream"))?;
            }
            Ok(Self {
                lib,
                handle,
                lt: Mutex::new(None),
                sm_count_target: 0,
            })
        })
    }

    /// The same handle with its stream ordered with CubeCL's by `ordering`
    /// ([`StreamOrdering::HostWaits`] unless set).
    pub fn with_ordering(mut self, ordering: StreamOrdering) -> Self {
        self.set_ordering(ordering);
        self
    }

    /// Orders this handle's stream with CubeCL's by `ordering` from now on. Under
    /// [`StreamOrdering::DeviceWaits`] cuBLAS (and cuBLASLt) size their kernels for one
    /// multiprocessor less, the one CubeCL's polling kernel takes while they run; where the
    /// device cannot say how many it has, they keep sizing for all (a speed matter only).
    pub(crate) fn set_ordering(&mut self, ordering: StreamOrdering) {
        self.lib.set_ordering(ordering);
        let target = match (ordering, self.lib.multiprocessors()) {
            (StreamOrdering::DeviceWaits, Ok(all)) => ordering.kernel_multiprocessors(all) as i32,
            _ => 0,
        };
        // Host waits on a new handle change nothing: the default path makes no call here.
        if target == self.sm_count_target {
            return;
        }
        self.sm_count_target = target;
        if self.lib.bind().is_ok() {
            // SAFETY: a live handle; 0 restores cuBLAS's own choice (every multiprocessor).
            let _ = unsafe { sys::cublasSetSmCountTarget(self.handle, self.sm_count_target) };
        }
    }

    /// The multiprocessors cuBLAS sizes its kernels for (0: all of them).
    pub(crate) fn sm_count_target(&self) -> i32 {
        self.sm_count_target
    }

    /// How this handle's stream is ordered with CubeCL's.
    pub fn ordering(&self) -> StreamOrdering {
        self.lib.ordering()
    }

    /// Runs `f` (cuBLAS calls on this handle) after CubeCL's queued work; CubeCL's next work
    /// runs after it (the host waits for it unless the device does: [`Cublas::with_ordering`]).
    pub(crate) fn run(
        &self,
        client: &ComputeClient<CudaRuntime>,
        what: &'static str,
        f: impl FnOnce(sys::cublasHandle_t) -> Result<(), KernelError>,
    ) -> Result<(), KernelError> {
        self.queue(client, what, f)?;
        self.lib.before_cubecl(client, what)
    }

    /// Queues `f` (cuBLAS calls on this handle) on this handle's stream after CubeCL's queued
    /// work, without ordering CubeCL's next work after it: the caller keeps what it reads and
    /// writes alive and untouched until the stream is done ([`XtxStream`](super::XtxStream)
    /// does).
    pub(crate) fn queue(
        &self,
        client: &ComputeClient<CudaRuntime>,
        what: &'static str,
        f: impl FnOnce(sys::cublasHandle_t) -> Result<(), KernelError>,
    ) -> Result<(), KernelError> {
        self.lib.after_cubecl(client)?;
        self.lib.bind()?;
        guarded(what, || f(self.handle))
    }

    /// This handle's stream.
    pub(crate) fn lib(&self) -> &LibStream {
        &self.lib
    }

    /// The cuBLASLt state on this handle's stream, locked (`None` until the first use makes it).
    pub(super) fn lt_slot(&self) -> LtSlot<'_> {
        self.lt
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for Cublas {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once; errors at teardown are ignored.
        unsafe {
            let _ = cudarc::cublas::result::destroy_handle(self.handle);
        }
    }
}

/// Maps a cuBLAS status to [`KernelError::Launch`] naming the call.
pub(super) fn blas_error(
    what: &'static str,
) -> impl Fn(cudarc::cublas::result::CublasError) -> KernelError {
    move |e| KernelError::Launch {
        what,
        message: format!("{e:?}"),
    }
}

/// [`Gemm`] on cuBLAS: `c ← β·c + α·op(a)·op(b)` on row-major f32 windows of CubeCL buffers.
#[derive(Debug, Clone)]
pub struct CublasGemm {
    blas: Arc<Cublas>,
    math: Fp32Math,
}

impl CublasGemm {
    /// A GEMM on `blas` with the given FP32 mode ([`Fp32Math::Pedantic`] by default).
    pub fn new(blas: Arc<Cublas>, math: Fp32Math) -> Self {
        Self { blas, math }
    }

    /// The FP32 mode.
    pub fn math(&self) -> Fp32Math {
        self.math
    }
}

/// One column-major `cublasGemmEx` call: `c ← β·c + α·op(x1)·op(x2)`, `c` `m × n`.
struct GemmExCall {
    op1: cublasOperation_t,
    op2: cublasOperation_t,
    m: i32,
    n: i32,
    k: i32,
    x1: (u64, i32, cudaDataType),
    x2: (u64, i32, cudaDataType),
    /// Output pointer, leading dimension and element type.
    c: (u64, i32, cudaDataType),
    alpha: f32,
    beta: f32,
    compute: cublasComputeType_t,
}

impl GemmExCall {
    fn launch(&self, handle: sys::cublasHandle_t) -> Result<(), KernelError> {
        // SAFETY: the pointers come from live CubeCL buffers whose windows were checked
        // against the operand shapes; alpha and beta are host scalars (cuBLAS's default
        // pointer mode) and outlive the call, which completes before `run` returns.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                handle,
                self.op1,
                self.op2,
                self.m,
                self.n,
                self.k,
                (&self.alpha as *const f32).cast(),
                self.x1.0 as *const _,
                self.x1.2,
                self.x1.1,
                self.x2.0 as *const _,
                self.x2.2,
                self.x2.1,
                (&self.beta as *const f32).cast(),
                self.c.0 as *mut _,
                self.c.2,
                self.c.1,
                self.compute,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_error("cublasGemmEx"))
    }

    /// This call for `count` operand sets, each `strides` elements (`x1`, `x2`, `c`) after
    /// the last: one `cublasGemmStridedBatchedEx`.
    fn launch_strided_batched(
        &self,
        handle: sys::cublasHandle_t,
        count: usize,
        (stride1, stride2, stride_c): (i64, i64, i64),
    ) -> Result<(), KernelError> {
        let count = dim_i32("gemm batch", count)?;
        // SAFETY: as in `launch`; the caller checked that every batch member's window lies in
        // its buffer (the blocks of `xtx_lower_blocks` stay inside `[dim, dim]`).
        unsafe {
            sys::cublasGemmStridedBatchedEx(
                handle,
                self.op1,
                self.op2,
                self.m,
                self.n,
                self.k,
                (&self.alpha as *const f32).cast(),
                self.x1.0 as *const _,
                self.x1.2,
                self.x1.1,
                stride1,
                self.x2.0 as *const _,
                self.x2.2,
                self.x2.1,
                stride2,
                (&self.beta as *const f32).cast(),
                self.c.0 as *mut _,
                self.c.2,
                self.c.1,
                stride_c,
                count,
                self.compute,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .result()
        .map_err(blas_error("cublasGemmStridedBatchedEx"))
    }
}

fn op(trans: bool) -> cublasOperation_t {
    if trans {
        cublasOperation_t::CUBLAS_OP_T
    } else {
        cublasOperation_t::CUBLAS_OP_N
    }
}

/// A leading dimension: the row stride, at least 1 (cuBLAS rejects 0 even for empty
/// operands).
fn ld(view: &MatrixView) -> Result<i32, KernelError> {
    dim_i32("leading dimension", view.row_stride.max(1))
}

impl Gemm<CudaRuntime> for CublasGemm {
    fn gemm(
        &self,
        client: &ComputeClient<CudaRuntime>,
        alpha: f32,
        a: &MatrixView,
        trans_a: bool,
        b: &MatrixView,
        trans_b: bool,
        beta: f32,
        c: &MatrixView,
    ) -> Result<(), KernelError> {
        let (m, n, k) = check_gemm_shapes(a, trans_a, b, trans_b, c)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let call = GemmExCall {
            op1: op(trans_b),
            op2: op(trans_a),
            m: dim_i32("gemm n", n)?,
            n: dim_i32("gemm m", m)?,
            k: dim_i32("gemm k", k)?,
            x1: (device_ptr(client, b)?, ld(b)?, cudaDataType::CUDA_R_32F),
            x2: (device_ptr(client, a)?, ld(a)?, cudaDataType::CUDA_R_32F),
            c: (device_ptr(client, c)?, ld(c)?, cudaDataType::CUDA_R_32F),
            alpha,
            beta,
            compute: self.math.compute_type(),
        };
        self.blas
            .run(client, "cublasGemmEx (f32)", |h| call.launch(h))
    }
}

/// A dense row-major bf16 matrix in a CubeCL buffer (bf16 values as little-endian `u16`s).
#[derive(Debug, Clone)]
pub struct Bf16Matrix {
    /// The buffer (`rows · cols · 2` bytes at least).
    pub handle: Handle,
    /// Rows.
    pub rows: usize,
    /// Columns (= the row stride).
    pub cols: usize,
}

impl Bf16Matrix {
    /// Uploads bf16 bit patterns (`u16`, row-major `[rows, cols]`).
    pub fn upload(
        client: &ComputeClient<CudaRuntime>,
        bits: &[u16],
        rows: usize,
        cols: usize,
    ) -> Result<Self, KernelError> {
        if bits.len() != rows * cols {
            return Err(KernelError::shape(
                "bf16 upload",
                format!("{} values for a {rows}×{cols} matrix", bits.len()),
            ));
        }
        Ok(Self {
            handle: client.create_from_slice(bytemuck::cast_slice(bits)),
            rows,
            cols,
        })
    }
}

/// `(tokens, dim)` of `x` once `h` is a valid `[dim, dim]` window and `x`'s buffer holds its
/// bf16 values: the checks of [`xtx_bf16`] and [`xtx_runs_bf16`].
fn check_xtx_operands(x: &Bf16Matrix, h: &MatrixView) -> Result<(usize, usize), KernelError> {
    h.check("xtx h")?;
    let (tokens, dim) = (x.rows, x.cols);
    if h.rows != dim || h.cols != dim {
        return Err(KernelError::shape(
            "xtx",
            format!("x is {tokens}×{dim}, h is {}×{}", h.rows, h.cols),
        ));
    }
    let bytes = x.handle.size_in_used() as usize;
    if bytes < tokens * dim * 2 {
        return Err(KernelError::shape(
            "xtx x",
            format!("{bytes} bytes for a {tokens}×{dim} bf16 matrix"),
        ));
    }
    Ok((tokens, dim))
}

/// `h ← alpha·XᵀX + beta·h`: the Hessian of bf16 activations `x` `[tokens, dim]` into the f32
/// window `h` `[dim, dim]`, by one `cublasGemmEx` (bf16 inputs, f32 output, f32 compute:
/// products of bf16 values are exact in f32, so only the summation order differs from an
/// f32 reference). `alpha = 1/tokens, beta = 0` gives the per-token-normalized Hessian.
pub fn xtx_bf16(
    client: &ComputeClient<CudaRuntime>,
    blas: &Cublas,
    x: &Bf16Matrix,
    h: &MatrixView,
    alpha: f32,
    beta: f32,
) -> Result<(), KernelError> {
    let (tokens, dim) = check_xtx_operands(x, h)?;
    if dim == 0 {
        return Ok(());
    }
    // Row-major X is column-major Y = Xᵀ (dim × tokens, ld dim); XᵀX = Y·Yᵀ is symmetric, so
    // its column-major result is also the row-major one.
    let x_ptr = handle_ptr(client, &x.handle)?;
    let call = GemmExCall {
        op1: cublasOperation_t::CUBLAS_OP_N,
        op2: cublasOperation_t::CUBLAS_OP_T,
        m: dim_i32("xtx dim", dim)?,
        n: dim_i32("xtx dim", dim)?,
        k: dim_i32("xtx tokens", tokens)?,
        x1: (x_ptr, dim_i32("xtx dim", dim)?, cudaDataType::CUDA_R_16BF),
        x2: (x_ptr, dim_i32("xtx dim", dim)?, cudaDataType::CUDA_R_16BF),
        c: (device_ptr(client, h)?, ld(h)?, cudaDataType::CUDA_R_32F),
        alpha,
        beta,
        compute: cublasComputeType_t::CUBLAS_COMPUTE_32F,
    };
    blas.run(client, "cublasGemmEx (bf16 XᵀX)", |handle| {
        call.launch(handle)
    })
}

/// Rows of `x` sharing one weight in [`xtx_runs_bf16`]: rows `first_row..first_row + rows`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct XtxRun {
    /// First row of the run in `x`.
    pub first_row: usize,
    /// Rows in the run.
    pub rows: usize,
    /// Weight of the run's `XᵀX` (e.g. `1/T` of its samples' length).
    pub weight: f32,
}

/// `h ← h + Σ_r weight_r · X_rᵀX_r` over the `runs` of rows of the bf16 activations `x`
/// `[tokens, dim]`, into the f32 window `h` `[dim, dim]`, using the symmetry: only the blocks
/// on and below the diagonal of [`XtxBlocking::default`] (halving down to diagonal blocks of
/// [`XTX_BLOCK`](crate::hessian::XTX_BLOCK)) are multiplied (`cublasGemmEx`, bf16 inputs, f32
/// compute, as [`xtx_bf16`]), then each block below is copied, transposed, above
/// (`cublasSgeam`). For `n` diagonal blocks that is `(n + 1) / 2n` of the full product's work,
/// and the result is exactly symmetric. All products run in one library call (one host
/// sync).
pub fn xtx_runs_bf16(
    client: &ComputeClient<CudaRuntime>,
    blas: &Cublas,
    x: &Bf16Matrix,
    runs: &[XtxRun],
    h: &MatrixView,
) -> Result<(), KernelError> {
    xtx_runs_bf16_blocked(client, blas, x, runs, h, XtxBlocking::default())
}

/// [`xtx_runs_bf16`] with the blocks of `blocking` ([`xtx_lower_blocks`]): with
/// `blocking.batched`, the whole blocks of each block diagonal are one
/// `cublasGemmStridedBatchedEx`, so that small blocks (less work) still make large calls.
pub fn xtx_runs_bf16_blocked(
    client: &ComputeClient<CudaRuntime>,
    blas: &Cublas,
    x: &Bf16Matrix,
    runs: &[XtxRun],
    h: &MatrixView,
    blocking: XtxBlocking,
) -> Result<(), KernelError> {
    queue_xtx_runs(client, blas, x, runs, h, blocking, true)?;
    blas.lib
        .before_cubecl(client, "cublasGemmEx + cublasSgeam (bf16 XᵀX)")
}

/// [`xtx_runs_bf16_blocked`] queued on `blas`'s stream without waiting for it: `x` and `h`
/// must stay alive and untouched until that stream is done. With `mirror` false only the
/// blocks on and below the diagonal are written; [`queue_xtx_mirrors`] fills the rest later
/// (once for many products into one Hessian, instead of once per product).
pub(crate) fn queue_xtx_runs(
    client: &ComputeClient<CudaRuntime>,
    blas: &Cublas,
    x: &Bf16Matrix,
    runs: &[XtxRun],
    h: &MatrixView,
    blocking: XtxBlocking,
    mirror: bool,
) -> Result<(), KernelError> {
    let (tokens, dim) = check_xtx_operands(x, h)?;
    if let Some(r) = runs.iter().find(|r| r.first_row + r.rows > tokens) {
        return Err(KernelError::shape(
            "xtx runs",
            format!(
                "rows {}..{} of a {tokens}-row matrix",
                r.first_row,
                r.first_row + r.rows
            ),
        ));
    }
    if dim == 0 || runs.iter().all(|r| r.rows == 0) {
        return Ok(());
    }
    let groups = xtx_lower_blocks(dim, blocking);
    let x_ptr = handle_ptr(client, &x.handle)?;
    let h = XtxTarget::of(client, h)?;
    let lda = dim_i32("xtx dim", dim)?;
    let mut products = Vec::new();
    for run in runs.iter().filter(|r| r.rows > 0) {
        let first = x_ptr + (run.first_row * dim * 2) as u64;
        for g in &groups {
            // Column-major, Y = Xᵀ (dim × rows): C = Y_j·Y_iᵀ is the row-major block at
            // (rows i, columns j) of XᵀX.
            let call = GemmExCall {
                op1: cublasOperation_t::CUBLAS_OP_N,
                op2: cublasOperation_t::CUBLAS_OP_T,
                m: dim_i32("xtx block", g.cols)?,
                n: dim_i32("xtx block", g.rows)?,
                k: dim_i32("xtx tokens", run.rows)?,
                x1: (first + (g.col * 2) as u64, lda, cudaDataType::CUDA_R_16BF),
                x2: (first + (g.row * 2) as u64, lda, cudaDataType::CUDA_R_16BF),
                c: (h.at(g.row, g.col), h.ld()?, cudaDataType::CUDA_R_32F),
                alpha: run.weight,
                beta: 1.0,
                compute: cublasComputeType_t::CUBLAS_COMPUTE_32F,
            };
            // Block k + 1 starts `step` columns of x (both operands) and `step` rows and
            // columns of h after block k.
            let strides = (
                g.step as i64,
                g.step as i64,
                (g.step * (h.row_stride + 1)) as i64,
            );
            products.push((call, g.count, strides));
        }
    }
    let mirrors = match mirror {
        true => h.mirrors(&groups)?,
        false => Vec::new(),
    };
    blas.queue(client, "cublasGemmEx + cublasSgeam (bf16 XᵀX)", |handle| {
        for (call, count, strides) in &products {
            match count {
                1 => call.launch(handle)?,
                _ => call.launch_strided_batched(handle, *count, *strides)?,
            }
        }
        launch_mirrors(handle, &mirrors)
    })
}

/// Queues on `blas`'s stream the copies that fill the blocks above the diagonal of each
/// Hessian of `targets` from those below, as [`queue_xtx_runs`] leaves them with `mirror`
/// false under `blocking`: the Hessians must stay alive and untouched until the stream is done.
pub(crate) fn queue_xtx_mirrors(
    client: &ComputeClient<CudaRuntime>,
    blas: &Cublas,
    targets: &[XtxTarget],
    blocking: XtxBlocking,
) -> Result<(), KernelError> {
    let mut mirrors = Vec::new();
    for h in targets {
        mirrors.extend(h.mirrors(&xtx_lower_blocks(h.dim, blocking))?);
    }
    if mirrors.is_empty() {
        return Ok(());
    }
    blas.queue(client, "cublasSgeam (XᵀX mirror)", |handle| {
        launch_mirrors(handle, &mirrors)
    })
}

/// Where a Hessian `[dim, dim]` f32 lies on the device: what its products and mirrors address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct XtxTarget {
    /// Device address of entry `(0, 0)`.
    pub ptr: u64,
    /// Rows and columns.
    pub dim: usize,
    /// Elements from one row to the next.
    pub row_stride: usize,
}

impl XtxTarget {
    /// The window `h` (checked against its buffer).
    pub fn of(client: &ComputeClient<CudaRuntime>, h: &MatrixView) -> Result<Self, KernelError> {
        Ok(Self {
            ptr: device_ptr(client, h)?,
            dim: h.rows,
            row_stride: h.row_stride,
        })
    }

    /// The device address of entry `(row, col)`.
    fn at(&self, row: usize, col: usize) -> u64 {
        self.ptr + ((row * self.row_stride + col) * 4) as u64
    }

    /// The leading dimension cuBLAS reads.
    fn ld(&self) -> Result<i32, KernelError> {
        dim_i32("xtx row stride", self.row_stride)
    }

    /// One copy per block strictly below the diagonal of `groups`, transposed to the block
    /// above it (block `(j, i)` is the transpose of block `(i, j)`).
    fn mirrors(&self, groups: &[XtxBlocks]) -> Result<Vec<Mirror>, KernelError> {
        let mut mirrors = Vec::new();
        for g in groups {
            for (i0, j0) in g.origins().filter(|&(i0, j0)| i0 != j0) {
                mirrors.push(Mirror {
                    below: self.at(i0, j0),
                    above: self.at(j0, i0),
                    rows: dim_i32("xtx block", g.rows)?,
                    cols: dim_i32("xtx block", g.cols)?,
                    ld: self.ld()?,
                });
            }
        }
        Ok(mirrors)
    }
}

/// One block below the diagonal copied, transposed, above it.
#[derive(Debug, Clone, Copy)]
struct Mirror {
    below: u64,
    above: u64,
    /// Rows and columns of the block below.
    rows: i32,
    cols: i32,
    ld: i32,
}

/// Launches `mirrors` (`cublasSgeam`) on `handle`.
fn launch_mirrors(handle: sys::cublasHandle_t, mirrors: &[Mirror]) -> Result<(), KernelError> {
    let (one, zero) = (1.0f32, 0.0f32);
    for m in mirrors {
        // SAFETY: both blocks lie inside a checked Hessian window and do not overlap; the
        // destination doubles as the unread `B` (β = 0, in place: transb N, ldb = ldc).
        let status = unsafe {
            sys::cublasSgeam(
                handle,
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                m.rows,
                m.cols,
                &one,
                m.below as *const f32,
                m.ld,
                &zero,
                m.above as *const f32,
                m.ld,
                m.above as *mut f32,
                m.ld,
            )
        };
        status.result().map_err(blas_error("cublasSgeam"))?;
    }
    Ok(())
}

/// The shape of a linear layer's product `y = x·wᵀ`: `x` `[tokens, in_features]`, `w`
/// `[out_features, in_features]`, `y` `[tokens, out_features]`, all dense row-major.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearShape {
    /// Rows of `x` and `y`.
    pub tokens: usize,
    /// Columns of `x` and `w`.
    pub in_features: usize,
    /// Rows of `w`, columns of `y`.
    pub out_features: usize,
}

/// `y ← x·wᵀ` in bf16 (bf16 inputs and output, f32 accumulation: `CUBLAS_COMPUTE_32F`, as a
/// PyTorch bf16 linear), one `cublasGemmEx` on CubeCL buffers (`x`, `w`, `y` whole buffers of
/// bf16 values, row-major, per `shape`). Waits for CubeCL's queued work first and for the
/// product after, as every call of [`Cublas`] does.
pub fn linear_bf16(
    client: &ComputeClient<CudaRuntime>,
    blas: &Cublas,
    shape: LinearShape,
    x: &Handle,
    w: &Handle,
    y: &Handle,
) -> Result<(), KernelError> {
    linears_bf16(
        client,
        blas,
        shape.tokens,
        shape.in_features,
        x,
        &[LinearOutput {
            out_features: shape.out_features,
            w,
            y,
        }],
    )
}

/// One weight of [`linears_bf16`] and the buffer its product goes to.
#[derive(Debug, Clone, Copy)]
pub struct LinearOutput<'a> {
    /// Rows of `w`, columns of `y`.
    pub out_features: usize,
    /// The weight `[out_features, in_features]`, bf16, row-major.
    pub w: &'a Handle,
    /// The product `[tokens, out_features]`, bf16, row-major.
    pub y: &'a Handle,
}

/// `y_i ← x·w_iᵀ` in bf16 for several weights that read one input `x` `[tokens, in_features]`
/// (a layer's q, k, v and gate projections, or its MLP's gate and up): the products of
/// [`linear_bf16`], queued back to back on cuBLAS's stream. Waits for CubeCL's queued work
/// once before them and for cuBLAS's stream once after, where one [`linear_bf16`] each would
/// wait twice per product (each wait leaves the GPU idle until the host has queued the next
/// product). Every buffer is checked before anything is queued.
pub fn linears_bf16(
    client: &ComputeClient<CudaRuntime>,
    blas: &Cublas,
    tokens: usize,
    in_features: usize,
    x: &Handle,
    outputs: &[LinearOutput<'_>],
) -> Result<(), KernelError> {
    check_bf16_buffer("linear x", x, tokens, in_features)?;
    for out in outputs {
        check_bf16_buffer("linear w", out.w, out.out_features, in_features)?;
        check_bf16_buffer("linear y", out.y, tokens, out.out_features)?;
    }
    let calls = outputs
        .iter()
        .filter(|out| tokens > 0 && out.out_features > 0)
        .map(|out| linear_call(client, tokens, in_features, x, out))
        .collect::<Result<Vec<_>, _>>()?;
    if calls.is_empty() {
        return Ok(());
    }
    blas.run(client, "cublasGemmEx (bf16 linear)", |handle| {
        calls.iter().try_for_each(|call| call.launch(handle))
    })
}

/// Errors unless `handle` holds at least a `rows × cols` bf16 matrix; `what` names it.
pub(super) fn check_bf16_buffer(
    what: &'static str,
    handle: &Handle,
    rows: usize,
    cols: usize,
) -> Result<(), KernelError> {
    let needed = rows
        .checked_mul(cols)
        .and_then(|n| n.checked_mul(2))
        .ok_or_else(|| KernelError::shape(what, format!("{rows}×{cols} overflows")))?;
    let bytes = handle.size_in_used() as usize;
    if bytes < needed {
        return Err(KernelError::shape(
            what,
            format!("{bytes} bytes for a {rows}×{cols} bf16 matrix"),
        ));
    }
    Ok(())
}

/// The `cublasGemmEx` call of one product of [`linears_bf16`].
fn linear_call(
    client: &ComputeClient<CudaRuntime>,
    tokens: usize,
    in_features: usize,
    x: &Handle,
    out: &LinearOutput<'_>,
) -> Result<GemmExCall, KernelError> {
    // Row-major y [tokens, out] is column-major yᵀ (out × tokens, ld out) = w·xᵀ, where
    // row-major w [out, in] is column-major wᵀ (ld in, used transposed) and row-major x
    // [tokens, in] is column-major xᵀ (ld in).
    let ld_in = dim_i32("linear in_features", in_features.max(1))?;
    Ok(GemmExCall {
        op1: cublasOperation_t::CUBLAS_OP_T,
        op2: cublasOperation_t::CUBLAS_OP_N,
        m: dim_i32("linear out_features", out.out_features)?,
        n: dim_i32("linear tokens", tokens)?,
        k: dim_i32("linear in_features", in_features)?,
        x1: (handle_ptr(client, out.w)?, ld_in, cudaDataType::CUDA_R_16BF),
        x2: (handle_ptr(client, x)?, ld_in, cudaDataType::CUDA_R_16BF),
        c: (
            handle_ptr(client, out.y)?,
            dim_i32("linear out_features", out.out_features)?,
            cudaDataType::CUDA_R_16BF,
        ),
        alpha: 1.0,
        beta: 0.0,
        compute: cublasComputeType_t::CUBLAS_COMPUTE_32F,
    })
}
