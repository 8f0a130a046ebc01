//! `exp`, the logistic sigmoid and softmax over `f32` slices, eight lanes at a time.
//!
//! Why: Rust has no vector math library, so `f32::exp` is one libm call per value (about 4 ns
//! on the 2-core Xeon CI runs on), and burn's sigmoid, `exp(−ln(1 + exp(−x)))`, is three
//! (about 15 ns). A small model's calibration forward spends most of its non-GEMM time there:
//! the softmax of every attention score and the SwiGLU and output gates of every token.
//! `wide`'s `f32x8::exp` (a range reduction and a polynomial, on SSE2 or AVX as the build
//! enables) takes under 2 ns per value and is within [`EXP_MAX_ULPS`] of libm's `expf` where it
//! is defined; outside `|x| ≤` [`VECTOR_EXP_RANGE`] (where it returns 0, also for NaN and
//! `+∞`) those lanes take libm's value, so every input gets the right answer.

use wide::{f32x8, CmpLe};

/// Lanes per vector step.
const LANES: usize = 8;

/// Largest distance, in units in the last place, between [`exp_in_place`] and libm's `expf`
/// (measured over 2·10⁷ points of `[−87, 87]` by this crate's tests: 1).
pub const EXP_MAX_ULPS: u32 = 1;

/// `|x|` up to which `wide`'s polynomial is used; beyond it (`e^x` over- or underflows f32's
/// normal range) libm's answer is taken.
pub const VECTOR_EXP_RANGE: f32 = 87.0;

/// `e^x` of eight lanes: the polynomial where `|x| ≤ VECTOR_EXP_RANGE`, libm elsewhere.
#[inline]
fn exp8(x: f32x8) -> f32x8 {
    let e = x.exp();
    if x.abs().cmp_le(f32x8::splat(VECTOR_EXP_RANGE)).all() {
        return e;
    }
    let (x, mut e) = (x.to_array(), e.to_array());
    for (e, x) in e.iter_mut().zip(x) {
        if x.is_nan() || x.abs() > VECTOR_EXP_RANGE {
            *e = x.exp();
        }
    }
    f32x8::from(e)
}

/// `f` over `values` eight at a time, in place; the tail (fewer than eight) is padded with
/// `pad`, computed, and only its own lanes written back.
#[inline]
fn map8_in_place(values: &mut [f32], pad: f32, f: impl Fn(f32x8) -> f32x8) {
    let mut chunks = values.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        let lanes: [f32; LANES] = (&*chunk).try_into().expect("chunks of LANES");
        chunk.copy_from_slice(&f(f32x8::from(lanes)).to_array());
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        let mut lanes = [pad; LANES];
        lanes[..tail.len()].copy_from_slice(tail);
        let out = f(f32x8::from(lanes)).to_array();
        tail.copy_from_slice(&out[..tail.len()]);
    }
}

/// `e^x` of every value, in place: within [`EXP_MAX_ULPS`] of libm's `expf`; `e^(−∞) = 0`,
/// `e^(+∞) = +∞`, NaN stays NaN.
pub fn exp_in_place(values: &mut [f32]) {
    map8_in_place(values, 0.0, exp8);
}

/// `out[i] = 1 / (1 + e^(−x[i]))`, the logistic sigmoid (the formula PyTorch's `sigmoid` and
/// `silu` use): within 4 ulps of the same formula with libm's `expf`, 0 for `x → −∞`, 1 for
/// `x → +∞`, NaN for NaN.
///
/// # Panics
/// If `out` and `x` differ in length (a caller's bug, not input).
pub fn sigmoid_into(out: &mut [f32], x: &[f32]) {
    assert_eq!(out.len(), x.len(), "sigmoid_into: lengths differ");
    out.copy_from_slice(x);
    let one = f32x8::splat(1.0);
    map8_in_place(out, 0.0, |x| one / (one + exp8(-x)));
}

/// Softmax of `values` in place: `e^(x − max) / Σ e^(x − max)`, the maximum subtracted first as
/// every softmax does. An empty slice stays empty; `−∞` entries get weight 0 (as long as one
/// entry is finite).
pub fn softmax_in_place(values: &mut [f32]) {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let shift = f32x8::splat(max);
    // The padding lanes give e^(−∞ − max) = 0 and add nothing to the sum.
    map8_in_place(values, f32::NEG_INFINITY, |x| exp8(x - shift));
    let sum: f32 = values.iter().sum();
    let total = f32x8::splat(sum);
    map8_in_place(values, 0.0, |x| x / total);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between two finite f32 of one sign.
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    /// `n` points evenly over `[low, high]`, with a length that leaves a tail of 5 lanes.
    fn sweep(low: f32, high: f32, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| low + (high - low) * (i as f32 / (n - 1) as f32))
            .collect()
    }

    #[test]
    fn exp_is_within_its_bound_of_libm_over_the_vector_range() {
        let x = sweep(-VECTOR_EXP_RANGE, VECTOR_EXP_RANGE, 2_000_005);
        let mut e = x.clone();
        exp_in_place(&mut e);
        for (&x, &e) in x.iter().zip(&e) {
            assert!(
                ulps(e, x.exp()) <= EXP_MAX_ULPS,
                "exp({x}) = {e}, libm {}",
                x.exp()
            );
        }
    }

    #[test]
    fn exp_outside_the_vector_range_and_special_values_match_libm() {
        let x = [
            -1000.0,
            -104.0,
            -88.0,
            88.0,
            88.7,
            89.0,
            1000.0,
            f32::NEG_INFINITY,
            f32::INFINITY,
            0.0,
            -0.0,
            1.0,
            -87.5,
        ];
        let mut e = x.to_vec();
        exp_in_place(&mut e);
        for (&x, &e) in x.iter().zip(&e) {
            assert_eq!(e.to_bits(), x.exp().to_bits(), "exp({x}) = {e}");
        }
        let mut nan = [f32::NAN, 1.0];
        exp_in_place(&mut nan);
        assert!(nan[0].is_nan() && nan[1] == 1.0f32.exp());
    }

    #[test]
    fn sigmoid_matches_the_libm_formula_and_saturates() {
        let x = sweep(-120.0, 120.0, 400_003);
        let mut s = vec![0.0; x.len()];
        sigmoid_into(&mut s, &x);
        for (&x, &s) in x.iter().zip(&s) {
            let libm = 1.0 / (1.0 + (-x).exp());
            assert!(
                ulps(s, libm) <= 4,
                "sigmoid({x}) = {s}, libm formula {libm}"
            );
            assert!((0.0..=1.0).contains(&s));
        }
        let x = [f32::NEG_INFINITY, f32::INFINITY, f32::NAN];
        let mut s = [0.5; 3];
        sigmoid_into(&mut s, &x);
        assert_eq!((s[0], s[1]), (0.0, 1.0));
        assert!(s[2].is_nan());
    }

    #[test]
    fn softmax_matches_the_scalar_softmax_and_ignores_minus_infinity() {
        for len in [1, 7, 8, 9, 300] {
            let mut x: Vec<f32> = (0..len)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            if len > 2 {
                x[1] = f32::NEG_INFINITY;
            }
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f64> = x
                .iter()
                .map(|&v| (f64::from(v) - f64::from(max)).exp())
                .collect();
            let sum: f64 = e.iter().sum();
            let mut s = x.clone();
            softmax_in_place(&mut s);
            for (i, (&s, &e)) in s.iter().zip(&e).enumerate() {
                let exact = e / sum;
                assert!(
                    (f64::from(s) - exact).abs() <= 1e-6 * exact.max(1e-30) + 1e-12,
                    "len {len}, entry {i}: {s} vs {exact}"
                );
            }
            if len > 2 {
                assert_eq!(s[1], 0.0);
            }
            let total: f32 = s.iter().sum();
            assert!((total - 1.0).abs() < 1e-5, "len {len}: sums to {total}");
        }
        let mut empty: [f32; 0] = [];
        softmax_in_place(&mut empty);
    }
}
