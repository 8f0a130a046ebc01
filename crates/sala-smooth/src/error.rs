//! The one error type of the crate.

use thiserror::Error;

use crate::stats::Normalization;

/// Everything that can go wrong when computing or folding smoothing scales.
///
/// Every variant names the tensor, group or statistic it is about, so a caller can report it
/// without adding context.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SmoothError {
    /// A buffer's length does not match the shape it was declared with.
    #[error("{what}: {rows}×{cols} needs {expected} values, the buffer has {actual}")]
    BufferSize {
        /// Which tensor (its name) or buffer.
        what: String,
        /// Declared rows.
        rows: usize,
        /// Declared columns.
        cols: usize,
        /// `rows · cols`.
        expected: usize,
        /// Length of the buffer handed in.
        actual: usize,
    },
    /// Two things that must have the same number of channels do not.
    #[error("{what}: has {actual} channels, expected {expected}")]
    ChannelCount {
        /// What was measured (a tensor name, "scales", "activation statistic", …).
        what: String,
        /// Channels expected (usually the length of the scale vector).
        expected: usize,
        /// Channels found.
        actual: usize,
    },
    /// A value that must be finite is NaN or infinite.
    #[error("{what}: channel {channel} holds the non-finite value {value}")]
    NonFinite {
        /// Which input.
        what: String,
        /// Channel (column) index.
        channel: usize,
        /// The offending value.
        value: f64,
    },
    /// A value that must be strictly positive (a smoothing scale) is not.
    #[error("{what}: channel {channel} holds {value}, which must be > 0")]
    NonPositive {
        /// Which input.
        what: String,
        /// Channel index.
        channel: usize,
        /// The offending value.
        value: f64,
    },
    /// A value that must be non-negative (an activation or weight magnitude) is negative.
    #[error("{what}: channel {channel} holds {value}, which must be >= 0")]
    Negative {
        /// Which input.
        what: String,
        /// Channel index.
        channel: usize,
        /// The offending value.
        value: f64,
    },
    /// The migration strength α lies outside `[0, 1]`.
    #[error("smoothing alpha must lie in [0, 1], got {0}")]
    Alpha(f32),
    /// A recipe parameter (floor or clamp bound) is not usable.
    #[error("scale recipe: {0}")]
    Recipe(String),
    /// Statistics normalised differently cannot be merged (their sums are weighted
    /// differently).
    #[error("merged statistics: normalised {actual:?}, expected {expected:?}")]
    NormalizationMismatch {
        /// The normalisation of the statistics merged into.
        expected: Normalization,
        /// The normalisation of the statistics merged.
        actual: Normalization,
    },
    /// Statistics were asked for before any sample was added.
    #[error("activation statistics hold no samples")]
    NoSamples,
    /// A sample with no tokens was handed to the statistics.
    #[error("a calibration sample must have at least one token")]
    EmptySample,
    /// A smoothing group lists no targets, or no target weights were handed in.
    #[error("smooth group {producer}: no target linears")]
    NoTargets {
        /// The group's source (norm or linear) name.
        producer: String,
    },
    /// The reader map does not know the group's source.
    #[error("smooth group {producer}: the source is not in the reader map")]
    UnknownSource {
        /// The group's source name.
        producer: String,
    },
    /// A linear reads the source's output but is not a target: folding `1/s` into the source
    /// would silently rescale that linear's input (the `o_gate` bug of the original scripts).
    #[error(
        "smooth group {producer}: {linear} reads the output of {producer} but is not among the \
         group's targets; folding would silently change its input"
    )]
    MissingReader {
        /// The group's source name.
        producer: String,
        /// The linear left out of the group.
        linear: String,
    },
    /// A target does not read the source's output, so scaling its columns would change it.
    #[error("smooth group {producer}: target {linear} does not read the output of {producer}")]
    NotAReader {
        /// The group's source name.
        producer: String,
        /// The target that does not read it.
        linear: String,
    },
    /// A target is listed twice in one group (it would be scaled twice).
    #[error("smooth group {producer}: target {linear} is listed twice")]
    DuplicateTarget {
        /// The group's source name.
        producer: String,
        /// The repeated target.
        linear: String,
    },
    /// Two groups smooth the same source.
    #[error("{producer} is the source of more than one smooth group")]
    DuplicateSource {
        /// The repeated source name.
        producer: String,
    },
}

/// Result alias of the crate.
pub type Result<T> = std::result::Result<T, SmoothError>;
