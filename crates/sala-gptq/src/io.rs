//! Where the per-layer engine reads weights from ([`WeightSource`]: a checkpoint, or the
//! synthetic model of [`crate::synthetic`]) and where it puts each finished layer
//! ([`LayerSink`]: a checkpoint writer, or nowhere).

use crate::error::PipelineError;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use sala_export::CheckpointWriter;
use sala_formats::{GptqPacked, Nvfp4Matrix};
use sala_model::{
    EmbeddingTable, HostTensor, LayerRunner, LayerWeights, ModelError, SalaConfig, TensorStore,
};

/// A model's weights, one decoder layer at a time.
pub trait WeightSource<B: Backend> {
    /// The model's configuration.
    fn config(&self) -> &SalaConfig;

    /// The layer-0 input of `ids`, `[ids.len(), hidden]` in the runner's storage dtype.
    fn embed(&self, runner: &LayerRunner<B>, ids: &[u32]) -> Result<Tensor<B, 2>, ModelError>;

    /// The embedding table on `runner`'s device, when this source has one to upload, for
    /// embedding many samples there ([`LayerRunner::embed_on_device`], the same values as
    /// [`WeightSource::embed`]); `None` (the default): embed each sample with `embed`.
    fn embedding_table(
        &self,
        _runner: &LayerRunner<B>,
    ) -> Result<Option<EmbeddingTable<B>>, ModelError> {
        Ok(None)
    }

    /// The layer-0 input of `ids` written into `dst` in bf16 on the host
    /// (`[ids.len(), hidden]`), the values of [`WeightSource::embed`] rounded to bf16, for
    /// hidden states kept in host memory; `Ok(false)` (the default) where this source only
    /// embeds on the runner's device.
    fn embed_host(
        &self,
        _runner: &LayerRunner<B>,
        _ids: &[u32],
        _dst: &mut [half::bf16],
    ) -> Result<bool, ModelError> {
        Ok(false)
    }

    /// Decoder layer `layer`'s weights on the host (f32), which the pipeline smooths and
    /// replaces by their quantized values.
    fn layer(&self, layer: usize) -> Result<LayerWeights, ModelError>;
}

/// A checkpoint directory's weights (memory-mapped).
pub struct CheckpointSource<'a> {
    /// The tensors.
    pub store: &'a TensorStore,
    /// Its validated `config.json`.
    pub config: &'a SalaConfig,
}

impl<B: Backend> WeightSource<B> for CheckpointSource<'_> {
    fn config(&self) -> &SalaConfig {
        self.config
    }

    fn embed(&self, runner: &LayerRunner<B>, ids: &[u32]) -> Result<Tensor<B, 2>, ModelError> {
        runner.embed(self.store, ids)
    }

    fn embedding_table(
        &self,
        runner: &LayerRunner<B>,
    ) -> Result<Option<EmbeddingTable<B>>, ModelError> {
        runner.upload_embedding(self.store).map(Some)
    }

    fn embed_host(
        &self,
        runner: &LayerRunner<B>,
        ids: &[u32],
        dst: &mut [half::bf16],
    ) -> Result<bool, ModelError> {
        runner.embed_bf16_into(self.store, ids, dst)?;
        Ok(true)
    }

    fn layer(&self, layer: usize) -> Result<LayerWeights, ModelError> {
        LayerWeights::load(self.store, self.config, layer)
    }
}

/// A solved linear, ready for a writer.
#[derive(Debug, Clone)]
pub enum SolvedLinear {
    /// GPTQ: AutoGPTQ `qweight/qzeros/scales/g_idx`.
    Gptq(GptqPacked),
    /// NVFP4: codes and scales, with the activation `input_scale` (amax / 2688).
    Nvfp4(Nvfp4Matrix, f32),
}

/// Receives each finished layer's tensors. `Send`: the engine hands a layer over on a thread
/// of its own while the next forward runs.
pub trait LayerSink: Send {
    /// The quantized linear `module` (module name without `.weight`).
    fn quantized(&mut self, module: &str, linear: &SolvedLinear) -> Result<(), PipelineError>;

    /// A tensor of the layer kept in 16 bits (full tensor name, f32 values); `modified` when
    /// smoothing changed it (otherwise it equals the source's tensor).
    fn kept(
        &mut self,
        name: &str,
        tensor: &HostTensor,
        modified: bool,
    ) -> Result<(), PipelineError>;
}

/// Writes into a checkpoint: quantized linears in their format, untouched tensors byte for byte
/// from the source store, smoothed ones re-encoded in their original dtype.
pub struct CheckpointSink<'a> {
    /// The output.
    pub writer: &'a mut CheckpointWriter,
    /// The input, for dtypes and raw bytes.
    pub store: &'a TensorStore,
}

impl LayerSink for CheckpointSink<'_> {
    fn quantized(&mut self, module: &str, linear: &SolvedLinear) -> Result<(), PipelineError> {
        match linear {
            SolvedLinear::Gptq(packed) => self.writer.add_gptq_linear(module, packed)?,
            SolvedLinear::Nvfp4(matrix, input_scale) => {
                self.writer.add_nvfp4_linear(module, matrix, *input_scale)?
            }
        }
        Ok(())
    }

    fn kept(
        &mut self,
        name: &str,
        tensor: &HostTensor,
        modified: bool,
    ) -> Result<(), PipelineError> {
        let info = self.store.info(name)?;
        if modified {
            self.writer
                .add_f32(name, info.dtype, &tensor.shape, &tensor.data)?;
        } else {
            self.writer
                .add_tensor(name, info.dtype, &info.shape, self.store.raw_bytes(name)?)?;
        }
        Ok(())
    }
}

/// Keeps nothing (a benchmark that writes no checkpoint).
#[derive(Debug, Default, Clone, Copy)]
pub struct Discard;

impl LayerSink for Discard {
    fn quantized(&mut self, _module: &str, _linear: &SolvedLinear) -> Result<(), PipelineError> {
        Ok(())
    }

    fn kept(
        &mut self,
        _name: &str,
        _tensor: &HostTensor,
        _modified: bool,
    ) -> Result<(), PipelineError> {
        Ok(())
    }
}
