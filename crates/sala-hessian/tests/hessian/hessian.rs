//! The Hessian accumulator and the channel statistics against plain loops.

use crate::common;

use common::*;
use half::bf16;
use sala_hessian::reference::hessian_naive;
use sala_hessian::{
    ChannelStatsAccumulator, HessianAccumulator, HessianError, HessianScalar, Normalization,
};

/// Three samples of different lengths; one is longer than a GEMM chunk (512 tokens).
fn samples(dim: usize) -> Vec<(Vec<f32>, usize)> {
    let mut rng = rng(20);
    [37, 700, 5]
        .iter()
        .map(|&t| (correlated_activations(&mut rng, t, dim, 6), t))
        .collect()
}

fn accumulate<T: HessianScalar>(
    samples: &[(Vec<f32>, usize)],
    dim: usize,
    norm: Normalization,
) -> Vec<f64> {
    let mut acc = HessianAccumulator::<T>::new(dim, norm).unwrap();
    for (x, t) in samples {
        acc.add_sample(x, *t).unwrap();
    }
    assert_eq!(acc.samples(), samples.len() as u64);
    acc.finalize()
        .unwrap()
        .to_row_major()
        .into_iter()
        .map(Into::into)
        .collect()
}

fn assert_close(got: &[f64], expected: &[f64], rel: f64) {
    let scale = expected.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        assert!((g - e).abs() <= rel * scale, "element {i}: {g} vs {e}");
    }
}

#[test]
fn accumulator_matches_the_triple_loop() {
    let dim = 24;
    let samples = samples(dim);
    let refs: Vec<(&[f32], usize)> = samples.iter().map(|(x, t)| (x.as_slice(), *t)).collect();
    for norm in [Normalization::PerSample, Normalization::PerToken] {
        let expected = hessian_naive(&refs, dim, norm);
        assert_close(&accumulate::<f64>(&samples, dim, norm), &expected, 1e-12);
        assert_close(&accumulate::<f32>(&samples, dim, norm), &expected, 1e-5);
    }
    // The two normalizations really differ when samples have different lengths.
    let per_sample = accumulate::<f64>(&samples, dim, Normalization::PerSample);
    let per_token = accumulate::<f64>(&samples, dim, Normalization::PerToken);
    assert!((per_sample[0] - per_token[0]).abs() > 1e-6 * per_token[0].abs());
}

/// f32 chunk products summed in f64 (the pipeline's host path) against the triple loop: within
/// f32 rounding of a 512-term dot product, relative to the largest entry, on activations whose
/// channels span two decades; and far closer than the whole sum kept in f32 would need to be.
#[test]
fn f32_chunk_products_summed_in_f64_match_the_triple_loop() {
    let dim = 40;
    let mut rng = rng(21);
    // Six chunks of 512 tokens and a tail, plus a short sample.
    let samples: Vec<(Vec<f32>, usize)> = [3 * 1024 + 77, 9]
        .iter()
        .map(|&t| (correlated_activations(&mut rng, t, dim, 6), t))
        .collect();
    let refs: Vec<(&[f32], usize)> = samples.iter().map(|(x, t)| (x.as_slice(), *t)).collect();
    for norm in [Normalization::PerSample, Normalization::PerToken] {
        let expected = hessian_naive(&refs, dim, norm);
        let mut acc = HessianAccumulator::<f64>::new(dim, norm)
            .unwrap()
            .with_f32_products();
        for (x, t) in &samples {
            acc.add_sample(x, *t).unwrap();
        }
        assert_eq!(acc.tokens(), 3 * 1024 + 77 + 9);
        let got = acc.finalize().unwrap().to_row_major();
        assert_close(&got, &expected, 2e-6);
        // Symmetric, as the plain path's.
        for r in 0..dim {
            for c in 0..dim {
                assert_eq!(got[r * dim + c], got[c * dim + r]);
            }
        }
    }
}

#[test]
fn merged_partials_equal_one_accumulator() {
    let dim = 16;
    let samples = samples(dim);
    let mut left = HessianAccumulator::<f64>::new(dim, Normalization::PerSample).unwrap();
    let mut right = left.clone();
    left.add_sample(&samples[0].0, samples[0].1).unwrap();
    right.add_sample(&samples[1].0, samples[1].1).unwrap();
    right.add_sample(&samples[2].0, samples[2].1).unwrap();
    left.merge(&right).unwrap();
    assert_eq!((left.samples(), left.tokens()), (3, 742));
    let merged: Vec<f64> = left.finalize().unwrap().to_row_major();
    assert_close(
        &merged,
        &accumulate::<f64>(&samples, dim, Normalization::PerSample),
        1e-13,
    );
    let other = HessianAccumulator::<f64>::new(dim, Normalization::PerToken).unwrap();
    assert!(matches!(
        left.merge(&other),
        Err(HessianError::MergeMismatch { .. })
    ));
    let other = HessianAccumulator::<f64>::new(dim + 1, Normalization::PerSample).unwrap();
    assert!(matches!(
        left.merge(&other),
        Err(HessianError::DimensionMismatch { .. })
    ));
}

#[test]
fn bf16_batches_equal_their_f32_values() {
    let dim = 16;
    let (x, t) = samples(dim).swap_remove(0);
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let xr: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
    let mut a = HessianAccumulator::<f64>::new(dim, Normalization::PerSample).unwrap();
    let mut b = a.clone();
    a.add_sample(&xb, t).unwrap();
    b.add_sample(&xr, t).unwrap();
    assert_eq!(a.finalize().unwrap(), b.finalize().unwrap());
}

#[test]
fn channel_statistics_match_the_hessian_diagonal_and_plain_loops() {
    let dim = 20;
    let samples = samples(dim);
    for norm in [Normalization::PerSample, Normalization::PerToken] {
        let mut stats = ChannelStatsAccumulator::new(dim, norm).unwrap();
        let mut h = HessianAccumulator::<f64>::new(dim, norm).unwrap();
        for (x, t) in &samples {
            stats.add_sample(x, *t).unwrap();
            h.add_sample(x, *t).unwrap();
        }
        let stats = stats.finalize().unwrap();
        let diag = h.finalize().unwrap().diagonal();
        assert_close(&stats.mean_square, &diag, 1e-12);
        let total_tokens: usize = samples.iter().map(|s| s.1).sum();
        for j in 0..dim {
            let mut abs_max = 0.0f32;
            let mut mean_abs = 0.0f64;
            for (x, t) in &samples {
                let column: Vec<f32> = (0..*t).map(|k| x[k * dim + j].abs()).collect();
                abs_max = column.iter().fold(abs_max, |m, &v| m.max(v));
                let sum: f64 = column.iter().map(|&v| v as f64).sum();
                mean_abs += match norm {
                    Normalization::PerSample => sum / *t as f64 / samples.len() as f64,
                    Normalization::PerToken => sum / total_tokens as f64,
                };
            }
            assert_eq!(stats.abs_max[j], abs_max);
            assert!((stats.mean_abs[j] - mean_abs).abs() <= 1e-12 * mean_abs);
        }
    }
}

#[test]
fn bad_batches_are_clear_errors() {
    let dim = 8;
    let mut acc = HessianAccumulator::<f32>::new(dim, Normalization::PerSample).unwrap();
    assert!(matches!(acc.finalize(), Err(HessianError::Empty { .. })));
    let mut x = vec![0.5f32; 3 * dim];
    assert!(matches!(
        acc.add_sample(&x, 4),
        Err(HessianError::LengthMismatch { .. })
    ));
    assert!(matches!(
        acc.add_sample::<f32>(&[], 0),
        Err(HessianError::Empty { .. })
    ));
    x[2 * dim + 5] = f32::NAN;
    match acc.add_sample(&x, 3) {
        Err(HessianError::NonFinite { what, row, col, .. }) => {
            assert_eq!((what, row, col), ("activations", 2, 5))
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(acc.samples(), 0, "a rejected batch adds nothing");
    let mut stats = ChannelStatsAccumulator::new(dim, Normalization::PerSample).unwrap();
    assert!(matches!(
        stats.add_sample(&x, 3),
        Err(HessianError::NonFinite { row: 2, col: 5, .. })
    ));
    assert!(HessianAccumulator::<f64>::new(0, Normalization::PerSample).is_err());
}
