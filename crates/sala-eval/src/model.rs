//! A checkpoint directory loaded once (every layer dequantized to f32 on the host) and run
//! through `sala-model`'s layer runner.

use crate::error::EvalError;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use sala_gptq::evaluate::{checkpoint_head, checkpoint_layer};
use sala_gptq::export::Checkpoint;
use sala_gptq::model::{HeadWeights, LayerRunner, LayerWeights, SalaConfig, TensorStore};
use std::path::{Path, PathBuf};

/// The `config.json` of a model directory.
pub fn read_config(dir: &Path) -> Result<SalaConfig, EvalError> {
    Ok(SalaConfig::from_file(&dir.join("config.json"))?)
}

/// The ids of `text` under the tokenizer of the model in `dir`, without special tokens.
pub fn tokenize(dir: &Path, text: &str) -> Result<Vec<u32>, EvalError> {
    let tokenizer = sala_gptq::calib::CalibTokenizer::from_model_dir(dir)?;
    let encoding = tokenizer
        .tokenizer()
        .encode(text, false)
        .map_err(|e| EvalError::InvalidInput(format!("{}: tokenizing: {e}", dir.display())))?;
    Ok(encoding.get_ids().to_vec())
}

/// A model (original or quantized, GPTQ or NVFP4) with all its weights on the host.
pub struct LoadedModel {
    dir: PathBuf,
    format: &'static str,
    store: TensorStore,
    layers: Vec<LayerWeights>,
    head: HeadWeights,
}

impl LoadedModel {
    /// Reads the checkpoint in `dir` through `sala-export`'s reader, with the shapes of `config`
    /// (the original model's; a quantized checkpoint of another model is refused).
    pub fn open(dir: &Path, config: &SalaConfig) -> Result<Self, EvalError> {
        let checkpoint = Checkpoint::open(dir)?;
        let layers = (0..config.num_layers())
            .map(|layer| checkpoint_layer(&checkpoint, config, layer))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            dir: dir.to_path_buf(),
            format: checkpoint.format().name(),
            store: TensorStore::open(dir)?,
            head: checkpoint_head(&checkpoint, config)?,
            layers,
        })
    }

    /// The directory it was read from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// `"gptq"`, `"nvfp4"` or `"unquantized"`.
    pub fn format(&self) -> &'static str {
        self.format
    }
    /// The decoder layers' weights.
    pub fn layers(&self) -> &[LayerWeights] {
        &self.layers
    }
    /// The decoder layers' weights, to perturb them.
    pub fn layers_mut(&mut self) -> &mut [LayerWeights] {
        &mut self.layers
    }

    /// Layer-0 input `[ids.len(), hidden]`.
    pub fn embed<B: Backend>(
        &self,
        runner: &LayerRunner<B>,
        ids: &[u32],
    ) -> Result<Tensor<B, 2>, EvalError> {
        Ok(runner.embed(&self.store, ids)?)
    }

    /// Logits `[ids.len(), vocab]`.
    pub fn logits<B: Backend>(
        &self,
        runner: &LayerRunner<B>,
        ids: &[u32],
    ) -> Result<Tensor<B, 2>, EvalError> {
        let mut hidden = self.embed(runner, ids)?;
        for weights in &self.layers {
            hidden = runner.run_layer(weights, hidden, |_, _, _| {})?;
        }
        Ok(runner.logits(&self.head, hidden)?)
    }
}

/// A tensor's values as f32, row-major.
pub fn host_values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Result<Vec<f32>, EvalError> {
    t.into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| EvalError::InvalidInput(format!("reading a tensor back: {e:?}")))
}
