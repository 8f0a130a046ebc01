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

/// Powers of each head's decay γ_h = e^{g_h} used by [`chunked`], for chunks of `len` tokens
/// grouped `per_block` chunks at a time into `blocks` blocks, each computed directly as
/// `exp(g·n)` in f64 and stored as f32 (no ratios of powers, so nothing overflows; powers too
/// small for f32 become 0, as the decayed terms they weigh would).
struct DecayTables<B: Backend> {
    /// `γ^{i+1}` for the state entering the chunk, `[heads, 1, len, 1]`.
    into_queries: Tensor<B, 4>,
    /// `γ^{len-1-j}` weighting each key's contribution to the outgoing state, `[heads, 1, len, 1]`.
    into_state: Tensor<B, 4>,
    /// `γ^{i-j}` for `j ≤ i`, else 0: the causal intra-chunk mask, `[heads, 1, len, len]`.
    intra: Tensor<B, 4>,
    /// `γ^{len·(r-r')}` for `r' ≤ r`, else 0: chunk states summed within a block,
    /// `[heads, blocks, per_block, per_block]` (the same matrix for every block).
    within_block: Tensor<B, 4>,
    /// `γ^{len·(r+1)}`: the block's entering state as seen at the end of its chunk `r`,
    /// `[heads, 1, per_block, 1]`.
    from_block_start: Tensor<B, 4>,
    /// `γ^{len·per_block·(s-1-s')}` for `s' < s`, else 0: block end states carried into block
    /// `s`, `[heads, blocks, blocks]`.
    across_blocks: Tensor<B, 3>,
}

impl<B: Backend> DecayTables<B> {
    fn new(
        log_decays: &[f64],
        len: usize,
        per_block: usize,
        blocks: usize,
        device: &B::Device,
    ) -> Self {
        let heads = log_decays.len();
        let power = |g: f64, n: usize| (g * n as f64).exp() as f32;
        // `γ^{unit·(i-j)}` below (or strictly below) the diagonal of an `n × n` matrix.
        let lower = |g: f64, n: usize, unit: usize, strict: bool| {
            let mut m = Vec::with_capacity(n * n);
            for i in 0..n {
                m.extend((0..n).map(|j| match (j < i, j == i && !strict) {
                    (true, _) => power(g, unit * (i - j - usize::from(strict))),
                    (false, true) => 1.0,
                    (false, false) => 0.0,
                }));
            }
            m
        };
        let per_head =
            |f: &dyn Fn(f64) -> Vec<f32>| log_decays.iter().flat_map(|&g| f(g)).collect();
        fn tensor<B: Backend, const D: usize>(
            data: Vec<f32>,
            shape: Vec<usize>,
            device: &B::Device,
        ) -> Tensor<B, D> {
            Tensor::from_data(TensorData::new(data, shape), (device, DType::F32))
        }
        let within: Vec<f32> = per_head(&|g| lower(g, per_block, len, false).repeat(blocks));
        Self {
            into_queries: tensor(
                per_head(&|g| (0..len).map(|i| power(g, i + 1)).collect()),
                vec![heads, 1, len, 1],
                device,
            ),
            into_state: tensor(
                per_head(&|g| (0..len).map(|j| power(g, len - 1 - j)).collect()),
                vec![heads, 1, len, 1],
                device,
            ),
            intra: tensor(
                per_head(&|g| lower(g, len, 1, false)),
                vec![heads, 1, len, len],
                device,
            ),
            within_block: tensor(within, vec![heads, blocks, per_block, per_block], device),
            from_block_start: tensor(
                per_head(&|g| (0..per_block).map(|r| power(g, len * (r + 1))).collect()),
                vec![heads, 1, per_block, 1],
                device,
            ),
            across_blocks: tensor(
                per_head(&|g| lower(g, blocks, len * per_block, true)),
                vec![heads, blocks, blocks],
                device,
            ),
        }
    }
}

impl<B: Backend> DecayTables<B> {
    /// The tables of `times` sequences' heads side by side (a device copy; `times <= 1`: as is).
    fn repeated(self, times: usize) -> Self {
        if times <= 1 {
            return self;
        }
        Self {
            into_queries: self.into_queries.repeat_dim(0, times),
            into_state: self.into_state.repeat_dim(0, times),
            intra: self.intra.repeat_dim(0, times),
            within_block: self.within_block.repeat_dim(0, times),
            from_block_start: self.from_block_start.repeat_dim(0, times),
            across_blocks: self.across_blocks.repeat_dim(0, times),
        }
    }
}

/// Chunked parallel Simple GLA over `q`, `k`, `v` `[heads, tokens, d]` (q already scaled),
/// returning `[heads, tokens, d]`, in a fixed number of batched tensor operations whatever the
/// length (no loop over chunks).
///
/// The tokens are cut into `n` chunks of `chunk` tokens (the last one zero-padded: zero keys
/// and values add nothing to the state). Within chunk `c` the output is
/// `(q ⊙ γ^{i+1}) S_c + ((q kᵀ) ⊙ D) v`, with `S_c` the state entering the chunk. Each chunk's
/// own contribution `L_c = (k ⊙ γ^{C-1-j})ᵀ v` is computed for all chunks at once; the states
/// `S_c = Σ_{j<c} γ^{C(c-1-j)} L_j` come from a two-level scan written as matrix products:
/// within blocks of about `√n` chunks, then across blocks. Work is `O(T·C·d + T·d²)` per head
/// plus `O(n^{1.5}·d²)` for the scan; memory `O(T·C + (T/C)·d²)`. Every power of γ is taken
/// directly, so no term overflows however long the chunk. Computed in f32 (the inputs are
/// cast; a no-op on f32 tensors); the output is f32. `log_decays` holds one value per head;
/// when `q` has `n` times as many heads, they are `n` sequences' heads side by side and the
/// decay tables (built on the host for the distinct heads only) are repeated on the device.
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
    let len = chunk.clamp(1, tokens.max(1));
    let chunks = tokens.div_ceil(len);
    let per_block = (chunks as f64).sqrt().ceil().max(1.0) as usize;
    let blocks = chunks.div_ceil(per_block);
    let tables = DecayTables::<B>::new(log_decays, len, per_block, blocks, &device)
        .repeated(heads / log_decays.len().max(1));
    let padded = chunks * len;
    let split = |x: Tensor<B, 3>| -> Tensor<B, 4> {
        let x = if padded > tokens {
            let zeros = Tensor::zeros([heads, padded - tokens, d], (&device, DType::F32));
            Tensor::cat(vec![x, zeros], 1)
        } else {
            x
        };
        x.reshape([heads, chunks, len, d])
    };
    let (q, k, v) = (split(q), split(k), split(v));

    let scores = q.clone().matmul(k.clone().swap_dims(2, 3)) * tables.intra.clone();
    let intra = scores.matmul(v.clone());
    let own = (k * tables.into_state.clone()).swap_dims(2, 3).matmul(v); // [heads, chunks, d, d]
    let entering = entering_states(
        own.reshape([heads, chunks, d * d]),
        &tables,
        per_block,
        blocks,
    )
    .reshape([heads, chunks, d, d]);
    let out = (q * tables.into_queries.clone()).matmul(entering) + intra;
    out.reshape([heads, padded, d])
        .slice([0..heads, 0..tokens, 0..d])
}

/// The state entering each chunk, `[heads, chunks, d²]`, from each chunk's own contribution
/// `own` `[heads, chunks, d²]`: a scan within blocks of `per_block` chunks, then across the
/// `blocks` blocks, as matrix products with the decay tables.
fn entering_states<B: Backend>(
    own: Tensor<B, 3>,
    tables: &DecayTables<B>,
    per_block: usize,
    blocks: usize,
) -> Tensor<B, 3> {
    let [heads, chunks, width] = own.dims();
    let device = own.device();
    let slots = per_block * blocks;
    let own = if slots > chunks {
        let zeros = Tensor::zeros([heads, slots - chunks, width], (&device, DType::F32));
        Tensor::cat(vec![own, zeros], 1)
    } else {
        own
    };
    // State at the end of each chunk counting only the chunks of its own block.
    let within = tables
        .within_block
        .clone()
        .matmul(own.reshape([heads, blocks, per_block, width]));
    let block_ends = within
        .clone()
        .slice([0..heads, 0..blocks, per_block - 1..per_block, 0..width])
        .reshape([heads, blocks, width]);
    // The state entering each block, then at the end of every chunk.
    let carried = tables.across_blocks.clone().matmul(block_ends);
    let ends = (within + tables.from_block_start.clone() * carried.unsqueeze_dim::<4>(2))
        .reshape([heads, slots, width]);
    // The state entering chunk c is the state at the end of chunk c − 1 (zero for the first).
    let zeros = Tensor::zeros([heads, 1, width], (&device, DType::F32));
    if chunks == 1 {
        return zeros;
    }
    Tensor::cat(
        vec![zeros, ends.slice([0..heads, 0..chunks - 1, 0..width])],
        1,
    )
}
