//! The NVFP4 block-scale search against `reference::nvfp4_block_search_naive`: block scales
//! and codes byte for byte, errors to 1e-5.

use sala_formats::nvfp4::global_scale_from_amax;
use sala_hessian::reference::nvfp4_block_search_naive;
use sala_hessian::{HessianError, Nvfp4BlockSearch, Nvfp4SearchResult};
use sala_kernels::{nvfp4_block_search, nvfp4_gptq_solve, CubeGemm, KernelError, MatrixView};

use crate::common::{client, device_client, Rng};

/// A `rows × cols` weight of normal values with special blocks: all zeros, negative zeros,
/// tiny values of both signs, one huge value, E2M1 midpoints of a power-of-two divisor.
fn special_weight(rng: &mut Rng, rows: usize, cols: usize) -> Vec<f32> {
    let mut w: Vec<f32> = (0..rows * cols).map(|_| rng.normal()).collect();
    let blocks = rows * cols / 16;
    for (k, b) in (0..blocks).step_by(7).enumerate() {
        let span = b * 16..(b + 1) * 16;
        match k % 6 {
            0 => w[span].fill(0.0),
            1 => w[span].fill(-0.0),
            2 => {
                for (j, v) in w[span].iter_mut().enumerate() {
                    *v = if j % 2 == 0 { 1e-30 } else { -3e-31 };
                }
            }
            3 => w[span.start + 5] = 40.0,
            4 => {
                // Midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 times 1/64 (and their negatives),
                // with amax 6/64: max calibration's divisor is exactly a power of two.
                let mids = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0];
                for (j, v) in w[span].iter_mut().enumerate() {
                    let m = mids[j % 8] / 64.0;
                    *v = if j < 8 { m } else { -m };
                }
            }
            _ => {
                for v in &mut w[span] {
                    *v *= 1e-3;
                }
            }
        }
    }
    w
}

fn diag(rng: &mut Rng, cols: usize) -> Vec<f32> {
    (0..cols)
        .map(|j| {
            if j % 13 == 0 {
                0.0
            } else {
                2.0 * rng.uniform()
            }
        })
        .collect()
}

fn run(
    w: &[f32],
    rows: usize,
    cols: usize,
    diag_h: &[f32],
    global: f32,
    search: &Nvfp4BlockSearch,
) -> (Nvfp4SearchResult, Nvfp4SearchResult) {
    let client = device_client();
    let view = MatrixView::upload(&client, w, rows, cols).unwrap();
    let gpu = nvfp4_block_search(&client, &view, diag_h, global, search)
        .unwrap()
        .download(&client)
        .unwrap();
    let cpu = nvfp4_block_search_naive(search, w, rows, cols, diag_h, global).unwrap();
    (gpu, cpu)
}

fn assert_errors_close(gpu: &Nvfp4SearchResult, cpu: &Nvfp4SearchResult, tol: f32) {
    for (b, (&g, &c)) in gpu.block_error.iter().zip(&cpu.block_error).enumerate() {
        assert!(
            (g - c).abs() <= tol * c.abs().max(1e-30),
            "block {b}: error {g} vs {c}"
        );
    }
}

#[test]
fn block_scales_and_codes_equal_the_reference_for_p_2() {
    if client().is_none() {
        return;
    }
    let mut rng = Rng::new(21);
    let (rows, cols) = (64, 256);
    let w = special_weight(&mut rng, rows, cols);
    let diag_h = diag(&mut rng, cols);
    let amax = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    // The tensor's own global scale, and a 50× smaller one so that large blocks saturate at 448.
    for global in [
        global_scale_from_amax(amax).unwrap(),
        amax / 2688.0 / 50.0,
        1.0 / 256.0,
    ] {
        let (gpu, cpu) = run(
            &w,
            rows,
            cols,
            &diag_h,
            global,
            &Nvfp4BlockSearch::default(),
        );
        assert_eq!(gpu.block_scales, cpu.block_scales, "global {global}");
        assert_eq!(gpu.codes, cpu.codes, "global {global}");
        assert_eq!(gpu.dequantized, cpu.dequantized, "global {global}");
        assert_errors_close(&gpu, &cpu, 1e-5);
    }
}

#[test]
fn a_zero_diagonal_and_a_single_candidate_match_too() {
    if client().is_none() {
        return;
    }
    let mut rng = Rng::new(5);
    let (rows, cols) = (16, 64);
    let w = special_weight(&mut rng, rows, cols);
    let global = global_scale_from_amax(4.0).unwrap();
    for search in [
        Nvfp4BlockSearch {
            iters: 1,
            ..Default::default()
        },
        Nvfp4BlockSearch {
            iters: 37,
            max_shrink: 0.3,
            error_norm: 2.0,
        },
    ] {
        let (gpu, cpu) = run(&w, rows, cols, &vec![0.0; cols], global, &search);
        assert_eq!(gpu.block_scales, cpu.block_scales, "{search:?}");
        assert_eq!(gpu.codes, cpu.codes, "{search:?}");
        assert_errors_close(&gpu, &cpu, 1e-5);
    }
}

/// NVFP4's GPTQ loop with the identity as the factor of `H⁻¹` spreads no error, so each
/// 16-column block is searched on the original weights: its scales and codes are the block
/// search's, byte for byte. This checks the loop's team search (the candidates dealt to 16
/// units, the least error and the first among equal ones kept) against the host's sequential
/// one, with partial cubes (37 rows), lazy blocks of one, two and eight 16-column blocks (the
/// last one cut short), fewer candidates than units, and one candidate.
#[test]
fn gptq_with_the_identity_factor_is_the_block_search() {
    if client().is_none() {
        return;
    }
    let client = device_client();
    let mut rng = Rng::new(22);
    let (rows, cols) = (37, 320);
    let mut w = special_weight(&mut rng, rows, cols);
    let diag_h = diag(&mut rng, cols);
    // Every candidate ties at zero error where the only nonzero weights have zero channel
    // weight (columns 0 and 13): the first candidate must win.
    w[..16].fill(0.0);
    (w[0], w[13]) = (0.3, -0.7);
    let amax = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let global = global_scale_from_amax(amax).unwrap();
    let identity: Vec<f32> = (0..cols * cols)
        .map(|k| if k / cols == k % cols { 1.0 } else { 0.0 })
        .collect();
    let u = MatrixView::upload(&client, &identity, cols, cols).unwrap();
    let searches = [
        Nvfp4BlockSearch::default(),
        Nvfp4BlockSearch {
            iters: 7,
            ..Default::default()
        },
        Nvfp4BlockSearch {
            iters: 1,
            ..Default::default()
        },
    ];
    for search in searches {
        let cpu = nvfp4_block_search_naive(&search, &w, rows, cols, &diag_h, global).unwrap();
        let channel = search.channel_weights(cols, &diag_h, global).unwrap();
        for lazy in [16, 32, 128] {
            let view = MatrixView::upload(&client, &w, rows, cols).unwrap();
            let gpu = nvfp4_gptq_solve(
                &client, &CubeGemm, &view, &u, &channel, global, &search, lazy,
            )
            .unwrap();
            let scales = gpu.block_scales.download_low_bytes(&client).unwrap();
            let codes = gpu.codes.download_low_bytes(&client).unwrap();
            let label = format!("{search:?}, lazy block {lazy}");
            assert_eq!(scales, cpu.block_scales, "{label}");
            assert_eq!(codes, cpu.codes, "{label}");
        }
    }
}

/// `p ≠ 2` goes through `powf`, whose last bits differ between libm and a GPU: a different
/// byte is only allowed where the two errors tie to 1e-5, and must be rare.
#[test]
fn other_error_norms_agree_up_to_near_ties() {
    if client().is_none() {
        return;
    }
    let mut rng = Rng::new(8);
    let (rows, cols) = (64, 256);
    let w = special_weight(&mut rng, rows, cols);
    let diag_h = diag(&mut rng, cols);
    let global = global_scale_from_amax(w.iter().fold(0.0f32, |m, v| m.max(v.abs()))).unwrap();
    for p in [1.0f32, 1.5, 3.0] {
        let search = Nvfp4BlockSearch {
            error_norm: p,
            ..Default::default()
        };
        let (gpu, cpu) = run(&w, rows, cols, &diag_h, global, &search);
        assert_errors_close(&gpu, &cpu, 1e-5);
        let flips = gpu
            .block_scales
            .iter()
            .zip(&cpu.block_scales)
            .filter(|(g, c)| g != c)
            .count();
        assert!(
            flips * 100 <= gpu.block_scales.len(),
            "p {p}: {flips} different scales"
        );
    }
}

#[test]
fn non_finite_weights_and_bad_inputs_are_errors() {
    let Some(client) = client() else {
        return;
    };
    let mut w = vec![0.5f32; 4 * 32];
    w[2 * 32 + 20] = f32::NAN;
    let view = MatrixView::upload(&client, &w, 4, 32).unwrap();
    let search = Nvfp4BlockSearch::default();
    let err = nvfp4_block_search(&client, &view, &[1.0; 32], 0.01, &search)
        .unwrap()
        .download(&client)
        .unwrap_err();
    assert!(
        matches!(
            err,
            KernelError::Hessian(HessianError::NonFinite {
                row: 2,
                col: 16,
                ..
            })
        ),
        "{err}"
    );
    for (diag_h, global) in [
        (vec![1.0; 31], 0.01),
        (vec![-1.0; 32], 0.01),
        (vec![1.0; 32], 0.0),
    ] {
        assert!(nvfp4_block_search(&client, &view, &diag_h, global, &search).is_err());
    }
    let narrow = view.window(0, 0, 4, 24).unwrap();
    assert!(nvfp4_block_search(&client, &narrow, &[1.0; 24], 0.01, &search).is_err());
    let bad = Nvfp4BlockSearch {
        iters: 0,
        ..Default::default()
    };
    assert!(nvfp4_block_search(&client, &view, &[1.0; 32], 0.01, &bad).is_err());
}

/// The kernel's bit arithmetic (mirrored on the host in `block_search::bits`) against
/// `sala_formats`' E4M3 on every code, every midpoint between neighbours and the floats just
/// around it, and log-uniform values over the clamp range `[2⁻⁹, 448]`.
#[test]
fn e4m3_bit_arithmetic_equals_the_format_codec() {
    use sala_formats::minifloat::{E4M3FN, E4M3_MAX, E4M3_MIN_POSITIVE};
    use sala_kernels::block_search::{e4m3_decode_bits, e4m3_encode_bits};
    let check = |s: f32| {
        assert_eq!(
            e4m3_encode_bits(s),
            E4M3FN.encode_non_nan(s) as u32,
            "encode {s:e} ({:#010x})",
            s.to_bits()
        );
    };
    for code in 1u8..=0x7E {
        let value = E4M3FN.decode(code);
        assert_eq!(e4m3_decode_bits(code as u32), value, "decode {code:#04x}");
        check(value);
        if code < 0x7E {
            let mid = (value + E4M3FN.decode(code + 1)) / 2.0;
            for s in [
                mid,
                f32::from_bits(mid.to_bits() - 1),
                f32::from_bits(mid.to_bits() + 1),
            ] {
                check(s);
            }
        }
    }
    let mut rng = Rng::new(11);
    let (lo, hi) = (E4M3_MIN_POSITIVE.ln(), E4M3_MAX.ln());
    for _ in 0..200_000 {
        check(
            (lo + (hi - lo) * rng.uniform())
                .exp()
                .clamp(E4M3_MIN_POSITIVE, E4M3_MAX),
        );
    }
}
