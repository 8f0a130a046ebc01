//! Round-to-nearest group-wise quantization with the same outputs as GPTQ: the baseline GPTQ
//! is compared against and its fallback.

use sala_formats::{quantize_groupwise, IntQuantizer};

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
        let q = quantize_groupwise(weights, out, inp, gs, self.quantizer)?;
        let g_idx: Vec<i32> = (0..inp).map(|j| (j / gs) as i32).collect();
        let dequantized = dequantize(&q.codes, &q.params, &g_idx, out);
        let mut column_loss = vec![0.0f64; inp];
        for (w_row, q_row) in weights.chunks_exact(inp).zip(dequantized.chunks_exact(inp)) {
            for ((acc, &w), &v) in column_loss.iter_mut().zip(w_row).zip(q_row) {
                let d = (w - v) as f64;
                *acc += d * d / 2.0;
            }
        }
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
