//! Owned tensors in their on-disk encoding, and conversions between f32 and the dtypes a
//! checkpoint stores (little-endian, as safetensors requires).

use std::borrow::Cow;

use half::{bf16, f16};
use safetensors::{Dtype, View};
use sala_formats::minifloat::{e4m3_decode, e5m2_decode};

use crate::ExportError;

/// A tensor ready to be written: dtype, shape and its little-endian bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Element type on disk.
    pub dtype: Dtype,
    /// Shape (row-major); `[]` is a scalar.
    pub shape: Vec<usize>,
    /// `elements · bits(dtype) / 8` bytes.
    pub data: Vec<u8>,
}

impl Tensor {
    /// Wraps raw bytes after checking that their length matches dtype and shape.
    pub fn from_bytes(
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<Self, ExportError> {
        check_byte_len(name, dtype, shape, data.len())?;
        Ok(Self {
            dtype,
            shape: shape.to_vec(),
            data,
        })
    }

    /// Encodes f32 values as `dtype` (F32, F16 or BF16, round-to-nearest-even).
    pub fn from_f32(
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        values: &[f32],
    ) -> Result<Self, ExportError> {
        let data = encode_f32(name, dtype, values)?;
        Self::from_bytes(name, dtype, shape, data)
    }

    /// An int32 tensor (`qweight`, `qzeros`, `g_idx`).
    pub fn from_i32(name: &str, shape: &[usize], values: &[i32]) -> Result<Self, ExportError> {
        Self::from_bytes(
            name,
            Dtype::I32,
            shape,
            le_bytes(values, |v| v.to_le_bytes()),
        )
    }

    /// Bytes of the data.
    pub fn byte_len(&self) -> usize {
        self.data.len()
    }
}

impl View for &Tensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Bytes a tensor of `dtype` and `shape` occupies, or `None` on overflow or a sub-byte remainder.
pub fn byte_len(dtype: Dtype, shape: &[usize]) -> Option<usize> {
    let elements = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))?;
    let bits = elements.checked_mul(dtype.bitsize())?;
    (bits % 8 == 0).then_some(bits / 8)
}

fn check_byte_len(
    name: &str,
    dtype: Dtype,
    shape: &[usize],
    actual: usize,
) -> Result<(), ExportError> {
    let expected = byte_len(dtype, shape);
    if expected == Some(actual) {
        return Ok(());
    }
    Err(ExportError::TensorSize {
        tensor: name.to_string(),
        dtype: dtype.to_string(),
        shape: shape.to_vec(),
        expected: expected.unwrap_or(usize::MAX),
        actual,
    })
}

/// Encodes f32 values as F32, F16 or BF16 bytes.
pub fn encode_f32(name: &str, dtype: Dtype, values: &[f32]) -> Result<Vec<u8>, ExportError> {
    Ok(match dtype {
        Dtype::F32 => le_bytes(values, |v| v.to_le_bytes()),
        Dtype::F16 => le_bytes(values, |v| f16::from_f32(v).to_le_bytes()),
        Dtype::BF16 => le_bytes(values, |v| bf16::from_f32(v).to_le_bytes()),
        other => return Err(unsupported(name, other, "encode from f32")),
    })
}

/// The little-endian bytes of every value, into one buffer sized up front (a `flat_map`
/// collect cannot size it and cost ~12 ns per value, minutes over a 9B checkpoint).
fn le_bytes<V: Copy, const N: usize>(values: &[V], encode: impl Fn(V) -> [u8; N]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * N);
    for &v in values {
        out.extend_from_slice(&encode(v));
    }
    out
}

/// Decodes bytes of a floating-point or integer dtype into f32 values.
///
/// Supported: F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I32, I16, I8, U8 (integers are converted
/// by value, as a reader of `g_idx` or raw codes would expect).
pub fn decode_f32(name: &str, dtype: Dtype, data: &[u8]) -> Result<Vec<f32>, ExportError> {
    Ok(match dtype {
        Dtype::F64 => le_chunks::<8>(data)
            .map(|b| f64::from_le_bytes(b) as f32)
            .collect(),
        Dtype::F32 => le_chunks::<4>(data).map(f32::from_le_bytes).collect(),
        Dtype::F16 => le_chunks::<2>(data)
            .map(|b| f16::from_le_bytes(b).to_f32())
            .collect(),
        Dtype::BF16 => le_chunks::<2>(data)
            .map(|b| bf16::from_le_bytes(b).to_f32())
            .collect(),
        Dtype::F8_E4M3 => data.iter().map(|&b| e4m3_decode(b)).collect(),
        Dtype::F8_E5M2 => data.iter().map(|&b| e5m2_decode(b)).collect(),
        Dtype::I32 => le_chunks::<4>(data)
            .map(|b| i32::from_le_bytes(b) as f32)
            .collect(),
        Dtype::I16 => le_chunks::<2>(data)
            .map(|b| i16::from_le_bytes(b) as f32)
            .collect(),
        Dtype::I8 => data.iter().map(|&b| b as i8 as f32).collect(),
        Dtype::U8 => data.iter().map(|&b| b as f32).collect(),
        other => return Err(unsupported(name, other, "decode to f32")),
    })
}

/// Decodes I32 bytes.
pub fn decode_i32(name: &str, dtype: Dtype, data: &[u8]) -> Result<Vec<i32>, ExportError> {
    match dtype {
        Dtype::I32 => Ok(le_chunks::<4>(data).map(i32::from_le_bytes).collect()),
        other => Err(unsupported(name, other, "read as int32")),
    }
}

/// Little-endian words of `N` bytes (a trailing remainder is impossible for checked tensors).
fn le_chunks<const N: usize>(data: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
    data.chunks_exact(N).map(|c| {
        let mut word = [0u8; N];
        word.copy_from_slice(c);
        word
    })
}

fn unsupported(name: &str, dtype: Dtype, what: &'static str) -> ExportError {
    ExportError::UnsupportedDtype {
        tensor: name.to_string(),
        dtype: dtype.to_string(),
        what,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_lengths_follow_dtype_and_shape() {
        assert_eq!(byte_len(Dtype::BF16, &[3, 4]), Some(24));
        assert_eq!(byte_len(Dtype::F32, &[]), Some(4));
        assert_eq!(byte_len(Dtype::F4, &[3]), None);
        assert!(Tensor::from_bytes("t", Dtype::I32, &[2], vec![0; 7]).is_err());
    }

    #[test]
    fn bf16_and_f16_round_trip_representable_values() {
        let values = [0.0f32, -1.5, 3.140625, 65504.0];
        for dtype in [Dtype::BF16, Dtype::F16, Dtype::F32] {
            let bytes = encode_f32("t", dtype, &values[..3]).unwrap();
            assert_eq!(decode_f32("t", dtype, &bytes).unwrap(), values[..3]);
        }
        assert!(encode_f32("t", Dtype::I32, &values).is_err());
    }
}
