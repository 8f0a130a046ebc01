//! # sala-formats
//!
//! Number formats and bit packing for post-training quantization, bit-exact with the Python
//! reference tools and the SGLang / vLLM loaders:
//!
//! - [`minifloat`]: E2M1 (FP4), FP8 E4M3FN and FP8 E5M2, round-to-nearest-even with saturation;
//! - [`int`]: 2–8 bit integer grids (two symmetric variants and asymmetric), group-wise RTN;
//! - [`nvfp4`]: the ModelOpt NVFP4 block codec (E2M1 codes, E4M3 block scales, FP32 global scale);
//! - [`gptq_pack`]: the AutoGPTQ int32 packing (`qweight`, `qzeros` v1/v2, `scales`, `g_idx`)
//!   and the compressed-tensors transposed view.
//!
//! Matrices are row-major `[rows, cols]` = `[out_features, in_features]` slices with explicit
//! shapes; every shape rule is checked and reported through [`FormatError`]. The crate has no
//! threads of its own: row-range functions such as [`nvfp4::quantize_rows_into`] let callers
//! parallelise.
//! See `docs/formats.md` in the repository for the formats in one table.

mod error;
pub mod gptq_pack;
pub mod int;
pub mod minifloat;
pub mod nvfp4;
mod shape;

pub use error::FormatError;
pub use gptq_pack::{GptqPacked, ZeroConvention};
pub use int::{
    quantize_groupwise, quantize_groupwise_searched, ClipSearch, IntGroupQuantized, IntQuantizer,
    IntScheme, QuantParams,
};
pub use minifloat::{MiniFloat, E2M1, E4M3FN, E5M2};
pub use nvfp4::{BlockScales, Nvfp4Matrix, NVFP4_BLOCK};
