//! Where the forward pass rounds to bf16.
//!
//! The reference model runs in bf16 on a GPU. On the CPU we compute in f32 and, when asked,
//! round to bf16 at exactly the points where PyTorch's bf16 eager execution rounds (design note
//! "sala-model" §3 and §5): after every linear, after each RMSNorm step, after RoPE, after the
//! residual scale and the residual add, after the gates. Without rounding (`F32`) the graph is the
//! same model in exact-as-possible f32, which is what the golden logits check.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};

/// Rounding policy of the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Numerics {
    /// Plain f32 everywhere (no intermediate rounding).
    #[default]
    F32,
    /// Round to bf16 (nearest-even) where the bf16 reference rounds.
    Bf16Rounding,
}

impl Numerics {
    /// Rounds `tensor` to bf16 values (kept in an f32 tensor) under `Bf16Rounding`; identity under `F32`.
    pub fn round<B: Backend, const D: usize>(self, tensor: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            Numerics::F32 => tensor,
            Numerics::Bf16Rounding => round_to_bf16(tensor),
        }
    }
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
    let values = tensor
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("an f32 tensor converts to Vec<f32>");
    let rounded: Vec<f32> = values
        .into_iter()
        .map(|v| half::bf16::from_f32(v).to_f32())
        .collect();
    Tensor::from_data(TensorData::new(rounded, shape), &device)
}
