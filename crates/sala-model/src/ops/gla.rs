//! Simple GLA (gated linear attention with a constant per-head decay), the lightning mixer.
//!
//! For head `h` with log-decay `g_h`, state `S_t = e^{g_h} S_{t-1} + k_tᵀ v_t` (`[d_k, d_v]`) and
//! output `o_t = q_t S_t` (the current token included). [`recurrent_reference`] is this loop,
//! verbatim; [`chunked`] is the parallel form used by the runner and tested against it.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};

use crate::numerics::to_f32;

/// ALiBi slopes `start^(h+1)`, `start = 2^(-8/H)`, negated: the fixed log-decays `g_h` of the
/// lightning heads (`−2^{−(h+1)/4}` for the released H = 32). `heads` must be a power of two
/// (the config validation refuses others).
pub fn log_decays(heads: usize) -> Vec<f64> {
    let start = 2f64.powf(-8.0 / heads as f64);
    // The reference computes start * start**h in Python f64, then stores f32.
    (0..heads)
        .map(|h| -((start * start.powi(h as i32)) as f32) as f64)
        .collect()
}

/// The recurrence, in f64, on row-major host slices `[tokens, heads, d]` (all of q, k, v).
/// `q` must already carry the attention scale. The test oracle for [`chunked`].
pub fn recurrent_reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    tokens: usize,
    heads: usize,
    d: usize,
    log_decays: &[f64],
) -> Vec<f32> {
    let mut out = vec![0f32; tokens * heads * d];
    for (h, &g) in log_decays.iter().enumerate().take(heads) {
        let gamma = g.exp();
        let mut state = vec![0f64; d * d];
        for t in 0..tokens {
            let row = (t * heads + h) * d;
            for s in state.iter_mut() {
                *s *= gamma;
            }
            for i in 0..d {
                for j in 0..d {
                    state[i * d + j] += k[row + i] as f64 * v[row + j] as f64;
                }
            }
            for j in 0..d {
                let acc: f64 = (0..d).map(|i| q[row + i] as f64 * state[i * d + j]).sum();
                out[row + j] = acc as f32;
            }
        }
    }
    out
}

/// Decay factors of one chunk of `len` tokens, per head, computed in f64 and stored as f32.
struct ChunkDecays<B: Backend> {
    /// `γ^{i+1}` for the state entering the chunk, `[heads, len, 1]`.
    into_queries: Tensor<B, 3>,
    /// `γ^{len-1-j}` weighting each key's contribution to the outgoing state, `[heads, len, 1]`.
    into_state: Tensor<B, 3>,
    /// `γ^{i-j}` for `j ≤ i`, else 0: the causal intra-chunk mask, `[heads, len, len]`.
    intra: Tensor<B, 3>,
    /// `γ^{len}`, `[heads, 1, 1]`.
    whole: Tensor<B, 3>,
}

impl<B: Backend> ChunkDecays<B> {
    fn new(log_decays: &[f64], len: usize, device: &B::Device) -> Self {
        let heads = log_decays.len();
        let power = |g: f64, n: usize| (g * n as f64).exp() as f32;
        let mut into_queries = Vec::with_capacity(heads * len);
        let mut into_state = Vec::with_capacity(heads * len);
        let mut intra = Vec::with_capacity(heads * len * len);
        for &g in log_decays {
            into_queries.extend((0..len).map(|i| power(g, i + 1)));
            into_state.extend((0..len).map(|j| power(g, len - 1 - j)));
            for i in 0..len {
                intra.extend((0..len).map(|j| if j <= i { power(g, i - j) } else { 0.0 }));
            }
        }
        let whole: Vec<f32> = log_decays.iter().map(|&g| power(g, len)).collect();
        let tensor = |data: Vec<f32>, shape: [usize; 3]| {
            Tensor::from_data(TensorData::new(data, shape.to_vec()), (device, DType::F32))
        };
        Self {
            into_queries: tensor(into_queries, [heads, len, 1]),
            into_state: tensor(into_state, [heads, len, 1]),
            intra: tensor(intra, [heads, len, len]),
            whole: tensor(whole, [heads, 1, 1]),
        }
    }
}

/// Chunked parallel Simple GLA over `q`, `k`, `v` `[heads, tokens, d]` (q already scaled),
/// returning `[heads, tokens, d]`. Within a chunk of `chunk` tokens the output is
/// `(q ⊙ γ^{i+1}) S + ((q kᵀ) ⊙ D) v`; the state then advances by `γ^C S + (k ⊙ γ^{C-1-j})ᵀ v`.
/// Work is `O(T·C·d + T·d²)` per head and memory `O(C² + d²)`; every power of γ is taken
/// directly (no ratios), so no term overflows however long the chunk. Computed in f32 (the
/// inputs are cast; a no-op on f32 tensors); the output is f32.
pub fn chunked<B: Backend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    log_decays: &[f64],
    chunk: usize,
) -> Tensor<B, 3> {
    let (q, k, v) = (to_f32(q), to_f32(k), to_f32(v));
    let [heads, tokens, d] = q.dims();
    let device = q.device();
    let chunk = chunk.max(1);
    let full = ChunkDecays::<B>::new(log_decays, chunk.min(tokens), &device);
    let mut state = Tensor::<B, 3>::zeros([heads, d, d], (&device, DType::F32));
    let mut outputs = Vec::with_capacity(tokens.div_ceil(chunk));
    for start in (0..tokens).step_by(chunk) {
        let end = (start + chunk).min(tokens);
        let tail;
        let decays = if end - start == chunk.min(tokens) {
            &full
        } else {
            tail = ChunkDecays::<B>::new(log_decays, end - start, &device);
            &tail
        };
        let range = [0..heads, start..end, 0..d];
        let (qc, kc, vc) = (
            q.clone().slice(range.clone()),
            k.clone().slice(range.clone()),
            v.clone().slice(range),
        );
        let from_state = (qc.clone() * decays.into_queries.clone()).matmul(state.clone());
        let scores = qc.matmul(kc.clone().swap_dims(1, 2)) * decays.intra.clone();
        outputs.push(from_state + scores.matmul(vc.clone()));
        let keys = (kc * decays.into_state.clone()).swap_dims(1, 2);
        state = state * decays.whole.clone() + keys.matmul(vc);
    }
    Tensor::cat(outputs, 1)
}
