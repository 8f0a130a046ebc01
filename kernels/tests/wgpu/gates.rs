//! The fused gates against host references that round at the same points: in f32 everywhere
//! (lavapipe has no bf16), and in bf16 where the runtime stores it (CUDA), where the result
//! must equal the host's bf16 chain up to the last bit of a rare f32 `exp`/`ln` difference.

use cubecl::ir::{ElemType, FloatKind};
use cubecl::prelude::CubeElement;
use cubecl::server::Handle;
use half::{bf16, f16};
use sala_kernels::gates::{
    rms_norm, rms_norm_gate, rms_norm_rope, scaled_residual, sigmoid_gate, swiglu, NormRopeShape,
};

use crate::common::{client, Rng, TestRuntime};

type Client = cubecl::prelude::ComputeClient<TestRuntime>;

/// The graph's sigmoid in f32: `exp(−ln(1 + exp(−g)))`.
fn sigmoid(g: f32) -> f32 {
    (-(1.0f32 + (-g).exp()).ln()).exp()
}

fn round_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// Inputs over the range where the gates bend (and beyond, where `exp` saturates).
fn inputs(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| rng.signed() * if i % 7 == 0 { 40.0 } else { 6.0 })
        .collect()
}

fn upload<S: CubeElement>(client: &Client, values: &[S]) -> Handle {
    client.create_from_slice(S::as_bytes(values))
}

fn download<S: CubeElement>(client: &Client, handle: Handle) -> Vec<S> {
    let bytes = client.read_one(handle).expect("read back");
    S::from_bytes(&bytes).to_vec()
}

/// Largest `|got − want| / max(|want|, 1e-3)`.
fn max_rel(got: &[f32], want: &[f32]) -> f32 {
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            assert!(g.is_finite(), "non-finite {g} (want {w})");
            (g - w).abs() / w.abs().max(1e-3)
        })
        .fold(0.0, f32::max)
}

#[test]
fn f32_gates_match_the_host_formulas() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(61);
    // Not a multiple of any cube size: the tail is bounds-checked.
    let n = 10_007;
    let (g, u) = (inputs(&mut rng, n), inputs(&mut rng, n));
    let (hg, hu) = (upload(&client, &g), upload(&client, &u));

    let out = client.empty(n * 4);
    swiglu::<TestRuntime, f32>(&client, &hg, &hu, &out, n).unwrap();
    let want: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&g, &u)| g * sigmoid(g) * u)
        .collect();
    let err = max_rel(&download::<f32>(&client, out), &want);
    // lavapipe's exp and ln are not correctly rounded: a few ulps.
    assert!(err < 1e-5, "swiglu {err:e}");

    let out = client.empty(n * 4);
    sigmoid_gate::<TestRuntime, f32>(&client, &hu, &hg, &out, n).unwrap();
    let want: Vec<f32> = g.iter().zip(&u).map(|(&g, &x)| x * sigmoid(g)).collect();
    let err = max_rel(&download::<f32>(&client, out), &want);
    assert!(err < 1e-5, "sigmoid gate {err:e}");
}

#[test]
fn bf16_gates_round_where_the_unfused_chain_rounds() {
    let Some(client) = client() else {
        return;
    };
    if !client
        .properties()
        .supports_type(ElemType::Float(FloatKind::BF16))
    {
        eprintln!("NOTICE: bf16 gates not tested: the runtime stores no bf16");
        return;
    }
    let mut rng = Rng::new(62);
    // An odd length takes the scalar kernels, a multiple of 8 the 16-byte-vector ones.
    for n in [100_003, 100_000] {
        let g: Vec<bf16> = inputs(&mut rng, n)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let u: Vec<bf16> = inputs(&mut rng, n)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let (hg, hu) = (upload(&client, &g), upload(&client, &u));
        let check = |got: Vec<bf16>, want: Vec<f32>, what: &str| {
            let (mut differ, mut far) = (0, 0);
            for (g, w) in got.iter().zip(&want) {
                let w = bf16::from_f32(*w);
                if *g != w {
                    differ += 1;
                    // Neighbouring bf16 values differ by one in their bit patterns (same sign).
                    if (g.to_bits() as i32 - w.to_bits() as i32).abs() > 1 {
                        far += 1;
                    }
                }
            }
            assert_eq!(far, 0, "{what}: {far} results more than one bf16 step away");
            assert!(differ * 1000 < n, "{what}: {differ} of {n} results differ");
        };

        let out = client.empty(n * 2);
        swiglu::<TestRuntime, bf16>(&client, &hg, &hu, &out, n).unwrap();
        let want: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| {
                let g = g.to_f32();
                round_bf16(g * round_bf16(sigmoid(g))) * u.to_f32()
            })
            .collect();
        check(download::<bf16>(&client, out), want, "swiglu");

        let out = client.empty(n * 2);
        sigmoid_gate::<TestRuntime, bf16>(&client, &hu, &hg, &out, n).unwrap();
        let want: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(g, x)| x.to_f32() * round_bf16(sigmoid(g.to_f32())))
            .collect();
        check(download::<bf16>(&client, out), want, "sigmoid gate");
    }
}

#[test]
fn short_buffers_are_refused() {
    let Some(client) = client() else {
        return;
    };
    let small = upload(&client, &[1.0f32; 4]);
    let big = upload(&client, &[1.0f32; 8]);
    let err = swiglu::<TestRuntime, f32>(&client, &small, &big, &big, 8).unwrap_err();
    assert!(err.to_string().contains("swiglu"), "{err}");
}

/// The graph's RMSNorm of one row, rounding through `round` (identity or bf16).
fn host_norm(x: &[f32], w: &[f32], eps: f32, round: fn(f32) -> f32) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let rms = (ms + eps).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, w)| round(round(v / rms) * w))
        .collect()
}

/// The graph's chain `round(n · round(σ(g)))` over normed values `n` and gates `g`.
fn host_gate(n: &[f32], g: &[f32], round: fn(f32) -> f32) -> Vec<f32> {
    n.iter()
        .zip(g)
        .map(|(n, g)| round(n * round(sigmoid(*g))))
        .collect()
}

/// `rms_norm_gate` of `x` `[rows, cols]` with `w` and `gate`, read back as f32.
#[allow(clippy::too_many_arguments)]
fn run_norm_gate<S: cubecl::prelude::Float + CubeElement>(
    client: &Client,
    x: &[S],
    w: &[S],
    gate: &[S],
    rows: usize,
    cols: usize,
    to_f32: fn(&S) -> f32,
) -> Vec<f32> {
    let out = client.empty(rows * cols * size_of::<S>());
    rms_norm_gate::<TestRuntime, S>(
        client,
        &upload(client, x),
        &upload(client, w),
        &upload(client, gate),
        &out,
        rows,
        cols,
        1e-6,
    )
    .unwrap();
    download::<S>(client, out).iter().map(to_f32).collect()
}

#[test]
fn f32_norm_and_residual_match_the_host_formulas() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(63);
    // Rows longer and shorter than a cube, a width that is no power of two.
    for (rows, cols) in [(3, 4096), (37, 128), (5, 1000)] {
        let x = inputs(&mut rng, rows * cols);
        let w = inputs(&mut rng, cols);
        let out = client.empty(rows * cols * 4);
        rms_norm::<TestRuntime, f32>(
            &client,
            &upload(&client, &x),
            &upload(&client, &w),
            &out,
            rows,
            cols,
            1e-6,
        )
        .unwrap();
        let want: Vec<f32> = x
            .chunks(cols)
            .flat_map(|row| host_norm(row, &w, 1e-6, |v| v))
            .collect();
        let err = max_rel(&download::<f32>(&client, out), &want);
        assert!(err < 1e-5, "rms norm {rows}×{cols}: {err:e}");
        let gate = inputs(&mut rng, rows * cols);
        let got = run_norm_gate(&client, &x, &w, &gate, rows, cols, |v| *v);
        let err = max_rel(&got, &host_gate(&want, &gate, |v| v));
        assert!(err < 1e-5, "rms norm gate {rows}×{cols}: {err:e}");
    }
    let n = 10_007;
    let (h, m) = (inputs(&mut rng, n), inputs(&mut rng, n));
    let out = client.empty(n * 4);
    scaled_residual::<TestRuntime, f32>(
        &client,
        &upload(&client, &h),
        &upload(&client, &m),
        &out,
        n,
        0.125,
    )
    .unwrap();
    let want: Vec<f32> = h.iter().zip(&m).map(|(h, m)| h + m * 0.125).collect();
    let err = max_rel(&download::<f32>(&client, out), &want);
    assert!(err < 1e-6, "scaled residual {err:e}");
}

#[test]
fn bf16_norm_and_residual_round_where_the_graph_rounds() {
    let Some(client) = client() else {
        return;
    };
    if !client
        .properties()
        .supports_type(ElemType::Float(FloatKind::BF16))
    {
        return;
    }
    let mut rng = Rng::new(64);
    let to_bf16 = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<bf16>>();
    // Widths that are multiples of 8 take the 16-byte-vector kernel (the MLP's, and one of
    // fewer vectors than a cube has units), 4100 the scalar one.
    for (rows, cols) in [(64, 4096), (33, 64), (7, 4100)] {
        let x = to_bf16(inputs(&mut rng, rows * cols));
        let w = to_bf16(inputs(&mut rng, cols));
        let out = client.empty(rows * cols * 2);
        rms_norm::<TestRuntime, bf16>(
            &client,
            &upload(&client, &x),
            &upload(&client, &w),
            &out,
            rows,
            cols,
            1e-6,
        )
        .unwrap();
        let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
        let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        let want: Vec<f32> = xf
            .chunks(cols)
            .flat_map(|row| host_norm(row, &wf, 1e-6, round_bf16))
            .collect();
        let got: Vec<f32> = download::<bf16>(&client, out)
            .iter()
            .map(|v| v.to_f32())
            .collect();
        // Sums of squares in another order differ in the last f32 bits: a rounding of
        // `x / rms` may flip by one bf16 step (2⁻⁷ relative at most), which the weight
        // scales, and the product's own rounding may then go the other way (2⁻⁸ more).
        let err = max_rel(&got, &want);
        let bound = 2f32.powi(-7) + 2f32.powi(-8);
        assert!(err <= bound, "rms norm {rows}×{cols}: {err:e}");
        let same = got.iter().zip(&want).filter(|(g, w)| g == w).count();
        assert!(
            same * 100 > 99 * got.len(),
            "rms norm {rows}×{cols}: {same} of {} equal",
            got.len()
        );
        // Gated: a flipped norm then one more rounding, of the product by the gate.
        let gate = to_bf16(inputs(&mut rng, rows * cols));
        let gf: Vec<f32> = gate.iter().map(|v| v.to_f32()).collect();
        let got = run_norm_gate(&client, &x, &w, &gate, rows, cols, |v| v.to_f32());
        let want = host_gate(&want, &gf, round_bf16);
        let err = max_rel(&got, &want);
        assert!(err <= 2f32.powi(-6), "rms norm gate {rows}×{cols}: {err:e}");
        let same = got.iter().zip(&want).filter(|(g, w)| g == w).count();
        assert!(
            same * 100 > 99 * got.len(),
            "rms norm gate {rows}×{cols}: {same} of {} equal",
            got.len()
        );
    }

    for n in [100_003, 100_000] {
        let h = to_bf16(inputs(&mut rng, n));
        let m = to_bf16(inputs(&mut rng, n));
        let out = client.empty(n * 2);
        scaled_residual::<TestRuntime, bf16>(
            &client,
            &upload(&client, &h),
            &upload(&client, &m),
            &out,
            n,
            0.3,
        )
        .unwrap();
        let want: Vec<bf16> = h
            .iter()
            .zip(&m)
            .map(|(h, m)| bf16::from_f32(h.to_f32() + round_bf16(m.to_f32() * 0.3)))
            .collect();
        assert_eq!(download::<bf16>(&client, out), want);
    }
}

/// The graph's per-head RMSNorm then rotate-half RoPE of `x` `[tokens, heads, d]` at
/// `positions`, rounding through `round` (identity or bf16).
#[allow(clippy::too_many_arguments)]
fn host_norm_rope(
    x: &[f32],
    w: &[f32],
    cos: &[f32],
    sin: &[f32],
    positions: &[u32],
    heads: usize,
    d: usize,
    round: fn(f32) -> f32,
) -> Vec<f32> {
    x.chunks(d)
        .enumerate()
        .flat_map(|(row, head)| {
            let y = host_norm(head, w, 1e-6, round);
            let t = positions[row / heads] as usize * d;
            (0..d)
                .map(|e| {
                    let rotated = if e < d / 2 {
                        -y[e + d / 2]
                    } else {
                        y[e - d / 2]
                    };
                    round(y[e] * cos[t + e] + rotated * sin[t + e])
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Random inputs of the fused norm + RoPE: two sequences (positions restart), real tables.
struct NormRopeCase {
    shape: NormRopeShape,
    x: Vec<f32>,
    w: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    positions: Vec<u32>,
}

impl NormRopeCase {
    fn new(rng: &mut Rng, lengths: &[usize], heads: usize, d: usize) -> Self {
        let tokens: usize = lengths.iter().sum();
        let table = *lengths.iter().max().unwrap();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for p in 0..table {
            for e in 0..d {
                let angle = p as f32 / 10000f32.powf((2 * (e % (d / 2))) as f32 / d as f32);
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Self {
            shape: NormRopeShape {
                tokens,
                heads,
                head_dim: d,
                positions: table,
                eps: 1e-6,
            },
            x: inputs(rng, tokens * heads * d),
            w: inputs(rng, d),
            cos,
            sin,
            positions: lengths.iter().flat_map(|&l| 0..l as u32).collect(),
        }
    }

    fn run<S: cubecl::prelude::Float + CubeElement>(
        &self,
        client: &Client,
        x: &[S],
        w: &[S],
    ) -> Vec<S> {
        let out = client.empty(self.x.len() * size_of::<S>());
        rms_norm_rope::<TestRuntime, S>(
            client,
            &self.shape,
            &upload(client, x),
            &upload(client, w),
            &upload(client, &self.cos),
            &upload(client, &self.sin),
            &upload(client, &self.positions),
            &out,
        )
        .unwrap();
        download::<S>(client, out)
    }

    fn want(&self, round: fn(f32) -> f32) -> Vec<f32> {
        let x: Vec<f32> = self.x.iter().map(|&v| round(v)).collect();
        let w: Vec<f32> = self.w.iter().map(|&v| round(v)).collect();
        host_norm_rope(
            &x,
            &w,
            &self.cos,
            &self.sin,
            &self.positions,
            self.shape.heads,
            self.shape.head_dim,
            round,
        )
    }
}

#[test]
fn f32_norm_rope_matches_the_host_chain() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(64);
    // A row count that leaves a cube partly empty; both head dims of the models.
    for (lengths, heads, d) in [(&[5usize, 9][..], 3, 128), (&[17][..], 2, 64)] {
        let case = NormRopeCase::new(&mut rng, lengths, heads, d);
        let got = case.run::<f32>(&client, &case.x, &case.w);
        let want = case.want(|v| v);
        // Relative to the head's largest output: a rotated pair can cancel to near zero,
        // and the products' rounding (or an FMA contraction) is relative to the terms.
        for (g, w) in got.chunks(d).zip(want.chunks(d)) {
            let top = w.iter().fold(1e-3f32, |a, v| a.max(v.abs()));
            let err = g.iter().zip(w).fold(0f32, |a, (g, w)| a.max((g - w).abs())) / top;
            assert!(err < 1e-5, "norm rope {lengths:?} {heads}×{d}: {err:e}");
        }
    }
}

#[test]
fn bf16_norm_rope_rounds_where_the_graph_rounds() {
    let Some(client) = client() else {
        return;
    };
    if !client
        .properties()
        .supports_type(ElemType::Float(FloatKind::BF16))
    {
        eprintln!("NOTICE: bf16 norm rope not tested: the runtime stores no bf16");
        return;
    }
    let mut rng = Rng::new(65);
    // Head dims of 64, 128 and 256 take the 16-byte-vector kernel (with cubes left partly
    // empty), 192 the scalar one.
    for (lengths, heads, d) in [
        (&[300usize, 77][..], 32, 128),
        (&[33][..], 3, 64),
        (&[20, 9][..], 2, 256),
        (&[40][..], 2, 192),
    ] {
        let case = NormRopeCase::new(&mut rng, lengths, heads, d);
        check_bf16_norm_rope(&client, &case);
    }
}

/// `case` in bf16 against the host's bf16 chain: equal but for rare one-step flips.
fn check_bf16_norm_rope(client: &Client, case: &NormRopeCase) {
    let d = case.shape.head_dim;
    let x: Vec<bf16> = case.x.iter().map(|&v| bf16::from_f32(v)).collect();
    let w: Vec<bf16> = case.w.iter().map(|&v| bf16::from_f32(v)).collect();
    let got = case.run::<bf16>(client, &x, &w);
    let want = case.want(round_bf16);
    let mut differ = 0;
    let x_rounded: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let w_rounded: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
    for ((g, w), head) in got.chunks(d).zip(want.chunks(d)).zip(x_rounded.chunks(d)) {
        // The squares are summed in another order (a tree), so a normalised value can round
        // to the neighbouring bf16 (one step of the head's largest normed value, carried
        // through the rotation), and the f32 sums may be contracted to FMAs (one step of the
        // output); a rotated pair can cancel to near 0, so steps are of the head's scale.
        let y = host_norm(head, &w_rounded, 1e-6, round_bf16);
        let y_top = y.iter().fold(0f32, |a, v| a.max(v.abs()));
        let out_top = w.iter().fold(0f32, |a, v| a.max(v.abs()));
        let step = (y_top + out_top) / 256.0;
        for (g, w) in g.iter().zip(w) {
            if *g != bf16::from_f32(*w) {
                differ += 1;
                assert!(
                    (g.to_f32() - w).abs() <= step,
                    "{g} vs {w}: more than one bf16 step of the head's scale"
                );
            }
        }
    }
    assert!(
        differ * 100 < got.len(),
        "norm rope {}×{d}: {differ} of {} differ",
        case.shape.heads,
        got.len()
    );
}

#[test]
fn norm_rope_refuses_odd_head_dims_and_short_tables() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(66);
    let case = NormRopeCase::new(&mut rng, &[4], 2, 64);
    let bad = NormRopeShape {
        head_dim: 96,
        ..case.shape
    };
    let h = upload(&client, &case.x);
    let err = rms_norm_rope::<TestRuntime, f32>(&client, &bad, &h, &h, &h, &h, &h, &h);
    assert!(err.is_err());
    let long = NormRopeShape {
        positions: 1000,
        ..case.shape
    };
    let (cos, w) = (upload(&client, &case.cos), upload(&client, &case.w));
    let pos = upload(&client, &case.positions);
    let out = client.empty(case.x.len() * 4);
    let err = rms_norm_rope::<TestRuntime, f32>(&client, &long, &h, &w, &cos, &cos, &pos, &out);
    assert!(err.unwrap_err().to_string().contains("tables"));
}

/// The 16-byte-vector norms in f16 (2 bytes, like bf16), where the runtime stores f16:
/// lavapipe does, so CI runs the vector kernels that serve bf16 on CUDA.
#[test]
fn f16_vector_norms_round_where_the_graph_rounds() {
    let Some(client) = client() else {
        return;
    };
    if !client
        .properties()
        .supports_type(ElemType::Float(FloatKind::F16))
    {
        eprintln!("NOTICE: f16 vector norms not tested: the runtime stores no f16");
        return;
    }
    let round_f16 = |v: f32| f16::from_f32(v).to_f32();
    let to_f16 = |v: &[f32]| v.iter().map(|&v| f16::from_f32(v)).collect::<Vec<f16>>();
    let mut rng = Rng::new(66);
    for (rows, cols) in [(9, 4096), (5, 64)] {
        let x = to_f16(&inputs(&mut rng, rows * cols));
        let w = to_f16(&inputs(&mut rng, cols));
        let out = client.empty(rows * cols * 2);
        rms_norm::<TestRuntime, f16>(
            &client,
            &upload(&client, &x),
            &upload(&client, &w),
            &out,
            rows,
            cols,
            1e-6,
        )
        .unwrap();
        let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        let want: Vec<f32> = x
            .iter()
            .map(|v| v.to_f32())
            .collect::<Vec<_>>()
            .chunks(cols)
            .flat_map(|row| host_norm(row, &wf, 1e-6, round_f16))
            .collect();
        let got: Vec<f32> = download::<f16>(&client, out)
            .iter()
            .map(|v| v.to_f32())
            .collect();
        // f16 keeps 11 significant bits: a flip of `x / rms` is 2⁻¹⁰ relative.
        let err = max_rel(&got, &want);
        assert!(err < 2e-3, "f16 rms norm {rows}×{cols}: {err:e}");
        let gate = to_f16(&inputs(&mut rng, rows * cols));
        let gf: Vec<f32> = gate.iter().map(|v| v.to_f32()).collect();
        let got = run_norm_gate(&client, &x, &w, &gate, rows, cols, |v| v.to_f32());
        let err = max_rel(&got, &host_gate(&want, &gf, round_f16));
        assert!(err < 3e-3, "f16 rms norm gate {rows}×{cols}: {err:e}");
    }
    for (lengths, heads, d) in [(&[21usize, 6][..], 5, 128), (&[11][..], 3, 64)] {
        let case = NormRopeCase::new(&mut rng, lengths, heads, d);
        let got: Vec<f32> = case
            .run::<f16>(&client, &to_f16(&case.x), &to_f16(&case.w))
            .iter()
            .map(|v| v.to_f32())
            .collect();
        let want = case.want(round_f16);
        for (g, w) in got.chunks(d).zip(want.chunks(d)) {
            let top = w.iter().fold(1e-3f32, |a, v| a.max(v.abs()));
            let err = g.iter().zip(w).fold(0f32, |a, (g, w)| a.max((g - w).abs())) / top;
            assert!(err < 4e-3, "f16 norm rope {lengths:?} {heads}×{d}: {err:e}");
        }
    }
}
