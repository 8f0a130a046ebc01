//! `sala-quant`: the root package of the workspace. It owns the thin example binaries under
//! `examples/` and the end-to-end tests; the libraries live in `crates/` (see the README).

use std::path::PathBuf;

pub mod allocator;
pub mod device;
pub mod forward_cli;
pub mod full_size;
pub mod quantize_cli;
pub mod synthetic_cli;

/// The repository's `fixtures/` directory (bundled tiny models, calibration and held-out text).
///
/// Resolved from the package's manifest directory at compile time, so examples run from any
/// working directory.
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}
