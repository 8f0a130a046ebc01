//! Textbook implementations, kept deliberately simple: the references the optimised paths of
//! this crate (and the GPU kernels) are tested against.
//!
//! - [`gptq_sequential`]: GPTQ one column at a time, every update applied at once (no lazy
//!   blocks, no GEMM, one thread);
//! - [`inverse_upper_textbook`]: IST-DASLab's `chol(cholesky_inverse(chol(H)), upper)`;
//! - [`hessian_naive`]: `Σ XᵀX` by a triple loop in f64;
//! - [`nvfp4_block_search_naive`]: every candidate of every block, one thread;
//! - [`gptq_column_loop`]: only the sequential column loop, on prepared `(W, U)`;
//! - [`nvfp4_gptq_sequential`]: GPTQ on the NVFP4 grid one column at a time.

use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::cholesky::llt::factor::{cholesky_in_place, cholesky_in_place_scratch};
use faer::linalg::cholesky::llt::inverse::{inverse, inverse_scratch};
use faer::{Mat, MatRef, Par};
use sala_formats::{IntQuantizer, QuantParams, NVFP4_BLOCK};

use crate::block_search::{block_error, encode_into, Nvfp4BlockSearch, Nvfp4SearchResult};
use crate::error::HessianError;
use crate::gptq::{
    quantize_column, ColumnGrid, ColumnProblem, ColumnSolution, Gptq, GptqColumnLoop, GptqConfig,
};
use crate::hessian::{Hessian, Normalization};
use crate::inverse::{dead_columns, diagonal_f64, mean_fixed_diagonal};
use crate::quantized::QuantizedLinear;
use crate::scalar::HessianScalar;

/// GPTQ with the textbook sequential column loop (the same preparation as
/// [`Gptq::solve`]: dead columns, act-order, static groups, damping, un-permutation).
pub fn gptq_sequential<T: HessianScalar>(
    config: &GptqConfig,
    weights: &[f32],
    out: usize,
    inp: usize,
    h: &Hessian<T>,
) -> Result<QuantizedLinear, HessianError> {
    Gptq::new(*config)?.solve_with_loop(weights, out, inp, h, &SequentialLoop)
}

/// The textbook column loop as a [`GptqColumnLoop`]: one column at a time, each error
/// applied to the rest of the row at once (no lazy blocks).
#[derive(Debug, Clone, Copy, Default)]
pub struct SequentialLoop;

impl GptqColumnLoop for SequentialLoop {
    fn run(
        &self,
        problem: &ColumnProblem<'_>,
        w: &mut [f32],
    ) -> Result<ColumnSolution, HessianError> {
        Ok(sequential_loop(problem, w))
    }
}

/// The output of [`gptq_column_loop`], in the loop order of its input.
#[derive(Debug, Clone, PartialEq)]
pub struct ColumnLoopResult {
    /// Codes, `[out, inp]`.
    pub codes: Vec<u8>,
    /// Group parameters, `[out, groups]` (row-major: all groups of row 0 first).
    pub params: Vec<QuantParams>,
    /// `Σ (w − q)²/(2·U[c,c]²)` per column, `[inp]`.
    pub column_loss: Vec<f64>,
    /// The error-updated weights after the loop, `[out, inp]`: column `c` holds the value it
    /// was quantized from (later columns never write to it).
    pub weights: Vec<f32>,
}

/// Only the textbook column loop of GPTQ, on an already prepared problem: `weights [out, inp]`
/// in loop order and `upper [inp, inp]` (the upper Cholesky factor of the damped `H⁻¹` in the
/// same order, e.g. from [`inverse_upper_textbook`]), dynamic groups of `group_size` columns.
///
/// The reference of the GPU kernels, which take the same prepared inputs (no dead-column,
/// act-order or damping step here).
pub fn gptq_column_loop(
    weights: &[f32],
    out: usize,
    inp: usize,
    upper: MatRef<'_, f32>,
    quantizer: IntQuantizer,
    group_size: usize,
) -> Result<ColumnLoopResult, HessianError> {
    crate::error::check_matrix("weights", weights.len(), out, inp)?;
    if upper.nrows() != inp || upper.ncols() != inp {
        return Err(HessianError::DimensionMismatch {
            what: "upper factor vs weight columns",
            left: upper.nrows(),
            right: inp,
        });
    }
    if group_size == 0 {
        return Err(sala_formats::FormatError::ZeroGroupSize.into());
    }
    let problem = ColumnProblem {
        quantizer,
        out,
        inp,
        group_size: group_size.min(inp),
        block_size: 1,
        upper,
        static_groups: None,
        clip: None,
    };
    let mut updated = weights.to_vec();
    let sol = sequential_loop(&problem, &mut updated);
    Ok(ColumnLoopResult {
        codes: sol.codes,
        params: sol.params_rows,
        column_loss: sol.column_loss,
        weights: updated,
    })
}

/// The column loop one column at a time: quantize column `c`, then subtract
/// `e · U[c, c+1..]` from the rest of the row immediately.
pub(crate) fn sequential_loop<G: ColumnGrid>(
    problem: &G,
    w: &mut [f32],
) -> ColumnSolution<G::Param> {
    let (out, inp, groups) = (problem.out(), problem.inp(), problem.groups());
    let upper = problem.upper();
    let mut sol = ColumnSolution::filled(out, inp, groups, problem.placeholder());
    for r in 0..out {
        let w_row = &mut w[r * inp..(r + 1) * inp];
        let params_row = &mut sol.params_rows[r * groups..(r + 1) * groups];
        for c in 0..inp {
            let (code, e, loss) = quantize_column(problem, r, c, w_row, params_row);
            sol.codes[r * inp + c] = code;
            sol.column_loss[c] += loss;
            for (j, wj) in w_row.iter_mut().enumerate().skip(c + 1) {
                *wj -= e * upper[(c, j)];
            }
        }
    }
    sol
}

/// `U = chol(cholesky_inverse(chol(H + λI)), upper)` in f64, natural column order, dead
/// columns given a unit diagonal, `λ = percdamp · mean(diag H)` (no retries).
pub fn inverse_upper_textbook<T: HessianScalar>(
    h: &Hessian<T>,
    percdamp: f64,
) -> Result<Mat<f64>, HessianError> {
    let n = h.dim();
    let diag = diagonal_f64(h);
    let dead = dead_columns(&diag);
    let damp = percdamp * mean_fixed_diagonal(&diag, &dead);
    let mut l = Mat::<f64>::from_fn(n, n, |i, j| {
        let v = if i == j && dead[i] {
            1.0
        } else {
            h.get(i.max(j), i.min(j)).into()
        };
        if i == j {
            v + damp
        } else {
            v
        }
    });
    cholesky_lower(&mut l, percdamp)?;
    let mut h_inv = Mat::<f64>::zeros(n, n);
    let mut mem = MemBuffer::new(inverse_scratch::<f64>(n, Par::Seq));
    inverse(
        h_inv.as_mut(),
        l.as_ref(),
        Par::Seq,
        MemStack::new(&mut mem),
    );
    for j in 0..n {
        for i in 0..j {
            h_inv[(i, j)] = h_inv[(j, i)];
        }
    }
    cholesky_lower(&mut h_inv, percdamp)?;
    Ok(Mat::from_fn(
        n,
        n,
        |i, j| if i <= j { h_inv[(j, i)] } else { 0.0 },
    ))
}

fn cholesky_lower(a: &mut Mat<f64>, percdamp: f64) -> Result<(), HessianError> {
    let n = a.nrows();
    let mut mem = MemBuffer::new(cholesky_in_place_scratch::<f64>(
        n,
        Par::Seq,
        Default::default(),
    ));
    cholesky_in_place(
        a.as_mut(),
        Default::default(),
        Par::Seq,
        MemStack::new(&mut mem),
        Default::default(),
    )
    .map_err(|_| HessianError::NotPositiveDefinite {
        attempts: 1,
        last_damp: f64::NAN,
        last_percdamp: percdamp,
    })?;
    Ok(())
}

/// `Σ XᵀX` over samples `(activations [tokens, dim], tokens)`, normalized like
/// [`HessianAccumulator`](crate::HessianAccumulator), by a triple loop in f64. Row-major
/// `[dim, dim]`.
pub fn hessian_naive(
    samples: &[(&[f32], usize)],
    dim: usize,
    normalization: Normalization,
) -> Vec<f64> {
    let mut h = vec![0.0f64; dim * dim];
    let mut tokens_total = 0usize;
    for &(x, tokens) in samples {
        let weight = match normalization {
            Normalization::PerSample => 1.0 / tokens as f64,
            Normalization::PerToken => 1.0,
        };
        for i in 0..dim {
            for j in 0..dim {
                let dot: f64 = (0..tokens)
                    .map(|t| x[t * dim + i] as f64 * x[t * dim + j] as f64)
                    .sum();
                h[i * dim + j] += dot * weight;
            }
        }
        tokens_total += tokens;
    }
    let divisor = match normalization {
        Normalization::PerSample => samples.len() as f64,
        Normalization::PerToken => tokens_total as f64,
    };
    h.iter().map(|v| v / divisor).collect()
}

/// The block-scale search evaluating all `iters` candidates of every block, one thread.
pub fn nvfp4_block_search_naive(
    search: &Nvfp4BlockSearch,
    weights: &[f32],
    rows: usize,
    cols: usize,
    diag_h: &[f32],
    global_scale: f32,
) -> Result<Nvfp4SearchResult, HessianError> {
    let h = search.check(weights, rows, cols, diag_h, global_scale)?;
    let mut result = Nvfp4SearchResult::zeros(rows, cols, global_scale);
    for (b, block) in weights.chunks_exact(NVFP4_BLOCK).enumerate() {
        let col0 = (b * NVFP4_BLOCK) % cols;
        let hb = &h[col0..col0 + NVFP4_BLOCK];
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let mut best = (0u8, f32::INFINITY);
        for i in 0..search.iters {
            let byte = search.candidate(amax, global_scale, i);
            let err = block_error(block, hb, byte, global_scale, search.error_norm);
            if err < best.1 {
                best = (byte, err);
            }
        }
        result.block_scales[b] = best.0;
        result.block_error[b] = best.1;
        let span = b * NVFP4_BLOCK..(b + 1) * NVFP4_BLOCK;
        encode_into(
            block,
            best.0,
            global_scale,
            &mut result.codes[span.clone()],
            &mut result.dequantized[span],
        );
    }
    Ok(result)
}

/// [`crate::Nvfp4Gptq::solve`] one column at a time (every update applied at once, one
/// thread), from the same factor and grid: returns the E2M1 codes `[rows, cols]` and the E4M3
/// block scales `[rows, cols/16]`. Errors as the solver's; no fallback.
pub fn nvfp4_gptq_sequential<T: HessianScalar>(
    solver: &crate::Nvfp4Gptq,
    weights: &[f32],
    rows: usize,
    cols: usize,
    h: &Hessian<T>,
    global_scale: f32,
) -> Result<(Vec<u8>, Vec<u8>), HessianError> {
    crate::quantized::check_weights(weights, rows, cols, Some(h.dim()))?;
    let diag = crate::nvfp4_gptq::hessian_diagonal(h);
    let channel_weights = solver.search.channel_weights(cols, &diag, global_scale)?;
    let natural: Vec<usize> = (0..cols).collect();
    let inverse = crate::CholeskyInverse::with_order(h, &natural, &solver.damping)?;
    let mut w = weights.to_vec();
    crate::nvfp4_gptq::zero_dead_columns(&mut w, cols, inverse.dead());
    let grid = crate::nvfp4_gptq::Nvfp4Columns {
        rows,
        cols,
        upper: inverse.upper(),
        search: &solver.search,
        channel_weights: &channel_weights,
        global_scale,
    };
    let sol = sequential_loop(&grid, &mut w);
    Ok((sol.codes, sol.params_rows))
}
