//! The quantizers an α search scores its candidates with ([`sala_smooth::search_alpha`]):
//! round to nearest on the linear's own format, no solver, as AWQ scores its grid.

use crate::plan::Treatment;
use rayon::prelude::*;
use sala_formats::minifloat::{e2m1_decode, e2m1_encode_fast};
use sala_formats::nvfp4::{block_divisor, global_scale_from_amax, max_block_scale};
use sala_formats::{IntQuantizer, IntScheme, NVFP4_BLOCK};

/// `Σ c_j (Q(x_ij) − x_ij)²` of a row-major `[rows, cols]` matrix quantized as `treatment` says
/// by round to nearest (`scheme`: the INT grid's); 0 for a linear kept in 16 bits; `+∞` when
/// the matrix cannot be quantized (a non-finite value, a bit width the grid refuses).
pub fn round_to_nearest_error(
    treatment: &Treatment,
    scheme: IntScheme,
    x: &[f32],
    cols: usize,
    column_weights: &[f32],
) -> f64 {
    if x.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    match *treatment {
        Treatment::Int { bits, group_size } => match IntQuantizer::new(bits, scheme) {
            Ok(quantizer) => int_error(quantizer, group_size, x, cols, column_weights),
            Err(_) => f64::INFINITY,
        },
        Treatment::Nvfp4 => nvfp4_error(x, cols, column_weights),
        Treatment::Keep { .. } => 0.0,
    }
}

/// Group-wise INT round to nearest on each group's min/max range.
fn int_error(quantizer: IntQuantizer, group_size: usize, x: &[f32], cols: usize, c: &[f32]) -> f64 {
    let group_size = group_size.clamp(1, cols.max(1));
    x.par_chunks(cols)
        .map(|row| {
            row.chunks(group_size)
                .zip(c.chunks(group_size))
                .map(|(group, c)| {
                    let p = quantizer.params_for(group);
                    group
                        .iter()
                        .zip(c)
                        .map(|(&v, &c)| weighted_square(c, quantizer.fake_quantize(v, p) - v))
                        .sum::<f64>()
                })
                .sum::<f64>()
        })
        .sum()
}

/// NVFP4 with the matrix's own global scale and max-calibrated block scales.
fn nvfp4_error(x: &[f32], cols: usize, c: &[f32]) -> f64 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let Ok(global) = global_scale_from_amax(amax) else {
        return f64::INFINITY;
    };
    if cols % NVFP4_BLOCK != 0 {
        return f64::INFINITY;
    }
    x.par_chunks(cols)
        .map(|row| {
            row.chunks_exact(NVFP4_BLOCK)
                .zip(c.chunks_exact(NVFP4_BLOCK))
                .map(|(block, c)| {
                    let block_amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let d = block_divisor(max_block_scale(block_amax, global), global);
                    block
                        .iter()
                        .zip(c)
                        .map(|(&v, &c)| {
                            weighted_square(c, e2m1_decode(e2m1_encode_fast(v / d)) * d - v)
                        })
                        .sum::<f64>()
                })
                .sum::<f64>()
        })
        .sum()
}

fn weighted_square(c: f32, e: f32) -> f64 {
    c as f64 * (e as f64) * (e as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sala_formats::{quantize_groupwise, BlockScales, Nvfp4Matrix};

    fn matrix(rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|i| ((i * 2654435761usize % 1000) as f32 / 500.0 - 1.0) * 0.3)
            .collect()
    }

    fn reference(w: &[f32], q: &[f32], cols: usize, c: &[f32]) -> f64 {
        w.iter()
            .zip(q)
            .enumerate()
            .map(|(i, (&a, &b))| c[i % cols] as f64 * ((b - a) as f64).powi(2))
            .sum()
    }

    #[test]
    fn int_error_is_the_groupwise_codec_s() {
        let (rows, cols) = (6, 40);
        let w = matrix(rows, cols);
        let c: Vec<f32> = (0..cols).map(|j| 1.0 + j as f32 * 0.1).collect();
        let quantizer = IntQuantizer::new(4, IntScheme::SymmetricIst).unwrap();
        let q = quantize_groupwise(&w, rows, cols, 16, quantizer)
            .unwrap()
            .dequantize();
        let treatment = Treatment::Int {
            bits: 4,
            group_size: 16,
        };
        let got = round_to_nearest_error(&treatment, IntScheme::SymmetricIst, &w, cols, &c);
        let want = reference(&w, &q, cols, &c);
        assert!(
            (got - want).abs() <= 1e-9 * want.max(1.0),
            "{got} vs {want}"
        );
    }

    #[test]
    fn nvfp4_error_is_the_codec_s() {
        let (rows, cols) = (5, 64);
        let w = matrix(rows, cols);
        let c: Vec<f32> = (0..cols).map(|j| 0.5 + (j % 7) as f32).collect();
        let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let global = global_scale_from_amax(amax).unwrap();
        let q = Nvfp4Matrix::quantize(&w, rows, cols, global, BlockScales::Max)
            .unwrap()
            .dequantize();
        let got = round_to_nearest_error(&Treatment::Nvfp4, IntScheme::SymmetricIst, &w, cols, &c);
        let want = reference(&w, &q, cols, &c);
        assert!(
            (got - want).abs() <= 1e-9 * want.max(1.0),
            "{got} vs {want}"
        );
    }

    #[test]
    fn unquantizable_input_scores_infinity() {
        let mut w = matrix(2, 32);
        w[3] = f32::NAN;
        let c = vec![1.0; 32];
        let e = round_to_nearest_error(&Treatment::Nvfp4, IntScheme::SymmetricIst, &w, 32, &c);
        assert_eq!(e, f64::INFINITY);
    }
}
