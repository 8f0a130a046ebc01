//! Backends and devices: the GPU backend behind the `cuda` feature, and what a device reports
//! about its memory.

/// Memory held by a device's allocator at one moment, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct DeviceMemory {
    /// Bytes of live tensors (what the allocator has handed out).
    pub in_use: u64,
    /// Bytes the allocator has reserved from the driver (live tensors, padding and free pages
    /// kept for reuse): the device's actual footprint.
    pub reserved: u64,
}

impl DeviceMemory {
    /// The element-wise maximum of two readings (a running peak).
    pub fn max(self, other: Self) -> Self {
        Self {
            in_use: self.in_use.max(other.in_use),
            reserved: self.reserved.max(other.reserved),
        }
    }
}

/// The GPU backend: burn-cuda with bf16 as its default float type (autotune on; kernel fusion
/// with the `cuda-fusion` feature).
///
/// Run the model on it with [`Numerics::Bf16Storage`](crate::Numerics::Bf16Storage). Needs the
/// NVIDIA driver (libcuda is loaded when the first tensor is created), no toolkit at build time.
#[cfg(feature = "cuda")]
pub type CudaBackend = burn::backend::Cuda<half::bf16>;

/// A CUDA device (`CudaDevice::new(index)`; `Default` is device 0).
#[cfg(feature = "cuda")]
pub use burn::backend::cuda::CudaDevice;

/// The memory this process's allocators hold on `device` (not other processes' use): in use,
/// CubeCL's live buffers as seen from the calling thread's stream; reserved, the larger of
/// CubeCL's pools and the CUDA memory pool its stream-ordered allocations come from (which
/// keeps freed memory up to its release threshold). `None` if the runtime cannot answer.
#[cfg(feature = "cuda")]
pub fn cuda_memory(device: &CudaDevice) -> Option<DeviceMemory> {
    use cubecl::Runtime;
    let usage = cubecl::cuda::CudaRuntime::client(device)
        .memory_usage()
        .ok()?;
    let pool = sala_kernels::cuda::pool_reserved_bytes(device.index).unwrap_or(0);
    Some(DeviceMemory {
        in_use: usage.bytes_in_use,
        reserved: usage.bytes_reserved.max(pool),
    })
}

/// Where [`configure_cuda_runtime`] keeps compiled kernels: `target/sala-kernels/<fingerprint>`
/// of the Cargo project around the working directory (outside one, under the user's cache
/// directory).
#[cfg(feature = "cuda")]
pub fn kernel_cache_dir() -> std::path::PathBuf {
    cubecl::config::cache::CacheConfig::Target
        .root()
        .join("sala-kernels")
        .join(sala_kernels::KERNELS_SOURCE_FINGERPRINT)
}

/// Sets CubeCL's configuration for the CUDA path (a `cubecl.toml` in or above the working
/// directory is read first, and what it sets is kept):
///
/// - **Kernel cache.** Compiled PTX is kept on disk, so that a second run does not
///   JIT-compile every kernel again. The cache lives in `sala-kernels/<fingerprint>` under the
///   `target/` directory of the Cargo project around the working directory (next to the
///   autotune cache), the fingerprint being [`sala_kernels::KERNELS_SOURCE_FINGERPRINT`]:
///   CubeCL keys compiled kernels by name and compile-time arguments only, so a cache shared
///   with an older build would run the old code of any kernel whose body changed. A new build
///   starts cold (minutes of compilation once). Unless the file configures a cache.
/// - **Exact-size allocations.** Every device buffer comes from CubeCL's persistent pool:
///   `cuMemAllocAsync` at its own size, reused only for a buffer of the same size and given
///   back by [`Backend::memory_cleanup`](burn::tensor::backend::Backend::memory_cleanup).
///   CubeCL's default pools size their pages from the device's total memory and round a
///   buffer up to a page: 9.4 GB pages for anything between 0.6 and 4.7 GB on an H200, so
///   that 117 GB were reserved for 16 GB in use. Unless the file sets
///   `memory.persistent_memory` to something other than its default.
///
/// Must run before the first CUDA tensor exists; returns `false` (and changes nothing) when
/// CubeCL's configuration was already read.
#[cfg(feature = "cuda")]
pub fn configure_cuda_runtime() -> bool {
    use cubecl::config::cache::CacheConfig;
    use cubecl::config::memory::PersistentMemory;
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    let mut state = CubeClRuntimeConfig::storage().lock();
    if state.is_some() {
        return false;
    }
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    if config.compilation.cache.is_none() {
        config.compilation.cache = Some(CacheConfig::File(kernel_cache_dir()));
    }
    if matches!(config.memory.persistent_memory, PersistentMemory::Enabled) {
        config.memory.persistent_memory = PersistentMemory::Enforced;
    }
    *state = Some(std::sync::Arc::new(config));
    true
}
