//! `gptq_solve` against `reference::gptq_column_loop` on the same prepared `(W, U)`.

use sala_formats::{ClipSearch, IntQuantizer, IntScheme, QuantParams};
use sala_hessian::faer::MatRef;
use sala_hessian::reference::{gptq_column_loop, inverse_upper_textbook};
use sala_hessian::{BlockedLoop, ColumnProblem, GptqColumnLoop, Hessian};
use sala_kernels::gptq::{effective_block, gptq_launch_choice, MAX_BLOCK, TEAM};
use sala_kernels::{gptq_solve, CubeGemm, DeviceGptqConfig, DeviceVec, KernelError, MatrixView};

use crate::common::{client, Rng};

/// A random SPD Hessian `XᵀX/tokens` with uneven channel scales, and `U` from the textbook
/// inverse (f64, rounded to f32), row-major.
fn upper_factor(rng: &mut Rng, inp: usize) -> Vec<f32> {
    let tokens = 2 * inp;
    let channel: Vec<f32> = (0..inp).map(|_| 0.2 + 2.0 * rng.uniform()).collect();
    let x: Vec<f64> = (0..tokens * inp)
        .map(|k| (rng.normal() * channel[k % inp]) as f64)
        .collect();
    let mut h = vec![0.0f64; inp * inp];
    for t in 0..tokens {
        let row = &x[t * inp..(t + 1) * inp];
        for i in 0..inp {
            for j in 0..inp {
                h[i * inp + j] += row[i] * row[j] / tokens as f64;
            }
        }
    }
    let h = Hessian::from_row_major(inp, &h).unwrap();
    let u = inverse_upper_textbook(&h, 0.01).unwrap();
    (0..inp * inp)
        .map(|k| u[(k / inp, k % inp)] as f32)
        .collect()
}

/// Row `r`'s loss `Σ_c (w − q)²/(2·U[c,c]²)` from the error-updated weights `updated`, the
/// codes and the group parameters `[out, groups]` of a host loop (`[out, inp]` row-major).
fn row_loss_of(
    r: usize,
    inp: usize,
    group: usize,
    u: &[f32],
    updated: &[f32],
    codes: &[u8],
    params: &[QuantParams],
) -> f64 {
    let groups = inp.div_ceil(group);
    (0..inp)
        .map(|c| {
            let q = IntQuantizer::dequantize(codes[r * inp + c], params[r * groups + c / group]);
            let diff = (updated[r * inp + c] - q) as f64;
            let d = u[c * inp + c] as f64;
            diff * diff / (2.0 * d * d)
        })
        .sum()
}

/// Solves on both sides and compares row by row: a row without a flipped code must have the
/// reference's parameters and loss; a row with one must flip first at a rounding boundary
/// (SymmetricIst puts a negative absmax exactly on the tie −7.5, so its result hangs on the
/// last bit of the error-updated weight), and such rows must be few.
fn compare(out: usize, inp: usize, config: DeviceGptqConfig, seed: u64) {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(seed);
    let u = upper_factor(&mut rng, inp);
    let w: Vec<f32> = (0..out * inp).map(|_| 0.1 * rng.normal()).collect();
    let quantizer = IntQuantizer::new(config.bits, config.scheme).unwrap();
    let gs = config.group_size.unwrap_or(inp).min(inp);
    let cpu = gptq_column_loop(
        &w,
        out,
        inp,
        MatRef::from_row_major_slice(&u, inp, inp),
        quantizer,
        gs,
    )
    .unwrap();

    // W as a window at (2, 3) of a wider buffer: unaligned offsets all the way through.
    let wide = inp + 5;
    let mut buffer = vec![f32::NAN; (out + 2) * wide];
    for r in 0..out {
        buffer[(r + 2) * wide + 3..(r + 2) * wide + 3 + inp]
            .copy_from_slice(&w[r * inp..(r + 1) * inp]);
    }
    let w_view = MatrixView::upload(&client, &buffer, out + 2, wide)
        .unwrap()
        .window(2, 3, out, inp)
        .unwrap();
    let u_view = MatrixView::upload(&client, &u, inp, inp).unwrap();
    let gpu = gptq_solve(&client, &CubeGemm, &w_view, &u_view, &config, None).unwrap();
    let host = gpu.download(&client).unwrap();

    let label = format!("{config:?} {out}×{inp}");
    let row_loss = gpu.row_loss.download(&client).unwrap();
    let groups = inp.div_ceil(gs);
    let mut flipped_rows = 0;
    for r in 0..out {
        let codes = |c: &[u8]| c[r * inp..(r + 1) * inp].to_vec();
        let (g_codes, c_codes) = (codes(&host.codes), codes(&cpu.codes));
        if let Some(c) = (0..inp).find(|&c| g_codes[c] != c_codes[c]) {
            // The first difference of a row must be a rounding boundary of the reference's
            // value (f32 rounding orders differ: the GEMM sums a block's updates first);
            // the row then follows a different, equally valid path.
            let p = cpu.params[r * groups + c / gs];
            let v = (cpu.weights[r * inp + c] / p.scale).abs();
            let from_tie = (v.fract() - 0.5).abs();
            assert!(
                from_tie < 1e-3,
                "{label}: row {r} column {c} flipped {v} (not at a tie)"
            );
            flipped_rows += 1;
            continue;
        }
        // The group ranges come from error-updated weights whose last bits depend on the
        // summation order (a few ulps after several blocks): 1e-5, not 1e-6.
        for g in 0..groups {
            let (a, b) = (host.params[r * groups + g], cpu.params[r * groups + g]);
            assert!(
                a.zero == b.zero && (a.scale - b.scale).abs() <= 1e-5 * b.scale,
                "{label}: row {r} group {g}: {a:?} vs {b:?}"
            );
        }
        let want = row_loss_of(r, inp, gs, &u, &cpu.weights, &cpu.codes, &cpu.params);
        let rel = (row_loss[r] as f64 - want).abs() / want;
        assert!(
            rel < 1e-4,
            "{label}: row {r} loss {} vs {want}",
            row_loss[r]
        );
    }
    assert!(
        flipped_rows * 10 <= out,
        "{label}: {flipped_rows} of {out} rows have a flipped code"
    );
    let cpu_loss: f64 = cpu.column_loss.iter().sum();
    let rel = (gpu.loss - cpu_loss).abs() / cpu_loss;
    eprintln!("{label}: {flipped_rows} rows with boundary flips, loss rel {rel:e}");
    // Flipped rows take other paths: the total only agrees loosely.
    assert!(rel < 1e-3, "{label}: loss {} vs {cpu_loss}", gpu.loss);
    assert!(
        host.codes.iter().all(|&c| c <= quantizer.maxq()),
        "{label}: code out of range"
    );
}

#[test]
fn symmetric_groups_inside_blocks() {
    let config = DeviceGptqConfig {
        bits: 4,
        group_size: Some(32),
        scheme: IntScheme::SymmetricIst,
        block: 64,
        clip: None,
    };
    compare(64, 256, config, 1);
}

#[test]
fn asymmetric_production_shape_128_128() {
    let config = DeviceGptqConfig {
        bits: 4,
        group_size: Some(128),
        scheme: IntScheme::Asymmetric,
        block: 128,
        clip: None,
    };
    compare(96, 384, config, 2);
}

#[test]
fn wide_blocks_and_a_narrow_last_block() {
    // Blocks of 256 (8 columns per unit), two groups per block, a last block of 64 columns.
    let config = DeviceGptqConfig {
        bits: 4,
        group_size: Some(128),
        scheme: IntScheme::SymmetricIst,
        block: 256,
        clip: None,
    };
    compare(37, 576, config, 5);
}

#[test]
fn groups_longer_than_blocks_and_per_channel() {
    let long_groups = DeviceGptqConfig {
        bits: 4,
        group_size: Some(96),
        scheme: IntScheme::SymmetricIst,
        block: 64,
        clip: None,
    };
    assert_eq!(effective_block(64, 96, 200), 32);
    compare(40, 200, long_groups, 3);
    let per_channel = DeviceGptqConfig {
        bits: 3,
        group_size: None,
        scheme: IntScheme::SymmetricAbsMax,
        block: 48,
        clip: None,
    };
    compare(33, 160, per_channel, 4);
}

#[test]
fn bad_configs_and_shapes_are_errors() {
    let Some(client) = client() else {
        return;
    };
    let w = MatrixView::zeros(&client, 4, 16).unwrap();
    let u = MatrixView::zeros(&client, 16, 16).unwrap();
    let ok = DeviceGptqConfig::default();
    let bad_u = MatrixView::zeros(&client, 15, 16).unwrap();
    assert!(matches!(
        gptq_solve(&client, &CubeGemm, &w, &bad_u, &ok, None),
        Err(KernelError::Shape { .. })
    ));
    for config in [
        DeviceGptqConfig { bits: 9, ..ok },
        DeviceGptqConfig {
            group_size: Some(0),
            ..ok
        },
        DeviceGptqConfig { block: 0, ..ok },
    ] {
        assert!(
            gptq_solve(&client, &CubeGemm, &w, &u, &config, None).is_err(),
            "{config:?}"
        );
    }
    let choice = gptq_launch_choice(&client, 4096, &ok).unwrap();
    eprintln!("gptq launch choice for blocks of 128: {choice:?}");
    assert_eq!((choice.block, choice.columns_per_unit), (128, 128 / TEAM));
    assert!(choice.rows_per_cube >= 1);
    // Blocks that do not divide into the team leave the last unit columns idle.
    let odd = DeviceGptqConfig {
        block: 48,
        group_size: Some(48),
        ..ok
    };
    assert_eq!(
        gptq_launch_choice(&client, 4096, &odd)
            .unwrap()
            .columns_per_unit,
        2
    );
    let too_long = DeviceGptqConfig {
        block: MAX_BLOCK + 1,
        ..ok
    };
    assert!(gptq_launch_choice(&client, 4096, &too_long).is_err());
}

/// The clipping search on the device against the host's column loop with the same search
/// (`BlockedLoop`, which calls `ClipSearch::params` at every group start), on the same
/// prepared `(W, U)` and column weights: rows without a flipped code have the same group
/// parameters and a loss within 1e-4; a flip (a code at a rounding tie, or two candidates
/// whose errors tie to f32 rounding) must be rare. Norms 2 (products) and 2.4 (`powf`),
/// weighted and not, groups shorter and longer than the configured block.
#[test]
fn device_clip_search_matches_the_host_loop() {
    let Some(client) = client() else {
        return;
    };
    for (seed, inp, group, block, norm, weighted) in [
        (11u64, 256usize, 64usize, 128usize, 2.0f32, true),
        (12, 256, 128, 64, 2.4, true),
        (13, 192, 64, 64, 2.0, false),
        (14, 160, 32, 128, 2.4, false),
    ] {
        let out = 40;
        let mut rng = Rng::new(seed);
        let u = upper_factor(&mut rng, inp);
        // Heavy tails: a few large weights per row give the search ranges worth clipping.
        let w: Vec<f32> = (0..out * inp)
            .map(|_| {
                let v = 0.1 * rng.normal();
                if rng.uniform() < 0.02 {
                    8.0 * v
                } else {
                    v
                }
            })
            .collect();
        let column_weights: Vec<f32> = (0..inp).map(|_| 0.1 + 2.0 * rng.uniform()).collect();
        let search = ClipSearch::new(100, 0.8, norm).unwrap();
        let quantizer = IntQuantizer::new(4, IntScheme::SymmetricIst).unwrap();
        let upper = MatRef::from_row_major_slice(&u, inp, inp);
        let problem = ColumnProblem {
            quantizer,
            out,
            inp,
            group_size: group,
            block_size: block,
            upper,
            static_groups: None,
            clip: Some((search, &column_weights)),
        };
        let mut host_w = w.clone();
        let host = if weighted {
            BlockedLoop.run(&problem, &mut host_w).unwrap()
        } else {
            let ones = vec![1.0f32; inp];
            let problem = ColumnProblem {
                clip: Some((search, &ones)),
                ..problem
            };
            BlockedLoop.run(&problem, &mut host_w).unwrap()
        };

        let config = DeviceGptqConfig {
            bits: 4,
            group_size: Some(group),
            scheme: IntScheme::SymmetricIst,
            block,
            clip: Some(search),
        };
        let choice = gptq_launch_choice(&client, inp, &config).unwrap();
        assert!(
            choice.block <= group,
            "a group starts inside a block: {choice:?}"
        );
        let w_view = MatrixView::upload(&client, &w, out, inp).unwrap();
        let u_view = MatrixView::upload(&client, &u, inp, inp).unwrap();
        let weights = DeviceVec::upload(&client, &column_weights);
        let gpu = gptq_solve(
            &client,
            &CubeGemm,
            &w_view,
            &u_view,
            &config,
            weighted.then_some(&weights),
        )
        .unwrap();
        let device = gpu.download(&client).unwrap();
        let row_loss = gpu.row_loss.download(&client).unwrap();

        let label = format!("group {group} block {block} norm {norm} weighted {weighted}");
        let groups = inp.div_ceil(group);
        let mut flipped_rows = 0;
        let mut clipped_groups = 0;
        for r in 0..out {
            let row = r * inp..(r + 1) * inp;
            if device.codes[row.clone()] != host.codes[row] {
                flipped_rows += 1;
                continue;
            }
            for g in 0..groups {
                let (a, b) = (
                    device.params[r * groups + g],
                    host.params_rows[r * groups + g],
                );
                assert!(
                    a.zero == b.zero && (a.scale - b.scale).abs() <= 1e-5 * b.scale,
                    "{label}: row {r} group {g}: {a:?} vs {b:?}"
                );
                let cols = g * group..((g + 1) * group).min(inp);
                let absmax = w[r * inp..][cols].iter().fold(0f32, |m, v| m.max(v.abs()));
                clipped_groups += usize::from(b.scale < 0.99 * 2.0 * absmax / 15.0);
            }
            // `host_w` holds the error-updated weight each column was quantized from.
            let want = row_loss_of(r, inp, group, &u, &host_w, &host.codes, &host.params_rows);
            let rel = (row_loss[r] as f64 - want).abs() / want;
            assert!(
                rel < 1e-4,
                "{label}: row {r} loss {} vs {want}",
                row_loss[r]
            );
        }
        eprintln!("{label}: {flipped_rows} of {out} rows flipped, {clipped_groups} groups clipped");
        assert!(
            flipped_rows * 10 <= out,
            "{label}: {flipped_rows} of {out} rows flipped"
        );
        assert!(clipped_groups > 0, "{label}: the search never clipped");
        let host_loss: f64 = host.column_loss.iter().sum();
        let rel = (gpu.loss - host_loss).abs() / host_loss;
        assert!(rel < 1e-3, "{label}: loss {} vs {host_loss}", gpu.loss);
    }
}
