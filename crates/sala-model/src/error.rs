//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while reading a model directory or running the graph.
///
/// Every variant names the file and, where there is one, the tensor, so that a user can find
/// the faulty input without a debugger.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be opened, mapped or read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating-system error.
        source: std::io::Error,
    },
    /// A JSON file (config or shard index) is malformed or lacks a required field.
    #[error("{path}: {message}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What serde reported (includes line and column).
        message: String,
    },
    /// The configuration parses but describes something invalid or unsupported.
    #[error("{path}: invalid config: {message}")]
    Config {
        /// The `config.json` file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A safetensors file has a malformed header.
    #[error("{path}: not a valid safetensors file: {message}")]
    Safetensors {
        /// The shard file.
        path: PathBuf,
        /// What the safetensors parser reported.
        message: String,
    },
    /// The shard index refers to a file outside the model directory.
    #[error("{index}: shard {shard:?} for tensor {tensor} is not a plain file name inside the model directory")]
    ShardOutsideDirectory {
        /// The `model.safetensors.index.json` file.
        index: PathBuf,
        /// The offending tensor.
        tensor: String,
        /// The file name as written in the index.
        shard: String,
    },
    /// A model file resolves, through symbolic links, outside the model directory.
    #[error("{path} resolves to {resolved}, outside the model directory {root}; copy the file into the model directory instead of linking to it")]
    OutsideModelDirectory {
        /// The file as named in the model directory.
        path: PathBuf,
        /// Where it resolves to.
        resolved: PathBuf,
        /// The directory it must stay in.
        root: PathBuf,
    },
    /// A tensor the configuration requires is absent.
    #[error("tensor {tensor} is missing from {path}")]
    MissingTensor {
        /// The model directory (or the shard the index points to).
        path: PathBuf,
        /// The tensor's full name.
        tensor: String,
    },
    /// A tensor has a shape other than the configuration implies.
    #[error("{path}: tensor {tensor} has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The shard file that holds the tensor.
        path: PathBuf,
        /// The tensor's full name.
        tensor: String,
        /// Shape in the file.
        found: Vec<usize>,
        /// Shape the configuration implies.
        expected: Vec<usize>,
    },
    /// A tensor is stored in a dtype this crate cannot read as weights.
    #[error("{path}: tensor {tensor} has dtype {dtype}, expected BF16, F16 or F32")]
    UnsupportedDtype {
        /// The shard file that holds the tensor.
        path: PathBuf,
        /// The tensor's full name.
        tensor: String,
        /// The dtype as safetensors names it.
        dtype: String,
    },
    /// A tensor contains NaN or infinite values.
    #[error("{path}: tensor {tensor} contains a non-finite value at flat index {index}")]
    NonFinite {
        /// The shard file that holds the tensor.
        path: PathBuf,
        /// The tensor's full name.
        tensor: String,
        /// First offending element (row-major).
        index: usize,
    },
    /// A caller-supplied argument is invalid (token id out of range, wrong hidden width, ...).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// A device kernel of a [`FastOps`](crate::FastOps) implementation refused its inputs or
    /// failed to launch.
    #[error("device kernel {op}: {message}")]
    Kernel {
        /// The operation (e.g. `causal attention`).
        op: &'static str,
        /// What went wrong.
        message: String,
    },
    /// A minicpm4 layer received a sequence at or beyond `dense_len` without dense mode.
    #[error(
        "layer {layer}: sequence of {tokens} tokens reaches sparse_config.dense_len = {dense_len}; \
         InfLLM-v2 sparse attention is not implemented, ask for dense mode (AttentionMode::Dense) explicitly"
    )]
    SparseAttentionRequired {
        /// The decoder layer index.
        layer: usize,
        /// Sequence length.
        tokens: usize,
        /// The configured threshold.
        dense_len: usize,
    },
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, ModelError>;
