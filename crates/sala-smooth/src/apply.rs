//! One call that smooths a whole group: weight magnitudes, scales, and every fold.

use crate::error::{Result, SmoothError};
use crate::fold::{fold_into_input_columns, fold_into_norm, fold_into_output_rows};
use crate::matrix::{check_channels, WeightMatrix};
use crate::scales::{compute_scales, weight_column_absmax, ScaleRecipe};
use crate::stats::ChannelStats;

/// The weight that produces the smoothed activation, ready to absorb `1/s`.
#[derive(Debug)]
pub enum SourceWeight<'a> {
    /// A norm weight `[channels]` (see [`fold_into_norm`]).
    Norm {
        /// Tensor name, for errors.
        name: &'a str,
        /// The norm weight.
        weight: &'a mut [f32],
    },
    /// A linear `[channels, in]` whose output rows produce the activation
    /// (see [`fold_into_output_rows`]).
    LinearOutput(WeightMatrix<'a>),
}

impl SourceWeight<'_> {
    fn channels(&self) -> usize {
        match self {
            SourceWeight::Norm { weight, .. } => weight.len(),
            SourceWeight::LinearOutput(matrix) => matrix.rows(),
        }
    }

    fn name(&self) -> &str {
        match self {
            SourceWeight::Norm { name, .. } => name,
            SourceWeight::LinearOutput(matrix) => matrix.name(),
        }
    }

    fn fold(&mut self, scales: &[f32]) -> Result<()> {
        match self {
            SourceWeight::Norm { name, weight } => fold_into_norm(name, weight, scales),
            SourceWeight::LinearOutput(matrix) => fold_into_output_rows(matrix, scales),
        }
    }
}

/// Smooths one group in place and returns its scales `[channels]`.
///
/// `stats` are the statistics of the source's output (= every target's input); the recipe
/// picks the activation statistic. The weight magnitude is [`weight_column_absmax`] over all
/// targets. Afterwards `source` holds `·/s` and each target `W[:, j]·s_j`; transform the targets'
/// Hessians with the returned scales ([`crate::transform_hessian`]).
///
/// Nothing is modified unless every shape matches and the scales are valid.
pub fn smooth_group(
    recipe: &ScaleRecipe,
    stats: &ChannelStats,
    source: SourceWeight<'_>,
    targets: &mut [WeightMatrix<'_>],
) -> Result<Vec<f32>> {
    let act = stats.activation(recipe.activation)?;
    smooth_group_with_activation(recipe, &act, source, targets)
}

/// [`smooth_group`] with the activation magnitudes given directly (`[channels]`), e.g.
/// `sqrt(diag(H))` of a full Hessian collected elsewhere.
pub fn smooth_group_with_activation(
    recipe: &ScaleRecipe,
    act: &[f32],
    source: SourceWeight<'_>,
    targets: &mut [WeightMatrix<'_>],
) -> Result<Vec<f32>> {
    if targets.is_empty() {
        return Err(SmoothError::NoTargets {
            producer: source.name().to_owned(),
        });
    }
    check_channels(source.name(), act.len(), source.channels())?;
    let wmax = weight_column_absmax(targets)?;
    let scales = compute_scales(recipe, act, &wmax)?;
    apply_scales(&scales, source, targets)?;
    Ok(scales)
}

/// Folds given scales `[channels]` into a group: `source` gets `·/s`, each target `W[:, j]·s_j`
/// (e.g. the scales an [`crate::search_alpha`] chose). Nothing is modified unless every shape
/// matches.
pub fn apply_scales(
    scales: &[f32],
    mut source: SourceWeight<'_>,
    targets: &mut [WeightMatrix<'_>],
) -> Result<()> {
    check_channels(source.name(), scales.len(), source.channels())?;
    for target in targets.iter() {
        check_channels(target.name(), scales.len(), target.cols())?;
    }
    source.fold(scales)?;
    for target in targets.iter_mut() {
        fold_into_input_columns(target, scales)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_smoothing_folds_source_and_targets() {
        let mut stats = ChannelStats::new(2);
        stats.add_sample(&[4.0, 1.0], 1).unwrap();
        let mut norm = vec![1.0, 1.0];
        let mut q = vec![1.0, 1.0];
        let mut k = vec![1.0, 1.0];
        let mut targets = [
            WeightMatrix::new("q", &mut q, 1, 2).unwrap(),
            WeightMatrix::new("k", &mut k, 1, 2).unwrap(),
        ];
        let source = SourceWeight::Norm {
            name: "ln",
            weight: &mut norm,
        };
        let s = smooth_group(&ScaleRecipe::smoothquant(1.0), &stats, source, &mut targets).unwrap();
        assert_eq!(s, vec![4.0, 1.0]);
        assert_eq!(targets[0].data(), &[4.0, 1.0]);
        assert_eq!(targets[1].data(), &[4.0, 1.0]);
        assert_eq!(norm, vec![0.25, 1.0]);
    }

    #[test]
    fn mismatched_source_changes_nothing() {
        let mut norm = vec![1.0; 3];
        let mut q = vec![1.0, 1.0];
        let mut targets = [WeightMatrix::new("q", &mut q, 1, 2).unwrap()];
        let source = SourceWeight::Norm {
            name: "ln",
            weight: &mut norm,
        };
        let err = smooth_group_with_activation(
            &ScaleRecipe::original(0.5),
            &[1.0, 2.0],
            source,
            &mut targets,
        )
        .unwrap_err();
        assert!(err.to_string().contains("ln"), "{err}");
        assert_eq!(targets[0].data(), &[1.0, 1.0]);
        assert_eq!(norm, vec![1.0; 3]);
    }
}
