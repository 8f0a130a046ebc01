//! CUDA-only glue to NVIDIA's libraries, on the buffers of CubeCL's CUDA runtime:
//!
//! - [`CublasGemm`]: the [`Gemm`](crate::Gemm) trait on cuBLAS (FP32 SGEMM through
//!   `cublasGemmEx`, pedantic FP32 by default, TF32 on request);
//! - [`xtx_bf16`]: `H ← α·XᵀX + β·H` for bf16 activations with f32 accumulation (the Hessian),
//!   and [`xtx_runs_bf16`], its sum over runs of rows with their own weights, computed on the
//!   blocks below the diagonal only;
//! - [`inverse_upper_cusolver`]: the upper Cholesky factor `U` of `H⁻¹` by one Cholesky and
//!   one triangular inverse (cuSOLVER), the factor GPTQ propagates its errors with;
//! - [`XtxStream`]: the same Hessian products queued on a stream of their own, so that they run
//!   beside the forward pass, each Hessian's upper blocks filled once when it is read;
//! - [`DriverTransfer`]: host ↔ device copies through the driver (CubeCL's pinned staging is
//!   slow for large buffers);
//! - [`blocked_causal_attention_bf16`]: causal GQA attention for long sequences, the products
//!   on cuBLAS (strided batched bf16 GEMMs) and the masked softmax a CubeCL kernel;
//! - [`linear_bf16`] and [`linears_bf16`]: a bf16 linear layer's product, or those of several
//!   weights that read one input, queued together between one pair of waits;
//! - [`linear_residual_bf16`]: a bf16 linear with a scaled residual added in its epilogue
//!   (cuBLASLt, the residual read but not overwritten);
//! - [`HopperAttention`]: causal GQA flash attention on Hopper's warpgroup tensor-core
//!   instructions, K and V staged by the tensor memory accelerator, persistent blocks,
//!   optionally with a sigmoid output gate in its epilogue, CUDA C++ compiled at run time by
//!   NVRTC for `sm_90a`;
//! - [`MmaGla`]: chunked Simple GLA on `mma.sync` with its fragments in registers, CUDA C++
//!   compiled at run time by NVRTC;
//! - [`StreamOrdering`]: whether the host or the device waits between CubeCL's stream and a
//!   library's;
//! - [`PtxCache`]: those two kernels' PTX kept beside CubeCL's kernel cache, so that a run
//!   after the first does not compile them again.
//!
//! CubeCL's CUDA runtime retains the device's *primary* context, and so does
//! [`cudarc::driver::CudaContext::new`]: both see one address space, so the device pointer of
//! a CubeCL buffer ([`device_ptr`]) can be handed to cuBLAS. CubeCL runs its kernels on its
//! own streams, the libraries here on a stream of their own; every call therefore waits for
//! CubeCL's queued work first ([`sync_client`]) and synchronizes its stream before it returns,
//! so work is ordered whatever runs next. The forward's libraries can keep that order on the
//! device instead ([`StreamOrdering::DeviceWaits`]: a counter each way, no host wait), for the
//! readers on CubeCL's stream.
//!
//! The libraries are loaded at run time (cudarc's dynamic loading): [`library_report`] says
//! which ones load and why the others do not (the dynamic loader's message names a missing
//! dependency such as `libnvJitLink`), and the constructors fail with that report instead of
//! panicking at the first call.

mod attention;
mod blas;
mod blas_lt;
mod fence;
mod gla_mma;
mod hopper_attention;
mod libs;
mod ptx_cache;
mod solver;
mod transfer;
mod xtx_stream;

pub use crate::hessian::{XtxBlocking, XTX_BLOCK};
pub use attention::{
    attention_blocking, blocked_causal_attention_bf16, AttentionBlocking, MAX_BLOCK, MIN_BLOCK,
    SCORE_BUDGET_BYTES,
};
pub use blas::{
    linear_bf16, linears_bf16, xtx_bf16, xtx_runs_bf16, xtx_runs_bf16_blocked, Bf16Matrix, Cublas,
    CublasGemm, Fp32Math, LinearOutput, LinearShape, XtxRun,
};
pub use blas_lt::{linear_residual_bf16, ResidualLinear, LT_WORKSPACE_BYTES};
pub use fence::StreamOrdering;
pub use gla_mma::MmaGla;
pub use hopper_attention::{HopperAttention, HOPPER_HEAD_DIM, HOPPER_ROWS_PER_BLOCK};
pub use libs::{library_report, LibraryStatus, CUDA_LIBRARIES};
pub use ptx_cache::{nvrtc_version, PtxCache, PtxOrigin};
pub use solver::{
    inverse_upper_cusolver, inverse_upper_cusolver_timed, Cusolver, CusolverFactorizer,
    InverseTimings,
};
pub use transfer::{DriverTransfer, STAGING_BYTES};
pub use xtx_stream::{XtxStream, XTX_IN_FLIGHT_BYTES};

use std::sync::Arc;

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use cubecl::server::Handle;
use cudarc::driver::{CudaContext, CudaStream};

use crate::device::MatrixView;
use crate::error::KernelError;

/// Bytes of one f32.
const F32_BYTES: u64 = 4;

/// The device address of byte 0 of `handle` (its own offsets applied), as cuBLAS takes it.
///
/// The pointer stays valid while `handle` (or a clone of it) is alive: the caller keeps the
/// buffer alive for as long as a library uses the pointer.
pub fn handle_ptr(
    client: &ComputeClient<CudaRuntime>,
    handle: &Handle,
) -> Result<u64, KernelError> {
    let resource = client
        .get_resource(handle.clone())
        .map_err(|e| KernelError::Launch {
            what: "device pointer (get_resource)",
            message: format!("{e:?}"),
        })?;
    // `GpuResource::ptr` already includes the storage offset and the handle's offset_start.
    Ok(resource.resource().ptr)
}

/// The device address of element `(0, 0)` of `view`: the buffer's address plus
/// `view.offset · 4` bytes. The window is checked against its buffer first.
pub fn device_ptr(
    client: &ComputeClient<CudaRuntime>,
    view: &MatrixView,
) -> Result<u64, KernelError> {
    view.check("device pointer")?;
    Ok(handle_ptr(client, &view.handle)? + view.offset as u64 * F32_BYTES)
}

/// Waits until every kernel and copy CubeCL queued on the calling thread's stream is done
/// (including the stream-ordered allocations behind pointers taken with [`device_ptr`]).
pub fn sync_client(client: &ComputeClient<CudaRuntime>) -> Result<(), KernelError> {
    cubecl::future::block_on(client.sync()).map_err(|e| KernelError::Launch {
        what: "cubecl sync",
        message: format!("{e:?}"),
    })
}

/// Free and total memory of CUDA device `ordinal`, bytes, as the driver reports them now
/// (other processes' allocations count as used). Retains the primary context, CubeCL's.
pub fn device_memory_info(ordinal: usize) -> Result<(u64, u64), KernelError> {
    let ctx = CudaContext::new(ordinal).map_err(|e| driver_error("CUDA context", e))?;
    ctx.bind_to_thread()
        .map_err(|e| driver_error("binding the CUDA context", e))?;
    let (free, total) =
        cudarc::driver::result::mem_get_info().map_err(|e| driver_error("cuMemGetInfo", e))?;
    Ok((free as u64, total as u64))
}

/// The default memory pool of CUDA device `ordinal`: where CubeCL's stream-ordered
/// allocations (`cuMemAllocAsync`) come from. Retains the primary context, CubeCL's.
fn default_memory_pool(
    ordinal: usize,
) -> Result<(Arc<CudaContext>, cudarc::driver::sys::CUmemoryPool), KernelError> {
    use cudarc::driver::sys;
    let ctx = CudaContext::new(ordinal).map_err(|e| driver_error("CUDA context", e))?;
    ctx.bind_to_thread()
        .map_err(|e| driver_error("binding the CUDA context", e))?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer and the device comes from a live context.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
        .result()
        .map_err(|e| driver_error("cuDeviceGetDefaultMemPool", e))?;
    Ok((ctx, pool))
}

/// Lets the default memory pool of device `ordinal` keep up to `bytes` of freed memory
/// across synchronizations (CUDA's default is 0: everything freed goes back to the driver at
/// the next synchronization, and is mapped again by the next allocation). With CubeCL
/// allocating every buffer at its exact size and the pipeline releasing them after each
/// pack, this is what makes the next pack's allocations cheap.
pub fn set_pool_release_threshold(ordinal: usize, bytes: u64) -> Result<(), KernelError> {
    use cudarc::driver::sys;
    let (_ctx, pool) = default_memory_pool(ordinal)?;
    let mut value = bytes;
    // SAFETY: the release threshold is a `cuuint64_t` attribute; `value` outlives the call.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut value as *mut u64).cast(),
        )
    }
    .result()
    .map_err(|e| driver_error("cuMemPoolSetAttribute", e))
}

/// The release threshold of the default memory pool of device `ordinal`, bytes (0, CUDA's
/// default, unless someone set it: [`set_pool_release_threshold`]).
pub fn pool_release_threshold(ordinal: usize) -> Result<u64, KernelError> {
    pool_attribute(
        ordinal,
        cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
    )
}

/// A `cuuint64_t` attribute of the default memory pool of device `ordinal`.
fn pool_attribute(
    ordinal: usize,
    attribute: cudarc::driver::sys::CUmemPool_attribute,
) -> Result<u64, KernelError> {
    use cudarc::driver::sys;
    let (_ctx, pool) = default_memory_pool(ordinal)?;
    let mut value = 0u64;
    // SAFETY: `attribute` is a `cuuint64_t` attribute; `value` outlives the call.
    unsafe { sys::cuMemPoolGetAttribute(pool, attribute, (&mut value as *mut u64).cast()) }
        .result()
        .map_err(|e| driver_error("cuMemPoolGetAttribute", e))?;
    Ok(value)
}

/// Bytes the default memory pool of device `ordinal` holds from the driver now (its live
/// allocations and the freed memory it keeps): the stream-ordered allocator's footprint.
pub fn pool_reserved_bytes(ordinal: usize) -> Result<u64, KernelError> {
    pool_attribute(
        ordinal,
        cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
    )
}

/// A context handle on the device's primary context and one non-blocking stream, shared by
/// the cuBLAS and cuSOLVER wrappers, and how the stream is ordered with CubeCL's.
#[derive(Debug)]
pub(crate) struct LibStream {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordering: fence::Ordering,
}

impl LibStream {
    /// Retains the primary context of device `ordinal` (CubeCL's) and creates a stream.
    pub(crate) fn new(ordinal: usize) -> Result<Self, KernelError> {
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_error("CUDA context", e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_error("CUDA stream", e))?;
        Ok(Self {
            ctx,
            stream,
            ordering: fence::Ordering::default(),
        })
    }

    /// Orders the stream with CubeCL's by `mode` from now on (host waits by default).
    pub(crate) fn set_ordering(&mut self, mode: StreamOrdering) {
        self.ordering = fence::Ordering::new(mode);
    }

    /// How this stream is ordered with CubeCL's.
    pub(crate) fn ordering(&self) -> StreamOrdering {
        self.ordering.mode()
    }

    /// The device's multiprocessors (at least one).
    pub(crate) fn multiprocessors(&self) -> Result<u32, KernelError> {
        let count = self
            .ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| driver_error("multiprocessor count", e))?;
        Ok(count.max(1) as u32)
    }

    /// Orders this stream's next work after the work CubeCL queued on the calling thread: the
    /// host waits for CubeCL ([`sync_client`]), or the stream waits on the device.
    pub(crate) fn after_cubecl(
        &self,
        client: &ComputeClient<CudaRuntime>,
    ) -> Result<(), KernelError> {
        self.ordering.library_after_cubecl(client, self)
    }

    /// Orders the calling thread's next CubeCL work after this stream's queued work: the host
    /// waits for the stream ([`LibStream::synchronize`]), or CubeCL waits on the device.
    /// `what` names the call in an error.
    pub(crate) fn before_cubecl(
        &self,
        client: &ComputeClient<CudaRuntime>,
        what: &'static str,
    ) -> Result<(), KernelError> {
        self.ordering.cubecl_after_library(client, self, what)
    }

    /// Makes the context current on the calling thread (CubeCL may have run on another).
    pub(crate) fn bind(&self) -> Result<(), KernelError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("binding the CUDA context", e))
    }

    /// Blocks until the stream's work is done.
    pub(crate) fn synchronize(&self, what: &'static str) -> Result<(), KernelError> {
        self.stream.synchronize().map_err(|e| driver_error(what, e))
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device's compute capability, `(major, minor)`.
    pub(crate) fn compute_capability(&self) -> Result<(i32, i32), KernelError> {
        self.ctx
            .compute_capability()
            .map_err(|e| driver_error("compute capability", e))
    }
}

fn driver_error(what: &'static str, e: cudarc::driver::DriverError) -> KernelError {
    KernelError::Launch {
        what,
        message: format!("{e:?}"),
    }
}

/// Errors unless a block on `ctx`'s device may have `bytes` of dynamic shared memory (the
/// opt-in limit); `what` names the kernel's device in the error.
pub(crate) fn require_shared_optin(
    ctx: &CudaContext,
    what: &'static str,
    bytes: u32,
) -> Result<(), KernelError> {
    let optin = ctx
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )
        .map_err(|e| driver_error("shared memory per block", e))?;
    if (optin as i64) < bytes as i64 {
        return Err(KernelError::unsupported(
            what,
            format!("{optin} bytes of shared memory per block ({bytes} needed)"),
        ));
    }
    Ok(())
}

/// A kernel module loaded on a context, with the PTX it was loaded from.
pub(crate) struct LoadedModule {
    pub(crate) module: Arc<cudarc::driver::CudaModule>,
    pub(crate) ptx: String,
    pub(crate) origin: PtxOrigin,
}

/// CUDA C++ `source` compiled by NVRTC with `options` (or its PTX from the [`PtxCache`] beside
/// CubeCL's kernel cache, where an earlier run compiled it) and loaded on `ctx`; `what` names
/// the kernel in the errors (the compile log in the message).
pub(crate) fn compile_module(
    ctx: &Arc<CudaContext>,
    source: &str,
    options: cudarc::nvrtc::CompileOptions,
    what: &'static str,
) -> Result<LoadedModule, KernelError> {
    let (ptx, origin) = PtxCache::beside_cubecl().ptx(source, &options, what)?;
    let module = ctx
        .load_module(cudarc::nvrtc::Ptx::from_src(ptx.clone()))
        .map_err(|e| driver_error(what, e))?;
    Ok(LoadedModule {
        module,
        ptx,
        origin,
    })
}

/// Function `name` of `module`, allowed `shared_bytes` of dynamic shared memory per block.
pub(crate) fn load_function(
    module: &Arc<cudarc::driver::CudaModule>,
    name: &str,
    shared_bytes: u32,
    what: &'static str,
) -> Result<cudarc::driver::CudaFunction, KernelError> {
    let function = module
        .load_function(name)
        .map_err(|e| driver_error(what, e))?;
    function
        .set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared_bytes as i32,
        )
        .map_err(|e| driver_error(what, e))?;
    Ok(function)
}

/// Runs a library call, turning a panic (cudarc panics when a library or a symbol cannot be
/// loaded) into a [`KernelError::Launch`].
pub(crate) fn guarded<T>(
    what: &'static str,
    f: impl FnOnce() -> Result<T, KernelError>,
) -> Result<T, KernelError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panic without a message".into());
        Err(KernelError::Launch { what, message })
    })
}

/// A dimension as the `i32` the legacy cuBLAS/cuSOLVER interfaces take.
pub(crate) fn dim_i32(what: &'static str, value: usize) -> Result<i32, KernelError> {
    i32::try_from(value).map_err(|_| {
        KernelError::unsupported(
            what,
            format!("{value} does not fit a 32-bit BLAS dimension"),
        )
    })
}
