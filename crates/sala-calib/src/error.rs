//! Error types: one for the crate, one for what is wrong with a single JSONL line.

use std::path::PathBuf;

use thiserror::Error;

/// Everything that can go wrong while reading, rendering or tokenizing calibration data.
///
/// Every variant names the file (and the line, where there is one).
#[derive(Debug, Error)]
pub enum CalibError {
    /// A file could not be opened or read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A JSONL line is not a usable calibration record.
    #[error("{}:{line}: {reason}", path.display())]
    Malformed {
        /// The JSONL file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: LineError,
    },
    /// The file holds no usable record.
    #[error("{}: no calibration samples ({skipped} malformed lines skipped)", path.display())]
    NoSamples {
        /// The JSONL file.
        path: PathBuf,
        /// Lines skipped as malformed.
        skipped: usize,
    },
    /// The tokenizer could not be loaded or configured.
    #[error("{}: tokenizer: {message}", path.display())]
    Tokenizer {
        /// `tokenizer.json` (or the JSONL file the tokenizer was being configured for).
        path: PathBuf,
        /// The tokenizer's message.
        message: String,
    },
    /// The tokenizer failed on one record's text.
    #[error("{}:{line}: tokenizer: {message}", path.display())]
    Encode {
        /// The JSONL file.
        path: PathBuf,
        /// 1-based line number of the record.
        line: usize,
        /// The tokenizer's message.
        message: String,
    },
    /// A model-directory JSON file (`tokenizer_config.json`, `config.json`) has the wrong shape.
    #[error("{}: {message}", path.display())]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The chat template does not compile.
    #[error("{}: invalid chat template: {source}", path.display())]
    Template {
        /// Where the template came from.
        path: PathBuf,
        /// The template engine's error.
        #[source]
        source: minijinja::Error,
    },
    /// Rendering a `messages` record with the chat template failed.
    #[error("{}:{line}: chat template failed: {source}", path.display())]
    Render {
        /// The JSONL file.
        path: PathBuf,
        /// 1-based line number of the record.
        line: usize,
        /// The template engine's error.
        #[source]
        source: minijinja::Error,
    },
    /// An option value cannot work (e.g. `max_len` of 0).
    #[error("invalid calibration option: {0}")]
    Option(String),
}

/// Why one JSONL line is not a calibration record.
#[derive(Debug, Error)]
pub enum LineError {
    /// The line is not valid JSON.
    #[error("not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// The line is not valid UTF-8.
    #[error("not valid UTF-8")]
    Utf8,
    /// The line could not be read.
    #[error("cannot read: {0}")]
    Read(std::io::Error),
    /// The line is longer than the bound (bytes).
    #[error(
        "longer than {0} bytes; a calibration line is at most that long (is this a JSONL file?)"
    )]
    TooLong(usize),
    /// The file starts with a UTF-8 byte-order mark.
    #[error("starts with a UTF-8 byte-order mark (EF BB BF); save the file as UTF-8 without BOM")]
    ByteOrderMark,
    /// The line is JSON but not an object.
    #[error("not a JSON object")]
    NotAnObject,
    /// None of the fields the reader understands is present.
    #[error("no `question`, `text` or `messages` field")]
    NoTextField,
    /// A text field holds something other than a string.
    #[error("field `{0}` is not a string")]
    NotAString(&'static str),
    /// A text field is an empty string.
    #[error("field `{0}` is empty")]
    Empty(&'static str),
    /// `messages` is not a non-empty list of `{"role": string, "content": string}`.
    #[error(
        "`messages` must be a non-empty array of {{\"role\", \"content\"}} string objects: {0}"
    )]
    Messages(String),
}

/// Result alias of the crate.
pub type Result<T> = std::result::Result<T, CalibError>;
