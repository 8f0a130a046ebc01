//! Where the forward pass rounds to bf16.
//!
//! The reference model runs in bf16 on a GPU. On the CPU we compute in f32 and, when asked,
//! round to bf16 at exactly the points where PyTorch's bf16 eager execution rounds (design note
//! "sala-model" §3 and §5): after every linear, after each RMSNorm step, after RoPE, after the
//! residual scale and the residual add, after the gates. Without rounding (`F32`) the graph is the
//! same model in exact-as-possible f32, which is what the golden logits check.
//!
//! On a GPU backend ([`Numerics::Bf16Storage`]) the tensors between those points are stored in
//! bf16 (half the memory and bandwidth); the steps the reference computes in f32 (RMSNorm
//! statistics, RoPE, softmax attention, the GLA recurrence, scalar multiplies) cast their inputs
//! to f32 first. On an f32 tensor those casts are no-ops, so the CPU paths are unchanged.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use rayon::prelude::*;

use crate::error::{ModelError, Result};

/// Rounding policy of the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Numerics {
    /// Plain f32 everywhere (no intermediate rounding).
    #[default]
    F32,
    /// Round to bf16 (nearest-even) where the bf16 reference rounds; values stay in f32 tensors
    /// (the CPU path).
    Bf16Rounding,
    /// Store every tensor between rounding points in bf16 (the GPU path): the same rounding
    /// points as [`Numerics::Bf16Rounding`], with linears as bf16 GEMMs (f32 accumulation).
    /// Needs a backend with bf16 tensors ([`Numerics::check_backend`]).
    Bf16Storage,
}

impl Numerics {
    /// Rounds `tensor` to bf16 values: under `Bf16Rounding` kept in an f32 tensor, under
    /// `Bf16Storage` cast to a bf16 tensor; identity under `F32`.
    pub fn round<B: Backend, const D: usize>(self, tensor: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            Numerics::F32 => tensor,
            Numerics::Bf16Rounding => round_to_bf16(tensor),
            Numerics::Bf16Storage => tensor.cast(FloatDType::BF16),
        }
    }

    /// The dtype of the tensors between rounding points: bf16 under `Bf16Storage`, else f32.
    /// Weights, hidden states and the outputs of [`Numerics::round`] have it.
    pub fn storage_dtype(self) -> DType {
        match self {
            Numerics::F32 | Numerics::Bf16Rounding => DType::F32,
            Numerics::Bf16Storage => DType::BF16,
        }
    }

    /// An error unless backend `B` can store this policy's tensors on `device` (burn-ndarray
    /// has no bf16 tensors, so `Bf16Storage` is for GPU backends).
    pub fn check_backend<B: Backend>(self, device: &B::Device) -> Result<()> {
        let dtype = self.storage_dtype();
        if B::supports_dtype(device, dtype) {
            Ok(())
        } else {
            Err(ModelError::InvalidInput(format!(
                "numerics {self:?} stores {dtype:?} tensors, which the {} backend does not support",
                B::name(device)
            )))
        }
    }
}

/// `tensor` as f32: the dtype of the steps the reference computes in f32. A no-op on an f32
/// tensor (every CPU path).
pub fn to_f32<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Tensor<B, D> {
    tensor.cast(FloatDType::F32)
}

/// `v` rounded to the nearest bf16 (ties to even), as f32: the value `half::bf16::from_f32(v)`
/// gives, NaN included (kept NaN, quiet), computed without branches so that a pass over a
/// slice vectorizes (half's conversion branches per value: a tenth of a small model's
/// calibration forward went to it).
#[inline]
pub fn nearest_bf16(v: f32) -> f32 {
    let bits = v.to_bits();
    // Adding 0x7FFF plus the lowest kept bit carries into the kept half exactly when the
    // dropped half is above the midpoint, or at it with an odd kept half.
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) & 0xFFFF_0000;
    let quiet_nan = (bits | 0x0040_0000) & 0xFFFF_0000;
    f32::from_bits(if v.is_nan() { quiet_nan } else { rounded })
}

/// Rounds every value to the nearest bf16 (ties to even) and returns it as f32.
///
/// Uses the backend's own bf16 cast where it has one (GPU backends); `burn-ndarray` has none,
/// so there the values take a host round trip through `half::bf16`, which is exact.
pub fn round_to_bf16<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Tensor<B, D> {
    let device = tensor.device();
    if B::supports_dtype(&device, DType::BF16) {
        return tensor.cast(FloatDType::BF16).cast(FloatDType::F32);
    }
    let shape = tensor.shape();
    let mut values = tensor
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("an f32 tensor converts to Vec<f32>");
    // In place and on every core: on the CPU backend this runs after every GEMM and was a
    // tenth of a calibration run's time as a single-threaded map (perf, SmolLM2-135M).
    values.par_chunks_mut(1 << 14).for_each(|chunk| {
        for v in chunk {
            *v = nearest_bf16(*v);
        }
    });
    Tensor::from_data(TensorData::new(values, shape), (&device, DType::F32))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_ndarray::NdArray;

    #[test]
    fn bf16_storage_is_refused_on_a_backend_without_bf16_tensors() {
        let device = Default::default();
        assert!(Numerics::F32.check_backend::<NdArray<f32>>(&device).is_ok());
        assert!(Numerics::Bf16Rounding
            .check_backend::<NdArray<f32>>(&device)
            .is_ok());
        let err = Numerics::Bf16Storage
            .check_backend::<NdArray<f32>>(&device)
            .unwrap_err();
        assert!(err.to_string().contains("BF16"), "{err}");
        assert_eq!(Numerics::Bf16Storage.storage_dtype(), DType::BF16);
        assert_eq!(Numerics::Bf16Rounding.storage_dtype(), DType::F32);
    }

    #[test]
    fn nearest_bf16_is_halfs_rounding_bit_for_bit() {
        let special = [
            0.0f32,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN_POSITIVE,
            1.0 + f32::EPSILON,
            f32::from_bits(0x3F80_8000), // a tie, even kept half: stays
            f32::from_bits(0x3F81_8000), // a tie, odd kept half: rounds up
            f32::from_bits(0x7F7F_FFFF), // rounds to +inf
            f32::from_bits(0x0000_8001), // subnormal
        ];
        let mut state = 0x9E37_79B9u32;
        let random = (0..1_000_000).map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            f32::from_bits(state)
        });
        for v in special.into_iter().chain(random) {
            let expected = half::bf16::from_f32(v).to_f32();
            let got = nearest_bf16(v);
            if v.is_nan() {
                assert_eq!(got.to_bits(), expected.to_bits(), "NaN {:#x}", v.to_bits());
            } else {
                assert_eq!(
                    got.to_bits(),
                    expected.to_bits(),
                    "{v:e} ({:#x})",
                    v.to_bits()
                );
            }
        }
    }

    #[test]
    fn to_f32_leaves_an_f32_tensor_untouched() {
        let x = Tensor::<NdArray<f32>, 1>::from_floats([1.0, 0.1, -3.25], &Default::default());
        assert_eq!(to_f32(x.clone()).into_data(), x.into_data());
    }
}
