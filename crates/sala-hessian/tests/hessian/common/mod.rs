//! Deterministic random inputs shared by the integration tests.
#![allow(dead_code)]

use proptest::prelude::Rng;
use proptest::test_runner::{RngAlgorithm, TestRng};
use sala_hessian::{Hessian, HessianAccumulator, HessianScalar, Normalization};

/// A seeded generator.
pub fn rng(seed: u8) -> TestRng {
    TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32])
}

/// Uniform in `[-1, 1)`.
pub fn uniform(rng: &mut TestRng) -> f32 {
    (rng.next_u32() >> 8) as f32 / (1u32 << 23) as f32 - 1.0
}

/// Approximately standard normal (sum of 4 uniforms, rescaled).
pub fn normal(rng: &mut TestRng) -> f32 {
    (0..4).map(|_| uniform(rng)).sum::<f32>() * (3.0f32 / 4.0).sqrt()
}

/// `n` uniform values in `[-scale, scale)`.
pub fn uniform_vec(rng: &mut TestRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| uniform(rng) * scale).collect()
}

/// Activations `[tokens, dim]` with correlated channels: `X = Z·M`, `M` a random mixing matrix
/// plus per-channel magnitudes that vary over two orders of magnitude.
pub fn correlated_activations(
    rng: &mut TestRng,
    tokens: usize,
    dim: usize,
    latent: usize,
) -> Vec<f32> {
    let mix: Vec<f32> = (0..latent * dim).map(|_| normal(rng)).collect();
    let magnitude: Vec<f32> = (0..dim).map(|_| 10f32.powf(uniform(rng))).collect();
    let mut x = vec![0.0f32; tokens * dim];
    for t in 0..tokens {
        let z: Vec<f32> = (0..latent).map(|_| normal(rng)).collect();
        for j in 0..dim {
            let v: f32 = (0..latent).map(|k| z[k] * mix[k * dim + j]).sum();
            x[t * dim + j] = v * magnitude[j] + 0.05 * normal(rng);
        }
    }
    x
}

/// The per-sample-normalized Hessian of `samples` batches of `tokens` correlated activations.
pub fn correlated_hessian<T: HessianScalar>(
    rng: &mut TestRng,
    dim: usize,
    samples: usize,
    tokens: usize,
) -> Hessian<T> {
    let mut acc = HessianAccumulator::<T>::new(dim, Normalization::PerSample).unwrap();
    for _ in 0..samples {
        let x = correlated_activations(rng, tokens, dim, dim / 4 + 1);
        acc.add_sample(&x, tokens).unwrap();
    }
    acc.finalize().unwrap()
}

/// A weight matrix `[out, inp]` with a few outliers.
pub fn weights(rng: &mut TestRng, out: usize, inp: usize) -> Vec<f32> {
    (0..out * inp)
        .map(|i| {
            let v = normal(rng) * 0.02;
            if i % 97 == 0 {
                v * 8.0
            } else {
                v
            }
        })
        .collect()
}

/// `tr(D H Dᵀ)` by a plain double loop in f64 (row-major `H`).
pub fn proxy_naive(w: &[f32], q: &[f32], inp: usize, h: &[f64]) -> f64 {
    w.chunks_exact(inp)
        .zip(q.chunks_exact(inp))
        .map(|(wr, qr)| {
            let d: Vec<f64> = wr.iter().zip(qr).map(|(&a, &b)| (a - b) as f64).collect();
            (0..inp)
                .map(|i| (0..inp).map(|j| d[i] * h[i * inp + j] * d[j]).sum::<f64>())
                .sum::<f64>()
        })
        .sum()
}

/// A symmetric `[inp, inp]` matrix with a negative eigenvalue (`1 − 50` in its leading 2×2
/// block): no damping of the schedule makes it factorable.
pub fn indefinite_hessian(inp: usize) -> Hessian<f64> {
    let mut h = vec![0.0f64; inp * inp];
    for i in 0..inp {
        h[i * inp + i] = 1.0;
    }
    h[1] = 50.0;
    h[inp] = 50.0;
    Hessian::from_row_major(inp, &h).unwrap()
}
