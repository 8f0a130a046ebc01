//! The metrics on hand-made logits and the drift helpers on hand-made states.

use sala_eval::drift::{gla_states, growth_exponent};
use sala_eval::metrics::compare_token;
use sala_eval::{split_sequences, MetricsAccumulator};

fn logits(tokens: usize, vocab: usize) -> Vec<f32> {
    (0..tokens * vocab)
        .map(|i| ((i * 7919) % 97) as f32 / 13.0 - 3.0)
        .collect()
}

#[test]
fn uniform_logits_have_the_vocabulary_as_perplexity() {
    let vocab = 2048;
    let ids: Vec<u32> = (0..9).map(|i| i * 101).collect();
    let zeros = vec![0f32; ids.len() * vocab];
    let mut acc = MetricsAccumulator::default();
    acc.add_sequence(&zeros, &zeros, vocab, &ids).unwrap();
    let m = acc.finish();
    assert_eq!((m.tokens, m.predicted), (9, 8));
    assert!((m.perplexity_original - vocab as f64).abs() < 1e-9 * vocab as f64);
    assert!((m.perplexity_quantized - vocab as f64).abs() < 1e-9 * vocab as f64);
}

#[test]
fn identical_logits_have_zero_kl_and_full_agreement() {
    let (vocab, ids) = (50, vec![1u32, 4, 9, 16, 25]);
    let p = logits(ids.len(), vocab);
    let mut acc = MetricsAccumulator::default();
    acc.add_sequence(&p, &p, vocab, &ids).unwrap();
    let m = acc.finish();
    assert_eq!(m.kl_mean, 0.0);
    assert_eq!(m.kl_max, 0.0);
    assert_eq!(m.top1_agreement, 1.0);
    assert_eq!(m.perplexity_original, m.perplexity_quantized);
}

#[test]
fn a_perturbation_gives_positive_kl_matching_the_closed_form() {
    // Two tokens, logits (0, 0) vs (0, ln 3): p = (1/2, 1/2), q = (1/4, 3/4).
    let t = compare_token(&[0.0, 0.0], &[0.0, 3f32.ln()], Some(1)).unwrap();
    let expected = 0.5 * (0.5f64 / 0.25).ln() + 0.5 * (0.5f64 / 0.75).ln();
    assert!((t.kl - expected).abs() < 1e-7, "{} vs {expected}", t.kl);
    assert!(t.kl > 0.0);
    let (nll_p, nll_q) = t.nll.unwrap();
    assert!((nll_p - 2f64.ln()).abs() < 1e-7 && (nll_q - (4.0f64 / 3.0).ln()).abs() < 1e-6);
    // The argmax moves from token 0 (first of a tie) to token 1.
    assert!(!t.agree);
}

#[test]
fn bad_inputs_are_errors() {
    assert!(compare_token(&[0.0, 1.0], &[0.0], None).is_err());
    assert!(compare_token(&[0.0, 1.0], &[0.0, 1.0], Some(2)).is_err());
    let mut acc = MetricsAccumulator::default();
    assert!(acc.add_sequence(&[0.0; 6], &[0.0; 6], 4, &[1, 2]).is_err());
}

#[test]
fn sequences_grow_by_bucket_and_do_not_overlap() {
    let stream: Vec<u32> = (10..110).collect();
    let seqs = split_sequences(&stream, Some(1), &[8, 32, 200], 3);
    let lengths: Vec<usize> = seqs.iter().map(|s| s.ids.len()).collect();
    assert_eq!(lengths, vec![8, 8, 8, 32, 32, 32]);
    assert!(seqs
        .iter()
        .all(|s| s.ids[0] == 1 && s.ids.len() == s.bucket));
    assert_eq!(seqs[1].ids[1..], stream[7..14]);
    assert_eq!(seqs[5].offset, 62);
}

#[test]
fn states_follow_the_recurrence_and_exponents_recover_powers() {
    // One head, d = 1: S_t = γ S_{t-1} + k_t v_t with k = v = 1 gives (1 − γ^t)/(1 − γ).
    let g = -0.5f64;
    let ones = vec![1f32; 6];
    let states = gla_states(&ones, &ones, [6, 1, 1], &[g], &[1, 3, 6]);
    for (s, t) in states.iter().zip([1, 3, 6]) {
        let expected = (1.0 - (g * t as f64).exp()) / (1.0 - g.exp());
        assert!((s[0] - expected).abs() < 1e-12, "{} vs {expected}", s[0]);
    }
    let linear: Vec<(usize, f64)> = [64, 256, 1024]
        .iter()
        .map(|&n| (n, 3.0 * n as f64))
        .collect();
    assert!((growth_exponent(&linear).unwrap() - 1.0).abs() < 1e-12);
    let root: Vec<(usize, f64)> = [64, 256].iter().map(|&n| (n, (n as f64).sqrt())).collect();
    assert!((growth_exponent(&root).unwrap() - 0.5).abs() < 1e-12);
    assert_eq!(growth_exponent(&[(64, 1.0)]), None);
}
