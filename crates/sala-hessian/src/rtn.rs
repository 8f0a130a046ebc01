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
    /// carries the proxy output error `tr((W − Q) H (W − Q)ᵀ)`, and a clipping search weighs
    /// each column's error by `diag(H)` (as GPTQ's does).
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
        let diag: Option<Vec<f32>> = match (&self.grid.clip, hessian) {
            (Some(_), Some(h)) => Some(h.diagonal().into_iter().map(|d| d.to_f32()).collect()),
            _ => None,
        };
        let mut q = self.quantize_checked(weights, out, inp, diag.as_deref())?;
        q.proxy_error = hessian.map(|h| proxy_error(weights, &q.dequantized, inp, h));
        Ok(q)
    }

    /// Quantizes the row-major `W [out, inp]` without a proxy error, a clipping search
    /// weighing each column's error by `column_weights` `[inp]` (`diag(H)` where the Hessian
    /// is elsewhere, e.g. on a device) or by 1 without them.
    pub fn quantize_weighted(
        &self,
        weights: &[f32],
        out: usize,
        inp: usize,
        column_weights: Option<&[f32]>,
    ) -> Result<QuantizedLinear, HessianError> {
        check_weights(weights, out, inp, column_weights.map(<[f32]>::len))?;
        self.quantize_checked(weights, out, inp, column_weights)
    }

    /// [`quantize_weighted`](Self::quantize_weighted) of checked inputs.
    fn quantize_checked(
        &self,
        weights: &[f32],
        out: usize,
        inp: usize,
        column_weights: Option<&[f32]>,
    ) -> Result<QuantizedLinear, HessianError> {
        let gs = self.grid.effective_group_size(inp)?;
        let q = match &self.grid.clip {
            None => quantize_groupwise(weights, out, inp, gs, self.quantizer)?,
            Some(search) => {
                let q = self.quantizer;
                quantize_groupwise_searched(weights, out, inp, gs, q, search, column_weights)?
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
            proxy_error: None,
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
