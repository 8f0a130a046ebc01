//! RMSNorm with f32 statistics, as `MiniCPMRMSNorm` / `LlamaRMSNorm`.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::numerics::{to_f32, Numerics};

/// Normalises each row of `x` `[rows, n]` by its root mean square and multiplies by `weight` `[n]`.
///
/// `y = bf(bf(x · rsqrt(mean(x²) + eps)) · w)`: the reference rounds to bf16 before the weight
/// multiply, so a smoothing scale folded into `w` acts on the rounded value (design §3).
/// The statistics and the division are in f32 whatever `x`'s dtype; `weight` must have the
/// dtype [`Numerics::round`] produces (f32, or bf16 under [`Numerics::Bf16Storage`]).
pub fn rms_norm<B: Backend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 1>,
    eps: f64,
    numerics: Numerics,
) -> Tensor<B, 2> {
    let x = to_f32(x);
    let mean_square = (x.clone() * x.clone()).mean_dim(1);
    // A true division: burn-ndarray's `recip` is a fast approximation (about 1e-5 relative,
    // and not even reproducible between calls), too coarse for a reference graph.
    let rms = mean_square.add_scalar(eps).sqrt();
    let normed = numerics.round(x / rms);
    numerics.round(normed * weight.unsqueeze::<2>())
}
