//! Tensor names, dtypes and shapes of one quantized linear in each format, from the
//! `sala-formats` structures (writing) and back (reading).
//!
//! | format | tensor | dtype | shape |
//! |---|---|---|---|
//! | GPTQ | `qweight` | I32 | `[in·bits/32, out]` |
//! | GPTQ | `qzeros` | I32 | `[groups, out·bits/32]` (v1: zero − 1) |
//! | GPTQ | `scales` | F16 | `[groups, out]` |
//! | GPTQ | `g_idx` | I32 | `[in]` |
//! | NVFP4 | `weight` | U8 | `[out, in/2]` (element 2j in the low nibble) |
//! | NVFP4 | `weight_scale` | F8_E4M3 | `[out, in/16]` |
//! | NVFP4 | `weight_scale_2` | F32 | `[]` (amax/2688, multiplies) |
//! | NVFP4 | `input_scale` | F32 | `[]` (activation amax/2688) |

use safetensors::Dtype;
use sala_formats::gptq_pack::{check_g_idx, codes_per_word};
use sala_formats::minifloat::e4m3_decode;
use sala_formats::{FormatError, GptqPacked, Nvfp4Matrix, ZeroConvention, NVFP4_BLOCK};

use crate::tensor::Tensor;
use crate::ExportError;

/// GPTQ tensor suffixes.
pub const GPTQ_QWEIGHT: &str = "qweight";
/// GPTQ zero points.
pub const GPTQ_QZEROS: &str = "qzeros";
/// GPTQ fp16 group scales.
pub const GPTQ_SCALES: &str = "scales";
/// GPTQ group index of every input column.
pub const GPTQ_G_IDX: &str = "g_idx";
/// NVFP4 packed codes (also the name of an unquantized linear's bf16 weight).
pub const NVFP4_WEIGHT: &str = "weight";
/// NVFP4 E4M3 block scales.
pub const NVFP4_WEIGHT_SCALE: &str = "weight_scale";
/// NVFP4 fp32 global weight scale.
pub const NVFP4_WEIGHT_SCALE_2: &str = "weight_scale_2";
/// NVFP4 fp32 activation scale.
pub const NVFP4_INPUT_SCALE: &str = "input_scale";

/// `module.suffix`.
pub fn tensor_name(module: &str, suffix: &str) -> String {
    format!("{module}.{suffix}")
}

/// The four GPTQ tensors of one linear; scales are cast to fp16 and must stay finite.
pub fn gptq_tensors(module: &str, p: &GptqPacked) -> Result<Vec<(String, Tensor)>, ExportError> {
    if p.zero_convention != ZeroConvention::V1 {
        return Err(ExportError::Layout {
            module: module.to_string(),
            message: "checkpoint_format \"gptq\" stores v1 zeros (zero − 1); got v2".to_string(),
        });
    }
    let per = codes_per_word(p.bits).map_err(ExportError::format(module))?;
    let (out, inp) = (p.out_features, p.in_features);
    for (what, value) in [("in features", inp), ("out features", out)] {
        if value % per != 0 {
            return Err(ExportError::Format {
                module: module.to_string(),
                source: FormatError::NotDivisible {
                    what,
                    value,
                    divisor: per,
                },
            });
        }
    }
    let groups = p.groups();
    check_g_idx(&p.g_idx, groups).map_err(ExportError::format(module))?;
    let scales_name = tensor_name(module, GPTQ_SCALES);
    check_scales(&scales_name, &p.scales, half::f16::MAX.to_f32())?;
    let name = |suffix| tensor_name(module, suffix);
    Ok(vec![
        (
            name(GPTQ_QWEIGHT),
            Tensor::from_i32(&name(GPTQ_QWEIGHT), &[inp / per, out], &p.qweight)?,
        ),
        (
            name(GPTQ_QZEROS),
            Tensor::from_i32(&name(GPTQ_QZEROS), &[groups, out / per], &p.qzeros)?,
        ),
        (
            scales_name.clone(),
            Tensor::from_f32(&scales_name, Dtype::F16, &[groups, out], &p.scales)?,
        ),
        (
            name(GPTQ_G_IDX),
            Tensor::from_i32(&name(GPTQ_G_IDX), &[inp], &p.g_idx)?,
        ),
    ])
}

/// The four NVFP4 tensors of one linear.
pub fn nvfp4_tensors(
    module: &str,
    m: &Nvfp4Matrix,
    input_scale: f32,
) -> Result<Vec<(String, Tensor)>, ExportError> {
    if m.cols % NVFP4_BLOCK != 0 {
        return Err(ExportError::Format {
            module: module.to_string(),
            source: FormatError::NotDivisible {
                what: "in features",
                value: m.cols,
                divisor: NVFP4_BLOCK,
            },
        });
    }
    let name = |suffix| tensor_name(module, suffix);
    for (suffix, v) in [
        (NVFP4_WEIGHT_SCALE_2, m.global_scale),
        (NVFP4_INPUT_SCALE, input_scale),
    ] {
        check_scales(&name(suffix), &[v], f32::MAX)?;
        if v == 0.0 {
            return Err(ExportError::InvalidScale {
                tensor: name(suffix),
                value: v,
                why: "a global scale must be positive",
            });
        }
    }
    let block_scales: Vec<f32> = m.block_scales.iter().map(|&b| e4m3_decode(b)).collect();
    check_scales(&name(NVFP4_WEIGHT_SCALE), &block_scales, f32::MAX)?;
    let scalar = |suffix, v: f32| Tensor::from_f32(&name(suffix), Dtype::F32, &[], &[v]);
    Ok(vec![
        (
            name(NVFP4_WEIGHT),
            Tensor::from_bytes(
                &name(NVFP4_WEIGHT),
                Dtype::U8,
                &[m.rows, m.cols / 2],
                m.packed.clone(),
            )?,
        ),
        (
            name(NVFP4_WEIGHT_SCALE),
            Tensor::from_bytes(
                &name(NVFP4_WEIGHT_SCALE),
                Dtype::F8_E4M3,
                &[m.rows, m.cols / NVFP4_BLOCK],
                m.block_scales.clone(),
            )?,
        ),
        (
            name(NVFP4_WEIGHT_SCALE_2),
            scalar(NVFP4_WEIGHT_SCALE_2, m.global_scale)?,
        ),
        (
            name(NVFP4_INPUT_SCALE),
            scalar(NVFP4_INPUT_SCALE, input_scale)?,
        ),
    ])
}

/// Scales must be finite, non-negative and not above `max` (fp16 overflows to inf).
fn check_scales(tensor: &str, scales: &[f32], max: f32) -> Result<(), ExportError> {
    let bad = |why| {
        move |&v: &f32| ExportError::InvalidScale {
            tensor: tensor.to_string(),
            value: v,
            why,
        }
    };
    if let Some(v) = scales.iter().find(|v| !v.is_finite()) {
        return Err(bad("not finite")(v));
    }
    if let Some(v) = scales.iter().find(|&&v| v < 0.0) {
        return Err(bad("negative")(v));
    }
    if let Some(v) = scales.iter().find(|&&v| v > max) {
        return Err(bad("overflows the on-disk dtype")(v));
    }
    Ok(())
}
