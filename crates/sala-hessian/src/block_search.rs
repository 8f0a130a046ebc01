//! The NVFP4 block-scale search of the original SALA scripts: for each `(row, 16-block)`,
//! try shrunk E4M3 block scales and keep the one with the smallest error weighted by the
//! diagonal Hessian.

use rayon::prelude::*;
use sala_formats::minifloat::{e2m1_decode, E4M3FN, E4M3_MAX, E4M3_MIN_POSITIVE};
use sala_formats::nvfp4::{block_divisor, dequantize_rows_into, encode_block, quantize_rows_into};
use sala_formats::{FormatError, NVFP4_BLOCK};

use crate::error::{check_finite, check_matrix, HessianError};

/// Search options (defaults 120 / 0.60 / 2.0 as `AWQ_NVFP4_dense_all.py`).
///
/// Candidate `i` in `0..iters` scales the max-calibration block scale
/// `block_amax / (6 · global)` by `1 − i · max_shrink / iters`; each candidate is clamped to
/// `[2⁻⁹, 448]` and rounded to E4M3 before it is evaluated. The error of a block is
/// `Σ_j |w_j − deq_j|^p · h_j` with `p = error_norm` and `h_j = diag(H)_j / max(diag H)`.
/// The first candidate with the smallest error wins, so `iters = 1` is max calibration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Nvfp4BlockSearch {
    /// Candidates per block (≥ 1).
    pub iters: usize,
    /// Largest relative shrink, in `[0, 1)`.
    pub max_shrink: f32,
    /// Exponent `p` of the error (> 0).
    pub error_norm: f32,
}

impl Default for Nvfp4BlockSearch {
    fn default() -> Self {
        Self {
            iters: 120,
            max_shrink: 0.60,
            error_norm: 2.0,
        }
    }
}

/// The chosen block scales, codes and dequantized weight of one matrix.
#[derive(Debug, Clone, PartialEq)]
pub struct Nvfp4SearchResult {
    /// Rows (output features).
    pub rows: usize,
    /// Columns (input features, a multiple of 16).
    pub cols: usize,
    /// The global scale used (`weight_scale_2`).
    pub global_scale: f32,
    /// E4M3 block scale bytes, `[rows, cols/16]`.
    pub block_scales: Vec<u8>,
    /// E2M1 codes, `[rows, cols]` (one code per element, unpacked).
    pub codes: Vec<u8>,
    /// Dequantized weight, `[rows, cols]`.
    pub dequantized: Vec<f32>,
    /// Weighted error of each block's chosen scale, `[rows, cols/16]`.
    pub block_error: Vec<f32>,
}

impl Nvfp4BlockSearch {
    /// Checks the options.
    pub fn validate(&self) -> Result<(), HessianError> {
        if self.iters == 0 {
            return Err(invalid(
                "iters",
                self.iters.to_string(),
                "must be at least 1",
            ));
        }
        if !(0.0..1.0).contains(&self.max_shrink) {
            return Err(invalid(
                "max_shrink",
                self.max_shrink.to_string(),
                "must be in [0, 1)",
            ));
        }
        if !(self.error_norm.is_finite() && self.error_norm > 0.0) {
            return Err(invalid(
                "error_norm",
                self.error_norm.to_string(),
                "must be positive and finite",
            ));
        }
        Ok(())
    }

    /// The shrink factor of candidate `i`.
    #[inline]
    pub fn shrink(&self, i: usize) -> f32 {
        1.0 - i as f32 * self.max_shrink / self.iters as f32
    }

    /// Searches every block of the row-major `weights [rows, cols]`, in parallel over rows.
    ///
    /// `diag_h` `[cols]` is the diagonal Hessian `E[x²]` (non-negative, finite; all zeros
    /// weighs every channel equally); `global_scale` the tensor's (or fused group's)
    /// `weight_scale_2`.
    pub fn search(
        &self,
        weights: &[f32],
        rows: usize,
        cols: usize,
        diag_h: &[f32],
        global_scale: f32,
    ) -> Result<Nvfp4SearchResult, HessianError> {
        let channel_weights = self.check(weights, rows, cols, diag_h, global_scale)?;
        let blocks = cols / NVFP4_BLOCK;
        let mut result = Nvfp4SearchResult::zeros(rows, cols, global_scale);
        (
            weights.par_chunks(cols),
            result.block_scales.par_chunks_mut(blocks),
            result.codes.par_chunks_mut(cols),
            result.dequantized.par_chunks_mut(cols),
            result.block_error.par_chunks_mut(blocks),
        )
            .into_par_iter()
            .for_each(|(w_row, s_row, c_row, d_row, e_row)| {
                for b in 0..blocks {
                    let span = b * NVFP4_BLOCK..(b + 1) * NVFP4_BLOCK;
                    let best = self.best_scale(
                        &w_row[span.clone()],
                        &channel_weights[span.clone()],
                        global_scale,
                    );
                    s_row[b] = best.0;
                    e_row[b] = best.1;
                    encode_into(
                        &w_row[span.clone()],
                        best.0,
                        global_scale,
                        &mut c_row[span.clone()],
                        &mut d_row[span],
                    );
                }
            });
        Ok(result)
    }

    /// Validates the inputs and returns `h_j = diag_j / max(diag)` (all ones if the diagonal
    /// is zero).
    pub(crate) fn check(
        &self,
        weights: &[f32],
        rows: usize,
        cols: usize,
        diag_h: &[f32],
        global_scale: f32,
    ) -> Result<Vec<f32>, HessianError> {
        check_matrix("weights", weights.len(), rows, cols)?;
        check_finite("weights", weights, cols)?;
        self.channel_weights(cols, diag_h, global_scale)
    }

    /// Validates everything but the weights themselves (the options, `cols` a multiple of 16,
    /// the diagonal `[cols]` finite and non-negative, the global scale positive and finite)
    /// and returns the channel weights `h_j = diag_j / max(diag)` (all ones if the diagonal is
    /// zero). For searches whose weights live elsewhere (a device) and are checked there.
    pub fn channel_weights(
        &self,
        cols: usize,
        diag_h: &[f32],
        global_scale: f32,
    ) -> Result<Vec<f32>, HessianError> {
        self.validate()?;
        if cols % NVFP4_BLOCK != 0 {
            return Err(sala_formats::FormatError::NotDivisible {
                what: "cols",
                value: cols,
                divisor: NVFP4_BLOCK,
            }
            .into());
        }
        if diag_h.len() != cols {
            return Err(HessianError::DimensionMismatch {
                what: "diagonal hessian vs weight columns",
                left: diag_h.len(),
                right: cols,
            });
        }
        check_finite("diagonal hessian", diag_h, cols)?;
        if let Some(j) = diag_h.iter().position(|&v| v < 0.0) {
            return Err(invalid(
                "diagonal hessian",
                format!("{} at column {j}", diag_h[j]),
                "must be non-negative",
            ));
        }
        if !(global_scale.is_finite() && global_scale > 0.0) {
            return Err(invalid(
                "global_scale",
                global_scale.to_string(),
                "must be positive and finite",
            ));
        }
        let max = diag_h.iter().copied().fold(0.0f32, f32::max);
        Ok(if max > 0.0 {
            diag_h.iter().map(|&v| v / max).collect()
        } else {
            vec![1.0; cols]
        })
    }

    /// The E4M3 byte of candidate `i` for a block of absolute maximum `amax`.
    #[inline]
    pub(crate) fn candidate(&self, amax: f32, global_scale: f32, i: usize) -> u8 {
        // Same expression as max calibration (`sala_formats::nvfp4::max_block_scale`), so that
        // candidate 0 (shrink 1) is its exact byte.
        let init = amax / (sala_formats::minifloat::E2M1_MAX * global_scale);
        E4M3FN.encode_non_nan((init * self.shrink(i)).clamp(E4M3_MIN_POSITIVE, E4M3_MAX))
    }

    /// The best byte of one block and its error. Consecutive candidates often round to the
    /// same E4M3 byte; those are evaluated once (a repeat cannot be strictly better).
    pub(crate) fn best_scale(&self, block: &[f32], h: &[f32], global_scale: f32) -> (u8, f32) {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let mut best = (0u8, f32::INFINITY);
        let mut previous = None;
        for i in 0..self.iters {
            let byte = self.candidate(amax, global_scale, i);
            if previous == Some(byte) {
                continue;
            }
            previous = Some(byte);
            let err = block_error(block, h, byte, global_scale, self.error_norm);
            if err < best.1 {
                best = (byte, err);
            }
        }
        best
    }
}

impl Nvfp4SearchResult {
    pub(crate) fn zeros(rows: usize, cols: usize, global_scale: f32) -> Self {
        let blocks = rows * cols / NVFP4_BLOCK;
        Self {
            rows,
            cols,
            global_scale,
            block_scales: vec![0; blocks],
            codes: vec![0; rows * cols],
            dequantized: vec![0.0; rows * cols],
            block_error: vec![0.0; blocks],
        }
    }
}

/// `Σ_j |w_j − deq_j|^p · h_j` for one block under one E4M3 scale byte.
#[inline]
pub(crate) fn block_error(block: &[f32], h: &[f32], byte: u8, global_scale: f32, p: f32) -> f32 {
    let divisor = block_divisor(byte, global_scale);
    let mut codes = [0u8; NVFP4_BLOCK];
    encode_block(block, divisor, &mut codes);
    let mut err = 0.0f32;
    for ((&w, &hj), &code) in block.iter().zip(h).zip(&codes) {
        let diff = (w - e2m1_decode(code) * divisor).abs();
        let term = if p == 2.0 { diff * diff } else { diff.powf(p) };
        err += term * hj;
    }
    err
}

/// Codes and dequantized values of one block under a scale byte.
#[inline]
pub(crate) fn encode_into(
    block: &[f32],
    byte: u8,
    global_scale: f32,
    codes: &mut [u8],
    deq: &mut [f32],
) {
    let divisor = block_divisor(byte, global_scale);
    encode_block(block, divisor, codes);
    for (d, &c) in deq.iter_mut().zip(codes.iter()) {
        *d = e2m1_decode(c) * divisor;
    }
}

/// [`diagonal_error`] of NVFP4 max calibration of `w` (the reports' NVFP4 baseline) with the
/// global scale `global`, row by row: the same figure, bit for bit, without building the quantized
/// and dequantized matrices (three passes over a 280 M-weight layer and their allocations).
pub fn max_calibration_diagonal_error(
    w: &[f32],
    global: f32,
    diag: &[f32],
) -> Result<f64, FormatError> {
    let cols = diag.len().max(1);
    let buffers = || {
        let scales = vec![0u8; cols / NVFP4_BLOCK];
        (scales, vec![0u8; cols / 2], vec![0f32; cols])
    };
    // Rows in parallel, their sums added in row order; the first failing row names the error.
    let rows: Vec<Result<f64, FormatError>> = w
        .par_chunks(cols)
        .enumerate()
        .map_init(buffers, |(scales, packed, q), (r, row)| {
            quantize_rows_into(row, cols, global, r, true, scales, packed)?;
            dequantize_rows_into(packed, scales, global, q);
            Ok(row_diagonal_error(row, q, diag))
        })
        .collect();
    rows.into_iter().sum()
}

/// `Σ_rows Σ_j d_j (w − q)²` of row-major `w` and `q` with `diag.len()` columns: the proxy
/// output error under a diagonal Hessian (rows in parallel, each summed in f64 in column
/// order, the rows added in order: the same figure on any thread count).
pub fn diagonal_error(w: &[f32], q: &[f32], diag: &[f32]) -> f64 {
    let cols = diag.len().max(1);
    let rows: Vec<f64> = w
        .par_chunks_exact(cols)
        .zip(q.par_chunks_exact(cols))
        .map(|(wr, qr)| row_diagonal_error(wr, qr, diag))
        .collect();
    rows.iter().sum()
}

/// `Σ_j d_j (w_j − q_j)²` of one row, summed in f64 in column order.
fn row_diagonal_error(w: &[f32], q: &[f32], diag: &[f32]) -> f64 {
    w.iter()
        .zip(q)
        .zip(diag)
        .map(|((&a, &b), &d)| d as f64 * ((a - b) as f64).powi(2))
        .sum::<f64>()
}

fn invalid(name: &'static str, value: String, rule: &'static str) -> HessianError {
    HessianError::InvalidOption { name, value, rule }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sala_formats::nvfp4::global_scale_from_amax;
    use sala_formats::{BlockScales, Nvfp4Matrix};

    /// The row-by-row baseline is the figure of the whole quantized matrix, bit for bit, and
    /// names a non-finite weight by position.
    #[test]
    fn max_calibration_error_equals_the_dequantized_matrix_error() {
        let (rows, cols) = (13, 64);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * (1.0 + (i % 5) as f32))
            .collect();
        let diag: Vec<f32> = (0..cols).map(|j| 0.1 + (j % 9) as f32).collect();
        let global = global_scale_from_amax(3.0).unwrap();
        let max = Nvfp4Matrix::quantize(&w, rows, cols, global, BlockScales::Max).unwrap();
        let expected = diagonal_error(&w, &max.dequantize(), &diag);
        let got = max_calibration_diagonal_error(&w, global, &diag).unwrap();
        assert_eq!(got.to_bits(), expected.to_bits(), "{got} vs {expected}");
        let mut bad = w.clone();
        bad[5 * cols + 17] = f32::NAN;
        let err = max_calibration_diagonal_error(&bad, global, &diag).unwrap_err();
        assert!(
            matches!(
                err,
                FormatError::NonFinite {
                    row: 5,
                    col: 17,
                    ..
                }
            ),
            "{err:?}"
        );
    }
}
