//! The NVFP4 block-scale search against max calibration and the one-thread reference.

use crate::common;

use common::*;
use sala_formats::nvfp4::global_scale_from_amax;
use sala_formats::{BlockScales, Nvfp4Matrix, NVFP4_BLOCK};
use sala_hessian::reference::nvfp4_block_search_naive;
use sala_hessian::{HessianError, Nvfp4BlockSearch};

struct Case {
    w: Vec<f32>,
    rows: usize,
    cols: usize,
    diag: Vec<f32>,
    global: f32,
}

fn case(seed: u8) -> Case {
    let mut rng = rng(seed);
    let (rows, cols) = (32, 128);
    let w = weights(&mut rng, rows, cols);
    let diag: Vec<f32> = (0..cols)
        .map(|_| 10f32.powf(2.0 * uniform(&mut rng)))
        .collect();
    let amax = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    Case {
        w,
        rows,
        cols,
        diag,
        global: global_scale_from_amax(amax).unwrap(),
    }
}

fn weighted_error(w: &[f32], deq: &[f32], h: &[f32], cols: usize, p: f32) -> Vec<f32> {
    w.chunks_exact(NVFP4_BLOCK)
        .zip(deq.chunks_exact(NVFP4_BLOCK))
        .enumerate()
        .map(|(b, (wb, db))| {
            let c0 = (b * NVFP4_BLOCK) % cols;
            (0..NVFP4_BLOCK)
                .map(|j| (wb[j] - db[j]).abs().powf(p) * h[c0 + j])
                .sum()
        })
        .collect()
}

#[test]
fn one_iteration_is_max_calibration() {
    let c = case(30);
    let search = Nvfp4BlockSearch {
        iters: 1,
        ..Default::default()
    };
    let found = search
        .search(&c.w, c.rows, c.cols, &c.diag, c.global)
        .unwrap();
    let max = Nvfp4Matrix::quantize(&c.w, c.rows, c.cols, c.global, BlockScales::Max).unwrap();
    assert_eq!(found.block_scales, max.block_scales);
    assert_eq!(found.codes, max.codes());
    assert_eq!(found.dequantized, max.dequantize());
}

#[test]
fn searched_scales_reproduce_through_the_format_codec() {
    let c = case(31);
    let found = Nvfp4BlockSearch::default()
        .search(&c.w, c.rows, c.cols, &c.diag, c.global)
        .unwrap();
    let given = Nvfp4Matrix::quantize(
        &c.w,
        c.rows,
        c.cols,
        c.global,
        BlockScales::Given(&found.block_scales),
    )
    .unwrap();
    assert_eq!(given.codes(), found.codes);
    assert_eq!(given.dequantize(), found.dequantized);
    // The search does change scales (shrinking clips the largest value of some blocks).
    let max = Nvfp4Matrix::quantize(&c.w, c.rows, c.cols, c.global, BlockScales::Max).unwrap();
    assert_ne!(found.block_scales, max.block_scales);
}

#[test]
fn parallel_search_equals_the_naive_search() {
    for (seed, p, iters) in [(32, 2.0, 120), (33, 2.4, 80), (34, 1.0, 7)] {
        let c = case(seed);
        let search = Nvfp4BlockSearch {
            iters,
            max_shrink: 0.6,
            error_norm: p,
        };
        let fast = search
            .search(&c.w, c.rows, c.cols, &c.diag, c.global)
            .unwrap();
        let naive =
            nvfp4_block_search_naive(&search, &c.w, c.rows, c.cols, &c.diag, c.global).unwrap();
        assert_eq!(fast, naive, "p {p} iters {iters}");
    }
}

#[test]
fn search_error_never_exceeds_max_calibration_for_any_block() {
    for seed in 35..39 {
        let c = case(seed);
        let found = Nvfp4BlockSearch::default()
            .search(&c.w, c.rows, c.cols, &c.diag, c.global)
            .unwrap();
        let hmax = c.diag.iter().fold(0.0f32, |m, &v| m.max(v));
        let h: Vec<f32> = c.diag.iter().map(|v| v / hmax).collect();
        let max = Nvfp4Matrix::quantize(&c.w, c.rows, c.cols, c.global, BlockScales::Max).unwrap();
        let max_err = weighted_error(&c.w, &max.dequantize(), &h, c.cols, 2.0);
        let found_err = weighted_error(&c.w, &found.dequantized, &h, c.cols, 2.0);
        let mut improved = 0;
        for (b, (f, m)) in found_err.iter().zip(&max_err).enumerate() {
            assert!(*f <= m * (1.0 + 1e-5), "block {b}: {f} > {m}");
            improved += (*f < m * (1.0 - 1e-3)) as usize;
        }
        assert!(improved > 0, "the search improved no block");
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    let c = case(40);
    let s = Nvfp4BlockSearch::default();
    let err = s
        .search(&c.w[..c.rows * 120], c.rows, 120, &c.diag[..120], c.global)
        .unwrap_err();
    assert!(matches!(err, HessianError::Format(_)), "{err}");
    let mut diag = c.diag.clone();
    diag[3] = -1.0;
    assert!(matches!(
        s.search(&c.w, c.rows, c.cols, &diag, c.global),
        Err(HessianError::InvalidOption { .. })
    ));
    diag[3] = f32::NAN;
    assert!(matches!(
        s.search(&c.w, c.rows, c.cols, &diag, c.global),
        Err(HessianError::NonFinite { .. })
    ));
    assert!(matches!(
        s.search(&c.w, c.rows, c.cols, &c.diag[1..], c.global),
        Err(HessianError::DimensionMismatch { .. })
    ));
    assert!(s.search(&c.w, c.rows, c.cols, &c.diag, 0.0).is_err());
    let mut w = c.w.clone();
    w[5] = f32::NAN;
    assert!(matches!(
        s.search(&w, c.rows, c.cols, &c.diag, c.global),
        Err(HessianError::NonFinite {
            what: "weights",
            ..
        })
    ));
    let zero_iters = Nvfp4BlockSearch { iters: 0, ..s };
    assert!(zero_iters
        .search(&c.w, c.rows, c.cols, &c.diag, c.global)
        .is_err());
    // An all-zero diagonal weighs every channel equally instead of dividing by zero.
    let flat = s
        .search(&c.w, c.rows, c.cols, &vec![0.0; c.cols], c.global)
        .unwrap();
    let ones = s
        .search(&c.w, c.rows, c.cols, &vec![1.0; c.cols], c.global)
        .unwrap();
    assert_eq!(flat, ones);
}
