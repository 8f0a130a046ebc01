//! The optimised building blocks against their plain reference implementations.

use crate::common;

use common::*;
use sala_model::ops::attention::{causal_attention, naive_reference};
use sala_model::ops::gla::{chunked, log_decays, recurrent_reference};
use sala_model::ops::norm::rms_norm;
use sala_model::ops::rope::{apply_rope, inverse_frequencies, RopeTables};
use sala_model::{round_to_bf16, Numerics};

/// Chunked GLA on random `[tokens, heads, d]` inputs against the f64 recurrence, for each of
/// `chunks` (f32 matmuls against an f64 loop: errors of a few ulp of the output's magnitude).
fn check_chunked_gla(tokens: usize, heads: usize, d: usize, chunks: &[usize]) {
    let decays = log_decays(heads);
    let q = random([tokens, heads, d]).mul_scalar(0.25);
    let k = random([tokens, heads, d]);
    let v = random([tokens, heads, d]);
    let expected = recurrent_reference(
        &to_vec(q.clone()),
        &to_vec(k.clone()),
        &to_vec(v.clone()),
        tokens,
        heads,
        d,
        &decays,
    );
    for &chunk in chunks {
        let out = chunked(
            q.clone().swap_dims(0, 1),
            k.clone().swap_dims(0, 1),
            v.clone().swap_dims(0, 1),
            &decays,
            chunk,
        );
        let err = max_abs_diff(&to_vec(out.swap_dims(0, 1)), &expected);
        assert!(
            err <= 1e-4 * max_abs(&expected),
            "{tokens} tokens, chunk {chunk}: max error {err}"
        );
    }
}

/// Chunk sizes that divide T, do not, and exceed it.
#[test]
fn chunked_gla_matches_recurrence() {
    check_chunked_gla(45, 4, 16, &[1, 2, 8, 15, 45, 64]);
}

/// Many chunks (the two-level state scan with partly filled blocks) over a long sequence, with
/// the released model's 32 decays (fast heads whose chunk powers underflow, slow ones that keep
/// the state for thousands of tokens): the chunked form still matches the recurrence.
#[test]
fn chunked_gla_scans_many_chunks() {
    check_chunked_gla(700, 32, 8, &[3, 16, 64]);
}

/// The decay slopes of the released model (H = 32) as the design note lists them.
#[test]
fn decay_slopes_match_released_model() {
    let g = log_decays(32);
    for (h, gamma) in [(0, 0.431324), (7, 0.778801), (15, 0.939413), (31, 0.996101)] {
        assert!(
            (g[h].exp() - gamma).abs() < 1e-6,
            "head {h}: {}",
            g[h].exp()
        );
    }
    // H = 4: start = 2^-2, slopes 1/4, 1/16, 1/64, 1/256.
    assert_eq!(log_decays(4), vec![-0.25, -0.0625, -0.015625, -0.00390625]);
}

/// Blocked GQA attention vs naive attention, with budgets that force 1-row, uneven and
/// whole-sequence blocks.
#[test]
fn blocked_attention_matches_naive() {
    let (tokens, heads, kv_heads, d) = (37, 4, 2, 8);
    let q = random([tokens, heads, d]);
    let k = random([tokens, kv_heads, d]);
    let v = random([tokens, kv_heads, d]);
    let expected = naive_reference(
        &to_vec(q.clone()),
        &to_vec(k.clone()),
        &to_vec(v.clone()),
        tokens,
        heads,
        kv_heads,
        d,
    );
    for budget in [1, heads * tokens * 5, 1 << 20] {
        let got = to_vec(causal_attention(q.clone(), k.clone(), v.clone(), budget));
        let err = max_abs_diff(&got, &expected);
        assert!(err < 1e-5, "budget {budget}: max error {err}");
    }
}

/// RoPE at position 1 with hand-computed cos/sin, and position 0 as the identity.
#[test]
fn rope_against_hand_computed_values() {
    let d = 4;
    // inv_freq = [1, 1/sqrt(10000)] = [1, 0.01].
    let inv = inverse_frequencies(d, 10_000.0);
    assert_eq!(inv[0], 1.0);
    assert!((inv[1] - 0.01).abs() < 1e-9);
    let tables = RopeTables::<B>::new(2, d, 10_000.0, &Default::default());
    let x = from_vec(vec![1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0], [2, 1, d]);
    let got = to_vec(apply_rope(x, &tables, Numerics::F32));
    let (c1, s1) = (1f32.cos(), 1f32.sin());
    let (c2, s2) = (0.01f32.cos(), 0.01f32.sin());
    // x·cos + rotate_half(x)·sin with rotate_half([1,2,3,4]) = [-3,-4,1,2].
    let expected = [
        1.0,
        2.0,
        3.0,
        4.0,
        1.0 * c1 - 3.0 * s1,
        2.0 * c2 - 4.0 * s2,
        3.0 * c1 + 1.0 * s1,
        4.0 * c2 + 2.0 * s2,
    ];
    assert!(max_abs_diff(&got, &expected) < 1e-6, "{got:?}");
}

/// RMSNorm on a hand-checked row: [3, 4] has RMS sqrt(12.5).
#[test]
fn rms_norm_hand_computed() {
    let x = from_vec(vec![3.0, 4.0], [1, 2]);
    let w = from_vec(vec![1.0, 2.0], [2]);
    let got = to_vec(rms_norm(x, w, 0.0, Numerics::F32));
    let r = 12.5f32.sqrt();
    assert!(max_abs_diff(&got, &[3.0 / r, 8.0 / r]) < 1e-6);
}

/// bf16 rounding is round-to-nearest-even with 8 significant bits.
#[test]
fn bf16_rounding_is_nearest_even() {
    let ulp = 2f32.powi(-7); // bf16 spacing in [1, 2)
    let x = from_vec(
        vec![
            1.0 + ulp / 2.0,
            1.0 + 1.5 * ulp,
            1.0 + 0.6 * ulp,
            -3.0,
            1e-3,
        ],
        [5],
    );
    let got = to_vec(round_to_bf16(x));
    assert_eq!(got[0], 1.0); // tie goes to even (1.0)
    assert_eq!(got[1], 1.0 + 2.0 * ulp); // tie goes to even (1 + 2 ulp)
    assert_eq!(got[2], 1.0 + ulp);
    assert_eq!(got[3], -3.0);
    assert_eq!(got[4], half::bf16::from_f32(1e-3).to_f32());
    assert_ne!(got[4], 1e-3);
}
