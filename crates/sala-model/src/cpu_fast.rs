//! [`FastOps`] on the CPU backend (burn-ndarray): a layer's products and fused element-wise
//! steps on every core.
//!
//! Why: burn-ndarray runs each element-wise op as its own single-threaded pass (and a strided
//! copy where a view is not contiguous), so a calibration forward on 2 cores kept about 1.3 of
//! them busy. Profiled on SmolLM2-135M (`perf record`, 8 samples × 512 tokens): the graph's
//! matmuls took about a quarter of the time, and the bf16 rounding after every product, the
//! per-sequence attention and the copies most of the rest. Here a linear is one faer GEMM
//! with the rounding fused into the same parallel pass, SwiGLU and the sigmoid gates are one
//! parallel pass each, and causal attention runs (sequence, head) pairs in parallel. Each op
//! computes what the graph computes (same formulas, f32, the same rounding points), only the
//! GEMM's summation order differs; the tests compare every op and a whole model with the
//! graph.

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
            half::bf16::from_f32(v).to_f32()
        } else {
            v
        }
    }

    /// `f(a, b)` element by element over two tensors of one shape, on every core.
    fn zip_map(
        &self,
        a: &Tensor<Cpu, 2>,
        b: &Tensor<Cpu, 2>,
        what: &str,
        f: impl Fn(f32, f32) -> f32 + Sync,
    ) -> Result<Tensor<Cpu, 2>> {
        if a.dims() != b.dims() {
            return Err(ModelError::InvalidInput(format!(
                "{what}: shapes {:?} and {:?} differ",
                a.dims(),
                b.dims()
            )));
        }
        let mut out = host_values(a);
        let other = host_values(b);
        out.par_chunks_mut(CHUNK)
            .zip(other.par_chunks(CHUNK))
            .for_each(|(o, b)| {
                for (x, &y) in o.iter_mut().zip(b) {
                    *x = f(*x, y);
                }
            });
        Ok(from_values(out, a.dims(), a))
    }
}

/// burn's sigmoid as burn-backend computes it, `exp(−ln(1 + exp(−x)))` in f32.
#[inline]
fn sigmoid(x: f32) -> f32 {
    (-((-x).exp() + 1.0).ln()).exp()
}

/// A tensor's values, row-major f32: one copy of the array's slice. (burn's `into_data` on a
/// tensor whose array is shared, as every tensor the graph still holds is, collects it one
/// element at a time through a dynamic-dimension iterator: slower than the GEMM itself.)
fn host_values<const D: usize>(t: &Tensor<Cpu, D>) -> Vec<f32> {
    match t.clone().into_primitive().tensor() {
        NdArrayTensor::F32(storage) => {
            let view = storage.view();
            match view.as_slice() {
                Some(values) => values.to_vec(),
                None => view.iter().copied().collect(),
            }
        }
        other => Tensor::<Cpu, D>::from_primitive(TensorPrimitive::Float(other))
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .expect("a float tensor converts to f32"),
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
        let (qv, kv, vv) = (host_values(&q), host_values(&k), host_values(&v));
        let group = heads / kv_heads;
        let offsets = sequence_offsets(lengths);
        let pairs: Vec<(usize, usize)> = (0..lengths.len())
            .flat_map(|s| (0..heads).map(move |h| (s, h)))
            .collect();
        // Each (sequence, head) pair is independent: its output rows `[len, d]`, from two
        // GEMMs (`S = (scale·Q)Kᵀ`, `O = softmax(S)V`; the masked half of `S` is computed and
        // dropped: a GEMM at full speed beats a causal loop of scalar dot products).
        let blocks: Vec<Vec<f32>> = pairs
            .par_iter()
            .map(|&(s, h)| {
                let (start, len) = (offsets[s], lengths[s]);
                let kh = h / group;
                let gather = |t: &[f32], width: usize, head: usize, factor: f32| -> Vec<f32> {
                    (0..len)
                        .flat_map(|i| {
                            let at = ((start + i) * width + head) * d;
                            t[at..at + d].iter().map(move |&x| x * factor)
                        })
                        .collect()
                };
                let (q, k, v) = (
                    gather(&qv, heads, h, scale),
                    gather(&kv, kv_heads, kh, 1.0),
                    gather(&vv, kv_heads, kh, 1.0),
                );
                let mut scores = vec![0.0f32; len * len];
                matmul(
                    MatMut::from_column_major_slice_mut(&mut scores, len, len).transpose_mut(),
                    Accum::Replace,
                    MatRef::from_column_major_slice(&q, d, len).transpose(),
                    MatRef::from_column_major_slice(&k, d, len),
                    1.0f32,
                    Par::Seq,
                );
                for (i, row) in scores.chunks_exact_mut(len.max(1)).enumerate() {
                    let (kept, masked) = row.split_at_mut(i + 1);
                    let max = kept.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0.0f32;
                    for p in kept.iter_mut() {
                        *p = (*p - max).exp();
                        sum += *p;
                    }
                    for p in kept.iter_mut() {
                        *p /= sum;
                    }
                    masked.fill(0.0);
                }
                let mut out = vec![0.0f32; len * d];
                matmul(
                    MatMut::from_column_major_slice_mut(&mut out, d, len).transpose_mut(),
                    Accum::Replace,
                    MatRef::from_column_major_slice(&scores, len, len).transpose(),
                    MatRef::from_column_major_slice(&v, d, len).transpose(),
                    1.0f32,
                    Par::Seq,
                );
                out
            })
            .collect();
        let mut out = vec![0.0f32; tokens * heads * d];
        for (&(s, h), block) in pairs.iter().zip(&blocks) {
            for (i, values) in block.chunks_exact(d.max(1)).enumerate() {
                let at = ((offsets[s] + i) * heads + h) * d;
                out[at..at + d].copy_from_slice(values);
            }
        }
        Ok(from_values(out, [tokens, heads, d], &q))
    }

    fn linear(&self, x: &Tensor<Cpu, 2>, w: &Tensor<Cpu, 2>) -> Result<Option<Tensor<Cpu, 2>>> {
        let ([tokens, inp], [out, w_inp]) = (x.dims(), w.dims());
        if inp != w_inp {
            return Err(ModelError::InvalidInput(format!(
                "linear: input [{tokens}, {inp}] against weight [{out}, {w_inp}]"
            )));
        }
        let (xv, wv) = (host_values(x), host_values(w));
        let mut y = vec![0.0f32; tokens * out];
        // Row-major views built as transposed column-major ones (faer's row-major stride
        // constructors are avoided: see sala-hessian's GPTQ loop).
        let lhs = MatRef::from_column_major_slice(&xv, inp, tokens).transpose();
        let rhs = MatRef::from_column_major_slice(&wv, inp, out);
        let dst = MatMut::from_column_major_slice_mut(&mut y, out, tokens).transpose_mut();
        matmul(dst, Accum::Replace, lhs, rhs, 1.0f32, Par::rayon(0));
        if self.rounds() {
            y.par_chunks_mut(CHUNK).for_each(|chunk| {
                for v in chunk {
                    *v = self.round(*v);
                }
            });
        }
        Ok(Some(from_values(y, [tokens, out], x)))
    }

    fn to_host(&self, x: &Tensor<Cpu, 2>) -> Option<Vec<f32>> {
        Some(host_values(x))
    }

    fn swiglu(&self, gate: &Tensor<Cpu, 2>, up: &Tensor<Cpu, 2>) -> Result<Option<Tensor<Cpu, 2>>> {
        self.zip_map(gate, up, "swiglu", |g, u| {
            self.round(self.round(g * sigmoid(g)) * u)
        })
        .map(Some)
    }

    fn sigmoid_gate(
        &self,
        x: &Tensor<Cpu, 2>,
        gate: &Tensor<Cpu, 2>,
    ) -> Result<Option<Tensor<Cpu, 2>>> {
        self.zip_map(x, gate, "sigmoid gate", |x, g| {
            self.round(x * self.round(sigmoid(g)))
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
    fn swiglu_and_sigmoid_gates_match_the_graph_exactly() {
        for numerics in BOTH {
            let ops = CpuFastOps::new(numerics);
            let (a, b) = (tensor([33, 70], 5, numerics), tensor([33, 70], 6, numerics));
            let fast = ops.swiglu(&a, &b).unwrap().unwrap();
            let graph = numerics.round(numerics.round(silu(a.clone())) * b.clone());
            assert_eq!(host_values(&fast), host_values(&graph), "{numerics:?}");
            let fast = ops.sigmoid_gate(&a, &b).unwrap().unwrap();
            let graph = numerics.round(a.clone() * numerics.round(graph_sigmoid(b.clone())));
            assert_eq!(host_values(&fast), host_values(&graph), "{numerics:?}");
        }
    }

    #[test]
    fn causal_attention_matches_the_graph_per_sequence() {
        let (heads, kv_heads, d) = (6, 2, 16);
        let lengths = [5, 17, 1, 9];
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
