//! `reverse_in_place` against a host flip, on odd and even shapes and on a window.

use sala_kernels::flip::reverse_in_place;
use sala_kernels::MatrixView;

use crate::common::{client, Rng};

#[test]
fn reversal_matches_the_host_and_stays_inside_the_window() {
    let client = client();
    let mut rng = Rng::new(9);
    for (rows, cols) in [(7, 7), (6, 6), (5, 9), (1, 1)] {
        let a = rng.vec(rows * cols);
        let view = MatrixView::upload(&client, &a, rows, cols).unwrap();
        reverse_in_place(&client, &view).unwrap();
        let want: Vec<f32> = (0..rows * cols).map(|k| a[rows * cols - 1 - k]).collect();
        assert_eq!(view.download(&client).unwrap(), want, "{rows}×{cols}");
    }
    // A 4×3 window at (1, 2) of a 6×6 buffer: only the window moves.
    let big = rng.vec(36);
    let full = MatrixView::upload(&client, &big, 6, 6).unwrap();
    reverse_in_place(&client, &full.window(1, 2, 4, 3).unwrap()).unwrap();
    let got = full.download(&client).unwrap();
    for i in 0..6 {
        for j in 0..6 {
            let inside = (1..5).contains(&i) && (2..5).contains(&j);
            let want = if inside {
                big[(5 - i) * 6 + (6 - j)]
            } else {
                big[i * 6 + j]
            };
            assert_eq!(got[i * 6 + j], want, "({i}, {j})");
        }
    }
}
