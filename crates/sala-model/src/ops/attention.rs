//! Causal softmax attention with grouped KV heads, in query blocks so that no `T × T` score
//! matrix is ever held (a 131,072-token calibration sequence would need 64 GiB per head).

use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Tensor};

use crate::numerics::to_f32;

/// Default cap on score-matrix elements per query block (2^26 f32 = 256 MiB).
pub const DEFAULT_SCORE_BUDGET: usize = 1 << 26;

/// Causal GQA attention. `q` `[tokens, heads, d]`, `k`/`v` `[tokens, kv_heads, d]`; query head
/// `i` reads KV head `i / (heads / kv_heads)` (HF `repeat_kv`). Scores are `q·k / sqrt(d)`,
/// softmax in f32. The inputs are cast to f32 (a no-op on f32 tensors); returns `[tokens,
/// heads, d]` in f32.
///
/// Query rows are processed in blocks sized so that one block's scores
/// (`heads × block × keys`) stay within `score_budget` elements.
pub fn causal_attention<B: Backend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    score_budget: usize,
) -> Tensor<B, 3> {
    let (q, k, v) = (to_f32(q), to_f32(k), to_f32(v));
    let [tokens, heads, d] = q.dims();
    let kv_heads = k.dims()[1];
    let group = heads / kv_heads;
    let block = query_block_len(tokens, heads, score_budget);
    // [kv_heads, group, tokens, d]: the query heads sharing one KV head sit together.
    let q = q
        .reshape([tokens, kv_heads, group, d])
        .permute([1, 2, 0, 3])
        .mul_scalar(1.0 / (d as f64).sqrt());
    let k = k.swap_dims(0, 1); // [kv_heads, tokens, d]
    let v = v.swap_dims(0, 1);
    let mut blocks = Vec::with_capacity(tokens.div_ceil(block));
    for start in (0..tokens).step_by(block) {
        let end = (start + block).min(tokens);
        blocks.push(attend_block(
            q.clone().slice([0..kv_heads, 0..group, start..end, 0..d]),
            k.clone().slice([0..kv_heads, 0..end, 0..d]),
            v.clone().slice([0..kv_heads, 0..end, 0..d]),
            start,
        ));
    }
    Tensor::cat(blocks, 2)
        .permute([2, 0, 1, 3])
        .reshape([tokens, heads, d])
}

/// Query rows per block: as many as the budget allows, at least one, at most `tokens`.
fn query_block_len(tokens: usize, heads: usize, score_budget: usize) -> usize {
    (score_budget / (heads * tokens).max(1)).clamp(1, tokens.max(1))
}

/// One query block at absolute positions `start..start+rows` against keys `0..start+rows`.
/// `q` `[kv_heads, group, rows, d]`, `k`/`v` `[kv_heads, keys, d]`.
fn attend_block<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    start: usize,
) -> Tensor<B, 4> {
    let [kv_heads, group, rows, d] = q.dims();
    let keys = k.dims()[1];
    let q = q.reshape([kv_heads, group * rows, d]);
    let scores = q.matmul(k.swap_dims(1, 2)); // [kv_heads, group*rows, keys]
                                              // Row r is query position start + r; key j is visible iff j <= start + r.
    let future = Tensor::<B, 2, Bool>::tril_mask([rows, keys], start as i64, &scores.device())
        .repeat_dim(0, group)
        .unsqueeze::<3>()
        .repeat_dim(0, kv_heads);
    let probs = softmax(scores.mask_fill(future, f32::NEG_INFINITY), 2);
    probs.matmul(v).reshape([kv_heads, group, rows, d])
}

/// Naive causal GQA attention in f64 on row-major host slices (`q` `[tokens, heads, d]`,
/// `k`/`v` `[tokens, kv_heads, d]`): the full score row per query, the test oracle for
/// [`causal_attention`].
pub fn naive_reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    tokens: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
) -> Vec<f32> {
    let group = heads / kv_heads;
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0f32; tokens * heads * d];
    for t in 0..tokens {
        for h in 0..heads {
            let qrow = &q[(t * heads + h) * d..][..d];
            let kv = h / group;
            let krow = |s: usize| &k[(s * kv_heads + kv) * d..][..d];
            let scores: Vec<f64> = (0..=t)
                .map(|s| {
                    let dot: f64 = qrow
                        .iter()
                        .zip(krow(s))
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum();
                    dot * scale
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for j in 0..d {
                let acc: f64 = (0..=t)
                    .map(|s| weights[s] * v[(s * kv_heads + kv) * d + j] as f64)
                    .sum();
                out[(t * heads + h) * d + j] = (acc / total) as f32;
            }
        }
    }
    out
}
