//! The bf16 linears on cuBLAS and cuBLASLt (CUDA only) against an f64 host product of the same
//! bf16 inputs: `linear_residual_bf16`'s sum rounded once, its residual left alone, its
//! answer beside the unfused route (`linear_bf16`, then the sum rounded from the rounded
//! product), and its refusals.

use cubecl::server::Handle;
use half::bf16;
use sala_kernels::cuda::{linear_bf16, linear_residual_bf16, Cublas, LinearShape, ResidualLinear};
use sala_kernels::KernelError;

use crate::common::{client, Rng, TestRuntime};
use crate::flash_attention::upload_bf16;

type Client = cubecl::prelude::ComputeClient<TestRuntime>;

fn download_bf16(client: &Client, handle: &Handle, len: usize) -> Vec<f32> {
    let bytes = client.read_one(handle.clone()).unwrap();
    let values: &[bf16] = bytemuck::cast_slice(&bytes[..len * 2]);
    values.iter().map(|v| v.to_f32()).collect()
}

/// Values ~N(0, σ) rounded to bf16 (what the device sees, and the reference too).
fn bf16_values(rng: &mut Rng, len: usize, sigma: f32) -> Vec<f32> {
    (0..len)
        .map(|_| bf16::from_f32(sigma * rng.normal()).to_f32())
        .collect()
}

/// `x·wᵀ` in f64 for row-major `x` `[tokens, in]` and `w` `[out, in]`.
fn product(x: &[f32], w: &[f32], shape: LinearShape) -> Vec<f64> {
    let LinearShape {
        tokens,
        in_features,
        out_features,
    } = shape;
    let mut y = vec![0.0f64; tokens * out_features];
    for t in 0..tokens {
        let row = &x[t * in_features..(t + 1) * in_features];
        for o in 0..out_features {
            let col = &w[o * in_features..(o + 1) * in_features];
            y[t * out_features + o] = row
                .iter()
                .zip(col)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum();
        }
    }
    y
}

struct Case {
    shape: LinearShape,
    x: Vec<f32>,
    w: Vec<f32>,
    hidden: Vec<f32>,
    scale: f32,
}

impl Case {
    fn new(seed: u64, tokens: usize, in_features: usize, out_features: usize) -> Self {
        let mut rng = Rng::new(seed);
        let shape = LinearShape {
            tokens,
            in_features,
            out_features,
        };
        Self {
            shape,
            x: bf16_values(&mut rng, tokens * in_features, 1.0),
            w: bf16_values(&mut rng, out_features * in_features, 0.05),
            hidden: bf16_values(&mut rng, tokens * out_features, 4.0),
            // MiniCPM's residual scale, 1.4 / √32.
            scale: 1.4 / 32f32.sqrt(),
        }
    }

    /// `hidden + scale · x·wᵀ` in f64.
    fn want(&self) -> Vec<f64> {
        product(&self.x, &self.w, self.shape)
            .iter()
            .zip(&self.hidden)
            .map(|(&p, &h)| h as f64 + self.scale as f64 * p)
            .collect()
    }
}

/// `linear_residual_bf16` of `case` on these buffers.
fn fused(
    client: &Client,
    blas: &Cublas,
    case: &Case,
    [x, w, hidden, out]: [&Handle; 4],
) -> Result<(), KernelError> {
    let buffers = ResidualLinear { x, w, hidden, out };
    linear_residual_bf16(client, blas, case.shape, buffers, case.scale)
}

/// The sum is the f64 one rounded once: within half a bf16 step of it, plus the f32
/// accumulation's error (far smaller at these widths).
#[test]
fn linear_residual_rounds_the_sum_once_and_leaves_the_residual_alone() {
    let Some(client) = client() else {
        return;
    };
    let blas = Cublas::new(0).unwrap();
    for (seed, tokens, in_features, out_features) in
        [(1, 37, 96, 80), (2, 1, 256, 8), (3, 300, 512, 136)]
    {
        let case = Case::new(seed, tokens, in_features, out_features);
        let len = tokens * out_features;
        let hidden = upload_bf16(&client, &case.hidden);
        let out = upload_bf16(&client, &vec![f32::NAN; len]);
        let (x, w) = (upload_bf16(&client, &case.x), upload_bf16(&client, &case.w));
        fused(&client, &blas, &case, [&x, &w, &hidden, &out]).unwrap();
        let got = download_bf16(&client, &out, len);
        for (i, (&g, &want)) in got.iter().zip(&case.want()).enumerate() {
            let step = want.abs().max(f64::MIN_POSITIVE) / 128.0;
            assert!(
                (g as f64 - want).abs() <= 0.5 * step + 1e-4,
                "{tokens}×{in_features}→{out_features}, element {i}: {g} vs {want}"
            );
        }
        assert_eq!(
            download_bf16(&client, &hidden, len),
            case.hidden,
            "the residual was written"
        );
    }
}

/// Against the unfused route (the product rounded, scaled, rounded, added, rounded), the fused
/// sum differs by at most the unfused route's own rounding: half a bf16 step of the scaled
/// product twice over and half a step of the sum, plus the fused sum's half step. Where the
/// residual cancels the scaled product, that is many steps of the small sum (a first GPU run
/// met -0.00368 against -0.00195 beside terms near 0.5); on most elements they agree exactly.
#[test]
fn linear_residual_agrees_with_the_product_then_the_sum() {
    let Some(client) = client() else {
        return;
    };
    let blas = Cublas::new(0).unwrap();
    let case = Case::new(4, 129, 384, 200);
    let len = case.shape.tokens * case.shape.out_features;
    let (x, w) = (upload_bf16(&client, &case.x), upload_bf16(&client, &case.w));
    let product = upload_bf16(&client, &vec![f32::NAN; len]);
    linear_bf16(&client, &blas, case.shape, &x, &w, &product).unwrap();
    let round = |v: f32| bf16::from_f32(v).to_f32();
    // (the unfused sum, the rounded scaled product it added)
    let unfused: Vec<(f32, f32)> = download_bf16(&client, &product, len)
        .iter()
        .zip(&case.hidden)
        .map(|(&p, &h)| {
            let scaled = round(p * case.scale);
            (round(h + scaled), scaled)
        })
        .collect();
    let out = upload_bf16(&client, &vec![f32::NAN; len]);
    let hidden = upload_bf16(&client, &case.hidden);
    fused(&client, &blas, &case, [&x, &w, &hidden, &out]).unwrap();
    let fused = download_bf16(&client, &out, len);
    let mut differ = 0;
    for (i, (&f, &(u, scaled))) in fused.iter().zip(&unfused).enumerate() {
        // A bf16 step is at most 2⁻⁷ of the value: the half steps above come to
        // (|scaled| + |u|) / 128, with a little room for f32 accumulation orders.
        let bound = (scaled.abs() + u.abs()) / 128.0 * 1.01 + f32::MIN_POSITIVE;
        assert!(
            (f - u).abs() <= bound,
            "element {i}: fused {f}, unfused {u} (scaled product {scaled})"
        );
        differ += usize::from(f != u);
    }
    println!("fused and unfused differ on {differ} of {len} elements");
    assert!(differ * 4 < len, "{differ} of {len} elements differ");
}

/// A residual read from inside its buffer (a chunk of rows of a hidden state) is read from
/// that offset.
#[test]
fn linear_residual_reads_the_residual_from_its_offset() {
    let Some(client) = client() else {
        return;
    };
    let blas = Cublas::new(0).unwrap();
    let case = Case::new(5, 24, 128, 64);
    let len = case.shape.tokens * case.shape.out_features;
    let skip = 3 * case.shape.out_features;
    let mut padded = vec![1e4f32; skip];
    padded.extend(&case.hidden);
    let hidden = upload_bf16(&client, &padded).offset_start(2 * skip as u64);
    let out = upload_bf16(&client, &vec![f32::NAN; len]);
    let (x, w) = (upload_bf16(&client, &case.x), upload_bf16(&client, &case.w));
    fused(&client, &blas, &case, [&x, &w, &hidden, &out]).unwrap();
    let got = download_bf16(&client, &out, len);
    for (i, (&g, &want)) in got.iter().zip(&case.want()).enumerate() {
        assert!(
            (g as f64 - want).abs() <= want.abs() / 256.0 + 1e-4,
            "element {i}: {g} vs {want}"
        );
    }
}

/// An output over the residual, or a buffer too short for its matrix, is refused before
/// anything runs, naming the buffer.
#[test]
fn linear_residual_refuses_an_output_over_the_residual_and_short_buffers() {
    let Some(client) = client() else {
        return;
    };
    let blas = Cublas::new(0).unwrap();
    let case = Case::new(6, 8, 64, 32);
    let (x, w) = (upload_bf16(&client, &case.x), upload_bf16(&client, &case.w));
    let hidden = upload_bf16(&client, &case.hidden);
    let run = |hidden: &Handle, out: &Handle, w: &Handle| {
        fused(&client, &blas, &case, [&x, w, hidden, out])
    };
    let shape_error = |result: Result<(), KernelError>, what: &str| match result {
        Err(KernelError::Shape { what: got, .. }) => assert_eq!(got, what),
        other => panic!("{what}: expected a shape error, got {other:?}"),
    };
    shape_error(run(&hidden, &hidden, &w), "linear residual out");
    let short = upload_bf16(&client, &case.w[..case.w.len() - 1]);
    shape_error(
        run(&hidden, &upload_bf16(&client, &case.hidden), &short),
        "linear residual w",
    );
    assert_eq!(
        download_bf16(&client, &hidden, case.hidden.len()),
        case.hidden,
        "a refused call wrote the residual"
    );
}
