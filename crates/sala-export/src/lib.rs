//! # sala-export
//!
//! Checkpoints that SGLang and vLLM load as they are, and a verifier that proves it.
//!
//! - [`CheckpointWriter`] streams tensors (one layer at a time) into safetensors shards of a
//!   bounded size inside a staging directory next to the target, then writes the index, the
//!   config files and the source model's tokenizer files; the staged checkpoint can be verified
//!   and given more files ([`StagedCheckpoint`]) before it is renamed into place. One output
//!   is written by one run at a time (a lock), `overwrite` replaces only a checkpoint and only
//!   once the new one is in place, and what interrupted runs leave is removed ([`StagedDir`],
//!   [`remove_staging_on_interrupt`]).
//!   It writes both layouts: AutoGPTQ v1 for `gptq_marlin` ([`CheckpointWriter::add_gptq_linear`])
//!   and ModelOpt NVFP4 ([`CheckpointWriter::add_nvfp4_linear`]).
//! - [`config`]: the quantization configs (GPTQ with `dynamic` mixed precision; NVFP4's
//!   `hf_quant_config.json` and flat `quantization_config` with both `ignore` and
//!   `exclude_modules`).
//! - [`Checkpoint`] reads an exported directory back: packed linears and dequantized f32 weights.
//! - [`verify`] checks a directory against the loaders' rules and lists every violation by
//!   tensor name ([`VerifyReport`]); [`verify_for`] applies another [`loaders::LoaderTarget`]'s
//!   shape rules (GPTQ for the torch kernels: a partial last group allowed) and the report says
//!   which [`loaders::GptqLoader`]s accept the checkpoint.
//! - [`compare`] sets two checkpoints of one model side by side, linear by linear (codes,
//!   scales, dequantized weights): a GPU-solved run against a host-solved one.
//!
//! Tensor layouts per format are in [`layout`]; the fused q/k/v and gate/up groups in
//! [`modules`]. See `docs/formats.md` ("Checkpoint formats on disk") for the files in one place.

pub mod compare;
pub mod config;
mod error;
mod interrupt;
pub mod layout;
pub mod loaders;
pub mod modules;
mod reader;
mod shards;
mod staging;
mod tensor;
mod verify;
mod writer;

pub use config::{DynamicOverride, GptqConfig, ModulePrecision, Nvfp4Config, QuantizationConfig};
pub use error::ExportError;
pub use interrupt::remove_staging_on_interrupt;
pub use reader::{Checkpoint, CheckpointFormat, DenseTensor};
pub use safetensors::Dtype;
pub use shards::{
    FlushedShard, ShardIndex, ShardLayout, DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, SINGLE_FILE,
};
pub use staging::{
    check_output, find_resumable, is_checkpoint_dir, recover_output, recover_output_with,
    StagedDir, StaleStaging, REPORT_FILE, RESUME_DIR, RESUME_MANIFEST,
};
pub use tensor::{byte_len, decode_f32, encode_f32, Tensor};
pub use verify::{
    verify, verify_for, Rule, Summary, VerifyReport, Violation, MARLIN_MIN_IN, MARLIN_MIN_OUT,
};
pub use writer::{
    CheckpointWriter, LinearFormat, StagedCheckpoint, WriterOptions, WriterState,
    WrittenCheckpoint, SIDE_FILES,
};
