//! Property tests: every codec round trip, checked against brute-force references.

use proptest::prelude::*;
use rayon::prelude::*;
use sala_formats::gptq_pack::{
    compressed_tensors_to_qweight, pack_qweight, pack_qweight_rows_into, pack_qzeros,
    qweight_to_compressed_tensors, sequential_g_idx, unpack_qweight, unpack_qzeros,
};
use sala_formats::minifloat::{e2m1_decode, e2m1_encode_fast, E2M1_VALUES};
use sala_formats::nvfp4::{
    block_divisor, global_scale_from_amax, pack_e2m1, quantize_rows_into, unpack_e2m1,
};
use sala_formats::{
    quantize_groupwise, quantize_groupwise_searched, BlockScales, ClipSearch, GptqPacked,
    IntQuantizer, IntScheme, MiniFloat, Nvfp4Matrix, ZeroConvention, E2M1, E4M3FN, E5M2,
    NVFP4_BLOCK,
};

const FORMATS: [MiniFloat; 3] = [E2M1, E4M3FN, E5M2];

/// All finite, non-negative codes of a format (sign bit clear), by brute force over the byte range.
fn finite_magnitude_codes(f: &MiniFloat) -> Vec<u8> {
    let sign = 1u8 << (f.exp_bits + f.man_bits);
    (0..sign).filter(|&c| f.decode(c).is_finite()).collect()
}

/// The reference rounding: the nearest finite value by exhaustive search over the code table,
/// ties to the code with an even mantissa, saturating above the largest finite value.
fn brute_force_round(f: &MiniFloat, x: f32) -> f32 {
    let a = x.abs() as f64;
    let mut best: Option<(f64, u8)> = None;
    for c in finite_magnitude_codes(f) {
        let d = (f.decode(c) as f64 - a).abs();
        best = match best {
            None => Some((d, c)),
            Some((bd, bc)) if d < bd || (d == bd && c % 2 == 0 && bc % 2 == 1) => Some((d, c)),
            keep => keep,
        };
    }
    let magnitude = f.decode(best.unwrap().1);
    if x < 0.0 {
        -magnitude
    } else {
        magnitude
    }
}

/// Random f32s that exercise every region: ordinary values, subnormal-range values, exact ties
/// between adjacent codes, and values beyond saturation.
fn probe_value(f: MiniFloat) -> impl Strategy<Value = f32> {
    let max = f.max_value();
    let codes = finite_magnitude_codes(&f);
    let n = codes.len();
    prop_oneof![
        (-1.5f32..1.5).prop_map(move |u| u * max),
        (-30i32..20, -1.0f32..1.0).prop_map(|(e, u)| u * 2f32.powi(e)),
        (0..n - 1, any::<bool>()).prop_map(move |(i, neg)| {
            let mid = (f.decode(codes[i]) + f.decode(codes[i + 1])) / 2.0;
            if neg {
                -mid
            } else {
                mid
            }
        }),
    ]
}

#[test]
fn every_code_round_trips_through_decode_and_encode() {
    for f in FORMATS {
        for code in 0..(1u16 << f.bits()) {
            let code = code as u8;
            let v = f.decode(code);
            if v.is_nan() {
                assert_eq!(f.encode(v).unwrap(), f.nan_code().unwrap(), "{}", f.name);
                continue;
            }
            let back = f.encode(v).unwrap();
            if v.is_infinite() {
                // Saturating encoder: E5M2's infinities map to ±max finite.
                let sign = code & (1 << (f.exp_bits + f.man_bits));
                assert_eq!(back, f.max_code | sign, "{} {code:#x}", f.name);
            } else if f.name == "e2m1" && v == 0.0 {
                // ModelOpt's sign rule (`x < 0`) encodes -0.0 as +0: the one code that maps elsewhere.
                assert_eq!(back, 0);
            } else {
                assert_eq!(back, code, "{} code {code:#x} value {v}", f.name);
            }
        }
    }
}

#[test]
fn fp8_exhaustive_decode_matches_the_closed_form() {
    // E4M3FN: 0x7F/0xFF NaN; E5M2: exponent 31 is inf/NaN; everything else finite.
    let e4m3_nans = (0..=255u8).filter(|&c| E4M3FN.decode(c).is_nan()).count();
    assert_eq!(e4m3_nans, 2);
    let e5m2_specials = (0..=255u8).filter(|&c| !E5M2.decode(c).is_finite()).count();
    assert_eq!(e5m2_specials, 8);
    for c in 0..=255u8 {
        for f in [E4M3FN, E5M2] {
            let v = f.decode(c);
            if v.is_finite() && v != 0.0 {
                let m = f.man_bits as i32;
                let exp = ((c & 0x7F) >> m) as i32;
                let man = (c & ((1 << m) - 1)) as f64;
                let expected = if exp == 0 {
                    man * 2f64.powi(1 - f.bias - m)
                } else {
                    (1.0 + man / 2f64.powi(m)) * 2f64.powi(exp - f.bias)
                };
                assert_eq!(v.abs() as f64, expected, "{} {c:#x}", f.name);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn e2m1_rounding_is_nearest_ties_to_even(x in probe_value(E2M1)) {
        prop_assert_eq!(E2M1.round(x).unwrap().abs(), brute_force_round(&E2M1, x).abs());
        // The sign is kept except for zero, which follows `x < 0`.
        let code = E2M1.encode(x).unwrap();
        prop_assert_eq!(code >= 8, x < 0.0);
    }

    #[test]
    fn e2m1_fast_encoder_equals_the_generic_one(x in probe_value(E2M1)) {
        prop_assert_eq!(e2m1_encode_fast(x), E2M1.encode(x).unwrap());
    }

    #[test]
    fn e4m3_rounding_is_nearest_ties_to_even(x in probe_value(E4M3FN)) {
        let got = E4M3FN.round(x).unwrap();
        prop_assert_eq!(got, brute_force_round(&E4M3FN, x));
        prop_assert_eq!(got.is_sign_negative(), x.is_sign_negative());
    }

    #[test]
    fn e5m2_rounding_is_nearest_ties_to_even(x in probe_value(E5M2)) {
        prop_assert_eq!(E5M2.round(x).unwrap(), brute_force_round(&E5M2, x));
    }

    #[test]
    fn int_rtn_error_is_at_most_half_a_step_inside_the_grid(
        values in prop::collection::vec(-10.0f32..10.0, 1..64),
        bits in 2u32..=8,
        scheme in prop_oneof![Just(IntScheme::SymmetricAbsMax), Just(IntScheme::Asymmetric), Just(IntScheme::SymmetricIst)],
    ) {
        let q = IntQuantizer::new(bits, scheme).unwrap();
        let p = q.params_for(&values);
        let lo = p.scale * (0.0 - p.zero as f32);
        let hi = p.scale * (q.maxq() as f32 - p.zero as f32);
        for &v in &values {
            let err = (q.fake_quantize(v, p) - v).abs();
            // Inside the grid: half a step (plus rounding slack). Outside (the IST grid clips
            // +absmax to (2^(b-1)-1)·scale): the distance to the grid's end.
            let allowed = if v > hi { v - hi } else if v < lo { lo - v } else { 0.5 * p.scale };
            prop_assert!(err <= allowed * (1.0 + 1e-5) + 1e-6, "v {} err {} allowed {}", v, err, allowed);
        }
    }

    #[test]
    fn qweight_pack_unpack_is_identity(
        out in 1usize..8, words in 1usize..6,
        bits in prop_oneof![Just(2u32), Just(4u32), Just(8u32)],
        seed in any::<u64>(),
    ) {
        let inp = words * (32 / bits as usize);
        let codes: Vec<u8> = pseudo_random(seed, out * inp).map(|r| (r % (1 << bits)) as u8).collect();
        let q = pack_qweight(&codes, out, inp, bits).unwrap();
        prop_assert_eq!(q.len(), words * out);
        prop_assert_eq!(unpack_qweight(&q, out, inp, bits).unwrap(), codes.clone());
        // compressed-tensors' weight_packed is the transpose, word for word.
        let ct = qweight_to_compressed_tensors(&q, out, words).unwrap();
        for o in 0..out { for w in 0..words { prop_assert_eq!(ct[o * words + w], q[w * out + o]); } }
        prop_assert_eq!(compressed_tensors_to_qweight(&ct, out, words).unwrap(), q.clone());
        // Packing by chunks of word rows in parallel gives the same words.
        let mut chunked = vec![0i32; q.len()];
        chunked.par_chunks_mut(2 * out).enumerate().try_for_each(|(i, dst)| {
            pack_qweight_rows_into(&codes, out, inp, bits, 2 * i, dst)
        }).unwrap();
        prop_assert_eq!(chunked, q);
    }

    #[test]
    fn qzeros_pack_unpack_is_identity(
        groups in 1usize..6, words in 1usize..4,
        bits in prop_oneof![Just(2u32), Just(4u32), Just(8u32)],
        v1 in any::<bool>(), seed in any::<u64>(),
    ) {
        let out = words * (32 / bits as usize);
        let conv = if v1 { ZeroConvention::V1 } else { ZeroConvention::V2 };
        let zeros: Vec<u8> = pseudo_random(seed, groups * out).map(|r| (r % (1 << bits)) as u8).collect();
        let q = pack_qzeros(&zeros, groups, out, bits, conv).unwrap();
        prop_assert_eq!(unpack_qzeros(&q, groups, out, bits, conv).unwrap(), zeros);
    }

    #[test]
    fn e2m1_pack_unpack_is_identity(seed in any::<u64>(), pairs in 1usize..64) {
        let codes: Vec<u8> = pseudo_random(seed, 2 * pairs).map(|r| (r % 16) as u8).collect();
        prop_assert_eq!(unpack_e2m1(&pack_e2m1(&codes).unwrap()), codes);
    }

    #[test]
    fn gptq_packed_dequantizes_like_rtn(
        out8 in 1usize..4, groups in 1usize..4, seed in any::<u64>(),
        scheme in prop_oneof![Just(IntScheme::SymmetricIst), Just(IntScheme::SymmetricAbsMax), Just(IntScheme::Asymmetric)],
    ) {
        let (out, gs) = (out8 * 8, 16usize);
        let inp = groups * gs;
        let w: Vec<f32> = pseudo_random(seed, out * inp).map(unit).collect();
        let q = IntQuantizer::new(4, scheme).unwrap();
        let rtn = quantize_groupwise(&w, out, inp, gs, q).unwrap();
        let g_idx = sequential_g_idx(inp, gs).unwrap();
        let packed = GptqPacked::pack(&rtn.codes, &rtn.params, &g_idx, out, inp, 4, gs, ZeroConvention::V1).unwrap();
        prop_assert_eq!(packed.dequantize().unwrap(), rtn.dequantize());
    }

    /// A partial last group (`in % group_size != 0`, as GPTQModel writes SmolLM2's 576 inputs
    /// in groups of 128): `ceil(in / group)` groups, `g_idx = k / group`, and packing, unpacking
    /// and dequantizing all agree with the unpacked round-to-nearest result.
    #[test]
    fn gptq_packed_partial_last_group_round_trips(
        out8 in 1usize..4, whole in 0usize..4, tail_words in 1usize..4, seed in any::<u64>(),
        bits in prop_oneof![Just(2u32), Just(4u32), Just(8u32)],
        scheme in prop_oneof![Just(IntScheme::SymmetricIst), Just(IntScheme::Asymmetric)],
    ) {
        let per = 32 / bits as usize;
        // Groups of 4 words; the last holds 1..=3 words, so it is always partial.
        let (out, gs) = (out8 * per, 4 * per);
        let inp = whole * gs + tail_words * per;
        prop_assert_ne!(inp % gs, 0);
        let w: Vec<f32> = pseudo_random(seed, out * inp).map(unit).collect();
        let q = IntQuantizer::new(bits, scheme).unwrap();
        let rtn = quantize_groupwise(&w, out, inp, gs, q).unwrap();
        let g_idx = sequential_g_idx(inp, gs).unwrap();
        prop_assert_eq!(*g_idx.last().unwrap() as usize, whole);
        let packed = GptqPacked::pack(&rtn.codes, &rtn.params, &g_idx, out, inp, bits, gs, ZeroConvention::V1).unwrap();
        prop_assert_eq!(packed.groups(), whole + 1);
        prop_assert_eq!(packed.scales.len(), (whole + 1) * out);
        prop_assert_eq!(packed.qweight.len(), inp / per * out);
        let (codes, params) = packed.unpack().unwrap();
        prop_assert_eq!(codes, rtn.codes.clone());
        prop_assert_eq!(params.len(), rtn.params.len());
        for (a, b) in params.iter().zip(&rtn.params) {
            prop_assert_eq!(a.zero, b.zero);
            prop_assert_eq!(a.scale, b.scale);
        }
        prop_assert_eq!(packed.dequantize().unwrap(), rtn.dequantize());
    }

    /// The clipping search (f32 lanes, products for integer norms) finds the best candidate of
    /// the textbook objective in f64 with `powf`, up to f32 near-ties; so it never does worse
    /// than the plain min/max range (its first candidate). The searched RTN matrix uses
    /// exactly the search's parameters.
    #[test]
    fn clip_search_never_loses_to_min_max(
        len in 1usize..64, seed in any::<u64>(), outlier in any::<bool>(),
        bits in prop_oneof![Just(2u32), Just(4u32), Just(8u32)],
        scheme in prop_oneof![Just(IntScheme::SymmetricIst), Just(IntScheme::SymmetricAbsMax), Just(IntScheme::Asymmetric)],
        norm in prop_oneof![Just(2.0f32), Just(2.4f32), Just(1.0f32), Just(3.0f32), Just(4.0f32)],
    ) {
        let mut values: Vec<f32> = pseudo_random(seed, len).map(unit).collect();
        if outlier { values[0] *= 20.0; }
        let weights: Vec<f32> = pseudo_random(seed ^ 7, len).map(|r| unit(r).abs() + 0.01).collect();
        let q = IntQuantizer::new(bits, scheme).unwrap();
        let search = ClipSearch::new(100, 0.8, norm).unwrap();
        let objective = |p| -> f64 {
            values.iter().zip(&weights)
                .map(|(&v, &c)| c as f64 * ((v - q.fake_quantize(v, p)).abs() as f64).powf(norm as f64))
                .sum()
        };
        let searched = search.params(&q, &values, Some(&weights));
        let plain = q.params_for(&values);
        let best = (0..search.candidates())
            .map(|i| {
                let (lo, hi) = values.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)));
                objective(q.params_from_range(lo * search.shrink(i), hi * search.shrink(i)))
            })
            .fold(f64::INFINITY, f64::min);
        prop_assert!(objective(searched) <= best * (1.0 + 1e-5) + 1e-30, "{} vs {best}", objective(searched));
        prop_assert!(objective(searched) <= objective(plain) * (1.0 + 1e-5) + 1e-30);
        let m = quantize_groupwise_searched(&values, 1, len, 16, q, &search, Some(&weights)).unwrap();
        for (g, p) in m.params.iter().enumerate() {
            let cols = g * 16..((g + 1) * 16).min(len);
            prop_assert_eq!(*p, search.params(&q, &values[cols.clone()], Some(&weights[cols])));
        }
    }

    #[test]
    fn nvfp4_error_is_bounded_by_half_a_grid_step(
        rows in 1usize..4, blocks in 1usize..4, seed in any::<u64>(), amp_exp in -8i32..8,
    ) {
        let cols = blocks * NVFP4_BLOCK;
        let amp = 2f32.powi(amp_exp);
        let w: Vec<f32> = pseudo_random(seed, rows * cols).map(|r| unit(r) * amp * if r % 7 == 0 { 9.0 } else { 1.0 }).collect();
        let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let g = global_scale_from_amax(amax).unwrap();
        let m = Nvfp4Matrix::quantize(&w, rows, cols, g, BlockScales::Max).unwrap();
        let deq = m.dequantize();
        for (i, (&x, &y)) in w.iter().zip(&deq).enumerate() {
            let d = block_divisor(m.block_scales[i / NVFP4_BLOCK], g);
            let scaled = (x / d).abs();
            // Half the gap of the E2M1 interval that holds |x|/d; beyond 6 the distance to 6.
            let allowed = if scaled >= 6.0 { scaled - 6.0 + 1e-6 } else { 0.5 * e2m1_gap(scaled) };
            prop_assert!(((x - y) / d).abs() <= allowed * (1.0 + 1e-5) + 1e-6,
                "x {} y {} d {} scaled {}", x, y, d, scaled);
        }
        // Given scales reproduce the same codes.
        let again = Nvfp4Matrix::quantize(&w, rows, cols, g, BlockScales::Given(&m.block_scales)).unwrap();
        prop_assert_eq!(again, m);
    }

    #[test]
    fn nvfp4_row_chunks_in_parallel_equal_the_whole(rows in 1usize..24, seed in any::<u64>()) {
        let cols = 64;
        let w: Vec<f32> = pseudo_random(seed, rows * cols).map(unit).collect();
        let whole = Nvfp4Matrix::quantize(&w, rows, cols, 1.0 / 2688.0, BlockScales::Max).unwrap();
        let mut scales = vec![0u8; rows * cols / 16];
        let mut packed = vec![0u8; rows * cols / 2];
        w.par_chunks(3 * cols)
            .zip(scales.par_chunks_mut(3 * cols / 16))
            .zip(packed.par_chunks_mut(3 * cols / 2))
            .enumerate()
            .try_for_each(|(i, ((wc, sc), pc))| quantize_rows_into(wc, cols, 1.0 / 2688.0, 3 * i, true, sc, pc))
            .unwrap();
        prop_assert_eq!(scales, whole.block_scales);
        prop_assert_eq!(packed, whole.packed);
    }
}

/// Gap between the E2M1 grid points around magnitude `a` (a < 6).
fn e2m1_gap(a: f32) -> f32 {
    let grid = &E2M1_VALUES[..8];
    let i = grid.iter().rposition(|&g| g <= a).unwrap();
    grid[i + 1] - grid[i]
}

#[test]
fn e2m1_decode_is_the_table() {
    for c in 0..16u8 {
        assert_eq!(e2m1_decode(c).to_bits(), E2M1_VALUES[c as usize].to_bits());
    }
}

/// A small deterministic generator (SplitMix64), so failures reproduce from the seed proptest prints.
fn pseudo_random(seed: u64, n: usize) -> impl Iterator<Item = u64> {
    let mut s = seed;
    (0..n).map(move |_| {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    })
}

/// Maps a random word to [-1, 1).
fn unit(r: u64) -> f32 {
    (r >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

proptest! {
    // Inputs of up to a few hundred thousand codes cross the packers' parallel task
    // boundaries (64 K codes), so a few cases suffice.
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn e2m1_packing_across_tasks_is_the_sequential_packing(
        seed in any::<u64>(), pairs in 1usize..200_000, bad in proptest::option::of((any::<prop::sample::Index>(), any::<prop::sample::Index>())),
    ) {
        let mut codes: Vec<u8> = pseudo_random(seed, 2 * pairs).map(|r| (r % 16) as u8).collect();
        let sequential: Vec<u8> = codes.chunks_exact(2).map(|p| p[0] | (p[1] << 4)).collect();
        match bad {
            None => {
                let packed = pack_e2m1(&codes).unwrap();
                prop_assert_eq!(&packed, &sequential);
                prop_assert_eq!(unpack_e2m1(&packed), codes);
            }
            Some((first, second)) => {
                // Two codes out of range: the error names the earlier one.
                let (a, b) = (first.index(codes.len()), second.index(codes.len()));
                codes[a] = 16;
                codes[b] = 0xFF;
                let earliest = a.min(b);
                match pack_e2m1(&codes) {
                    Err(sala_formats::FormatError::CodeOutOfRange { index, code, bits }) => {
                        prop_assert_eq!(index, earliest);
                        prop_assert_eq!(code, u32::from(codes[earliest]));
                        prop_assert_eq!(bits, 4);
                    }
                    other => prop_assert!(false, "expected CodeOutOfRange, got {:?}", other),
                }
            }
        }
    }
}
