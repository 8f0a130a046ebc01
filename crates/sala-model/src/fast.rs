//! The seam through which a backend supplies faster implementations of the graph's heaviest
//! steps. The Burn graph stays the definition of the model; an implementation of [`FastOps`]
//! must compute the same function (tested against it) and is chosen by whoever builds the
//! [`LayerRunner`](crate::LayerRunner) (the facade does on CUDA).

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};

use crate::error::Result;
use crate::numerics::to_f32;

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

    /// [`FastOps::causal_attention`] then [`FastOps::sigmoid_gate`] by `gate`
    /// `[tokens, heads·d]`, in one call: `round(a · round(sigmoid(gate)))` for `a` the attention
    /// output (rounded to the storage dtype), as `[tokens, heads·d]`: the minicpm4 layers'
    /// gated attention. `Ok(None)` where this implementation has no fused kernel for these
    /// tensors (the two ops run instead).
    fn gated_causal_attention(
        &self,
        q: &Tensor<B, 3>,
        k: &Tensor<B, 3>,
        v: &Tensor<B, 3>,
        lengths: &[usize],
        scale: f32,
        gate: &Tensor<B, 2>,
    ) -> Result<Option<Tensor<B, 2>>> {
        let _ = (q, k, v, lengths, scale, gate);
        Ok(None)
    }

    /// `x·wᵀ` for `x` `[tokens, in]` and `w` `[out, in]` in the storage dtype, rounded like a
    /// bf16 GEMM with f32 accumulation; `Ok(None)` where this implementation has no faster
    /// product for these tensors (the graph's matmul runs instead).
    fn linear(&self, x: &Tensor<B, 2>, w: &Tensor<B, 2>) -> Result<Option<Tensor<B, 2>>> {
        let _ = (x, w);
        Ok(None)
    }

    /// [`FastOps::linear`] of one `x` `[tokens, in]` by each of `ws` (`[out_i, in]`), in one
    /// call: the products of weights that read the same input (a layer's q, k, v and gate
    /// projections; its MLP's gate and up), which an implementation may queue together.
    /// Returns one product per weight, in order; `Ok(None)` where it has no such call for
    /// these tensors (each weight then goes through [`FastOps::linear`]).
    fn linears(&self, x: &Tensor<B, 2>, ws: &[&Tensor<B, 2>]) -> Result<Option<Vec<Tensor<B, 2>>>> {
        let _ = (x, ws);
        Ok(None)
    }

    /// The SwiGLU activation `round(round(silu(gate)) · up)` of `gate`, `up` `[tokens, inter]`
    /// (storage dtype), rounded where the graph rounds (`silu` itself computes
    /// `gate · round(sigmoid(gate))`); `Ok(None)` where this implementation has no fused
    /// kernel for these tensors (the graph's ops run instead).
    fn swiglu(&self, gate: &Tensor<B, 2>, up: &Tensor<B, 2>) -> Result<Option<Tensor<B, 2>>> {
        let _ = (gate, up);
        Ok(None)
    }

    /// `round(x · round(sigmoid(gate)))` for `x`, `gate` of one shape (storage dtype): the
    /// sigmoid output gates of the attention layers; `Ok(None)` as [`FastOps::swiglu`].
    fn sigmoid_gate(&self, x: &Tensor<B, 2>, gate: &Tensor<B, 2>) -> Result<Option<Tensor<B, 2>>> {
        let _ = (x, gate);
        Ok(None)
    }

    /// RMSNorm of each row of `x` `[rows, n]` with `weight` `[n]` (storage dtype),
    /// `round(round(x / √(mean(x²) + eps)) · weight)` like [`crate::ops::norm::rms_norm`];
    /// `Ok(None)` as [`FastOps::swiglu`].
    fn rms_norm(
        &self,
        x: &Tensor<B, 2>,
        weight: &Tensor<B, 1>,
        eps: f64,
    ) -> Result<Option<Tensor<B, 2>>> {
        let _ = (x, weight, eps);
        Ok(None)
    }

    /// [`FastOps::rms_norm`] of `x` `[rows, n]` then [`FastOps::sigmoid_gate`] by `gate`
    /// `[rows, n]`, in one pass: `round(n · round(sigmoid(gate)))` with `n` the rounded
    /// RMSNorm (the lightning layers' `o_norm` times `sigmoid(z_proj)`); `Ok(None)` as
    /// [`FastOps::swiglu`].
    fn rms_norm_gate(
        &self,
        x: &Tensor<B, 2>,
        weight: &Tensor<B, 1>,
        eps: f64,
        gate: &Tensor<B, 2>,
    ) -> Result<Option<Tensor<B, 2>>> {
        let _ = (x, weight, eps, gate);
        Ok(None)
    }

    /// `round(hidden + round(f32(branch) · scale))` for tensors of one shape (storage dtype):
    /// the residual add of a scaled branch; `Ok(None)` as [`FastOps::swiglu`].
    fn scaled_residual(
        &self,
        hidden: &Tensor<B, 2>,
        branch: &Tensor<B, 2>,
        scale: f64,
    ) -> Result<Option<Tensor<B, 2>>> {
        let _ = (hidden, branch, scale);
        Ok(None)
    }

    /// `round(hidden + scale · x·wᵀ)` for `x` `[tokens, in]`, `w` `[out, in]` and `hidden`
    /// `[tokens, out]` (storage dtype): a linear whose product goes straight into a scaled
    /// residual add, in one call (the product's epilogue adds the residual in f32 and rounds
    /// once). `hidden` is read, not written. `Ok(None)` where this implementation has no such
    /// call: [`FastOps::linear`] then [`FastOps::scaled_residual`] run instead, which round the
    /// product before the sum, so the two routes may differ by one rounding step of the sum.
    fn linear_residual(
        &self,
        hidden: &Tensor<B, 2>,
        x: &Tensor<B, 2>,
        w: &Tensor<B, 2>,
        scale: f64,
    ) -> Result<Option<Tensor<B, 2>>> {
        let _ = (hidden, x, w, scale);
        Ok(None)
    }

    /// RoPE of `x` `[tokens, heads, d]` (storage dtype) at positions restarting with each
    /// sequence of `lengths`, read from the f32 tables `cos`, `sin` `[positions, d]`: the
    /// graph's [`crate::ops::rope::apply_rope`] (Llama's q and k), rounded where it rounds.
    /// `Ok(None)` as [`FastOps::swiglu`].
    fn rope(
        &self,
        x: &Tensor<B, 3>,
        cos: &Tensor<B, 2>,
        sin: &Tensor<B, 2>,
        lengths: &[usize],
    ) -> Result<Option<Tensor<B, 3>>> {
        let _ = (x, cos, sin, lengths);
        Ok(None)
    }

    /// Per-head RMSNorm then RoPE: for `x` `[tokens, heads, d]` (storage dtype) the graph's
    /// [`crate::ops::norm::rms_norm`] of every head with `weight` `[d]`, then
    /// [`crate::ops::rope::apply_rope`] at positions restarting with each sequence of `lengths`,
    /// read from the f32 tables `cos`, `sin` `[positions, d]`; rounded where the graph rounds.
    /// `Ok(None)` as [`FastOps::swiglu`].
    fn rms_norm_rope(
        &self,
        x: &Tensor<B, 3>,
        weight: &Tensor<B, 1>,
        eps: f64,
        cos: &Tensor<B, 2>,
        sin: &Tensor<B, 2>,
        lengths: &[usize],
    ) -> Result<Option<Tensor<B, 3>>> {
        let _ = (x, weight, eps, cos, sin, lengths);
        Ok(None)
    }

    /// Simple GLA (one constant decay per head) over sequences of `lengths` lying back to back
    /// (the state restarts with each): `o_t = scale · q_t S_t`, `S_t = γ_h S_{t−1} + k_tᵀ v_t`,
    /// `γ_h = e^{log_decays[h]}`, for `q`, `k`, `v` `[tokens, heads, d]` in the storage dtype
    /// (`q` not yet scaled). Returns `[tokens, heads·d]` in the storage dtype: the f32 result
    /// rounded once, as the graph's [`crate::ops::gla::chunked`] is rounded; `Ok(None)` as
    /// [`FastOps::swiglu`].
    fn simple_gla(
        &self,
        q: &Tensor<B, 3>,
        k: &Tensor<B, 3>,
        v: &Tensor<B, 3>,
        lengths: &[usize],
        log_decays: &[f64],
        scale: f32,
    ) -> Result<Option<Tensor<B, 2>>> {
        let _ = (q, k, v, lengths, log_decays, scale);
        Ok(None)
    }

    /// What these fast ops run, in a few words for progress lines (`"the graph's ops"` by
    /// default).
    fn describe(&self) -> String {
        "the graph's ops".to_owned()
    }

    /// `x` `[rows, cols]` as row-major host f32 values; `None` where the backend's own
    /// download (`into_data`) is the fast way.
    fn to_host(&self, x: &Tensor<B, 2>) -> Option<Vec<f32>> {
        let _ = x;
        None
    }

    /// The flat tensor `[bytes.len() / dtype.size()]` of `dtype` on `device` whose values are
    /// `bytes` (native byte order); `Ok(None)` where the backend's own upload (`from_data`) is
    /// the fast way. How a layer's weights reach the device, twice per layer, and hidden
    /// states kept in host memory before each pass.
    fn upload_host(
        &self,
        bytes: &[u8],
        dtype: DType,
        device: &B::Device,
    ) -> Result<Option<Tensor<B, 1>>> {
        let _ = (bytes, dtype, device);
        Ok(None)
    }

    /// Copies the values of `x` `[rows, cols]` into `dst` (`rows · cols` values, row-major) as
    /// bf16; `Ok(false)` where the backend's own download (`into_data`) is the fast way
    /// (`dst` untouched; an implementation may answer only for bf16 tensors, whose bytes it
    /// copies as they are). How hidden states kept in host memory come back after each pass.
    fn download_bf16(&self, x: &Tensor<B, 2>, dst: &mut [half::bf16]) -> Result<bool> {
        let _ = (x, dst);
        Ok(false)
    }

    /// Per-channel statistics of `x` `[Σ rows, dim]` (storage dtype) over the runs of rows
    /// `runs` lying back to back in it: `[Σ_r w_r x², Σ_r w_r |x|, max |x|]` per column, each
    /// `[1, dim]` f32 (the squares as `(|x|·w)·|x|`), what NVFP4's scales and SmoothQuant read;
    /// `Ok(None)` where this implementation has no one-pass kernel for `x` (the caller's
    /// chain of tensor ops runs instead).
    fn channel_sums(&self, x: &Tensor<B, 2>, runs: &[RowRun]) -> Result<Option<[Tensor<B, 2>; 3]>> {
        let _ = (x, runs);
        Ok(None)
    }

    /// `h + Σ_r w_r X_rᵀX_r` over the runs of rows `runs` lying back to back in `x`
    /// `[Σ rows, dim]` (storage dtype), `h` `[dim, dim]` f32: with [`sample_runs`]' weights
    /// `1/T_s`, the per-sample-normalised Hessian sums of calibration. By default the graph's
    /// [`gram_reference`].
    ///
    /// An implementation may return before the product is done, running it beside the
    /// caller's next steps: the returned Hessian is then read only after
    /// [`FastOps::settle_grams`] (a later `accumulate_gram` into it is fine).
    fn accumulate_gram(
        &self,
        h: Tensor<B, 2>,
        x: &Tensor<B, 2>,
        runs: &[RowRun],
    ) -> Result<Tensor<B, 2>> {
        Ok(gram_reference(h, x, runs))
    }

    /// Waits for the products [`FastOps::accumulate_gram`] left running, if any; their
    /// failures surface here. Nothing to wait for by default.
    fn settle_grams(&self) -> Result<()> {
        Ok(())
    }

    /// The op-by-op timer of these fast ops, where they have one
    /// ([`ProfiledOps`](crate::ProfiledOps)); `None` by default.
    fn profile(&self) -> Option<&crate::profile::OpProfile> {
        None
    }
}

/// Rows of a tensor that share one weight in a weighted sum over rows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowRun {
    /// Consecutive rows.
    pub rows: usize,
    /// Their weight.
    pub weight: f32,
}

/// The rows `rows` of a pack of samples of `lengths` tokens as runs weighted `1/T` by the
/// tokens `T` of the sample each row belongs to (neighbouring samples of equal length share
/// one run), and how many samples start in `rows`: the weights that count every sample once,
/// as if it had been added alone, whether it arrives whole or in chunks of rows.
pub fn sample_runs(lengths: &[usize], rows: std::ops::Range<usize>) -> (Vec<RowRun>, usize) {
    let (mut runs, mut starts) = (Vec::<RowRun>::new(), 0);
    let offsets = sequence_offsets(lengths);
    for (&len, span) in lengths.iter().zip(offsets.windows(2)) {
        let (first, end) = (span[0].max(rows.start), span[1].min(rows.end));
        if first >= end {
            continue;
        }
        starts += usize::from(span[0] >= rows.start);
        let weight = 1.0 / len.max(1) as f32;
        match runs.last_mut() {
            Some(run) if run.weight == weight => run.rows += end - first,
            _ => runs.push(RowRun {
                rows: end - first,
                weight,
            }),
        }
    }
    (runs, starts)
}

/// Each run's weight on each of its rows (`Σ rows` values): the per-row form of `runs`.
pub fn row_weights(runs: &[RowRun]) -> Vec<f32> {
    runs.iter()
        .flat_map(|run| std::iter::repeat_n(run.weight, run.rows))
        .collect()
}

/// `h + Σ_r w_r X_rᵀX_r` with the backend's f32 matmul: one product of the rows scaled by
/// `√w_r` (`Σ_r w_r X_rᵀX_r = (DX)ᵀ(DX)`), or `w XᵀX` for a single run.
pub fn gram_reference<B: Backend>(
    h: Tensor<B, 2>,
    x: &Tensor<B, 2>,
    runs: &[RowRun],
) -> Tensor<B, 2> {
    let x = to_f32(x.clone());
    let gram = match runs {
        [one] => x
            .clone()
            .transpose()
            .matmul(x)
            .mul_scalar(one.weight as f64),
        _ => {
            let values: Vec<f32> = runs
                .iter()
                .flat_map(|run| std::iter::repeat_n((run.weight as f64).sqrt() as f32, run.rows))
                .collect();
            let rows = values.len();
            let weights = Tensor::<B, 2>::from_data(
                TensorData::new(values, [rows, 1]),
                (&h.device(), DType::F32),
            );
            let scaled = x * weights;
            scaled.clone().transpose().matmul(scaled)
        }
    };
    h + gram
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

/// Runs of consecutive sequences of equal length in a pack: `(first row, length, count)`.
pub fn equal_runs(lengths: &[usize]) -> Vec<(usize, usize, usize)> {
    let mut runs: Vec<(usize, usize, usize)> = Vec::new();
    let mut row = 0;
    for &len in lengths {
        match runs.last_mut() {
            Some((_, l, count)) if *l == len => *count += 1,
            _ => runs.push((row, len, 1)),
        }
        row += len;
    }
    runs
}

#[cfg(feature = "cuda")]
pub use cube::{f32_matrix_view, CudaFastOps};

/// [`FastOps`] on burn-cuda: the kernels of `sala-kernels` on the tensors' own buffers.
#[cfg(feature = "cuda")]
mod cube {
    use super::{sequence_offsets, FastOps, RowRun};
    use crate::error::{ModelError, Result};
    use burn::tensor::{DType, Tensor, TensorPrimitive};
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::tensor::CubeTensor;
    use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
    use cubecl::cuda::CudaRuntime;
    use cubecl::prelude::CubeElement;
    use sala_kernels::attention::{causal_gqa_attention, AttentionShape};
    use sala_kernels::channel_stats::{channel_sums, ChannelBlocks};
    use sala_kernels::cuda::{
        blocked_causal_attention_bf16, linear_residual_bf16, linears_bf16, xtx_runs_bf16,
        Bf16Matrix, Cublas, DriverTransfer, HopperAttention, LinearOutput, LinearShape, MmaGla,
        ResidualLinear, XtxRun, XtxStream,
    };
    use sala_kernels::flash_attention::{
        flash_attention_bf16, flash_attention_supported, FLASH_HEAD_DIMS,
    };
    use sala_kernels::gates::{
        rms_norm, rms_norm_gate, rms_norm_rope, scaled_residual, sigmoid_gate, swiglu,
        NormRopeShape,
    };
    use sala_kernels::gla::{simple_gla_bf16, simple_gla_supported, GlaShape, GLA_HEAD_DIMS};

    /// Without the tensor-core flash kernel (a head dimension it is not compiled for),
    /// sequences from this length on take the cuBLAS-blocked attention (2.3 s at 131072
    /// tokens on an H200 against 15.9 s for the portable FMA kernel); shorter ones keep the
    /// portable kernel (no scratch, no host syncs per block).
    pub const BLOCKED_ATTENTION_MIN_LEN: usize = 4096;
    use sala_kernels::MatrixView;
    use std::sync::Arc;

    type R = CudaRuntime;

    /// The `sala-kernels` implementations on CUDA: causal GQA attention (bf16 on Hopper's
    /// warpgroup instructions with a [`HopperAttention`], else on the tensor cores where the
    /// head dimension allows, else the portable CubeCL kernel for bf16, f16 or f32 tensors)
    /// and, with a cuBLAS handle, bf16 linears and Hessians as cuBLAS GEMMs and, for head
    /// dimensions the flash kernel lacks, the attention of long bf16 sequences blocked on
    /// cuBLAS; with a [`DriverTransfer`], uploads through its page-locked staging; with an
    /// [`XtxStream`], the Hessian products on a stream of their own, beside the forward.
    #[derive(Debug, Clone, Default)]
    pub struct CudaFastOps {
        blas: Option<Arc<Cublas>>,
        hopper: Option<Arc<HopperAttention>>,
        gla: Option<Arc<MmaGla>>,
        transfer: Option<Arc<DriverTransfer>>,
        hessians: Option<Arc<XtxStream>>,
        fused_residual: bool,
    }

    impl CudaFastOps {
        /// Attention only (linears stay on the graph's matmul).
        pub fn attention_only() -> Self {
            Self::default()
        }

        /// Attention, and linears through `blas`.
        pub fn with_cublas(blas: Arc<Cublas>) -> Self {
            Self {
                blas: Some(blas),
                ..Self::default()
            }
        }

        /// The same, with bf16 attention of head dimension 128 on the Hopper kernel
        /// (`wgmma`) instead of the CubeCL flash kernel (`mma.sync`).
        pub fn with_hopper_attention(self, hopper: Arc<HopperAttention>) -> Self {
            Self {
                hopper: Some(hopper),
                ..self
            }
        }

        /// The same, with bf16 Simple GLA on the `mma.sync` kernel with register-resident
        /// fragments ([`MmaGla`]) instead of the CubeCL one (cooperative matrices).
        pub fn with_mma_gla(self, gla: Arc<MmaGla>) -> Self {
            Self {
                gla: Some(gla),
                ..self
            }
        }

        /// The same, uploading host tensors (a layer's weights, twice per layer) through
        /// `transfer`'s page-locked staging instead of CubeCL's own: on an H100 the real job's
        /// propagate of a lightning layer went from 2.52 to 2.37 s, and `bench_forward`'s
        /// first upload of a layer from 0.9 to 0.35 s (docs/results.md).
        pub fn with_transfer(self, transfer: Arc<DriverTransfer>) -> Self {
            Self {
                transfer: Some(transfer),
                ..self
            }
        }

        /// The same, with `o_proj` and `down_proj` adding their scaled residual in the
        /// product's epilogue (cuBLASLt, [`FastOps::linear_residual`]): one pass less over the
        /// hidden state per residual add, and the sum rounded once instead of the product
        /// first, so the hidden states (and the checkpoint) may move by a rounding step. Needs
        /// the cuBLAS linears ([`CudaFastOps::with_cublas`]).
        pub fn with_fused_residual(self) -> Self {
            Self {
                fused_residual: true,
                ..self
            }
        }

        /// The same, queueing the bf16 Hessian products (with cuBLAS) on `hessians`' stream:
        /// they run beside the forward's next steps instead of holding them up, and
        /// [`FastOps::settle_grams`] waits for them (and fills each Hessian's blocks above the
        /// diagonal then, once, instead of after every product). Each Hessian's sum is the
        /// same bit for bit.
        pub fn with_hessian_stream(self, hessians: Arc<XtxStream>) -> Self {
            Self {
                hessians: Some(hessians),
                ..self
            }
        }
    }

    fn primitive<F: FloatElement, I: IntElement, BT: BoolElement, const D: usize>(
        x: Tensor<CubeBackend<R, F, I, BT>, D>,
    ) -> CubeTensor<R> {
        into_contiguous(x.into_primitive().tensor())
    }

    /// The f32 matrix `t` `[rows, cols]` as a `sala-kernels` window on its own buffer (made
    /// contiguous first if it is not): how a statistics tensor reaches the device solver.
    pub fn f32_matrix_view<F: FloatElement, I: IntElement, BT: BoolElement>(
        t: &Tensor<CubeBackend<R, F, I, BT>, 2>,
    ) -> Result<MatrixView> {
        let [rows, cols] = t.dims();
        let t = primitive(t.clone());
        if t.dtype != DType::F32 {
            return Err(ModelError::InvalidInput(format!(
                "a {:?} matrix where f32 is expected",
                t.dtype
            )));
        }
        Ok(MatrixView {
            handle: t.handle.clone(),
            offset: 0,
            rows,
            cols,
            row_stride: cols,
        })
    }

    /// A CUDA tensor of the backend `CubeBackend<R, F, I, BT>`.
    type CudaTensor<F, I, BT, const D: usize> = Tensor<CubeBackend<R, F, I, BT>, D>;

    /// Runs the fused elementwise `kernel` (two inputs, one output, a length) on two bf16 tensors of one shape into a new one;
    /// `None` unless both are bf16.
    fn fused_bf16<F: FloatElement, I: IntElement, BT: BoolElement>(
        op: &'static str,
        a: &CudaTensor<F, I, BT, 2>,
        b: &CudaTensor<F, I, BT, 2>,
        kernel: impl Fn(
            &cubecl::prelude::ComputeClient<R>,
            &cubecl::server::Handle,
            &cubecl::server::Handle,
            &cubecl::server::Handle,
            usize,
        ) -> std::result::Result<(), sala_kernels::KernelError>,
    ) -> Result<Option<CudaTensor<F, I, BT, 2>>> {
        if a.dtype() != DType::BF16 || b.dtype() != DType::BF16 {
            return Ok(None);
        }
        let ([rows, cols], other) = (a.dims(), b.dims());
        if other != [rows, cols] {
            return Err(ModelError::InvalidInput(format!(
                "{op} of a [{rows}, {cols}] and a {other:?} tensor"
            )));
        }
        let (a, b) = (primitive(a.clone()), primitive(b.clone()));
        let len = rows * cols;
        let out = a.client.empty(len * 2);
        kernel(&a.client, &a.handle, &b.handle, &out, len).map_err(kernel_error(op))?;
        Ok(Some(bf16_tensor(&a, out, [rows, cols])))
    }

    /// The dense bf16 tensor of `shape` that `handle` holds, on `like`'s client and device.
    fn bf16_tensor<F: FloatElement, I: IntElement, BT: BoolElement, const D: usize>(
        like: &CubeTensor<R>,
        handle: cubecl::server::Handle,
        shape: [usize; D],
    ) -> CudaTensor<F, I, BT, D> {
        let tensor = CubeTensor::new_contiguous(
            like.client.clone(),
            like.device.clone(),
            shape.into(),
            handle,
            DType::BF16,
        );
        Tensor::from_primitive(TensorPrimitive::Float(tensor))
    }

    /// The bf16 RMSNorm of `x`'s rows, gated by `gate` (one shape with `x`) when given;
    /// `None` unless every tensor is bf16.
    fn bf16_norm<F: FloatElement, I: IntElement, BT: BoolElement>(
        x: &CudaTensor<F, I, BT, 2>,
        weight: &CudaTensor<F, I, BT, 1>,
        eps: f64,
        gate: Option<&CudaTensor<F, I, BT, 2>>,
    ) -> Result<Option<CudaTensor<F, I, BT, 2>>> {
        let op = if gate.is_some() {
            "rms norm gate"
        } else {
            "rms norm"
        };
        if x.dtype() != DType::BF16
            || weight.dtype() != DType::BF16
            || gate.is_some_and(|g| g.dtype() != DType::BF16)
        {
            return Ok(None);
        }
        let ([rows, cols], [n]) = (x.dims(), weight.dims());
        if n != cols || gate.is_some_and(|g| g.dims() != [rows, cols]) {
            return Err(ModelError::InvalidInput(format!(
                "{op} of [{rows}, {cols}] rows with a [{n}] weight and a gate of {:?}",
                gate.map(|g| g.dims())
            )));
        }
        let (x, weight) = (primitive(x.clone()), primitive(weight.clone()));
        let out = x.client.empty(rows * cols * 2);
        let (client, eps) = (&x.client, eps as f32);
        match gate.map(|g| primitive(g.clone())) {
            Some(g) => rms_norm_gate::<R, half::bf16>(
                client,
                &x.handle,
                &weight.handle,
                &g.handle,
                &out,
                rows,
                cols,
                eps,
            ),
            None => {
                rms_norm::<R, half::bf16>(client, &x.handle, &weight.handle, &out, rows, cols, eps)
            }
        }
        .map_err(kernel_error(op))?;
        Ok(Some(bf16_tensor(&x, out, [rows, cols])))
    }

    fn kernel_error(op: &'static str) -> impl Fn(sala_kernels::KernelError) -> ModelError {
        move |e| ModelError::Kernel {
            op,
            message: e.to_string(),
        }
    }

    impl<F, I, BT> FastOps<CubeBackend<R, F, I, BT>> for CudaFastOps
    where
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        fn describe(&self) -> String {
            let attention = match self.hopper {
                Some(_) => "bf16 attention on Hopper's wgmma (HopperAttention)",
                None => "bf16 attention on the CubeCL flash kernel",
            };
            let linears = match (&self.blas, &self.hessians) {
                (Some(_), Some(_)) => "linears and Hessians on cuBLAS, Hessians beside the forward",
                (Some(_), None) => "linears and Hessians on cuBLAS",
                (None, _) => "linears on burn's matmul",
            };
            let residual = match (&self.blas, self.fused_residual) {
                (Some(_), true) => ", residual adds in cuBLASLt's epilogue",
                _ => "",
            };
            let gla = match self.gla {
                Some(_) => "GLA on mma.sync (MmaGla)",
                None => "GLA on CubeCL's cooperative matrices",
            };
            let waits = match self.blas.as_ref().map(|blas| blas.ordering()) {
                Some(sala_kernels::cuda::StreamOrdering::DeviceWaits) => {
                    ", library calls ordered on the device"
                }
                _ => "",
            };
            format!("{attention}, {gla}, {linears}{residual}{waits}")
        }

        fn upload_host(
            &self,
            bytes: &[u8],
            dtype: DType,
            device: &<R as cubecl::Runtime>::Device,
        ) -> Result<Option<CudaTensor<F, I, BT, 1>>> {
            let Some(transfer) = &self.transfer else {
                return Ok(None);
            };
            if !matches!(dtype, DType::F32 | DType::BF16) || bytes.len() % dtype.size() != 0 {
                return Ok(None);
            }
            let client = <R as cubecl::Runtime>::client(device);
            let handle = transfer
                .upload_bytes(&client, bytes)
                .map_err(kernel_error("upload"))?;
            let len = bytes.len() / dtype.size();
            let out =
                CubeTensor::new_contiguous(client, device.clone(), [len].into(), handle, dtype);
            Ok(Some(Tensor::from_primitive(TensorPrimitive::Float(out))))
        }

        fn download_bf16(
            &self,
            x: &CudaTensor<F, I, BT, 2>,
            dst: &mut [half::bf16],
        ) -> Result<bool> {
            let Some(transfer) = &self.transfer else {
                return Ok(false);
            };
            if x.dtype() != DType::BF16 {
                return Ok(false);
            }
            if dst.len() != x.shape().num_elements() {
                return Err(ModelError::InvalidInput(format!(
                    "a download of {:?} bf16 into {} values",
                    x.dims(),
                    dst.len()
                )));
            }
            let x = primitive(x.clone());
            transfer
                .download_into(&x.client, &x.handle, dst)
                .map_err(kernel_error("download"))?;
            Ok(true)
        }

        fn accumulate_gram(
            &self,
            h: Tensor<CubeBackend<R, F, I, BT>, 2>,
            x: &Tensor<CubeBackend<R, F, I, BT>, 2>,
            runs: &[RowRun],
        ) -> Result<Tensor<CubeBackend<R, F, I, BT>, 2>> {
            let Some(blas) = &self.blas else {
                return Ok(super::gram_reference(h, x, runs));
            };
            if x.dtype() != DType::BF16 || h.dtype() != DType::F32 {
                return Ok(super::gram_reference(h, x, runs));
            }
            let ([tokens, dim], [rows, cols]) = (x.dims(), h.dims());
            if rows != dim || cols != dim || runs.iter().map(|r| r.rows).sum::<usize>() != tokens {
                return Err(ModelError::InvalidInput(format!(
                    "Hessian [{rows}, {cols}] for inputs [{tokens}, {dim}] in runs {runs:?}"
                )));
            }
            let x = primitive(x.clone());
            let mut h = primitive(h);
            let square = |h: &CubeTensor<R>| MatrixView {
                handle: h.handle.clone(),
                offset: 0,
                rows: dim,
                cols: dim,
                row_stride: dim,
            };
            if let Some(hessians) = &self.hessians {
                // Products still queued into h hold its buffer (and write it). Its blocks above
                // the diagonal are filled once, when settle_grams precedes reading it.
                hessians
                    .wait_for_products(&h.client, &square(&h))
                    .map_err(kernel_error("XᵀX"))?;
            }
            // β = 1 accumulates into h's own buffer: it must not be shared.
            if !h.handle.can_mut() {
                h = h.copy();
            }
            let view = square(&h);
            let runs: Vec<XtxRun> = runs
                .iter()
                .scan(0, |first_row, run| {
                    let xtx = XtxRun {
                        first_row: *first_row,
                        rows: run.rows,
                        weight: run.weight,
                    };
                    *first_row += run.rows;
                    Some(xtx)
                })
                .collect();
            let all = Bf16Matrix {
                handle: x.handle.clone(),
                rows: tokens,
                cols: dim,
            };
            match &self.hessians {
                Some(hessians) => hessians.queue(&x.client, &all, &runs, &view),
                None => xtx_runs_bf16(&x.client, blas, &all, &runs, &view),
            }
            .map_err(kernel_error("XᵀX"))?;
            drop(view);
            Ok(Tensor::from_primitive(TensorPrimitive::Float(h)))
        }

        fn channel_sums(
            &self,
            x: &Tensor<CubeBackend<R, F, I, BT>, 2>,
            runs: &[RowRun],
        ) -> Result<Option<[Tensor<CubeBackend<R, F, I, BT>, 2>; 3]>> {
            let [rows, cols] = x.dims();
            // No rows: nothing to add (and no block for the kernel to write).
            if x.dtype() != DType::BF16 || rows == 0 || cols == 0 {
                return Ok(None);
            }
            let weights = super::row_weights(runs);
            if weights.len() != rows {
                return Err(ModelError::InvalidInput(format!(
                    "channel sums of [{rows}, {cols}] inputs in runs of {} rows",
                    weights.len()
                )));
            }
            let x = primitive(x.clone());
            let client = &x.client;
            let blocks = ChannelBlocks::for_rows(rows);
            let partials = client.empty(blocks.partial_len(cols) * 4);
            let weights = client.create_from_slice(bytemuck::cast_slice(&weights));
            channel_sums::<R, half::bf16>(client, &x.handle, &weights, &partials, rows, cols)
                .map_err(kernel_error("channel sums"))?;
            let partials = CubeTensor::new_contiguous(
                client.clone(),
                x.device.clone(),
                [3, blocks.blocks, cols].into(),
                partials,
                DType::F32,
            );
            let partials: Tensor<CubeBackend<R, F, I, BT>, 3> =
                Tensor::from_primitive(TensorPrimitive::Float(partials));
            let plane = |s: usize| {
                partials
                    .clone()
                    .slice([s..s + 1, 0..blocks.blocks, 0..cols])
                    .reshape([blocks.blocks, cols])
            };
            Ok(Some([
                plane(0).sum_dim(0),
                plane(1).sum_dim(0),
                plane(2).max_dim(0),
            ]))
        }

        fn settle_grams(&self) -> Result<()> {
            match &self.hessians {
                Some(hessians) => hessians.settle().map_err(kernel_error("XᵀX")),
                None => Ok(()),
            }
        }

        fn swiglu(
            &self,
            gate: &Tensor<CubeBackend<R, F, I, BT>, 2>,
            up: &Tensor<CubeBackend<R, F, I, BT>, 2>,
        ) -> Result<Option<Tensor<CubeBackend<R, F, I, BT>, 2>>> {
            fused_bf16("swiglu", gate, up, swiglu::<R, half::bf16>)
        }

        fn sigmoid_gate(
            &self,
            x: &Tensor<CubeBackend<R, F, I, BT>, 2>,
            gate: &Tensor<CubeBackend<R, F, I, BT>, 2>,
        ) -> Result<Option<Tensor<CubeBackend<R, F, I, BT>, 2>>> {
            fused_bf16("sigmoid gate", x, gate, sigmoid_gate::<R, half::bf16>)
        }

        fn rms_norm(
            &self,
            x: &Tensor<CubeBackend<R, F, I, BT>, 2>,
            weight: &Tensor<CubeBackend<R, F, I, BT>, 1>,
            eps: f64,
        ) -> Result<Option<Tensor<CubeBackend<R, F, I, BT>, 2>>> {
            bf16_norm(x, weight, eps, None)
        }

        fn rms_norm_gate(
            &self,
            x: &Tensor<CubeBackend<R, F, I, BT>, 2>,
            weight: &Tensor<CubeBackend<R, F, I, BT>, 1>,
            eps: f64,
            gate: &Tensor<CubeBackend<R, F, I, BT>, 2>,
        ) -> Result<Option<Tensor<CubeBackend<R, F, I, BT>, 2>>> {
            bf16_norm(x, weight, eps, Some(gate))
        }

        fn scaled_residual(
            &self,
            hidden: &Tensor<CubeBackend<R, F, I, BT>, 2>,
            branch: &Tensor<CubeBackend<R, F, I, BT>, 2>,
            scale: f64,
        ) -> Result<Option<Tensor<CubeBackend<R, F, I, BT>, 2>>> {
            let scale = scale as f32;
            fused_bf16(
                "scaled residual",
                hidden,
                branch,
                |client, h, m, out, len| {
                    scaled_residual::<R, half::bf16>(client, h, m, out, len, scale)
                },
            )
        }

        fn linear(
            &self,
            x: &Tensor<CubeBackend<R, F, I, BT>, 2>,
            w: &Tensor<CubeBackend<R, F, I, BT>, 2>,
        ) -> Result<Option<Tensor<CubeBackend<R, F, I, BT>, 2>>> {
            Ok(self.linears(x, &[w])?.map(|mut ys| ys.remove(0)))
        }

        fn linear_residual(
            &self,
            hidden: &Tensor<CubeBackend<R, F, I, BT>, 2>,
            x: &Tensor<CubeBackend<R, F, I, BT>, 2>,
            w: &Tensor<CubeBackend<R, F, I, BT>, 2>,
            scale: f64,
        ) -> Result<Option<Tensor<CubeBackend<R, F, I, BT>, 2>>> {
            let Some(blas) = self.blas.as_ref().filter(|_| self.fused_residual) else {
                return Ok(None);
            };
            if [hidden, x, w].iter().any(|t| t.dtype() != DType::BF16) {
                return Ok(None);
            }
            let ([tokens, in_features], [out_features, w_in]) = (x.dims(), w.dims());
            if w_in != in_features || hidden.dims() != [tokens, out_features] {
                return Err(ModelError::InvalidInput(format!(
                    "linear residual of [{tokens}, {in_features}] by a [{out_features}, {w_in}] \
                     weight into a {:?} residual",
                    hidden.dims()
                )));
            }
            let (hidden, x, w) = (
                primitive(hidden.clone()),
                primitive(x.clone()),
                primitive(w.clone()),
            );
            let out = x.client.empty(tokens * out_features * 2);
            let shape = LinearShape {
                tokens,
                in_features,
                out_features,
            };
            let buffers = ResidualLinear {
                x: &x.handle,
                w: &w.handle,
                hidden: &hidden.handle,
                out: &out,
            };
            linear_residual_bf16(&x.client, blas, shape, buffers, scale as f32)
                .map_err(kernel_error("linear residual"))?;
            Ok(Some(bf16_tensor(&x, out, [tokens, out_features])))
        }

        fn linears(
            &self,
            x: &Tensor<CubeBackend<R, F, I, BT>, 2>,
            ws: &[&Tensor<CubeBackend<R, F, I, BT>, 2>],
        ) -> Result<Option<Vec<Tensor<CubeBackend<R, F, I, BT>, 2>>>> {
            let Some(blas) = &self.blas else {
                return Ok(None);
            };
            if x.dtype() != DType::BF16 || ws.iter().any(|w| w.dtype() != DType::BF16) {
                return Ok(None);
            }
            let [tokens, in_features] = x.dims();
            let mut outs = Vec::with_capacity(ws.len());
            for w in ws {
                let [out_features, w_in] = w.dims();
                if w_in != in_features {
                    return Err(ModelError::InvalidInput(format!(
                        "linear of [{tokens}, {in_features}] by a [{out_features}, {w_in}] weight"
                    )));
                }
                outs.push(out_features);
            }
            let x = primitive(x.clone());
            let ws: Vec<_> = ws.iter().map(|w| primitive((*w).clone())).collect();
            let ys: Vec<_> = outs
                .iter()
                .map(|out| x.client.empty(tokens * out * 2))
                .collect();
            let outputs: Vec<LinearOutput> = outs
                .iter()
                .zip(&ws)
                .zip(&ys)
                .map(|((&out_features, w), y)| LinearOutput {
                    out_features,
                    w: &w.handle,
                    y,
                })
                .collect();
            linears_bf16(&x.client, blas, tokens, in_features, &x.handle, &outputs)
                .map_err(kernel_error("linear"))?;
            let ys = outs
                .iter()
                .zip(ys)
                .map(|(&out_features, y)| bf16_tensor(&x, y, [tokens, out_features]))
                .collect();
            Ok(Some(ys))
        }

        fn rms_norm_rope(
            &self,
            x: &Tensor<CubeBackend<R, F, I, BT>, 3>,
            weight: &Tensor<CubeBackend<R, F, I, BT>, 1>,
            eps: f64,
            cos: &Tensor<CubeBackend<R, F, I, BT>, 2>,
            sin: &Tensor<CubeBackend<R, F, I, BT>, 2>,
            lengths: &[usize],
        ) -> Result<Option<Tensor<CubeBackend<R, F, I, BT>, 3>>> {
            let [tokens, heads, head_dim] = x.dims();
            let [positions, table_dim] = cos.dims();
            if x.dtype() != DType::BF16
                || weight.dtype() != DType::BF16
                || cos.dtype() != DType::F32
                || sin.dtype() != DType::F32
                || head_dim % 64 != 0
                || head_dim > 256
            {
                return Ok(None);
            }
            let longest = lengths.iter().copied().max().unwrap_or(0);
            if weight.dims() != [head_dim]
                || table_dim != head_dim
                || sin.dims() != cos.dims()
                || lengths.iter().sum::<usize>() != tokens
                || longest > positions
            {
                return Err(ModelError::InvalidInput(format!(
                    "rms norm rope of {:?} with a {:?} weight, {:?} tables, sequences {lengths:?}",
                    x.dims(),
                    weight.dims(),
                    cos.dims()
                )));
            }
            let (x, weight) = (primitive(x.clone()), primitive(weight.clone()));
            let (cos, sin) = (primitive(cos.clone()), primitive(sin.clone()));
            let at: Vec<u32> = lengths.iter().flat_map(|&len| 0..len as u32).collect();
            let at = x.client.create_from_slice(u32::as_bytes(&at));
            let out = x.client.empty(tokens * heads * head_dim * 2);
            let shape = NormRopeShape {
                tokens,
                heads,
                head_dim,
                positions,
                eps: eps as f32,
            };
            rms_norm_rope::<R, half::bf16>(
                &x.client,
                &shape,
                &x.handle,
                &weight.handle,
                &cos.handle,
                &sin.handle,
                &at,
                &out,
            )
            .map_err(kernel_error("rms norm rope"))?;
            Ok(Some(bf16_tensor(&x, out, [tokens, heads, head_dim])))
        }

        fn simple_gla(
            &self,
            q: &Tensor<CubeBackend<R, F, I, BT>, 3>,
            k: &Tensor<CubeBackend<R, F, I, BT>, 3>,
            v: &Tensor<CubeBackend<R, F, I, BT>, 3>,
            lengths: &[usize],
            log_decays: &[f64],
            scale: f32,
        ) -> Result<Option<Tensor<CubeBackend<R, F, I, BT>, 2>>> {
            let [tokens, heads, head_dim] = q.dims();
            if k.dims() != q.dims() || v.dims() != q.dims() {
                return Err(ModelError::InvalidInput(format!(
                    "gla of q {:?}, k {:?}, v {:?}",
                    q.dims(),
                    k.dims(),
                    v.dims()
                )));
            }
            if [q.dtype(), k.dtype(), v.dtype()] != [DType::BF16; 3]
                || !GLA_HEAD_DIMS.contains(&head_dim)
            {
                return Ok(None);
            }
            let (q, k, v) = (
                primitive(q.clone()),
                primitive(k.clone()),
                primitive(v.clone()),
            );
            let shape = GlaShape {
                heads,
                head_dim,
                scale,
            };
            let mma = self.gla.as_ref().filter(|_| MmaGla::supports(&shape));
            if mma.is_none() && !simple_gla_supported(&q.client) {
                return Ok(None);
            }
            let out = q.client.empty(tokens * heads * head_dim * 2);
            let (offsets, buffers) = (
                sequence_offsets(lengths),
                [&q.handle, &k.handle, &v.handle, &out],
            );
            match mma {
                Some(gla) => gla.run(&q.client, &shape, &offsets, log_decays, buffers),
                None => simple_gla_bf16(&q.client, &shape, &offsets, log_decays, buffers),
            }
            .map_err(kernel_error("simple gla"))?;
            Ok(Some(bf16_tensor(&q, out, [tokens, heads * head_dim])))
        }

        fn gated_causal_attention(
            &self,
            q: &Tensor<CubeBackend<R, F, I, BT>, 3>,
            k: &Tensor<CubeBackend<R, F, I, BT>, 3>,
            v: &Tensor<CubeBackend<R, F, I, BT>, 3>,
            lengths: &[usize],
            scale: f32,
            gate: &Tensor<CubeBackend<R, F, I, BT>, 2>,
        ) -> Result<Option<Tensor<CubeBackend<R, F, I, BT>, 2>>> {
            let [tokens, heads, head_dim] = q.dims();
            let shape = AttentionShape {
                heads,
                kv_heads: k.dims()[1],
                head_dim,
                scale,
            };
            let bf16 = [q.dtype(), k.dtype(), v.dtype(), gate.dtype()]
                .iter()
                .all(|&d| d == DType::BF16);
            let Some(hopper) = self
                .hopper
                .as_ref()
                .filter(|_| bf16 && HopperAttention::supports(&shape))
            else {
                return Ok(None);
            };
            if gate.dims() != [tokens, heads * head_dim] {
                return Err(ModelError::InvalidInput(format!(
                    "attention gate {:?} for {tokens} tokens of {heads} heads of {head_dim}",
                    gate.dims()
                )));
            }
            let (q, k, v) = (
                primitive(q.clone()),
                primitive(k.clone()),
                primitive(v.clone()),
            );
            let gate = primitive(gate.clone());
            let out = q.client.empty(tokens * heads * head_dim * 2);
            hopper
                .run_gated(
                    &q.client,
                    &shape,
                    &sequence_offsets(lengths),
                    [&q.handle, &k.handle, &v.handle, &out],
                    &gate.handle,
                )
                .map_err(kernel_error("gated causal attention"))?;
            Ok(Some(bf16_tensor(&q, out, [tokens, heads * head_dim])))
        }

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
            let longest = lengths.iter().copied().max().unwrap_or(0);
            let flash = q.dtype == DType::BF16
                && FLASH_HEAD_DIMS.contains(&head_dim)
                && flash_attention_supported(&q.client);
            let hopper = self
                .hopper
                .as_ref()
                .filter(|_| q.dtype == DType::BF16 && HopperAttention::supports(&shape));
            let launched = match (q.dtype, &self.blas, hopper) {
                // bf16 on Hopper's warpgroup tensor-core instructions, any length.
                (_, _, Some(hopper)) => hopper.run(
                    &q.client,
                    &shape,
                    &offsets,
                    [&q.handle, &k.handle, &v.handle, &out_handle],
                ),
                // bf16 on the tensor cores, any length.
                (DType::BF16, _, _) if flash => flash_attention_bf16(
                    &q.client,
                    &shape,
                    &offsets,
                    &q.handle,
                    &k.handle,
                    &v.handle,
                    &out_handle,
                )
                .map(|_| ()),
                // Long bf16 sequences: scores and P·V as cuBLAS GEMMs per query block.
                (DType::BF16, Some(blas), _) if longest >= BLOCKED_ATTENTION_MIN_LEN => {
                    blocked_causal_attention_bf16(
                        &q.client,
                        blas,
                        &shape,
                        &offsets,
                        &q.handle,
                        &k.handle,
                        &v.handle,
                        &out_handle,
                    )
                }
                (DType::BF16, _, _) => causal_gqa_attention::<R, half::bf16>(
                    &q.client,
                    &shape,
                    &offsets,
                    &q.handle,
                    &k.handle,
                    &v.handle,
                    &out_handle,
                ),
                (DType::F16, _, _) => causal_gqa_attention::<R, half::f16>(
                    &q.client,
                    &shape,
                    &offsets,
                    &q.handle,
                    &k.handle,
                    &v.handle,
                    &out_handle,
                ),
                (DType::F32, _, _) => causal_gqa_attention::<R, f32>(
                    &q.client,
                    &shape,
                    &offsets,
                    &q.handle,
                    &k.handle,
                    &v.handle,
                    &out_handle,
                ),
                (other, _, _) => {
                    return Err(ModelError::InvalidInput(format!(
                        "no attention kernel for {other:?} tensors"
                    )))
                }
            };
            launched.map_err(kernel_error("causal attention"))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows cutting through samples are weighted by their whole sample's length, neighbours of
    /// equal length share a run, and a sample counts where it starts.
    #[test]
    fn sample_runs_weigh_rows_by_their_whole_sample() {
        let lengths = [4, 4, 2, 6];
        let run = |rows, weight| RowRun { rows, weight };
        assert_eq!(
            sample_runs(&lengths, 0..16),
            (vec![run(8, 0.25), run(2, 0.5), run(6, 1.0 / 6.0)], 4)
        );
        assert_eq!(
            sample_runs(&lengths, 2..9),
            (vec![run(6, 0.25), run(1, 0.5)], 2)
        );
        assert_eq!(sample_runs(&lengths, 11..14), (vec![run(3, 1.0 / 6.0)], 0));
        assert_eq!(sample_runs(&lengths, 5..5), (vec![], 0));
        let chunks = [0..3, 3..10, 10..16].map(|r| sample_runs(&lengths, r));
        let total: usize = chunks.iter().map(|(_, starts)| starts).sum();
        assert_eq!(
            total,
            lengths.len(),
            "every sample counts once over the chunks"
        );
    }
}
