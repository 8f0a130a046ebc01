//! The AutoGPTQ / GPTQModel int32 packing that `gptq_marlin` loads, and its compressed-tensors view.
//!
//! | tensor | dtype | shape | content |
//! |---|---|---|---|
//! | `qweight` | int32 | `[in·bits/32, out]` | word `r`, field `j` (bits `bits·j..`) = code of input `k = r·(32/bits) + j` |
//! | `qzeros` | int32 | `[groups, out·bits/32]` | word `c`, field `j` = zero of output `c·(32/bits) + j` (v1: zero − 1) |
//! | `scales` | fp16 | `[groups, out]` | group scale |
//! | `g_idx` | int32 | `[in]` | group of input `k` |
//!
//! compressed-tensors' `weight_packed` is `qweightᵀ` word for word, `weight_scale` is `scalesᵀ`.

use crate::int::{IntQuantizer, QuantParams};
use crate::shape::{check_divisible, check_len, check_matrix};
use crate::FormatError;
use rayon::prelude::*;

/// How `qzeros` stores the zero point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ZeroConvention {
    /// AutoGPTQ v1 (`checkpoint_format: "gptq"`): stores `zero − 1` (wrapping in the field), so a
    /// symmetric 4-bit tensor has every word `0x77777777`.
    #[default]
    V1,
    /// GPTQModel v2 (`checkpoint_format: "gptq_v2"`): stores the zero as is.
    V2,
}

/// Codes per 32-bit word for a packable width (2, 4 or 8 bits).
pub fn codes_per_word(bits: u32) -> Result<usize, FormatError> {
    match bits {
        2 | 4 | 8 => Ok((32 / bits) as usize),
        _ => Err(FormatError::UnsupportedBits {
            bits,
            supported: "2, 4, 8 (int32 packing)",
        }),
    }
}

fn check_codes(codes: &[u8], bits: u32) -> Result<(), FormatError> {
    let max = (1u32 << bits) - 1;
    match codes.iter().position(|&c| c as u32 > max) {
        None => Ok(()),
        Some(index) => Err(FormatError::CodeOutOfRange {
            code: codes[index] as u32,
            index,
            bits,
        }),
    }
}

/// Packs codes `[out, in]` (row-major, one code per weight) into `qweight` `[in·bits/32, out]`.
pub fn pack_qweight(
    codes: &[u8],
    out: usize,
    inp: usize,
    bits: u32,
) -> Result<Vec<i32>, FormatError> {
    let per = codes_per_word(bits)?;
    check_matrix("codes", codes.len(), out, inp)?;
    check_divisible("in features", inp, per)?;
    let mut q = vec![0i32; inp / per * out];
    // Word rows are independent: a few per task keeps the tasks large enough to pay.
    const WORD_ROWS_PER_TASK: usize = 8;
    q.par_chunks_mut(WORD_ROWS_PER_TASK * out.max(1))
        .enumerate()
        .try_for_each(|(task, dst)| {
            pack_qweight_rows_into(codes, out, inp, bits, task * WORD_ROWS_PER_TASK, dst)
        })?;
    Ok(q)
}

/// Packs the `qweight` rows (input words) starting at word `first_word` into `dst`
/// (`[n, out]` for some `n`): the building block for parallel callers, which split `qweight`
/// by rows and call this per chunk. `codes` is the whole `[out, in]` matrix.
pub fn pack_qweight_rows_into(
    codes: &[u8],
    out: usize,
    inp: usize,
    bits: u32,
    first_word: usize,
    dst: &mut [i32],
) -> Result<(), FormatError> {
    let per = codes_per_word(bits)?;
    check_matrix("codes", codes.len(), out, inp)?;
    check_divisible("qweight chunk", dst.len(), out)?;
    let words = dst.len() / out;
    if (first_word + words) * per > inp {
        return Err(FormatError::LengthMismatch {
            what: "qweight rows",
            expected: inp / per - first_word.min(inp / per),
            actual: words,
        });
    }
    let max = (1u32 << bits) - 1;
    for (w, row) in dst.chunks_exact_mut(out).enumerate() {
        let k0 = (first_word + w) * per;
        for (o, word) in row.iter_mut().enumerate() {
            let chunk = &codes[o * inp + k0..o * inp + k0 + per];
            if let Some(j) = chunk.iter().position(|&c| c as u32 > max) {
                return Err(FormatError::CodeOutOfRange {
                    code: chunk[j] as u32,
                    index: o * inp + k0 + j,
                    bits,
                });
            }
            *word = pack_word(chunk, bits) as i32;
        }
    }
    Ok(())
}

/// Unpacks `qweight` `[in·bits/32, out]` into codes `[out, in]`.
pub fn unpack_qweight(
    qweight: &[i32],
    out: usize,
    inp: usize,
    bits: u32,
) -> Result<Vec<u8>, FormatError> {
    let per = codes_per_word(bits)?;
    check_divisible("in features", inp, per)?;
    check_matrix("qweight", qweight.len(), inp / per, out)?;
    let mut codes = vec![0u8; out * inp];
    for (w, row) in qweight.chunks_exact(out).enumerate() {
        for (o, &word) in row.iter().enumerate() {
            for j in 0..per {
                codes[o * inp + w * per + j] = field(word as u32, j, bits);
            }
        }
    }
    Ok(codes)
}

/// Packs zero points `[groups, out]` into `qzeros` `[groups, out·bits/32]`.
pub fn pack_qzeros(
    zeros: &[u8],
    groups: usize,
    out: usize,
    bits: u32,
    convention: ZeroConvention,
) -> Result<Vec<i32>, FormatError> {
    let per = codes_per_word(bits)?;
    check_matrix("zeros", zeros.len(), groups, out)?;
    check_divisible("out features", out, per)?;
    check_codes(zeros, bits)?;
    let mask = ((1u32 << bits) - 1) as u8;
    let stored: Vec<u8> = match convention {
        ZeroConvention::V1 => zeros.iter().map(|&z| z.wrapping_sub(1) & mask).collect(),
        ZeroConvention::V2 => zeros.to_vec(),
    };
    Ok(stored
        .chunks_exact(per)
        .map(|chunk| pack_word(chunk, bits) as i32)
        .collect())
}

/// Unpacks `qzeros` `[groups, out·bits/32]` into zero points `[groups, out]`.
pub fn unpack_qzeros(
    qzeros: &[i32],
    groups: usize,
    out: usize,
    bits: u32,
    convention: ZeroConvention,
) -> Result<Vec<u8>, FormatError> {
    let per = codes_per_word(bits)?;
    check_divisible("out features", out, per)?;
    check_matrix("qzeros", qzeros.len(), groups, out / per)?;
    let mask = ((1u32 << bits) - 1) as u8;
    Ok(qzeros
        .iter()
        .flat_map(|&w| (0..per).map(move |j| field(w as u32, j, bits)))
        .map(|z| match convention {
            ZeroConvention::V1 => z.wrapping_add(1) & mask,
            ZeroConvention::V2 => z,
        })
        .collect())
}

fn pack_word(codes: &[u8], bits: u32) -> u32 {
    codes.iter().enumerate().fold(0u32, |acc, (j, &c)| {
        acc | ((c as u32) << (bits as usize * j))
    })
}

#[inline]
fn field(word: u32, j: usize, bits: u32) -> u8 {
    ((word >> (bits as usize * j)) & ((1u32 << bits) - 1)) as u8
}

/// `g_idx` without act-order: input `k` belongs to group `k / group_size`.
pub fn sequential_g_idx(inp: usize, group_size: usize) -> Result<Vec<i32>, FormatError> {
    if group_size == 0 {
        return Err(FormatError::ZeroGroupSize);
    }
    Ok((0..inp).map(|k| (k / group_size) as i32).collect())
}

/// Checks that every entry of `g_idx` names a group in `0..groups`.
pub fn check_g_idx(g_idx: &[i32], groups: usize) -> Result<(), FormatError> {
    match g_idx.iter().position(|&g| g < 0 || g as usize >= groups) {
        None => Ok(()),
        Some(index) => Err(FormatError::GroupIndexOutOfRange {
            index,
            group: g_idx[index] as i64,
            groups,
        }),
    }
}

/// compressed-tensors `weight_packed` `[out, in·bits/32]` from `qweight` `[in·bits/32, out]`
/// (a transpose; the words are identical).
pub fn qweight_to_compressed_tensors(
    qweight: &[i32],
    out: usize,
    words: usize,
) -> Result<Vec<i32>, FormatError> {
    check_matrix("qweight", qweight.len(), words, out)?;
    Ok(transpose(qweight, words, out))
}

/// `qweight` from compressed-tensors `weight_packed` (the inverse transpose).
pub fn compressed_tensors_to_qweight(
    packed: &[i32],
    out: usize,
    words: usize,
) -> Result<Vec<i32>, FormatError> {
    check_matrix("weight_packed", packed.len(), out, words)?;
    Ok(transpose(packed, out, words))
}

fn transpose<T: Copy>(m: &[T], rows: usize, cols: usize) -> Vec<T> {
    (0..cols)
        .flat_map(|c| (0..rows).map(move |r| m[r * cols + c]))
        .collect()
}

/// One linear in AutoGPTQ layout, scales still in f32 (the exporter casts them to fp16).
#[derive(Debug, Clone, PartialEq)]
pub struct GptqPacked {
    /// Output features.
    pub out_features: usize,
    /// Input features.
    pub in_features: usize,
    /// Bits per weight (2, 4 or 8).
    pub bits: u32,
    /// Input columns per group.
    pub group_size: usize,
    /// `[in·bits/32, out]`.
    pub qweight: Vec<i32>,
    /// `[groups, out·bits/32]`.
    pub qzeros: Vec<i32>,
    /// `[groups, out]`.
    pub scales: Vec<f32>,
    /// `[in]`.
    pub g_idx: Vec<i32>,
    /// How `qzeros` is stored.
    pub zero_convention: ZeroConvention,
}

impl GptqPacked {
    /// Packs codes `[out, in]`, per-group parameters `[groups, out]` and `g_idx` `[in]`.
    #[allow(clippy::too_many_arguments)]
    pub fn pack(
        codes: &[u8],
        params: &[QuantParams],
        g_idx: &[i32],
        out: usize,
        inp: usize,
        bits: u32,
        group_size: usize,
        zero_convention: ZeroConvention,
    ) -> Result<Self, FormatError> {
        if group_size == 0 {
            return Err(FormatError::ZeroGroupSize);
        }
        let groups = inp.div_ceil(group_size);
        check_len("params", params.len(), groups * out)?;
        check_len("g_idx", g_idx.len(), inp)?;
        check_g_idx(g_idx, groups)?;
        let zeros: Vec<u8> = params.iter().map(|p| p.zero).collect();
        Ok(Self {
            out_features: out,
            in_features: inp,
            bits,
            group_size,
            qweight: pack_qweight(codes, out, inp, bits)?,
            qzeros: pack_qzeros(&zeros, groups, out, bits, zero_convention)?,
            scales: params.iter().map(|p| p.scale).collect(),
            g_idx: g_idx.to_vec(),
            zero_convention,
        })
    }

    /// Number of groups (rows of `scales` / `qzeros`).
    pub fn groups(&self) -> usize {
        self.scales.len() / self.out_features
    }

    /// Unpacks codes `[out, in]` and parameters `[groups, out]`.
    pub fn unpack(&self) -> Result<(Vec<u8>, Vec<QuantParams>), FormatError> {
        let groups = self.groups();
        let codes = unpack_qweight(
            &self.qweight,
            self.out_features,
            self.in_features,
            self.bits,
        )?;
        let zeros = unpack_qzeros(
            &self.qzeros,
            groups,
            self.out_features,
            self.bits,
            self.zero_convention,
        )?;
        let params = self
            .scales
            .iter()
            .zip(zeros)
            .map(|(&scale, zero)| QuantParams { scale, zero })
            .collect();
        Ok((codes, params))
    }

    /// Dequantizes to `[out, in]`: `W[o, k] = scale[g, o] · (code[o, k] − zero[g, o])`, `g = g_idx[k]`.
    pub fn dequantize(&self) -> Result<Vec<f32>, FormatError> {
        let (codes, params) = self.unpack()?;
        check_g_idx(&self.g_idx, self.groups())?;
        let (out, inp) = (self.out_features, self.in_features);
        Ok((0..out * inp)
            .map(|i| {
                let (o, k) = (i / inp, i % inp);
                let p = params[self.g_idx[k] as usize * out + o];
                IntQuantizer::dequantize(codes[i], p)
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nibble_order_along_input() {
        // out = 1, in = 8: code of input k sits at bits 4k.
        let codes: Vec<u8> = (0..8).collect();
        let q = pack_qweight(&codes, 1, 8, 4).unwrap();
        assert_eq!(q, vec![0x7654_3210]);
    }

    #[test]
    fn symmetric_v1_zeros_are_0x77777777() {
        let q = pack_qzeros(&[8u8; 16], 2, 8, 4, ZeroConvention::V1).unwrap();
        assert_eq!(q, vec![0x7777_7777, 0x7777_7777]);
        assert_eq!(q[0], 2004318071);
        let v2 = pack_qzeros(&[8u8; 8], 1, 8, 4, ZeroConvention::V2).unwrap();
        assert_eq!(v2, vec![0x8888_8888u32 as i32]);
    }

    #[test]
    fn v1_zero_of_zero_wraps_and_round_trips() {
        let z = [0u8, 15, 1, 8, 0, 0, 0, 0];
        let q = pack_qzeros(&z, 1, 8, 4, ZeroConvention::V1).unwrap();
        assert_eq!(unpack_qzeros(&q, 1, 8, 4, ZeroConvention::V1).unwrap(), z);
    }

    #[test]
    fn shape_errors() {
        assert!(pack_qweight(&[0; 12], 2, 6, 4).is_err());
        assert!(pack_qweight(&[16; 8], 1, 8, 4).is_err());
        assert!(pack_qweight(&[0; 8], 1, 8, 3).is_err());
        assert!(check_g_idx(&[0, 1, 2], 2).is_err());
        assert!(sequential_g_idx(8, 0).is_err());
    }
}
