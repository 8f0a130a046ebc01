//! `causal_softmax_rows` against a plain f64 reference: shapes with rows longer than a cube
//! (the strided loop), `first_query` 0 and past the start, large scores, exact zeros past the
//! diagonal, rows summing to 1, and the input checks.

use cubecl::ir::{ElemType, FloatKind, StorageType};
use sala_kernels::softmax::{causal_softmax_rows, causal_softmax_rows_as, SoftmaxShape};
use sala_kernels::{DeviceVec, KernelError};

use crate::common::{client, Rng, TestRuntime};

type Client = cubecl::prelude::ComputeClient<TestRuntime>;

/// Runs the kernel; `p` starts as NaN so that an element it fails to write shows.
fn run(client: &Client, shape: &SoftmaxShape, scores: &[f32]) -> Result<Vec<f32>, KernelError> {
    let s = DeviceVec::upload(client, scores);
    let p = DeviceVec::upload(client, &vec![f32::NAN; scores.len()]);
    causal_softmax_rows::<TestRuntime, f32>(client, &s.handle, &p.handle, shape)?;
    p.download(client)
}

/// The definition in f64 (dense `[batch, rows, keys]`).
fn reference(shape: &SoftmaxShape, scores: &[f32]) -> Vec<f64> {
    let mut p = vec![0.0f64; scores.len()];
    for row in 0..shape.batch * shape.rows {
        let base = row * shape.keys;
        let valid = (shape.first_query + row % shape.rows + 1).min(shape.keys);
        let s = &scores[base..base + valid];
        let m = s.iter().map(|&x| x as f64).fold(f64::MIN, f64::max);
        let sum: f64 = s.iter().map(|&x| (x as f64 - m).exp()).sum();
        for (c, &x) in s.iter().enumerate() {
            p[base + c] = (x as f64 - m).exp() / sum;
        }
    }
    p
}

/// Checks one shape: masked entries exactly 0, valid ones within `1e-6` of the reference
/// (relative to the row's largest probability), every row summing to 1 within `1e-6`.
fn check(client: &Client, rng: &mut Rng, shape: SoftmaxShape, magnitude: f32) {
    let n = shape.batch * shape.rows * shape.keys;
    let scores: Vec<f32> = (0..n).map(|_| magnitude * rng.signed()).collect();
    let got = run(client, &shape, &scores).unwrap();
    let want = reference(&shape, &scores);
    for row in 0..shape.batch * shape.rows {
        let base = row * shape.keys;
        let valid = (shape.first_query + row % shape.rows + 1).min(shape.keys);
        let got = &got[base..base + shape.keys];
        let want = &want[base..base + shape.keys];
        assert!(
            got[valid..].iter().all(|&x| x == 0.0),
            "{shape:?} row {row}: masked entries {:?}",
            &got[valid..valid + 4.min(shape.keys - valid)]
        );
        let err = got[..valid]
            .iter()
            .zip(want)
            .map(|(&a, &b)| (a as f64 - b).abs())
            .fold(0.0f64, f64::max);
        assert!(err < 1e-6, "{shape:?} row {row}: max error {err}");
        let sum: f64 = got.iter().map(|&x| x as f64).sum();
        assert!((sum - 1.0).abs() < 1e-6, "{shape:?} row {row}: sum {sum}");
        assert!(got.iter().all(|x| x.is_finite()), "{shape:?} row {row}");
    }
}

#[test]
fn matches_the_reference_on_various_shapes() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(11);
    for (batch, rows, keys, first_query) in [
        (1, 1, 1, 0),
        (1, 5, 5, 0),
        (2, 7, 19, 12),
        (3, 40, 40, 0),
        (1, 16, 300, 284),
        (2, 3, 700, 697),
        (3, 8, 700, 300),
        // Fewer keys than the rows' diagonals: the rows past them see every key.
        (2, 10, 6, 0),
        (1, 4, 257, 1000),
    ] {
        let shape = SoftmaxShape {
            batch,
            rows,
            keys,
            first_query,
        };
        check(&client, &mut rng, shape, 4.0);
    }
}

#[test]
fn large_scores_stay_finite() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(12);
    for (batch, rows, keys, first_query) in [(2, 12, 600, 588), (1, 9, 9, 0)] {
        let shape = SoftmaxShape {
            batch,
            rows,
            keys,
            first_query,
        };
        check(&client, &mut rng, shape, 80.0);
    }
    // One dominant key far above the rest: a one-hot row.
    let shape = SoftmaxShape {
        batch: 1,
        rows: 1,
        keys: 513,
        first_query: 512,
    };
    let mut scores = vec![-80.0f32; 513];
    scores[300] = 80.0;
    let got = run(&client, &shape, &scores).unwrap();
    assert_eq!(got[300], 1.0);
    assert!(got.iter().enumerate().all(|(c, &x)| c == 300 || x == 0.0));
}

#[test]
fn bad_shapes_are_errors() {
    let Some(client) = client() else {
        return;
    };
    let shape = SoftmaxShape {
        batch: 2,
        rows: 3,
        keys: 4,
        first_query: 0,
    };
    let big = DeviceVec::upload(&client, &[0.0f32; 24]);
    let small = DeviceVec::upload(&client, &[0.0f32; 23]);
    // Scores too small, probabilities too small.
    for (s, p, what) in [
        (&small, &big, "softmax scores"),
        (&big, &small, "softmax p"),
    ] {
        let err = causal_softmax_rows::<TestRuntime, f32>(&client, &s.handle, &p.handle, &shape)
            .unwrap_err();
        assert!(
            matches!(err, KernelError::Shape { what: w, .. } if w == what),
            "{err}"
        );
    }
    // No keys.
    let err = causal_softmax_rows::<TestRuntime, f32>(
        &client,
        &big.handle,
        &big.handle,
        &SoftmaxShape { keys: 0, ..shape },
    )
    .unwrap_err();
    assert!(matches!(err, KernelError::Shape { .. }), "{err}");
    // Past 32-bit indexing.
    let err = causal_softmax_rows::<TestRuntime, f32>(
        &client,
        &big.handle,
        &small.handle,
        &SoftmaxShape {
            batch: 1 << 16,
            rows: 1 << 16,
            keys: 2,
            first_query: 0,
        },
    )
    .unwrap_err();
    assert!(matches!(err, KernelError::Unsupported { .. }), "{err}");
    // Overflowing sizes.
    let err = causal_softmax_rows::<TestRuntime, f32>(
        &client,
        &big.handle,
        &small.handle,
        &SoftmaxShape {
            batch: usize::MAX,
            rows: 2,
            keys: 2,
            first_query: 0,
        },
    )
    .unwrap_err();
    assert!(matches!(err, KernelError::Unsupported { .. }), "{err}");
    // Not a float output type.
    let err = causal_softmax_rows_as(
        &client,
        &big.handle,
        &small.handle,
        &shape,
        StorageType::Scalar(ElemType::UInt(cubecl::ir::UIntKind::U32)),
    )
    .unwrap_err();
    assert!(matches!(err, KernelError::Unsupported { .. }), "{err}");
    // A bf16 output is checked at 2 bytes an element: 24 of them need 12 f32 slots, not 11
    // (the check fails before any launch: lavapipe has no bf16).
    let bf16 = StorageType::Scalar(ElemType::Float(FloatKind::BF16));
    let err = causal_softmax_rows_as(
        &client,
        &big.handle,
        &DeviceVec::upload(&client, &[0.0f32; 11]).handle,
        &shape,
        bf16,
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            KernelError::Shape {
                what: "softmax p",
                ..
            }
        ),
        "{err}"
    );
    // An empty problem does nothing.
    causal_softmax_rows::<TestRuntime, f32>(
        &client,
        &big.handle,
        &big.handle,
        &SoftmaxShape { rows: 0, ..shape },
    )
    .unwrap();
}

/// On CUDA only (`--features cuda`, an NVIDIA GPU): the bf16 output of the softmax and the
/// cuBLAS route to attention against the portable flash kernel. CI never builds these.
#[cfg(feature = "cuda")]
mod cuda {
    use std::time::Instant;

    use cubecl::server::Handle;
    use sala_kernels::attention::{causal_gqa_attention, AttentionShape};
    use sala_kernels::cuda::{attention_blocking, blocked_causal_attention_bf16, Cublas};

    use super::*;

    /// Round to nearest even (finite inputs).
    fn to_bf16(x: f32) -> u16 {
        let b = x.to_bits();
        ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
    }

    fn from_bf16(b: u16) -> f32 {
        f32::from_bits((b as u32) << 16)
    }

    /// bf16 values packed two to a `u32` (little-endian: element `2i` in the low half).
    fn upload_bf16(client: &Client, bits: &[u16]) -> DeviceVec<u32> {
        let packed: Vec<u32> = bits
            .chunks(2)
            .map(|c| c[0] as u32 | (*c.get(1).unwrap_or(&0) as u32) << 16)
            .collect();
        DeviceVec::upload(client, &packed)
    }

    /// The first `n` bf16 values of `packed`.
    fn download_bf16(client: &Client, packed: &DeviceVec<u32>, n: usize) -> Vec<f32> {
        let packed: Vec<u32> = packed.download(client).unwrap();
        packed
            .iter()
            .flat_map(|&w| [from_bf16(w as u16), from_bf16((w >> 16) as u16)])
            .take(n)
            .collect()
    }

    #[test]
    fn softmax_writes_bf16() {
        let Some(client) = client() else {
            return;
        };
        let mut rng = Rng::new(21);
        let shape = SoftmaxShape {
            batch: 3,
            rows: 17,
            keys: 1000,
            first_query: 983,
        };
        let n = 3 * 17 * 1000;
        let scores: Vec<f32> = (0..n).map(|_| 6.0 * rng.signed()).collect();
        let s = DeviceVec::upload(&client, &scores);
        let p = DeviceVec::upload(&client, &vec![u32::MAX; n / 2]);
        let bf16 = StorageType::Scalar(ElemType::Float(FloatKind::BF16));
        causal_softmax_rows_as(&client, &s.handle, &p.handle, &shape, bf16).unwrap();
        let got = download_bf16(&client, &p, n);
        let want = reference(&shape, &scores);
        for (i, (&a, &b)) in got.iter().zip(&want).enumerate() {
            assert!((a as f64 - b).abs() <= b.abs() / 256.0, "{i}: {a} vs {b}");
        }
    }

    fn random_bf16(rng: &mut Rng, n: usize) -> Vec<u16> {
        (0..n).map(|_| to_bf16(rng.normal())).collect()
    }

    #[test]
    fn blocked_attention_matches_the_flash_kernel() {
        let Some(client) = client() else {
            return;
        };
        let blas = Cublas::new(0).unwrap();
        let mut rng = Rng::new(22);
        let shape = AttentionShape {
            heads: 32,
            kv_heads: 2,
            head_dim: 128,
            scale: 1.0 / (128f32).sqrt(),
        };
        let offsets = [0, 2500, 3200, 3201];
        let tokens = 3201;
        let blocking = attention_blocking(&shape, &offsets).unwrap();
        println!("{blocking:?}");
        let (qn, kvn) = (tokens * 32 * 128, tokens * 2 * 128);
        let (q, k, v) = (
            random_bf16(&mut rng, qn),
            random_bf16(&mut rng, kvn),
            random_bf16(&mut rng, kvn),
        );
        let out = upload_bf16(&client, &vec![0x7FC0; qn]);
        let t = Instant::now();
        blocked_causal_attention_bf16(
            &client,
            &blas,
            &shape,
            &offsets,
            &upload_bf16(&client, &q).handle,
            &upload_bf16(&client, &k).handle,
            &upload_bf16(&client, &v).handle,
            &out.handle,
        )
        .unwrap();
        println!("blocked attention, {tokens} tokens: {:?}", t.elapsed());
        let got = download_bf16(&client, &out, qn);

        let f = |x: &[u16]| -> Handle {
            let vals: Vec<f32> = x.iter().map(|&b| from_bf16(b)).collect();
            DeviceVec::upload(&client, &vals).handle
        };
        let want_h = DeviceVec::upload(&client, &vec![f32::NAN; qn]);
        causal_gqa_attention::<TestRuntime, f32>(
            &client,
            &shape,
            &offsets,
            &f(&q),
            &f(&k),
            &f(&v),
            &want_h.handle,
        )
        .unwrap();
        let want = want_h.download(&client).unwrap();
        let mut max_err = 0.0f32;
        let mut sum_err = 0.0f64;
        for (&a, &b) in got.iter().zip(&want) {
            assert!(a.is_finite(), "non-finite output");
            let e = (a - b).abs();
            max_err = max_err.max(e);
            sum_err += e as f64;
        }
        let max_want = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        println!(
            "max |err| {max_err}, mean |err| {}, max |out| {max_want}",
            sum_err / qn as f64
        );
        assert!(max_err < 2e-2, "max |err| {max_err}");
    }

    /// `cargo test --features cuda --test wgpu -- --ignored --nocapture blocked_attention_speed`
    #[test]
    #[ignore]
    fn blocked_attention_speed() {
        let Some(client) = client() else {
            return;
        };
        let blas = Cublas::new(0).unwrap();
        let shape = AttentionShape {
            heads: 32,
            kv_heads: 2,
            head_dim: 128,
            scale: 1.0 / (128f32).sqrt(),
        };
        let mut rng = Rng::new(23);
        let tile: Vec<u16> = random_bf16(&mut rng, 1 << 20);
        for tokens in [8192usize, 32768, 131072] {
            let offsets = [0, tokens];
            let blocking = attention_blocking(&shape, &offsets).unwrap();
            let make = |n: usize| {
                let bits: Vec<u16> = tile.iter().cycle().take(n).copied().collect();
                upload_bf16(&client, &bits)
            };
            let (q, k, v) = (
                make(tokens * 32 * 128),
                make(tokens * 2 * 128),
                make(tokens * 2 * 128),
            );
            let out = make(tokens * 32 * 128);
            let t = Instant::now();
            blocked_causal_attention_bf16(
                &client,
                &blas,
                &shape,
                &offsets,
                &q.handle,
                &k.handle,
                &v.handle,
                &out.handle,
            )
            .unwrap();
            let secs = t.elapsed().as_secs_f64();
            // Useful work: the causal half of 2 GEMMs.
            let flops = 4.0 * 32.0 * 128.0 * (tokens as f64) * (tokens as f64 + 1.0) / 2.0;
            println!(
                "{tokens} tokens, {blocking:?}: {secs:.3} s, {:.0} TFLOP/s useful",
                flops / secs / 1e12
            );
            let got = download_bf16(&client, &out, 4096);
            assert!(got.iter().all(|x| x.is_finite()));
        }
    }
}
