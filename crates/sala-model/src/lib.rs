//! `sala-model`: the MiniCPM-SALA (and Llama) decoder graph on Burn, generic over the backend.
//!
//! - [`SalaConfig`]: `config.json`, validated, with the tensor names and shapes it implies.
//! - [`TensorStore`]: memory-mapped safetensors (single file or sharded), read lazily.
//! - [`LayerWeights`] / [`HeadWeights`]: one layer's weights on the host as f32, mutable.
//! - [`LayerRunner`]: embedding, one decoder layer with a tap on every linear's input, logits.
//! - [`ops`]: RMSNorm, RoPE, chunked Simple GLA, blocked causal attention, with the plain
//!   reference implementations they are tested against.
//!
//! The forward pass follows the HF reference (`modeling_minicpm_sala.py`) step by step; where
//! it rounds to bf16 is switchable ([`Numerics`]).

pub mod config;
pub mod error;
pub mod host;
pub mod numerics;
pub mod ops;
pub mod runner;
pub mod store;
pub mod wiring;

pub use config::{
    HeadDims, HfConfig, LayerKind, LinearSpec, ModelArch, SalaConfig, SparseConfig, TensorSpec,
    TokenIds, EMBED_TOKENS, FINAL_NORM, LM_HEAD,
};
pub use error::{ModelError, Result};
pub use host::{HeadWeights, HostTensor, LayerWeights};
pub use numerics::{round_to_bf16, Numerics};
pub use runner::{AttentionMode, LayerRunner, RunOptions};
pub use safetensors::Dtype;
pub use store::{TensorInfo, TensorStore, INDEX_FILE, SINGLE_FILE};
pub use wiring::{input_groups, InputGroup, InputSource};
