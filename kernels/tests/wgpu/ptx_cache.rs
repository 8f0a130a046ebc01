//! The NVRTC PTX cache (CUDA only): a second compile of the same source and options reads the
//! first one's PTX from the cache, another source or option compiles afresh, and a cache that
//! cannot be written is skipped.

use cudarc::nvrtc::CompileOptions;
use sala_kernels::cuda::{PtxCache, PtxOrigin};

use crate::common::client;

const SOURCE: &str =
    r#"extern "C" __global__ void sala_ptx_cache_probe(float* x) { x[threadIdx.x] *= 2.0f; }"#;

fn options(arch: &'static str) -> CompileOptions {
    CompileOptions {
        arch: Some(arch),
        ..Default::default()
    }
}

#[test]
fn a_second_compile_reads_the_first_ones_ptx() {
    if client().is_none() {
        return;
    }
    let root = std::env::temp_dir().join(format!("sala-ptx-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let cache = PtxCache::at(&root);
    let (first, origin) = cache.ptx(SOURCE, &options("compute_80"), "probe").unwrap();
    assert_eq!(origin, PtxOrigin::Nvrtc);
    assert!(first.contains("sala_ptx_cache_probe"), "{first}");
    let (again, origin) = cache.ptx(SOURCE, &options("compute_80"), "probe").unwrap();
    assert_eq!((again.as_str(), origin), (first.as_str(), PtxOrigin::Cache));
    let (_, origin) = cache.ptx(SOURCE, &options("compute_90"), "probe").unwrap();
    assert_eq!(
        origin,
        PtxOrigin::Nvrtc,
        "another architecture compiles afresh"
    );
    let edited = SOURCE.replace("2.0f", "3.0f");
    let (_, origin) = cache.ptx(&edited, &options("compute_80"), "probe").unwrap();
    assert_eq!(origin, PtxOrigin::Nvrtc, "another source compiles afresh");
    let _ = std::fs::remove_dir_all(&root);
}

/// A cache under a path that cannot be a directory (a file is in the way) compiles every time
/// and never fails because of the cache; a source NVRTC rejects is an error naming the kernel.
#[test]
fn an_unwritable_cache_is_skipped_and_compile_errors_name_the_kernel() {
    if client().is_none() {
        return;
    }
    let blocker = std::env::temp_dir().join(format!("sala-ptx-blocker-{}", std::process::id()));
    std::fs::write(&blocker, b"not a directory").unwrap();
    let cache = PtxCache::at(blocker.join("cache"));
    for _ in 0..2 {
        let (_, origin) = cache.ptx(SOURCE, &options("compute_80"), "probe").unwrap();
        assert_eq!(origin, PtxOrigin::Nvrtc);
    }
    let err = PtxCache::none()
        .ptx("this is not CUDA", &options("compute_80"), "probe")
        .unwrap_err()
        .to_string();
    assert!(err.contains("probe") && err.contains("NVRTC"), "{err}");
    let _ = std::fs::remove_file(&blocker);
}
