//! Fingerprints the kernels' source so that an on-disk cache of compiled kernels can be keyed
//! by it: CubeCL keys its PTX cache by kernel name and compile-time arguments only, so a cache
//! written by an older build would otherwise hand back the old machine code of a kernel whose
//! body changed.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};

/// Every file under `dir`, sorted.
fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            files(&path, out);
        } else {
            out.push(path);
        }
    }
}

fn main() {
    println!("cargo:rerun-if-changed=src");
    let mut paths = Vec::new();
    files(Path::new("src"), &mut paths);
    paths.sort();
    let mut hasher = DefaultHasher::new();
    env!("CARGO_PKG_VERSION").hash(&mut hasher);
    for path in &paths {
        path.hash(&mut hasher);
        // An unreadable file changes the fingerprint too (its read error is hashed instead).
        match std::fs::read(path) {
            Ok(bytes) => bytes.hash(&mut hasher),
            Err(e) => e.to_string().hash(&mut hasher),
        }
    }
    println!(
        "cargo:rustc-env=SALA_KERNELS_SOURCE_FINGERPRINT={:016x}",
        hasher.finish()
    );
}
