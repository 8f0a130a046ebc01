//! The one error type of the crate: every variant that comes from a file names it.

use std::path::PathBuf;

/// Why a report could not be read or rendered.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A file could not be read.
    #[error("{}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file is not the JSON expected.
    #[error("{}: not the expected JSON: {source}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What serde said (it names the line, column and missing field).
        source: serde_json::Error,
    },
    /// A file parses but holds nothing usable.
    #[error("{}: {message}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A plot could not be drawn.
    #[error("plot {plot}: {message}")]
    Plot {
        /// Which plot.
        plot: &'static str,
        /// The plotting library's error.
        message: String,
    },
    /// The page template failed (a bug, not a user error; reported rather than a panic).
    #[error("report template: {0}")]
    Template(#[from] minijinja::Error),
}
