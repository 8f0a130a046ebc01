//! SmoothQuant on a decoder layer: the groups come from the model's wiring (every reader of a
//! source is a target by construction), the folding from `sala-smooth`.

use crate::error::PipelineError;
use sala_model::{HostTensor, InputGroup, InputSource, LayerWeights};
use sala_smooth::{ReaderMap, ScaleRecipe, SmoothGroup, SmoothSource, SourceWeight, WeightMatrix};

/// The smoothing group of a foldable input (its source and every reader); `None` for an input no
/// weight can absorb a scale into (an attention output).
pub fn smooth_group_of(group: &InputGroup) -> Option<SmoothGroup> {
    let targets: Vec<&str> = group.readers.iter().map(String::as_str).collect();
    match &group.source {
        InputSource::Norm { norm } => Some(SmoothGroup::norm(norm, &targets)),
        InputSource::UpProjection { linear } => Some(SmoothGroup::linear_output(linear, &targets)),
        InputSource::Opaque { .. } => None,
    }
}

/// Who reads what, from the model's wiring: the smoothing validator's ground truth.
pub fn reader_map(groups: &[InputGroup]) -> ReaderMap {
    let mut readers = ReaderMap::new();
    for g in groups {
        let names: Vec<&str> = g.readers.iter().map(String::as_str).collect();
        readers.add_all(g.source.name(), &names);
    }
    readers
}

/// Chooses the group's scales with `choose` (given the targets as they are) and folds them into
/// the source (`/s`) and every target's input columns (`·s`) in `weights`; returns the scales,
/// or `None` when `choose` keeps the group unsmoothed. Nothing changes unless every tensor is
/// present and every shape matches.
pub fn fold_group<F>(
    weights: &mut LayerWeights,
    group: &SmoothGroup,
    choose: F,
) -> Result<Option<Vec<f32>>, PipelineError>
where
    F: FnOnce(&[WeightMatrix<'_>]) -> sala_smooth::Result<Option<Vec<f32>>>,
{
    let source_name = format!("{}.weight", group.source.name());
    let smooth_err = |source| PipelineError::Smooth {
        group: group.source.name().to_owned(),
        source,
    };
    // Take the tensors out of the map so that the source and every target can be borrowed
    // mutably at once; they go back whatever happens.
    let mut source = take(weights, &source_name)?;
    let mut targets = Vec::new();
    for t in &group.targets {
        match take(weights, &format!("{t}.weight")) {
            Ok(tensor) => targets.push((format!("{t}.weight"), tensor)),
            Err(e) => {
                put_back(weights, source_name, source, targets);
                return Err(e);
            }
        }
    }
    let result = (|| {
        let mut matrices = targets
            .iter_mut()
            .map(|(name, t)| WeightMatrix::new(name, &mut t.data, t.shape[0], t.shape[1]))
            .collect::<Result<Vec<_>, _>>()?;
        let Some(scales) = choose(&matrices)? else {
            return Ok(None);
        };
        let source_weight = match &group.source {
            SmoothSource::Norm(_) => SourceWeight::Norm {
                name: &source_name,
                weight: &mut source.data,
            },
            SmoothSource::LinearOutput(_) => {
                let (rows, cols) = (source.shape[0], source.shape[1]);
                SourceWeight::LinearOutput(WeightMatrix::new(
                    &source_name,
                    &mut source.data,
                    rows,
                    cols,
                )?)
            }
        };
        sala_smooth::apply_scales(&scales, source_weight, &mut matrices)?;
        Ok(Some(scales))
    })()
    .map_err(smooth_err);
    put_back(weights, source_name.clone(), source, targets);
    result
}

/// The scales of a fixed `recipe` from the activation magnitudes `act` `[channels]`: a
/// chooser for [`fold_group`].
pub fn fixed_scales<'a>(
    recipe: &'a ScaleRecipe,
    act: &'a [f32],
) -> impl FnOnce(&[WeightMatrix<'_>]) -> sala_smooth::Result<Option<Vec<f32>>> + 'a {
    move |targets| {
        let wmax = sala_smooth::weight_column_absmax(targets)?;
        sala_smooth::compute_scales(recipe, act, &wmax).map(Some)
    }
}

fn take(weights: &mut LayerWeights, name: &str) -> Result<HostTensor, PipelineError> {
    weights.tensors.remove(name).ok_or_else(|| {
        PipelineError::Model(sala_model::ModelError::InvalidInput(format!(
            "tensor {name} is missing from layer {}",
            weights.layer
        )))
    })
}

fn put_back(
    weights: &mut LayerWeights,
    source_name: String,
    source: HostTensor,
    targets: Vec<(String, HostTensor)>,
) {
    weights.tensors.insert(source_name, source);
    weights.tensors.extend(targets);
}
