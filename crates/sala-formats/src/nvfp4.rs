//! NVFP4 (ModelOpt layout): E2M1 codes in blocks of 16 along the input dimension, one FP8 E4M3
//! block scale per block, one FP32 global scale per tensor.
//!
//! Conventions (ModelOpt `nvfp4_tensor.py`, what SGLang and vLLM load):
//! - `weight_scale_2 = amax / (6·448)`; it **multiplies** on dequantization;
//! - block scale `s_b = amax_b / (6 · weight_scale_2)`, clamped to `[2⁻⁹, 448]` (ModelOpt 0.47:
//!   a stored block scale is never 0), then cast to E4M3 with round-to-nearest-even;
//! - codes `e2m1(x / (f32(s_b) · weight_scale_2))`; dequantization `LUT[code] · (f32(s_b) · weight_scale_2)`;
//! - packing: element `2j` in the low nibble of byte `j`, element `2j+1` in the high nibble.

use crate::minifloat::{
    e2m1_decode, e2m1_encode_fast, E2M1_MAX, E4M3FN, E4M3_MAX, E4M3_MIN_POSITIVE,
};
use crate::shape::{check_divisible, check_len, check_matrix};
use crate::FormatError;
use rayon::prelude::*;

/// Rows per parallel task of the whole-matrix conversions (a 4096-column task is 64 K values).
const ROWS_PER_TASK: usize = 16;

/// Elements per block scale.
pub const NVFP4_BLOCK: usize = 16;
/// `6 · 448`: the ratio between a tensor's amax and its `weight_scale_2`.
pub const NVFP4_SCALE_DENOMINATOR: f32 = E2M1_MAX * E4M3_MAX;

/// The global scale (`weight_scale_2`, also the `input_scale` convention) for a tensor amax.
///
/// An all-zero tensor (`amax == 0`) gets the scale of `amax = 1` so that every division stays
/// finite; its codes are all zero either way.
pub fn global_scale_from_amax(amax: f32) -> Result<f32, FormatError> {
    if !amax.is_finite() || amax < 0.0 {
        return Err(FormatError::InvalidScale {
            what: "amax",
            value: amax,
        });
    }
    let amax = if amax == 0.0 { 1.0 } else { amax };
    Ok(amax / NVFP4_SCALE_DENOMINATOR)
}

fn check_global_scale(global_scale: f32) -> Result<(), FormatError> {
    if !(global_scale.is_finite() && global_scale > 0.0) {
        return Err(FormatError::InvalidScale {
            what: "global",
            value: global_scale,
        });
    }
    Ok(())
}

/// The E4M3 block scale that max calibration gives a block of absolute maximum `block_amax`.
///
/// `clamp(block_amax / (6 · global_scale), 2⁻⁹, 448)` rounded to E4M3 (returned as its byte).
#[inline]
pub fn max_block_scale(block_amax: f32, global_scale: f32) -> u8 {
    let s = block_amax / (E2M1_MAX * global_scale);
    E4M3FN.encode_non_nan(s.clamp(E4M3_MIN_POSITIVE, E4M3_MAX))
}

/// The divisor applied to a block's values: `f32(block scale) · global_scale`.
#[inline]
pub fn block_divisor(block_scale: u8, global_scale: f32) -> f32 {
    E4M3FN.decode(block_scale) * global_scale
}

/// Encodes one block's values with a given divisor into E2M1 codes (one code per element).
///
/// Values must be finite (callers check once per block).
#[inline]
pub fn encode_block(values: &[f32], divisor: f32, codes: &mut [u8]) {
    for (c, &v) in codes.iter_mut().zip(values) {
        *c = e2m1_encode_fast(v / divisor);
    }
}

/// Codes per parallel task of packing and unpacking: per-element tasks cost more than the
/// work (a layer of the 9B model has 280 M codes).
const CODES_PER_TASK: usize = 1 << 16;

/// Packs E2M1 codes two per byte (element `2j` low nibble, `2j+1` high nibble).
///
/// Errors: an odd count, or a code above `0xF` (the first one, by index).
pub fn pack_e2m1(codes: &[u8]) -> Result<Vec<u8>, FormatError> {
    check_divisible("code count", codes.len(), 2)?;
    let mut packed = vec![0u8; codes.len() / 2];
    // Each task ORs its codes together, so one pass both packs and finds whether any code is
    // out of range; only then is the first such code searched for.
    let any_bits = packed
        .par_chunks_mut(CODES_PER_TASK / 2)
        .zip(codes.par_chunks(CODES_PER_TASK))
        .map(|(out, codes)| pack_pairs_into(codes, out))
        .reduce(|| 0, |a, b| a | b);
    if any_bits > 0xF {
        if let Some(index) = codes.iter().position(|&c| c > 0xF) {
            return Err(FormatError::CodeOutOfRange {
                code: codes[index] as u32,
                index,
                bits: 4,
            });
        }
    }
    Ok(packed)
}

/// Packs `codes` two per byte into `out` (element `2j` in the low nibble of `out[j]`) and
/// returns the OR of all the codes, so that a caller can tell from one value whether any code
/// exceeds `0xF` (its high bits would then be lost in the packing).
fn pack_pairs_into(codes: &[u8], out: &mut [u8]) -> u8 {
    let mut bits = 0u8;
    for (byte, pair) in out.iter_mut().zip(codes.chunks_exact(2)) {
        *byte = pair[0] | (pair[1] << 4);
        bits |= pair[0] | pair[1];
    }
    bits
}

/// Dequantizes unpacked E2M1 `codes` (one per element, row-major, a multiple of 16 of them)
/// with one E4M3 byte of `block_scales` per 16 codes: `e2m1(code) · block_divisor(byte,
/// global_scale)`, what [`Nvfp4Matrix::dequantize`] computes from the packed form, for
/// solvers that return codes unpacked (blocks in parallel: a layer of the 9B model has 280 M
/// codes). Codes past the last whole block or its scale are left out.
pub fn dequantize_codes(codes: &[u8], block_scales: &[u8], global_scale: f32) -> Vec<f32> {
    let blocks = (codes.len() / NVFP4_BLOCK).min(block_scales.len());
    let mut out = vec![0f32; blocks * NVFP4_BLOCK];
    out.par_chunks_mut(NVFP4_BLOCK)
        .zip(codes.par_chunks_exact(NVFP4_BLOCK))
        .zip(block_scales.par_iter())
        .with_min_len(1024)
        .for_each(|((values, block), &byte)| {
            let divisor = block_divisor(byte, global_scale);
            for (v, &c) in values.iter_mut().zip(block) {
                *v = e2m1_decode(c) * divisor;
            }
        });
    out
}

/// Unpacks bytes into E2M1 codes (two per byte, low nibble first).
pub fn unpack_e2m1(packed: &[u8]) -> Vec<u8> {
    let mut codes = vec![0u8; packed.len() * 2];
    codes
        .par_chunks_mut(CODES_PER_TASK)
        .zip(packed.par_chunks(CODES_PER_TASK / 2))
        .for_each(|(codes, packed)| {
            for (pair, &byte) in codes.chunks_exact_mut(2).zip(packed) {
                pair[0] = byte & 0xF;
                pair[1] = byte >> 4;
            }
        });
    codes
}

/// A row-major `[rows, cols]` matrix in NVFP4.
#[derive(Debug, Clone, PartialEq)]
pub struct Nvfp4Matrix {
    /// Output rows.
    pub rows: usize,
    /// Input columns (a multiple of 16).
    pub cols: usize,
    /// Packed E2M1 codes, `[rows, cols/2]` bytes (the `weight` tensor, uint8).
    pub packed: Vec<u8>,
    /// E4M3 block scales as bytes, `[rows, cols/16]` (the `weight_scale` tensor, float8_e4m3fn).
    pub block_scales: Vec<u8>,
    /// `weight_scale_2` (fp32 scalar, multiplies on dequant).
    pub global_scale: f32,
}

/// Which block scales to use when quantizing.
#[derive(Debug, Clone, Copy)]
pub enum BlockScales<'a> {
    /// Max calibration: each block's scale from its absolute maximum.
    Max,
    /// Scales chosen by the caller (e.g. a search), E4M3 bytes `[rows, cols/16]`.
    Given(&'a [u8]),
}

impl Nvfp4Matrix {
    /// Quantizes a row-major `[rows, cols]` matrix with a given global scale.
    pub fn quantize(
        weights: &[f32],
        rows: usize,
        cols: usize,
        global_scale: f32,
        scales: BlockScales<'_>,
    ) -> Result<Self, FormatError> {
        check_matrix("weights", weights.len(), rows, cols)?;
        check_divisible("cols", cols, NVFP4_BLOCK)?;
        check_global_scale(global_scale)?;
        let blocks = cols / NVFP4_BLOCK;
        let mut block_scales = match scales {
            BlockScales::Max => vec![0u8; rows * blocks],
            BlockScales::Given(s) => {
                check_len("block scales", s.len(), rows * blocks)?;
                s.to_vec()
            }
        };
        let mut packed = vec![0u8; rows * cols / 2];
        let compute = matches!(scales, BlockScales::Max);
        // Rows in parallel; the first failing task in row order names the error, as a
        // sequential pass would.
        let blocks_per_task = ROWS_PER_TASK * blocks;
        let outcomes: Vec<Result<(), FormatError>> = weights
            .par_chunks((ROWS_PER_TASK * cols).max(1))
            .zip(block_scales.par_chunks_mut(blocks_per_task.max(1)))
            .zip(packed.par_chunks_mut((ROWS_PER_TASK * cols / 2).max(1)))
            .enumerate()
            .map(|(task, ((w, scales), packed))| {
                let first_row = task * ROWS_PER_TASK;
                quantize_rows_into(w, cols, global_scale, first_row, compute, scales, packed)
            })
            .collect();
        outcomes.into_iter().collect::<Result<(), FormatError>>()?;
        Ok(Self {
            rows,
            cols,
            packed,
            block_scales,
            global_scale,
        })
    }

    /// A matrix from its unpacked E2M1 codes `[rows, cols]` (each at most 15) and E4M3 block
    /// scale bytes `[rows, cols/16]`: for solvers whose codes are not those of rounding a
    /// given weight (GPTQ).
    pub fn from_codes(
        codes: &[u8],
        rows: usize,
        cols: usize,
        global_scale: f32,
        block_scales: Vec<u8>,
    ) -> Result<Self, FormatError> {
        check_matrix("codes", codes.len(), rows, cols)?;
        check_divisible("cols", cols, NVFP4_BLOCK)?;
        check_global_scale(global_scale)?;
        check_len(
            "block scales",
            block_scales.len(),
            rows * cols / NVFP4_BLOCK,
        )?;
        Ok(Self {
            rows,
            cols,
            packed: pack_e2m1(codes)?,
            block_scales,
            global_scale,
        })
    }

    /// The unpacked E2M1 codes, `[rows, cols]`.
    pub fn codes(&self) -> Vec<u8> {
        unpack_e2m1(&self.packed)
    }

    /// Dequantizes to a row-major `[rows, cols]` f32 matrix (blocks in parallel).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        let task_blocks = ROWS_PER_TASK * (self.cols / NVFP4_BLOCK).max(1);
        out.par_chunks_mut(task_blocks * NVFP4_BLOCK)
            .zip(self.packed.par_chunks(task_blocks * NVFP4_BLOCK / 2))
            .zip(self.block_scales.par_chunks(task_blocks))
            .for_each(|((out, packed), scales)| {
                dequantize_rows_into(packed, scales, self.global_scale, out);
            });
        out
    }
}

/// Dequantizes whole blocks from caller-provided buffers, the inverse of
/// [`quantize_rows_into`]: `packed` (two codes a byte, low nibble first) and one scale byte of
/// `block_scales` per 16 values into `out`. Lengths must agree (`out` = 2 · `packed` = 16 ·
/// `block_scales`); extra elements of the longer ones are left alone.
pub fn dequantize_rows_into(
    packed: &[u8],
    block_scales: &[u8],
    global_scale: f32,
    out: &mut [f32],
) {
    let half_block = NVFP4_BLOCK / 2;
    let blocks = out.chunks_exact_mut(NVFP4_BLOCK);
    for ((values, block), &scale) in blocks
        .zip(packed.chunks_exact(half_block))
        .zip(block_scales)
    {
        let d = block_divisor(scale, global_scale);
        for (pair, &byte) in values.chunks_exact_mut(2).zip(block) {
            pair[0] = e2m1_decode(byte & 0xF) * d;
            pair[1] = e2m1_decode(byte >> 4) * d;
        }
    }
}

/// Quantizes whole rows into caller-provided buffers: the building block for parallel callers
/// (split `weights`, `block_scales` and `packed` by the same rows and call it per chunk).
///
/// - `weights`: `[n, cols]` for some `n`; `block_scales`: `[n, cols/16]`; `packed`: `[n, cols/2]`;
/// - `compute_scales`: fill `block_scales` by max calibration, or read them as given;
/// - `first_row`: the index of the chunk's first row, used only in error messages.
pub fn quantize_rows_into(
    weights: &[f32],
    cols: usize,
    global_scale: f32,
    first_row: usize,
    compute_scales: bool,
    block_scales: &mut [u8],
    packed: &mut [u8],
) -> Result<(), FormatError> {
    check_divisible("cols", cols, NVFP4_BLOCK)?;
    check_divisible("weights", weights.len(), cols)?;
    check_global_scale(global_scale)?;
    let n_blocks = weights.len() / NVFP4_BLOCK;
    check_len("block scales", block_scales.len(), n_blocks)?;
    check_len("packed", packed.len(), weights.len() / 2)?;
    let mut codes = [0u8; NVFP4_BLOCK];
    for (b, block) in weights.chunks_exact(NVFP4_BLOCK).enumerate() {
        let mut amax = 0.0f32;
        for (i, &v) in block.iter().enumerate() {
            if !v.is_finite() {
                let flat = b * NVFP4_BLOCK + i;
                return Err(FormatError::NonFinite {
                    row: first_row + flat / cols,
                    col: flat % cols,
                    value: v,
                });
            }
            amax = amax.max(v.abs());
        }
        if compute_scales {
            block_scales[b] = max_block_scale(amax, global_scale);
        }
        let divisor = block_divisor(block_scales[b], global_scale);
        if !(divisor.is_finite() && divisor > 0.0) {
            return Err(FormatError::InvalidScale {
                what: "block",
                value: E4M3FN.decode(block_scales[b]),
            });
        }
        encode_block(block, divisor, &mut codes);
        pack_pairs_into(
            &codes,
            &mut packed[b * NVFP4_BLOCK / 2..(b + 1) * NVFP4_BLOCK / 2],
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpacked_codes_dequantize_like_the_packed_matrix() {
        let (rows, cols) = (5, 48);
        let codes: Vec<u8> = (0..rows * cols).map(|k| (k * 11 % 16) as u8).collect();
        let scales: Vec<u8> = (0..rows * cols / 16)
            .map(|b| (b * 37 % 127) as u8)
            .collect();
        let g = global_scale_from_amax(2.0).unwrap();
        let matrix = Nvfp4Matrix::from_codes(&codes, rows, cols, g, scales.clone()).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&dequantize_codes(&codes, &scales, g)),
            bits(&matrix.dequantize())
        );
        // A partial block and a missing scale are left out.
        assert_eq!(dequantize_codes(&codes[..40], &scales, g).len(), 32);
        assert_eq!(dequantize_codes(&codes, &scales[..2], g).len(), 32);
    }

    #[test]
    fn global_scale_is_amax_over_2688() {
        assert_eq!(global_scale_from_amax(2688.0).unwrap(), 1.0);
        assert_eq!(global_scale_from_amax(5.376).unwrap(), 5.376 / 2688.0);
        assert!(global_scale_from_amax(f32::NAN).is_err());
    }

    #[test]
    fn packing_puts_even_elements_in_the_low_nibble() {
        assert_eq!(pack_e2m1(&[0x1, 0xF, 0x7, 0x8]).unwrap(), vec![0xF1, 0x87]);
        assert_eq!(unpack_e2m1(&[0xF1]), vec![0x1, 0xF]);
        assert!(pack_e2m1(&[16, 0]).is_err());
        assert!(pack_e2m1(&[1]).is_err());
    }

    #[test]
    fn a_block_whose_amax_is_the_tensor_amax_uses_scale_448() {
        let mut w = vec![0.0f32; 16];
        w[3] = -12.0;
        w[4] = 6.0;
        let g = global_scale_from_amax(12.0).unwrap();
        let m = Nvfp4Matrix::quantize(&w, 1, 16, g, BlockScales::Max).unwrap();
        assert_eq!(E4M3FN.decode(m.block_scales[0]), 448.0);
        let d = m.dequantize();
        assert_eq!(d[3], -12.0);
        assert_eq!(d[4], 6.0);
    }

    #[test]
    fn zero_blocks_get_the_smallest_scale_not_zero() {
        let w = vec![0.0f32; 32];
        let m = Nvfp4Matrix::quantize(&w, 1, 32, 1.0, BlockScales::Max).unwrap();
        assert_eq!(m.block_scales, vec![0x01, 0x01]);
        assert!(m.dequantize().iter().all(|&v| v == 0.0));
    }

    /// The row-parallel conversions against one sequential pass over the whole matrix, on a
    /// row count that leaves a partial last task; the first bad row in order names the error.
    #[test]
    fn parallel_conversions_equal_one_sequential_pass() {
        let (rows, cols) = (3 * ROWS_PER_TASK + 5, 64);
        let mut state = 0x2545_f491_u32;
        let w: Vec<f32> = (0..rows * cols)
            .map(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (state >> 8) as f32 / (1u32 << 24) as f32 * 8.0 - 4.0
            })
            .collect();
        let g = global_scale_from_amax(4.0).unwrap();
        let mut scales = vec![0u8; rows * cols / NVFP4_BLOCK];
        let mut packed = vec![0u8; rows * cols / 2];
        quantize_rows_into(&w, cols, g, 0, true, &mut scales, &mut packed).unwrap();
        let max = Nvfp4Matrix::quantize(&w, rows, cols, g, BlockScales::Max).unwrap();
        assert_eq!((&max.packed, &max.block_scales), (&packed, &scales));
        let shifted: Vec<u8> = scales.iter().map(|&s| s.saturating_sub(3).max(1)).collect();
        let mut given_packed = vec![0u8; rows * cols / 2];
        let mut given_scales = shifted.clone();
        quantize_rows_into(&w, cols, g, 0, false, &mut given_scales, &mut given_packed).unwrap();
        let given = Nvfp4Matrix::quantize(&w, rows, cols, g, BlockScales::Given(&shifted)).unwrap();
        assert_eq!(given.packed, given_packed);
        let sequential: Vec<f32> = unpack_e2m1(&given.packed)
            .iter()
            .enumerate()
            .map(|(i, &c)| e2m1_decode(c) * block_divisor(shifted[i / NVFP4_BLOCK], g))
            .collect();
        assert_eq!(given.dequantize(), sequential);
        let mut bad = w.clone();
        bad[(2 * ROWS_PER_TASK + 1) * cols + 7] = f32::NAN;
        bad[(ROWS_PER_TASK + 2) * cols + 3] = f32::INFINITY;
        let err = Nvfp4Matrix::quantize(&bad, rows, cols, g, BlockScales::Max).unwrap_err();
        assert!(
            matches!(err, FormatError::NonFinite { row, col: 3, .. } if row == ROWS_PER_TASK + 2),
            "{err:?}"
        );
        // No rows is an error, not an empty task list.
        assert!(matches!(
            Nvfp4Matrix::quantize(&[], 0, 64, g, BlockScales::Max),
            Err(FormatError::EmptyMatrix { .. })
        ));
    }

    #[test]
    fn errors_name_the_problem() {
        let mut w = vec![1.0f32; 64];
        assert!(matches!(
            Nvfp4Matrix::quantize(&w, 2, 32, 0.0, BlockScales::Max),
            Err(FormatError::InvalidScale { .. })
        ));
        assert!(matches!(
            Nvfp4Matrix::quantize(&w, 4, 16, 1.0, BlockScales::Given(&[1, 2])),
            Err(FormatError::LengthMismatch { .. })
        ));
        assert!(matches!(
            Nvfp4Matrix::quantize(&w, 8, 8, 1.0, BlockScales::Max),
            Err(FormatError::NotDivisible { .. })
        ));
        w[40] = f32::INFINITY;
        assert!(matches!(
            Nvfp4Matrix::quantize(&w, 2, 32, 1.0, BlockScales::Max),
            Err(FormatError::NonFinite { row: 1, col: 8, .. })
        ));
    }

    #[test]
    fn a_matrix_from_its_codes_is_the_quantized_one() {
        let w: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let g = global_scale_from_amax(3.0).unwrap();
        let m = Nvfp4Matrix::quantize(&w, 2, 32, g, BlockScales::Max).unwrap();
        let rebuilt = Nvfp4Matrix::from_codes(&m.codes(), 2, 32, g, m.block_scales.clone());
        assert_eq!(rebuilt.unwrap(), m);
        let scales = m.block_scales.clone();
        let mut codes = m.codes();
        assert!(matches!(
            Nvfp4Matrix::from_codes(&codes, 2, 32, g, scales[..3].to_vec()),
            Err(FormatError::LengthMismatch { .. })
        ));
        codes[7] = 16;
        assert!(matches!(
            Nvfp4Matrix::from_codes(&codes, 2, 32, g, scales),
            Err(FormatError::CodeOutOfRange { index: 7, .. })
        ));
    }
}
