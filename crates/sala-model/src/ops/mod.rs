//! The building blocks of the forward pass, each a small function over Burn tensors.

pub mod attention;
pub mod gla;
pub mod norm;
pub mod rope;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::numerics::Numerics;

/// `y = x Wᵀ` for `x` `[tokens, in]` and `w` `[out, in]` (both of the same dtype), rounded like
/// a bf16 GEMM output (under [`Numerics::Bf16Storage`] a bf16 GEMM with f32 accumulation).
pub fn linear<B: Backend>(x: Tensor<B, 2>, w: Tensor<B, 2>, numerics: Numerics) -> Tensor<B, 2> {
    numerics.round(x.matmul(w.transpose()))
}
