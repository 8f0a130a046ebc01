//! The device-Hessian helpers of `hessian_ops` against host computations: the diagonal of a
//! window, the first non-finite element, the damped permuted copy (lower triangle mirrored)
//! and the row dots of the proxy error.

use sala_kernels::hessian_ops::{damped_permuted, diagonal, first_non_finite, row_dots};
use sala_kernels::{KernelError, MatrixView};

use crate::common::{client, Rng};

#[test]
fn the_diagonal_of_a_window_is_read_in_place() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(31);
    let big = rng.vec(7 * 9);
    let full = MatrixView::upload(&client, &big, 7, 9).unwrap();
    let window = full.window(1, 3, 5, 5).unwrap();
    let got = diagonal(&client, &window)
        .unwrap()
        .download(&client)
        .unwrap();
    let want: Vec<f32> = (0..5).map(|i| big[(1 + i) * 9 + 3 + i]).collect();
    assert_eq!(got, want);
    assert!(matches!(
        diagonal(&client, &full),
        Err(KernelError::Shape { .. })
    ));
}

#[test]
fn the_first_non_finite_element_is_found_in_row_major_order() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(32);
    // More columns than units per cube, so that units stride.
    let (rows, cols) = (5, 700);
    let mut values = rng.vec(rows * cols);
    let clean = MatrixView::upload(&client, &values, rows, cols).unwrap();
    assert_eq!(first_non_finite(&client, &clean).unwrap(), None);
    values[4 * cols + 3] = f32::NAN;
    values[2 * cols + 650] = f32::INFINITY;
    values[2 * cols + 600] = f32::NEG_INFINITY;
    let bad = MatrixView::upload(&client, &values, rows, cols).unwrap();
    assert_eq!(first_non_finite(&client, &bad).unwrap(), Some((2, 600)));
    // A window that leaves the bad rows out.
    let top = bad.window(0, 0, 2, cols).unwrap();
    assert_eq!(first_non_finite(&client, &top).unwrap(), None);
    let lower = bad.window(3, 1, 2, 10).unwrap();
    assert_eq!(first_non_finite(&client, &lower).unwrap(), Some((1, 2)));
}

#[test]
fn the_damped_permuted_copy_mirrors_the_lower_triangle() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(33);
    let n = 37;
    // Not symmetric: only the lower triangle (with the diagonal) may be read.
    let h = rng.vec(n * n);
    let order: Vec<usize> = (0..n).map(|i| (i * 10) % n).collect();
    let damped: Vec<f32> = (0..n).map(|i| 5.0 + i as f32).collect();
    let view = MatrixView::upload(&client, &h, n, n).unwrap();
    let got = damped_permuted(&client, &view, &order, &damped)
        .unwrap()
        .download(&client)
        .unwrap();
    for i in 0..n {
        for j in 0..n {
            let (oi, oj) = (order[i], order[j]);
            let want = if i == j {
                damped[i]
            } else {
                h[oi.max(oj) * n + oi.min(oj)]
            };
            assert_eq!(got[i * n + j], want, "({i}, {j})");
        }
    }
    assert_eq!(view.download(&client).unwrap(), h, "h is left as it is");
    let short = &order[1..];
    assert!(matches!(
        damped_permuted(&client, &view, short, &damped),
        Err(KernelError::Shape { .. })
    ));
    let mut outside = order.clone();
    outside[0] = n;
    assert!(matches!(
        damped_permuted(&client, &view, &outside, &damped),
        Err(KernelError::Shape { .. })
    ));
}

#[test]
fn row_dots_match_the_host() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(34);
    let (rows, cols) = (6, 900);
    let a = rng.vec(rows * cols);
    let b = rng.vec(rows * (cols + 4));
    let av = MatrixView::upload(&client, &a, rows, cols).unwrap();
    let bv = MatrixView::upload(&client, &b, rows, cols + 4)
        .unwrap()
        .window(0, 4, rows, cols)
        .unwrap();
    let got = row_dots(&client, &av, &bv).unwrap();
    for r in 0..rows {
        let want: f64 = (0..cols)
            .map(|c| a[r * cols + c] as f64 * b[r * (cols + 4) + 4 + c] as f64)
            .sum();
        assert!(
            (got[r] as f64 - want).abs() <= 1e-4 * (1.0 + want.abs()),
            "row {r}"
        );
    }
    assert!(matches!(
        row_dots(&client, &av, &av.window(0, 0, rows, 3).unwrap()),
        Err(KernelError::Shape { .. })
    ));
}
