//! `accumulate_xtx` against `reference::hessian_naive` for both normalizations.

use sala_hessian::reference::hessian_naive;
use sala_hessian::Normalization;
use sala_kernels::hessian::{accumulate_xtx, normalization_weight};
use sala_kernels::{CubeGemm, KernelError, MatrixView};

use crate::common::{client, max_rel_diff, Rng};

#[test]
fn accumulated_xtx_matches_the_naive_hessian_for_both_normalizations() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(3);
    let dim = 48;
    let samples: Vec<(Vec<f32>, usize)> = [37usize, 21, 64]
        .iter()
        .map(|&tokens| (rng.vec(tokens * dim), tokens))
        .collect();
    for normalization in [Normalization::PerSample, Normalization::PerToken] {
        let h = MatrixView::zeros(&client, dim, dim).unwrap();
        for (x, tokens) in &samples {
            let x = MatrixView::upload(&client, x, *tokens, dim).unwrap();
            let weight = normalization_weight(normalization, x.rows);
            accumulate_xtx(&client, &CubeGemm, &x, weight, &h).unwrap();
        }
        let divisor = match normalization {
            Normalization::PerSample => samples.len() as f64,
            Normalization::PerToken => samples.iter().map(|s| s.1).sum::<usize>() as f64,
        };
        let got: Vec<f32> = h
            .download(&client)
            .unwrap()
            .iter()
            .map(|&v| (v as f64 / divisor) as f32)
            .collect();
        let refs: Vec<(&[f32], usize)> = samples.iter().map(|(x, t)| (x.as_slice(), *t)).collect();
        let want = hessian_naive(&refs, dim, normalization);
        // Relative to the diagonal's scale (off-diagonal sums of random signs are small).
        let err = max_rel_diff(&got, &want, 0.1);
        assert!(err < 1e-5, "{normalization:?}: relative error {err}");
    }
}

#[test]
fn accumulate_xtx_checks_shapes() {
    let Some(client) = client() else {
        return;
    };
    let x = MatrixView::zeros(&client, 5, 8).unwrap();
    let h = MatrixView::zeros(&client, 8, 7).unwrap();
    let err = accumulate_xtx(&client, &CubeGemm, &x, 1.0, &h).unwrap_err();
    assert!(matches!(err, KernelError::Shape { .. }), "{err}");
}

/// On CUDA only (`--features cuda`, an NVIDIA GPU): the blocked, symmetric cuBLAS Hessian
/// over weighted runs of rows against the f64 sum. CI never builds these.
#[cfg(feature = "cuda")]
mod cuda_runs {
    use half::bf16;
    use sala_kernels::cuda::{xtx_runs_bf16, Bf16Matrix, Cublas, XtxRun, XTX_BLOCK};
    use sala_kernels::{DeviceVec, MatrixView};

    use crate::common::{client, Rng};

    #[test]
    fn weighted_runs_match_the_f64_sum_and_are_exactly_symmetric() {
        let Some(client) = client() else {
            return;
        };
        let blas = Cublas::new(0).unwrap();
        let mut rng = Rng::new(71);
        // Three blocks, the last one ragged; runs of different weights, one empty, rows left
        // out between them.
        let (tokens, dim) = (300, 2 * XTX_BLOCK + 100);
        let x: Vec<f32> = (0..tokens * dim)
            .map(|_| bf16::from_f32(rng.normal()).to_f32())
            .collect();
        let bits: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        let xm = Bf16Matrix::upload(&client, &bits, tokens, dim).unwrap();
        let runs = [
            XtxRun {
                first_row: 0,
                rows: 100,
                weight: 0.01,
            },
            XtxRun {
                first_row: 100,
                rows: 0,
                weight: 5.0,
            },
            XtxRun {
                first_row: 120,
                rows: 180,
                weight: 1.0 / 180.0,
            },
        ];
        // h starts symmetric and non-zero: the products accumulate into it.
        let h0: Vec<f32> = (0..dim * dim)
            .map(|e| {
                let (r, c) = (e / dim, e % dim);
                ((r.min(c) * 7 + r.max(c) * 3) % 11) as f32 - 5.0
            })
            .collect();
        let h = DeviceVec::upload(&client, &h0);
        let view = MatrixView {
            handle: h.handle.clone(),
            offset: 0,
            rows: dim,
            cols: dim,
            row_stride: dim,
        };
        xtx_runs_bf16(&client, &blas, &xm, &runs, &view).unwrap();
        let got: Vec<f32> = h.download(&client).unwrap();
        // Column-major copy: the reference reads columns of x as contiguous rows.
        let xt: Vec<f64> = (0..dim * tokens)
            .map(|e| x[(e % tokens) * dim + e / tokens] as f64)
            .collect();
        let mut worst = 0f64;
        for r in 0..dim {
            for c in 0..=r {
                let want: f64 = h0[r * dim + c] as f64
                    + runs
                        .iter()
                        .map(|run| {
                            run.weight as f64
                                * (run.first_row..run.first_row + run.rows)
                                    .map(|t| xt[r * tokens + t] * xt[c * tokens + t])
                                    .sum::<f64>()
                        })
                        .sum::<f64>();
                let (lower, upper) = (got[r * dim + c], got[c * dim + r]);
                assert_eq!(lower.to_bits(), upper.to_bits(), "({r}, {c}) not symmetric");
                worst = worst.max((lower as f64 - want).abs());
            }
        }
        // Entries are O(1)–O(10); f32 sums of a few hundred products are good to ~1e-5.
        assert!(worst < 1e-4, "worst error {worst:e}");
    }
}
