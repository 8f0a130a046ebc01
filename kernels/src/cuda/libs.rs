//! Which NVIDIA libraries load on this machine, and why the others do not.
//!
//! cudarc tries a list of file names per library and panics when none loads; here the same
//! names are tried first, and the dynamic loader's own messages are kept: when the file is
//! found but one of *its* dependencies is not (libcusolver needs libcublasLt, libcusparse and
//! libnvJitLink), the message names that dependency.

use std::fmt;

/// The libraries the CUDA path uses: `(cudarc name, what needs it)`.
pub const CUDA_LIBRARIES: [(&str, &str); 5] = [
    ("cuda", "driver API (CubeCL runtime, contexts, streams)"),
    (
        "nvrtc",
        "run-time compilation of the CubeCL kernels and HopperAttention",
    ),
    ("cublas", "CublasGemm, xtx_bf16"),
    ("cublasLt", "loaded by cuBLAS; linear_residual_bf16"),
    ("cusolver", "inverse_upper_cusolver"),
];

/// Whether one library loads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibraryStatus {
    /// cudarc's name of the library (`"cublas"`, ...).
    pub name: &'static str,
    /// What needs it.
    pub used_by: &'static str,
    /// The file name that loaded, if one did.
    pub loaded: Option<String>,
    /// The candidate file names tried.
    pub candidates: Vec<String>,
    /// Loader messages other than "this candidate does not exist" (typically a missing
    /// dependency of a file that exists).
    pub errors: Vec<String>,
}

impl LibraryStatus {
    /// Whether the library loads.
    pub fn ok(&self) -> bool {
        self.loaded.is_some()
    }
}

impl fmt::Display for LibraryStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.loaded {
            Some(file) => write!(f, "{:<9} ok ({file}) — {}", self.name, self.used_by),
            None => {
                write!(
                    f,
                    "{:<9} NOT LOADED — {}; tried {:?}",
                    self.name, self.used_by, self.candidates
                )?;
                for e in &self.errors {
                    write!(f, "\n          loader: {e}")?;
                }
                write!(
                    f,
                    "\n          fix: add its directory (e.g. /usr/local/cuda/lib64) to LD_LIBRARY_PATH"
                )
            }
        }
    }
}

/// Tries to load every library of [`CUDA_LIBRARIES`] under cudarc's candidate names.
pub fn library_report() -> Vec<LibraryStatus> {
    CUDA_LIBRARIES
        .iter()
        .map(|&(name, used_by)| probe(name, used_by))
        .collect()
}

/// The status of one library (`name` as cudarc spells it).
pub(crate) fn probe(name: &'static str, used_by: &'static str) -> LibraryStatus {
    let candidates = cudarc::get_lib_name_candidates(name);
    let mut errors = Vec::new();
    for candidate in &candidates {
        // SAFETY: loading a vendor library runs its initialisers, as cudarc itself does
        // when it loads the same file by the same name.
        match unsafe { libloading::Library::new(candidate) } {
            Ok(_) => {
                return LibraryStatus {
                    name,
                    used_by,
                    loaded: Some(candidate.clone()),
                    candidates,
                    errors,
                }
            }
            Err(e) => {
                let message = with_sources(&e);
                // "<candidate>: cannot open shared object file" only says the name is absent.
                if !message.contains(&format!("{candidate}:")) && !errors.contains(&message) {
                    errors.push(message);
                }
            }
        }
    }
    LibraryStatus {
        name,
        used_by,
        loaded: None,
        candidates,
        errors,
    }
}

/// An error's message followed by those of its sources (libloading's own message is only
/// "dlopen failed"; the loader's text is its source).
fn with_sources(e: &dyn std::error::Error) -> String {
    let mut message = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    message
}

/// `Ok` when `name` loads, else an error carrying the report.
pub(crate) fn require(
    name: &'static str,
    used_by: &'static str,
) -> Result<(), crate::error::KernelError> {
    let status = probe(name, used_by);
    if status.ok() {
        Ok(())
    } else {
        Err(crate::error::KernelError::unsupported(
            "CUDA library",
            status.to_string(),
        ))
    }
}
