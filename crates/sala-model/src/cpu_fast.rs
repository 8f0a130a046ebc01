//! [`FastOps`] on the CPU backend (burn-ndarray): a layer's products and fused element-wise
//! steps on every core.
//!
//! Why: burn-ndarray runs each element-wise op as its own single-threaded pass (and a strided
//! copy where a view is not contiguous), so a calibration forward on 2 cores kept about 1.3 of
//! them busy. Here a linear is one faer GEMM with the rounding fused into the same parallel
//! pass; SwiGLU, the sigmoid gates, RMSNorm, the scaled residual adds and the per-head
//! RMSNorm + RoPE are one parallel pass each; causal attention runs (sequence, head) pairs in
//! parallel, each in query blocks that skip the masked triangle; Simple GLA runs the same pairs
//! chunk by chunk with the state carried. Inputs are read in place where the array is
//! contiguous. Each op computes what the graph computes (same formulas, f32, the same rounding
//! points); summation orders differ in the products and the norms' mean squares, `exp` is
//! `sala-cpu`'s eight-lane one (within 1 ulp of libm's), and the sigmoid is `1/(1 + e^−x)` as
//! PyTorch computes it (burn's `exp(−ln(1 + e^−x))` costs three libm calls per value). The tests
//! compare every op with the graph (and GLA with the recurrence). After every faer product the
//! upper vector state is cleared (`sala-cpu` says why: without it the `exp`/`ln` calls after
//! a GEMM ran up to 20× slower on AVX-512 Xeons).

use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};
use burn_ndarray::{NdArray, NdArrayTensor};
use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use rayon::prelude::*;

use crate::error::{ModelError, Result};
use crate::fast::{sequence_offsets, FastOps};
use crate::numerics::Numerics;

/// The CPU backend these ops run on.
type Cpu = NdArray<f32>;

/// Values per parallel chunk of the element-wise passes.
const CHUNK: usize = 1 << 14;

/// [`FastOps`] for burn-ndarray, rounding where `numerics` rounds ([`Numerics::F32`]: nowhere;
/// [`Numerics::Bf16Rounding`]: to bf16 after each step, as the graph does).
#[derive(Debug, Clone, Copy)]
pub struct CpuFastOps {
    numerics: Numerics,
}

impl CpuFastOps {
    /// Ops that round as `numerics` does (the runner's [`crate::RunOptions::numerics`]).
    /// [`Numerics::Bf16Storage`] has no CPU tensors (the runner refuses it), so it is treated
    /// like [`Numerics::Bf16Rounding`].
    pub fn new(numerics: Numerics) -> Self {
        Self { numerics }
    }

    /// Whether values are rounded to bf16 between steps.
    fn rounds(&self) -> bool {
        !matches!(self.numerics, Numerics::F32)
    }

    /// `v` rounded as the numerics say.
    #[inline]
    fn round(&self, v: f32) -> f32 {
        if self.rounds() {
            crate::numerics::nearest_bf16(v)
        } else {
            v
        }
    }

    /// Every value rounded as the numerics say, in place on every core.
    fn round_all(&self, values: &mut [f32]) {
        if self.rounds() {
            values.par_chunks_mut(CHUNK).for_each(|chunk| {
                for v in chunk {
                    *v = self.round(*v);
                }
            });
        }
    }

    /// One row of RMSNorm in place, as the graph computes it: the mean square and the division
    /// in f32, `round(round(x / √(mean(x²) + eps)) · w)`.
    fn rms_norm_row(&self, row: &mut [f32], weight: &[f32], eps: f32) {
        let mean_square = row.iter().map(|&v| v * v).sum::<f32>() / row.len().max(1) as f32;
        let rms = (mean_square + eps).sqrt();
        for (v, &w) in row.iter_mut().zip(weight) {
            *v = self.round(self.round(*v / rms) * w);
        }
    }

    /// RoPE of every head row of `x` `[tokens, heads, d]` at positions restarting with each
    /// sequence of `lengths`, read from `cos`, `sin` `[positions, d]`, after an RMSNorm of the
    /// row with `(weight, eps)` where `norm` is given: one parallel pass over the tokens.
    fn rotate_heads(
        &self,
        x: &Tensor<Cpu, 3>,
        norm: Option<(&[f32], f32)>,
        cos: &Tensor<Cpu, 2>,
        sin: &Tensor<Cpu, 2>,
        lengths: &[usize],
    ) -> Result<Tensor<Cpu, 3>> {
        let [tokens, heads, d] = x.dims();
        let [positions, table_d] = cos.dims();
        let longest = lengths.iter().copied().max().unwrap_or(0);
        let shapes_agree = d % 2 == 0
            && cos.dims() == sin.dims()
            && table_d == d
            && longest <= positions
            && lengths.iter().sum::<usize>() == tokens;
        if !shapes_agree {
            return Err(ModelError::InvalidInput(format!(
                "rope: x {:?}, tables {:?} for sequences of {lengths:?} tokens",
                x.dims(),
                cos.dims()
            )));
        }
        let positions: Vec<usize> = lengths.iter().flat_map(|&len| 0..len).collect();
        let mut values = host_values(x);
        // The tables are read in place (they cover the longest sequence: up to 131,072 rows).
        with_values(cos, |cos| {
            with_values(sin, |sin| {
                values
                    .par_chunks_mut((heads * d).max(1))
                    .zip(positions.par_iter())
                    .for_each_init(
                        || vec![0.0f32; d],
                        |input, (token, &p)| {
                            let (cos, sin) = (&cos[p * d..][..d], &sin[p * d..][..d]);
                            for row in token.chunks_exact_mut(d.max(1)) {
                                if let Some((weight, eps)) = norm {
                                    self.rms_norm_row(row, weight, eps);
                                }
                                input.copy_from_slice(row);
                                // x·cos + rotate_half(x)·sin, rotate_half(x) = [−x₂, x₁].
                                let half = d / 2;
                                for (i, out) in row.iter_mut().enumerate() {
                                    let rotated = if i < half {
                                        -input[i + half]
                                    } else {
                                        input[i - half]
                                    };
                                    *out = self.round(input[i] * cos[i] + rotated * sin[i]);
                                }
                            }
                        },
                    )
            })
        });
        Ok(from_values(values, [tokens, heads, d], x))
    }

    /// `f(out, a, b)` over matching chunks of two tensors of one shape (each chunk's output
    /// written by `f`), on every core.
    fn zip_map(
        &self,
        a: &Tensor<Cpu, 2>,
        b: &Tensor<Cpu, 2>,
        what: &str,
        f: impl Fn(&mut [f32], &[f32], &[f32]) + Sync,
    ) -> Result<Tensor<Cpu, 2>> {
        if a.dims() != b.dims() {
            return Err(ModelError::InvalidInput(format!(
                "{what}: shapes {:?} and {:?} differ",
                a.dims(),
                b.dims()
            )));
        }
        let out = with_values(a, |a| {
            with_values(b, |b| {
                let mut out = zeros(a.len());
                out.par_chunks_mut(CHUNK)
                    .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
                    .for_each(|(o, (a, b))| f(o, a, b));
                out
            })
        });
        Ok(from_values(out, a.dims(), a))
    }
}

/// The row-major `[len, d]` view of head `head`'s rows `start..start + len` in a packed
/// `[tokens, width, d]` tensor's values (rows `width·d` apart): no copy.
fn head_rows(
    values: &[f32],
    start: usize,
    len: usize,
    width: usize,
    head: usize,
    d: usize,
) -> MatRef<'_, f32> {
    if len == 0 {
        return MatRef::from_column_major_slice(&[], d, 0).transpose();
    }
    let at = (start * width + head) * d;
    MatRef::from_column_major_slice_with_stride(&values[at..], d, len, width * d).transpose()
}

/// `head(start, len, h)` for every (sequence, head) pair of a pack of sequences of `lengths`
/// tokens, in parallel, each giving that head's rows `[len, d]`; laid out as
/// `[Σ lengths, heads, d]`.
fn for_each_sequence_head(
    lengths: &[usize],
    heads: usize,
    d: usize,
    head: impl Fn(usize, usize, usize) -> Vec<f32> + Sync,
) -> Vec<f32> {
    let offsets = sequence_offsets(lengths);
    let pairs: Vec<(usize, usize)> = (0..lengths.len())
        .flat_map(|s| (0..heads).map(move |h| (s, h)))
        .collect();
    let blocks: Vec<Vec<f32>> = pairs
        .par_iter()
        .map(|&(s, h)| head(offsets[s], lengths[s], h))
        .collect();
    let tokens = offsets.last().copied().unwrap_or(0);
    // Laid out token by token on every core: token `t` of sequence `s` (row `t − offsets[s]`
    // of its blocks) gathers one row of `d` from each head's block.
    let sequence_of: Vec<usize> = lengths
        .iter()
        .enumerate()
        .flat_map(|(s, &len)| std::iter::repeat_n(s, len))
        .collect();
    let mut out = zeros(tokens * heads * d);
    out.par_chunks_mut((heads * d).max(1))
        .zip(sequence_of.par_iter())
        .enumerate()
        .for_each(|(t, (row, &s))| {
            let i = t - offsets[s];
            for (h, values) in row.chunks_exact_mut(d.max(1)).enumerate() {
                values.copy_from_slice(&blocks[s * heads + h][i * d..(i + 1) * d]);
            }
        });
    out
}

/// Tokens per chunk of [`gla_one_head`] (the graph's default `gla_chunk`).
const GLA_CHUNK: usize = 64;

/// Simple GLA of one head of one sequence, `q`, `k`, `v` `[len, d]` (`q` not yet scaled), log
/// decay `g`: `o_t = scale · q_t S_t`, `S_t = e^g S_{t−1} + k_tᵀ v_t`; returns `[len, d]`
/// row-major f32. Chunk by chunk of [`GLA_CHUNK`] tokens with the state `S` `[d, d]` carried:
/// within a chunk `o = ((scale·q kᵀ) ⊙ D) v + (scale·q ⊙ γ^{i+1}) S`, `D_ij = γ^{i−j}` for
/// `j ≤ i`; then `S ← γ^L S + (k ⊙ γ^{L−1−j})ᵀ v`. Every power of γ is `exp(g·n)` in f64,
/// stored as f32, as the graph's [`crate::ops::gla::chunked`] takes them.
fn gla_one_head(
    q: MatRef<'_, f32>,
    k: MatRef<'_, f32>,
    v: MatRef<'_, f32>,
    g: f64,
    scale: f32,
) -> Vec<f32> {
    let (len, d) = (q.nrows(), q.ncols());
    let chunk = GLA_CHUNK.min(len.max(1));
    // γ^n for n = 0..=chunk, each taken once per head (not per row of every chunk).
    let power: Vec<f32> = (0..=chunk).map(|n| (g * n as f64).exp() as f32).collect();
    let intra_mask: Vec<f32> = (0..chunk)
        .flat_map(|i| {
            let power = &power;
            (0..chunk).map(move |j| if j <= i { power[i - j] } else { 0.0 })
        })
        .collect();
    let mut out = vec![0.0f32; len * d];
    let mut state = vec![0.0f32; d * d];
    let mut scores = vec![0.0f32; chunk * chunk];
    let mut decayed_q = vec![0.0f32; chunk * d];
    let mut decayed_k = vec![0.0f32; chunk * d];
    for first in (0..len).step_by(chunk) {
        let rows = chunk.min(len - first);
        let (qc, kc, vc) = (
            q.subrows(first, rows),
            k.subrows(first, rows),
            v.subrows(first, rows),
        );
        let scores = &mut scores[..rows * rows];
        matmul(
            MatMut::from_column_major_slice_mut(scores, rows, rows).transpose_mut(),
            Accum::Replace,
            qc,
            kc.transpose(),
            scale,
            Par::Seq,
        );
        sala_cpu::clear_upper_state();
        for (i, row) in scores.chunks_exact_mut(rows).enumerate() {
            for (p, &m) in row.iter_mut().zip(&intra_mask[i * chunk..]) {
                *p *= m;
            }
        }
        for i in 0..rows {
            let factor = scale * power[i + 1];
            for j in 0..d {
                decayed_q[i * d + j] = qc[(i, j)] * factor;
            }
            let factor = power[rows - 1 - i];
            for j in 0..d {
                decayed_k[i * d + j] = kc[(i, j)] * factor;
            }
        }
        let out_rows =
            MatMut::from_column_major_slice_mut(&mut out[first * d..(first + rows) * d], d, rows)
                .transpose_mut();
        let state_ref = MatRef::from_column_major_slice(&state, d, d).transpose();
        let decayed_q =
            MatRef::from_column_major_slice(&decayed_q[..rows * d], d, rows).transpose();
        matmul(
            out_rows,
            Accum::Replace,
            decayed_q,
            state_ref,
            1.0f32,
            Par::Seq,
        );
        let out_rows =
            MatMut::from_column_major_slice_mut(&mut out[first * d..(first + rows) * d], d, rows)
                .transpose_mut();
        let scores_ref = MatRef::from_column_major_slice(scores, rows, rows).transpose();
        matmul(out_rows, Accum::Add, scores_ref, vc, 1.0f32, Par::Seq);
        sala_cpu::clear_upper_state();
        let carried = power[rows];
        for s in state.iter_mut() {
            *s *= carried;
        }
        let decayed_k =
            MatRef::from_column_major_slice(&decayed_k[..rows * d], d, rows).transpose();
        matmul(
            MatMut::from_column_major_slice_mut(&mut state, d, d).transpose_mut(),
            Accum::Add,
            decayed_k.transpose(),
            vc,
            1.0f32,
            Par::Seq,
        );
        sala_cpu::clear_upper_state();
    }
    out
}

/// Query rows per block of [`attend_one_head`]: a block's scores (`rows × keys`) stay small
/// enough for the cache, and the keys after a block's last row (the masked triangle) are never
/// multiplied.
const QUERY_BLOCK: usize = 128;

/// Causal softmax attention of one head of one sequence: `q`, `k`, `v` `[len, d]`, scores
/// `scale · q·kᵀ` (softmax in f32 over the keys `0..=i` of query `i`); returns `[len, d]`
/// row-major. Queries go in blocks of [`QUERY_BLOCK`] rows, each against the keys up to its
/// last row: two GEMMs per block (a GEMM at full speed beats a loop of scalar dot products),
/// about half the products of the full square.
fn attend_one_head(
    q: MatRef<'_, f32>,
    k: MatRef<'_, f32>,
    v: MatRef<'_, f32>,
    scale: f32,
) -> Vec<f32> {
    let (len, d) = (q.nrows(), q.ncols());
    let mut out = vec![0.0f32; len * d];
    let mut scores = vec![0.0f32; QUERY_BLOCK.min(len) * len];
    for first in (0..len).step_by(QUERY_BLOCK) {
        let rows = QUERY_BLOCK.min(len - first);
        let keys = first + rows;
        let block = &mut scores[..rows * keys];
        matmul(
            MatMut::from_column_major_slice_mut(block, keys, rows).transpose_mut(),
            Accum::Replace,
            q.subrows(first, rows),
            k.subrows(0, keys).transpose(),
            scale,
            Par::Seq,
        );
        // The product's kernels left this thread's upper vector state dirty: the softmax's
        // `exp` would pay for it on every call (sala-cpu says why).
        sala_cpu::clear_upper_state();
        for (i, row) in block.chunks_exact_mut(keys).enumerate() {
            let (kept, masked) = row.split_at_mut(first + i + 1);
            sala_cpu::softmax_in_place(kept);
            masked.fill(0.0);
        }
        matmul(
            MatMut::from_column_major_slice_mut(&mut out[first * d..keys * d], d, rows)
                .transpose_mut(),
            Accum::Replace,
            MatRef::from_column_major_slice(block, keys, rows).transpose(),
            v.subrows(0, keys),
            1.0f32,
            Par::Seq,
        );
        sala_cpu::clear_upper_state();
    }
    out
}

/// A tensor's values, row-major f32: one copy of the array's slice. (burn's `into_data` on a
/// tensor whose array is shared, as every tensor the graph still holds is, collects it one
/// element at a time through a dynamic-dimension iterator: slower than the GEMM itself.)
fn host_values<const D: usize>(t: &Tensor<Cpu, D>) -> Vec<f32> {
    with_values(t, copy_of)
}

/// `n` zeros, written on every core. A fresh buffer of a layer's size is fresh pages: the
/// first write faults each one in, and one thread doing that (plus the zeroing) for a
/// `[tokens, 1536]` product took as long as a parallel pass over it.
fn zeros(n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n);
    out.par_extend(rayon::iter::repeat_n(0.0f32, n));
    out
}

/// A copy of `values`, written on every core (see [`zeros`]).
fn copy_of(values: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(values.len());
    out.par_extend(values.par_iter().copied());
    out
}

/// `f` of a tensor's row-major f32 values, borrowed from the array where it is contiguous
/// (no copy: the inputs of a layer's products are read several times), else collected once.
fn with_values<const D: usize, R>(t: &Tensor<Cpu, D>, f: impl FnOnce(&[f32]) -> R) -> R {
    match t.clone().into_primitive().tensor() {
        NdArrayTensor::F32(storage) => {
            let view = storage.view();
            match view.as_slice() {
                Some(values) => f(values),
                None => f(&view.iter().copied().collect::<Vec<f32>>()),
            }
        }
        other => f(
            &Tensor::<Cpu, D>::from_primitive(TensorPrimitive::Float(other))
                .into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .expect("a float tensor converts to f32"),
        ),
    }
}

/// `values` as a tensor of `shape` on `like`'s device.
fn from_values<const D: usize, const E: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    like: &Tensor<Cpu, E>,
) -> Tensor<Cpu, D> {
    Tensor::from_data(TensorData::new(values, shape), (&like.device(), DType::F32))
}

impl FastOps<Cpu> for CpuFastOps {
    fn describe(&self) -> String {
        "CPU fast ops (faer GEMMs, fused passes)".to_owned()
    }

    fn causal_attention(
        &self,
        q: Tensor<Cpu, 3>,
        k: Tensor<Cpu, 3>,
        v: Tensor<Cpu, 3>,
        lengths: &[usize],
        scale: f32,
    ) -> Result<Tensor<Cpu, 3>> {
        let [tokens, heads, d] = q.dims();
        let [k_tokens, kv_heads, k_d] = k.dims();
        let shapes_agree = k.dims() == v.dims()
            && k_tokens == tokens
            && k_d == d
            && kv_heads > 0
            && heads % kv_heads == 0
            && lengths.iter().sum::<usize>() == tokens;
        if !shapes_agree {
            return Err(ModelError::InvalidInput(format!(
                "causal attention: q {:?}, k {:?}, v {:?} for sequences of {lengths:?} tokens",
                q.dims(),
                k.dims(),
                v.dims()
            )));
        }
        let group = heads / kv_heads;
        let out = with_values(&q, |qv| {
            with_values(&k, |kv| {
                with_values(&v, |vv| {
                    for_each_sequence_head(lengths, heads, d, |start, len, h| {
                        let kh = h / group;
                        attend_one_head(
                            head_rows(qv, start, len, heads, h, d),
                            head_rows(kv, start, len, kv_heads, kh, d),
                            head_rows(vv, start, len, kv_heads, kh, d),
                            scale,
                        )
                    })
                })
            })
        });
        Ok(from_values(out, [tokens, heads, d], &q))
    }

    fn linear(&self, x: &Tensor<Cpu, 2>, w: &Tensor<Cpu, 2>) -> Result<Option<Tensor<Cpu, 2>>> {
        let ([tokens, inp], [out, w_inp]) = (x.dims(), w.dims());
        if inp != w_inp {
            return Err(ModelError::InvalidInput(format!(
                "linear: input [{tokens}, {inp}] against weight [{out}, {w_inp}]"
            )));
        }
        let mut y = zeros(tokens * out);
        with_values(x, |xv| {
            with_values(w, |wv| {
                // Row-major views built as transposed column-major ones (faer's row-major
                // stride constructors are avoided: see sala-hessian's GPTQ loop).
                let lhs = MatRef::from_column_major_slice(xv, inp, tokens).transpose();
                let rhs = MatRef::from_column_major_slice(wv, inp, out);
                let dst = MatMut::from_column_major_slice_mut(&mut y, out, tokens).transpose_mut();
                matmul(dst, Accum::Replace, lhs, rhs, 1.0f32, Par::rayon(0));
            })
        });
        // Its kernels ran on the pool's threads and left their upper vector state dirty: every
        // element-wise pass after it would run several times slower (sala-cpu says why).
        sala_cpu::clear_upper_state_everywhere();
        self.round_all(&mut y);
        Ok(Some(from_values(y, [tokens, out], x)))
    }

    fn rms_norm(
        &self,
        x: &Tensor<Cpu, 2>,
        weight: &Tensor<Cpu, 1>,
        eps: f64,
    ) -> Result<Option<Tensor<Cpu, 2>>> {
        let [rows, n] = x.dims();
        let w = host_values(weight);
        if w.len() != n {
            return Err(ModelError::InvalidInput(format!(
                "rms norm: input [{rows}, {n}] against weight [{}]",
                w.len()
            )));
        }
        let mut values = host_values(x);
        values.par_chunks_mut(n.max(1)).for_each(|row| {
            self.rms_norm_row(row, &w, eps as f32);
        });
        Ok(Some(from_values(values, [rows, n], x)))
    }

    fn scaled_residual(
        &self,
        hidden: &Tensor<Cpu, 2>,
        branch: &Tensor<Cpu, 2>,
        scale: f64,
    ) -> Result<Option<Tensor<Cpu, 2>>> {
        let scale = scale as f32;
        self.zip_map(hidden, branch, "scaled residual", |out, h, b| {
            for ((o, &h), &b) in out.iter_mut().zip(h).zip(b) {
                *o = self.round(h + self.round(b * scale));
            }
        })
        .map(Some)
    }

    fn rms_norm_rope(
        &self,
        x: &Tensor<Cpu, 3>,
        weight: &Tensor<Cpu, 1>,
        eps: f64,
        cos: &Tensor<Cpu, 2>,
        sin: &Tensor<Cpu, 2>,
        lengths: &[usize],
    ) -> Result<Option<Tensor<Cpu, 3>>> {
        let w = host_values(weight);
        if w.len() != x.dims()[2] {
            return Err(ModelError::InvalidInput(format!(
                "rms norm + rope: x {:?} against weight [{}]",
                x.dims(),
                w.len()
            )));
        }
        self.rotate_heads(x, Some((&w, eps as f32)), cos, sin, lengths)
            .map(Some)
    }

    fn rope(
        &self,
        x: &Tensor<Cpu, 3>,
        cos: &Tensor<Cpu, 2>,
        sin: &Tensor<Cpu, 2>,
        lengths: &[usize],
    ) -> Result<Option<Tensor<Cpu, 3>>> {
        self.rotate_heads(x, None, cos, sin, lengths).map(Some)
    }

    fn simple_gla(
        &self,
        q: &Tensor<Cpu, 3>,
        k: &Tensor<Cpu, 3>,
        v: &Tensor<Cpu, 3>,
        lengths: &[usize],
        log_decays: &[f64],
        scale: f32,
    ) -> Result<Option<Tensor<Cpu, 2>>> {
        let [tokens, heads, d] = q.dims();
        let shapes_agree = k.dims() == q.dims()
            && v.dims() == q.dims()
            && log_decays.len() == heads
            && lengths.iter().sum::<usize>() == tokens;
        if !shapes_agree {
            return Err(ModelError::InvalidInput(format!(
                "simple GLA: q {:?}, k {:?}, v {:?}, {} decays for sequences of {lengths:?} \
                 tokens",
                q.dims(),
                k.dims(),
                v.dims(),
                log_decays.len()
            )));
        }
        let mut out = with_values(q, |qv| {
            with_values(k, |kv| {
                with_values(v, |vv| {
                    for_each_sequence_head(lengths, heads, d, |start, len, h| {
                        gla_one_head(
                            head_rows(qv, start, len, heads, h, d),
                            head_rows(kv, start, len, heads, h, d),
                            head_rows(vv, start, len, heads, h, d),
                            log_decays[h],
                            scale,
                        )
                    })
                })
            })
        });
        self.round_all(&mut out);
        Ok(Some(from_values(out, [tokens, heads * d], q)))
    }

    fn to_host(&self, x: &Tensor<Cpu, 2>) -> Option<Vec<f32>> {
        Some(host_values(x))
    }

    fn swiglu(&self, gate: &Tensor<Cpu, 2>, up: &Tensor<Cpu, 2>) -> Result<Option<Tensor<Cpu, 2>>> {
        // `out` holds σ(gate) first, then the gated product.
        self.zip_map(gate, up, "swiglu", |out, g, u| {
            sala_cpu::sigmoid_into(out, g);
            for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
                *o = self.round(self.round(g * *o) * u);
            }
        })
        .map(Some)
    }

    fn sigmoid_gate(
        &self,
        x: &Tensor<Cpu, 2>,
        gate: &Tensor<Cpu, 2>,
    ) -> Result<Option<Tensor<Cpu, 2>>> {
        self.zip_map(x, gate, "sigmoid gate", |out, x, g| {
            sala_cpu::sigmoid_into(out, g);
            for (o, &x) in out.iter_mut().zip(x) {
                *o = self.round(x * self.round(*o));
            }
        })
        .map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::attention::causal_attention;
    use crate::ops::linear;
    use burn::tensor::activation::{sigmoid as graph_sigmoid, silu};

    fn random(shape: &[usize], seed: u64) -> Vec<f32> {
        // A small LCG: deterministic inputs without another dependency.
        let mut state = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..shape.iter().product::<usize>())
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 33) as f32 / (1u64 << 31) as f32) * 4.0 - 2.0
            })
            .collect()
    }

    fn tensor<const D: usize>(shape: [usize; D], seed: u64, numerics: Numerics) -> Tensor<Cpu, D> {
        let t = Tensor::from_data(
            TensorData::new(random(&shape, seed), shape),
            (&Default::default(), DType::F32),
        );
        numerics.round(t)
    }

    /// Largest `|a − b| / max(|b|, floor)`.
    fn max_relative<const D: usize>(a: Tensor<Cpu, D>, b: Tensor<Cpu, D>, floor: f32) -> f32 {
        host_values(&a)
            .iter()
            .zip(host_values(&b))
            .map(|(x, y)| (x - y).abs() / y.abs().max(floor))
            .fold(0.0, f32::max)
    }

    const BOTH: [Numerics; 2] = [Numerics::F32, Numerics::Bf16Rounding];

    #[test]
    fn linear_matches_the_graph() {
        for numerics in BOTH {
            let ops = CpuFastOps::new(numerics);
            let (x, w) = (tensor([37, 96], 1, numerics), tensor([50, 96], 2, numerics));
            let fast = ops.linear(&x, &w).unwrap().unwrap();
            let graph = linear(x, w, numerics);
            // Another summation order: f32 rounding, or one bf16 step where it tips a tie.
            let bound = if numerics == Numerics::F32 {
                1e-4
            } else {
                1.0 / 128.0
            };
            let rel = max_relative(fast, graph, 1.0);
            assert!(rel <= bound, "{numerics:?}: {rel}");
        }
        let bad = CpuFastOps::new(Numerics::F32).linear(
            &tensor([4, 8], 3, Numerics::F32),
            &tensor([4, 9], 4, Numerics::F32),
        );
        assert!(bad.unwrap_err().to_string().contains("linear"));
    }

    #[test]
    fn swiglu_and_sigmoid_gates_match_the_graph() {
        // σ here is 1/(1 + e^−x) with an eight-lane exp; burn's is exp(−ln(1 + e^−x)) with
        // libm's: a few f32 ulps apart, which tips a bf16 rounding now and then.
        for numerics in BOTH {
            let ops = CpuFastOps::new(numerics);
            let (a, b) = (tensor([33, 70], 5, numerics), tensor([33, 70], 6, numerics));
            // (bound, least share of values equal): f32 differs in the last bits of most
            // values; bf16 rounding hides those except where they tip a rounding.
            let bound = if numerics == Numerics::F32 {
                (1e-5, 0.5)
            } else {
                (1.0 / 128.0, 0.9)
            };
            let fast = ops.swiglu(&a, &b).unwrap().unwrap();
            let graph = numerics.round(numerics.round(silu(a.clone())) * b.clone());
            assert_close_mostly_equal(fast, graph, bound, &format!("swiglu {numerics:?}"));
            let fast = ops.sigmoid_gate(&a, &b).unwrap().unwrap();
            let graph = numerics.round(a.clone() * numerics.round(graph_sigmoid(b.clone())));
            assert_close_mostly_equal(fast, graph, bound, &format!("gate {numerics:?}"));
        }
    }

    /// Every value within `bound.0` (relative, floor 1e-6) and at least the share `bound.1` of
    /// them equal.
    fn assert_close_mostly_equal(
        fast: Tensor<Cpu, 2>,
        graph: Tensor<Cpu, 2>,
        (bound, least_equal): (f32, f64),
        what: &str,
    ) {
        let (fast, graph) = (host_values(&fast), host_values(&graph));
        let equal = fast.iter().zip(&graph).filter(|(a, b)| a == b).count();
        let share = equal as f64 / fast.len() as f64;
        assert!(
            share >= least_equal,
            "{what}: only {equal} of {} equal",
            fast.len()
        );
        let rel = fast
            .iter()
            .zip(&graph)
            .map(|(x, y)| (x - y).abs() / y.abs().max(1e-6))
            .fold(0.0, f32::max);
        assert!(rel <= bound, "{what}: {rel}");
    }

    /// The bound of [`linear_matches_the_graph`]: f32 rounding of another summation order, or
    /// one bf16 step where it tips a tie.
    fn summation_bound(numerics: Numerics) -> f32 {
        if numerics == Numerics::F32 {
            1e-5
        } else {
            1.0 / 128.0
        }
    }

    #[test]
    fn rms_norm_and_scaled_residual_match_the_graph() {
        use crate::ops::norm::rms_norm;
        for numerics in BOTH {
            let ops = CpuFastOps::new(numerics);
            let (x, b) = (
                tensor([29, 72], 10, numerics),
                tensor([29, 72], 11, numerics),
            );
            let w = tensor([72], 12, numerics);
            let fast = ops.rms_norm(&x, &w, 1e-6).unwrap().unwrap();
            let graph = rms_norm(x.clone(), w.clone(), 1e-6, numerics);
            let rel = max_relative(fast, graph, 1.0);
            assert!(rel <= summation_bound(numerics), "{numerics:?}: {rel}");
            // Same operations in the same order: exact.
            let fast = ops.scaled_residual(&x, &b, 0.3).unwrap().unwrap();
            let graph = numerics.round(x.clone() + numerics.round(b.clone().mul_scalar(0.3)));
            assert_eq!(host_values(&fast), host_values(&graph), "{numerics:?}");
        }
        let ops = CpuFastOps::new(Numerics::F32);
        let bad = ops.rms_norm(
            &tensor([3, 8], 13, Numerics::F32),
            &tensor([9], 14, Numerics::F32),
            1e-6,
        );
        assert!(bad.unwrap_err().to_string().contains("rms norm"));
    }

    #[test]
    fn rope_matches_the_graph_per_sequence() {
        use crate::ops::rope::{apply_rope, RopeTables};
        let (heads, d) = (3, 16);
        let lengths = [7, 1, 40, 12];
        let tokens: usize = lengths.iter().sum();
        let tables = RopeTables::<Cpu>::new(50, d, 10000.0, &Default::default());
        for numerics in BOTH {
            let ops = CpuFastOps::new(numerics);
            let x = tensor([tokens, heads, d], 17, numerics);
            let fast = ops
                .rope(&x, &tables.cos, &tables.sin, &lengths)
                .unwrap()
                .unwrap();
            let graph = apply_rope(x.clone(), &tables.for_pack(&lengths).unwrap(), numerics);
            // Same products and one sum per value: equal.
            assert_eq!(host_values(&fast), host_values(&graph), "{numerics:?}");
            let bad = ops.rope(&x, &tables.cos, &tables.sin, &[tokens + 1]);
            assert!(bad.unwrap_err().to_string().contains("rope"));
            let short = RopeTables::<Cpu>::new(39, d, 10000.0, &Default::default());
            let bad = ops.rope(&x, &short.cos, &short.sin, &lengths);
            assert!(bad.unwrap_err().to_string().contains("rope"));
        }
    }

    #[test]
    fn rms_norm_rope_matches_the_graph_per_sequence() {
        use crate::ops::norm::rms_norm;
        use crate::ops::rope::{apply_rope, RopeTables};
        let (heads, d) = (3, 16);
        let lengths = [7, 1, 40, 12];
        let tokens: usize = lengths.iter().sum();
        let device = Default::default();
        let tables = RopeTables::<Cpu>::new(50, d, 10000.0, &device);
        for numerics in BOTH {
            let ops = CpuFastOps::new(numerics);
            let (x, w) = (
                tensor([tokens, heads, d], 15, numerics),
                tensor([d], 16, numerics),
            );
            let fast = ops
                .rms_norm_rope(&x, &w, 1e-6, &tables.cos, &tables.sin, &lengths)
                .unwrap()
                .unwrap();
            let normed = rms_norm(
                x.clone().reshape([tokens * heads, d]),
                w.clone(),
                1e-6,
                numerics,
            )
            .reshape([tokens, heads, d]);
            let graph = apply_rope(normed, &tables.for_pack(&lengths).unwrap(), numerics);
            let rel = max_relative(fast, graph, 1.0);
            assert!(rel <= summation_bound(numerics), "{numerics:?}: {rel}");
            let bad = ops.rms_norm_rope(&x, &w, 1e-6, &tables.cos, &tables.sin, &[tokens - 1]);
            assert!(bad.unwrap_err().to_string().contains("rope"));
        }
    }

    #[test]
    fn simple_gla_matches_the_graph_and_the_recurrence() {
        use crate::ops::gla::{chunked, log_decays, recurrent_reference};
        let (heads, d) = (4, 8);
        // 150 tokens: three chunks, the last one partial.
        let lengths = [3, 150, 64, 1];
        let tokens: usize = lengths.iter().sum();
        let decays = log_decays(heads);
        let scale = 0.35f32;
        for numerics in BOTH {
            let ops = CpuFastOps::new(numerics);
            let (q, k, v) = (
                tensor([tokens, heads, d], 17, numerics),
                tensor([tokens, heads, d], 18, numerics),
                tensor([tokens, heads, d], 19, numerics),
            );
            let fast = ops
                .simple_gla(&q, &k, &v, &lengths, &decays, scale)
                .unwrap()
                .unwrap();
            let offsets = sequence_offsets(&lengths);
            let (qv, kv, vv) = (host_values(&q), host_values(&k), host_values(&v));
            let mut graph = Vec::new();
            let mut oracle = Vec::new();
            for (s, &len) in lengths.iter().enumerate() {
                let rows = offsets[s]..offsets[s + 1];
                let by_head = |x: &Tensor<Cpu, 3>| {
                    x.clone()
                        .slice([rows.clone(), 0..heads, 0..d])
                        .swap_dims(0, 1)
                };
                let out = chunked(
                    by_head(&q).mul_scalar(scale),
                    by_head(&k),
                    by_head(&v),
                    &decays,
                    64,
                );
                graph.push(numerics.round(out.swap_dims(0, 1).reshape([len, heads * d])));
                let span = offsets[s] * heads * d..offsets[s + 1] * heads * d;
                let scaled: Vec<f32> = qv[span.clone()].iter().map(|x| x * scale).collect();
                oracle.extend(recurrent_reference(
                    &scaled,
                    &kv[span.clone()],
                    &vv[span],
                    len,
                    heads,
                    d,
                    &decays,
                ));
            }
            let rel = max_relative(fast.clone(), Tensor::cat(graph, 0), 1.0);
            assert!(
                rel <= 10.0 * summation_bound(numerics),
                "{numerics:?}: {rel}"
            );
            let oracle = from_values(oracle, [tokens, heads * d], &fast);
            let rel = max_relative(fast, numerics.round(oracle), 1.0);
            assert!(
                rel <= 10.0 * summation_bound(numerics),
                "{numerics:?}: {rel}"
            );
            let bad = ops.simple_gla(&q, &k, &v, &lengths, &decays[..2], scale);
            assert!(bad.unwrap_err().to_string().contains("simple GLA"));
        }
    }

    #[test]
    fn causal_attention_matches_the_graph_per_sequence() {
        let (heads, kv_heads, d) = (6, 2, 16);
        // 300 tokens: three query blocks, the last one partial.
        let lengths = [5, 17, 1, 300, 9];
        let tokens: usize = lengths.iter().sum();
        let n = Numerics::F32;
        let (q, k, v) = (
            tensor([tokens, heads, d], 7, n),
            tensor([tokens, kv_heads, d], 8, n),
            tensor([tokens, kv_heads, d], 9, n),
        );
        let scale = 0.25;
        let fast = CpuFastOps::new(n)
            .causal_attention(q.clone(), k.clone(), v.clone(), &lengths, scale)
            .unwrap();
        let offsets = sequence_offsets(&lengths);
        let graph: Vec<Tensor<Cpu, 3>> = lengths
            .iter()
            .enumerate()
            .map(|(s, _)| {
                let rows = offsets[s]..offsets[s + 1];
                causal_attention(
                    q.clone().slice([rows.clone(), 0..heads, 0..d]),
                    k.clone().slice([rows.clone(), 0..kv_heads, 0..d]),
                    v.clone().slice([rows, 0..kv_heads, 0..d]),
                    usize::MAX,
                )
            })
            .collect();
        // The graph scales q by 1/√d = 0.25 as well.
        let rel = max_relative(fast, Tensor::cat(graph, 0), 1.0);
        assert!(rel < 1e-5, "{rel}");
        let bad = CpuFastOps::new(n).causal_attention(q, k, v, &[tokens + 1], scale);
        assert!(bad.unwrap_err().to_string().contains("causal attention"));
    }
}
