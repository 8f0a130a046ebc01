//! `flip::reversed` against a host flip, on odd and even sizes, on a window, with and without
//! the upper-triangle option.

use sala_kernels::flip::reversed;
use sala_kernels::{KernelError, MatrixView};

use crate::common::{client, Rng};

#[test]
fn reversal_matches_the_host_and_reads_only_the_window() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(9);
    for n in [7, 6, 1] {
        let a = rng.vec(n * n);
        let view = MatrixView::upload(&client, &a, n, n).unwrap();
        for upper_only in [false, true] {
            let got = reversed(&client, &view, upper_only)
                .unwrap()
                .download(&client)
                .unwrap();
            let want: Vec<f32> = (0..n * n)
                .map(|k| {
                    let below = k / n > k % n;
                    if upper_only && below {
                        0.0
                    } else {
                        a[n * n - 1 - k]
                    }
                })
                .collect();
            assert_eq!(got, want, "{n}×{n} upper_only {upper_only}");
        }
        assert_eq!(view.download(&client).unwrap(), a, "the input is unchanged");
    }
    // A 4×4 window at (1, 2) of a 6×6 buffer.
    let big = rng.vec(36);
    let full = MatrixView::upload(&client, &big, 6, 6).unwrap();
    let got = reversed(&client, &full.window(1, 2, 4, 4).unwrap(), false)
        .unwrap()
        .download(&client)
        .unwrap();
    for i in 0..4 {
        for j in 0..4 {
            assert_eq!(got[i * 4 + j], big[(4 - i) * 6 + (5 - j)], "({i}, {j})");
        }
    }
    assert!(matches!(
        reversed(&client, &full.window(0, 0, 2, 3).unwrap(), false),
        Err(KernelError::Shape { .. })
    ));
}
