//! Test support: the device client (skipping with a notice without a driver, failing where
//! `SALA_REQUIRE_DEVICE_TESTS` is set) and seeded random inputs.

use std::sync::OnceLock;

use cubecl::prelude::ComputeClient;
use cubecl::Runtime;

/// The runtime the tests run on: wgpu (lavapipe in CI); CUDA when the `cuda` feature is on
/// (CI never enables it: that build is for a machine with an NVIDIA GPU).
#[cfg(not(feature = "cuda"))]
pub type TestRuntime = cubecl::wgpu::WgpuRuntime;
#[cfg(feature = "cuda")]
pub type TestRuntime = cubecl::cuda::CudaRuntime;

#[cfg(not(feature = "cuda"))]
const MISSING: &str = "The kernel tests need a Vulkan driver: install \
     `mesa-vulkan-drivers libvulkan1` (lavapipe, Mesa's software Vulkan driver), \
     e.g. `apt-get install -y mesa-vulkan-drivers libvulkan1`";
#[cfg(feature = "cuda")]
const MISSING: &str = "With the `cuda` feature the kernel tests need an NVIDIA GPU, its driver \
     and NVRTC on the library path";

/// Set (as `.ci/run` does) to make a missing device a failure instead of a skip.
const REQUIRE: &str = "SALA_REQUIRE_DEVICE_TESTS";

/// The client of the default device, or `None` when no device can be created: the test then
/// returns early, after a notice on standard error (once per test binary) saying what to
/// install. With `SALA_REQUIRE_DEVICE_TESTS` set it panics instead, so that CI cannot pass
/// without running the kernels.
pub fn client() -> Option<ComputeClient<TestRuntime>> {
    static OK: OnceLock<Result<(), String>> = OnceLock::new();
    let device = <TestRuntime as Runtime>::Device::default;
    let status = OK.get_or_init(|| {
        std::panic::catch_unwind(|| {
            let _ = TestRuntime::client(&device());
        })
        .map_err(|e| {
            e.downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default()
        })
    });
    match status {
        Ok(()) => Some(TestRuntime::client(&device())),
        Err(message) if std::env::var_os(REQUIRE).is_some() => {
            panic!("no device ({message}; the runtime's own panic is printed above). {MISSING}")
        }
        Err(message) => {
            skip_notice(message);
            None
        }
    }
}

/// The client, in helpers of tests that checked [`client`] first.
pub fn device_client() -> ComputeClient<TestRuntime> {
    client().expect("the test checks for a device before its helpers use it")
}

/// Says once, past the test harness's output capture (which only catches the print macros),
/// that the kernel tests are skipped and why.
fn skip_notice(message: &str) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "NOTICE: sala-kernels tests SKIPPED: no device ({message}). {MISSING}. \
             Set {REQUIRE}=1 to make this a failure (.ci/run does)."
        );
    });
}

/// A small deterministic generator (SplitMix64): reproducible inputs without a `rand`
/// dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in `[-1, 1)`.
    pub fn signed(&mut self) -> f32 {
        2.0 * self.uniform() - 1.0
    }

    /// Approximately standard normal (sum of 4 uniforms, rescaled).
    pub fn normal(&mut self) -> f32 {
        let s: f32 = (0..4).map(|_| self.uniform()).sum();
        (s - 2.0) * 1.732
    }

    /// `n` values in `[-1, 1)`.
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.signed()).collect()
    }
}

/// Largest `|a − b| / (|b| + floor)` over two slices of equal length.
pub fn max_rel_diff(a: &[f32], b: &[f64], floor: f64) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y).abs() / (y.abs() + floor))
        .fold(0.0, f64::max)
}
