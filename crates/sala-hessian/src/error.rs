//! The one error type of the crate: bad shapes, non-finite inputs, invalid options and a
//! Hessian that no amount of damping makes positive definite.

use rayon::prelude::*;
use sala_formats::FormatError;
use sala_smooth::SmoothError;
use thiserror::Error;

/// What went wrong while accumulating a Hessian, inverting it or quantizing a weight.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum HessianError {
    /// A buffer's length does not match the shape it was declared with.
    #[error("{what}: expected {expected} elements, got {actual}")]
    LengthMismatch {
        /// Which buffer.
        what: &'static str,
        /// Elements the shape implies.
        expected: usize,
        /// Elements given.
        actual: usize,
    },
    /// Two objects that must agree on a dimension do not.
    #[error("{what}: dimension {left} does not match {right}")]
    DimensionMismatch {
        /// What is being compared (e.g. "hessian vs weight columns").
        what: &'static str,
        /// The first dimension.
        left: usize,
        /// The second dimension.
        right: usize,
    },
    /// A matrix or batch with no rows or no columns.
    #[error("{what} is empty")]
    Empty {
        /// Which input.
        what: &'static str,
    },
    /// A NaN or infinite value in an input.
    #[error("{what} has a non-finite value {value} at row {row}, column {col}")]
    NonFinite {
        /// Which input ("hessian", "weights", "activations", ...).
        what: &'static str,
        /// Row of the offending element.
        row: usize,
        /// Column of the offending element.
        col: usize,
        /// The value (NaN or ±inf), as f64.
        value: f64,
    },
    /// A configuration value outside its valid range.
    #[error("invalid option {name} = {value}: {rule}")]
    InvalidOption {
        /// The option.
        name: &'static str,
        /// Its value, printed.
        value: String,
        /// What it must satisfy.
        rule: &'static str,
    },
    /// Accumulators built with different settings cannot be merged.
    #[error("cannot merge accumulators: {reason}")]
    MergeMismatch {
        /// Which setting differs.
        reason: &'static str,
    },
    /// The Cholesky factorization failed even with the largest damping tried.
    #[error(
        "hessian is not positive definite after {attempts} attempts \
         (last damping {last_damp:e} = {last_percdamp} x mean diagonal)"
    )]
    NotPositiveDefinite {
        /// Factorizations attempted (1 + retries).
        attempts: usize,
        /// Absolute damping `λ` of the last attempt.
        last_damp: f64,
        /// The last relative damping factor.
        last_percdamp: f64,
    },
    /// An error from the number formats (bits, group size, block shape).
    #[error(transparent)]
    Format(#[from] FormatError),
    /// An error from sala-smooth's channel statistics, which [`crate::ChannelStatsAccumulator`]
    /// adapts. The accumulator checks its inputs first and reports them as the variants
    /// above; this carries whatever sala-smooth refuses beyond those checks.
    #[error(transparent)]
    Smooth(#[from] SmoothError),
    /// A device (GPU) implementation of a solver failed: a launch, a read-back, an
    /// unsupported size. The message is the device layer's.
    #[error("device solver: {0}")]
    Device(String),
}

/// Checks a row-major `[rows, cols]` buffer: not empty and of the right length.
pub(crate) fn check_matrix(
    what: &'static str,
    len: usize,
    rows: usize,
    cols: usize,
) -> Result<(), HessianError> {
    if rows == 0 || cols == 0 {
        return Err(HessianError::Empty { what });
    }
    if len != rows * cols {
        return Err(HessianError::LengthMismatch {
            what,
            expected: rows * cols,
            actual: len,
        });
    }
    Ok(())
}

/// Returns an error naming the first non-finite element of a row-major matrix.
pub(crate) fn check_finite<T: Copy + Into<f64> + Sync>(
    what: &'static str,
    values: &[T],
    cols: usize,
) -> Result<(), HessianError> {
    // In parallel over chunks (weights reach 67M values; rayon's per-item search would check
    // a shared atomic for every value); the first bad chunk holds the first offender.
    const CHUNK: usize = 1 << 16;
    let first = values
        .par_chunks(CHUNK)
        .position_first(|c| c.iter().any(|&v| !v.into().is_finite()))
        .and_then(|k| {
            let start = k * CHUNK;
            values[start..]
                .iter()
                .position(|&v| !v.into().is_finite())
                .map(|i| start + i)
        });
    match first {
        None => Ok(()),
        Some(i) => Err(HessianError::NonFinite {
            what,
            row: i / cols,
            col: i % cols,
            value: values[i].into(),
        }),
    }
}
