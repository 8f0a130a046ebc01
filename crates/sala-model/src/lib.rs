//! `sala-model`: the MiniCPM-SALA (and Llama) decoder graph on Burn, generic over the backend.
//!
//! - [`SalaConfig`]: `config.json`, validated, with the tensor names and shapes it implies.
//! - [`TensorStore`]: memory-mapped safetensors (single file or sharded), read lazily.
//! - [`LayerWeights`] / [`HeadWeights`]: one layer's weights on the host as f32, mutable.
//! - [`LayerRunner`]: embedding, one decoder layer (one sequence or a pack of them) with a tap
//!   on every linear's input, logits.
//! - [`FastOps`]: the seam through which a backend computes heavy steps with its own kernels
//!   (`CudaFastOps` on CUDA, feature `cuda`: `sala-kernels`' attention, cuBLAS linears;
//!   [`CpuFastOps`] on burn-ndarray: faer GEMMs and fused element-wise passes on every core),
//!   tested against the graph.
//! - [`ProfiledOps`]: a [`FastOps`] wrapper that times each op between device
//!   synchronisations, switched on and off through its [`OpProfile`].
//! - [`LayerSource`]: where a layer's weights come from — host f32 or device tensors
//!   ([`DeviceLayerWeights`]: a training loop's parameters run through the same graph).
//! - [`device`]: the GPU backend `CudaBackend` (feature `cuda`; bf16 storage,
//!   [`Numerics::Bf16Storage`]) and device memory readings.
//! - [`ops`]: RMSNorm, RoPE, chunked Simple GLA, blocked causal attention, with the plain
//!   reference implementations they are tested against.
//!
//! The forward pass follows the HF reference (`modeling_minicpm_sala.py`) step by step; where
//! it rounds to bf16 is switchable ([`Numerics`]).

pub mod config;
pub mod cpu_fast;
pub mod device;
pub mod error;
pub mod fast;
pub mod host;
pub mod numerics;
pub mod ops;
pub mod profile;
pub mod runner;
pub mod source;
pub mod store;
pub mod wiring;

pub use config::{
    HeadDims, HfConfig, LayerKind, LinearSpec, ModelArch, SalaConfig, SparseConfig, TensorSpec,
    TokenIds, EMBED_TOKENS, FINAL_NORM, LM_HEAD,
};
pub use cpu_fast::CpuFastOps;
pub use device::DeviceMemory;
#[cfg(feature = "cuda")]
pub use device::{configure_cuda_runtime, cuda_memory, kernel_cache_dir, CudaBackend, CudaDevice};
pub use error::{ModelError, Result};
#[cfg(feature = "cuda")]
pub use fast::{f32_matrix_view, CudaFastOps};
pub use fast::{gram_reference, row_weights, sample_runs, sequence_offsets, FastOps, RowRun};
pub use host::{HeadWeights, HostTensor, LayerWeights};
pub use numerics::{nearest_bf16, round_to_bf16, to_f32, Numerics};
pub use profile::{OpProfile, OpTotal, ProfiledOps};
pub use runner::{
    AttentionMode, EmbeddingTable, LayerRunner, RunOptions, TapRows, HOST_EMBED_TOKENS,
};
pub use safetensors::Dtype;
pub use source::{DeviceLayerWeights, LayerSource};
pub use store::{containment_root, TensorInfo, TensorStore, INDEX_FILE, SINGLE_FILE};
pub use wiring::{input_groups, InputGroup, InputSource};
