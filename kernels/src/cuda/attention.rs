//! Causal GQA attention for long sequences on cuBLAS: [`blocked_causal_attention_bf16`].
//!
//! Same contract as [`causal_gqa_attention`](crate::attention::causal_gqa_attention) with bf16
//! buffers (`q`, `out` `[tokens, heads, d]`, `k`, `v` `[tokens, kv_heads, d]`, row-major,
//! sequences back to back per `offsets`), but the two products run on the tensor cores
//! through cuBLAS instead of the portable kernel's FMAs, which are far too slow at 131072
//! tokens. Work unit: one (query block, KV head) pair, the block being `block` consecutive
//! tokens of one sequence (the last block of a sequence may be shorter), the `g = heads /
//! kv_heads` query heads of the group at once:
//!
//! 1. scores `S_j = scale · Q_j·Kᵀ` by one strided batched GEMM (batch `j` = query head
//!    `h0 + j`; every batch reads the same keys: batch stride 0), bf16 in, f32 out, into a
//!    scratch buffer `[g, rows, keys]`, where `keys` runs from the sequence's start to the
//!    block's last query: key blocks above the diagonal are never multiplied;
//! 2. the masked row softmax ([`causal_softmax_rows_as`], a CubeCL kernel) from the f32 scores
//!    into a bf16 scratch `P [g, rows, keys]` (the keys past a row's diagonal get exactly 0);
//! 3. `O_j = P_j·V` by a second strided batched GEMM, f32 accumulation, written as bf16
//!    straight into `out` at the block's rows of head `h0 + j`.
//!
//! The score matrix of a block is materialized (`g · rows · keys` f32 values), so the block
//! size trades GEMM efficiency against scratch memory: see [`attention_blocking`].
//!
//! # cuBLAS parameters
//!
//! cuBLAS is column-major: a row-major `r × c` matrix with row stride `s` is the column-major
//! `c × r` matrix of its transpose with leading dimension `s` (see `blas.rs`). With `rows` the
//! block's queries, `keys` its key count, `d` the head dimension:
//!
//! - scores: row-major `S_j [rows, keys] = Q_j [rows, d] · K [keys, d]ᵀ` is column-major
//!   `S_jᵀ (keys × rows, ld keys) = K · Q_jᵀ`. Row-major K (row stride `kv_heads·d`) is
//!   column-major `Kᵀ` (`d × keys`), used transposed; row-major `Q_j` (row stride `heads·d`)
//!   is column-major `Q_jᵀ` (`d × rows`), used as is. So `transa = T, transb = N, m = keys,
//!   n = rows, k = d, A = K (lda kv_heads·d, strideA 0), B = Q (ldb heads·d, strideB d),
//!   C = S (ldc keys, strideC rows·keys), α = scale, β = 0`.
//! - output: row-major `O_j [rows, d] = P_j [rows, keys] · V [keys, d]` is column-major
//!   `O_jᵀ (d × rows, ld heads·d) = Vᵀ · P_jᵀ`, row-major V being column-major `Vᵀ`
//!   (`d × keys`, ld `kv_heads·d`) and row-major `P_j` column-major `P_jᵀ` (`keys × rows`, ld
//!   `keys`), both used as they are. So `transa = N, transb = N, m = d, n = rows, k = keys,
//!   A = V (lda kv_heads·d, strideA 0), B = P (ldb keys, strideB rows·keys), C = out (ldc
//!   heads·d, strideC d), α = 1, β = 0`. The batches of C interleave (batch `j` is columns
//!   `j·d..(j+1)·d` of the same rows) but never share an element.
//!
//! # Ordering
//!
//! cuBLAS runs on its own stream, CubeCL's kernel on CubeCL's: every [`Cublas::run`] waits
//! for CubeCL's queued work first and for its own stream after, so each step sees the
//! previous one's results. To halve those host round trips, the output GEMM of one work unit
//! is issued in the same `run` as the score GEMM of the next (they touch different scratch
//! buffers: the output GEMM reads `P`, the score GEMM writes `S`, whose previous reader, the
//! softmax, has finished when `run` starts).

use cubecl::cuda::CudaRuntime;
use cubecl::ir::{ElemType, FloatKind, StorageType};
use cubecl::prelude::ComputeClient;
use cubecl::server::Handle;
use cudarc::cublas::sys::cudaDataType;
use cudarc::cublas::sys::{self, cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t};

use super::{dim_i32, handle_ptr, Cublas};
use crate::attention::{check_inputs, AttentionShape};
use crate::error::KernelError;
use crate::softmax::{causal_softmax_rows_as, SoftmaxShape};

/// Bytes of f32 scores one work unit may materialize: `g · block · longest · 4 ≤` this (2 GiB;
/// the bf16 copy `P` adds half as much again). Exceeded only when even [`MIN_BLOCK`] rows do
/// not fit (`g · longest > 2²³`, e.g. longer than 524288 tokens at a group of 16).
pub const SCORE_BUDGET_BYTES: usize = 2 << 30;

/// The smallest query block (tokens); blocks are multiples of it. Below this the GEMMs have
/// too few rows to keep the tensor cores busy.
pub const MIN_BLOCK: usize = 64;

/// The largest query block (tokens): beyond it the GEMMs gain little, and the key range of a
/// block overshoots its early rows' diagonals by up to a block (computed, then masked).
pub const MAX_BLOCK: usize = 1024;

/// Bytes of one bf16.
const BF16_BYTES: usize = 2;

/// Bytes of one f32.
const F32_BYTES: usize = 4;

/// How [`blocked_causal_attention_bf16`] blocks a problem (for benchmarks and reports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionBlocking {
    /// Query tokens per block (the last block of each sequence may be shorter).
    pub block: usize,
    /// Elements of each scratch buffer (`S` in f32, `P` in bf16): `g · min(block, longest) ·
    /// longest`, `longest` the longest sequence in tokens.
    pub scratch_elements: usize,
    /// Query blocks over all sequences (each is run once per KV head).
    pub query_blocks: usize,
}

impl AttentionBlocking {
    /// Bytes of device scratch the call allocates (`S` and `P`).
    pub fn scratch_bytes(&self) -> usize {
        self.scratch_elements * (F32_BYTES + BF16_BYTES)
    }
}

/// The blocking of a problem: the largest multiple of [`MIN_BLOCK`] in
/// `MIN_BLOCK..=MAX_BLOCK` whose scores fit [`SCORE_BUDGET_BYTES`] at the longest sequence's
/// length (at least [`MIN_BLOCK`], even over the budget), and no longer than that sequence.
/// E.g. 32 heads over 2 KV heads (`g = 16`): 256 tokens at 131072 (2 GiB of scores, 1 GiB of
/// `P`), 1024 up to 32768. Errors as the input checks on `shape` and `offsets`.
pub fn attention_blocking(
    shape: &AttentionShape,
    offsets: &[usize],
) -> Result<AttentionBlocking, KernelError> {
    crate::attention::attention_tiling(shape)?;
    crate::attention::check_offsets(offsets)?;
    let longest = offsets.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(1);
    let block = choose_block(shape.group(), longest);
    let scratch_elements = shape
        .group()
        .checked_mul(block.min(longest))
        .and_then(|n| n.checked_mul(longest))
        .ok_or_else(|| {
            KernelError::unsupported("attention scratch", format!("{longest} tokens overflow"))
        })?;
    Ok(AttentionBlocking {
        block,
        scratch_elements,
        query_blocks: query_blocks(offsets, block).len(),
    })
}

/// See [`attention_blocking`].
fn choose_block(group: usize, longest: usize) -> usize {
    let per_row = group.max(1).saturating_mul(longest.max(1)) * F32_BYTES;
    let fit = SCORE_BUDGET_BYTES / per_row;
    let block = fit.clamp(MIN_BLOCK, MAX_BLOCK) / MIN_BLOCK * MIN_BLOCK;
    block.min(longest.max(1))
}

/// One query block: the queries at token rows `q0..q1` of the sequence starting at row
/// `seq_start` (all absolute rows of the packed buffers). Its keys are rows `seq_start..q1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct QueryBlock {
    seq_start: usize,
    q0: usize,
    q1: usize,
}

impl QueryBlock {
    fn rows(&self) -> usize {
        self.q1 - self.q0
    }

    fn keys(&self) -> usize {
        self.q1 - self.seq_start
    }
}

/// The blocks of `block` tokens of every sequence, in order (offsets already checked).
fn query_blocks(offsets: &[usize], block: usize) -> Vec<QueryBlock> {
    let mut blocks = Vec::new();
    for w in offsets.windows(2) {
        let (start, end) = (w[0], w[1]);
        let mut q0 = start;
        while q0 < end {
            let q1 = (q0 + block).min(end);
            blocks.push(QueryBlock {
                seq_start: start,
                q0,
                q1,
            });
            q0 = q1;
        }
    }
    blocks
}

/// One column-major strided batched operand: elements from its buffer's start to matrix 0's
/// element (0, 0), leading dimension, and elements between consecutive batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Operand {
    offset: usize,
    ld: usize,
    stride: usize,
}

/// One `cublasGemmStridedBatchedEx` in element units (buffers named by the caller):
/// `C_j ← α·op(A_j)·op(B_j)` (β = 0), column-major, `C_j` `m × n`, for `j < batch`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct StridedGemm {
    trans_a: bool,
    trans_b: bool,
    m: usize,
    n: usize,
    k: usize,
    a: Operand,
    b: Operand,
    c: Operand,
    batch: usize,
    alpha: f32,
}

/// Step 1 for block `blk`, KV head `kv`: A = `k`, B = `q`, C = the f32 scores `[g, rows,
/// keys]` (see the module documentation for the derivation).
fn score_gemm(shape: &AttentionShape, blk: &QueryBlock, kv: usize) -> StridedGemm {
    let (heads, kv_heads, d, g) = (shape.heads, shape.kv_heads, shape.head_dim, shape.group());
    let (rows, keys) = (blk.rows(), blk.keys());
    StridedGemm {
        trans_a: true,
        trans_b: false,
        m: keys,
        n: rows,
        k: d,
        a: Operand {
            offset: (blk.seq_start * kv_heads + kv) * d,
            ld: kv_heads * d,
            stride: 0,
        },
        b: Operand {
            offset: (blk.q0 * heads + kv * g) * d,
            ld: heads * d,
            stride: d,
        },
        c: Operand {
            offset: 0,
            ld: keys,
            stride: rows * keys,
        },
        batch: g,
        alpha: shape.scale,
    }
}

/// Step 2 for block `blk`: the softmax of the scores of [`score_gemm`].
fn softmax_shape(shape: &AttentionShape, blk: &QueryBlock) -> SoftmaxShape {
    SoftmaxShape {
        batch: shape.group(),
        rows: blk.rows(),
        keys: blk.keys(),
        first_query: blk.q0 - blk.seq_start,
    }
}

/// Step 3 for block `blk`, KV head `kv`: A = `v`, B = the bf16 probabilities `[g, rows,
/// keys]`, C = `out` (see the module documentation for the derivation).
fn output_gemm(shape: &AttentionShape, blk: &QueryBlock, kv: usize) -> StridedGemm {
    let (heads, kv_heads, d, g) = (shape.heads, shape.kv_heads, shape.head_dim, shape.group());
    let (rows, keys) = (blk.rows(), blk.keys());
    StridedGemm {
        trans_a: false,
        trans_b: false,
        m: d,
        n: rows,
        k: keys,
        a: Operand {
            offset: (blk.seq_start * kv_heads + kv) * d,
            ld: kv_heads * d,
            stride: 0,
        },
        b: Operand {
            offset: 0,
            ld: keys,
            stride: rows * keys,
        },
        c: Operand {
            offset: (blk.q0 * heads + kv * g) * d,
            ld: heads * d,
            stride: d,
        },
        batch: g,
        alpha: 1.0,
    }
}

/// `out ← softmax(scale · q·kᵀ, causal) · v` per sequence and query head, bf16 in and out,
/// f32 accumulation, on cuBLAS (the products) and CubeCL (the softmax).
///
/// - `shape`: heads, KV heads (`heads` a multiple), head_dim (16, 32, 64 or 128, as
///   [`causal_gqa_attention`](crate::attention::causal_gqa_attention)), finite scale;
/// - `offsets`: the sequence boundaries in tokens, `[0, …, tokens]`, strictly increasing;
/// - `q`, `out`: bf16 `[tokens, heads, head_dim]`; `k`, `v`: bf16 `[tokens, kv_heads,
///   head_dim]`; whole dense CubeCL buffers of the CUDA client (at least that many bytes;
///   `out` must not alias an input).
///
/// Precision: scores and softmax in f32, the probabilities rounded to bf16 (normalized) before
/// `P·V`, accumulated in f32 and rounded to bf16 once: about the error of a bf16 flash
/// attention. Allocates two scratch buffers once per call ([`attention_blocking`]: up to
/// [`SCORE_BUDGET_BYTES`] plus half that). Synchronous: returns when `out` is written.
///
/// Errors: the input checks of the portable kernel ([`KernelError::Shape`],
/// [`KernelError::Unsupported`]), a dimension past cuBLAS's 32-bit integers, or a cuBLAS /
/// CubeCL failure ([`KernelError::Launch`]).
#[allow(clippy::too_many_arguments)]
pub fn blocked_causal_attention_bf16(
    client: &ComputeClient<CudaRuntime>,
    blas: &Cublas,
    shape: &AttentionShape,
    offsets: &[usize],
    q: &Handle,
    k: &Handle,
    v: &Handle,
    out: &Handle,
) -> Result<(), KernelError> {
    check_inputs(shape, offsets, BF16_BYTES, [q, k, v, out])?;
    let blocking = attention_blocking(shape, offsets)?;
    let blocks = query_blocks(offsets, blocking.block);
    let scratch = blocking.scratch_elements;
    let scores = client.empty(scratch * F32_BYTES);
    let probs = client.empty(scratch * BF16_BYTES);
    let ptr = |h: &Handle| handle_ptr(client, h);
    let (q_ptr, k_ptr, v_ptr, out_ptr) = (ptr(q)?, ptr(k)?, ptr(v)?, ptr(out)?);
    let (s_ptr, p_ptr) = (ptr(&scores)?, ptr(&probs)?);
    let bf16_out = StorageType::Scalar(ElemType::Float(FloatKind::BF16));

    // The output GEMM of the previous work unit, issued with the next score GEMM.
    let mut pending: Option<CublasCall> = None;
    for blk in &blocks {
        for kv in 0..shape.kv_heads {
            let score = CublasCall::new(
                &score_gemm(shape, blk, kv),
                (k_ptr, BF16),
                (q_ptr, BF16),
                (s_ptr, F32),
            )?;
            let calls: Vec<CublasCall> = pending.take().into_iter().chain([score]).collect();
            blas.run(client, "cublasGemmStridedBatchedEx (attention)", |h| {
                calls.iter().try_for_each(|c| c.launch(h))
            })?;
            causal_softmax_rows_as(
                client,
                &scores,
                &probs,
                &softmax_shape(shape, blk),
                bf16_out,
            )?;
            pending = Some(CublasCall::new(
                &output_gemm(shape, blk, kv),
                (v_ptr, BF16),
                (p_ptr, BF16),
                (out_ptr, BF16),
            )?);
        }
    }
    if let Some(last) = pending {
        blas.run(client, "cublasGemmStridedBatchedEx (attention)", |h| {
            last.launch(h)
        })?;
    }
    // `scores` and `probs` are dropped here: every call that used their pointers has
    // completed (`run` synchronizes).
    Ok(())
}

/// A buffer's element type as cuBLAS names it, with its size.
#[derive(Debug, Clone, Copy)]
struct DataType(cudaDataType, usize);

const BF16: DataType = DataType(cudaDataType::CUDA_R_16BF, BF16_BYTES);
const F32: DataType = DataType(cudaDataType::CUDA_R_32F, F32_BYTES);

/// One strided batched operand as cuBLAS takes it: pointer, leading dimension, batch stride,
/// type.
#[derive(Debug, Clone, Copy)]
struct CublasOperand {
    ptr: u64,
    ld: i32,
    stride: i64,
    ty: cudaDataType,
}

impl CublasOperand {
    fn new(op: &Operand, (base, ty): (u64, DataType)) -> Result<Self, KernelError> {
        let bytes = op
            .offset
            .checked_mul(ty.1)
            .and_then(|b| u64::try_from(b).ok())
            .ok_or_else(|| KernelError::unsupported("attention operand", "offset overflows"))?;
        Ok(Self {
            ptr: base + bytes,
            ld: dim_i32("attention leading dimension", op.ld.max(1))?,
            stride: i64::try_from(op.stride).map_err(|_| {
                KernelError::unsupported("attention batch stride", format!("{}", op.stride))
            })?,
            ty: ty.0,
        })
    }
}

/// A [`StridedGemm`] with its buffers' addresses and checked 32/64-bit integers.
#[derive(Debug, Clone, Copy)]
struct CublasCall {
    op_a: cublasOperation_t,
    op_b: cublasOperation_t,
    m: i32,
    n: i32,
    k: i32,
    a: CublasOperand,
    b: CublasOperand,
    c: CublasOperand,
    batch: i32,
    alpha: f32,
    beta: f32,
}

impl CublasCall {
    /// `a`, `b`, `c`: the base address and element type of the buffer of each operand.
    fn new(
        g: &StridedGemm,
        a: (u64, DataType),
        b: (u64, DataType),
        c: (u64, DataType),
    ) -> Result<Self, KernelError> {
        let op = |t: bool| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        Ok(Self {
            op_a: op(g.trans_a),
            op_b: op(g.trans_b),
            m: dim_i32("attention gemm m", g.m)?,
            n: dim_i32("attention gemm n", g.n)?,
            k: dim_i32("attention gemm k", g.k)?,
            a: CublasOperand::new(&g.a, a)?,
            b: CublasOperand::new(&g.b, b)?,
            c: CublasOperand::new(&g.c, c)?,
            batch: dim_i32("attention gemm batch", g.batch)?,
            alpha: g.alpha,
            beta: 0.0,
        })
    }

    fn launch(&self, handle: sys::cublasHandle_t) -> Result<(), KernelError> {
        // SAFETY: the pointers come from live CubeCL buffers (the inputs, checked against the
        // attention shape, and the scratch buffers, sized by `attention_blocking`) and every
        // operand window lies inside its buffer (the index arithmetic is tested against a
        // host emulation of these very calls); alpha and beta are host scalars (cuBLAS's
        // default pointer mode) that outlive the call, which completes before `run` returns.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                handle,
                self.op_a,
                self.op_b,
                self.m,
                self.n,
                self.k,
                (&self.alpha as *const f32).cast(),
                self.a.ptr as *const _,
                self.a.ty,
                self.a.ld,
                self.a.stride,
                self.b.ptr as *const _,
                self.b.ty,
                self.b.ld,
                self.b.stride,
                (&self.beta as *const f32).cast(),
                self.c.ptr as *mut _,
                self.c.ty,
                self.c.ld,
                self.c.stride,
                self.batch,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| KernelError::Launch {
            what: "cublasGemmStridedBatchedEx (attention)",
            message: format!("{e:?}"),
        })
    }
}

#[cfg(test)]
mod tests {
    //! The blocking, and the exact GEMM descriptors the device function issues executed by a
    //! host emulation of `cublasGemmStridedBatchedEx` (column-major, op flags, leading
    //! dimensions, batch strides; panics on any out-of-buffer index) together with a host
    //! softmax of the kernel's contract, against a direct f64 attention.

    use super::*;

    /// `C_j ← α·op(A_j)·op(B_j)` as cuBLAS defines it; counts the writes per element of `c`.
    fn emulate(g: &StridedGemm, a: &[f64], b: &[f64], c: &mut [f64], writes: &mut [u32]) {
        for j in 0..g.batch {
            let (a0, b0, c0) = (
                g.a.offset + j * g.a.stride,
                g.b.offset + j * g.b.stride,
                g.c.offset + j * g.c.stride,
            );
            for col in 0..g.n {
                for row in 0..g.m {
                    let mut sum = 0.0;
                    for p in 0..g.k {
                        let x = if g.trans_a {
                            a[a0 + p + row * g.a.ld]
                        } else {
                            a[a0 + row + p * g.a.ld]
                        };
                        let y = if g.trans_b {
                            b[b0 + col + p * g.b.ld]
                        } else {
                            b[b0 + p + col * g.b.ld]
                        };
                        sum += x * y;
                    }
                    let at = c0 + row + col * g.c.ld;
                    c[at] = g.alpha as f64 * sum;
                    writes[at] += 1;
                }
            }
        }
    }

    /// The contract of `causal_softmax_rows` on dense `[batch, rows, keys]`.
    fn softmax(shape: &SoftmaxShape, s: &[f64], p: &mut [f64]) {
        for row in 0..shape.batch * shape.rows {
            let base = row * shape.keys;
            let valid = (shape.first_query + row % shape.rows + 1).min(shape.keys);
            let m = s[base..base + valid]
                .iter()
                .cloned()
                .fold(f64::MIN, f64::max);
            let sum: f64 = s[base..base + valid].iter().map(|x| (x - m).exp()).sum();
            for c in 0..shape.keys {
                p[base + c] = if c < valid {
                    (s[base + c] - m).exp() / sum
                } else {
                    0.0
                };
            }
        }
    }

    /// The device function's loop on the host, with scratch buffers of exactly
    /// `scratch_elements` (so that an operand outside them panics).
    fn blocked(
        shape: &AttentionShape,
        offsets: &[usize],
        block: usize,
        scratch_elements: usize,
        [q, k, v]: [&[f64]; 3],
    ) -> Vec<f64> {
        let mut out = vec![f64::NAN; q.len()];
        let mut writes = vec![0u32; q.len()];
        let mut s = vec![0.0; scratch_elements];
        let mut p = vec![0.0; scratch_elements];
        let mut scratch_writes = vec![0u32; scratch_elements];
        for blk in &query_blocks(offsets, block) {
            for kv in 0..shape.kv_heads {
                let sm = softmax_shape(shape, blk);
                emulate(
                    &score_gemm(shape, blk, kv),
                    k,
                    q,
                    &mut s,
                    &mut scratch_writes,
                );
                softmax(&sm, &s, &mut p);
                emulate(&output_gemm(shape, blk, kv), v, &p, &mut out, &mut writes);
            }
        }
        assert!(writes.iter().all(|&w| w == 1), "every output written once");
        out
    }

    /// The definition, one query at a time.
    fn direct(shape: &AttentionShape, offsets: &[usize], [q, k, v]: [&[f64]; 3]) -> Vec<f64> {
        let (heads, kv_heads, d, g) = (shape.heads, shape.kv_heads, shape.head_dim, shape.group());
        let mut out = vec![0.0; q.len()];
        for w in offsets.windows(2) {
            for t in w[0]..w[1] {
                for h in 0..heads {
                    let kv = h / g;
                    let qrow = &q[(t * heads + h) * d..][..d];
                    let scores: Vec<f64> = (w[0]..=t)
                        .map(|j| {
                            let krow = &k[(j * kv_heads + kv) * d..][..d];
                            shape.scale as f64
                                * qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for c in 0..d {
                        out[(t * heads + h) * d + c] = (w[0]..=t)
                            .zip(&e)
                            .map(|(j, p)| p * v[(j * kv_heads + kv) * d + c])
                            .sum::<f64>()
                            / sum;
                    }
                }
            }
        }
        out
    }

    fn random(n: usize, seed: &mut u64) -> Vec<f64> {
        (0..n)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((*seed >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn the_blocked_descriptors_compute_causal_gqa_attention() {
        let mut seed = 7;
        for (heads, kv_heads, d, lengths, block) in [
            (4, 2, 16, vec![7, 1, 12], 3),
            (4, 1, 16, vec![5], 5),
            (2, 2, 32, vec![9, 4], 4),
            (8, 2, 16, vec![13], 1),
            (6, 3, 16, vec![2, 11, 6], 64),
        ] {
            let shape = AttentionShape {
                heads,
                kv_heads,
                head_dim: d,
                scale: 1.0 / (d as f32).sqrt(),
            };
            let mut offsets = vec![0];
            for len in &lengths {
                offsets.push(offsets.last().unwrap() + len);
            }
            let tokens = *offsets.last().unwrap();
            let q = random(tokens * heads * d, &mut seed);
            let k = random(tokens * kv_heads * d, &mut seed);
            let v = random(tokens * kv_heads * d, &mut seed);
            let longest = *lengths.iter().max().unwrap();
            let scratch = shape.group() * block.min(longest) * longest;
            let got = blocked(&shape, &offsets, block, scratch, [&q, &k, &v]);
            let want = direct(&shape, &offsets, [&q, &k, &v]);
            let err = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(
                err < 1e-12,
                "{heads}/{kv_heads}/{d} {lengths:?} block {block}: {err}"
            );
        }
    }

    #[test]
    fn query_blocks_tile_each_sequence() {
        let blocks = query_blocks(&[0, 5, 6, 14], 4);
        let spans: Vec<_> = blocks.iter().map(|b| (b.seq_start, b.q0, b.q1)).collect();
        assert_eq!(
            spans,
            [(0, 0, 4), (0, 4, 5), (5, 5, 6), (6, 6, 10), (6, 10, 14)]
        );
        assert_eq!(blocks[4].keys(), 8);
        assert_eq!(blocks[4].rows(), 4);
    }

    #[test]
    fn the_block_fits_the_budget_at_the_model_shape() {
        let shape = AttentionShape {
            heads: 32,
            kv_heads: 2,
            head_dim: 128,
            scale: 0.088,
        };
        let at = |longest: usize| attention_blocking(&shape, &[0, 3, 3 + longest]).unwrap();
        let b = at(131072);
        assert_eq!(b.block, 256);
        assert_eq!(b.scratch_elements * F32_BYTES, SCORE_BUDGET_BYTES);
        assert_eq!(b.query_blocks, 1 + 512);
        assert_eq!(at(32768).block, 1024);
        assert_eq!(at(65536).block, 512);
        assert_eq!(at(100).block, 100);
        assert_eq!(at(100).scratch_elements, 16 * 100 * 100);
        // Past the budget at the smallest block.
        let huge = at(1 << 20);
        assert_eq!(huge.block, MIN_BLOCK);
        assert!(huge.scratch_elements * F32_BYTES > SCORE_BUDGET_BYTES);
        // Every block's scores fit the scratch.
        for len in [1, 63, 64, 65, 1000, 4097, 131072, 200_000] {
            let b = at(len);
            for blk in query_blocks(&[0, 3, 3 + len], b.block) {
                assert!(shape.group() * blk.rows() * blk.keys() <= b.scratch_elements);
            }
        }
        assert!(attention_blocking(&shape, &[0]).is_err());
        assert!(attention_blocking(
            &AttentionShape {
                kv_heads: 3,
                ..shape
            },
            &[0, 4]
        )
        .is_err());
    }

    #[test]
    fn cublas_integers_are_checked() {
        let g = StridedGemm {
            trans_a: false,
            trans_b: false,
            m: 1 << 31,
            n: 1,
            k: 1,
            a: Operand {
                offset: 0,
                ld: 1,
                stride: 0,
            },
            b: Operand {
                offset: 0,
                ld: 1,
                stride: 0,
            },
            c: Operand {
                offset: 0,
                ld: 1,
                stride: 0,
            },
            batch: 1,
            alpha: 1.0,
        };
        assert!(CublasCall::new(&g, (0, BF16), (0, BF16), (0, F32)).is_err());
        let ok = StridedGemm { m: 4, ..g };
        let call = CublasCall::new(&ok, (0, BF16), (0, BF16), (1000, F32)).unwrap();
        assert_eq!((call.m, call.a.ld, call.c.ptr), (4, 1, 1000));
    }
}
