//! The one-pass channel statistics against an f64 host sum over the same rows, in f32 (every
//! runtime) and in bf16 (where the runtime stores it), with row and column counts that leave
//! partial cubes and partial blocks, and weights that differ from run to run.

use cubecl::ir::{ElemType, FloatKind};
use cubecl::prelude::CubeElement;
use half::bf16;
use sala_kernels::channel_stats::{channel_sums, ChannelBlocks};

use crate::common::{client, Rng, TestRuntime};

type Client = cubecl::prelude::ComputeClient<TestRuntime>;

/// `[Σ w x², Σ w |x|, max |x|]` per column, folded over the kernel's blocks.
fn folded(
    client: &Client,
    x_bytes: &[u8],
    is_bf16: bool,
    weights: &[f32],
    rows: usize,
    cols: usize,
) -> [Vec<f32>; 3] {
    let blocks = ChannelBlocks::for_rows(rows);
    let x = client.create_from_slice(x_bytes);
    let w = client.create_from_slice(f32::as_bytes(weights));
    let partials = client.empty(blocks.partial_len(cols) * 4);
    match is_bf16 {
        true => channel_sums::<TestRuntime, bf16>(client, &x, &w, &partials, rows, cols),
        false => channel_sums::<TestRuntime, f32>(client, &x, &w, &partials, rows, cols),
    }
    .unwrap();
    let bytes = client.read_one(partials).expect("read back");
    let p = f32::from_bytes(&bytes);
    let plane = blocks.blocks * cols;
    let fold = |s: usize, f: fn(f32, f32) -> f32| -> Vec<f32> {
        (0..cols)
            .map(|c| {
                (0..blocks.blocks)
                    .map(|b| p[s * plane + b * cols + c])
                    .fold(0.0, f)
            })
            .collect()
    };
    [
        fold(0, |a, b| a + b),
        fold(1, |a, b| a + b),
        fold(2, f32::max),
    ]
}

/// The host's f64 statistics of `x` (values as f32).
fn reference(x: &[f32], weights: &[f32], rows: usize, cols: usize) -> [Vec<f64>; 3] {
    let mut out = [vec![0f64; cols], vec![0f64; cols], vec![0f64; cols]];
    for r in 0..rows {
        for c in 0..cols {
            let a = x[r * cols + c].abs() as f64;
            out[0][c] += weights[r] as f64 * a * a;
            out[1][c] += weights[r] as f64 * a;
            out[2][c] = out[2][c].max(a);
        }
    }
    out
}

/// Weights `1/T` of samples of varied lengths covering `rows` rows.
fn sample_weights(rows: usize) -> Vec<f32> {
    let mut weights = Vec::with_capacity(rows);
    let mut len = 7;
    while weights.len() < rows {
        let n = len.min(rows - weights.len());
        weights.extend(std::iter::repeat_n(1.0 / len as f32, n));
        len = len * 3 % 1000 + 1;
    }
    weights
}

fn check(got: &[Vec<f32>; 3], want: &[Vec<f64>; 3], what: &str) {
    for (s, name) in ["squares", "absolute values"].iter().enumerate() {
        for (c, (&g, &w)) in got[s].iter().zip(&want[s]).enumerate() {
            let err = (g as f64 - w).abs() / w.abs().max(1e-12);
            assert!(
                err < 1e-5,
                "{what}: sum of {name}, column {c}: {g} against {w}"
            );
        }
    }
    // Maxima are one of the inputs: exact.
    for (c, (&g, &w)) in got[2].iter().zip(&want[2]).enumerate() {
        assert_eq!(g as f64, w, "{what}: maximum, column {c}");
    }
}

#[test]
fn f32_channel_sums_match_an_f64_host_sum() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(71);
    // A partial cube of columns and a partial block of rows; more rows than 512 blocks of
    // the minimum size hold, so that the blocks grow.
    for (rows, cols) in [(300, 37), (1000, 300), (140_000, 3)] {
        let x: Vec<f32> = (0..rows * cols).map(|_| rng.signed() * 4.0).collect();
        let weights = sample_weights(rows);
        let got = folded(&client, f32::as_bytes(&x), false, &weights, rows, cols);
        check(
            &got,
            &reference(&x, &weights, rows, cols),
            &format!("f32 {rows}×{cols}"),
        );
    }
}

#[test]
fn bf16_channel_sums_read_the_stored_values() {
    let Some(client) = client() else {
        return;
    };
    if !client
        .properties()
        .supports_type(ElemType::Float(FloatKind::BF16))
    {
        eprintln!("NOTICE: bf16 channel sums not tested: the runtime stores no bf16");
        return;
    }
    let mut rng = Rng::new(72);
    let (rows, cols) = (700, 260);
    let x: Vec<bf16> = (0..rows * cols)
        .map(|_| bf16::from_f32(rng.signed() * 4.0))
        .collect();
    let weights = sample_weights(rows);
    let values: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let got = folded(&client, bf16::as_bytes(&x), true, &weights, rows, cols);
    check(
        &got,
        &reference(&values, &weights, rows, cols),
        "bf16 700×260",
    );
}

#[test]
fn channel_blocks_cover_the_rows_within_their_bounds() {
    for rows in [0, 1, 255, 256, 257, 131_072, 2_000_000] {
        let b = ChannelBlocks::for_rows(rows);
        assert!(b.blocks >= 1 && b.blocks <= 512, "{rows}: {b:?}");
        assert!(b.rows_per_block >= 256, "{rows}: {b:?}");
        assert!(b.blocks * b.rows_per_block >= rows, "{rows}: {b:?}");
        assert!(
            (b.blocks - 1) * b.rows_per_block < rows.max(1),
            "{rows}: {b:?}"
        );
    }
}

#[test]
fn short_buffers_are_refused_before_the_launch() {
    let Some(client) = client() else {
        return;
    };
    let x = client.empty(10 * 8 * 4);
    let w = client.empty(10 * 4);
    let partials = client.empty(3 * 8 * 4);
    // 11 rows of x need 352 bytes.
    let err = channel_sums::<TestRuntime, f32>(&client, &x, &w, &partials, 11, 8).unwrap_err();
    assert!(err.to_string().contains("channel sums x"), "{err}");
    let err = channel_sums::<TestRuntime, f32>(&client, &x, &client.empty(4), &partials, 10, 8)
        .unwrap_err();
    assert!(err.to_string().contains("channel sums weights"), "{err}");
}
