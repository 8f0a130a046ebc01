//! GPTQ on the NVFP4 grid against its one-column-at-a-time reference, the block search alone
//! and the format's own decoder.

use crate::common;

use common::*;
use sala_formats::nvfp4::global_scale_from_amax;
use sala_formats::{BlockScales, Nvfp4Matrix, NVFP4_BLOCK};
use sala_hessian::reference::nvfp4_gptq_sequential;
use sala_hessian::{
    Damping, FailurePolicy, Hessian, HessianError, Method, Nvfp4BlockSearch, Nvfp4Gptq,
};

struct Case {
    w: Vec<f32>,
    rows: usize,
    cols: usize,
    h: Hessian<f64>,
    global: f32,
}

fn case(seed: u8, rows: usize, cols: usize) -> Case {
    let mut rng = rng(seed);
    let w = weights(&mut rng, rows, cols);
    let h = correlated_hessian::<f64>(&mut rng, cols, 3, 2 * cols);
    let amax = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    Case {
        w,
        rows,
        cols,
        h,
        global: global_scale_from_amax(amax).unwrap(),
    }
}

/// A search with few candidates keeps the tests quick; the loop is what they check.
fn solver() -> Nvfp4Gptq {
    Nvfp4Gptq {
        search: Nvfp4BlockSearch {
            iters: 16,
            ..Nvfp4BlockSearch::default()
        },
        ..Nvfp4Gptq::default()
    }
}

#[test]
fn the_blocked_loop_matches_the_sequential_one() {
    for (seed, rows, cols, block) in [(1, 24, 256, 128), (2, 7, 160, 48), (3, 16, 64, 16)] {
        let c = case(seed, rows, cols);
        let solver = Nvfp4Gptq {
            block_size: block,
            ..solver()
        };
        let got = solver.solve(&c.w, rows, cols, &c.h, c.global).unwrap();
        let (codes, scales) =
            nvfp4_gptq_sequential(&solver, &c.w, rows, cols, &c.h, c.global).unwrap();
        // The blocked loop sums the same updates in another order: a rounding tie may flip a
        // code (and with it the later ones of its row), rarely.
        let differing = got.codes.iter().zip(&codes).filter(|(a, b)| a != b).count();
        assert!(
            differing * 200 <= codes.len(),
            "seed {seed}: {differing} of {} codes differ",
            codes.len()
        );
        let same_scales = got
            .block_scales
            .iter()
            .zip(&scales)
            .filter(|(a, b)| a == b)
            .count();
        assert!(
            same_scales * 100 >= 99 * scales.len(),
            "seed {seed}: scales differ"
        );
        assert_eq!(got.method, Method::Gptq);
    }
}

#[test]
fn the_result_decodes_as_the_format_does() {
    let c = case(4, 12, 128);
    let got = solver()
        .solve(&c.w, c.rows, c.cols, &c.h, c.global)
        .unwrap();
    // Re-encoding the dequantized weight with the chosen scales gives the same codes: every
    // value lies on its block's grid.
    let matrix = Nvfp4Matrix::quantize(
        &got.dequantized,
        c.rows,
        c.cols,
        c.global,
        BlockScales::Given(&got.block_scales),
    )
    .unwrap();
    assert_eq!(matrix.dequantize(), got.dequantized);
    // The same codes, but for the sign of a zero (E2M1 has ±0: code 8 is −0).
    let unsigned_zero = |c: &u8| if *c == 8 { 0 } else { *c };
    let codes: Vec<u8> = got.codes.iter().map(unsigned_zero).collect();
    let recoded: Vec<u8> = matrix.codes().iter().map(unsigned_zero).collect();
    assert_eq!(codes, recoded);
    assert_eq!(got.block_scales.len(), c.rows * c.cols / NVFP4_BLOCK);
}

#[test]
fn a_diagonal_hessian_gives_the_block_search_itself() {
    // With a diagonal H the factor is diagonal: no error reaches another column, and each
    // block is searched on its original weights.
    let c = case(5, 10, 96);
    let diag: Vec<f64> = (0..c.cols).map(|j| 0.5 + (j % 5) as f64).collect();
    let mut dense = vec![0.0f64; c.cols * c.cols];
    for (j, &d) in diag.iter().enumerate() {
        dense[j * c.cols + j] = d;
    }
    let h = Hessian::from_row_major(c.cols, &dense).unwrap();
    let solver = solver();
    let got = solver.solve(&c.w, c.rows, c.cols, &h, c.global).unwrap();
    let diag32: Vec<f32> = diag.iter().map(|&d| d as f32).collect();
    let searched = solver
        .search
        .search(&c.w, c.rows, c.cols, &diag32, c.global)
        .unwrap();
    assert_eq!(got.block_scales, searched.block_scales);
    assert_eq!(got.codes, searched.codes);
}

#[test]
fn gptq_lowers_the_output_error_of_the_block_search() {
    for seed in [6, 7, 8] {
        let c = case(seed, 32, 128);
        let solver = solver();
        let got = solver.solve(&c.w, c.rows, c.cols, &c.h, c.global).unwrap();
        let diag: Vec<f32> = (0..c.cols).map(|j| c.h.as_mat()[(j, j)] as f32).collect();
        let searched = solver
            .search
            .search(&c.w, c.rows, c.cols, &diag, c.global)
            .unwrap();
        let search_error = proxy_naive(&c.w, &searched.dequantized, c.cols, &dense(&c.h));
        let gptq_error = proxy_naive(&c.w, &got.dequantized, c.cols, &dense(&c.h));
        assert!(
            (got.proxy_error - gptq_error).abs() <= 1e-6 * gptq_error,
            "{} vs {gptq_error}",
            got.proxy_error
        );
        assert!(
            gptq_error < 0.9 * search_error,
            "seed {seed}: GPTQ {gptq_error} vs search {search_error}"
        );
    }
}

#[test]
fn a_failed_inverse_is_an_error_or_the_block_search_alone() {
    let c = case(9, 4, 32);
    let h = indefinite_hessian(32);
    let failing = Nvfp4Gptq {
        damping: Damping {
            max_retries: 1,
            ..Damping::default()
        },
        ..solver()
    };
    let err = failing
        .solve(&c.w, c.rows, c.cols, &h, c.global)
        .unwrap_err();
    assert!(
        matches!(err, HessianError::NotPositiveDefinite { attempts: 2, .. }),
        "{err}"
    );
    let fallback = Nvfp4Gptq {
        on_failure: FailurePolicy::Rtn,
        ..failing
    };
    let got = fallback.solve(&c.w, c.rows, c.cols, &h, c.global).unwrap();
    assert_eq!(got.method, Method::RtnFallback);
    let diag: Vec<f32> = (0..32).map(|j| h.as_mat()[(j, j)] as f32).collect();
    let searched = fallback
        .search
        .search(&c.w, c.rows, c.cols, &diag, c.global)
        .unwrap();
    assert_eq!(got.codes, searched.codes);
}

#[test]
fn bad_input_is_an_error() {
    let c = case(10, 4, 64);
    let solver = solver();
    assert!(solver.solve(&c.w, c.rows, 48, &c.h, c.global).is_err());
    assert!(solver.solve(&c.w, c.rows, c.cols, &c.h, 0.0).is_err());
    let mut w = c.w.clone();
    w[5] = f32::INFINITY;
    assert!(solver.solve(&w, c.rows, c.cols, &c.h, c.global).is_err());
}

fn dense(h: &Hessian<f64>) -> Vec<f64> {
    let m = h.as_mat();
    (0..h.dim())
        .flat_map(|i| (0..h.dim()).map(move |j| (i, j)))
        .map(|(i, j)| m[(i, j)])
        .collect()
}
