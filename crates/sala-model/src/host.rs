//! Weights on the host as plain f32: one decoder layer at a time, mutable by the caller
//! (smoothing folds scales into them, quantization replaces linears by dequantized values).

use std::collections::BTreeMap;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};

use crate::config::{LayerKind, SalaConfig, FINAL_NORM};
use crate::error::{ModelError, Result};
use crate::store::TensorStore;

/// An owned row-major f32 tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Dimensions, outermost first (a linear weight is `[out, in]`).
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values, row-major.
    pub data: Vec<f32>,
}

impl HostTensor {
    /// Wraps `data`; panics if its length does not match `shape` (a programming error).
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "HostTensor: data length does not match shape {shape:?}"
        );
        Self { shape, data }
    }

    /// Index of the first NaN or infinite value, if any.
    pub fn first_non_finite(&self) -> Option<usize> {
        self.data.iter().position(|v| !v.is_finite())
    }

    /// Copies the values to a `D`-dimensional tensor on `device` in the backend's default float
    /// dtype; the rank must match.
    pub fn to_tensor<B: Backend, const D: usize>(&self, device: &B::Device) -> Tensor<B, D> {
        Tensor::from_data(
            TensorData::new(self.data.clone(), self.shape.clone()),
            device,
        )
    }

    /// Copies the values to a `D`-dimensional tensor of `dtype` (a float dtype, converted on the
    /// host) on `device`; the rank must match.
    pub fn to_tensor_as<B: Backend, const D: usize>(
        &self,
        device: &B::Device,
        dtype: DType,
    ) -> Tensor<B, D> {
        Tensor::from_data(
            TensorData::new(self.data.clone(), self.shape.clone()),
            (device, dtype),
        )
    }
}

/// The tensors of one decoder layer, keyed by full HF name (`model.layers.3.mlp.up_proj.weight`).
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// Layer index.
    pub layer: usize,
    /// Mixer type.
    pub kind: LayerKind,
    /// Norm and linear weights, f32.
    pub tensors: BTreeMap<String, HostTensor>,
}

impl LayerWeights {
    /// Loads layer `layer` from `store`, checking names, shapes, dtypes and finiteness.
    pub fn load(store: &TensorStore, config: &SalaConfig, layer: usize) -> Result<Self> {
        if layer >= config.num_layers() {
            return Err(ModelError::InvalidInput(format!(
                "layer {layer} does not exist (the model has {})",
                config.num_layers()
            )));
        }
        let specs = config.layer_tensor_specs(layer);
        store.check_specs(&specs)?;
        let mut tensors = BTreeMap::new();
        for spec in specs {
            let tensor = load_finite(store, &spec.name)?;
            tensors.insert(spec.name, tensor);
        }
        Ok(Self {
            layer,
            kind: config.layer_kind(layer),
            tensors,
        })
    }

    /// Tensor `name` (full name), or an error naming it.
    pub fn get(&self, name: &str) -> Result<&HostTensor> {
        self.tensors
            .get(name)
            .ok_or_else(|| ModelError::InvalidInput(format!("layer weights lack tensor {name}")))
    }

    /// Mutable tensor `name` (full name), or an error naming it.
    pub fn get_mut(&mut self, name: &str) -> Result<&mut HostTensor> {
        self.tensors
            .get_mut(name)
            .ok_or_else(|| ModelError::InvalidInput(format!("layer weights lack tensor {name}")))
    }
}

/// The weights after the last decoder layer: final norm `[hidden]` and `lm_head` `[vocab, hidden]`.
#[derive(Debug, Clone)]
pub struct HeadWeights {
    /// `model.norm.weight`.
    pub final_norm: HostTensor,
    /// `lm_head.weight`, or the embedding matrix when tied.
    pub lm_head: HostTensor,
}

impl HeadWeights {
    /// Loads the final norm and the output projection, checked against the config.
    pub fn load(store: &TensorStore, config: &SalaConfig) -> Result<Self> {
        store.check_specs(&config.global_tensor_specs())?;
        Ok(Self {
            final_norm: load_finite(store, FINAL_NORM)?,
            lm_head: load_finite(store, config.lm_head_name())?,
        })
    }
}

/// Reads `name` as f32 and refuses NaN / Inf, which would silently poison every Hessian.
pub(crate) fn load_finite(store: &TensorStore, name: &str) -> Result<HostTensor> {
    let tensor = store.to_f32(name)?;
    match tensor.first_non_finite() {
        None => Ok(tensor),
        Some(index) => Err(ModelError::NonFinite {
            path: store.info(name)?.file,
            tensor: name.to_owned(),
            index,
        }),
    }
}
