//! Smoothing scales `s_j = act_j^α / wmax_j^(1−α)` and the recipes that normalise and clamp them.

use crate::error::{Result, SmoothError};
use crate::matrix::{check_channels, WeightMatrix};
use crate::stats::ActivationStat;
use rayon::prelude::*;

/// How the raw scales are normalised before the final clamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Normalisation {
    /// Leave them as they are (SmoothQuant).
    None,
    /// Divide by their arithmetic mean (the original scripts).
    Mean,
    /// Divide by `sqrt(max · min)`, centring them geometrically around 1 (AWQ).
    GeometricMidrange,
}

/// A closed range `[min, max]` that scales are clamped to; `f32::INFINITY` leaves a side open.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClampRange {
    /// Lower bound (≥ 0).
    pub min: f32,
    /// Upper bound (≥ `min`, may be `f32::INFINITY`).
    pub max: f32,
}

impl ClampRange {
    /// No clamping at all.
    pub const NONE: ClampRange = ClampRange {
        min: 0.0,
        max: f32::INFINITY,
    };

    /// `[min, max]`.
    pub const fn new(min: f32, max: f32) -> Self {
        Self { min, max }
    }

    /// `[min, ∞)`.
    pub const fn at_least(min: f32) -> Self {
        Self::new(min, f32::INFINITY)
    }

    fn apply(self, values: &mut [f32]) {
        for v in values {
            *v = v.clamp(self.min, self.max);
        }
    }

    fn validate(self, what: &str) -> Result<()> {
        if self.min >= 0.0 && self.min <= self.max && !self.min.is_nan() && !self.max.is_nan() {
            Ok(())
        } else {
            Err(SmoothError::Recipe(format!(
                "{what} clamp range [{}, {}] is not a range of non-negative numbers",
                self.min, self.max
            )))
        }
    }
}

/// Everything that turns activation and weight magnitudes into smoothing scales.
///
/// The pipeline, per channel `j`:
/// 1. `a = max(act_j, act_floor)`, `w = max(wmax_j, weight_floor)`;
/// 2. `s = a^α / w^(1−α)`, clamped to `raw_clamp`;
/// 3. all scales normalised together (`normalisation`);
/// 4. clamped to `final_clamp`.
///
/// The presets reproduce the published variants; the fields are public so a plan can mix them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScaleRecipe {
    /// Migration strength α in `[0, 1]`: 0 keeps activations as they are, 1 moves everything
    /// into the weights.
    pub alpha: f32,
    /// Which activation statistic is `act_j`.
    pub activation: ActivationStat,
    /// Lower bound applied to `act_j` before the power.
    pub act_floor: f32,
    /// Lower bound applied to `wmax_j` before the power.
    pub weight_floor: f32,
    /// Clamp applied to each raw scale, before normalisation.
    pub raw_clamp: ClampRange,
    /// How the scales are normalised.
    pub normalisation: Normalisation,
    /// Clamp applied after normalisation.
    pub final_clamp: ClampRange,
}

impl ScaleRecipe {
    /// The original scripts' `compute_smooth_factor`: `act = RMS` (`sqrt(diag(H)/nsamples)`),
    /// both magnitudes floored at 1e-8, scales divided by their mean, then clamped to `[0.01, 100]`.
    pub const fn original(alpha: f32) -> Self {
        Self {
            alpha,
            activation: ActivationStat::Rms,
            act_floor: 1e-8,
            weight_floor: 1e-8,
            raw_clamp: ClampRange::NONE,
            normalisation: Normalisation::Mean,
            final_clamp: ClampRange::new(0.01, 100.0),
        }
    }

    /// SmoothQuant (`smoothquant/smooth.py`): `act = max|x|`, `wmax` floored at 1e-5, raw scales
    /// clamped to ≥ 1e-5, no normalisation.
    pub const fn smoothquant(alpha: f32) -> Self {
        Self {
            alpha,
            activation: ActivationStat::AbsMax,
            act_floor: 0.0,
            weight_floor: 1e-5,
            raw_clamp: ClampRange::at_least(1e-5),
            normalisation: Normalisation::None,
            final_clamp: ClampRange::NONE,
        }
    }

    /// AWQ-style (AutoAWQ `duo_scaling`, ModelOpt `awq_lite`): `act = E|x|`, raw scales clamped to
    /// `[1e-4, 1e4]`, normalised by `sqrt(max · min)`.
    ///
    /// The weight magnitude is whatever the caller passes as `wmax` (AWQ uses a group-normalised
    /// mean of `|W|`; [`weight_column_absmax`] gives the column maximum), and the published
    /// `+1e-4` added to the weight term is a floor of 1e-4 here.
    pub const fn awq(alpha: f32) -> Self {
        Self {
            alpha,
            activation: ActivationStat::MeanAbs,
            act_floor: 0.0,
            weight_floor: 1e-4,
            raw_clamp: ClampRange::new(1e-4, 1e4),
            normalisation: Normalisation::GeometricMidrange,
            final_clamp: ClampRange::NONE,
        }
    }

    /// Checks α and the floors and clamp ranges.
    pub fn validate(&self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.alpha) {
            return Err(SmoothError::Alpha(self.alpha));
        }
        for (what, floor) in [("act", self.act_floor), ("weight", self.weight_floor)] {
            if !(floor >= 0.0 && floor.is_finite()) {
                return Err(SmoothError::Recipe(format!(
                    "{what} floor {floor} must be a finite number >= 0"
                )));
            }
        }
        self.raw_clamp.validate("raw")?;
        self.final_clamp.validate("final")
    }
}

/// Computes one smoothing scale per channel from activation magnitudes `act` and weight
/// magnitudes `wmax` (both `[channels]`, ≥ 0), following `recipe`.
///
/// Fails on mismatched lengths, negative or non-finite inputs, an invalid recipe, and when the
/// result holds a scale that is zero or not finite (e.g. all-zero activations with no floor),
/// since folding such a scale would destroy the layer.
pub fn compute_scales(recipe: &ScaleRecipe, act: &[f32], wmax: &[f32]) -> Result<Vec<f32>> {
    recipe.validate()?;
    check_channels("weight magnitudes", act.len(), wmax.len())?;
    check_magnitudes("activation magnitudes", act)?;
    check_magnitudes("weight magnitudes", wmax)?;

    let mut scales: Vec<f32> = act
        .iter()
        .zip(wmax)
        .map(|(&a, &w)| {
            let a = a.max(recipe.act_floor);
            let w = w.max(recipe.weight_floor);
            a.powf(recipe.alpha) / w.powf(1.0 - recipe.alpha)
        })
        .collect();
    recipe.raw_clamp.apply(&mut scales);
    normalise(recipe.normalisation, &mut scales);
    recipe.final_clamp.apply(&mut scales);
    check_positive("smoothing scales", &scales)?;
    Ok(scales)
}

/// `max over targets and rows of |W[:, j]|`: the per-input-channel weight magnitude of a group
/// of linears that read the same input (all must have the same number of columns).
pub fn weight_column_absmax(targets: &[WeightMatrix<'_>]) -> Result<Vec<f32>> {
    let Some(first) = targets.first() else {
        return Err(SmoothError::Recipe(
            "weight magnitudes need at least one target".to_owned(),
        ));
    };
    let mut wmax = vec![0.0f32; first.cols()];
    for target in targets {
        check_channels(target.name(), wmax.len(), target.cols())?;
        // Rows in parallel: a maximum does not depend on the order it is taken in.
        let partial = target
            .rows_par_iter()
            .fold(
                || vec![0.0f32; wmax.len()],
                |mut acc, row| {
                    for (m, &w) in acc.iter_mut().zip(row) {
                        *m = m.max(w.abs());
                    }
                    acc
                },
            )
            .reduce(
                || vec![0.0f32; wmax.len()],
                |mut a, b| {
                    for (x, y) in a.iter_mut().zip(b) {
                        *x = x.max(y);
                    }
                    a
                },
            );
        for (m, p) in wmax.iter_mut().zip(partial) {
            *m = m.max(p);
        }
    }
    check_magnitudes("weight magnitudes", &wmax)?;
    Ok(wmax)
}

fn normalise(normalisation: Normalisation, scales: &mut [f32]) {
    let divisor = match normalisation {
        Normalisation::None => return,
        Normalisation::Mean => {
            let sum: f64 = scales.iter().map(|&s| f64::from(s)).sum();
            (sum / scales.len().max(1) as f64) as f32
        }
        Normalisation::GeometricMidrange => {
            let max = scales.iter().copied().fold(f32::MIN, f32::max);
            let min = scales.iter().copied().fold(f32::MAX, f32::min);
            (f64::from(max) * f64::from(min)).sqrt() as f32
        }
    };
    for s in scales {
        *s /= divisor;
    }
}

/// Rejects negative and non-finite magnitudes, naming the channel.
fn check_magnitudes(what: &str, values: &[f32]) -> Result<()> {
    for (channel, &v) in values.iter().enumerate() {
        if !v.is_finite() {
            return Err(SmoothError::NonFinite {
                what: what.to_owned(),
                channel,
                value: f64::from(v),
            });
        }
        if v < 0.0 {
            return Err(SmoothError::Negative {
                what: what.to_owned(),
                channel,
                value: f64::from(v),
            });
        }
    }
    Ok(())
}

/// Rejects scales that are zero, negative or not finite, naming the channel.
pub(crate) fn check_positive(what: &str, scales: &[f32]) -> Result<()> {
    for (channel, &s) in scales.iter().enumerate() {
        if !s.is_finite() {
            return Err(SmoothError::NonFinite {
                what: what.to_owned(),
                channel,
                value: f64::from(s),
            });
        }
        if s <= 0.0 {
            return Err(SmoothError::NonPositive {
                what: what.to_owned(),
                channel,
                value: f64::from(s),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() <= 1e-6 * a.abs().max(b.abs()).max(1.0)
    }

    #[test]
    fn original_recipe_divides_by_mean_then_clamps() {
        // alpha = 0.5: raw s = sqrt(act / wmax) = [1, 2, 3, 1e-3·…]; mean-normalised, clamped.
        let act = [1.0, 4.0, 9.0];
        let wmax = [1.0, 1.0, 1.0];
        let s = compute_scales(&ScaleRecipe::original(0.5), &act, &wmax).unwrap();
        assert!(
            close(s[0], 0.5) && close(s[1], 1.0) && close(s[2], 1.5),
            "{s:?}"
        );

        // A channel far below the mean hits the 0.01 floor; one far above hits 100.
        let act = [1e-12, 1.0, 1.0, 1e12];
        let s = compute_scales(&ScaleRecipe::original(0.5), &act, &[1.0; 4]).unwrap();
        assert_eq!(s[0], 0.01);
        assert!(s[3] <= 100.0 && s[3] > 1.0);
    }

    #[test]
    fn smoothquant_recipe_is_unnormalised() {
        let s = compute_scales(&ScaleRecipe::smoothquant(0.5), &[4.0, 0.0], &[1.0, 1.0]).unwrap();
        assert!(close(s[0], 2.0));
        assert_eq!(s[1], 1e-5);
    }

    #[test]
    fn awq_recipe_centres_geometrically() {
        let s = compute_scales(&ScaleRecipe::awq(1.0), &[0.25, 4.0], &[1.0, 1.0]).unwrap();
        assert!(close(s[0], 0.25) && close(s[1], 4.0), "{s:?}");
        let geometric_centre = (s[0] * s[1]).sqrt();
        assert!(close(geometric_centre, 1.0));
    }

    #[test]
    fn alpha_zero_and_one_pick_one_side() {
        let act = [2.0, 8.0];
        let wmax = [4.0, 0.5];
        let mut recipe = ScaleRecipe::smoothquant(1.0);
        assert_eq!(
            compute_scales(&recipe, &act, &wmax).unwrap(),
            vec![2.0, 8.0]
        );
        recipe.alpha = 0.0;
        assert_eq!(
            compute_scales(&recipe, &act, &wmax).unwrap(),
            vec![0.25, 2.0]
        );
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        let r = ScaleRecipe::original(0.5);
        assert_eq!(
            compute_scales(&ScaleRecipe::original(1.5), &[1.0], &[1.0]),
            Err(SmoothError::Alpha(1.5))
        );
        assert!(matches!(
            compute_scales(&r, &[1.0, 2.0], &[1.0]),
            Err(SmoothError::ChannelCount {
                expected: 2,
                actual: 1,
                ..
            })
        ));
        assert!(matches!(
            compute_scales(&r, &[1.0, f32::NAN], &[1.0, 1.0]),
            Err(SmoothError::NonFinite { channel: 1, .. })
        ));
        assert!(matches!(
            compute_scales(&r, &[1.0, 1.0], &[-1.0, 1.0]),
            Err(SmoothError::Negative { channel: 0, .. })
        ));
        // No floor and no clamp: a dead channel gives a zero scale, which must be refused.
        let mut raw = ScaleRecipe::smoothquant(0.5);
        raw.raw_clamp = ClampRange::NONE;
        assert!(matches!(
            compute_scales(&raw, &[0.0, 1.0], &[1.0, 1.0]),
            Err(SmoothError::NonPositive { channel: 0, .. })
        ));
        let mut bad_clamp = r;
        bad_clamp.final_clamp = ClampRange::new(2.0, 1.0);
        assert!(matches!(
            compute_scales(&bad_clamp, &[1.0], &[1.0]),
            Err(SmoothError::Recipe(_))
        ));
    }

    #[test]
    fn column_absmax_spans_all_targets() {
        let mut a = vec![1.0, -5.0, 0.5, 2.0];
        let mut b = vec![-3.0, 1.0];
        let targets = [
            WeightMatrix::new("a", &mut a, 2, 2).unwrap(),
            WeightMatrix::new("b", &mut b, 1, 2).unwrap(),
        ];
        assert_eq!(weight_column_absmax(&targets).unwrap(), vec![3.0, 5.0]);

        let mut c = vec![1.0; 3];
        let mismatched = [
            WeightMatrix::new("a", &mut a, 2, 2).unwrap(),
            WeightMatrix::new("c", &mut c, 1, 3).unwrap(),
        ];
        assert!(matches!(
            weight_column_absmax(&mismatched),
            Err(SmoothError::ChannelCount { ref what, .. }) if what == "c"
        ));
    }
}
