//! `inverse_upper_cusolver` (CUDA only): the upper Cholesky factor of `H⁻¹` from `potrf` and
//! the blocked triangular inverse (`trtri` on diagonal blocks up to 1024 columns, `trmm` above).
//! Sizes that stay in one block, split once unevenly, and split twice; checked as
//! `Uᵀ·U·H·v = v` on random vectors (an O(n²) check: the f64 textbook factor costs O(n³)),
//! a zero strict lower triangle and a positive diagonal; the smallest against the textbook.

use sala_hessian::reference::inverse_upper_textbook;
use sala_hessian::Hessian;
use sala_kernels::cuda::{inverse_upper_cusolver, Cusolver};
use sala_kernels::{KernelError, MatrixView};

use crate::common::{client, Rng};

/// A symmetric, diagonally dominant (so positive definite and well conditioned) `n × n`
/// matrix, row-major.
fn spd(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut h = vec![0.0f32; n * n];
    for i in 0..n {
        for j in 0..i {
            let v = rng.normal() / n as f32;
            h[i * n + j] = v;
            h[j * n + i] = v;
        }
        h[i * n + i] = 1.5 + rng.uniform();
    }
    h
}

/// `m·v` for a row-major `n × n` matrix, or `mᵀ·v` with `transpose`, in f64.
fn mat_vec(m: &[f32], v: &[f64], n: usize, transpose: bool) -> Vec<f64> {
    (0..n)
        .map(|i| {
            (0..n)
                .map(|k| {
                    let a = if transpose {
                        m[k * n + i]
                    } else {
                        m[i * n + k]
                    };
                    a as f64 * v[k]
                })
                .sum()
        })
        .collect()
}

#[test]
fn the_blocked_inverse_gives_the_factor_of_h_inverse() {
    let Some(client) = client() else {
        return;
    };
    let solver = match Cusolver::new(0) {
        Ok(solver) => solver,
        Err(KernelError::Unsupported { what, detail }) => {
            eprintln!("NOTICE: cuSOLVER not tested: {what}: {detail}");
            return;
        }
        Err(e) => panic!("cuSOLVER failed to load: {e}"),
    };
    let mut rng = Rng::new(5);
    for n in [64, 1100, 2600] {
        let h = spd(&mut rng, n);
        let view = MatrixView::upload(&client, &h, n, n).unwrap();
        let u = inverse_upper_cusolver(&client, &solver, &view)
            .unwrap()
            .download(&client)
            .unwrap();
        for i in 0..n {
            assert!(u[i * n + i] > 0.0, "n {n}: U[{i},{i}] = {}", u[i * n + i]);
            for j in 0..i {
                assert_eq!(u[i * n + j], 0.0, "n {n}: U[{i},{j}] below the diagonal");
            }
        }
        for _ in 0..3 {
            let v: Vec<f64> = (0..n).map(|_| rng.normal() as f64).collect();
            let hv = mat_vec(&h, &v, n, false);
            let back = mat_vec(&u, &mat_vec(&u, &hv, n, false), n, true);
            let err = back
                .iter()
                .zip(&v)
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f64>();
            let norm = v.iter().map(|b| b * b).sum::<f64>();
            let rel = (err / norm).sqrt();
            assert!(rel < 1e-4, "n {n}: |UᵀU·H·v − v| / |v| = {rel:.2e}");
        }
        if n == 64 {
            let hessian =
                Hessian::<f64>::from_row_major(n, &h.iter().map(|&x| x as f64).collect::<Vec<_>>())
                    .unwrap();
            let textbook = inverse_upper_textbook(&hessian, 0.0).unwrap();
            let scale = (0..n).map(|i| textbook[(i, i)].abs()).fold(0.0, f64::max);
            for i in 0..n {
                for j in 0..n {
                    let (a, b) = (u[i * n + j] as f64, textbook[(i, j)]);
                    assert!((a - b).abs() <= 1e-5 * scale, "({i}, {j}): {a} vs {b}");
                }
            }
        }
    }
}
