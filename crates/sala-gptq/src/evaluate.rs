//! Running a model whose weights come from an exported checkpoint (either format, dequantized by
//! `sala-export`'s reader), so a quantized model can be compared with its original.

use crate::error::PipelineError;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use sala_export::Checkpoint;
use sala_model::{
    HeadWeights, HostTensor, LayerRunner, LayerWeights, SalaConfig, TensorStore, FINAL_NORM,
    LM_HEAD,
};
use std::collections::BTreeMap;

/// Decoder layer `layer` of `checkpoint` as f32 host weights: linears dequantized, norms decoded.
pub fn checkpoint_layer(
    checkpoint: &Checkpoint,
    config: &SalaConfig,
    layer: usize,
) -> Result<LayerWeights, PipelineError> {
    let linears: Vec<String> = config
        .linear_specs(layer)
        .into_iter()
        .map(|s| s.weight_name())
        .collect();
    let mut tensors = BTreeMap::new();
    for spec in config.layer_tensor_specs(layer) {
        let dense = if linears.contains(&spec.name) {
            checkpoint.linear_weight(spec.name.trim_end_matches(".weight"))?
        } else {
            checkpoint.tensor_f32(&spec.name)?
        };
        if dense.shape != spec.shape {
            return Err(PipelineError::Model(sala_model::ModelError::InvalidInput(
                format!(
                    "{}: {} has shape {:?}, the config expects {:?}",
                    checkpoint.dir().display(),
                    spec.name,
                    dense.shape,
                    spec.shape
                ),
            )));
        }
        tensors.insert(spec.name, HostTensor::new(dense.shape, dense.values));
    }
    Ok(LayerWeights {
        layer,
        kind: config.layer_kind(layer),
        tensors,
    })
}

/// Final norm and output projection of `checkpoint` (the embedding when tied).
pub fn checkpoint_head(
    checkpoint: &Checkpoint,
    config: &SalaConfig,
) -> Result<HeadWeights, PipelineError> {
    let dense = |d: sala_export::DenseTensor| HostTensor::new(d.shape, d.values);
    let lm_head = if config.tie_word_embeddings() {
        sala_model::EMBED_TOKENS
    } else {
        LM_HEAD
    };
    Ok(HeadWeights {
        final_norm: dense(checkpoint.tensor_f32(FINAL_NORM)?),
        lm_head: dense(checkpoint.linear_weight(lm_head.trim_end_matches(".weight"))?),
    })
}

/// Logits `[ids.len(), vocab]` of the model stored in `checkpoint` (quantized or not), loading
/// one layer at a time.
pub fn checkpoint_logits<B: Backend>(
    runner: &LayerRunner<B>,
    checkpoint: &Checkpoint,
    ids: &[u32],
) -> Result<Tensor<B, 2>, PipelineError> {
    let config = runner.config();
    let store = TensorStore::open(checkpoint.dir())?;
    let mut hidden = runner.embed(&store, ids)?;
    for layer in 0..config.num_layers() {
        let weights = checkpoint_layer(checkpoint, config, layer)?;
        hidden = runner.run_layer(&weights, hidden, |_, _, _| {})?;
    }
    Ok(runner.logits(&checkpoint_head(checkpoint, config)?, hidden)?)
}
