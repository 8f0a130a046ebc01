//! `Gemm` (CubeGemm) against a host triple loop, on windows with offsets and row strides.

use sala_kernels::{CubeGemm, Gemm, KernelError, MatrixView};

use crate::common::{client, max_rel_diff, Rng, TestRuntime};

/// `beta·c + alpha·op(a)·op(b)` on the host in f64, row-major dense operands.
#[allow(clippy::too_many_arguments)]
fn host_gemm(
    alpha: f32,
    a: &[f32],
    a_cols: usize,
    trans_a: bool,
    b: &[f32],
    b_cols: usize,
    trans_b: bool,
    beta: f32,
    c: &[f32],
    (m, n, k): (usize, usize, usize),
) -> Vec<f64> {
    let at = |i: usize, l: usize| {
        if trans_a {
            a[l * a_cols + i]
        } else {
            a[i * a_cols + l]
        }
    };
    let bt = |l: usize, j: usize| {
        if trans_b {
            b[j * b_cols + l]
        } else {
            b[l * b_cols + j]
        }
    };
    (0..m * n)
        .map(|idx| {
            let (i, j) = (idx / n, idx % n);
            let dot: f64 = (0..k).map(|l| at(i, l) as f64 * bt(l, j) as f64).sum();
            beta as f64 * c[idx] as f64 + alpha as f64 * dot
        })
        .collect()
}

/// A `rows × cols` window at `(1, 3)` of a larger random buffer (unaligned offset, padded
/// rows), and the window's values.
fn random_window(
    client: &cubecl::prelude::ComputeClient<TestRuntime>,
    rng: &mut Rng,
    rows: usize,
    cols: usize,
) -> (MatrixView, Vec<f32>) {
    let (big_rows, big_cols) = (rows + 2, cols + 5);
    let big = rng.vec(big_rows * big_cols);
    let view = MatrixView::upload(client, &big, big_rows, big_cols)
        .unwrap()
        .window(1, 3, rows, cols)
        .unwrap();
    let values = (0..rows * cols)
        .map(|i| big[(1 + i / cols) * big_cols + 3 + i % cols])
        .collect();
    (view, values)
}

#[test]
fn gemm_matches_the_host_on_windows_for_every_transpose() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(7);
    let (m, n, k) = (37, 45, 70);
    for (trans_a, trans_b) in [(false, false), (true, false), (false, true), (true, true)] {
        let (ar, ac) = if trans_a { (k, m) } else { (m, k) };
        let (br, bc) = if trans_b { (n, k) } else { (k, n) };
        let (a, a_host) = random_window(&client, &mut rng, ar, ac);
        let (b, b_host) = random_window(&client, &mut rng, br, bc);
        let (c, c_host) = random_window(&client, &mut rng, m, n);
        let (alpha, beta) = (-0.75, 1.5);
        CubeGemm
            .gemm(&client, alpha, &a, trans_a, &b, trans_b, beta, &c)
            .unwrap();
        let got = c.download(&client).unwrap();
        let want = host_gemm(
            alpha,
            &a_host,
            ac,
            trans_a,
            &b_host,
            bc,
            trans_b,
            beta,
            &c_host,
            (m, n, k),
        );
        let err = max_rel_diff(&got, &want, 1.0);
        assert!(
            err < 1e-5,
            "trans ({trans_a}, {trans_b}): relative error {err}"
        );
    }
}

#[test]
fn gemm_leaves_the_rest_of_the_buffer_alone_and_ignores_c_when_beta_is_zero() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(11);
    let (m, n, k) = (8, 16, 32);
    let a_host = rng.vec(m * k);
    let b_host = rng.vec(k * n);
    let a = MatrixView::upload(&client, &a_host, m, k).unwrap();
    let b = MatrixView::upload(&client, &b_host, k, n).unwrap();
    // c is the middle of a NaN-filled buffer: beta = 0 must not read it, and the elements
    // outside the window must stay NaN.
    let big = vec![f32::NAN; (m + 2) * (n + 2)];
    let full = MatrixView::upload(&client, &big, m + 2, n + 2).unwrap();
    let c = full.window(1, 1, m, n).unwrap();
    CubeGemm
        .gemm(&client, 2.0, &a, false, &b, false, 0.0, &c)
        .unwrap();
    let got = full.download(&client).unwrap();
    let want = host_gemm(
        2.0,
        &a_host,
        k,
        false,
        &b_host,
        n,
        false,
        0.0,
        &vec![0.0; m * n],
        (m, n, k),
    );
    for i in 0..m + 2 {
        for j in 0..n + 2 {
            let v = got[i * (n + 2) + j];
            if (1..=m).contains(&i) && (1..=n).contains(&j) {
                let w = want[(i - 1) * n + j - 1];
                assert!(
                    (v as f64 - w).abs() < 1e-4 * (1.0 + w.abs()),
                    "({i},{j}) {v} vs {w}"
                );
            } else {
                assert!(v.is_nan(), "({i},{j}) outside the window was written: {v}");
            }
        }
    }
}

#[test]
fn gemm_rejects_mismatched_shapes_and_windows_outside_their_buffer() {
    let Some(client) = client() else {
        return;
    };
    let a = MatrixView::zeros(&client, 4, 5).unwrap();
    let b = MatrixView::zeros(&client, 6, 3).unwrap();
    let c = MatrixView::zeros(&client, 4, 3).unwrap();
    let err = CubeGemm
        .gemm(&client, 1.0, &a, false, &b, false, 0.0, &c)
        .unwrap_err();
    assert!(matches!(err, KernelError::Shape { .. }), "{err}");
    assert!(a.window(2, 0, 3, 5).is_err());
    let mut bad = a.clone();
    bad.row_stride = 7;
    let err = CubeGemm
        .gemm(&client, 1.0, &bad, true, &c, false, 0.0, &c)
        .unwrap_err();
    assert!(matches!(err, KernelError::Shape { .. }), "{err}");
}
