//! A bf16 linear whose epilogue adds a scaled residual, on cuBLASLt:
//! [`linear_residual_bf16`], `out ← hidden + scale · x·wᵀ`.
//!
//! A decoder layer ends each of its two halves with `hidden + scale · linear(x)`. As a
//! product and then an elementwise kernel, the sum reads the product back from memory
//! (`[tokens, hidden]` bf16, 128 MiB at 16,384 tokens of a 4096-wide model) and writes it again.
//! `cublasGemmEx` can add a `β·C`, but it writes its result over that C, which is the hidden
//! state the caller may still need (capture keeps a layer's input for the propagate pass).
//! cuBLASLt takes C (read) and D (written) apart, so the residual is read once, in the
//! product's epilogue, and the product is rounded once, after the sum.

use std::ffi::c_void;
use std::sync::MutexGuard;

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use cubecl::server::Handle;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys as lt_sys;
use cudarc::driver::{CudaSlice, DevicePtr};

use super::blas::check_bf16_buffer;
use super::LinearShape;
use super::{guarded, handle_ptr, libs, Cublas, LibStream};
use crate::error::KernelError;

/// Bytes of cuBLASLt's workspace: what NVIDIA recommends for Hopper (32 MiB), enough for the
/// others (4 MiB recommended).
pub const LT_WORKSPACE_BYTES: usize = 32 << 20;

/// The buffers of [`linear_residual_bf16`]: whole buffers of bf16 values, dense row-major,
/// per its [`LinearShape`].
#[derive(Debug, Clone, Copy)]
pub struct ResidualLinear<'a> {
    /// The input `[tokens, in_features]`.
    pub x: &'a Handle,
    /// The weight `[out_features, in_features]`.
    pub w: &'a Handle,
    /// The residual `[tokens, out_features]`: read, never written.
    pub hidden: &'a Handle,
    /// The sum `[tokens, out_features]`; a buffer of its own (not `hidden`'s).
    pub out: &'a Handle,
}

/// `out ← round(hidden + scale · x·wᵀ)` in bf16 (bf16 inputs, f32 accumulation and epilogue,
/// rounded once): one `cublasLtMatmul` with `α = scale`, `β = 1`, C = `hidden` and
/// D = `out`, on `blas`'s stream. Waits for CubeCL's queued work first and for the product
/// after, as every call of [`Cublas`] does; the descriptors and the algorithm are chosen
/// before the first wait, while CubeCL's work still runs. Every buffer is checked first.
pub fn linear_residual_bf16(
    client: &ComputeClient<CudaRuntime>,
    blas: &Cublas,
    shape: LinearShape,
    buffers: ResidualLinear<'_>,
    scale: f32,
) -> Result<(), KernelError> {
    let LinearShape {
        tokens,
        in_features,
        out_features,
    } = shape;
    check_bf16_buffer("linear residual x", buffers.x, tokens, in_features)?;
    check_bf16_buffer("linear residual w", buffers.w, out_features, in_features)?;
    check_bf16_buffer(
        "linear residual hidden",
        buffers.hidden,
        tokens,
        out_features,
    )?;
    check_bf16_buffer("linear residual out", buffers.out, tokens, out_features)?;
    if tokens == 0 || out_features == 0 {
        return Ok(());
    }
    let [x, w, hidden, out] =
        [buffers.x, buffers.w, buffers.hidden, buffers.out].map(|h| handle_ptr(client, h));
    let (x, w, hidden, out) = (x?, w?, hidden?, out?);
    let sum_bytes = (tokens * out_features * 2) as u64;
    if hidden < out + sum_bytes && out < hidden + sum_bytes {
        return Err(KernelError::shape(
            "linear residual out",
            "the sum needs a buffer of its own: it overlaps the residual",
        ));
    }
    let mut slot = blas.lt_slot();
    let lt_state: &LtState = match &mut *slot {
        Some(state) => state,
        empty => empty.insert(LtState::new(blas.lib())?),
    };
    let plan = guarded("cuBLASLt plan", || {
        LinearPlan::new(lt_state, shape, blas.sm_count_target()).map_err(lt_error("cuBLASLt plan"))
    })?;
    let lib = blas.lib();
    lib.after_cubecl(client)?;
    lib.bind()?;
    guarded("cublasLtMatmul (bf16 linear + residual)", || {
        let (alpha, beta) = (scale, 1.0f32);
        let stream = lib.stream();
        let (workspace, _record) = lt_state.workspace.device_ptr(stream);
        // SAFETY: the descriptors live in `plan` until after the call; `x`, `w`, `hidden` and
        // `out` are device addresses of buffers checked above to hold their matrices (the
        // handles outlive the call, which is synchronized below), `out` is not `hidden`, and
        // the workspace holds `LT_WORKSPACE_BYTES` on this stream's context.
        unsafe {
            lt::matmul(
                lt_state.handle,
                plan.desc.0,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                w as *const c_void,
                plan.a.0,
                x as *const c_void,
                plan.b.0,
                hidden as *const c_void,
                plan.cd.0,
                out as *mut c_void,
                plan.cd.0,
                &plan.algo,
                workspace as *mut c_void,
                LT_WORKSPACE_BYTES,
                stream.cu_stream() as _,
            )
        }
        .map_err(lt_error("cublasLtMatmul"))
    })?;
    drop(slot);
    lib.before_cubecl(client, "cublasLtMatmul (bf16 linear + residual)")
}

/// A cuBLASLt handle and its workspace, on a [`Cublas`]'s stream: made at the first
/// [`linear_residual_bf16`] (the forward's handle needs one, the Hessians' does not).
#[derive(Debug)]
pub(super) struct LtState {
    handle: lt_sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
}

impl LtState {
    /// A handle and a workspace of [`LT_WORKSPACE_BYTES`] on `lib`'s stream.
    pub(super) fn new(lib: &LibStream) -> Result<Self, KernelError> {
        libs::require("cublasLt", "linear_residual_bf16")?;
        guarded("cuBLASLt handle", || {
            lib.bind()?;
            let handle = lt::create_handle().map_err(lt_error("cublasLtCreate"))?;
            // SAFETY: bytes the library writes before it reads them.
            let workspace = unsafe { lib.stream().alloc::<u8>(LT_WORKSPACE_BYTES) };
            match workspace {
                Ok(workspace) => Ok(Self { handle, workspace }),
                Err(e) => {
                    // SAFETY: created above, destroyed once.
                    let _ = unsafe { lt::destroy_handle(handle) };
                    Err(super::driver_error("cuBLASLt workspace", e))
                }
            }
        })
    }
}

impl Drop for LtState {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once; errors at teardown are ignored.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

/// The lazily made [`LtState`] of a [`Cublas`], locked for one call.
pub(super) type LtSlot<'a> = MutexGuard<'a, Option<LtState>>;

/// The descriptors of one product and the algorithm cuBLASLt's heuristic picked for them.
struct LinearPlan {
    desc: MatmulDesc,
    a: Layout,
    b: Layout,
    cd: Layout,
    algo: lt_sys::cublasLtMatmulAlgo_t,
}

impl LinearPlan {
    /// Row-major `out [tokens, out] = hidden + scale · x·wᵀ` is column-major
    /// `outᵀ (out × tokens, ld out) = scale · w·xᵀ + hiddenᵀ`, where row-major `w [out, in]`
    /// is column-major `wᵀ` (in × out, ld in, used transposed) and row-major `x [tokens, in]`
    /// is column-major `xᵀ` (in × tokens, ld in).
    ///
    /// `sm_count_target` (0: all) is the multiprocessors the product is sized for.
    fn new(
        state: &LtState,
        shape: LinearShape,
        sm_count_target: i32,
    ) -> Result<Self, lt::CublasError> {
        let (m, n, k) = (
            shape.out_features as u64,
            shape.tokens as u64,
            shape.in_features as u64,
        );
        let bf16 = lt_sys::cudaDataType_t::CUDA_R_16BF;
        let desc = MatmulDesc(lt::create_matmul_desc(
            lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lt_sys::cudaDataType_t::CUDA_R_32F,
        )?);
        let transpose = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T;
        // SAFETY: TRANSA takes a `cublasOperation_t`, which outlives the call.
        unsafe {
            lt::set_matmul_desc_attribute(
                desc.0,
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&transpose as *const cudarc::cublas::sys::cublasOperation_t).cast(),
                std::mem::size_of::<cudarc::cublas::sys::cublasOperation_t>(),
            )?;
        }
        if sm_count_target > 0 {
            // SAFETY: SM_COUNT_TARGET takes an `i32`, which outlives the call.
            unsafe {
                lt::set_matmul_desc_attribute(
                    desc.0,
                    lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET,
                    (&sm_count_target as *const i32).cast(),
                    std::mem::size_of::<i32>(),
                )?;
            }
        }
        let a = Layout(lt::create_matrix_layout(bf16, k, m, k as i64)?);
        let b = Layout(lt::create_matrix_layout(bf16, k, n, k as i64)?);
        let cd = Layout(lt::create_matrix_layout(bf16, m, n, m as i64)?);
        let pref = Preference(lt::create_matmul_pref()?);
        let workspace = LT_WORKSPACE_BYTES as u64;
        // SAFETY: MAX_WORKSPACE_BYTES takes a `u64`, which outlives the call; the heuristic
        // reads descriptors made above.
        let heuristic = unsafe {
            lt::set_matmul_pref_attribute(
                pref.0,
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&workspace as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )?;
            lt::get_matmul_algo_heuristic(state.handle, desc.0, a.0, b.0, cd.0, cd.0, pref.0)?
        };
        Ok(Self {
            desc,
            a,
            b,
            cd,
            algo: heuristic.algo,
        })
    }
}

/// A matmul descriptor, destroyed on drop.
struct MatmulDesc(lt_sys::cublasLtMatmulDesc_t);

impl Drop for MatmulDesc {
    fn drop(&mut self) {
        // SAFETY: created once by `create_matmul_desc`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}

/// A matrix layout, destroyed on drop.
struct Layout(lt_sys::cublasLtMatrixLayout_t);

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created once by `create_matrix_layout`, destroyed once.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}

/// A heuristic's preferences, destroyed on drop.
struct Preference(lt_sys::cublasLtMatmulPreference_t);

impl Drop for Preference {
    fn drop(&mut self) {
        // SAFETY: created once by `create_matmul_pref`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

/// Maps a cuBLASLt status to [`KernelError::Launch`] naming the call.
fn lt_error(what: &'static str) -> impl Fn(lt::CublasError) -> KernelError {
    move |e| KernelError::Launch {
        what,
        message: format!("{e:?}"),
    }
}
