//! The crate's error type.

use std::path::PathBuf;

use sala_formats::FormatError;

/// Everything that can go wrong while writing or reading a checkpoint.
///
/// Every variant names the file, the tensor or the module involved, so that a user can find the
/// faulty input without a debugger.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// A file or directory could not be created, read, written or renamed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The operating-system error.
        source: std::io::Error,
    },
    /// A JSON file is malformed, lacks a required field, or is not the expected shape.
    #[error("{path}: {message}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What is wrong (serde's message includes line and column).
        message: String,
    },
    /// A safetensors file could not be parsed or written.
    #[error("{path}: safetensors: {message}")]
    Safetensors {
        /// The shard file.
        path: PathBuf,
        /// What the safetensors crate reported.
        message: String,
    },
    /// The output directory exists and overwriting was not requested.
    #[error("output directory {path} already exists (use --overwrite to replace it)")]
    TargetExists {
        /// The requested output directory.
        path: PathBuf,
    },
    /// The output directory is the source model directory or contains it.
    #[error(
        "refusing to write {target}: it is, contains or lies inside the source model directory {source_dir}"
    )]
    TargetIsSource {
        /// The requested output directory.
        target: PathBuf,
        /// The source model directory.
        source_dir: PathBuf,
    },
    /// The output exists but may not be replaced: it is not a checkpoint (no quantization
    /// config, no `quantization_report.json`), it is a file or a symbolic link, or it holds the
    /// working directory or another input of the run.
    #[error("refusing to overwrite {path}: {reason}")]
    NotReplaceable {
        /// The requested output directory.
        path: PathBuf,
        /// Why it is kept.
        reason: String,
    },
    /// Another run holds the lock on the same output.
    #[error("{target}: another run is writing this output (lock file {lock} is held{holder}); wait for it to finish or choose another output")]
    Locked {
        /// The requested output directory.
        target: PathBuf,
        /// The lock file next to it.
        lock: PathBuf,
        /// ` by process N` when the lock file names its holder, else empty.
        holder: String,
    },
    /// A file of the source model directory resolves, through symbolic links, outside it.
    #[error("{path} resolves to {resolved}, outside the model directory {root}; copy the file into the model directory instead of linking to it")]
    OutsideSource {
        /// The file as named in the model directory.
        path: PathBuf,
        /// Where it resolves to.
        resolved: PathBuf,
        /// The directory it must stay in.
        root: PathBuf,
    },
    /// A tensor's byte length does not match its dtype and shape.
    #[error("tensor {tensor}: {dtype} {shape:?} needs {expected} bytes, got {actual}")]
    TensorSize {
        /// Tensor name.
        tensor: String,
        /// Declared dtype.
        dtype: String,
        /// Declared shape.
        shape: Vec<usize>,
        /// Bytes implied by dtype and shape.
        expected: usize,
        /// Bytes given.
        actual: usize,
    },
    /// The same tensor name was written twice.
    #[error("tensor {tensor} written twice")]
    DuplicateTensor {
        /// Tensor name.
        tensor: String,
    },
    /// A quantized linear is internally inconsistent (shapes, codes, group indices).
    #[error("{module}: {source}")]
    Format {
        /// The linear (module name, e.g. `model.layers.0.mlp.up_proj`) or tensor.
        module: String,
        /// What `sala-formats` reported.
        source: FormatError,
    },
    /// A scale that is NaN, infinite, not positive, or that overflows its on-disk dtype.
    #[error("{tensor}: invalid scale {value} ({why})")]
    InvalidScale {
        /// Tensor name.
        tensor: String,
        /// The offending value.
        value: f32,
        /// Which condition it breaks.
        why: &'static str,
    },
    /// A linear whose layout does not fit the checkpoint (GPTQ and NVFP4 linears mixed, a
    /// `gptq_v2` zero convention in a `gptq` checkpoint, a config of the other format).
    #[error("{module}: {message}")]
    Layout {
        /// The module or file concerned.
        module: String,
        /// What does not fit.
        message: String,
    },
    /// A dtype the operation cannot convert.
    #[error("tensor {tensor}: dtype {dtype} is not supported here ({what})")]
    UnsupportedDtype {
        /// Tensor name.
        tensor: String,
        /// Its dtype.
        dtype: String,
        /// What was attempted.
        what: &'static str,
    },
    /// A tensor or module that the checkpoint does not contain.
    #[error("{dir}: no tensor or module named {name}")]
    Missing {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The name asked for.
        name: String,
    },
    /// The checkpoint's shards and index disagree (a file missing, a tensor not where the index
    /// says); each line is one problem.
    #[error("{dir}: inconsistent checkpoint:\n  {}", problems.join("\n  "))]
    Inconsistent {
        /// The checkpoint directory.
        dir: PathBuf,
        /// One line per problem.
        problems: Vec<String>,
    },
}

impl ExportError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| ExportError::Io { path, source }
    }

    pub(crate) fn format(module: &str) -> impl FnOnce(FormatError) -> Self + '_ {
        move |source| ExportError::Format {
            module: module.to_string(),
            source,
        }
    }
}
