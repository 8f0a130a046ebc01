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

/// The memory CubeCL's allocator holds on `device` (its pool, not other processes' use), as
/// seen from the calling thread's stream; `None` if the runtime cannot answer.
#[cfg(feature = "cuda")]
pub fn cuda_memory(device: &CudaDevice) -> Option<DeviceMemory> {
    use cubecl::Runtime;
    let usage = cubecl::cuda::CudaRuntime::client(device)
        .memory_usage()
        .ok()?;
    Some(DeviceMemory {
        in_use: usage.bytes_in_use,
        reserved: usage.bytes_reserved,
    })
}

/// Where [`enable_kernel_cache`] keeps compiled kernels: `target/sala-kernels/<fingerprint>`
/// of the Cargo project around the working directory (outside one, under the user's cache
/// directory).
#[cfg(feature = "cuda")]
pub fn kernel_cache_dir() -> std::path::PathBuf {
    cubecl::config::cache::CacheConfig::Target
        .root()
        .join("sala-kernels")
        .join(sala_kernels::KERNELS_SOURCE_FINGERPRINT)
}

/// Turns on CubeCL's on-disk kernel cache (compiled PTX) unless a `cubecl.toml` configures
/// it, so that a second run does not JIT-compile every kernel again. The cache lives in
/// `sala-kernels/<fingerprint>` under the `target/` directory of the Cargo project around the
/// working directory (next to the autotune cache), the fingerprint being
/// [`sala_kernels::KERNELS_SOURCE_FINGERPRINT`]: CubeCL keys compiled kernels by name and
/// compile-time arguments only, so a cache shared with an older build would run the old code
/// of any kernel whose body changed. A new build starts cold (minutes of compilation once).
/// Must run before the first CUDA tensor exists; returns `false` (and changes nothing) when
/// CubeCL's configuration was already read.
#[cfg(feature = "cuda")]
pub fn enable_kernel_cache() -> bool {
    use cubecl::config::cache::CacheConfig;
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    let mut state = CubeClRuntimeConfig::storage().lock();
    if state.is_some() {
        return false;
    }
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    if config.compilation.cache.is_none() {
        config.compilation.cache = Some(CacheConfig::File(kernel_cache_dir()));
    }
    *state = Some(std::sync::Arc::new(config));
    true
}
