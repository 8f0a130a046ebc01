//! GPTQ on the NVFP4 grid: the column loop of [`crate::gptq`] with E2M1 values in blocks of
//! 16 input columns, each block's E4M3 scale chosen by [`Nvfp4BlockSearch`] when the loop
//! reaches the block, on the error-updated weights (as GPTQ chooses an integer group's
//! parameters at the group's start). The tensor's (or fused group's) global scale is the
//! caller's and stays as it is, so fused shards keep one `weight_scale_2`.
//!
//! The columns run in their natural order: an NVFP4 block is 16 consecutive columns of the
//! stored tensor, and a permuted order would put columns of several blocks into one.

use faer::MatRef;
use sala_formats::minifloat::{e2m1_decode, e2m1_encode_fast};
use sala_formats::nvfp4::block_divisor;
use sala_formats::NVFP4_BLOCK;

use crate::block_search::Nvfp4BlockSearch;
use crate::error::HessianError;
use crate::gptq::{
    blocked_loop, effective_block, ColumnGrid, ColumnSolution, FailurePolicy, OUTER_BLOCKS,
};
use crate::hessian::Hessian;
use crate::inverse::{diagonal_f64, CholeskyInverse, Damping, UpperFactorizer};
use crate::quantized::{check_weights, proxy_error, Method};
use crate::scalar::HessianScalar;

/// GPTQ with NVFP4 weights. Defaults: the block search's defaults (120 candidates, shrink up to
/// 0.60, squared error), damping 0.01, lazy blocks of 128 columns, errors on failure.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Nvfp4Gptq {
    /// How each block's scale is chosen, weighted by `diag(H)`.
    pub search: Nvfp4BlockSearch,
    /// Damping and retries of the Cholesky inverse.
    pub damping: Damping,
    /// Columns per lazy block (shortened to a multiple of 16); 0 means the default 128.
    pub block_size: usize,
    /// What to do when no damping makes the Hessian factorable: an error, or the block search
    /// alone (no error propagation; [`Method::RtnFallback`]).
    pub on_failure: FailurePolicy,
}

/// One linear quantized by [`Nvfp4Gptq`].
#[derive(Debug, Clone, PartialEq)]
pub struct Nvfp4GptqResult {
    /// Output rows.
    pub rows: usize,
    /// Input columns (a multiple of 16).
    pub cols: usize,
    /// The global scale used (`weight_scale_2`).
    pub global_scale: f32,
    /// E4M3 block scale bytes, `[rows, cols/16]`.
    pub block_scales: Vec<u8>,
    /// E2M1 codes, `[rows, cols]` (one code per element, unpacked).
    pub codes: Vec<u8>,
    /// Dequantized weight, `[rows, cols]`.
    pub dequantized: Vec<f32>,
    /// GPTQ's loss `Σ (w − q)²/(2·U[c,c]²)` (0 for the fallback).
    pub loss: f64,
    /// `tr((W − Q) H (W − Q)ᵀ)` against the original weights.
    pub proxy_error: f64,
    /// [`Method::Gptq`], or [`Method::RtnFallback`] when the Hessian could not be factored.
    pub method: Method,
    /// Failed damping attempts before the one that factored the Hessian.
    pub damping_retries: usize,
}

impl Nvfp4Gptq {
    /// Checks the options.
    pub fn validate(&self) -> Result<(), HessianError> {
        self.search.validate()?;
        self.damping.validate()
    }

    /// Quantizes the row-major `weights [rows, cols]` with the Hessian `h` `[cols, cols]` and
    /// the global scale `global_scale`. Dead columns (`H[j,j] = 0`) are zeroed, as GPTQ does.
    ///
    /// Errors: shapes, non-finite weights or Hessian, `cols` not a multiple of 16, a global
    /// scale that is not positive and finite, and [`HessianError::NotPositiveDefinite`] unless
    /// the policy is [`FailurePolicy::Rtn`].
    pub fn solve<T: HessianScalar>(
        &self,
        weights: &[f32],
        rows: usize,
        cols: usize,
        h: &Hessian<T>,
        global_scale: f32,
    ) -> Result<Nvfp4GptqResult, HessianError> {
        self.solve_using(weights, rows, cols, h, global_scale, None)
    }

    /// [`Nvfp4Gptq::solve`] with each damping attempt factored by `factorizer` (a GPU's
    /// Cholesky) instead of faer on the host; `None` is the host.
    pub fn solve_using<T: HessianScalar>(
        &self,
        weights: &[f32],
        rows: usize,
        cols: usize,
        h: &Hessian<T>,
        global_scale: f32,
        factorizer: Option<&dyn UpperFactorizer>,
    ) -> Result<Nvfp4GptqResult, HessianError> {
        let host = HostNvfp4Loop { factorizer };
        self.solve_with_loop(weights, rows, cols, h, global_scale, &host)
    }

    /// [`Nvfp4Gptq::solve`] with the factorization, the column loop and the proxy error of
    /// `column_loop` (a device's); checks, dead columns, the damping schedule, the fallback
    /// and dequantization stay here.
    pub fn solve_with_loop<T: HessianScalar, L: Nvfp4ColumnLoop>(
        &self,
        weights: &[f32],
        rows: usize,
        cols: usize,
        h: &Hessian<T>,
        global_scale: f32,
        column_loop: &L,
    ) -> Result<Nvfp4GptqResult, HessianError> {
        self.validate()?;
        check_weights(weights, rows, cols, Some(h.dim()))?;
        let diag = hessian_diagonal(h);
        let channel_weights = self.search.channel_weights(cols, &diag, global_scale)?;
        let natural: Vec<usize> = (0..cols).collect();
        let factorizer = column_loop.factorizer();
        let inverse =
            match CholeskyInverse::with_order_using(h, &natural, &self.damping, factorizer) {
                Ok(inverse) => inverse,
                Err(HessianError::NotPositiveDefinite { .. })
                    if self.on_failure == FailurePolicy::Rtn =>
                {
                    return self.search_only(weights, rows, cols, h, &diag, global_scale);
                }
                Err(e) => return Err(e),
            };
        let mut w = weights.to_vec();
        zero_dead_columns(&mut w, cols, inverse.dead());
        let grid = Nvfp4Columns {
            rows,
            cols,
            upper: inverse.upper(),
            search: &self.search,
            channel_weights: &channel_weights,
            global_scale,
        };
        let configured = if self.block_size == 0 {
            128
        } else {
            self.block_size
        };
        let block = effective_block(configured, NVFP4_BLOCK, cols, false);
        let sol = column_loop.run(&grid, block, &mut w)?;
        let dequantized = dequantize(&sol.codes, &sol.params_rows, global_scale);
        Ok(Nvfp4GptqResult {
            rows,
            cols,
            global_scale,
            proxy_error: column_loop.proxy_error(weights, &dequantized, cols, h)?,
            block_scales: sol.params_rows,
            codes: sol.codes,
            dequantized,
            loss: sol.column_loss.iter().sum(),
            method: Method::Gptq,
            damping_retries: inverse.retries(),
        })
    }

    /// The [`FailurePolicy::Rtn`] fallback: the block search alone.
    fn search_only<T: HessianScalar>(
        &self,
        weights: &[f32],
        rows: usize,
        cols: usize,
        h: &Hessian<T>,
        diag: &[f32],
        global_scale: f32,
    ) -> Result<Nvfp4GptqResult, HessianError> {
        let found = self
            .search
            .search(weights, rows, cols, diag, global_scale)?;
        Ok(Nvfp4GptqResult {
            rows,
            cols,
            global_scale,
            proxy_error: proxy_error(weights, &found.dequantized, cols, h),
            block_scales: found.block_scales,
            codes: found.codes,
            dequantized: found.dequantized,
            loss: 0.0,
            method: Method::RtnFallback,
            damping_retries: self.damping.max_retries,
        })
    }
}

/// Where [`Nvfp4Gptq`]'s factorization, column loop and proxy error run: the host
/// ([`Nvfp4Gptq::solve_using`]) or a device.
pub trait Nvfp4ColumnLoop {
    /// Quantizes every column of `w` `[rows, cols]` (row-major f32, natural order, dead
    /// columns zeroed; a workspace the loop may overwrite) in lazy blocks of `block` columns
    /// (a multiple of 16): each 16-column block's scale searched on its error-updated
    /// weights when the loop reaches it, each weight rounded to E2M1 on it, its scaled error
    /// spread over the later columns. Parameters are one E4M3 byte per row and block.
    fn run(
        &self,
        columns: &Nvfp4Columns<'_>,
        block: usize,
        w: &mut [f32],
    ) -> Result<ColumnSolution<u8>, HessianError>;

    /// Who factors the damped Hessian: `None` (the default) is faer on the host.
    fn factorizer(&self) -> Option<&dyn UpperFactorizer> {
        None
    }

    /// `tr((W − Q) H (W − Q)ᵀ)` of the original `weights` and the `dequantized` ones
    /// (row-major, `cols` columns) under `h`: on the host by default.
    fn proxy_error<T: HessianScalar>(
        &self,
        weights: &[f32],
        dequantized: &[f32],
        cols: usize,
        h: &Hessian<T>,
    ) -> Result<f64, HessianError> {
        Ok(proxy_error(weights, dequantized, cols, h))
    }
}

/// The host's loop: [`Nvfp4Columns`] through the integer GPTQ's lazy-block loop (faer GEMMs,
/// rows in parallel), the damped Hessian factored by `factorizer` (faer when `None`).
struct HostNvfp4Loop<'a> {
    factorizer: Option<&'a dyn UpperFactorizer>,
}

impl Nvfp4ColumnLoop for HostNvfp4Loop<'_> {
    fn run(
        &self,
        columns: &Nvfp4Columns<'_>,
        block: usize,
        w: &mut [f32],
    ) -> Result<ColumnSolution<u8>, HessianError> {
        Ok(blocked_loop(columns, w, block, block * OUTER_BLOCKS))
    }

    fn factorizer(&self) -> Option<&dyn UpperFactorizer> {
        self.factorizer
    }
}

/// The NVFP4 grid as GPTQ's column loop sees it: one E4M3 byte per row and block, searched at
/// the block's first column.
pub struct Nvfp4Columns<'a> {
    /// Output rows.
    pub rows: usize,
    /// Input columns (a multiple of 16).
    pub cols: usize,
    /// `U`, the upper Cholesky factor of the damped inverse Hessian, `[cols, cols]`.
    pub upper: MatRef<'a, f32>,
    /// How each block's scale is chosen.
    pub search: &'a Nvfp4BlockSearch,
    /// The search's weight of each column's error, `diag(H)/max diag(H)`, `[cols]`
    /// ([`Nvfp4BlockSearch::channel_weights`]).
    pub channel_weights: &'a [f32],
    /// The tensor's (or fused group's) `weight_scale_2`.
    pub global_scale: f32,
}

impl ColumnGrid for Nvfp4Columns<'_> {
    type Param = u8;

    fn out(&self) -> usize {
        self.rows
    }

    fn inp(&self) -> usize {
        self.cols
    }

    fn groups(&self) -> usize {
        self.cols / NVFP4_BLOCK
    }

    fn placeholder(&self) -> u8 {
        0
    }

    fn upper(&self) -> MatRef<'_, f32> {
        self.upper
    }

    #[inline]
    fn round(&self, _r: usize, c: usize, w_row: &[f32], scales: &mut [u8]) -> (u8, f32) {
        let b = c / NVFP4_BLOCK;
        if c % NVFP4_BLOCK == 0 {
            let span = c..c + NVFP4_BLOCK;
            let block = &w_row[span.clone()];
            let weights = &self.channel_weights[span];
            scales[b] = self.search.best_scale(block, weights, self.global_scale).0;
        }
        let divisor = block_divisor(scales[b], self.global_scale);
        let code = e2m1_encode_fast(w_row[c] / divisor);
        (code, e2m1_decode(code) * divisor)
    }
}

/// `diag(H)` in f32, negative rounding noise clipped to 0: the block search's weights.
pub(crate) fn hessian_diagonal<T: HessianScalar>(h: &Hessian<T>) -> Vec<f32> {
    diagonal_f64(h).iter().map(|&d| d.max(0.0) as f32).collect()
}

/// Zeroes the columns marked dead in every row of the row-major `w` `[_, cols]`.
pub(crate) fn zero_dead_columns(w: &mut [f32], cols: usize, dead: &[bool]) {
    if !dead.contains(&true) {
        return;
    }
    for row in w.chunks_exact_mut(cols) {
        for (v, _) in row.iter_mut().zip(dead).filter(|(_, &d)| d) {
            *v = 0.0;
        }
    }
}

/// The values of row-major E2M1 `codes` under their blocks' scale bytes (one per 16 codes).
pub(crate) fn dequantize(codes: &[u8], scales: &[u8], global_scale: f32) -> Vec<f32> {
    codes
        .chunks_exact(NVFP4_BLOCK)
        .zip(scales)
        .flat_map(|(block, &scale)| {
            let divisor = block_divisor(scale, global_scale);
            block.iter().map(move |&code| e2m1_decode(code) * divisor)
        })
        .collect()
}
