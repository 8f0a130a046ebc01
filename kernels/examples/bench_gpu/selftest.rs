//! Small correctness checks of the CUDA glue, run before the timings: every transpose
//! combination of both GEMMs on strided windows (and that nothing outside the output window
//! changes), the bf16 XᵀX, and the cuSOLVER factor against the textbook f64 route. A wrong
//! layout or leading dimension shows up here with a precise message instead of as a bad
//! GPTQ loss later.

use sala_hessian::{reference, Hessian};
use sala_kernels::cuda::{inverse_upper_cusolver, xtx_bf16, Bf16Matrix, CublasGemm, Fp32Math};
use sala_kernels::{CubeGemm, Gemm, MatrixView};

use crate::data;
use crate::report::{Json, Row};
use crate::stages::{stage, Gpu, Stage};

/// Tolerance of an f32 result against an f64 reference, relative to the largest value.
const TOLERANCE: f64 = 1e-4;

/// A deterministic pseudo-random matrix in [-1, 1).
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        })
        .collect()
}

/// A `rows × cols` window at `(1, 2)` of a larger buffer (row stride `cols + 5`), with its
/// values; the full buffer is returned too (to check what lies outside the window).
fn strided(gpu: &Gpu, rows: usize, cols: usize, seed: u64) -> Stage<(MatrixView, Vec<f32>)> {
    let (full_rows, stride) = (rows + 3, cols + 5);
    let full = values(full_rows * stride, seed);
    let view = MatrixView::upload(&gpu.client, &full, full_rows, stride)
        .and_then(|v| v.window(1, 2, rows, cols))
        .map_err(|e| e.to_string())?;
    Ok((view, full))
}

/// Element `(i, j)` of `op(x)` for a window at `(1, 2)` of a buffer with row stride `stride`.
fn at(full: &[f32], stride: usize, trans: bool, i: usize, j: usize) -> f64 {
    let (r, c) = if trans { (j, i) } else { (i, j) };
    full[(1 + r) * stride + 2 + c] as f64
}

/// All four transpose combinations of `gemm`; the worst relative error, and whether every
/// element outside the output window kept its value.
fn check_gemm(gpu: &Gpu, gemm: &dyn Gemm<cubecl::cuda::CudaRuntime>) -> Stage<(f64, bool)> {
    let (m, n, k) = (37, 45, 29);
    let (alpha, beta) = (0.7f32, 0.3f32);
    let mut worst = 0.0f64;
    let mut untouched = true;
    for (case, (ta, tb)) in [(false, false), (true, false), (false, true), (true, true)]
        .into_iter()
        .enumerate()
    {
        let seed = 10 * case as u64;
        let (a_shape, b_shape) = (
            if ta { (k, m) } else { (m, k) },
            if tb { (n, k) } else { (k, n) },
        );
        let (a, a_full) = strided(gpu, a_shape.0, a_shape.1, seed + 1)?;
        let (b, b_full) = strided(gpu, b_shape.0, b_shape.1, seed + 2)?;
        let (c, c_full) = strided(gpu, m, n, seed + 3)?;
        gemm.gemm(&gpu.client, alpha, &a, ta, &b, tb, beta, &c)
            .map_err(|e| e.to_string())?;
        let (full_rows, stride) = (m + 3, n + 5);
        let whole = MatrixView {
            offset: 0,
            rows: full_rows,
            cols: stride,
            row_stride: stride,
            ..c.clone()
        };
        let got = whole.download(&gpu.client).map_err(|e| e.to_string())?;
        let (mut diff, mut scale) = (0.0f64, 0.0f64);
        for r in 0..full_rows {
            for col in 0..stride {
                let idx = r * stride + col;
                let inside = (1..1 + m).contains(&r) && (2..2 + n).contains(&col);
                if !inside {
                    untouched &= got[idx] == c_full[idx];
                    continue;
                }
                let (i, j) = (r - 1, col - 2);
                let dot: f64 = (0..k)
                    .map(|p| {
                        at(&a_full, a_shape.1 + 5, ta, i, p) * at(&b_full, b_shape.1 + 5, tb, p, j)
                    })
                    .sum();
                let want = alpha as f64 * dot + beta as f64 * c_full[idx] as f64;
                diff = diff.max((got[idx] as f64 - want).abs());
                scale = scale.max(want.abs());
            }
        }
        let rel = diff / scale.max(f64::MIN_POSITIVE);
        if rel > TOLERANCE {
            return Err(format!(
                "trans_a {ta}, trans_b {tb}: max relative error {rel:.3e} > {TOLERANCE:e}"
            ));
        }
        worst = worst.max(rel);
    }
    Ok((worst, untouched))
}

fn gemm_row(
    kernel: &'static str,
    gpu: &Gpu,
    gemm: &dyn Gemm<cubecl::cuda::CudaRuntime>,
) -> Stage<Row> {
    let (rel, untouched) = check_gemm(gpu, gemm)?;
    if !untouched {
        return Err("elements outside the output window changed (leading dimension?)".into());
    }
    Ok(Row {
        kernel,
        ..Default::default()
    }
    .extra("max_rel", Json::Num(rel)))
}

/// `XᵀX/tokens` of bf16 activations against an f64 reference.
fn check_xtx(gpu: &Gpu) -> Stage<Row> {
    let blas = gpu.blas()?;
    let (tokens, dim) = (70, 40);
    let x: Vec<u16> = values(tokens * dim, 99)
        .iter()
        .map(|&v| data::f32_to_bf16(v))
        .collect();
    let xd = Bf16Matrix::upload(&gpu.client, &x, tokens, dim).map_err(|e| e.to_string())?;
    let h = MatrixView::zeros(&gpu.client, dim, dim).map_err(|e| e.to_string())?;
    xtx_bf16(&gpu.client, blas, &xd, &h, 1.0 / tokens as f32, 0.0).map_err(|e| e.to_string())?;
    let got = h.download(&gpu.client).map_err(|e| e.to_string())?;
    let xf = |t: usize, c: usize| data::bf16_to_f32(x[t * dim + c]) as f64;
    let want: Vec<f64> = (0..dim * dim)
        .map(|k| {
            (0..tokens)
                .map(|t| xf(t, k / dim) * xf(t, k % dim))
                .sum::<f64>()
                / tokens as f64
        })
        .collect();
    let rel = rel_error(&got, &want);
    if rel > TOLERANCE {
        return Err(format!("max relative error {rel:.3e} > {TOLERANCE:e}"));
    }
    Ok(Row {
        kernel: "selftest_xtx_bf16",
        ..Default::default()
    }
    .extra("max_rel", Json::Num(rel)))
}

fn rel_error(got: &[f32], want: &[f64]) -> f64 {
    let diff = got
        .iter()
        .zip(want)
        .fold(0.0f64, |m, (&g, &w)| m.max((g as f64 - w).abs()));
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    diff / scale.max(f64::MIN_POSITIVE)
}

/// The cuSOLVER factor of a small damped `XᵀX` (as a strided window) against
/// `reference::inverse_upper_textbook` in f64.
fn check_inverse(gpu: &Gpu) -> Stage<Row> {
    let solver = gpu.solver()?;
    let (tokens, n) = (90, 64);
    let x = values(tokens * n, 7);
    let mut h = vec![0.0f64; n * n];
    for t in 0..tokens {
        for i in 0..n {
            for j in 0..n {
                h[i * n + j] += (x[t * n + i] * x[t * n + j]) as f64 / tokens as f64;
            }
        }
    }
    let h32: Vec<f32> = h.iter().map(|&v| v as f32).collect();
    let damp = 0.01 * (0..n).map(|i| h32[i * n + i] as f64).sum::<f64>() / n as f64;
    let mut damped = h32.clone();
    for i in 0..n {
        damped[i * n + i] += damp as f32;
    }
    // The damped H inside a larger buffer, to exercise the window offset and stride.
    let stride = n + 5;
    let mut full = values((n + 3) * stride, 8);
    for i in 0..n {
        full[(1 + i) * stride + 2..(1 + i) * stride + 2 + n]
            .copy_from_slice(&damped[i * n..(i + 1) * n]);
    }
    let view = MatrixView::upload(&gpu.client, &full, n + 3, stride)
        .and_then(|v| v.window(1, 2, n, n))
        .map_err(|e| e.to_string())?;
    let u = inverse_upper_cusolver(&gpu.client, solver, &view).map_err(|e| e.to_string())?;
    let got = u.download(&gpu.client).map_err(|e| e.to_string())?;
    let hessian = Hessian::from_row_major(n, &h32).map_err(|e| e.to_string())?;
    let textbook = reference::inverse_upper_textbook(&hessian, 0.01).map_err(|e| e.to_string())?;
    let want: Vec<f64> = (0..n * n).map(|k| textbook[(k / n, k % n)]).collect();
    let rel = rel_error(&got, &want);
    let lower_zero = (0..n * n).all(|k| k / n <= k % n || got[k] == 0.0);
    if !lower_zero {
        return Err("the strict lower triangle of U is not zero".into());
    }
    if rel > 1e-3 {
        return Err(format!(
            "max relative error vs the f64 textbook factor {rel:.3e} > 1e-3"
        ));
    }
    Ok(Row {
        kernel: "selftest_inverse",
        ..Default::default()
    }
    .extra("max_rel", Json::Num(rel)))
}

/// Every self-test, one row each.
pub fn run(gpu: &Gpu) -> Vec<Row> {
    vec![
        stage("selftest_gemm_cubecl", || {
            gemm_row("selftest_gemm_cubecl", gpu, &CubeGemm)
        }),
        stage("selftest_gemm_cublas", || {
            let blas = gpu.blas()?;
            let gemm = CublasGemm::new(blas.clone(), Fp32Math::Pedantic);
            gemm_row("selftest_gemm_cublas", gpu, &gemm)
        }),
        stage("selftest_xtx_bf16", || check_xtx(gpu)),
        stage("selftest_inverse", || check_inverse(gpu)),
    ]
}
