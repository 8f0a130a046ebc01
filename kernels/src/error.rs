//! The one error type of the crate: every bad input and every runtime failure is a
//! [`KernelError`]; no function panics on caller input.

use thiserror::Error;

/// What went wrong while checking, launching or reading back a kernel.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum KernelError {
    /// Operand shapes do not fit together (or a window leaves its buffer).
    #[error("shape mismatch in {what}: {detail}")]
    Shape {
        /// The operation or operand.
        what: &'static str,
        /// The numbers involved.
        detail: String,
    },
    /// A kernel could not be set up or launched (also asynchronous failures reported at the
    /// next flush).
    #[error("launching {what} failed: {message}")]
    Launch {
        /// The kernel.
        what: &'static str,
        /// The runtime's message.
        message: String,
    },
    /// Reading a buffer back to the host failed.
    #[error("reading {what} back failed: {message}")]
    Read {
        /// The buffer.
        what: &'static str,
        /// The runtime's message.
        message: String,
    },
    /// An option or input outside what the kernels support.
    #[error("unsupported {what}: {detail}")]
    Unsupported {
        /// The option.
        what: &'static str,
        /// Why.
        detail: String,
    },
    /// A Cholesky factorization met a non-positive pivot (more damping is needed).
    #[error(
        "the matrix is not positive definite: first failing column {column} (more damping needed)"
    )]
    NotPositiveDefinite {
        /// The first column (in the matrix's own order) whose pivot failed.
        column: usize,
    },
    /// Input rejected by the CPU crate's own validation (search options, quantizer).
    #[error(transparent)]
    Hessian(#[from] sala_hessian::HessianError),
    /// Input rejected by the formats crate (bit widths, group sizes).
    #[error(transparent)]
    Format(#[from] sala_formats::FormatError),
}

impl KernelError {
    /// A [`KernelError::Shape`] with a formatted detail.
    pub(crate) fn shape(what: &'static str, detail: impl Into<String>) -> Self {
        Self::Shape {
            what,
            detail: detail.into(),
        }
    }

    /// A [`KernelError::Unsupported`] with a formatted detail.
    pub(crate) fn unsupported(what: &'static str, detail: impl Into<String>) -> Self {
        Self::Unsupported {
            what,
            detail: detail.into(),
        }
    }
}

/// Submits the queued work and turns an asynchronous launch failure into an error.
///
/// CubeCL launches return nothing: a kernel that cannot run (too much shared memory, an
/// invalid binding) leaves the server unhealthy and is only reported here or at a read.
pub fn flush<R: cubecl::Runtime>(
    client: &cubecl::prelude::ComputeClient<R>,
    what: &'static str,
) -> Result<(), KernelError> {
    client.flush().map_err(|e| KernelError::Launch {
        what,
        message: format!("{e:?}"),
    })
}
