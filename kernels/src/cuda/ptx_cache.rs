//! The PTX that NVRTC makes of the CUDA C++ kernels ([`HopperAttention`](super::HopperAttention),
//! [`MmaGla`](super::MmaGla)), kept on disk beside CubeCL's own kernel cache: a run after the
//! first loads it instead of compiling the source again, as CubeCL does for its kernels.
//!
//! An entry is keyed by a stable hash of the source, the compile options and NVRTC's version, so
//! an edited kernel, other options or another NVRTC compile afresh. The store is cubecl-common's
//! `CompilationCache` (a table of contents and an append-only chunk). A cache that cannot be
//! opened, read or written is skipped: the kernel is compiled as if there were none.

use std::path::PathBuf;

use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
use cubecl_common::cache::CacheOption;
use cubecl_common::compilation_cache::CompilationCache;
use cubecl_common::hash::{StableHash, StableHasher};
use cudarc::nvrtc::CompileOptions;

use crate::error::KernelError;

/// Where a kernel's PTX came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PtxOrigin {
    /// Read from the cache: an earlier run compiled the same source with the same options.
    Cache,
    /// Compiled by NVRTC now (and stored, where the cache could be written).
    Nvrtc,
}

/// An on-disk cache of NVRTC's PTX under one directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PtxCache {
    root: Option<PathBuf>,
}

impl PtxCache {
    /// The cache beside CubeCL's kernel cache: under the root of its `compilation.cache`
    /// setting (`sala_model::configure_cuda_runtime` sets `target/sala-kernels/<fingerprint>`
    /// of the Cargo project around the working directory); none where CubeCL keeps none, or
    /// where its configuration has not been read yet (this does not read it: that would fix it
    /// for the process before its owner could set it).
    pub fn beside_cubecl() -> Self {
        let root = std::panic::catch_unwind(|| {
            let state = CubeClRuntimeConfig::storage().lock();
            state
                .as_ref()
                .and_then(|config| config.compilation.cache.as_ref().map(|cache| cache.root()))
        })
        .ok()
        .flatten();
        Self { root }
    }

    /// A cache under `root`.
    pub fn at(root: impl Into<PathBuf>) -> Self {
        Self {
            root: Some(root.into()),
        }
    }

    /// No cache: every call compiles.
    pub fn none() -> Self {
        Self { root: None }
    }

    /// The PTX of `source` compiled with `options`: the cached text where there is one, else
    /// NVRTC's (then stored). `what` names the kernel in a compile error (NVRTC's log in the
    /// message).
    pub fn ptx(
        &self,
        source: &str,
        options: &CompileOptions,
        what: &'static str,
    ) -> Result<(String, PtxOrigin), KernelError> {
        let key = ptx_key(source, options, nvrtc_version().unwrap_or((0, 0)));
        self.get_or_compile(key, || {
            cudarc::nvrtc::compile_ptx_with_opts(source, options.clone())
                .map(|ptx| ptx.to_src())
                .map_err(|e| KernelError::Launch {
                    what,
                    message: format!("NVRTC compile: {e}"),
                })
        })
    }

    /// The text cached under `key`, else `compile`'s (then stored under `key`).
    fn get_or_compile(
        &self,
        key: StableHash,
        compile: impl FnOnce() -> Result<String, KernelError>,
    ) -> Result<(String, PtxOrigin), KernelError> {
        if let Some(text) = self.read(key) {
            return Ok((text, PtxOrigin::Cache));
        }
        let text = compile()?;
        self.write(key, &text);
        Ok((text, PtxOrigin::Nvrtc))
    }

    /// The cache's root where it is (or can be made) a directory. Checked before cubecl-common
    /// opens it, because its panics, though caught, print a panic message a user would take
    /// for a crash; a root that cannot be a directory is the usual way a cache is unusable.
    fn usable_root(&self) -> Option<PathBuf> {
        let root = self.root.as_ref()?;
        std::fs::create_dir_all(root).ok()?;
        Some(root.clone())
    }

    /// The cached text of `key`, if the cache opens and holds it.
    fn read(&self, key: StableHash) -> Option<String> {
        let root = self.usable_root()?;
        // cubecl-common panics on I/O errors: a cache that cannot be read is no cache.
        std::panic::catch_unwind(|| open(root).get(&key).cloned())
            .ok()
            .flatten()
    }

    /// Stores `text` under `key`, silently giving up where the cache cannot be written.
    fn write(&self, key: StableHash, text: &str) {
        if let Some(root) = self.usable_root() {
            let text = text.to_owned();
            let _ = std::panic::catch_unwind(move || open(root).insert(key, text).is_ok());
        }
    }
}

/// The cache's store under `root`.
fn open(root: PathBuf) -> CompilationCache<StableHash, String> {
    CompilationCache::new("ptx", CacheOption::default().name("sala-nvrtc").root(root))
}

/// The stable hash an entry is keyed by: of the source, the options and NVRTC's version.
fn ptx_key(source: &str, options: &CompileOptions, nvrtc: (i32, i32)) -> StableHash {
    StableHasher::hash_one(&(source, options, nvrtc, env!("CARGO_PKG_VERSION")))
}

/// The NVRTC library's `(major, minor)` version as it reports it, or why it could not
/// (`"not loaded"`, or `"unknown (status)"`).
pub fn nvrtc_version() -> Result<(i32, i32), String> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-pointers to live integers; cudarc loads the library on first use and
    // panics where it cannot, which is caught.
    let call = std::panic::AssertUnwindSafe(|| unsafe {
        cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor)
    });
    match std::panic::catch_unwind(call) {
        Ok(cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS) => Ok((major, minor)),
        Ok(rc) => Err(format!("unknown ({rc:?})")),
        Err(_) => Err("not loaded".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Another source, option or NVRTC gives another key; the same inputs the same key.
    #[test]
    fn keys_follow_the_source_the_options_and_nvrtc() {
        let options = CompileOptions {
            arch: Some("sm_90a"),
            ..Default::default()
        };
        let key = ptx_key("a", &options, (13, 0));
        assert_eq!(key, ptx_key("a", &options.clone(), (13, 0)));
        assert_ne!(key, ptx_key("b", &options, (13, 0)));
        assert_ne!(key, ptx_key("a", &options, (12, 9)));
        let other = CompileOptions {
            arch: Some("sm_80"),
            ..Default::default()
        };
        assert_ne!(key, ptx_key("a", &other, (13, 0)));
    }

    fn compiled(text: &str) -> impl FnOnce() -> Result<String, KernelError> + '_ {
        move || Ok(text.to_owned())
    }

    /// The second request of a key reads the first one's text (without compiling), another key
    /// compiles, and a new cache over the same directory (another run) reads both.
    #[test]
    fn a_second_request_reads_the_first_ones_text() {
        let root = std::env::temp_dir().join(format!("sala-ptx-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let cache = PtxCache::at(&root);
        let first = cache.get_or_compile(1, compiled("ptx one")).unwrap();
        assert_eq!(first, ("ptx one".to_owned(), PtxOrigin::Nvrtc));
        let never = || -> Result<String, KernelError> { panic!("compiled a cached key") };
        assert_eq!(
            cache.get_or_compile(1, never).unwrap(),
            ("ptx one".to_owned(), PtxOrigin::Cache)
        );
        let second = cache.get_or_compile(2, compiled("ptx two")).unwrap();
        assert_eq!(second.1, PtxOrigin::Nvrtc);
        let next_run = PtxCache::at(&root);
        assert_eq!(next_run.get_or_compile(2, never).unwrap().0, "ptx two");
        assert_eq!(next_run.get_or_compile(1, never).unwrap().0, "ptx one");
        let _ = std::fs::remove_dir_all(&root);
    }

    /// A cache that cannot be created (a file where its directory would be) compiles every time
    /// and passes a compile error on; no cache compiles every time.
    #[test]
    fn an_unusable_cache_compiles_every_time() {
        let blocker = std::env::temp_dir().join(format!("sala-ptx-file-{}", std::process::id()));
        std::fs::write(&blocker, b"a file").unwrap();
        for cache in [PtxCache::at(blocker.join("cache")), PtxCache::none()] {
            for _ in 0..2 {
                let (_, origin) = cache.get_or_compile(3, compiled("ptx")).unwrap();
                assert_eq!(origin, PtxOrigin::Nvrtc);
            }
            let failed = || {
                Err(KernelError::Launch {
                    what: "probe",
                    message: "NVRTC compile: bad".into(),
                })
            };
            assert!(cache.get_or_compile(4, failed).is_err());
        }
        let _ = std::fs::remove_file(&blocker);
    }
}
