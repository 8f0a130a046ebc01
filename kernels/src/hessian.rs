//! Hessian accumulation on the device: `H ← H + weight·XᵀX` for one activation batch, one
//! [`Gemm`] call in f32.
//!
//! The caller picks `weight` for its normalization, as `sala_hessian::HessianAccumulator`
//! does: `1/tokens` per sample then `1/samples` at the end (per-sample), or `1` per batch
//! then `1/total tokens` (per-token); see [`normalization_weight`].

use cubecl::prelude::{ComputeClient, Runtime};
use sala_hessian::Normalization;

use crate::device::MatrixView;
use crate::error::KernelError;
use crate::gemm::Gemm;

/// `h ← h + weight·xᵀx`, `x [tokens, dim]`, `h [dim, dim]` (both triangles written).
pub fn accumulate_xtx<R: Runtime, G: Gemm<R>>(
    client: &ComputeClient<R>,
    gemm: &G,
    x: &MatrixView,
    weight: f32,
    h: &MatrixView,
) -> Result<(), KernelError> {
    if h.rows != x.cols || h.cols != x.cols {
        return Err(KernelError::shape(
            "accumulate_xtx",
            format!("x is {}×{}, h is {}×{}", x.rows, x.cols, h.rows, h.cols),
        ));
    }
    if !weight.is_finite() {
        return Err(KernelError::unsupported(
            "hessian batch weight",
            format!("{weight} is not finite"),
        ));
    }
    gemm.gemm(client, weight, x, true, x, false, 1.0, h)
}

/// The factor of one batch of `tokens` tokens under `normalization` (`1/tokens` per sample,
/// `1` per token); the final division by the sample or token count is the caller's.
pub fn normalization_weight(normalization: Normalization, tokens: usize) -> f32 {
    match normalization {
        Normalization::PerSample => 1.0 / tokens.max(1) as f32,
        Normalization::PerToken => 1.0,
    }
}
