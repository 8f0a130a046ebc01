//! Round-to-nearest group-wise quantization with the same outputs as GPTQ: the baseline GPTQ
//! is compared against and its fallback.

use rayon::prelude::*;
use sala_formats::{quantize_groupwise, quantize_groupwise_searched, IntQuantizer};

use crate::error::HessianError;
use crate::hessian::Hessian;
use crate::quantized::{check_weights, dequantize, proxy_error, IntGrid, Method, QuantizedLinear};
use crate::scalar::HessianScalar;

/// A validated round-to-nearest quantizer.
#[derive(Debug, Clone)]
pub struct Rtn {
    grid: IntGrid,
    quantizer: IntQuantizer,
}

impl Rtn {
    /// Validates the grid.
    pub fn new(grid: IntGrid) -> Result<Self, HessianError> {
        let quantizer = grid.quantizer()?;
        if grid.group_size == Some(0) {
            return Err(sala_formats::FormatError::ZeroGroupSize.into());
        }
        Ok(Self { grid, quantizer })
    }

    /// Quantizes the row-major `W [out, inp]`; with a Hessian `[inp, inp]` the result also
    /// carries the proxy output error `tr((W − Q) H (W − Q)ᵀ)`.
    ///
    /// The column loss is `Σ_rows (w − q)²/2`, GPTQ's loss with `d = 1`.
    pub fn quantize<T: HessianScalar>(
        &self,
        weights: &[f32],
        out: usize,
        inp: usize,
        hessian: Option<&Hessian<T>>,
    ) -> Result<QuantizedLinear, HessianError> {
        check_weights(weights, out, inp, hessian.map(Hessian::dim))?;
        if let Some(h) = hessian {
            h.check_finite()?;
        }
        let gs = self.grid.effective_group_size(inp)?;
        let q = match &self.grid.clip {
            None => quantize_groupwise(weights, out, inp, gs, self.quantizer)?,
            Some(search) => {
                // The same weighting as GPTQ's search: diag(H) when there is a Hessian.
                let diag: Option<Vec<f32>> =
                    hessian.map(|h| h.diagonal().into_iter().map(|d| d.to_f32()).collect());
                let q = self.quantizer;
                quantize_groupwise_searched(weights, out, inp, gs, q, search, diag.as_deref())?
            }
        };
        let g_idx: Vec<i32> = (0..inp).map(|j| (j / gs) as i32).collect();
        let dequantized = dequantize(&q.codes, &q.params, &g_idx, out);
        let column_loss = half_squared_column_errors(weights, &dequantized, inp);
        Ok(QuantizedLinear {
            out_features: out,
            in_features: inp,
            grid: self.grid,
            group_size: gs,
            codes: q.codes,
            params: q.params,
            g_idx,
            proxy_error: hessian.map(|h| proxy_error(weights, &dequantized, inp, h)),
            dequantized,
            loss: column_loss.iter().sum(),
            column_loss,
            method: Method::Rtn,
            damping_retries: 0,
            percdamp: 0.0,
        })
    }
}

/// Rows of `W − Q` per task in [`half_squared_column_errors`].
const LOSS_ROWS_PER_TASK: usize = 64;

/// `½ Σ_rows (w − q)²` of each column of `[out, inp]`, rows in parallel: fixed chunks of
/// rows whose partial sums are added in chunk order, so the result does not depend on the
/// thread count.
fn half_squared_column_errors(weights: &[f32], dequantized: &[f32], inp: usize) -> Vec<f64> {
    let chunk = LOSS_ROWS_PER_TASK * inp.max(1);
    let partials: Vec<Vec<f64>> = weights
        .par_chunks(chunk)
        .zip(dequantized.par_chunks(chunk))
        .map(|(w_rows, q_rows)| {
            let mut acc = vec![0.0f64; inp];
            for (w_row, q_row) in w_rows.chunks_exact(inp).zip(q_rows.chunks_exact(inp)) {
                for ((a, &w), &v) in acc.iter_mut().zip(w_row).zip(q_row) {
                    let d = (w - v) as f64;
                    *a += d * d / 2.0;
                }
            }
            acc
        })
        .collect();
    let mut total = vec![0.0f64; inp];
    for partial in partials {
        for (t, p) in total.iter_mut().zip(partial) {
            *t += p;
        }
    }
    total
}
