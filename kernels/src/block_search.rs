//! The NVFP4 block-scale search on the device: one unit per `(row, 16-block)` tries every
//! shrunk E4M3 candidate of [`Nvfp4BlockSearch`] in registers and keeps the first with the
//! smallest Hessian-weighted error, then writes the block's E2M1 codes.
//!
//! Bit-exactness with `sala_hessian::reference::nvfp4_block_search_naive`:
//! - the candidate shrink factors `1 − i·max_shrink/iters` and `6·global_scale` are computed
//!   on the host with the reference's own expressions and uploaded;
//! - E4M3 values come from a 128-entry table (`sala_formats` decoding), and rounding to E4M3
//!   is a search in that table: nearest value, ties to the even code (= even mantissa); both
//!   distances are exact in f32 (Sterbenz), so the result equals `E4M3FN.encode_non_nan`;
//! - E2M1 rounding is `e2m1_encode_fast` (midpoint comparisons, sign bit `x < 0`);
//! - the error sums the 16 terms in element order in f32 like `block_error`; every product
//!   that feeds an addition is multiplied by a runtime `1.0` first, so that a GPU compiler
//!   that contracts `a·b + c` into an FMA (CUDA does by default) contracts `(a·b)·1 + c`
//!   instead, which rounds exactly like the reference's separate multiply and add.

use cubecl::prelude::*;
use sala_formats::minifloat::{E2M1_MAX, E2M1_VALUES, E4M3FN, E4M3_MAX, E4M3_MIN_POSITIVE};
use sala_formats::NVFP4_BLOCK;
use sala_hessian::{HessianError, Nvfp4BlockSearch, Nvfp4SearchResult};

use crate::device::{array_arg, DeviceVec, MatrixView};
use crate::error::{flush, KernelError};
use crate::launch::elementwise;

/// Largest E4M3FN code (448).
const E4M3_MAX_CODE: u32 = 0x7E;
/// The E4M3FN NaN code: the scale of a block with a non-finite weight.
const E4M3_NAN_CODE: u32 = 0x7F;

/// The search's output, still on the device.
#[derive(Clone, Debug)]
pub struct DeviceBlockSearch {
    /// Rows of the weight.
    pub rows: usize,
    /// Columns of the weight (a multiple of 16).
    pub cols: usize,
    /// The global scale used.
    pub global_scale: f32,
    /// E4M3 block-scale bytes as `u32`, `[rows, cols/16]`; the NaN byte 0x7F marks a block
    /// with a non-finite weight (its codes are meaningless).
    pub block_scales: DeviceVec<u32>,
    /// Weighted error of each block's chosen scale, `[rows, cols/16]`.
    pub block_error: DeviceVec<f32>,
    /// E2M1 codes (low 4 bits) as `u32`, `[rows, cols]`.
    pub codes: DeviceVec<u32>,
}

impl DeviceBlockSearch {
    /// Reads the result back as the CPU search's result type (dequantized values computed on
    /// the host from the codes, as the reference does).
    ///
    /// Errors: a read failure, or [`HessianError::NonFinite`] for a block with a NaN or
    /// infinite weight (reported at the block's first column).
    pub fn download<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
    ) -> Result<Nvfp4SearchResult, KernelError> {
        let blocks = self.cols / NVFP4_BLOCK;
        let block_scales: Vec<u8> = to_bytes(self.block_scales.download(client)?);
        if let Some(b) = block_scales.iter().position(|&s| s as u32 == E4M3_NAN_CODE) {
            return Err(HessianError::NonFinite {
                what: "weights",
                row: b / blocks,
                col: (b % blocks) * NVFP4_BLOCK,
                value: f64::NAN,
            }
            .into());
        }
        let block_error = self.block_error.download(client)?;
        let codes: Vec<u8> = to_bytes(self.codes.download(client)?);
        let dequantized = codes
            .chunks_exact(NVFP4_BLOCK)
            .zip(&block_scales)
            .flat_map(|(block, &byte)| {
                let divisor = sala_formats::nvfp4::block_divisor(byte, self.global_scale);
                block
                    .iter()
                    .map(move |&c| sala_formats::minifloat::e2m1_decode(c) * divisor)
            })
            .collect();
        Ok(Nvfp4SearchResult {
            rows: self.rows,
            cols: self.cols,
            global_scale: self.global_scale,
            block_scales,
            codes,
            dequantized,
            block_error,
        })
    }
}

/// Codes the kernels store as `u32` (always < 256).
fn to_bytes(values: Vec<u32>) -> Vec<u8> {
    values.into_iter().map(|v| v as u8).collect()
}

/// Searches every block of `weights [rows, cols]` (a device window, `cols` a multiple of 16).
///
/// `diag_h [cols]` is the diagonal Hessian (non-negative, finite; normalised here to
/// `h = diag / max(diag)`, all ones when it is zero), `global_scale` the tensor's
/// `weight_scale_2`. Validation follows the CPU search; non-finite weights are detected on the
/// device and reported by [`DeviceBlockSearch::download`].
pub fn nvfp4_block_search<R: Runtime>(
    client: &ComputeClient<R>,
    weights: &MatrixView,
    diag_h: &[f32],
    global_scale: f32,
    search: &Nvfp4BlockSearch,
) -> Result<DeviceBlockSearch, KernelError> {
    weights.check("nvfp4 block search weights")?;
    let (rows, cols) = (weights.rows, weights.cols);
    let h = channel_weights(search, rows, cols, diag_h, global_scale)?;
    let blocks = rows * cols / NVFP4_BLOCK;
    let shrink: Vec<f32> = (0..search.iters).map(|i| search.shrink(i)).collect();
    // Codes 0..=0x7F: the NaN code's entry keeps the final encode of a marked block in bounds.
    let e4m3: Vec<f32> = (0..=E4M3_NAN_CODE as u8)
        .map(|c| E4M3FN.decode(c))
        .collect();
    let result = DeviceBlockSearch {
        rows,
        cols,
        global_scale,
        block_scales: DeviceVec::zeros(client, blocks),
        block_error: DeviceVec::zeros(client, blocks),
        codes: DeviceVec::zeros(client, rows * cols),
    };
    let tables = Tables {
        h: DeviceVec::upload(client, &h),
        shrink: DeviceVec::upload(client, &shrink),
        e4m3: DeviceVec::upload(client, &e4m3),
        e2m1: DeviceVec::upload(client, &E2M1_VALUES[..8]),
    };
    let (count, dim) = elementwise(client, blocks)?;
    block_search_kernel::launch::<R>(
        client,
        count,
        dim,
        array_arg(&weights.handle),
        array_arg(&tables.h.handle),
        array_arg(&tables.shrink.handle),
        array_arg(&tables.e4m3.handle),
        array_arg(&tables.e2m1.handle),
        array_arg(&result.block_scales.handle),
        array_arg(&result.block_error.handle),
        array_arg(&result.codes.handle),
        BlockSearchArgsLaunch::new(
            weights.offset,
            weights.row_stride,
            cols / NVFP4_BLOCK,
            blocks,
            search.iters,
            E2M1_MAX * global_scale,
            global_scale,
            search.error_norm,
            1.0,
            f32::INFINITY,
        ),
    );
    flush(client, "nvfp4 block search")?;
    Ok(result)
}

/// The uploaded lookup tables of one search.
struct Tables {
    h: DeviceVec<f32>,
    shrink: DeviceVec<f32>,
    e4m3: DeviceVec<f32>,
    e2m1: DeviceVec<f32>,
}

/// Validates the inputs like the CPU search and returns `h = diag / max(diag)` (all ones
/// when the diagonal is zero).
fn channel_weights(
    search: &Nvfp4BlockSearch,
    rows: usize,
    cols: usize,
    diag_h: &[f32],
    global_scale: f32,
) -> Result<Vec<f32>, KernelError> {
    search.validate()?;
    if rows == 0 || cols == 0 {
        return Err(HessianError::Empty { what: "weights" }.into());
    }
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
        }
        .into());
    }
    if let Some(j) = diag_h.iter().position(|v| !v.is_finite()) {
        return Err(HessianError::NonFinite {
            what: "diagonal hessian",
            row: 0,
            col: j,
            value: diag_h[j] as f64,
        }
        .into());
    }
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

fn invalid(name: &'static str, value: String, rule: &'static str) -> KernelError {
    HessianError::InvalidOption { name, value, rule }.into()
}

/// The scalars of the search kernel.
#[derive(CubeLaunch, CubeType)]
struct BlockSearchArgs {
    /// Window of the weight in its buffer.
    w_offset: usize,
    w_stride: usize,
    /// Blocks per row and in total.
    blocks_per_row: usize,
    blocks: usize,
    /// Candidates per block.
    iters: usize,
    /// `6 · global_scale` (the max-calibration divisor).
    six_global: f32,
    global: f32,
    /// Error exponent `p`.
    p: f32,
    /// A runtime 1.0 that keeps FMA contraction exact (see the module documentation).
    one: f32,
    /// `f32::INFINITY`, the initial best error (WGSL has no infinity literal).
    infinity: f32,
}

/// One unit per `(row, block)`: the candidate loop, then the chosen scale's codes.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn block_search_kernel(
    w: &Array<f32>,
    h: &Array<f32>,
    shrink: &Array<f32>,
    e4m3: &Array<f32>,
    e2m1: &Array<f32>,
    scales: &mut Array<u32>,
    errors: &mut Array<f32>,
    codes: &mut Array<u32>,
    args: &BlockSearchArgs,
) {
    let b = ABSOLUTE_POS;
    if b < args.blocks {
        let row = b / args.blocks_per_row;
        let col0 = (b % args.blocks_per_row) * 16;
        let base = args.w_offset + row * args.w_stride + col0;
        let mut amax = 0.0f32;
        let mut finite = true;
        for j in 0..16usize {
            let v = w[base + j];
            if v.is_nan() || v.is_inf() {
                finite = false;
            }
            let a = v.abs();
            if a > amax {
                amax = a;
            }
        }
        let init = amax / args.six_global;
        let mut best_byte = 0u32;
        let mut best_err = args.infinity;
        let mut previous = 256u32;
        for i in 0..args.iters {
            let s = clamp_scale(init * shrink[i]);
            let byte = e4m3_encode(e4m3, s);
            if byte != previous {
                previous = byte;
                let divisor = e4m3[byte as usize] * args.global;
                let err = block_error(w, h, e2m1, base, col0, divisor, args.p, args.one);
                if err < best_err {
                    best_err = err;
                    best_byte = byte;
                }
            }
        }
        if !finite {
            // The E4M3 NaN byte marks the block for `download` (which reports an error).
            best_byte = E4M3_NAN_CODE;
            best_err = args.infinity;
        }
        scales[b] = best_byte;
        errors[b] = best_err;
        let divisor = e4m3[best_byte as usize] * args.global;
        let out = row * args.blocks_per_row * 16 + col0;
        for j in 0..16usize {
            codes[out + j] = e2m1_encode(w[base + j] / divisor);
        }
    }
}

/// `clamp(s, 2⁻⁹, 448)` (NaN-free: `s` comes from finite or infinite values only), as
/// explicit selects: the same code on every backend, whatever its `clamp` does with infinities.
#[cube]
#[allow(clippy::manual_clamp)]
fn clamp_scale(s: f32) -> f32 {
    let mut out = s;
    if s < E4M3_MIN_POSITIVE {
        out = E4M3_MIN_POSITIVE;
    }
    if s > E4M3_MAX {
        out = E4M3_MAX;
    }
    out
}

/// The E4M3 code nearest to `s` in `[2⁻⁹, 448]`, ties to the even code, by bisection over
/// the table of positive values (codes 1..=0x7E are increasing).
#[cube]
fn e4m3_encode(e4m3: &Array<f32>, s: f32) -> u32 {
    // Largest code `lo` with e4m3[lo] <= s, bisecting `[lo, hi)` from `[1, 127)`: 126
    // candidates, 7 halvings (a range of one is left alone: e4m3[lo] <= s).
    let mut lo = 1u32;
    let mut hi = 127u32;
    for _ in 0..7u32 {
        let mid = (lo + hi) / 2;
        if e4m3[mid as usize] <= s {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let mut code = lo;
    if lo < E4M3_MAX_CODE {
        // Both distances are exact (the neighbours are within a factor 2 of `s`).
        let down = s - e4m3[lo as usize];
        let up = e4m3[lo as usize + 1] - s;
        if up < down || (up == down && lo % 2 == 1) {
            code = lo + 1;
        }
    }
    code
}

/// `e2m1_encode_fast`: the index counts the midpoints below `|x|` (`>` sends a tie down,
/// `>=` up, toward the even mantissa); the sign bit is `x < 0` (ModelOpt: `-0.0` → `+0`).
#[cube]
fn e2m1_encode(x: f32) -> u32 {
    let a = x.abs();
    let mut index = 0u32;
    if a > 0.25 {
        index += 1;
    }
    if a >= 0.75 {
        index += 1;
    }
    if a > 1.25 {
        index += 1;
    }
    if a >= 1.75 {
        index += 1;
    }
    if a > 2.5 {
        index += 1;
    }
    if a >= 3.5 {
        index += 1;
    }
    if a > 5.0 {
        index += 1;
    }
    if x < 0.0 {
        index += 8;
    }
    index
}

/// `Σ_j |w_j − deq_j|^p · h_j` of one block under `divisor`, in element order.
#[cube]
#[allow(clippy::too_many_arguments)]
fn block_error(
    w: &Array<f32>,
    h: &Array<f32>,
    e2m1: &Array<f32>,
    base: usize,
    col0: usize,
    divisor: f32,
    p: f32,
    one: f32,
) -> f32 {
    let mut err = 0.0f32;
    for j in 0..16usize {
        let v = w[base + j];
        let code = e2m1_encode(v / divisor);
        let deq = e2m1[(code % 8) as usize] * divisor;
        let mut sign = one;
        if code >= 8 {
            sign = -one;
        }
        let diff = (v - deq * sign).abs();
        let mut term = diff * diff;
        if p != 2.0 {
            term = 0.0;
            if diff > 0.0 {
                term = diff.powf(p);
            }
        }
        err += (term * h[col0 + j]) * one;
    }
    err
}
