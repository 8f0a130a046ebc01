//! The decoder graph, run one layer at a time: embedding, decoder layers (with a tap on every
//! linear's input), final norm and `lm_head`.

use burn::tensor::activation::{sigmoid, silu};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};

use crate::config::{HeadDims, LayerKind, SalaConfig, EMBED_TOKENS};
use crate::error::{ModelError, Result};
use crate::fast::{equal_runs, FastOps};
use crate::host::{HeadWeights, HostTensor, LayerWeights};
use crate::numerics::{to_f32, Numerics};
use crate::ops::attention::{causal_attention, DEFAULT_SCORE_BUDGET};
use crate::ops::gla;
use crate::ops::linear;
use crate::ops::norm::rms_norm;
use crate::ops::rope::{apply_rope, RopeTables};
use crate::source::{DeviceLayerWeights, LayerSource};
use crate::store::TensorStore;
use rayon::prelude::*;
use std::sync::{Arc, Mutex};

/// Tokens per parallel task of [`LayerRunner::embed_bf16_into`]: each task holds the f32 rows
/// of this many tokens (16 MiB at a hidden size of 4096).
pub const HOST_EMBED_TOKENS: usize = 1024;

/// How minicpm4 layers treat sequences of `dense_len` tokens or more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionMode {
    /// Follow the config: a sequence at or beyond `sparse_config.dense_len` is an error,
    /// because InfLLM-v2 sparse attention is not implemented.
    #[default]
    FollowConfig,
    /// Plain causal attention at every length (the original calibration's
    /// `dense_len = 655360` override).
    Dense,
}

/// Options of a [`LayerRunner`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunOptions {
    /// Where to round to bf16.
    pub numerics: Numerics,
    /// Dense-mode switch for minicpm4 layers.
    pub attention: AttentionMode,
    /// Tokens per chunk of the chunked GLA (lightning layers).
    pub gla_chunk: usize,
    /// Maximum score-matrix elements per query block of softmax attention.
    pub score_budget: usize,
    /// Rows per chunk of the MLP (gate, up, SwiGLU, down): a pack longer than this runs its
    /// MLP a chunk at a time, so that `[rows, 3 × intermediate]` of intermediates live at once
    /// instead of the whole pack's. `None` runs every pack's rows at once. Row-wise, so the
    /// output is the same; `down_proj`'s tap then sees one chunk per call.
    pub mlp_rows: Option<usize>,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            numerics: Numerics::F32,
            attention: AttentionMode::FollowConfig,
            gla_chunk: 64,
            score_budget: DEFAULT_SCORE_BUDGET,
            mlp_rows: None,
        }
    }
}

/// Runs the model's pieces on backend `B`, one sequence (positions `0..T`) per call.
///
/// Hidden states are `Tensor<B, 2>` `[tokens, hidden_size]` in the storage dtype
/// ([`LayerRunner::storage_dtype`]): f32 (holding bf16 values under [`Numerics::Bf16Rounding`]),
/// or bf16 under [`Numerics::Bf16Storage`]. Inputs of another float dtype are cast to it.
#[derive(Debug, Clone)]
pub struct LayerRunner<B: Backend> {
    config: SalaConfig,
    device: B::Device,
    options: RunOptions,
    /// Faster implementations of some steps on this backend, if the caller supplied them.
    fast: Option<Arc<dyn FastOps<B>>>,
    /// RoPE tables of the longest sequence seen so far, kept on the device between calls.
    rope: Arc<Mutex<Option<RopeTables<B>>>>,
}

/// The rows of a pack (`start..end`) that a tapped tensor holds: a tap gets the module name,
/// the linear's input, and these rows (all of the pack's but for `down_proj` under
/// [`RunOptions::mlp_rows`]).
pub type TapRows = std::ops::Range<usize>;

/// Mixer steps, shared by the layer kinds: taps `x` as the input of each named linear (module
/// name and weight shape `[out, in]`), then returns `x·wᵀ` for each, in order, computed
/// together (one input, several weights: [`FastOps::linears`]).
type Apply<'f, B> =
    dyn FnMut(Tensor<B, 2>, &[(&str, [usize; 2])]) -> Result<Vec<Tensor<B, 2>>> + 'f;

/// q, k and v `[tokens, heads, d]`, and the gate projection `[tokens, q_width]` where one was
/// asked for.
type Projections<B> = ([Tensor<B, 3>; 3], Option<Tensor<B, 2>>);

/// [`Apply`] for one linear.
fn apply_one<B: Backend>(
    apply: &mut Apply<'_, B>,
    name: &str,
    x: Tensor<B, 2>,
    shape: [usize; 2],
) -> Result<Tensor<B, 2>> {
    let mut ys = apply(x, &[(name, shape)])?;
    ys.pop()
        .ok_or_else(|| ModelError::InvalidInput(format!("no product for {name}")))
}

/// `1/√d`: how the attention and GLA layers scale `q·k` for heads of dimension `d`.
fn attention_scale(head_dim: usize) -> f64 {
    1.0 / (head_dim as f64).sqrt()
}

/// The sequences of a pack as row ranges `start..end` of the `[Σ T, hidden]` buffer.
fn row_ranges(lengths: &[usize]) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    lengths.iter().scan(0, |start, &len| {
        let range = *start..*start + len;
        *start += len;
        Some(range)
    })
}

/// `values` as a flat tensor of `dtype` on `device`. bf16 is converted on the host in parallel
/// chunks (SIMD where the CPU has it) and uploaded as bf16: half the bytes over the bus, and
/// none of burn's one-value-at-a-time conversion (seconds per layer at full size). The bytes go
/// up through `fast`'s [`FastOps::upload_host`] where it has one, else through burn's
/// `from_data`.
fn upload_flat<B: Backend>(
    values: &[f32],
    device: &B::Device,
    dtype: DType,
    fast: Option<&dyn FastOps<B>>,
) -> Result<Tensor<B, 1>> {
    use half::slice::HalfFloatSliceExt;
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    if dtype != DType::BF16 {
        if let Some(t) = fast_upload(fast, bytemuck::cast_slice(values), dtype, device)? {
            return Ok(t);
        }
        return Ok(Tensor::from_data(
            TensorData::new(values.to_vec(), [values.len()]),
            (device, dtype),
        ));
    }
    let mut bits = vec![half::bf16::ZERO; values.len()];
    bits.par_chunks_mut(CHUNK)
        .zip(values.par_chunks(CHUNK))
        .for_each(|(dst, src)| dst.convert_from_f32_slice(src));
    if let Some(t) = fast_upload(fast, bytemuck::cast_slice(&bits), dtype, device)? {
        return Ok(t);
    }
    Ok(Tensor::from_data(
        TensorData::new(bits, [values.len()]),
        (device, dtype),
    ))
}

/// `bytes` uploaded through `fast`'s [`FastOps::upload_host`]; `None` without fast ops or where
/// they leave the upload to burn.
fn fast_upload<B: Backend>(
    fast: Option<&dyn FastOps<B>>,
    bytes: &[u8],
    dtype: DType,
    device: &B::Device,
) -> Result<Option<Tensor<B, 1>>> {
    fast.map_or(Ok(None), |f| f.upload_host(bytes, dtype, device))
}

/// The token embedding `[vocab, hidden]` uploaded once to a runner's device
/// ([`LayerRunner::upload_embedding`]), so that [`LayerRunner::embed_on_device`] gathers a
/// sample's rows there: 4 bytes per token cross the bus instead of a host buffer of
/// `4 · hidden` bytes per token.
#[derive(Debug, Clone)]
pub struct EmbeddingTable<B: Backend> {
    /// `[vocab, hidden]`, bf16 when the checkpoint stores bf16 and the runner stores bf16,
    /// else f32 (exact for f32, bf16 and f16 tables).
    rows: Tensor<B, 2>,
}

impl<B: Backend> EmbeddingTable<B> {
    /// Bytes the table takes on the device.
    pub fn bytes(&self) -> u64 {
        let [vocab, width] = self.rows.dims();
        (vocab * width * self.rows.dtype().size()) as u64
    }

    /// Rows (the vocabulary size).
    pub fn vocab(&self) -> usize {
        self.rows.dims()[0]
    }
}

/// Rows of the embedding uploaded at a time by [`LayerRunner::upload_embedding`]: 4096 rows of
/// a 4096-wide table are 64 MB of f32 on the host.
const EMBEDDING_UPLOAD_ROWS: usize = 4096;

/// The tensors of a pack's sequences stacked along the rows (the tensor itself for one).
fn concat_rows<B: Backend, const D: usize>(parts: Vec<Tensor<B, D>>) -> Tensor<B, D> {
    match <[Tensor<B, D>; 1]>::try_from(parts) {
        Ok([one]) => one,
        Err(parts) => Tensor::cat(parts, 0),
    }
}

/// A layer's weights converted to device tensors, checked against the config.
struct DeviceLayer<'a, B: Backend> {
    weights: &'a dyn LayerSource<B>,
    prefix: String,
    device: &'a B::Device,
    /// The runner's storage dtype; every weight is cast to it (a no-op when it has it).
    dtype: DType,
}

impl<B: Backend> DeviceLayer<'_, B> {
    fn tensor<const D: usize>(&self, name: &str, shape: [usize; D]) -> Result<Tensor<B, D>> {
        let full = format!("{}.{name}.weight", self.prefix);
        let flat = self.weights.flat_tensor(&full, &shape, self.device)?;
        Ok(flat.cast(self.dtype).reshape(shape))
    }
}

fn check_host_shape(name: &str, host: &HostTensor, shape: &[usize]) -> Result<()> {
    if host.shape != shape || host.data.len() != shape.iter().product::<usize>() {
        return Err(ModelError::InvalidInput(format!(
            "tensor {name} has shape {:?} with {} values, expected {shape:?}",
            host.shape,
            host.data.len()
        )));
    }
    Ok(())
}

impl<B: Backend> LayerRunner<B> {
    /// A runner for `config` on `device`.
    pub fn new(config: SalaConfig, device: B::Device, options: RunOptions) -> Self {
        Self {
            config,
            device,
            options,
            fast: None,
            rope: Arc::new(Mutex::new(None)),
        }
    }

    /// The same runner with `fast` computing the steps it implements (e.g.
    /// `CudaFastOps` on CUDA) instead of the Burn graph.
    pub fn with_fast_ops(mut self, fast: Arc<dyn FastOps<B>>) -> Self {
        self.fast = Some(fast);
        self
    }

    /// The installed [`FastOps`] implementation, if any.
    pub fn fast_ops(&self) -> Option<&dyn FastOps<B>> {
        self.fast.as_deref()
    }

    /// The model configuration.
    pub fn config(&self) -> &SalaConfig {
        &self.config
    }
    /// The device tensors are created on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }
    /// The options.
    pub fn options(&self) -> RunOptions {
        self.options
    }

    fn round<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        self.options.numerics.round(x)
    }

    /// The dtype of hidden states and weights on the device ([`Numerics::storage_dtype`]).
    pub fn storage_dtype(&self) -> DType {
        self.options.numerics.storage_dtype()
    }

    /// Uploads `weights` once, flattened and in the storage dtype, for running many samples
    /// through the layer with [`LayerRunner::run_layer_from`] (the quantization pipeline does;
    /// [`LayerRunner::run_layer`] uploads on every call).
    pub fn upload(&self, weights: &LayerWeights) -> Result<DeviceLayerWeights<B>> {
        self.options.numerics.check_backend::<B>(&self.device)?;
        let layer = weights.layer;
        if layer >= self.config.num_layers() || weights.kind != self.config.layer_kind(layer) {
            return Err(ModelError::InvalidInput(format!(
                "weights of layer {layer} ({:?}) do not match the config",
                weights.kind
            )));
        }
        let dtype = self.storage_dtype();
        let tensors = self
            .config
            .layer_tensor_specs(layer)
            .iter()
            .map(|spec| {
                let host = weights.get(&spec.name)?;
                check_host_shape(&spec.name, host, &spec.shape)?;
                upload_flat::<B>(&host.data, &self.device, dtype, self.fast_ops())
            })
            .collect::<Result<Vec<_>>>()?;
        DeviceLayerWeights::new(&self.config, layer, tensors)
    }

    /// Layer-0 input `[ids.len(), hidden]`: `embed_tokens[ids] · scale_emb`, reading only the
    /// rows of `ids` from the store.
    pub fn embed(&self, store: &TensorStore, ids: &[u32]) -> Result<Tensor<B, 2>> {
        if ids.is_empty() {
            return Err(ModelError::InvalidInput("empty token sequence".to_owned()));
        }
        let rows = store.rows_f32(EMBED_TOKENS, ids)?;
        check_host_shape(EMBED_TOKENS, &rows, &[ids.len(), self.config.hidden_size()])?;
        self.scale_embedding(rows.to_tensor_as::<B, 2>(&self.device, DType::F32))
    }

    /// The layer-0 input of `ids` in bf16 on the host, written into `dst` (`[ids.len(),
    /// hidden]` row-major): [`LayerRunner::embed`]'s values rounded to bf16
    /// (`embed_tokens[ids] · scale_emb` in f32, then the nearest bf16), with no device in
    /// between, for hidden states kept in host memory. The rows are read
    /// [`HOST_EMBED_TOKENS`] tokens per task, in parallel.
    pub fn embed_bf16_into(
        &self,
        store: &TensorStore,
        ids: &[u32],
        dst: &mut [half::bf16],
    ) -> Result<()> {
        if ids.is_empty() {
            return Err(ModelError::InvalidInput("empty token sequence".to_owned()));
        }
        let hidden = self.config.hidden_size();
        if dst.len() != ids.len() * hidden {
            return Err(ModelError::InvalidInput(format!(
                "{} bf16 values for the embedding of {} tokens of {hidden}",
                dst.len(),
                ids.len()
            )));
        }
        // `mul_scalar` on an f32 tensor multiplies by the scale as an f32.
        let scale = self.config.embedding_scale() as f32;
        dst.par_chunks_mut(HOST_EMBED_TOKENS * hidden)
            .zip(ids.par_chunks(HOST_EMBED_TOKENS))
            .try_for_each(|(out, ids)| {
                let rows = store.rows_f32(EMBED_TOKENS, ids)?;
                check_host_shape(EMBED_TOKENS, &rows, &[ids.len(), hidden])?;
                for (o, v) in out.iter_mut().zip(&rows.data) {
                    *o = half::bf16::from_f32(v * scale);
                }
                Ok(())
            })
    }

    /// The embedding table of `store` on this runner's device, for
    /// [`LayerRunner::embed_on_device`]. Uploaded in chunks of rows, so the host holds one
    /// chunk at a time (the whole table's mapped pages are released afterwards).
    pub fn upload_embedding(&self, store: &TensorStore) -> Result<EmbeddingTable<B>> {
        let info = store.info(EMBED_TOKENS)?;
        let width = self.config.hidden_size();
        let vocab = match info.shape[..] {
            // Gathered with i32 indices on the device.
            [vocab, w] if w == width && vocab > 0 && vocab <= i32::MAX as usize => vocab,
            _ => {
                return Err(ModelError::InvalidInput(format!(
                    "tensor {EMBED_TOKENS} has shape {:?}, expected [vocab > 0, {width}]",
                    info.shape
                )))
            }
        };
        let dtype = match (info.dtype, self.storage_dtype()) {
            (safetensors::Dtype::BF16, DType::BF16) => DType::BF16,
            _ => DType::F32,
        };
        let chunks = (0..vocab)
            .step_by(EMBEDDING_UPLOAD_ROWS)
            .map(|start| {
                let end = (start + EMBEDDING_UPLOAD_ROWS).min(vocab);
                let ids: Vec<u32> = (start..end).map(|i| i as u32).collect();
                let rows = store.rows_f32(EMBED_TOKENS, &ids)?;
                Ok(
                    upload_flat::<B>(&rows.data, &self.device, dtype, self.fast_ops())?
                        .reshape([end - start, width]),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        store.release(EMBED_TOKENS);
        Ok(EmbeddingTable {
            rows: concat_rows(chunks),
        })
    }

    /// Layer-0 input `[ids.len(), hidden]` gathered from `table` on the device: the same values
    /// as [`LayerRunner::embed`] (`embed_tokens[ids] · scale_emb` in f32, rounded to the
    /// storage dtype).
    pub fn embed_on_device(&self, table: &EmbeddingTable<B>, ids: &[u32]) -> Result<Tensor<B, 2>> {
        if ids.is_empty() {
            return Err(ModelError::InvalidInput("empty token sequence".to_owned()));
        }
        let vocab = table.vocab();
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(ModelError::InvalidInput(format!(
                "token id {id} is out of range for {EMBED_TOKENS} with {vocab} rows"
            )));
        }
        let index: Vec<i32> = ids.iter().map(|&id| id as i32).collect();
        let index =
            Tensor::<B, 1, Int>::from_data(TensorData::new(index, [ids.len()]), &self.device);
        self.scale_embedding(table.rows.clone().select(0, index))
    }

    /// Layer-0 input from embedding rows already on the device (`[tokens, hidden]`, any float
    /// dtype, e.g. gathered from a trained parameter): `rows · scale_emb` in f32, rounded to the
    /// storage dtype, as [`LayerRunner::embed`].
    pub fn scale_embedding(&self, rows: Tensor<B, 2>) -> Result<Tensor<B, 2>> {
        self.options.numerics.check_backend::<B>(&self.device)?;
        self.check_hidden(&rows)?;
        Ok(self.round(to_f32(rows).mul_scalar(self.config.embedding_scale())))
    }

    /// Logits `[tokens, vocab]` (an f32 tensor) from the last layer's output: final RMSNorm, division by
    /// `hidden_size / dim_model_base`, `lm_head`.
    pub fn logits(&self, head: &HeadWeights, hidden: Tensor<B, 2>) -> Result<Tensor<B, 2>> {
        let width = self.config.hidden_size();
        self.check_hidden(&hidden)?;
        check_host_shape("model.norm.weight", &head.final_norm, &[width])?;
        check_host_shape(
            self.config.lm_head_name(),
            &head.lm_head,
            &[self.config.vocab_size(), width],
        )?;
        self.logits_from(
            head.final_norm.to_tensor_as(&self.device, DType::F32),
            head.lm_head.to_tensor_as(&self.device, DType::F32),
            hidden,
        )
    }

    /// [`LayerRunner::logits`] with the final norm `[hidden]` and `lm_head` `[vocab, hidden]`
    /// given as device tensors (e.g. trained parameters), cast to the storage dtype. The logits
    /// are f32.
    pub fn logits_from(
        &self,
        final_norm: Tensor<B, 1>,
        lm_head: Tensor<B, 2>,
        hidden: Tensor<B, 2>,
    ) -> Result<Tensor<B, 2>> {
        let width = self.config.hidden_size();
        self.check_hidden(&hidden)?;
        let (norm_dims, head_dims) = (final_norm.dims(), lm_head.dims());
        if norm_dims != [width] || head_dims != [self.config.vocab_size(), width] {
            return Err(ModelError::InvalidInput(format!(
                "head tensors have shapes {norm_dims:?} and {head_dims:?}, expected [{width}] and [{}, {width}]",
                self.config.vocab_size()
            )));
        }
        self.options.numerics.check_backend::<B>(&self.device)?;
        let dtype = self.storage_dtype();
        let normed = self.norm(hidden.cast(dtype), final_norm.cast(dtype))?;
        let scaled = self.round(to_f32(normed).div_scalar(self.config.logit_divisor()));
        Ok(to_f32(linear(
            scaled,
            lm_head.cast(dtype),
            self.options.numerics,
        )))
    }

    fn check_hidden(&self, hidden: &Tensor<B, 2>) -> Result<()> {
        let [tokens, width] = hidden.dims();
        if tokens == 0 || width != self.config.hidden_size() {
            return Err(ModelError::InvalidInput(format!(
                "hidden states have shape [{tokens}, {width}], expected [tokens > 0, {}]",
                self.config.hidden_size()
            )));
        }
        Ok(())
    }

    /// RMSNorm of each row: the [`FastOps`] fused kernel where it has one, else the graph's.
    fn norm(&self, x: Tensor<B, 2>, weight: Tensor<B, 1>) -> Result<Tensor<B, 2>> {
        let eps = self.config.rms_norm_eps();
        if let Some(fast) = &self.fast {
            if let Some(normed) = fast.rms_norm(&x, &weight, eps)? {
                return Ok(normed);
            }
        }
        Ok(rms_norm(x, weight, eps, self.options.numerics))
    }

    /// RMSNorm of each row, then gated by `sigmoid(gate)`: the [`FastOps`] fused kernel where
    /// it has one, else [`Self::norm`] then [`Self::sigmoid_gate`].
    fn norm_gate(
        &self,
        x: Tensor<B, 2>,
        weight: Tensor<B, 1>,
        gate: Tensor<B, 2>,
    ) -> Result<Tensor<B, 2>> {
        if let Some(fast) = &self.fast {
            let eps = self.config.rms_norm_eps();
            if let Some(gated) = fast.rms_norm_gate(&x, &weight, eps, &gate)? {
                return Ok(gated);
            }
        }
        self.sigmoid_gate(self.norm(x, weight)?, gate)
    }

    /// `round(hidden + round(f32(branch) · residual_scale))`: the [`FastOps`] fused kernel
    /// where it has one.
    fn residual(&self, hidden: Tensor<B, 2>, branch: Tensor<B, 2>) -> Result<Tensor<B, 2>> {
        let scale = self.config.residual_scale();
        if let Some(fast) = &self.fast {
            if let Some(sum) = fast.scaled_residual(&hidden, &branch, scale)? {
                return Ok(sum);
            }
        }
        Ok(self.round(hidden + self.round(to_f32(branch).mul_scalar(scale))))
    }

    /// Checks `hidden` and that `weights` belong to a layer of this config.
    fn device_layer<'a>(
        &'a self,
        weights: &'a dyn LayerSource<B>,
        hidden: &Tensor<B, 2>,
    ) -> Result<DeviceLayer<'a, B>> {
        self.check_hidden(hidden)?;
        let layer = weights.layer();
        if layer >= self.config.num_layers() || weights.kind() != self.config.layer_kind(layer) {
            return Err(ModelError::InvalidInput(format!(
                "weights of layer {layer} ({:?}) do not match the config",
                weights.kind()
            )));
        }
        self.options.numerics.check_backend::<B>(&self.device)?;
        Ok(DeviceLayer::<B> {
            weights,
            prefix: format!("model.layers.{layer}"),
            device: &self.device,
            dtype: self.storage_dtype(),
        })
    }

    /// The inputs of a lightning layer's GLA for the layer input `hidden` `[tokens, hidden]`:
    /// `[q, k, v]`, each `[tokens, heads, d]`, after `input_layernorm`, the projections, the
    /// per-head q/k RMSNorm and RoPE, with q already multiplied by the attention scale
    /// `1/√d` — exactly what [`gla::chunked`] consumes inside [`LayerRunner::run_layer`]
    /// (there as `[heads, tokens, d]`); q is f32, k and v have the storage dtype. Errors unless
    /// `weights` is a lightning layer.
    pub fn lightning_gla_inputs(
        &self,
        weights: &LayerWeights,
        hidden: Tensor<B, 2>,
    ) -> Result<[Tensor<B, 3>; 3]> {
        let w = self.device_layer(weights, &hidden)?;
        let hidden = hidden.cast(w.dtype);
        if weights.kind != LayerKind::Lightning {
            return Err(ModelError::InvalidInput(format!(
                "layer {} is {:?}, not a lightning layer",
                weights.layer, weights.kind
            )));
        }
        let tokens = hidden.dims()[0];
        let a = self.norm(
            hidden,
            w.tensor("input_layernorm", [self.config.hidden_size()])?,
        )?;
        let mut apply = |x: Tensor<B, 2>, linears: &[(&str, [usize; 2])]| {
            linears
                .iter()
                .map(|&(name, shape)| {
                    Ok(linear(
                        x.clone(),
                        w.tensor(name, shape)?,
                        self.options.numerics,
                    ))
                })
                .collect()
        };
        let [q, k, v] = self.lightning_qkv(&w, &a, &[tokens], &mut apply)?;
        let scale = attention_scale(q.dims()[2]);
        Ok([to_f32(q).mul_scalar(scale), k, v])
    }

    /// Runs decoder layer `weights.layer` on `hidden` `[tokens, hidden]` and returns its output.
    ///
    /// `tap(name, x, rows)` is called once per linear, in forward order, with the full module
    /// name (`model.layers.3.self_attn.q_proj`), the exact `[tokens, in]` tensor that linear
    /// multiplies, and the rows it holds (`0..tokens`). Linears reading the same input (q/k/v
    /// and the gate; gate/up) get the same tensor, one call per name; the clone is a
    /// reference, not a copy. Under [`RunOptions::mlp_rows`], `down_proj` is tapped once per
    /// chunk of rows, in order.
    pub fn run_layer<F>(
        &self,
        weights: &LayerWeights,
        hidden: Tensor<B, 2>,
        tap: F,
    ) -> Result<Tensor<B, 2>>
    where
        F: FnMut(&str, &Tensor<B, 2>, TapRows),
    {
        self.run_layer_from(weights, hidden, tap)
    }

    /// [`LayerRunner::run_layer`] with the weights taken from any [`LayerSource`]: host f32
    /// or device tensors ([`DeviceLayerWeights`], e.g. the
    /// parameters of a training loop, through which gradients then flow).
    pub fn run_layer_from<F>(
        &self,
        weights: &dyn LayerSource<B>,
        hidden: Tensor<B, 2>,
        tap: F,
    ) -> Result<Tensor<B, 2>>
    where
        F: FnMut(&str, &Tensor<B, 2>, TapRows),
    {
        let tokens = hidden.dims()[0];
        self.run_pack_from(weights, hidden, &[tokens], tap)
    }

    /// [`LayerRunner::run_layer_from`] on a pack: sequences of `lengths` tokens lying back to
    /// back in `hidden` `[Σ lengths, hidden]`. Row-wise steps (norms, linears, gates) run on
    /// the whole pack at once; RoPE positions, attention and the GLA state restart at each
    /// sequence, so every sequence's rows come out as if it had run alone. The taps see the
    /// pack's `[Σ lengths, in]` inputs.
    pub fn run_pack_from<F>(
        &self,
        weights: &dyn LayerSource<B>,
        hidden: Tensor<B, 2>,
        lengths: &[usize],
        tap: F,
    ) -> Result<Tensor<B, 2>>
    where
        F: FnMut(&str, &Tensor<B, 2>, TapRows),
    {
        let out = self.forward(weights, hidden, lengths, tap, true)?;
        out.ok_or_else(|| ModelError::InvalidInput("the layer produced no output".into()))
    }

    /// The taps of [`LayerRunner::run_pack_from`] without the rest: the pass stops once the
    /// last linear's input (`down_proj`'s) has been tapped, skipping `down_proj` itself and
    /// the residual that nobody reads during calibration capture.
    pub fn capture_pack_from<F>(
        &self,
        weights: &dyn LayerSource<B>,
        hidden: Tensor<B, 2>,
        lengths: &[usize],
        tap: F,
    ) -> Result<()>
    where
        F: FnMut(&str, &Tensor<B, 2>, TapRows),
    {
        self.forward(weights, hidden, lengths, tap, false)
            .map(|_| ())
    }

    /// Errors unless `lengths` (all positive) add up to the `tokens` rows of a pack.
    fn check_lengths(lengths: &[usize], tokens: usize) -> Result<()> {
        if lengths.is_empty() || lengths.contains(&0) || lengths.iter().sum::<usize>() != tokens {
            return Err(ModelError::InvalidInput(format!(
                "sequence lengths {lengths:?} do not split a pack of {tokens} tokens"
            )));
        }
        Ok(())
    }

    /// One layer on a pack; `None` when `full` is false (stopped after the last tap).
    fn forward<F>(
        &self,
        weights: &dyn LayerSource<B>,
        hidden: Tensor<B, 2>,
        lengths: &[usize],
        mut tap: F,
        full: bool,
    ) -> Result<Option<Tensor<B, 2>>>
    where
        F: FnMut(&str, &Tensor<B, 2>, TapRows),
    {
        let w = self.device_layer(weights, &hidden)?;
        Self::check_lengths(lengths, hidden.dims()[0])?;
        let hidden = hidden.cast(w.dtype);
        let layer = weights.layer();
        let (hidden_size, inter) = (self.config.hidden_size(), self.config.intermediate_size());
        let mut apply = |x: Tensor<B, 2>, linears: &[(&str, [usize; 2])]| {
            let mut ws = Vec::with_capacity(linears.len());
            for &(name, shape) in linears {
                tap(&format!("{}.{name}", w.prefix), &x, 0..x.dims()[0]);
                ws.push(w.tensor(name, shape)?);
            }
            self.linears(x, ws)
        };
        let a = self.norm(hidden.clone(), w.tensor("input_layernorm", [hidden_size])?)?;
        // The mixer stops at o_proj's input: o_proj and the residual add run as one call.
        let mixed = match weights.kind() {
            LayerKind::Minicpm4 => self.minicpm4(layer, a, lengths, &mut apply)?,
            LayerKind::Lightning => self.lightning(&w, a, lengths, &mut apply)?,
            LayerKind::Llama => self.llama(a, lengths, &mut apply)?,
        };
        let [tokens, mixed_width] = mixed.dims();
        tap(&format!("{}.self_attn.o_proj", w.prefix), &mixed, 0..tokens);
        let o_proj = w.tensor("self_attn.o_proj", [hidden_size, mixed_width])?;
        let h = self.linear_residual(hidden, mixed, o_proj)?;

        let m = self.norm(
            h.clone(),
            w.tensor("post_attention_layernorm", [hidden_size])?,
        )?;
        for name in ["mlp.gate_proj", "mlp.up_proj"] {
            tap(&format!("{}.{name}", w.prefix), &m, 0..tokens);
        }
        let (gate, up, down) = (
            w.tensor("mlp.gate_proj", [inter, hidden_size])?,
            w.tensor("mlp.up_proj", [inter, hidden_size])?,
            w.tensor("mlp.down_proj", [hidden_size, inter])?,
        );
        let chunk = self.options.mlp_rows.unwrap_or(tokens).max(1);
        let mut outputs = Vec::with_capacity(tokens.div_ceil(chunk));
        for start in (0..tokens).step_by(chunk) {
            let rows = start..(start + chunk).min(tokens);
            let part = |x: &Tensor<B, 2>| match rows.len() == tokens {
                true => x.clone(),
                false => x.clone().slice([rows.clone(), 0..hidden_size]),
            };
            let [gate_out, up_out]: [Tensor<B, 2>; 2] = self
                .linears(part(&m), vec![gate.clone(), up.clone()])?
                .try_into()
                .map_err(|_| ModelError::InvalidInput("gate and up: not two products".into()))?;
            let act = self.swiglu(gate_out, up_out)?;
            tap(&format!("{}.mlp.down_proj", w.prefix), &act, rows.clone());
            if full {
                outputs.push(self.linear_residual(part(&h), act, down.clone())?);
            }
        }
        Ok(full.then(|| concat_rows(outputs)))
    }

    /// `x·wᵀ`: the [`FastOps`] product where it has one, else the graph's [`linear`].
    fn linear(&self, x: Tensor<B, 2>, w: Tensor<B, 2>) -> Result<Tensor<B, 2>> {
        if let Some(fast) = &self.fast {
            if let Some(y) = fast.linear(&x, &w)? {
                return Ok(y);
            }
        }
        Ok(linear(x, w, self.options.numerics))
    }

    /// `round(hidden + residual_scale · x·wᵀ)`: the [`FastOps`] call that adds the residual in
    /// the product's epilogue where it has one, else [`Self::linear`] then [`Self::residual`].
    fn linear_residual(
        &self,
        hidden: Tensor<B, 2>,
        x: Tensor<B, 2>,
        w: Tensor<B, 2>,
    ) -> Result<Tensor<B, 2>> {
        if let Some(fast) = &self.fast {
            let scale = self.config.residual_scale();
            if let Some(sum) = fast.linear_residual(&hidden, &x, &w, scale)? {
                return Ok(sum);
            }
        }
        let branch = self.linear(x, w)?;
        self.residual(hidden, branch)
    }

    /// `x·w_iᵀ` for each of `ws`: the [`FastOps`] call for several weights where it has one,
    /// else [`Self::linear`] per weight.
    fn linears(&self, x: Tensor<B, 2>, ws: Vec<Tensor<B, 2>>) -> Result<Vec<Tensor<B, 2>>> {
        if let (Some(fast), true) = (&self.fast, ws.len() > 1) {
            let refs: Vec<&Tensor<B, 2>> = ws.iter().collect();
            if let Some(ys) = fast.linears(&x, &refs)? {
                if ys.len() != ws.len() {
                    return Err(ModelError::InvalidInput(format!(
                        "{} products for {} weights",
                        ys.len(),
                        ws.len()
                    )));
                }
                return Ok(ys);
            }
        }
        ws.into_iter().map(|w| self.linear(x.clone(), w)).collect()
    }

    /// `round(round(silu(gate)) · up)`: the [`FastOps`] fused kernel where it has one.
    fn swiglu(&self, gate: Tensor<B, 2>, up: Tensor<B, 2>) -> Result<Tensor<B, 2>> {
        if let Some(fast) = &self.fast {
            if let Some(act) = fast.swiglu(&gate, &up)? {
                return Ok(act);
            }
        }
        Ok(self.round(self.round(silu(gate)) * up))
    }

    /// `round(x · round(sigmoid(gate)))`: the [`FastOps`] fused kernel where it has one.
    fn sigmoid_gate(&self, x: Tensor<B, 2>, gate: Tensor<B, 2>) -> Result<Tensor<B, 2>> {
        if let Some(fast) = &self.fast {
            if let Some(gated) = fast.sigmoid_gate(&x, &gate)? {
                return Ok(gated);
            }
        }
        Ok(self.round(x * self.round(sigmoid(gate))))
    }

    /// q/k/v projections of `a` into `[tokens, heads, d]` views, and with `gate` (a module
    /// name) that `[q_width, hidden]` projection of `a` too, all in one [`Apply`] call.
    fn project_qkv(
        &self,
        a: &Tensor<B, 2>,
        dims: HeadDims,
        apply: &mut Apply<'_, B>,
        gate: Option<&str>,
    ) -> Result<Projections<B>> {
        let hidden = self.config.hidden_size();
        let tokens = a.dims()[0];
        let mut linears = vec![
            ("self_attn.q_proj", [dims.q_width(), hidden]),
            ("self_attn.k_proj", [dims.kv_width(), hidden]),
            ("self_attn.v_proj", [dims.kv_width(), hidden]),
        ];
        linears.extend(gate.map(|name| (name, [dims.q_width(), hidden])));
        let mut ys = apply(a.clone(), &linears)?.into_iter();
        let mut next = |heads: usize| {
            ys.next()
                .map(|y| y.reshape([tokens, heads, dims.head_dim]))
                .ok_or_else(|| ModelError::InvalidInput("missing q/k/v product".into()))
        };
        let qkv = [
            next(dims.heads)?,
            next(dims.kv_heads)?,
            next(dims.kv_heads)?,
        ];
        Ok((qkv, ys.next()))
    }

    /// Causal softmax attention of each sequence of the pack, `[tokens, heads·d]` in the
    /// storage dtype: the [`FastOps`] kernel when one is installed, else the Burn graph one
    /// sequence at a time.
    fn softmax_attention(
        &self,
        q: Tensor<B, 3>,
        k: Tensor<B, 3>,
        v: Tensor<B, 3>,
        lengths: &[usize],
    ) -> Result<Tensor<B, 2>> {
        let [tokens, heads, d] = q.dims();
        if let Some(fast) = &self.fast {
            let scale = attention_scale(d) as f32;
            let out = fast.causal_attention(q, k, v, lengths, scale)?;
            return Ok(self.round(out.reshape([tokens, heads * d])));
        }
        let kv_heads = k.dims()[1];
        let outs: Vec<Tensor<B, 3>> = row_ranges(lengths)
            .map(|rows| {
                causal_attention(
                    q.clone().slice([rows.clone(), 0..heads, 0..d]),
                    k.clone().slice([rows.clone(), 0..kv_heads, 0..d]),
                    v.clone().slice([rows, 0..kv_heads, 0..d]),
                    self.options.score_budget,
                )
            })
            .collect();
        Ok(self.round(concat_rows(outs).reshape([tokens, heads * d])))
    }

    /// [`Self::softmax_attention`] times `sigmoid(gate)` (`gate` `[tokens, heads·d]`): the
    /// [`FastOps`] fused call where it has one, else the two steps.
    fn gated_attention(
        &self,
        q: Tensor<B, 3>,
        k: Tensor<B, 3>,
        v: Tensor<B, 3>,
        lengths: &[usize],
        gate: Tensor<B, 2>,
    ) -> Result<Tensor<B, 2>> {
        if let Some(fast) = &self.fast {
            let scale = attention_scale(q.dims()[2]) as f32;
            if let Some(gated) = fast.gated_causal_attention(&q, &k, &v, lengths, scale, &gate)? {
                return Ok(gated);
            }
        }
        let att = self.softmax_attention(q, k, v, lengths)?;
        self.sigmoid_gate(att, gate)
    }

    /// Sparse-layer mixer in dense mode up to `o_proj`'s input: GQA causal attention without
    /// RoPE, times `sigmoid(o_gate(a))`.
    fn minicpm4(
        &self,
        layer: usize,
        a: Tensor<B, 2>,
        lengths: &[usize],
        apply: &mut Apply<'_, B>,
    ) -> Result<Tensor<B, 2>> {
        let longest = lengths.iter().copied().max().unwrap_or(0);
        if let (AttentionMode::FollowConfig, Some(dense_len)) =
            (self.options.attention, self.config.dense_len())
        {
            if longest >= dense_len {
                return Err(ModelError::SparseAttentionRequired {
                    layer,
                    tokens: longest,
                    dense_len,
                });
            }
        }
        let dims = self.config.attention_heads();
        let ([q, k, v], gate) = self.project_qkv(&a, dims, apply, Some("self_attn.o_gate"))?;
        let gate = gate.ok_or_else(|| ModelError::InvalidInput("missing o_gate product".into()))?;
        self.gated_attention(q, k, v, lengths, gate)
    }

    /// Lightning mixer up to `o_proj`'s input: q/k RMSNorm per head, RoPE, Simple GLA in f32,
    /// `o_norm` over all heads, times `sigmoid(z_proj(a))`.
    fn lightning(
        &self,
        w: &DeviceLayer<'_, B>,
        a: Tensor<B, 2>,
        lengths: &[usize],
        apply: &mut Apply<'_, B>,
    ) -> Result<Tensor<B, 2>> {
        let dims = self.config.lightning_heads().ok_or_else(|| {
            ModelError::InvalidInput("lightning layer without lightning heads".into())
        })?;
        let hidden = self.config.hidden_size();
        let (heads, d) = (dims.heads, dims.head_dim);
        let [q, k, v] = self.lightning_qkv(w, &a, lengths, apply)?;
        let out = self.gla(q, k, v, lengths, attention_scale(d))?;
        // z_proj after the GLA, not with q/k/v: its [tokens, heads·d] output would otherwise
        // be held through the GLA (1 GiB at 131072 tokens).
        let gate = apply_one(apply, "self_attn.z_proj", a, [heads * d, hidden])?;
        self.norm_gate(out, w.tensor("self_attn.o_norm", [heads * d])?, gate)
    }

    /// The Simple GLA of every sequence of the pack for `q` (not yet multiplied by `scale`),
    /// `k`, `v` `[tokens, heads, d]`, `[tokens, heads·d]` rounded: the fast op where there is
    /// one, else the graph's chunked form, sequences of equal length next to each other as
    /// one batch (their heads side by side).
    fn gla(
        &self,
        q: Tensor<B, 3>,
        k: Tensor<B, 3>,
        v: Tensor<B, 3>,
        lengths: &[usize],
        scale: f64,
    ) -> Result<Tensor<B, 2>> {
        let [_, heads, d] = q.dims();
        let decays = gla::log_decays(heads);
        if let Some(fast) = &self.fast {
            if let Some(out) = fast.simple_gla(&q, &k, &v, lengths, &decays, scale as f32)? {
                return Ok(out);
            }
        }
        let q = to_f32(q).mul_scalar(scale);
        let outs: Vec<Tensor<B, 2>> = equal_runs(lengths)
            .into_iter()
            .map(|(start, len, count)| {
                let rows = start..start + len * count;
                // [count·len, heads, d] → [count·heads, len, d]
                let by_head = |x: Tensor<B, 3>| {
                    x.slice([rows.clone(), 0..heads, 0..d])
                        .reshape([count, len, heads, d])
                        .swap_dims(1, 2)
                        .reshape([count * heads, len, d])
                };
                let out = gla::chunked(
                    by_head(q.clone()),
                    by_head(k.clone()),
                    by_head(v.clone()),
                    &decays,
                    self.options.gla_chunk,
                );
                out.reshape([count, heads, len, d])
                    .swap_dims(1, 2)
                    .reshape([count * len, heads * d])
            })
            .collect();
        Ok(self.round(concat_rows(outs)))
    }

    /// RoPE of `q` and `k` `[tokens, heads, d]` at positions restarting with each sequence of
    /// `lengths`: the [`FastOps`] kernel where it has one, else the graph's rotation.
    fn rope(
        &self,
        q: Tensor<B, 3>,
        k: Tensor<B, 3>,
        lengths: &[usize],
    ) -> Result<[Tensor<B, 3>; 2]> {
        let d = q.dims()[2];
        if let Some(fast) = &self.fast {
            let tables = self.rope_cache(lengths, d)?;
            let q_rotated = fast.rope(&q, &tables.cos, &tables.sin, lengths)?;
            let k_rotated = fast.rope(&k, &tables.cos, &tables.sin, lengths)?;
            if let (Some(q), Some(k)) = (q_rotated, k_rotated) {
                return Ok([q, k]);
            }
        }
        let tables = self.rope_tables(lengths, d)?;
        let numerics = self.options.numerics;
        Ok([
            apply_rope(q, &tables, numerics),
            apply_rope(k, &tables, numerics),
        ])
    }

    /// RoPE tables covering every sequence of `lengths`, one row per token of the pack.
    fn rope_tables(&self, lengths: &[usize], head_dim: usize) -> Result<RopeTables<B>> {
        self.rope_cache(lengths, head_dim)?.for_pack(lengths)
    }

    /// The runner's cached RoPE tables `[positions, head_dim]`, covering the longest of
    /// `lengths` (rebuilt only when a longer sequence or another head dimension comes along).
    fn rope_cache(&self, lengths: &[usize], head_dim: usize) -> Result<RopeTables<B>> {
        let longest = lengths.iter().copied().max().unwrap_or(0);
        let mut cache = self
            .rope
            .lock()
            .map_err(|_| ModelError::InvalidInput("RoPE table cache poisoned".into()))?;
        let tables = match cache.as_ref() {
            Some(t) if t.positions() >= longest && t.cos.dims()[1] == head_dim => t.clone(),
            _ => {
                let t =
                    RopeTables::<B>::new(longest, head_dim, self.config.rope_theta(), &self.device);
                *cache = Some(t.clone());
                t
            }
        };
        Ok(tables)
    }

    /// Per-head RMSNorm of `x` `[tokens, heads, d]` with `weight` `[d]`, then RoPE at positions
    /// restarting with each sequence of `lengths`: the [`FastOps`] fused kernel where it has
    /// one, else the graph's norm and rotation.
    fn norm_rope(
        &self,
        x: Tensor<B, 3>,
        weight: Tensor<B, 1>,
        lengths: &[usize],
    ) -> Result<Tensor<B, 3>> {
        let [tokens, heads, d] = x.dims();
        let tables = self.rope_cache(lengths, d)?;
        if let Some(fast) = &self.fast {
            let eps = self.config.rms_norm_eps();
            if let Some(out) =
                fast.rms_norm_rope(&x, &weight, eps, &tables.cos, &tables.sin, lengths)?
            {
                return Ok(out);
            }
        }
        let normed = self
            .norm(x.reshape([tokens * heads, d]), weight)?
            .reshape([tokens, heads, d]);
        Ok(apply_rope(
            normed,
            &tables.for_pack(lengths)?,
            self.options.numerics,
        ))
    }

    /// Lightning q, k, v `[tokens, heads, d]` from the normed input `a`: projections,
    /// q/k RMSNorm per head, RoPE (positions restarting with each sequence of `lengths`).
    fn lightning_qkv(
        &self,
        w: &DeviceLayer<'_, B>,
        a: &Tensor<B, 2>,
        lengths: &[usize],
        apply: &mut Apply<'_, B>,
    ) -> Result<[Tensor<B, 3>; 3]> {
        let dims = self.config.lightning_heads().ok_or_else(|| {
            ModelError::InvalidInput("lightning layer without lightning heads".into())
        })?;
        let d = dims.head_dim;
        let ([q, k, v], _) = self.project_qkv(a, dims, apply, None)?;
        let q = self.norm_rope(q, w.tensor("self_attn.q_norm", [d])?, lengths)?;
        let k = self.norm_rope(k, w.tensor("self_attn.k_norm", [d])?, lengths)?;
        Ok([q, k, v])
    }

    /// Llama mixer up to `o_proj`'s input: RoPE on q and k, GQA causal attention.
    fn llama(
        &self,
        a: Tensor<B, 2>,
        lengths: &[usize],
        apply: &mut Apply<'_, B>,
    ) -> Result<Tensor<B, 2>> {
        let dims = self.config.attention_heads();
        let ([q, k, v], _) = self.project_qkv(&a, dims, apply, None)?;
        let [q, k] = self.rope(q, k, lengths)?;
        self.softmax_attention(q, k, v, lengths)
    }

    /// The whole model on one sequence: embedding, every layer (loaded one at a time from
    /// `store`), final norm and `lm_head`. Returns logits `[ids.len(), vocab]`.
    pub fn forward_logits(&self, store: &TensorStore, ids: &[u32]) -> Result<Tensor<B, 2>> {
        let mut hidden = self.embed(store, ids)?;
        for layer in 0..self.config.num_layers() {
            let weights = LayerWeights::load(store, &self.config, layer)?;
            hidden = self.run_layer(&weights, hidden, |_, _, _| {})?;
        }
        self.logits(&HeadWeights::load(store, &self.config)?, hidden)
    }
}
