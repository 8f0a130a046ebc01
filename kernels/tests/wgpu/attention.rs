//! `causal_gqa_attention` against a naive f64 reference (a full score row per query, per
//! sequence): varlen packs, GQA group sizes from 1 to 64, every supported head_dim, large
//! scores, packed-versus-alone equality and the input checks.

use cubecl::server::Handle;
use sala_kernels::attention::{causal_gqa_attention, AttentionShape};
use sala_kernels::{DeviceVec, KernelError};

use crate::common::{client, Rng, TestRuntime};

type Client = cubecl::prelude::ComputeClient<TestRuntime>;

/// The model's convention: `1/sqrt(head_dim)`.
pub(crate) fn shape(heads: usize, kv_heads: usize, head_dim: usize) -> AttentionShape {
    AttentionShape {
        heads,
        kv_heads,
        head_dim,
        scale: 1.0 / (head_dim as f32).sqrt(),
    }
}

/// Random `q [tokens, heads, d]`, `k`, `v [tokens, kv_heads, d]`, entries ~N(0, 1).
pub(crate) struct Inputs {
    pub(crate) q: Vec<f32>,
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
}

impl Inputs {
    pub(crate) fn random(rng: &mut Rng, shape: &AttentionShape, tokens: usize) -> Self {
        let mut normal = |n: usize| (0..n).map(|_| rng.normal()).collect::<Vec<f32>>();
        let d = shape.head_dim;
        Self {
            q: normal(tokens * shape.heads * d),
            k: normal(tokens * shape.kv_heads * d),
            v: normal(tokens * shape.kv_heads * d),
        }
    }
}

pub(crate) fn offsets_of(lengths: &[usize]) -> Vec<usize> {
    let mut offsets = vec![0];
    for &len in lengths {
        offsets.push(offsets.last().unwrap() + len);
    }
    offsets
}

fn upload(client: &Client, data: &[f32]) -> Handle {
    DeviceVec::upload(client, data).handle
}

/// Runs the kernel; `out` starts as NaN so that a row it fails to write shows.
fn run(
    client: &Client,
    shape: &AttentionShape,
    offsets: &[usize],
    x: &Inputs,
) -> Result<Vec<f32>, KernelError> {
    let n = x.q.len();
    let out = DeviceVec::upload(client, &vec![f32::NAN; n]);
    causal_gqa_attention::<TestRuntime, f32>(
        client,
        shape,
        offsets,
        &upload(client, &x.q),
        &upload(client, &x.k),
        &upload(client, &x.v),
        &out.handle,
    )?;
    out.download(client)
}

/// The definition in f64: for each query, the full causal score row of its sequence.
/// Returns the output and the largest `|score|` seen.
pub(crate) fn reference(shape: &AttentionShape, offsets: &[usize], x: &Inputs) -> (Vec<f64>, f64) {
    let (heads, kv_heads, d) = (shape.heads, shape.kv_heads, shape.head_dim);
    let group = heads / kv_heads;
    let mut out = vec![0.0f64; x.q.len()];
    let mut max_score = 0.0f64;
    for w in offsets.windows(2) {
        let (start, end) = (w[0], w[1]);
        for t in start..end {
            for h in 0..heads {
                let g = h / group;
                let qi = &x.q[(t * heads + h) * d..][..d];
                let scores: Vec<f64> = (start..=t)
                    .map(|j| {
                        let kj = &x.k[(j * kv_heads + g) * d..][..d];
                        let dot: f64 = qi.iter().zip(kj).map(|(&a, &b)| a as f64 * b as f64).sum();
                        shape.scale as f64 * dot
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                max_score = scores.iter().fold(max_score, |a, s| a.max(s.abs()));
                let p: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let sum: f64 = p.iter().sum();
                let o = &mut out[(t * heads + h) * d..][..d];
                for (pj, j) in p.iter().zip(start..=t) {
                    let vj = &x.v[(j * kv_heads + g) * d..][..d];
                    for (oc, &vc) in o.iter_mut().zip(vj) {
                        *oc += pj / sum * vc as f64;
                    }
                }
            }
        }
    }
    (out, max_score)
}

/// Largest `|got − want|` divided by `max |want|` (the scale of the output).
pub(crate) fn rel_error(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |a, w| a.max(w.abs())).max(1e-30);
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            assert!(g.is_finite(), "non-finite output {g} (want {w})");
            (g as f64 - w).abs()
        })
        .fold(0.0, f64::max)
        / scale
}

/// f32 accumulation over at most 300 keys and 128 products per score, each rounding at
/// ~6e-8 relative, with softmax weights that sum to 1: observed errors are ~1e-7 of max |out|;
/// 2e-5 leaves room for the exp of different backends (lavapipe's is not correctly rounded)
/// while catching any indexing or masking mistake (those are O(1)).
const TOLERANCE: f64 = 2e-5;

#[test]
fn matches_the_reference_on_varlen_packs_and_head_configs() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(41);
    let packs: [&[usize]; 4] = [&[1, 37, 130, 64], &[300], &[5, 5, 5], &[1]];
    // (heads, kv_heads, head_dim): GQA groups 2, 8, 1 (MHA), 3 (padding rows: 10 tokens × 3
    // heads per cube), 64 (two chunks of 32 heads per KV head).
    let configs = [(4, 2, 16), (8, 1, 32), (4, 4, 64), (6, 2, 16), (64, 1, 16)];
    for (heads, kv_heads, d) in configs {
        for lengths in packs {
            // Keep the reference cheap for the widest configurations.
            if heads * d > 512 && lengths.iter().sum::<usize>() > 200 {
                continue;
            }
            let shape = shape(heads, kv_heads, d);
            let offsets = offsets_of(lengths);
            let x = Inputs::random(&mut rng, &shape, *offsets.last().unwrap());
            let got = run(&client, &shape, &offsets, &x).unwrap();
            let (want, _) = reference(&shape, &offsets, &x);
            let err = rel_error(&got, &want);
            assert!(
                err < TOLERANCE,
                "heads {heads} kv {kv_heads} d {d} lengths {lengths:?}: error {err:e}"
            );
        }
    }
}

#[test]
fn matches_the_reference_at_the_model_shape() {
    // MiniCPM-SALA: 32 query heads on 2 KV heads (group 16), head_dim 128.
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(42);
    let shape = shape(32, 2, 128);
    for lengths in [&[70][..], &[1, 40, 29]] {
        let offsets = offsets_of(lengths);
        let x = Inputs::random(&mut rng, &shape, 70);
        let got = run(&client, &shape, &offsets, &x).unwrap();
        let (want, _) = reference(&shape, &offsets, &x);
        let err = rel_error(&got, &want);
        assert!(err < TOLERANCE, "lengths {lengths:?}: error {err:e}");
    }
}

#[test]
fn a_packed_run_equals_each_sequence_alone_bit_for_bit() {
    // Query tiles and key tiles start at each sequence's start, so a row's arithmetic (and
    // its rounding) does not depend on its neighbours in the pack: equality is exact.
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(43);
    for (heads, kv_heads, d) in [(4, 2, 16), (32, 2, 128)] {
        let shape = shape(heads, kv_heads, d);
        let lengths = [3, 50, 17];
        let offsets = offsets_of(&lengths);
        let x = Inputs::random(&mut rng, &shape, *offsets.last().unwrap());
        let packed = run(&client, &shape, &offsets, &x).unwrap();
        for w in offsets.windows(2) {
            let (start, end) = (w[0], w[1]);
            let slice = |data: &[f32], h: usize| data[start * h * d..end * h * d].to_vec();
            let alone = Inputs {
                q: slice(&x.q, heads),
                k: slice(&x.k, kv_heads),
                v: slice(&x.v, kv_heads),
            };
            let got = run(&client, &shape, &[0, end - start], &alone).unwrap();
            let packed_rows = &packed[start * heads * d..end * heads * d];
            assert!(
                got.iter()
                    .zip(packed_rows)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "d {d}: sequence {start}..{end} differs between the pack and alone"
            );
        }
    }
}

#[test]
fn large_scores_stay_finite_and_match() {
    // q scaled so that scores reach about ±80 (and beyond): a softmax without its running
    // max would overflow exp (f32 overflows past 88). Near one-hot weights make the output
    // sensitive to the scores' own f32 rounding (~6e-8 · 80 relative), hence 1e-4.
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(44);
    for (heads, kv_heads, d, factor) in [(4, 2, 32, 17.0f32), (32, 2, 128, 17.0)] {
        let shape = shape(heads, kv_heads, d);
        let offsets = offsets_of(&[70, 33]);
        let mut x = Inputs::random(&mut rng, &shape, 103);
        x.q.iter_mut().for_each(|e| *e *= factor);
        let got = run(&client, &shape, &offsets, &x).unwrap();
        let (want, max_score) = reference(&shape, &offsets, &x);
        assert!(
            (60.0..400.0).contains(&max_score),
            "the test should reach scores of ~80, got {max_score}"
        );
        let err = rel_error(&got, &want);
        assert!(
            err < 1e-4,
            "d {d}: max |score| {max_score:.0}, error {err:e}"
        );
    }
}

#[test]
fn bad_inputs_are_errors() {
    let Some(client) = client() else {
        return;
    };
    let good = shape(4, 2, 16);
    let tokens = 10;
    let x = Inputs::random(&mut Rng::new(45), &good, tokens);
    let call = |shape: &AttentionShape, offsets: &[usize]| run(&client, shape, offsets, &x);
    let detail = |e: KernelError| e.to_string();

    for (offsets, expected) in [
        (&[][..], "holds no sequence"),
        (&[0], "holds no sequence"),
        (&[1, 10], "first offset is 1"),
        (&[0, 4, 4, 10], "strictly increasing"),
        (&[0, 6, 4, 10], "strictly increasing"),
    ] {
        let err = call(&good, offsets).unwrap_err();
        assert!(
            matches!(
                err,
                KernelError::Shape {
                    what: "attention offsets",
                    ..
                }
            ),
            "{offsets:?}: {err}"
        );
        assert!(detail(err).contains(expected), "{offsets:?}");
    }

    let err = call(&shape(6, 4, 16), &[0, 10]).unwrap_err();
    assert!(
        matches!(
            err,
            KernelError::Shape {
                what: "attention heads",
                ..
            }
        ),
        "{err}"
    );
    let err = call(&shape(4, 0, 16), &[0, 10]).unwrap_err();
    assert!(matches!(
        err,
        KernelError::Shape {
            what: "attention heads",
            ..
        }
    ));

    for d in [0, 8, 48, 256] {
        let err = call(&shape(4, 2, d), &[0, 10]).unwrap_err();
        assert!(
            matches!(
                err,
                KernelError::Unsupported {
                    what: "attention head_dim",
                    ..
                }
            ),
            "{d}: {err}"
        );
    }

    for scale in [f32::NAN, f32::INFINITY] {
        let err = call(&AttentionShape { scale, ..good }, &[0, 10]).unwrap_err();
        assert!(matches!(
            err,
            KernelError::Unsupported {
                what: "attention scale",
                ..
            }
        ));
    }

    // The buffers hold 10 tokens; offsets claiming 11 leave every buffer too small.
    let err = call(&good, &[0, 5, 11]).unwrap_err();
    assert!(
        matches!(
            err,
            KernelError::Shape {
                what: "attention q",
                ..
            }
        ),
        "{err}"
    );
    // Only k too small: a K buffer for one KV head of a two-KV-head shape.
    let small_k = upload(&client, &x.k[..tokens * 16]);
    let out = DeviceVec::<f32>::zeros(&client, x.q.len()).unwrap();
    let err = causal_gqa_attention::<TestRuntime, f32>(
        &client,
        &good,
        &[0, tokens],
        &upload(&client, &x.q),
        &small_k,
        &upload(&client, &x.v),
        &out.handle,
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            KernelError::Shape {
                what: "attention k",
                ..
            }
        ),
        "{err}"
    );

    // 2^31 tokens × 32 heads × 128 do not fit 32-bit indices (checked before any buffer).
    let err = call(&shape(32, 2, 128), &[0, 1 << 31]).unwrap_err();
    assert!(
        matches!(err, KernelError::Unsupported { .. }) && detail(err.clone()).contains("32-bit"),
        "{err}"
    );
}
