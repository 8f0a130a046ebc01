//! Two checkpoints of one model side by side, linear by linear: how many quantization codes
//! agree and how far the scales and the dequantized weights are apart.
//!
//! The use: a GPU-solved checkpoint against a host-solved one of the same model and
//! calibration. The two solvers differ only by f32 summation orders, so their codes agree except
//! where a weight lies within rounding of a decision boundary (and, in GPTQ, the columns after
//! such a flip in the same row see a slightly different error feedback).

use serde::Serialize;

use crate::error::ExportError;
use crate::reader::Checkpoint;
use crate::writer::LinearFormat;

/// One quantized linear present in both checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LinearComparison {
    /// Module name (`model.layers.0.self_attn.q_proj`).
    pub module: String,
    /// `gptq` or `nvfp4` (the same in both).
    pub format: &'static str,
    /// Weights in the linear (`out · in`).
    pub weights: usize,
    /// GPTQ: codes equal in both (`None` for NVFP4, whose codes are compared through the
    /// dequantized weights).
    pub equal_codes: Option<usize>,
    /// GPTQ: the largest `|code_a − code_b|`.
    pub max_code_difference: Option<u8>,
    /// GPTQ: the largest `|scale_a − scale_b| / |scale_b|` over groups and rows.
    pub max_scale_relative_difference: Option<f32>,
    /// Dequantized weights bitwise equal in both.
    pub equal_weights: usize,
    /// `‖W_a − W_b‖_F / ‖W_b‖_F` of the dequantized weights (0 when both are zero).
    pub relative_weight_difference: f64,
}

impl LinearComparison {
    /// `equal_codes / weights` for GPTQ, `equal_weights / weights` otherwise (1 for an empty
    /// linear).
    pub fn equal_fraction(&self) -> f64 {
        let equal = self.equal_codes.unwrap_or(self.equal_weights);
        if self.weights == 0 {
            1.0
        } else {
            equal as f64 / self.weights as f64
        }
    }
}

/// Every selected quantized linear of two checkpoints.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Comparison {
    /// Linears quantized in both with the same format, in module order.
    pub linears: Vec<LinearComparison>,
    /// Quantized in the first checkpoint only (dense or absent in the second).
    pub only_in_first: Vec<String>,
    /// Quantized in the second checkpoint only.
    pub only_in_second: Vec<String>,
    /// Quantized in both, GPTQ in one and NVFP4 in the other.
    pub format_mismatch: Vec<String>,
}

impl Comparison {
    /// Whether both checkpoints quantize the same selected linears the same way.
    pub fn same_linears(&self) -> bool {
        self.only_in_first.is_empty()
            && self.only_in_second.is_empty()
            && self.format_mismatch.is_empty()
    }

    /// Codes (GPTQ) or dequantized weights (NVFP4) equal over every compared linear, and the
    /// weights compared.
    pub fn equal_total(&self) -> (usize, usize) {
        self.linears.iter().fold((0, 0), |(equal, total), l| {
            (
                equal + l.equal_codes.unwrap_or(l.equal_weights),
                total + l.weights,
            )
        })
    }
}

/// Compares the quantized linears of `a` and `b` whose module name `select` accepts.
///
/// Fails on a linear that cannot be read, or whose shape differs between the two (naming it).
pub fn compare_checkpoints(
    a: &Checkpoint,
    b: &Checkpoint,
    select: impl Fn(&str) -> bool,
) -> Result<Comparison, ExportError> {
    let selected = |c: &Checkpoint| -> Vec<(String, LinearFormat)> {
        c.quantized_linears()
            .into_iter()
            .filter(|(m, _)| select(m))
            .collect()
    };
    let (in_a, in_b) = (selected(a), selected(b));
    let format_in_b = |module: &str| in_b.iter().find(|(m, _)| m == module).map(|(_, f)| *f);
    let mut comparison = Comparison::default();
    for (module, format) in &in_a {
        match format_in_b(module) {
            None => comparison.only_in_first.push(module.clone()),
            Some(other) if other != *format => comparison.format_mismatch.push(module.clone()),
            Some(_) => comparison
                .linears
                .push(compare_linear(a, b, module, *format)?),
        }
    }
    comparison.only_in_second = in_b
        .iter()
        .filter(|(m, _)| !in_a.iter().any(|(n, _)| n == m))
        .map(|(m, _)| m.clone())
        .collect();
    Ok(comparison)
}

fn compare_linear(
    a: &Checkpoint,
    b: &Checkpoint,
    module: &str,
    format: LinearFormat,
) -> Result<LinearComparison, ExportError> {
    let (wa, wb) = (a.linear_weight(module)?, b.linear_weight(module)?);
    if wa.shape != wb.shape {
        return Err(ExportError::Layout {
            module: module.to_string(),
            message: format!(
                "shape {:?} in one checkpoint, {:?} in the other",
                wa.shape, wb.shape
            ),
        });
    }
    let mut comparison = LinearComparison {
        module: module.to_string(),
        format: match format {
            LinearFormat::Gptq => "gptq",
            LinearFormat::Nvfp4 => "nvfp4",
        },
        weights: wa.values.len(),
        equal_codes: None,
        max_code_difference: None,
        max_scale_relative_difference: None,
        equal_weights: wa
            .values
            .iter()
            .zip(&wb.values)
            .filter(|(x, y)| x == y)
            .count(),
        relative_weight_difference: relative_difference(&wa.values, &wb.values),
    };
    if format == LinearFormat::Gptq {
        let (codes_a, params_a) = a
            .gptq_linear(module)?
            .unpack()
            .map_err(ExportError::format(module))?;
        let (codes_b, params_b) = b
            .gptq_linear(module)?
            .unpack()
            .map_err(ExportError::format(module))?;
        if params_a.len() != params_b.len() {
            return Err(ExportError::Layout {
                module: module.to_string(),
                message: format!(
                    "{} group parameters in one checkpoint, {} in the other",
                    params_a.len(),
                    params_b.len()
                ),
            });
        }
        comparison.equal_codes = Some(codes_a.iter().zip(&codes_b).filter(|(x, y)| x == y).count());
        comparison.max_code_difference = Some(
            codes_a
                .iter()
                .zip(&codes_b)
                .map(|(x, y)| x.abs_diff(*y))
                .max()
                .unwrap_or(0),
        );
        comparison.max_scale_relative_difference = Some(
            params_a
                .iter()
                .zip(&params_b)
                .map(|(x, y)| (x.scale - y.scale).abs() / y.scale.abs().max(f32::MIN_POSITIVE))
                .fold(0.0, f32::max),
        );
    }
    Ok(comparison)
}

/// `‖a − b‖ / ‖b‖` in f64 (0 when both are zero, infinite when only `b` is).
fn relative_difference(a: &[f32], b: &[f32]) -> f64 {
    let (diff, norm) = a.iter().zip(b).fold((0.0f64, 0.0f64), |(d, n), (&x, &y)| {
        let (x, y) = (f64::from(x), f64::from(y));
        (d + (x - y) * (x - y), n + y * y)
    });
    if diff == 0.0 {
        0.0
    } else if norm == 0.0 {
        f64::INFINITY
    } else {
        (diff / norm).sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::relative_difference;

    #[test]
    fn relative_difference_is_a_norm_ratio() {
        assert_eq!(relative_difference(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert_eq!(relative_difference(&[0.0, 0.0], &[0.0, 0.0]), 0.0);
        assert!(
            (relative_difference(&[3.0, 4.0], &[0.0, 5.0]) - (10f64).sqrt() / 5.0).abs() < 1e-12
        );
        assert_eq!(relative_difference(&[1.0], &[0.0]), f64::INFINITY);
    }
}
