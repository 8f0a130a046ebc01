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
