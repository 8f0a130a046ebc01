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
use sala_formats::nvfp4::{block_divisor, dequantize_codes};
use sala_formats::NVFP4_BLOCK;

use crate::block_search::Nvfp4BlockSearch;
use crate::error::HessianError;
use crate::gptq::{
    blocked_loop, effective_block, ColumnGrid, ColumnSolution, FailurePolicy, GptqPreparation,
    OUTER_BLOCKS,
};
use crate::hessian::Hessian;
use crate::inverse::{
    dead_columns, diagonal_f64, mean_fixed_diagonal, CholeskyInverse, Damping, UpperFactorizer,
};
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
        let prepared = self.prepare(weights, rows, cols, &diagonal_f64(h), global_scale)?;
        let proxy = |q: &[f32]| column_loop.proxy_error(weights, q, cols, h);
        let order = &prepared.columns.order;
        let factorizer = column_loop.factorizer();
        let inverse = match CholeskyInverse::with_order_using(h, order, &self.damping, factorizer) {
            Ok(inverse) => inverse,
            Err(HessianError::NotPositiveDefinite { .. })
                if self.on_failure == FailurePolicy::Rtn =>
            {
                return self.search_fallback(weights, &prepared, proxy);
            }
            Err(e) => return Err(e),
        };
        let mut w = prepared.columns.dead_zeroed(weights, cols).into_owned();
        let grid = Nvfp4Columns {
            rows,
            cols,
            upper: inverse.upper(),
            search: &self.search,
            channel_weights: &prepared.channel_weights,
            global_scale,
        };
        let sol = column_loop.run(&grid, self.lazy_block(cols), &mut w)?;
        self.finish(&prepared, sol, inverse.retries(), proxy)
    }

    /// The column loop's lazy block for `cols` columns: the configured one (128 when 0),
    /// shortened to whole 16-column blocks.
    pub fn lazy_block(&self, cols: usize) -> usize {
        let configured = if self.block_size == 0 {
            128
        } else {
            self.block_size
        };
        effective_block(configured, NVFP4_BLOCK, cols, false)
    }

    /// Checks the options and `weights [rows, cols]` against `diag(H)` `[cols]`, and derives
    /// what the loop needs of the Hessian besides its factor ([`Nvfp4Preparation`]).
    ///
    /// Errors: shapes, non-finite weights, `cols` not a multiple of 16, a global scale that
    /// is not positive and finite.
    pub fn prepare(
        &self,
        weights: &[f32],
        rows: usize,
        cols: usize,
        diag: &[f64],
        global_scale: f32,
    ) -> Result<Nvfp4Preparation, HessianError> {
        self.validate()?;
        check_weights(weights, rows, cols, Some(diag.len()))?;
        // Rounding noise below zero is no weight: the search weighs by the clipped diagonal.
        let search_diag: Vec<f32> = diag.iter().map(|&d| d.max(0.0) as f32).collect();
        let channel_weights = self
            .search
            .channel_weights(cols, &search_diag, global_scale)?;
        let dead = dead_columns(diag);
        Ok(Nvfp4Preparation {
            columns: GptqPreparation {
                mean_diag: mean_fixed_diagonal(diag, &dead),
                dead,
                order: (0..cols).collect(),
                group_size: NVFP4_BLOCK,
                clip_weights: None,
            },
            rows,
            global_scale,
            search_diag,
            channel_weights,
        })
    }

    /// The result of the column loop's `sol` (codes and scale bytes `[rows, cols/16]`), found
    /// after `retries` failed damping attempts, with its proxy error from `proxy_error` of
    /// the dequantized weight.
    pub fn finish(
        &self,
        prepared: &Nvfp4Preparation,
        sol: ColumnSolution<u8>,
        retries: usize,
        proxy_error: impl FnOnce(&[f32]) -> Result<f64, HessianError>,
    ) -> Result<Nvfp4GptqResult, HessianError> {
        let dequantized = dequantize_codes(&sol.codes, &sol.params_rows, prepared.global_scale);
        Ok(Nvfp4GptqResult {
            rows: prepared.rows,
            cols: prepared.columns.order.len(),
            global_scale: prepared.global_scale,
            proxy_error: proxy_error(&dequantized)?,
            block_scales: sol.params_rows,
            codes: sol.codes,
            dequantized,
            loss: sol.column_loss.iter().sum(),
            method: Method::Gptq,
            damping_retries: retries,
        })
    }

    /// The [`FailurePolicy::Rtn`] fallback when no damping makes the Hessian factorable: the
    /// block search alone, its proxy error from `proxy_error`.
    pub fn search_fallback(
        &self,
        weights: &[f32],
        prepared: &Nvfp4Preparation,
        proxy_error: impl FnOnce(&[f32]) -> Result<f64, HessianError>,
    ) -> Result<Nvfp4GptqResult, HessianError> {
        let (rows, cols) = (prepared.rows, prepared.columns.order.len());
        let global_scale = prepared.global_scale;
        let found = self
            .search
            .search(weights, rows, cols, &prepared.search_diag, global_scale)?;
        Ok(Nvfp4GptqResult {
            rows,
            cols,
            global_scale,
            proxy_error: proxy_error(&found.dequantized)?,
            block_scales: found.block_scales,
            codes: found.codes,
            dequantized: found.dequantized,
            loss: 0.0,
            method: Method::RtnFallback,
            damping_retries: self.damping.max_retries,
        })
    }
}

/// [`Nvfp4Gptq::prepare`]'s result: what the column loop needs of the Hessian besides its
/// factor.
#[derive(Debug, Clone, PartialEq)]
pub struct Nvfp4Preparation {
    /// Dead columns, the damping reference and the loop order (natural: an NVFP4 block is 16
    /// consecutive stored columns), as GPTQ's preparation (groups of 16, no clipping search).
    pub columns: GptqPreparation,
    /// Output rows.
    pub rows: usize,
    /// The tensor's (or fused group's) `weight_scale_2`.
    pub global_scale: f32,
    /// `max(diag H, 0)` in f32, `[cols]`: the block search's weights.
    pub search_diag: Vec<f32>,
    /// The search's normalized column weights ([`Nvfp4BlockSearch::channel_weights`]).
    pub channel_weights: Vec<f32>,
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
