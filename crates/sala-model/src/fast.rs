//! The seam through which a backend supplies faster implementations of the graph's heaviest
//! steps. The Burn graph stays the definition of the model; an implementation of [`FastOps`]
//! must compute the same function (tested against it) and is chosen by whoever builds the
//! [`LayerRunner`](crate::LayerRunner) (the facade does on CUDA).

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::error::Result;

/// Backend-specific implementations of steps of the forward pass.
pub trait FastOps<B: Backend>: Send + Sync + std::fmt::Debug {
    /// Causal grouped-query softmax attention over sequences of `lengths` tokens lying back to
    /// back (positions and attention restart with each sequence).
    ///
    /// `q` `[tokens, heads, d]`, `k`/`v` `[tokens, kv_heads, d]`, all in the runner's storage
    /// dtype; query head `h` reads KV head `h / (heads / kv_heads)`; scores are
    /// `scale · q·k`, softmax in f32. Returns `[tokens, heads, d]` in the storage dtype (the
    /// f32 result rounded once, as the graph rounds the attention output).
    fn causal_attention(
        &self,
        q: Tensor<B, 3>,
        k: Tensor<B, 3>,
        v: Tensor<B, 3>,
        lengths: &[usize],
        scale: f32,
    ) -> Result<Tensor<B, 3>>;
}

/// Where each of `lengths` starts and ends in the pack: `[0, l0, l0 + l1, …, Σ l]`.
pub fn sequence_offsets(lengths: &[usize]) -> Vec<usize> {
    std::iter::once(0)
        .chain(lengths.iter().scan(0, |end, &len| {
            *end += len;
            Some(*end)
        }))
        .collect()
}

#[cfg(feature = "cuda")]
pub use cube::CubeFastOps;

/// [`FastOps`] on CubeCL backends: the kernels of `sala-kernels` on the tensors' own buffers.
#[cfg(feature = "cuda")]
mod cube {
    use super::{sequence_offsets, FastOps};
    use crate::error::{ModelError, Result};
    use burn::tensor::{DType, Tensor, TensorPrimitive};
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::tensor::CubeTensor;
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use sala_kernels::attention::{causal_gqa_attention, AttentionShape};

    /// The `sala-kernels` implementations for any CubeCL runtime (bf16, f16 or f32 tensors).
    #[derive(Debug, Clone, Copy, Default)]
    pub struct CubeFastOps;

    fn primitive<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
        x: Tensor<CubeBackend<R, F, I, BT>, 3>,
    ) -> CubeTensor<R> {
        into_contiguous(x.into_primitive().tensor())
    }

    impl<R, F, I, BT> FastOps<CubeBackend<R, F, I, BT>> for CubeFastOps
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        fn causal_attention(
            &self,
            q: Tensor<CubeBackend<R, F, I, BT>, 3>,
            k: Tensor<CubeBackend<R, F, I, BT>, 3>,
            v: Tensor<CubeBackend<R, F, I, BT>, 3>,
            lengths: &[usize],
            scale: f32,
        ) -> Result<Tensor<CubeBackend<R, F, I, BT>, 3>> {
            let [tokens, heads, head_dim] = q.dims();
            let kv_heads = k.dims()[1];
            let (q, k, v) = (primitive(q), primitive(k), primitive(v));
            if q.dtype != k.dtype || q.dtype != v.dtype {
                return Err(ModelError::InvalidInput(format!(
                    "attention inputs of dtypes {:?}, {:?}, {:?}",
                    q.dtype, k.dtype, v.dtype
                )));
            }
            let shape = AttentionShape {
                heads,
                kv_heads,
                head_dim,
                scale,
            };
            let offsets = sequence_offsets(lengths);
            let bytes = tokens * heads * head_dim * q.dtype.size();
            let out_handle = q.client.empty(bytes);
            let launched = match q.dtype {
                DType::BF16 => causal_gqa_attention::<R, half::bf16>(
                    &q.client,
                    &shape,
                    &offsets,
                    &q.handle,
                    &k.handle,
                    &v.handle,
                    &out_handle,
                ),
                DType::F16 => causal_gqa_attention::<R, half::f16>(
                    &q.client,
                    &shape,
                    &offsets,
                    &q.handle,
                    &k.handle,
                    &v.handle,
                    &out_handle,
                ),
                DType::F32 => causal_gqa_attention::<R, f32>(
                    &q.client,
                    &shape,
                    &offsets,
                    &q.handle,
                    &k.handle,
                    &v.handle,
                    &out_handle,
                ),
                other => {
                    return Err(ModelError::InvalidInput(format!(
                        "no attention kernel for {other:?} tensors"
                    )))
                }
            };
            launched.map_err(|e| ModelError::Kernel {
                op: "causal attention",
                message: e.to_string(),
            })?;
            let out = CubeTensor::new_contiguous(
                q.client.clone(),
                q.device.clone(),
                [tokens, heads, head_dim].into(),
                out_handle,
                q.dtype,
            );
            Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
        }
    }
}
