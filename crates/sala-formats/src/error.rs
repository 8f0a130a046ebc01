//! The one error type of the crate: every shape rule and every invalid value has a variant.

use thiserror::Error;

/// What went wrong when encoding, packing or unpacking.
///
/// Every variant carries the numbers a user needs to find the problem (shapes, positions).
#[derive(Debug, Clone, PartialEq, Error)]
pub enum FormatError {
    /// A matrix with zero rows or zero columns.
    #[error("empty matrix: {rows} rows x {cols} cols")]
    EmptyMatrix {
        /// Rows given.
        rows: usize,
        /// Columns given.
        cols: usize,
    },
    /// The data length does not match the declared shape.
    #[error("{what}: expected {expected} elements, got {actual}")]
    LengthMismatch {
        /// Which buffer.
        what: &'static str,
        /// Elements the shape implies.
        expected: usize,
        /// Elements given.
        actual: usize,
    },
    /// A dimension is not a multiple of what the format needs.
    #[error("{what} = {value} is not divisible by {divisor}")]
    NotDivisible {
        /// Which dimension (e.g. "cols", "out features").
        what: &'static str,
        /// Its value.
        value: usize,
        /// The required divisor.
        divisor: usize,
    },
    /// A bit width the operation does not support.
    #[error("unsupported bit width {bits} (supported: {supported})")]
    UnsupportedBits {
        /// Requested bits.
        bits: u32,
        /// Human-readable list of supported widths.
        supported: &'static str,
    },
    /// A group size that is zero.
    #[error("group size must be positive")]
    ZeroGroupSize,
    /// Clipping-search settings out of range.
    #[error("clipping search: grid {grid} must be at least 1, max_shrink {max_shrink} in (0, 1), norm {norm} positive and finite")]
    InvalidClipSearch {
        /// Candidates per unit shrink.
        grid: u32,
        /// Largest shrink.
        max_shrink: f32,
        /// Error exponent.
        norm: f32,
    },
    /// A NaN or infinite value inside a block that is being quantized.
    #[error("non-finite value {value} at row {row}, column {col}")]
    NonFinite {
        /// Row of the offending element.
        row: usize,
        /// Column of the offending element.
        col: usize,
        /// The value (NaN or ±inf).
        value: f32,
    },
    /// A scale that is not a positive finite number.
    #[error("invalid {what} scale {value} (must be positive and finite)")]
    InvalidScale {
        /// Which scale (e.g. "global", "group").
        what: &'static str,
        /// The value.
        value: f32,
    },
    /// A code that does not fit in the bit width when packing or unpacking.
    #[error("code {code} at index {index} does not fit in {bits} bits")]
    CodeOutOfRange {
        /// The code value.
        code: u32,
        /// Its position in the flat buffer.
        index: usize,
        /// The bit width.
        bits: u32,
    },
    /// A group index outside `0..groups`.
    #[error("g_idx[{index}] = {group} is outside 0..{groups}")]
    GroupIndexOutOfRange {
        /// Input column.
        index: usize,
        /// The group it claims.
        group: i64,
        /// Number of groups.
        groups: usize,
    },
}
