//! Exact folding of smoothing scales into the weights around an activation, and the matching
//! Hessian transforms.
//!
//! Smoothing replaces an activation `x` by `x / s` (channel-wise) and every weight that reads it
//! by `W · diag(s)`, so `W·x` is unchanged. The division is folded into whatever produced `x`.

use std::ops::{Div, MulAssign};

use rayon::prelude::*;

use crate::error::{Result, SmoothError};
use crate::matrix::{check_channels, WeightMatrix};
use crate::scales::check_positive;

/// Folds `1/s` into a per-channel vector that multiplies the activation: an RMSNorm weight
/// (`w_j /= s_j`), or a bias added to it. `weight` and `scales` are `[channels]`.
pub fn fold_into_norm(name: &str, weight: &mut [f32], scales: &[f32]) -> Result<()> {
    check_channels(name, scales.len(), weight.len())?;
    check_positive("scales", scales)?;
    for (w, &s) in weight.iter_mut().zip(scales) {
        *w /= s;
    }
    Ok(())
}

/// Folds `s` into the input columns of a linear that reads the smoothed activation:
/// `W[:, j] *= s_j` (`W` is `[out, in]`, `scales` is `[in]`).
pub fn fold_into_input_columns(weight: &mut WeightMatrix<'_>, scales: &[f32]) -> Result<()> {
    check_channels(weight.name(), scales.len(), weight.cols())?;
    check_positive("scales", scales)?;
    weight.rows_par_iter_mut().for_each(|row| {
        for (w, &s) in row.iter_mut().zip(scales) {
            *w *= s;
        }
    });
    Ok(())
}

/// Folds `1/s` into the output rows of the linear that produces the activation:
/// `W[j, :] /= s_j` (`W` is `[out, in]`, `scales` is `[out]`).
///
/// Exact only when everything between this linear's output and its readers is linear in it
/// channel by channel (e.g. `up` in `down(act(gate(x)) · up(x))`). If the linear has a bias, fold
/// the same scales into it with [`fold_into_norm`].
pub fn fold_into_output_rows(weight: &mut WeightMatrix<'_>, scales: &[f32]) -> Result<()> {
    check_channels(weight.name(), scales.len(), weight.rows())?;
    check_positive("scales", scales)?;
    weight
        .rows_par_iter_mut()
        .zip(scales)
        .for_each(|(row, &s)| {
            for w in row {
                *w /= s;
            }
        });
    Ok(())
}

/// An element type of a Hessian buffer (f32 or f64).
pub trait HessianScalar: Copy + MulAssign + Div<Output = Self> + From<f32> {}
impl HessianScalar for f32 {}
impl HessianScalar for f64 {}

/// Transforms a full Hessian `H = XᵀX` (row-major `[n, n]`) of a linear's input into the Hessian
/// of the smoothed input `X·diag(1/s)`: `H ← diag(1/s)·H·diag(1/s)`, i.e. `H[i][k] /= s_i·s_k`.
///
/// The reciprocals are formed in the Hessian's own precision, so an f64 Hessian loses nothing.
pub fn transform_hessian<T: HessianScalar>(
    hessian: &mut [T],
    n: usize,
    scales: &[f32],
) -> Result<()> {
    if n.checked_mul(n) != Some(hessian.len()) {
        return Err(SmoothError::BufferSize {
            what: "hessian".to_owned(),
            rows: n,
            cols: n,
            expected: n.saturating_mul(n),
            actual: hessian.len(),
        });
    }
    check_channels("scales", n, scales.len())?;
    check_positive("scales", scales)?;
    let inverse = reciprocals::<T>(scales);
    for (row, &inv_i) in hessian.chunks_exact_mut(n.max(1)).zip(&inverse) {
        for (h, &inv_k) in row.iter_mut().zip(&inverse) {
            *h *= inv_i;
            *h *= inv_k;
        }
    }
    Ok(())
}

/// Transforms a diagonal Hessian `diag(H) = E[x²]` (`[n]`) into that of the smoothed input:
/// `d_j /= s_j²`.
pub fn transform_hessian_diag<T: HessianScalar>(diag: &mut [T], scales: &[f32]) -> Result<()> {
    check_channels("scales", diag.len(), scales.len())?;
    check_positive("scales", scales)?;
    for (d, inv) in diag.iter_mut().zip(reciprocals::<T>(scales)) {
        *d *= inv;
        *d *= inv;
    }
    Ok(())
}

fn reciprocals<T: HessianScalar>(scales: &[f32]) -> Vec<T> {
    scales.iter().map(|&s| T::from(1.0) / T::from(s)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folds_touch_the_right_axis() {
        let mut data = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]; // [2 out, 3 in]
        let mut w = WeightMatrix::new("w", &mut data, 2, 3).unwrap();
        fold_into_input_columns(&mut w, &[1.0, 2.0, 4.0]).unwrap();
        assert_eq!(w.data(), &[1.0, 4.0, 12.0, 4.0, 10.0, 24.0]);
        fold_into_output_rows(&mut w, &[1.0, 2.0]).unwrap();
        assert_eq!(w.data(), &[1.0, 4.0, 12.0, 2.0, 5.0, 12.0]);

        let mut norm = vec![2.0, 8.0];
        fold_into_norm("norm", &mut norm, &[2.0, 4.0]).unwrap();
        assert_eq!(norm, vec![1.0, 2.0]);
    }

    #[test]
    fn shape_errors_name_the_tensor() {
        let mut data = vec![0.0; 6];
        let mut w = WeightMatrix::new("mlp.up_proj", &mut data, 2, 3).unwrap();
        let err = fold_into_input_columns(&mut w, &[1.0, 1.0]).unwrap_err();
        assert!(err.to_string().contains("mlp.up_proj"), "{err}");
        assert!(matches!(
            fold_into_output_rows(&mut w, &[1.0, 1.0, 1.0]),
            Err(SmoothError::ChannelCount {
                expected: 3,
                actual: 2,
                ..
            })
        ));
        assert!(matches!(
            fold_into_input_columns(&mut w, &[1.0, 0.0, 1.0]),
            Err(SmoothError::NonPositive { channel: 1, .. })
        ));
        let mut short = vec![0.0; 5];
        assert!(matches!(
            WeightMatrix::new("q_proj", &mut short, 2, 3),
            Err(SmoothError::BufferSize {
                expected: 6,
                actual: 5,
                ..
            })
        ));
        let mut h = vec![0.0f64; 8];
        assert!(matches!(
            transform_hessian(&mut h, 3, &[1.0; 3]),
            Err(SmoothError::BufferSize { .. })
        ));
    }

    #[test]
    fn hessian_transforms_agree_on_the_diagonal() {
        let scales = [0.5, 2.0];
        let mut full = vec![4.0f64, 1.0, 1.0, 16.0];
        let mut diag = vec![4.0f64, 16.0];
        transform_hessian(&mut full, 2, &scales).unwrap();
        transform_hessian_diag(&mut diag, &scales).unwrap();
        assert_eq!(full, vec![16.0, 1.0, 1.0, 4.0]);
        assert_eq!(diag, vec![full[0], full[3]]);
    }
}
