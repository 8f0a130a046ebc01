//! What GPTQ and RTN return for one linear, and the pieces both compute the same way
//! (the integer grid, dequantization, the proxy output error).

use faer::linalg::matmul::triangular::{matmul, BlockStructure};
use faer::{Accum, Mat, MatRef, Par};
use rayon::prelude::*;
use sala_formats::{ClipSearch, GptqPacked, IntQuantizer, IntScheme, QuantParams, ZeroConvention};

use crate::error::{check_finite, check_matrix, HessianError};
use crate::hessian::Hessian;
use crate::scalar::HessianScalar;

/// The integer grid of a quantized linear: bit width, scheme and group size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntGrid {
    /// Bits per weight, 2..=8 (default 4).
    pub bits: u32,
    /// How a group's scale and zero are derived (default [`IntScheme::SymmetricIst`]).
    pub scheme: IntScheme,
    /// Input columns per group; `None` means one group per output row (per-channel, AutoGPTQ's
    /// `group_size = -1`). Default `Some(128)`.
    pub group_size: Option<usize>,
    /// A clipping search for each group's range, errors weighted by `diag(H)` (default `None`:
    /// the plain min/max range).
    pub clip: Option<ClipSearch>,
}

impl Default for IntGrid {
    fn default() -> Self {
        Self {
            bits: 4,
            scheme: IntScheme::SymmetricIst,
            group_size: Some(128),
            clip: None,
        }
    }
}

impl IntGrid {
    /// The quantizer (checks the bit width).
    pub fn quantizer(&self) -> Result<IntQuantizer, HessianError> {
        Ok(IntQuantizer::new(self.bits, self.scheme)?)
    }

    /// One group's parameters under `quantizer` (this grid's): the min/max range, or the
    /// clipping search's best with each column weighted by `weights` (same length) when given.
    pub fn group_params(
        &self,
        quantizer: &IntQuantizer,
        values: &[f32],
        weights: Option<&[f32]>,
    ) -> QuantParams {
        match &self.clip {
            None => quantizer.params_for(values),
            Some(search) => search.params(quantizer, values, weights),
        }
    }

    /// Columns per group for a layer with `inp` input columns (`inp` when per-channel).
    pub fn effective_group_size(&self, inp: usize) -> Result<usize, HessianError> {
        match self.group_size {
            None => Ok(inp),
            Some(0) => Err(sala_formats::FormatError::ZeroGroupSize.into()),
            Some(g) => Ok(g.min(inp)),
        }
    }
}

/// Which algorithm produced a [`QuantizedLinear`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// GPTQ with a Cholesky inverse.
    Gptq,
    /// Round-to-nearest, asked for.
    Rtn,
    /// Round-to-nearest because the Hessian could not be factored and the caller chose
    /// [`FailurePolicy::Rtn`](crate::FailurePolicy::Rtn).
    RtnFallback,
}

/// One quantized linear `W [out, in]`, in the layout the AutoGPTQ exporter consumes.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedLinear {
    /// Output features (rows of `W`).
    pub out_features: usize,
    /// Input features (columns of `W`).
    pub in_features: usize,
    /// The grid (bits, scheme, group size as asked).
    pub grid: IntGrid,
    /// Columns per group actually used (`in_features` for per-channel).
    pub group_size: usize,
    /// Codes `[out, in]`, in the original (un-permuted) column order.
    pub codes: Vec<u8>,
    /// Scale and zero per group and row, `[groups, out]` (AutoGPTQ `scales` orientation).
    pub params: Vec<QuantParams>,
    /// Group of each input column, `[in]` (non-monotone with act-order without static groups).
    pub g_idx: Vec<i32>,
    /// The dequantized weight `Q`, `[out, in]`.
    pub dequantized: Vec<f32>,
    /// Loss per input column, `Σ_rows (w − q)² / (2·d²)` as IST-DASLab reports it (`w` the
    /// error-updated weight, `d = U[c,c]`); RTN uses `d = 1`. `[in]`.
    pub column_loss: Vec<f64>,
    /// The sum of `column_loss`.
    pub loss: f64,
    /// `tr((W − Q) H (W − Q)ᵀ)` with the undamped Hessian (the output error the layer adds,
    /// averaged like `H`); `None` when no Hessian was given or it was not asked for.
    pub proxy_error: Option<f64>,
    /// The algorithm that produced it.
    pub method: Method,
    /// Damping retries the Cholesky factorization needed (0 for RTN).
    pub damping_retries: usize,
    /// The relative damping that was used (0 for RTN).
    pub percdamp: f64,
}

impl QuantizedLinear {
    /// Number of groups (rows of `params`).
    pub fn groups(&self) -> usize {
        self.in_features.div_ceil(self.group_size)
    }

    /// The AutoGPTQ int32 packing of this result (v1 zero convention).
    pub fn pack(&self) -> Result<GptqPacked, HessianError> {
        Ok(GptqPacked::pack(
            &self.codes,
            &self.params,
            &self.g_idx,
            self.out_features,
            self.in_features,
            self.grid.bits,
            self.group_size,
            ZeroConvention::V1,
        )?)
    }
}

/// Checks a weight matrix `[out, inp]` (shape, finiteness) against a Hessian's dimension.
pub(crate) fn check_weights(
    weights: &[f32],
    out: usize,
    inp: usize,
    hessian_dim: Option<usize>,
) -> Result<(), HessianError> {
    check_matrix("weights", weights.len(), out, inp)?;
    check_finite("weights", weights, inp)?;
    if let Some(dim) = hessian_dim {
        if dim != inp {
            return Err(HessianError::DimensionMismatch {
                what: "hessian dimension vs weight columns",
                left: dim,
                right: inp,
            });
        }
    }
    Ok(())
}

/// `Q[r, c] = scale · (code − zero)` with the parameters of group `g_idx[c]`.
pub(crate) fn dequantize(
    codes: &[u8],
    params: &[QuantParams],
    g_idx: &[i32],
    out: usize,
) -> Vec<f32> {
    let inp = g_idx.len();
    let mut values = vec![0.0f32; codes.len()];
    values
        .par_chunks_mut(inp.max(1))
        .zip(codes.par_chunks(inp.max(1)))
        .enumerate()
        .for_each(|(r, (row, row_codes))| {
            for ((v, &code), &g) in row.iter_mut().zip(row_codes).zip(g_idx) {
                *v = IntQuantizer::dequantize(code, params[g as usize * out + r]);
            }
        });
    values
}

/// Rows of `W − Q` converted and multiplied per GEMM call in [`proxy_error`].
const PROXY_ROWS_PER_CHUNK: usize = 256;

/// The proxy output error `tr(D H Dᵀ)` of a quantized linear, `D = W − Q`, with `weights` and
/// `dequantized` row-major `[out, inp]` and `h` `[inp, inp]`. Reads only the lower triangle of
/// `H`: `Σ_r (Σ_k H_kk d_k² + 2 Σ_c d_c (D·L)_c)` with `L` the strict lower triangle, a
/// triangular GEMM of `out·inp²` flops in the Hessian's precision.
pub fn proxy_error<T: HessianScalar>(
    weights: &[f32],
    dequantized: &[f32],
    inp: usize,
    h: &Hessian<T>,
) -> f64 {
    let hm = h.as_mat();
    let mut total = 0.0f64;
    for (w_rows, q_rows) in weights
        .chunks(PROXY_ROWS_PER_CHUNK * inp)
        .zip(dequantized.chunks(PROXY_ROWS_PER_CHUNK * inp))
    {
        let rows = w_rows.len() / inp;
        let d = Mat::<T>::from_fn(rows, inp, |r, c| {
            T::from_f32(w_rows[r * inp + c] - q_rows[r * inp + c])
        });
        let mut y = Mat::<T>::zeros(rows, inp);
        matmul(
            y.as_mut(),
            BlockStructure::Rectangular,
            Accum::Replace,
            d.as_ref(),
            BlockStructure::Rectangular,
            hm,
            BlockStructure::StrictTriangularLower,
            T::from_f64(1.0),
            Par::rayon(0),
        );
        sala_cpu::clear_upper_state_everywhere();
        total += chunk_quadratic_form(d.as_ref(), y.as_ref(), hm);
    }
    total
}

fn chunk_quadratic_form<T: HessianScalar>(
    d: MatRef<'_, T>,
    y: MatRef<'_, T>,
    h: MatRef<'_, T>,
) -> f64 {
    let mut total = 0.0f64;
    for c in 0..d.ncols() {
        let h_cc: f64 = h[(c, c)].into();
        for r in 0..d.nrows() {
            let dc: f64 = d[(r, c)].into();
            let yc: f64 = y[(r, c)].into();
            total += h_cc * dc * dc + 2.0 * dc * yc;
        }
    }
    total
}
