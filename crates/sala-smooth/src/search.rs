//! The activation-aware choice of the migration strength α (AWQ's grid search), per group.
//!
//! For each candidate α the group's scales `s` come from the recipe, every target is scaled
//! (`W[:, j]·s_j`) and quantized by the caller's quantizer, and the candidate is scored by the
//! group's output error in the original space, weighted per input channel:
//!
//! `Σ_targets Σ_i Σ_j d_j · (Q(W_ij·s_j)/s_j − W_ij)² = Σ … (d_j/s_j²) · (Q(W'_ij) − W'_ij)²`
//!
//! with `d_j = E[x_j²]` (the Hessian's diagonal). This is the output error `tr(ΔW H ΔWᵀ)` without
//! the Hessian's off-diagonal terms: it costs one quantization per weight and candidate, where
//! the full form costs a matrix product per candidate, and it keeps AWQ's trade-off (scaling a
//! channel up shrinks its own error by `s_j²` and widens its group's range). The unsmoothed
//! weights (`s = 1`) are a candidate too, so the choice is never worse than no smoothing on this
//! objective.

use crate::error::{Result, SmoothError};
use crate::matrix::{check_channels, WeightMatrix};
use crate::scales::{compute_scales, weight_column_absmax, ScaleRecipe};
use rayon::prelude::*;

/// The candidates of an α search: `points` values `α = k/points`, `k = 0..points` (AutoAWQ's and
/// llm-compressor's `n_grid = 20` gives 0, 0.05, …, 0.95), and the unsmoothed weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AlphaGrid {
    points: usize,
}

impl AlphaGrid {
    /// The peers' grid: 20 points.
    pub const DEFAULT: AlphaGrid = AlphaGrid { points: 20 };

    /// A grid of `points` values of α (at least 1, at most 1000).
    pub fn new(points: usize) -> Result<Self> {
        if !(1..=1000).contains(&points) {
            return Err(SmoothError::Recipe(format!(
                "an α grid needs 1 to 1000 points, not {points}"
            )));
        }
        Ok(Self { points })
    }

    /// Number of α values (the unsmoothed candidate not counted).
    pub fn points(&self) -> usize {
        self.points
    }

    /// The α values, ascending.
    pub fn alphas(&self) -> impl Iterator<Item = f32> + '_ {
        (0..self.points).map(move |k| k as f32 / self.points as f32)
    }
}

/// What the search chose for one group.
#[derive(Debug, Clone, PartialEq)]
pub struct AlphaChoice {
    /// The chosen α; `None` when the unsmoothed weights scored best (the group stays as it is).
    pub alpha: Option<f32>,
    /// The chosen scales `[channels]` (all 1 when `alpha` is `None`).
    pub scales: Vec<f32>,
    /// The chosen candidate's weighted error (see the module's documentation).
    pub error: f64,
    /// The unsmoothed weights' weighted error.
    pub unsmoothed_error: f64,
}

/// Scores every candidate of `grid` on `targets` and returns the best (ties: the unsmoothed
/// weights, then the smaller α). Nothing is modified; fold [`AlphaChoice::scales`] afterwards.
///
/// - `recipe`: the scale recipe; its `alpha` is replaced by each candidate's;
/// - `act`: the activation magnitudes the recipe uses `[channels]`;
/// - `channel_weights`: `d_j = E[x_j²]` `[channels]`, finite and ≥ 0;
/// - `targets`: every reader of the group's input (`[out, channels]` each);
/// - `weighted_error(name, scaled, rows, cols, column_weights)`: the caller's quantizer applied to
///   a scaled target (row-major `[rows, cols]`), returning `Σ c_j (Q(x) − x)²` with
///   `column_weights` `c` `[cols]`. A candidate it cannot quantize should score `+∞`.
pub fn search_alpha<F>(
    recipe: &ScaleRecipe,
    grid: AlphaGrid,
    act: &[f32],
    channel_weights: &[f32],
    targets: &[WeightMatrix<'_>],
    weighted_error: F,
) -> Result<AlphaChoice>
where
    F: Fn(&str, &[f32], usize, usize, &[f32]) -> f64,
{
    let wmax = weight_column_absmax(targets)?;
    check_channels("activation magnitudes", wmax.len(), act.len())?;
    check_channels("channel weights", wmax.len(), channel_weights.len())?;
    if let Some(j) = channel_weights
        .iter()
        .position(|d| !(d.is_finite() && *d >= 0.0))
    {
        return Err(SmoothError::Recipe(format!(
            "channel weight {j} is {}, not a finite number >= 0",
            channel_weights[j]
        )));
    }
    let largest = targets.iter().map(|t| t.data().len()).max().unwrap_or(0);
    let mut scaled = vec![0f32; largest];
    let mut score = |scales: &[f32]| -> f64 {
        let column_weights: Vec<f32> = channel_weights
            .iter()
            .zip(scales)
            .map(|(&d, &s)| d / (s * s))
            .collect();
        targets
            .iter()
            .map(|t| {
                let buffer = &mut scaled[..t.data().len()];
                scale_columns(t.data(), scales, buffer);
                weighted_error(t.name(), buffer, t.rows(), t.cols(), &column_weights)
            })
            .sum()
    };
    let ones = vec![1f32; wmax.len()];
    let unsmoothed_error = score(&ones);
    let mut best = AlphaChoice {
        alpha: None,
        scales: ones,
        error: unsmoothed_error,
        unsmoothed_error,
    };
    for alpha in grid.alphas() {
        let scales = compute_scales(&ScaleRecipe { alpha, ..*recipe }, act, &wmax)?;
        let error = score(&scales);
        // `<`: a tie keeps the earlier candidate; a NaN never wins.
        if error < best.error {
            best = AlphaChoice {
                alpha: Some(alpha),
                scales,
                error,
                unsmoothed_error,
            };
        }
    }
    Ok(best)
}

/// `out[i, j] = w[i, j]·s_j` for a row-major matrix of `s.len()` columns, rows in parallel.
fn scale_columns(w: &[f32], s: &[f32], out: &mut [f32]) {
    out.par_chunks_mut(s.len())
        .zip(w.par_chunks(s.len()))
        .for_each(|(o, row)| {
            for ((o, &x), &s) in o.iter_mut().zip(row).zip(s) {
                *o = x * s;
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rounds to a grid of step `step` per row: a stand-in quantizer whose error grows with the
    /// row's range, as a group-wise grid's does.
    fn row_grid_error(levels: f32) -> impl Fn(&str, &[f32], usize, usize, &[f32]) -> f64 {
        move |_, x, _, cols, c| {
            x.chunks(cols)
                .map(|row| {
                    let amax = row.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
                    let step = amax / levels;
                    row.iter()
                        .zip(c)
                        .map(|(&v, &c)| {
                            let q = (v / step).round() * step;
                            c as f64 * ((q - v) as f64).powi(2)
                        })
                        .sum::<f64>()
                })
                .sum()
        }
    }

    #[test]
    fn the_grid_is_the_peers_twenty_points() {
        let alphas: Vec<f32> = AlphaGrid::DEFAULT.alphas().collect();
        assert_eq!(alphas.len(), 20);
        assert_eq!(alphas[0], 0.0);
        assert_eq!(alphas[10], 0.5);
        assert!((alphas[19] - 0.95).abs() < 1e-6);
        assert!(AlphaGrid::new(0).is_err());
    }

    #[test]
    fn an_exact_quantizer_keeps_the_weights_unsmoothed() {
        let mut w = vec![1.0, 2.0, 3.0, 4.0];
        let targets = [WeightMatrix::new("t", &mut w, 2, 2).unwrap()];
        let choice = search_alpha(
            &ScaleRecipe::original(0.5),
            AlphaGrid::DEFAULT,
            &[1.0, 5.0],
            &[1.0, 25.0],
            &targets,
            |_, _, _, _, _| 0.0,
        )
        .unwrap();
        assert_eq!(choice.alpha, None);
        assert_eq!(choice.scales, vec![1.0, 1.0]);
    }

    #[test]
    fn a_salient_channel_is_scaled_up_and_the_error_falls() {
        // Channel 0 carries activations 100× larger than the others; every weight is of the
        // same size. Scaling channel 0 up is AWQ's whole point.
        let (rows, cols) = (8, 16);
        let mut w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 97) as f32 / 97.0 - 0.5) * 0.2)
            .collect();
        let targets = [WeightMatrix::new("t", &mut w, rows, cols).unwrap()];
        let mut act = vec![1.0f32; cols];
        act[0] = 100.0;
        let d: Vec<f32> = act.iter().map(|a| a * a).collect();
        let choice = search_alpha(
            &ScaleRecipe::original(0.5),
            AlphaGrid::DEFAULT,
            &act,
            &d,
            &targets,
            row_grid_error(7.0),
        )
        .unwrap();
        assert!(choice.alpha.is_some(), "{choice:?}");
        assert!(choice.error < choice.unsmoothed_error, "{choice:?}");
        let largest = choice.scales.iter().cloned().fold(0f32, f32::max);
        assert_eq!(choice.scales[0], largest, "{:?}", choice.scales);
    }

    #[test]
    fn the_choice_is_the_minimum_over_the_candidates() {
        let (rows, cols) = (4, 8);
        let mut a: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut b: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.11).cos()).collect();
        let targets = [
            WeightMatrix::new("a", &mut a, rows, cols).unwrap(),
            WeightMatrix::new("b", &mut b, rows, cols).unwrap(),
        ];
        let act: Vec<f32> = (0..cols).map(|j| 1.0 + j as f32).collect();
        let d: Vec<f32> = act.iter().map(|a| a * a).collect();
        let recipe = ScaleRecipe::original(0.5);
        let quantizer = row_grid_error(3.0);
        let choice =
            search_alpha(&recipe, AlphaGrid::DEFAULT, &act, &d, &targets, &quantizer).unwrap();
        let wmax = weight_column_absmax(&targets).unwrap();
        for alpha in AlphaGrid::DEFAULT.alphas() {
            let s = compute_scales(&ScaleRecipe { alpha, ..recipe }, &act, &wmax).unwrap();
            let c: Vec<f32> = d.iter().zip(&s).map(|(d, s)| d / (s * s)).collect();
            let error: f64 = targets
                .iter()
                .map(|t| {
                    let mut x = vec![0f32; t.data().len()];
                    scale_columns(t.data(), &s, &mut x);
                    quantizer(t.name(), &x, rows, cols, &c)
                })
                .sum();
            assert!(
                choice.error <= error,
                "α {alpha}: {error} < {}",
                choice.error
            );
        }
        assert!(choice.error <= choice.unsmoothed_error);
    }

    #[test]
    fn mismatched_channel_weights_are_an_error() {
        let mut w = vec![1.0; 4];
        let targets = [WeightMatrix::new("t", &mut w, 2, 2).unwrap()];
        let recipe = ScaleRecipe::original(0.5);
        let err = search_alpha(
            &recipe,
            AlphaGrid::DEFAULT,
            &[1.0, 1.0],
            &[1.0],
            &targets,
            |_, _, _, _, _| 0.0,
        )
        .unwrap_err();
        assert!(err.to_string().contains("channel weights"), "{err}");
        let err = search_alpha(
            &recipe,
            AlphaGrid::DEFAULT,
            &[1.0, 1.0],
            &[1.0, f32::NAN],
            &targets,
            |_, _, _, _, _| 0.0,
        )
        .unwrap_err();
        assert!(err.to_string().contains("channel weight 1"), "{err}");
    }
}
