//! SmoothQuant channel equalization for post-training quantization, model-agnostic.
//!
//! Smoothing divides an activation channel-wise by scales `s` and multiplies every weight that
//! reads it by `s`, so the layer computes the same function while activation outliers move into
//! the weights. This crate provides the pieces, on plain `f32` slices with explicit shapes:
//!
//! - [`ChannelStats`]: per-input-channel statistics (abs-max, per-sample-normalised `E[x²]` =
//!   `diag(H)`, `E|x|`), mergeable across samples and workers, a sample's sums splittable
//!   over threads ([`ChannelSums`]); sala-hessian's channel statistics are these;
//! - [`compute_scales`] with a [`ScaleRecipe`]: `s_j = act_j^α / wmax_j^(1−α)` and the original
//!   scripts' / SmoothQuant / AWQ normalisations;
//! - folding ([`fold_into_norm`], [`fold_into_input_columns`], [`fold_into_output_rows`]) and the
//!   Hessian transforms ([`transform_hessian`], [`transform_hessian_diag`]), all exact;
//! - [`SmoothGroup`] descriptions checked against a [`ReaderMap`] so a group cannot forget a
//!   reader of its source (the `o_gate` bug);
//! - [`smooth_group`]: the whole group in one call;
//! - [`search_alpha`]: AWQ's grid search of the migration strength α per group, on the
//!   quantized group's channel-weighted output error, with the caller's quantizer.
//!
//! Weights are row-major `[out, in]` ([`WeightMatrix`]), as `nn.Linear.weight` is stored.

mod apply;
mod error;
mod fold;
mod group;
mod matrix;
mod scales;
mod search;
mod stats;

pub use apply::{apply_scales, smooth_group, smooth_group_with_activation, SourceWeight};
pub use error::{Result, SmoothError};
pub use fold::{
    fold_into_input_columns, fold_into_norm, fold_into_output_rows, transform_hessian,
    transform_hessian_diag, HessianScalar,
};
pub use group::{validate_groups, ReaderMap, SmoothGroup, SmoothSource};
pub use matrix::WeightMatrix;
pub use scales::{compute_scales, weight_column_absmax, ClampRange, Normalisation, ScaleRecipe};
pub use search::{search_alpha, AlphaChoice, AlphaGrid};
pub use stats::{ActivationStat, ChannelStats, ChannelSums, Normalization};
