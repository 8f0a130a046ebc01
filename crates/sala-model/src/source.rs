//! Where a decoder layer's weights come from when [`LayerRunner`](crate::LayerRunner) runs it:
//! the host ([`LayerWeights`], f32, what the quantization pipeline perturbs) or tensors the
//! caller already holds on the device ([`DeviceLayerWeights`], e.g. a training loop's
//! parameters, which must stay on the autodiff graph so that gradients reach them).
//!
//! Both go through the same graph code, so weights trained through [`DeviceLayerWeights`] mean
//! exactly what they mean when reloaded from a checkpoint into [`LayerWeights`].

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};

use crate::config::{LayerKind, SalaConfig, TensorSpec};
use crate::error::{ModelError, Result};
use crate::host::LayerWeights;

/// A decoder layer's tensors, looked up by full HF name.
pub trait LayerSource<B: Backend> {
    /// Layer index.
    fn layer(&self) -> usize;
    /// Mixer type.
    fn kind(&self) -> LayerKind;
    /// Tensor `name` (e.g. `model.layers.3.mlp.up_proj.weight`), flattened row-major, on
    /// `device`. Errors when it is missing or its shape is not `shape`.
    fn flat_tensor(&self, name: &str, shape: &[usize], device: &B::Device) -> Result<Tensor<B, 1>>;
}

fn shape_error(name: &str, found: &[usize], expected: &[usize]) -> ModelError {
    ModelError::InvalidInput(format!(
        "tensor {name} has shape {found:?}, expected {expected:?}"
    ))
}

impl<B: Backend> LayerSource<B> for LayerWeights {
    fn layer(&self) -> usize {
        self.layer
    }
    fn kind(&self) -> LayerKind {
        self.kind
    }
    fn flat_tensor(&self, name: &str, shape: &[usize], device: &B::Device) -> Result<Tensor<B, 1>> {
        let host = self.get(name)?;
        if host.shape != shape || host.data.len() != shape.iter().product::<usize>() {
            return Err(shape_error(name, &host.shape, shape));
        }
        let data = TensorData::new(host.data.clone(), vec![host.data.len()]);
        // f32 whatever the backend's default float type (the runner casts to its storage dtype).
        Ok(Tensor::from_data(data, (device, DType::F32)))
    }
}

/// One decoder layer's tensors already on the device, in the order of
/// [`SalaConfig::layer_tensor_specs`], each flattened to one dimension (the graph reshapes them
/// on use, so gradients flow back to whatever produced them).
#[derive(Debug, Clone)]
pub struct DeviceLayerWeights<B: Backend> {
    layer: usize,
    kind: LayerKind,
    specs: Vec<TensorSpec>,
    tensors: Vec<Tensor<B, 1>>,
}

impl<B: Backend> DeviceLayerWeights<B> {
    /// Pairs `tensors` with the specs of layer `layer` of `config`, checking their count and
    /// sizes.
    pub fn new(config: &SalaConfig, layer: usize, tensors: Vec<Tensor<B, 1>>) -> Result<Self> {
        if layer >= config.num_layers() {
            return Err(ModelError::InvalidInput(format!(
                "layer {layer} does not exist (the model has {})",
                config.num_layers()
            )));
        }
        let specs = config.layer_tensor_specs(layer);
        if specs.len() != tensors.len() {
            return Err(ModelError::InvalidInput(format!(
                "layer {layer} has {} tensors, {} given",
                specs.len(),
                tensors.len()
            )));
        }
        for (spec, tensor) in specs.iter().zip(&tensors) {
            let expected: usize = spec.shape.iter().product();
            if tensor.dims()[0] != expected {
                return Err(ModelError::InvalidInput(format!(
                    "tensor {} has {} values, expected {expected} ({:?})",
                    spec.name,
                    tensor.dims()[0],
                    spec.shape
                )));
            }
        }
        Ok(Self {
            layer,
            kind: config.layer_kind(layer),
            specs,
            tensors,
        })
    }
}

impl<B: Backend> LayerSource<B> for DeviceLayerWeights<B> {
    fn layer(&self) -> usize {
        self.layer
    }
    fn kind(&self) -> LayerKind {
        self.kind
    }
    fn flat_tensor(&self, name: &str, shape: &[usize], device: &B::Device) -> Result<Tensor<B, 1>> {
        let index = self
            .specs
            .iter()
            .position(|s| s.name == name)
            .ok_or_else(|| ModelError::InvalidInput(format!("layer weights lack tensor {name}")))?;
        if self.specs[index].shape != shape {
            return Err(shape_error(name, &self.specs[index].shape, shape));
        }
        Ok(self.tensors[index].clone().to_device(device))
    }
}
