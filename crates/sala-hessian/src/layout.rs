//! Square matrices between row-major buffers (what devices, files and the smoothing transforms
//! use) and faer's column-major [`Mat`] (what the solvers use), in parallel and in tiles.
//!
//! A naive element-by-element conversion of a 16384-wide Hessian (268 M values) makes one
//! strided access per element and took seconds per call; these walk a tile of `TILE`
//! columns (or rows) at a time, so that reads and writes both stay within a few cache lines
//! per row, with the tiles spread over rayon's threads.

use faer::{Mat, MatRef};
use rayon::prelude::*;

use crate::error::HessianError;

/// Columns (or rows) per tile.
const TILE: usize = 64;

/// The `n × n` matrix `m[(i, j)] = value(i, j)`, tiles of columns in parallel (within a
/// tile, `i` outer and `j` inner: `value` is called along rows).
pub fn square_from_fn<T, F>(n: usize, value: F) -> Mat<T>
where
    T: faer::traits::ComplexField + Copy + Send + Sync,
    F: Fn(usize, usize) -> T + Sync,
{
    let mut m = Mat::<T>::zeros(n, n);
    m.par_col_chunks_mut(TILE)
        .enumerate()
        .for_each(|(tile, mut cols)| {
            let c0 = tile * TILE;
            for i in 0..n {
                for k in 0..cols.ncols() {
                    cols[(i, k)] = value(i, c0 + k);
                }
            }
        });
    m
}

/// The symmetric `n × n` matrix whose lower triangle is `lower(row, col)` (`row >= col`; the
/// upper triangle mirrors it, so `lower` is never asked for `row < col`).
pub fn symmetric_from_lower<T, F>(n: usize, lower: F) -> Mat<T>
where
    T: faer::traits::ComplexField + Copy + Send + Sync,
    F: Fn(usize, usize) -> T + Sync,
{
    square_from_fn(n, |i, j| lower(i.max(j), i.min(j)))
}

/// The row-major `[n, n]` `values` as a faer matrix.
pub fn square_from_row_major<T>(values: &[T], n: usize) -> Result<Mat<T>, HessianError>
where
    T: faer::traits::ComplexField + Copy + Send + Sync,
{
    if n.checked_mul(n) != Some(values.len()) {
        return Err(HessianError::LengthMismatch {
            what: "row-major square matrix",
            expected: n.saturating_mul(n),
            actual: values.len(),
        });
    }
    Ok(square_from_fn(n, |i, j| values[i * n + j]))
}

/// `m` (square) as a row-major `[n, n]` vector, tiles of rows in parallel.
pub fn square_to_row_major<T>(m: MatRef<'_, T>) -> Vec<T>
where
    T: faer::traits::ComplexField + Copy + Send + Sync,
{
    let (n, cols) = (m.nrows(), m.ncols());
    if n == 0 || cols == 0 {
        return Vec::new();
    }
    // Every element is overwritten below; `m[(0, 0)]` only gives the vector a value of `T`.
    let mut out = vec![m[(0, 0)]; n * cols];
    out.par_chunks_mut(TILE * cols)
        .enumerate()
        .for_each(|(tile, rows)| {
            let r0 = tile * TILE;
            let height = rows.len() / cols;
            for j in 0..cols {
                for k in 0..height {
                    rows[k * cols + j] = m[(r0 + k, j)];
                }
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_round_trip_across_tile_edges() {
        for n in [1, 5, 63, 64, 65, 130] {
            let values: Vec<f64> = (0..n * n).map(|k| k as f64 * 0.25 - 7.0).collect();
            let m = square_from_row_major(&values, n).unwrap();
            for i in 0..n {
                for j in 0..n {
                    assert_eq!(m[(i, j)], values[i * n + j], "n {n} ({i}, {j})");
                }
            }
            assert_eq!(square_to_row_major(m.as_ref()), values, "n {n}");
        }
    }

    #[test]
    fn the_upper_triangle_mirrors_the_lower() {
        let m = symmetric_from_lower(70, |r, c| {
            assert!(r >= c, "asked for ({r}, {c})");
            (r * 100 + c) as f64
        });
        for i in 0..70 {
            for j in 0..70 {
                assert_eq!(m[(i, j)], (i.max(j) * 100 + i.min(j)) as f64);
            }
        }
    }

    #[test]
    fn a_wrong_length_is_an_error() {
        let err = square_from_row_major(&[1.0f32; 10], 3).unwrap_err();
        assert!(err.to_string().contains("expected 9"), "{err}");
    }
}
