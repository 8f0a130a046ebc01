//! Shape and value checks shared by every codec, so each rule is written once.

use crate::FormatError;
use rayon::prelude::*;

/// Checks that a row-major matrix buffer of `len` elements is `[rows, cols]` and not empty.
pub(crate) fn check_matrix(
    what: &'static str,
    len: usize,
    rows: usize,
    cols: usize,
) -> Result<(), FormatError> {
    if rows == 0 || cols == 0 {
        return Err(FormatError::EmptyMatrix { rows, cols });
    }
    check_len(what, len, rows * cols)
}

/// Checks a buffer length.
pub(crate) fn check_len(
    what: &'static str,
    actual: usize,
    expected: usize,
) -> Result<(), FormatError> {
    if actual != expected {
        return Err(FormatError::LengthMismatch {
            what,
            expected,
            actual,
        });
    }
    Ok(())
}

/// Checks that `value` is a multiple of `divisor`.
pub(crate) fn check_divisible(
    what: &'static str,
    value: usize,
    divisor: usize,
) -> Result<(), FormatError> {
    if value % divisor != 0 {
        return Err(FormatError::NotDivisible {
            what,
            value,
            divisor,
        });
    }
    Ok(())
}

/// Returns an error naming the first non-finite element of a row-major matrix with `cols` columns.
pub(crate) fn check_finite(values: &[f32], cols: usize) -> Result<(), FormatError> {
    // In parallel over chunks (weights reach 67M values; rayon's per-item search would check
    // a shared atomic for every value); the first bad chunk holds the first offender.
    const CHUNK: usize = 1 << 16;
    let first = values
        .par_chunks(CHUNK)
        .position_first(|c| c.iter().any(|v| !v.is_finite()))
        .and_then(|k| {
            let start = k * CHUNK;
            values[start..]
                .iter()
                .position(|v| !v.is_finite())
                .map(|i| start + i)
        });
    match first {
        None => Ok(()),
        Some(i) => Err(FormatError::NonFinite {
            row: i / cols,
            col: i % cols,
            value: values[i],
        }),
    }
}
