//! The NVFP4 block-scale search on the device: one unit per `(row, 16-block)` tries every
//! shrunk E4M3 candidate of [`Nvfp4BlockSearch`] in registers and keeps the first with the
//! smallest Hessian-weighted error, then writes the block's E2M1 codes.
//!
//! Bit-exactness with `sala_hessian::reference::nvfp4_block_search_naive`:
//! - the candidate shrink factors `1 − i·max_shrink/iters` and `6·global_scale` are computed
//!   on the host with the reference's own expressions and uploaded;
//! - rounding a candidate to E4M3 works on its f32 bits: in the normal range the exponent
//!   and the top three mantissa bits are the code, rounded to nearest-even on the 20 bits
//!   below (a carry moves to the next binade, as it should); below 2⁻⁶ the code is
//!   `s · 2⁹` (exact) rounded to nearest-even; decoding builds the f32 bits back. Both equal
//!   `E4M3FN.encode_non_nan` / `decode` on `[2⁻⁹, 448]` (tested against them on every code
//!   and every midpoint);
//! - E2M1 rounding is `e2m1_encode_fast` (midpoint comparisons, sign bit `x < 0`), which also
//!   yields the magnitude, so no table is read;
//! - a block's 16 weights and channel weights are read once into registers;
//! - the error sums the 16 terms in element order in f32 like `block_error`; every product
//!   that feeds an addition is multiplied by a runtime `1.0` first, so that a GPU compiler
//!   that contracts `a·b + c` into an FMA (CUDA does by default) contracts `(a·b)·1 + c`
//!   instead, which rounds exactly like the reference's separate multiply and add.

use cubecl::prelude::*;
use sala_formats::minifloat::{E2M1_MAX, E4M3_MAX, E4M3_MIN_POSITIVE};
use sala_formats::NVFP4_BLOCK;
use sala_hessian::{HessianError, Nvfp4BlockSearch, Nvfp4SearchResult};

pub use self::bits::{e4m3_decode_bits, e4m3_encode_bits};

use crate::device::{array_arg, to_bytes, DeviceVec, MatrixView};
use crate::error::{flush, KernelError};
use crate::launch::elementwise;
use crate::solver::Transfer;

/// The E4M3FN NaN code: the scale of a block with a non-finite weight.
pub(crate) const E4M3_NAN_CODE: u32 = 0x7F;

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
        self.download_with(client, &crate::solver::CubeTransfer)
    }

    /// [`DeviceBlockSearch::download`] through `transfer`'s copies (the driver's on CUDA:
    /// CubeCL stages reads of up to 100 MB in pinned host pages of up to 2.2 GB that it keeps
    /// for the rest of the process).
    pub fn download_with<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        transfer: &dyn Transfer<R>,
    ) -> Result<Nvfp4SearchResult, KernelError> {
        let block_scales = download_block_scales(client, transfer, &self.block_scales, self.cols)?;
        let block_error = transfer.download_f32(client, &self.block_error)?;
        let codes: Vec<u8> = self.codes.download_low_bytes_with(client, transfer)?;
        let dequantized =
            sala_formats::nvfp4::dequantize_codes(&codes, &block_scales, self.global_scale);
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

/// Downloads the E4M3 scale bytes of a `[rows, cols / 16]` block grid (one byte per `u32`
/// element) and refuses a NaN code: the search writes one only where a block's weights were
/// not finite, so the error names that block's row and first column.
pub(crate) fn download_block_scales<R: Runtime>(
    client: &ComputeClient<R>,
    transfer: &dyn Transfer<R>,
    scales: &DeviceVec<u32>,
    cols: usize,
) -> Result<Vec<u8>, KernelError> {
    let blocks = cols / NVFP4_BLOCK;
    let bytes: Vec<u8> = to_bytes(transfer.download_u32(client, scales)?);
    match bytes.iter().position(|&s| u32::from(s) == E4M3_NAN_CODE) {
        Some(b) => Err(HessianError::NonFinite {
            what: "weights",
            row: b / blocks,
            col: (b % blocks) * NVFP4_BLOCK,
            value: f64::NAN,
        }
        .into()),
        None => Ok(bytes),
    }
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
    if rows == 0 || cols == 0 {
        return Err(HessianError::Empty { what: "weights" }.into());
    }
    let h = search.channel_weights(cols, diag_h, global_scale)?;
    let h = DeviceVec::upload(client, &h);
    let launch = SearchLaunch::new(client, search, global_scale);
    let result = launch.search(client, weights, &h, 0)?;
    flush(client, "nvfp4 block search")?;
    Ok(result)
}

/// The search's constants on the device, for searches of many windows (GPTQ on the NVFP4
/// grid searches each 16-column block when its loop reaches it).
pub(crate) struct SearchLaunch {
    /// The candidates' shrink factors, computed on the host with the reference's expression.
    shrink: DeviceVec<f32>,
    iters: usize,
    error_norm: f32,
    global_scale: f32,
}

impl SearchLaunch {
    /// The constants of `search` under `global_scale` (validated by the caller).
    pub(crate) fn new<R: Runtime>(
        client: &ComputeClient<R>,
        search: &Nvfp4BlockSearch,
        global_scale: f32,
    ) -> Self {
        let shrink: Vec<f32> = (0..search.iters).map(|i| search.shrink(i)).collect();
        Self {
            shrink: DeviceVec::upload(client, &shrink),
            iters: search.iters,
            error_norm: search.error_norm,
            global_scale,
        }
    }

    /// Queues the search of every block of the window `weights` (`cols` a multiple of 16),
    /// column `j` of the window weighted by `channel_weights[h_offset + j]` (normalized), into
    /// a new result.
    pub(crate) fn search<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        weights: &MatrixView,
        channel_weights: &DeviceVec<f32>,
        h_offset: usize,
    ) -> Result<DeviceBlockSearch, KernelError> {
        let result = self.result_for(client, weights.rows, weights.cols)?;
        self.search_into(client, weights, channel_weights, h_offset, &result)?;
        Ok(result)
    }

    /// A zeroed result for a `rows × cols` window, for [`search_into`](Self::search_into).
    pub(crate) fn result_for<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        rows: usize,
        cols: usize,
    ) -> Result<DeviceBlockSearch, KernelError> {
        let blocks = rows * cols / NVFP4_BLOCK;
        Ok(DeviceBlockSearch {
            rows,
            cols,
            global_scale: self.global_scale,
            block_scales: DeviceVec::zeros(client, blocks)?,
            block_error: DeviceVec::zeros(client, blocks)?,
            codes: DeviceVec::zeros(client, rows * cols)?,
        })
    }

    /// [`search`](Self::search) into `result`, a result of the window's shape whose every
    /// element the search overwrites (a loop that searches many windows allocates it once).
    pub(crate) fn search_into<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        weights: &MatrixView,
        channel_weights: &DeviceVec<f32>,
        h_offset: usize,
        result: &DeviceBlockSearch,
    ) -> Result<(), KernelError> {
        let (rows, cols) = (weights.rows, weights.cols);
        if (result.rows, result.cols) != (rows, cols) {
            return Err(KernelError::shape(
                "nvfp4 block search",
                format!(
                    "a {rows}×{cols} window into a {}×{} result",
                    result.rows, result.cols
                ),
            ));
        }
        let blocks = rows * cols / NVFP4_BLOCK;
        let (count, dim) = elementwise(client, blocks)?;
        block_search_kernel::launch::<R>(
            client,
            count,
            dim,
            array_arg(&weights.handle),
            array_arg(&channel_weights.handle),
            array_arg(&self.shrink.handle),
            array_arg(&result.block_scales.handle),
            array_arg(&result.block_error.handle),
            array_arg(&result.codes.handle),
            BlockSearchArgsLaunch::new(
                weights.offset,
                weights.row_stride,
                h_offset,
                cols / NVFP4_BLOCK,
                blocks,
            ),
            self.scalars(),
        );
        Ok(())
    }

    /// The candidates' shrink factors on the device, `[iters]`.
    pub(crate) fn shrink(&self) -> &DeviceVec<f32> {
        &self.shrink
    }

    /// The candidate loop's scalars, for a kernel launch ([`search_block`]).
    pub(crate) fn scalars<R: Runtime>(&self) -> SearchScalarsLaunch<R> {
        SearchScalarsLaunch::new(
            self.iters,
            E2M1_MAX * self.global_scale,
            self.global_scale,
            self.error_norm,
            1.0,
            f32::INFINITY,
        )
    }
}

/// Where the search kernel's window and blocks are.
#[derive(CubeLaunch, CubeType)]
struct BlockSearchArgs {
    /// Window of the weight in its buffer.
    w_offset: usize,
    w_stride: usize,
    /// The channel weight of the window's column 0.
    h_offset: usize,
    /// Blocks per row and in total.
    blocks_per_row: usize,
    blocks: usize,
}

/// The candidate loop's scalars ([`search_block`]).
#[derive(CubeLaunch, CubeType)]
pub(crate) struct SearchScalars {
    /// Candidates per block.
    pub(crate) iters: usize,
    /// `6 · global_scale` (the max-calibration divisor).
    pub(crate) six_global: f32,
    pub(crate) global: f32,
    /// Error exponent `p`.
    pub(crate) p: f32,
    /// A runtime 1.0 that keeps FMA contraction exact (see the module documentation).
    pub(crate) one: f32,
    /// `f32::INFINITY`, the initial best error (WGSL has no infinity literal).
    pub(crate) infinity: f32,
}

/// One unit per `(row, block)`: the candidate loop, then the chosen scale's codes.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn block_search_kernel(
    w: &Array<f32>,
    h: &Array<f32>,
    shrink: &Array<f32>,
    scales: &mut Array<u32>,
    errors: &mut Array<f32>,
    codes: &mut Array<u32>,
    args: &BlockSearchArgs,
    search: &SearchScalars,
) {
    let b = ABSOLUTE_POS;
    if b < args.blocks {
        let row = b / args.blocks_per_row;
        let col0 = (b % args.blocks_per_row) * 16;
        let base = args.w_offset + row * args.w_stride + col0;
        let mut values = Array::<f32>::new(16usize);
        let mut channel = Array::<f32>::new(16usize);
        #[unroll]
        for j in 0..16usize {
            values[j] = w[base + j];
            channel[j] = h[args.h_offset + col0 + j];
        }
        let (byte, err) = search_block(&values, &channel, shrink, search);
        let mut divisor = e4m3_decode(byte) * search.global;
        if byte == E4M3_NAN_CODE {
            divisor = search.one;
        }
        scales[b] = byte;
        errors[b] = err;
        let out = row * args.blocks_per_row * 16 + col0;
        #[unroll]
        for j in 0..16usize {
            codes[out + j] = e2m1_round(values[j] / divisor).0;
        }
    }
}

/// The candidate loop on one block's 16 `values` weighted by `channel`: the first E4M3
/// byte of the smallest error and that error; for a block with a NaN or infinite value the
/// NaN byte ([`E4M3_NAN_CODE`], which no finite candidate encodes to) and infinity.
#[cube]
pub(crate) fn search_block(
    values: &Array<f32>,
    channel: &Array<f32>,
    shrink: &Array<f32>,
    search: &SearchScalars,
) -> (u32, f32) {
    let (init, finite) = max_scale(values, search);
    let (index, err) = search_candidates(values, channel, shrink, search, init, 0, 1);
    let mut best_err = err;
    if !finite {
        best_err = search.infinity;
    }
    (chosen_byte(init, shrink, search, index, finite), best_err)
}

/// The max-calibration scale of a block, `amax / (6 · global)`, and whether its 16 `values`
/// are all finite.
#[cube]
pub(crate) fn max_scale(values: &Array<f32>, search: &SearchScalars) -> (f32, bool) {
    let mut amax = 0.0f32;
    let mut finite = true;
    #[unroll]
    for j in 0..16usize {
        let v = values[j];
        if v.is_nan() || v.is_inf() {
            finite = false;
        }
        let a = v.abs();
        if a > amax {
            amax = a;
        }
    }
    (amax / search.six_global, finite)
}

/// The candidates `first, first + stride, …` of a block whose max-calibration scale is
/// `init`: the index of the first with the smallest error among them, and that error
/// (`search.iters` and infinity when none has a finite error). A candidate whose E4M3 byte
/// equals its predecessor's is skipped, as the host does, so that a team of `stride` units
/// dealing the candidates round-robin evaluates each distinct byte exactly once; the team's
/// choice is then the least error, the lowest index among equal ones ([`chosen_byte`]).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn search_candidates(
    values: &Array<f32>,
    channel: &Array<f32>,
    shrink: &Array<f32>,
    search: &SearchScalars,
    init: f32,
    first: usize,
    stride: usize,
) -> (usize, f32) {
    let mut best_index = search.iters;
    let mut best_err = search.infinity;
    let mut i = first;
    let mut previous = 256u32;
    if i > 0 && i < search.iters {
        previous = candidate_byte(init, shrink[i - 1]);
    }
    while i < search.iters {
        let byte = candidate_byte(init, shrink[i]);
        if byte != previous {
            let divisor = e4m3_decode(byte) * search.global;
            let err = block_error(values, channel, divisor, search.p, search.one);
            if err < best_err {
                best_err = err;
                best_index = i;
            }
        }
        previous = byte;
        if stride > 1 && i + stride < search.iters {
            previous = candidate_byte(init, shrink[i + stride - 1]);
        }
        i += stride;
    }
    (best_index, best_err)
}

/// The E4M3 byte of candidate `index` (`search.iters`, no candidate, gives byte 0, as the
/// host does), or [`E4M3_NAN_CODE`] for a block that is not `finite`.
#[cube]
pub(crate) fn chosen_byte(
    init: f32,
    shrink: &Array<f32>,
    search: &SearchScalars,
    index: usize,
    finite: bool,
) -> u32 {
    let mut byte = 0u32;
    if index < search.iters {
        byte = candidate_byte(init, shrink[index]);
    }
    if !finite {
        // The E4M3 NaN byte marks the block for `download` (which reports an error).
        byte = E4M3_NAN_CODE;
    }
    byte
}

/// Candidate `init · shrink` clamped and rounded to an E4M3 byte.
#[cube]
fn candidate_byte(init: f32, shrink: f32) -> u32 {
    e4m3_encode(clamp_scale(init * shrink))
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

/// The E4M3 code nearest to `s` in `[2⁻⁹, 448]`, ties to the even code ([`bits`] has the
/// same arithmetic on the host).
#[cube]
fn e4m3_encode(s: f32) -> u32 {
    // Below 2⁻⁶: `s · 2⁹` (exact) to nearest, ties to even.
    let scaled = s * 512.0;
    let m = u32::cast_from(scaled);
    let fraction = scaled - f32::cast_from(m);
    let mut code = m;
    if fraction > 0.5 || (fraction == 0.5 && m % 2 == 1) {
        code = m + 1;
    }
    let x = u32::reinterpret(s);
    if x >= bits::MIN_NORMAL_BITS {
        code = ((x + 0x7FFFFu32 + ((x >> 20) & 1)) >> 20) - bits::CODE_BIAS;
    }
    code
}

/// The value of a positive E4M3 code (`1..=0x7E`).
#[cube]
pub(crate) fn e4m3_decode(code: u32) -> f32 {
    let mut value = f32::cast_from(code) * (1.0 / 512.0);
    if code >= 8 {
        value = f32::reinterpret((code + bits::CODE_BIAS) << 20);
    }
    value
}

/// `e2m1_encode_fast` and the code's magnitude: the index counts the midpoints below `|x|`
/// (`>` sends a tie down, `>=` up, toward the even mantissa); the sign bit is `x < 0`
/// (ModelOpt: `-0.0` → `+0`).
#[cube]
pub(crate) fn e2m1_round(x: f32) -> (u32, f32) {
    let a = x.abs();
    let mut index = 0u32;
    let mut magnitude = 0.0f32;
    if a > 0.25 {
        index = 1;
        magnitude = 0.5;
    }
    if a >= 0.75 {
        index = 2;
        magnitude = 1.0;
    }
    if a > 1.25 {
        index = 3;
        magnitude = 1.5;
    }
    if a >= 1.75 {
        index = 4;
        magnitude = 2.0;
    }
    if a > 2.5 {
        index = 5;
        magnitude = 3.0;
    }
    if a >= 3.5 {
        index = 6;
        magnitude = 4.0;
    }
    if a > 5.0 {
        index = 7;
        magnitude = 6.0;
    }
    if x < 0.0 {
        index += 8;
    }
    (index, magnitude)
}

/// The magnitude of an E2M1 code's low three bits (`e2m1_decode` without the sign).
#[cube]
pub(crate) fn e2m1_magnitude(code: u32) -> f32 {
    let index = code % 8;
    let mut magnitude = f32::cast_from(index) * 0.5;
    if index >= 5 {
        magnitude = f32::cast_from(index - 2);
    }
    if index == 7 {
        magnitude = 6.0;
    }
    magnitude
}

/// `Σ_j |w_j − deq_j|^p · h_j` of one block under `divisor`, in element order.
#[cube]
fn block_error(values: &Array<f32>, channel: &Array<f32>, divisor: f32, p: f32, one: f32) -> f32 {
    let mut err = 0.0f32;
    #[unroll]
    for j in 0..16usize {
        let v = values[j];
        let (code, magnitude) = e2m1_round(v / divisor);
        let deq = magnitude * divisor;
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
        err += (term * channel[j]) * one;
    }
    err
}

/// The kernel's E4M3 arithmetic on the host, where it is checked against `sala_formats`.
pub mod bits {
    /// `2⁻⁶` (the smallest normal E4M3 value) as f32 bits.
    pub const MIN_NORMAL_BITS: u32 = 0x3C80_0000;
    /// `(127 − 7) << 3`: f32's exponent bias minus E4M3's, in the code's position.
    pub const CODE_BIAS: u32 = 120 << 3;

    /// The E4M3 code nearest to `s` in `[2⁻⁹, 448]`, ties to the even code.
    pub fn e4m3_encode_bits(s: f32) -> u32 {
        let x = s.to_bits();
        if x >= MIN_NORMAL_BITS {
            ((x + 0x7FFFF + ((x >> 20) & 1)) >> 20) - CODE_BIAS
        } else {
            let scaled = s * 512.0;
            let m = scaled as u32;
            let fraction = scaled - m as f32;
            if fraction > 0.5 || (fraction == 0.5 && m % 2 == 1) {
                m + 1
            } else {
                m
            }
        }
    }

    /// The value of a positive E4M3 code (`1..=0x7E`).
    pub fn e4m3_decode_bits(code: u32) -> f32 {
        if code >= 8 {
            f32::from_bits((code + CODE_BIAS) << 20)
        } else {
            code as f32 / 512.0
        }
    }
}
