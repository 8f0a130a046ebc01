//! Small floating-point formats: E2M1 (FP4), FP8 E4M3FN and FP8 E5M2.
//!
//! One codec serves all three: a [`MiniFloat`] describes the exponent and mantissa widths, the
//! bias and the largest finite magnitude, and [`MiniFloat::encode`] rounds an `f32` to the nearest
//! representable value with ties to even mantissa, saturating at the largest finite magnitude
//! (the rule of ModelOpt, compressed-tensors and PyTorch's saturating casts). Codes are returned
//! as the raw bit pattern in the low `1 + exp_bits + man_bits` bits of a `u8`.

use crate::FormatError;

/// How the sign bit of an encoded zero is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroSign {
    /// IEEE: the sign bit is copied from the input, so `-0.0` and tiny negatives that round to
    /// zero both encode as negative zero (PyTorch `.to(float8_*)`).
    Ieee,
    /// ModelOpt/compressed-tensors FP4: the sign bit is `x < 0`, so `-0.0` encodes as `+0` and a
    /// tiny negative that rounds to zero encodes as `-0` (code 8).
    LessThanZero,
}

/// How NaN and infinities are represented, if at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Specials {
    /// No NaN, no infinity: every code is a finite number (E2M1).
    None,
    /// Only the all-ones exponent-and-mantissa pattern is NaN; no infinity (E4M3FN: 0x7F, 0xFF).
    NanOnlyAllOnes,
    /// IEEE-like: all-ones exponent is infinity (mantissa 0) or NaN (E5M2).
    Ieee,
}

/// A small binary floating-point format with `1 + exp_bits + man_bits <= 8` bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MiniFloat {
    /// Human-readable name ("e2m1", "e4m3fn", "e5m2").
    pub name: &'static str,
    /// Exponent field width in bits.
    pub exp_bits: u32,
    /// Mantissa field width in bits.
    pub man_bits: u32,
    /// Exponent bias.
    pub bias: i32,
    /// Bit pattern (without sign) of the largest finite magnitude.
    pub max_code: u8,
    /// NaN / infinity encoding.
    pub specials: Specials,
    /// Sign rule for zero.
    pub zero_sign: ZeroSign,
}

/// FP4 E2M1 as used by NVFP4: magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}, code = sign<<3 | index.
pub const E2M1: MiniFloat = MiniFloat {
    name: "e2m1",
    exp_bits: 2,
    man_bits: 1,
    bias: 1,
    max_code: 0b111,
    specials: Specials::None,
    zero_sign: ZeroSign::LessThanZero,
};

/// FP8 E4M3FN (max 448, no infinity, NaN = 0x7F / 0xFF), `torch.float8_e4m3fn`.
pub const E4M3FN: MiniFloat = MiniFloat {
    name: "e4m3fn",
    exp_bits: 4,
    man_bits: 3,
    bias: 7,
    max_code: 0x7E,
    specials: Specials::NanOnlyAllOnes,
    zero_sign: ZeroSign::Ieee,
};

/// FP8 E5M2 (max 57344, IEEE infinities and NaNs), `torch.float8_e5m2`.
pub const E5M2: MiniFloat = MiniFloat {
    name: "e5m2",
    exp_bits: 5,
    man_bits: 2,
    bias: 15,
    max_code: 0x7B,
    specials: Specials::Ieee,
    zero_sign: ZeroSign::Ieee,
};

/// The 16 E2M1 values indexed by code (code 8 is negative zero).
pub const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Largest E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;
/// Largest FP8 E4M3FN magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// Smallest positive FP8 E4M3FN value (a subnormal): 2⁻⁹.
pub const E4M3_MIN_POSITIVE: f32 = 1.0 / 512.0;
/// Largest FP8 E5M2 magnitude.
pub const E5M2_MAX: f32 = 57344.0;

impl MiniFloat {
    /// Total number of bits (sign included).
    pub const fn bits(&self) -> u32 {
        1 + self.exp_bits + self.man_bits
    }

    fn sign_mask(&self) -> u8 {
        1 << (self.exp_bits + self.man_bits)
    }

    /// Largest finite magnitude.
    pub fn max_value(&self) -> f32 {
        self.decode(self.max_code)
    }

    /// The canonical NaN code, if the format has one (0x7F for both FP8 formats).
    pub fn nan_code(&self) -> Option<u8> {
        match self.specials {
            Specials::None => None,
            Specials::NanOnlyAllOnes | Specials::Ieee => Some(self.sign_mask() - 1),
        }
    }

    /// Decodes a code (only the low [`bits`](Self::bits) bits are read) to its exact `f32` value.
    pub fn decode(&self, code: u8) -> f32 {
        let sign_mask = self.sign_mask();
        let code = code & (sign_mask | (sign_mask - 1));
        let negative = code & sign_mask != 0;
        let magnitude = code & (sign_mask - 1);
        let exp = (magnitude >> self.man_bits) as i32;
        let man = (magnitude & ((1 << self.man_bits) - 1)) as f32;
        let all_ones_exp = (1 << self.exp_bits) - 1;
        let value = match self.specials {
            Specials::NanOnlyAllOnes if magnitude == sign_mask - 1 => f32::NAN,
            Specials::Ieee if exp == all_ones_exp => {
                if man == 0.0 {
                    f32::INFINITY
                } else {
                    f32::NAN
                }
            }
            _ if exp == 0 => man * pow2(1 - self.bias - self.man_bits as i32),
            _ => (1.0 + man * pow2(-(self.man_bits as i32))) * pow2(exp - self.bias),
        };
        if negative {
            -value
        } else {
            value
        }
    }

    /// Encodes `x` to the nearest representable value, ties to even mantissa.
    ///
    /// Finite magnitudes above the largest finite value saturate to it; infinities saturate too.
    /// NaN is an error for E2M1 (it has no NaN) and the canonical NaN code otherwise.
    pub fn encode(&self, x: f32) -> Result<u8, FormatError> {
        if x.is_nan() {
            return self.nan_code().ok_or(FormatError::NonFinite {
                row: 0,
                col: 0,
                value: x,
            });
        }
        Ok(self.encode_non_nan(x))
    }

    /// Encodes a value known not to be NaN (the hot path of the block codecs, which check
    /// finiteness once per block). Infinities saturate.
    #[inline]
    pub fn encode_non_nan(&self, x: f32) -> u8 {
        let negative = match self.zero_sign {
            ZeroSign::Ieee => x.is_sign_negative(),
            ZeroSign::LessThanZero => x < 0.0,
        };
        let magnitude = self.encode_magnitude(x.abs());
        if negative {
            magnitude | self.sign_mask()
        } else {
            magnitude
        }
    }

    /// Rounds a non-negative, non-NaN magnitude to the bit pattern of the nearest value.
    #[inline]
    fn encode_magnitude(&self, a: f32) -> u8 {
        let max = self.max_value();
        if a >= max {
            return self.max_code;
        }
        let man_bits = self.man_bits as i32;
        let min_normal_exp = 1 - self.bias;
        let f32_exp = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
        // Below the smallest normal, the quantum is fixed (subnormals); the rounded integer is
        // directly the bit pattern, and a carry to 2^man_bits lands on the smallest normal.
        let exp = f32_exp.max(min_normal_exp);
        let quantum_exp = exp - man_bits;
        let q = (a * pow2(-quantum_exp)).round_ties_even() as u32;
        if f32_exp < min_normal_exp {
            return q as u8;
        }
        // Normal: q in [2^m, 2^(m+1)]; a carry to 2^(m+1) increments the exponent field.
        let biased = (exp + self.bias) as u32;
        ((biased << self.man_bits) + (q - (1 << self.man_bits))) as u8
    }

    /// Rounds `x` to the nearest representable value and returns it as `f32`.
    pub fn round(&self, x: f32) -> Result<f32, FormatError> {
        Ok(self.decode(self.encode(x)?))
    }
}

/// `2^e` exactly, for the exponent range these formats need.
#[inline]
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// Encodes one value as E2M1 (see [`E2M1`]); NaN is an error, infinities saturate to ±6.
pub fn e2m1_encode(x: f32) -> Result<u8, FormatError> {
    E2M1.encode(x)
}

/// Encodes a non-NaN value as E2M1 by comparison with the six midpoints between grid points
/// (ModelOpt's `searchsorted` form): branch-free, so the block loops vectorise. Equal to
/// `E2M1.encode_non_nan` for every input (checked by the property tests); `>` at a midpoint
/// sends the tie down, `>=` up, whichever neighbour has the even mantissa.
#[inline]
pub fn e2m1_encode_fast(x: f32) -> u8 {
    let a = x.abs();
    let index = (a > 0.25) as u8
        + (a >= 0.75) as u8
        + (a > 1.25) as u8
        + (a >= 1.75) as u8
        + (a > 2.5) as u8
        + (a >= 3.5) as u8
        + (a > 5.0) as u8;
    index | (((x < 0.0) as u8) << 3)
}

/// Decodes an E2M1 code (low 4 bits) by table lookup.
#[inline]
pub fn e2m1_decode(code: u8) -> f32 {
    E2M1_VALUES[(code & 0xF) as usize]
}

/// Encodes one value as FP8 E4M3FN with round-to-nearest-even and saturation to ±448.
pub fn e4m3_encode(x: f32) -> u8 {
    E4M3FN.encode(x).unwrap_or(0x7F)
}

/// Decodes an FP8 E4M3FN byte (0x7F / 0xFF are NaN).
pub fn e4m3_decode(code: u8) -> f32 {
    E4M3FN.decode(code)
}

/// Encodes one value as FP8 E5M2 with round-to-nearest-even and saturation to ±57344.
pub fn e5m2_encode(x: f32) -> u8 {
    E5M2.encode(x).unwrap_or(0x7F)
}

/// Decodes an FP8 E5M2 byte.
pub fn e5m2_decode(code: u8) -> f32 {
    E5M2.decode(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2m1_table_matches_decode() {
        for (code, &v) in E2M1_VALUES.iter().enumerate() {
            let d = E2M1.decode(code as u8);
            assert_eq!(d.to_bits(), v.to_bits(), "code {code}");
        }
    }

    #[test]
    fn e2m1_ties_follow_modelopt() {
        let cases = [
            (0.25, 0.0),
            (0.75, 1.0),
            (1.25, 1.0),
            (1.75, 2.0),
            (2.5, 2.0),
            (3.5, 4.0),
            (5.0, 4.0),
            (5.01, 6.0),
            (100.0, 6.0),
        ];
        for (x, want) in cases {
            assert_eq!(E2M1.round(x).unwrap(), want, "{x}");
            assert_eq!(E2M1.round(-x).unwrap(), -want, "-{x}");
        }
    }

    #[test]
    fn e2m1_zero_signs() {
        assert_eq!(e2m1_encode(-0.0).unwrap(), 0);
        assert_eq!(e2m1_encode(-0.1).unwrap(), 8);
        assert!(e2m1_encode(f32::NAN).is_err());
        assert_eq!(e2m1_encode(f32::NEG_INFINITY).unwrap(), 0xF);
    }

    #[test]
    fn fp8_known_values() {
        assert_eq!(E4M3FN.max_value(), 448.0);
        assert_eq!(E5M2.max_value(), 57344.0);
        assert_eq!(e4m3_decode(0x01), E4M3_MIN_POSITIVE);
        assert!(e4m3_decode(0x7F).is_nan() && e4m3_decode(0xFF).is_nan());
        assert_eq!(e4m3_encode(1000.0), 0x7E);
        assert_eq!(e4m3_encode(-0.0), 0x80);
        assert_eq!(e4m3_encode(f32::NAN), 0x7F);
        assert_eq!(e5m2_decode(0x7C), f32::INFINITY);
        assert_eq!(e5m2_encode(f32::INFINITY), 0x7B);
        // 464 is exactly between 448 and the (NaN) pattern 480: saturates to 448.
        assert_eq!(e4m3_encode(464.0), 0x7E);
        // A tie between two subnormals goes to the even mantissa: 1.5 * 2^-9 -> 2 * 2^-9.
        assert_eq!(e4m3_encode(1.5 / 512.0), 0x02);
        assert_eq!(e4m3_encode(2.5 / 512.0), 0x02);
    }
}
