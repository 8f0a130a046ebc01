//! Rotary position embedding, NeoX "rotate-half" layout, as the HF `RotaryEmbedding`.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};

use crate::numerics::{to_f32, Numerics};

/// `cos` and `sin` tables `[positions, head_dim]` for positions `0..positions`, f32.
#[derive(Debug, Clone)]
pub struct RopeTables<B: Backend> {
    /// `cos(p · inv_freq[i mod head_dim/2])`.
    pub cos: Tensor<B, 2>,
    /// `sin(p · inv_freq[i mod head_dim/2])`.
    pub sin: Tensor<B, 2>,
}

/// `inv_freq[i] = 1 / theta^(2i / head_dim)` for `i < head_dim / 2`, in f32 like the reference.
pub fn inverse_frequencies(head_dim: usize, theta: f64) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32))
        .collect()
}

/// Host-side tables, `(cos, sin)`, each `positions * head_dim` values row-major.
///
/// The angle is `f32(p) · inv_freq[i]` in f32 and the first and second half of each row repeat
/// the same angles (`emb = cat(freqs, freqs)`), as HF computes them.
pub fn rope_tables_host(positions: usize, head_dim: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let inv_freq = inverse_frequencies(head_dim, theta);
    let mut cos = Vec::with_capacity(positions * head_dim);
    let mut sin = Vec::with_capacity(positions * head_dim);
    for p in 0..positions {
        for _half in 0..2 {
            for &f in &inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
    }
    (cos, sin)
}

impl<B: Backend> RopeTables<B> {
    /// Tables for positions `0..positions` on `device` (f32 tensors whatever the backend's
    /// default float type).
    pub fn new(positions: usize, head_dim: usize, theta: f64, device: &B::Device) -> Self {
        let (cos, sin) = rope_tables_host(positions, head_dim, theta);
        let shape = vec![positions, head_dim];
        Self {
            cos: Tensor::from_data(TensorData::new(cos, shape.clone()), (device, DType::F32)),
            sin: Tensor::from_data(TensorData::new(sin, shape), (device, DType::F32)),
        }
    }
}

impl<B: Backend> RopeTables<B> {
    /// Positions these tables cover (`0..positions`).
    pub fn positions(&self) -> usize {
        self.cos.dims()[0]
    }

    /// The rows for a pack of sequences of `lengths` tokens lying back to back, positions
    /// restarting at 0 with each sequence: `[Σ lengths, head_dim]` (a slice for one sequence,
    /// a gather otherwise). Errors when a sequence is longer than the tables.
    pub fn for_pack(&self, lengths: &[usize]) -> crate::Result<Self> {
        let longest = lengths.iter().copied().max().unwrap_or(0);
        if longest > self.positions() {
            return Err(crate::ModelError::InvalidInput(format!(
                "a sequence of {longest} tokens needs RoPE tables beyond their {} positions",
                self.positions()
            )));
        }
        let d = self.cos.dims()[1];
        if let [single] = lengths {
            return Ok(Self {
                cos: self.cos.clone().slice([0..*single, 0..d]),
                sin: self.sin.clone().slice([0..*single, 0..d]),
            });
        }
        let positions: Vec<i64> = lengths
            .iter()
            .flat_map(|&len| (0..len as i64).collect::<Vec<_>>())
            .collect();
        let index = Tensor::<B, 1, burn::tensor::Int>::from_data(
            TensorData::new(positions, [lengths.iter().sum::<usize>()]),
            &self.cos.device(),
        );
        Ok(Self {
            cos: self.cos.clone().select(0, index.clone()),
            sin: self.sin.clone().select(0, index),
        })
    }
}

/// `concat(-x[.., d/2..], x[.., ..d/2])` along the last axis of `x` `[tokens, heads, d]`.
pub fn rotate_half<B: Backend>(x: Tensor<B, 3>) -> Tensor<B, 3> {
    let [tokens, heads, d] = x.dims();
    let first = x.clone().slice([0..tokens, 0..heads, 0..d / 2]);
    let second = x.slice([0..tokens, 0..heads, d / 2..d]);
    Tensor::cat(vec![second.neg(), first], 2)
}

/// Rotates `x` `[tokens, heads, d]` at positions `0..tokens`: `x·cos + rotate_half(x)·sin`,
/// in f32 (`x` is cast first), then rounded (the reference casts back to bf16).
pub fn apply_rope<B: Backend>(
    x: Tensor<B, 3>,
    tables: &RopeTables<B>,
    numerics: Numerics,
) -> Tensor<B, 3> {
    let x = to_f32(x);
    let [tokens, _, d] = x.dims();
    let cos = tables
        .cos
        .clone()
        .slice([0..tokens, 0..d])
        .unsqueeze_dim::<3>(1);
    let sin = tables
        .sin
        .clone()
        .slice([0..tokens, 0..d])
        .unsqueeze_dim::<3>(1);
    numerics.round(x.clone() * cos + rotate_half(x) * sin)
}
