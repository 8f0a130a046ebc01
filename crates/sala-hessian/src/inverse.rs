//! The damped Cholesky inverse GPTQ needs: the upper Cholesky factor `U` of `(H + λI)⁻¹`.
//!
//! IST-DASLab computes it as `chol(cholesky_inverse(chol(H)), upper)`: three `n³/3` passes.
//! We use the identity `U = R⁻¹`, where `H = R Rᵀ` with `R` upper triangular (the Cholesky
//! factor of `H` in reversed index order): one Cholesky of the reversed matrix plus one
//! triangular inverse, two `n³/3` passes for the same `U`. The textbook route is kept in
//! [`crate::reference`] and the two are tested against each other.

use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::cholesky::llt::factor::{cholesky_in_place, cholesky_in_place_scratch};
use faer::linalg::triangular_inverse::invert_lower_triangular;
use faer::{Mat, MatRef, Par};
use rayon::prelude::*;

use crate::error::HessianError;
use crate::hessian::Hessian;
use crate::scalar::HessianScalar;

/// Damping schedule: attempt `k` (0-based) adds `percdamp · growth^k · mean(diag H)` to the
/// diagonal; `max_retries` further attempts follow a failed factorization.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Damping {
    /// Relative damping of the first attempt (GPTQ's `damp_percent`, default 0.01).
    pub percdamp: f64,
    /// Factor applied to the relative damping at each retry (default 10, as the SALA script).
    pub growth: f64,
    /// Retries after the first attempt (default 5).
    pub max_retries: usize,
}

impl Default for Damping {
    fn default() -> Self {
        Self {
            percdamp: 0.01,
            growth: 10.0,
            max_retries: 5,
        }
    }
}

impl Damping {
    /// Checks that the damping is positive and finite and that it grows.
    pub fn validate(&self) -> Result<(), HessianError> {
        if !(self.percdamp.is_finite() && self.percdamp > 0.0) {
            return Err(HessianError::InvalidOption {
                name: "percdamp",
                value: self.percdamp.to_string(),
                rule: "must be positive and finite",
            });
        }
        if !(self.growth.is_finite() && self.growth > 1.0) {
            return Err(HessianError::InvalidOption {
                name: "growth",
                value: self.growth.to_string(),
                rule: "must be finite and greater than 1",
            });
        }
        Ok(())
    }

    /// The relative damping of each attempt, in order: `percdamp`, then `percdamp · growth`
    /// after each failure, `max_retries + 1` values in all.
    pub fn relative_dampings(&self) -> impl Iterator<Item = f64> {
        let growth = self.growth;
        std::iter::successors(Some(self.percdamp), move |p| Some(p * growth))
            .take(self.max_retries + 1)
    }

    /// The error when every attempt failed, for a Hessian whose damping reference
    /// (`mean(diag H)`, dead columns counted as 1) is `mean_diag`.
    pub fn exhausted(&self, mean_diag: f64) -> HessianError {
        let last_percdamp = self.relative_dampings().last().unwrap_or(self.percdamp);
        HessianError::NotPositiveDefinite {
            attempts: self.max_retries + 1,
            last_damp: last_percdamp * mean_diag,
            last_percdamp,
        }
    }
}

/// One damping attempt factored elsewhere than faer on the host (a GPU's Cholesky), for
/// [`CholeskyInverse::with_order_using`].
pub trait UpperFactorizer: Send + Sync {
    /// `U`, the upper Cholesky factor of `A⁻¹` (`Uᵀ·U = A⁻¹`, strict lower triangle zero), of
    /// the symmetric `a` `[n, n]` (row-major f32: already permuted, dead columns given their
    /// unit diagonal, damping added). `Ok(None)` when `a` is not positive definite: the caller
    /// retries with more damping (as it does when `U` is not finite). `Err` for a failure of
    /// the factorizer itself.
    fn upper_factor(&self, a: &[f32], n: usize) -> Result<Option<Mat<f32>>, HessianError>;
}

/// The result of the damped inversion, in the column order it was computed for.
#[derive(Debug, Clone)]
pub struct CholeskyInverse {
    upper: Mat<f32>,
    dead: Vec<bool>,
    retries: usize,
    damp: f64,
    percdamp: f64,
}

impl CholeskyInverse {
    /// Inverts `H` in its natural column order.
    pub fn new<T: HessianScalar>(h: &Hessian<T>, damping: &Damping) -> Result<Self, HessianError> {
        let order: Vec<usize> = (0..h.dim()).collect();
        Self::with_order(h, &order, damping)
    }

    /// Inverts `P H Pᵀ`, where row `i` of the permuted matrix is row `order[i]` of `H`
    /// (GPTQ's act-order permutation).
    ///
    /// Dead columns (`H[i,i] == 0`) get a unit diagonal (`H[dead, dead] = 1`, as in every
    /// GPTQ implementation); the caller zeroes their weights. Errors: a non-finite element of `H`, an order that is not
    /// a permutation, or a factorization that fails at every damping of the schedule.
    pub fn with_order<T: HessianScalar>(
        h: &Hessian<T>,
        order: &[usize],
        damping: &Damping,
    ) -> Result<Self, HessianError> {
        Self::with_order_using(h, order, damping, None)
    }

    /// [`CholeskyInverse::with_order`] with each damping attempt factored by `factorizer`
    /// (a GPU's Cholesky) instead of faer on the host; `None` is the host.
    pub fn with_order_using<T: HessianScalar>(
        h: &Hessian<T>,
        order: &[usize],
        damping: &Damping,
        factorizer: Option<&dyn UpperFactorizer>,
    ) -> Result<Self, HessianError> {
        damping.validate()?;
        h.check_finite()?;
        check_permutation(order, h.dim())?;
        let diag = diagonal_f64(h);
        let dead = dead_columns(&diag);
        let mean_diag = mean_fixed_diagonal(&diag, &dead);
        for (attempt, percdamp) in damping.relative_dampings().enumerate() {
            let damp = percdamp * mean_diag;
            let upper = match factorizer {
                None => try_inverse_upper(h, order, &dead, damp),
                Some(f) => {
                    let a = damped_permuted(h, order, &dead, damp);
                    f.upper_factor(&a, h.dim())?.filter(all_finite)
                }
            };
            if let Some(upper) = upper {
                return Ok(Self {
                    upper,
                    dead: order.iter().map(|&i| dead[i]).collect(),
                    retries: attempt,
                    damp,
                    percdamp,
                });
            }
        }
        Err(damping.exhausted(mean_diag))
    }

    /// `U`, the upper Cholesky factor of `(H + λI)⁻¹` in the permuted order, `[dim, dim]`
    /// (its strict lower triangle is zero).
    pub fn upper(&self) -> MatRef<'_, f32> {
        self.upper.as_ref()
    }

    /// Dead columns in the permuted order (`true` where `H[i,i] == 0`).
    pub fn dead(&self) -> &[bool] {
        &self.dead
    }

    /// Retries that were needed (0 when the first damping worked).
    pub fn retries(&self) -> usize {
        self.retries
    }

    /// The absolute damping `λ` that was added to the diagonal.
    pub fn damp(&self) -> f64 {
        self.damp
    }

    /// The relative damping that worked (`λ / mean(diag H)`).
    pub fn percdamp(&self) -> f64 {
        self.percdamp
    }
}

fn check_permutation(order: &[usize], dim: usize) -> Result<(), HessianError> {
    if order.len() != dim {
        return Err(HessianError::DimensionMismatch {
            what: "column order vs hessian",
            left: order.len(),
            right: dim,
        });
    }
    let mut seen = vec![false; dim];
    for &i in order {
        if i >= dim || std::mem::replace(&mut seen[i], true) {
            return Err(HessianError::InvalidOption {
                name: "order",
                value: i.to_string(),
                rule: "must be a permutation of 0..dim",
            });
        }
    }
    Ok(())
}

/// `diag(H)` in f64.
pub(crate) fn diagonal_f64<T: HessianScalar>(h: &Hessian<T>) -> Vec<f64> {
    (0..h.dim()).map(|i| h.get(i, i).into()).collect()
}

/// `dead[i]` for each column `i` of a Hessian with diagonal `diag` (`H[i,i] == 0`: the
/// column never saw a non-zero input).
pub fn dead_columns(diag: &[f64]) -> Vec<bool> {
    diag.iter().map(|&d| d == 0.0).collect()
}

/// `mean(diag H)` after dead columns got their unit diagonal (the damping reference).
pub fn mean_fixed_diagonal(diag: &[f64], dead: &[bool]) -> f64 {
    let sum: f64 = diag
        .iter()
        .zip(dead)
        .map(|(&d, &dead)| if dead { 1.0 } else { d })
        .sum();
    sum / diag.len().max(1) as f64
}

/// The host's own factorization as an [`UpperFactorizer`] (faer, f32 in, f32 out): what a
/// device without a Cholesky of its own falls back to.
#[derive(Debug, Clone, Copy, Default)]
pub struct FaerFactorizer;

impl UpperFactorizer for FaerFactorizer {
    fn upper_factor(&self, a: &[f32], n: usize) -> Result<Option<Mat<f32>>, HessianError> {
        let h = Hessian::from_row_major(n, a)?;
        let order: Vec<usize> = (0..n).collect();
        Ok(try_inverse_upper(&h, &order, &vec![false; n], 0.0))
    }
}

/// `P (H + λI) Pᵀ` (row `i` is row `order[i]` of `H`, dead columns with a unit diagonal)
/// row-major in f32: what an [`UpperFactorizer`] gets.
fn damped_permuted<T: HessianScalar>(
    h: &Hessian<T>,
    order: &[usize],
    dead: &[bool],
    damp: f64,
) -> Vec<f32> {
    let n = h.dim();
    let mut a = vec![0.0f32; n * n];
    a.par_chunks_mut(n.max(1)).enumerate().for_each(|(i, row)| {
        let oi = order[i];
        for (j, v) in row.iter_mut().enumerate() {
            let oj = order[j];
            *v = if i == j {
                let d = if dead[oi] { 1.0 } else { h.get(oi, oi).into() };
                (d + damp) as f32
            } else {
                h.get(oi.max(oj), oi.min(oj)).into() as f32
            };
        }
    });
    a
}

/// Whether every element of `m` is finite (columns in parallel).
fn all_finite(m: &Mat<f32>) -> bool {
    m.par_col_iter().all(|c| c.iter().all(|v| v.is_finite()))
}

/// One attempt: factor the damped, permuted matrix in reversed order, invert the factor.
/// `None` when the factorization meets a non-positive pivot.
fn try_inverse_upper<T: HessianScalar>(
    h: &Hessian<T>,
    order: &[usize],
    dead: &[bool],
    damp: f64,
) -> Option<Mat<f32>> {
    let n = h.dim();
    let par = Par::rayon(0);
    // A = J P (H + λI) Pᵀ J, J the reversal: its lower Cholesky factor Lr gives R = J Lr J.
    let reversed = |i: usize| order[n - 1 - i];
    let damp_t = T::from_f64(damp);
    let mut a = Mat::<T>::from_fn(n, n, |i, j| {
        let (oi, oj) = (reversed(i), reversed(j));
        if i == j {
            let d = if dead[oi] {
                T::from_f64(1.0)
            } else {
                h.get(oi, oi)
            };
            d + damp_t
        } else {
            h.get(oi.max(oj), oi.min(oj))
        }
    });
    let mut mem = MemBuffer::new(cholesky_in_place_scratch::<T>(n, par, Default::default()));
    let stack = MemStack::new(&mut mem);
    cholesky_in_place(
        a.as_mut(),
        Default::default(),
        par,
        stack,
        Default::default(),
    )
    .ok()?;
    let mut l_inv = Mat::<T>::zeros(n, n);
    invert_lower_triangular(l_inv.as_mut(), a.as_ref(), par);
    sala_cpu::clear_upper_state_everywhere();
    // U = R⁻¹ = J Lr⁻¹ J.
    let upper = Mat::<f32>::from_fn(n, n, |i, j| {
        if i > j {
            0.0
        } else {
            l_inv[(n - 1 - i, n - 1 - j)].to_f32()
        }
    });
    all_finite(&upper).then_some(upper)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::square_from_row_major;

    #[test]
    fn a_single_non_finite_value_is_found() {
        let mut values = vec![1.0f32; 70 * 70];
        assert!(all_finite(&square_from_row_major(&values, 70).unwrap()));
        values[69 * 70 + 17] = f32::NAN;
        assert!(!all_finite(&square_from_row_major(&values, 70).unwrap()));
    }
}
