//! GPTQ against RTN, against the textbook sequential loop, and on the numerical failures.

use crate::common;

use common::*;
use proptest::prelude::*;
use sala_hessian::reference::{gptq_sequential, inverse_upper_textbook};
use sala_hessian::{
    BlockedLoop, CholeskyInverse, ColumnProblem, ColumnSolution, Damping, DampingAttempt,
    FailurePolicy, Gptq, GptqColumnLoop, GptqConfig, GptqPreparation, Hessian, HessianError,
    IntGrid, IntScheme, Method, QuantizedLinear, Rtn, UnfinishedGptq, UpperFactorizer,
};

const SCHEMES: [IntScheme; 3] = [
    IntScheme::SymmetricIst,
    IntScheme::SymmetricAbsMax,
    IntScheme::Asymmetric,
];

fn config(bits: u32, scheme: IntScheme, group_size: Option<usize>) -> GptqConfig {
    GptqConfig {
        grid: IntGrid {
            bits,
            scheme,
            group_size,
            clip: None,
        },
        ..GptqConfig::default()
    }
}

fn differing_codes(a: &QuantizedLinear, b: &QuantizedLinear) -> usize {
    a.codes.iter().zip(&b.codes).filter(|(x, y)| x != y).count()
}

#[test]
fn identity_hessian_gives_exactly_rtn() {
    let mut rng = rng(1);
    let (out, inp) = (16, 96);
    let w = weights(&mut rng, out, inp);
    let h = Hessian::<f64>::identity(inp);
    for scheme in SCHEMES {
        for bits in [2, 3, 4, 8] {
            for group_size in [Some(32), Some(40), None] {
                let cfg = config(bits, scheme, group_size);
                let gptq = Gptq::new(cfg).unwrap().solve(&w, out, inp, &h).unwrap();
                let rtn = Rtn::new(cfg.grid)
                    .unwrap()
                    .quantize(&w, out, inp, Some(&h))
                    .unwrap();
                assert_eq!(gptq.codes, rtn.codes, "{scheme:?} {bits} {group_size:?}");
                assert_eq!(gptq.params, rtn.params);
                assert_eq!(gptq.g_idx, rtn.g_idx);
                assert_eq!(gptq.dequantized, rtn.dequantized);
                assert_eq!(gptq.proxy_error, rtn.proxy_error);
                assert_eq!(gptq.method, Method::Gptq);
            }
        }
    }
}

#[test]
fn block_of_one_equals_the_sequential_algorithm_exactly() {
    let mut rng = rng(2);
    let (out, inp) = (24, 128);
    let w = weights(&mut rng, out, inp);
    let h = correlated_hessian::<f64>(&mut rng, inp, 3, 160);
    let variants = [
        (IntScheme::SymmetricIst, Some(32), false, false),
        (IntScheme::SymmetricAbsMax, Some(32), true, false),
        (IntScheme::Asymmetric, Some(32), true, true),
        (IntScheme::SymmetricIst, None, true, false),
        (IntScheme::Asymmetric, Some(48), false, false),
    ];
    for (scheme, group_size, act_order, static_groups) in variants {
        let cfg = GptqConfig {
            block_size: 1,
            act_order,
            static_groups,
            ..config(4, scheme, group_size)
        };
        let fast = Gptq::new(cfg).unwrap().solve(&w, out, inp, &h).unwrap();
        let textbook = gptq_sequential(&cfg, &w, out, inp, &h).unwrap();
        assert_eq!(
            fast.codes, textbook.codes,
            "{scheme:?} {group_size:?} {act_order} {static_groups}"
        );
        assert_eq!(fast.params, textbook.params);
        assert_eq!(fast.g_idx, textbook.g_idx);
        assert_eq!(fast.column_loss, textbook.column_loss);
    }
}

#[test]
fn lazy_blocks_match_the_sequential_algorithm() {
    let mut rng = rng(3);
    let (out, inp) = (64, 256);
    let w = weights(&mut rng, out, inp);
    // A ridge keeps rounding differences from cascading through the error feedback.
    let mut h = correlated_hessian::<f64>(&mut rng, inp, 2, 300).to_row_major();
    let mean = (0..inp).map(|i| h[i * inp + i]).sum::<f64>() / inp as f64;
    for i in 0..inp {
        h[i * inp + i] += 0.1 * mean;
    }
    let h = Hessian::from_row_major(inp, &h).unwrap();
    let variants = [
        (128, Some(128), false, false),
        (128, Some(32), false, false),
        (128, Some(96), false, false), // block shortened to 96
        (32, Some(64), true, false),   // groups span two blocks
        (128, Some(32), true, true),
        (64, None, true, false),
        (16, Some(16), false, false), // several outer blocks of 8 inner blocks
        (8, None, true, false),
        (16, Some(32), false, false), // groups longer than a block: single-level
    ];
    for (block_size, group_size, act_order, static_groups) in variants {
        let cfg = GptqConfig {
            block_size,
            act_order,
            static_groups,
            ..config(4, IntScheme::SymmetricIst, group_size)
        };
        let fast = Gptq::new(cfg).unwrap().solve(&w, out, inp, &h).unwrap();
        let textbook = gptq_sequential(&cfg, &w, out, inp, &h).unwrap();
        let label = format!(
            "block {block_size} group {group_size:?} act {act_order} static {static_groups}"
        );
        // Lazy updates sum the same terms in another order: a code may flip at an exact tie,
        // nothing more.
        assert!(
            differing_codes(&fast, &textbook) * 200 <= out * inp,
            "{label}"
        );
        assert_eq!(fast.g_idx, textbook.g_idx, "{label}");
        let rel = (fast.loss - textbook.loss).abs() / textbook.loss;
        assert!(
            rel < 1e-3,
            "{label}: loss {} vs {}",
            fast.loss,
            textbook.loss
        );
        let (p, q) = (fast.proxy_error.unwrap(), textbook.proxy_error.unwrap());
        assert!((p - q).abs() / q < 1e-2, "{label}: proxy {p} vs {q}");
    }
}

#[test]
fn fast_inverse_equals_the_textbook_route() {
    let mut rng = rng(4);
    let inp = 96;
    let mut h = correlated_hessian::<f64>(&mut rng, inp, 2, 200).to_row_major();
    // one dead channel
    for k in 0..inp {
        h[7 * inp + k] = 0.0;
        h[k * inp + 7] = 0.0;
    }
    let h = Hessian::from_row_major(inp, &h).unwrap();
    let fast = CholeskyInverse::new(&h, &Damping::default()).unwrap();
    let textbook = inverse_upper_textbook(&h, 0.01).unwrap();
    assert_eq!(fast.retries(), 0);
    assert!(fast.dead()[7] && fast.dead().iter().filter(|&&d| d).count() == 1);
    let max = (0..inp).map(|i| textbook[(i, i)].abs()).fold(0.0, f64::max);
    for i in 0..inp {
        for j in 0..inp {
            let diff = (fast.upper()[(i, j)] as f64 - textbook[(i, j)]).abs();
            assert!(
                diff <= 1e-5 * max,
                "U[{i},{j}]: {} vs {}",
                fast.upper()[(i, j)],
                textbook[(i, j)]
            );
        }
    }
}

#[test]
fn act_order_with_static_groups_has_a_monotone_g_idx() {
    let mut rng = rng(5);
    let (out, inp, gs) = (8, 128, 32);
    let w = weights(&mut rng, out, inp);
    let h = correlated_hessian::<f32>(&mut rng, inp, 2, 200);
    let base = GptqConfig {
        act_order: true,
        ..config(4, IntScheme::SymmetricIst, Some(gs))
    };
    let dynamic = Gptq::new(base).unwrap().solve(&w, out, inp, &h).unwrap();
    let fixed = Gptq::new(GptqConfig {
        static_groups: true,
        ..base
    })
    .unwrap()
    .solve(&w, out, inp, &h)
    .unwrap();
    assert!(fixed.g_idx.windows(2).all(|p| p[0] <= p[1]));
    assert_eq!(
        fixed.g_idx,
        (0..inp).map(|j| (j / gs) as i32).collect::<Vec<_>>()
    );
    // Without static groups the groups follow the act-order permutation: same group sizes,
    // but not monotone in the original column order.
    assert!(dynamic.g_idx.windows(2).any(|p| p[0] > p[1]));
    for g in 0..inp / gs {
        assert_eq!(dynamic.g_idx.iter().filter(|&&x| x == g as i32).count(), gs);
    }
    // Both pack and unpack to their own dequantized weight (orientation of params and g_idx).
    for result in [&dynamic, &fixed] {
        assert_eq!(
            result.pack().unwrap().dequantize().unwrap(),
            result.dequantized
        );
    }
}

/// GAR's loop order, computed here from its definition: full groups by decreasing maximum
/// `diag`, columns inside each by decreasing `diag`, a partial last group last.
fn gar_order(diag: &[f64], gs: usize) -> Vec<usize> {
    let full = diag.len() / gs;
    let mut groups: Vec<Vec<usize>> = (0..full)
        .map(|g| {
            let mut cols: Vec<usize> = (g * gs..(g + 1) * gs).collect();
            cols.sort_by(|&a, &b| diag[b].partial_cmp(&diag[a]).unwrap());
            cols
        })
        .collect();
    let max = |cols: &[usize]| cols.iter().map(|&j| diag[j]).fold(f64::MIN, f64::max);
    groups.sort_by(|a, b| max(b).partial_cmp(&max(a)).unwrap());
    let mut order = groups.concat();
    order.extend(full * gs..diag.len());
    order
}

/// Group-aware reordering is GPTQ in the natural order on the problem permuted by GAR's order,
/// un-permuted: every group keeps its own columns and parameters, `g_idx` stays natural, and
/// the lazy-block loop agrees with the textbook one in that order too.
#[test]
fn group_aware_order_is_natural_gptq_on_the_permuted_problem() {
    let mut rng = rng(9);
    let (out, gs) = (16, 32);
    for inp in [160, 176] {
        let w = weights(&mut rng, out, inp);
        let h = correlated_hessian::<f64>(&mut rng, inp, 2, 200);
        let diag = h.diagonal();
        let order = gar_order(&diag, gs);
        assert!(order.iter().enumerate().any(|(c, &j)| c != j), "inp {inp}");
        let w_perm: Vec<f32> = (0..out * inp)
            .map(|k| w[(k / inp) * inp + order[k % inp]])
            .collect();
        let h_perm: Vec<f64> = (0..inp * inp)
            .map(|k| h.get(order[k / inp], order[k % inp]))
            .collect();
        let h_perm = Hessian::from_row_major(inp, &h_perm).unwrap();
        let natural_cfg = config(4, IntScheme::SymmetricIst, Some(gs));
        let gar_cfg = GptqConfig {
            group_aware_order: true,
            ..natural_cfg
        };
        let natural = Gptq::new(natural_cfg)
            .unwrap()
            .solve(&w_perm, out, inp, &h_perm)
            .unwrap();
        let gar = Gptq::new(gar_cfg).unwrap().solve(&w, out, inp, &h).unwrap();

        assert_eq!(
            gar.g_idx,
            (0..inp).map(|j| (j / gs) as i32).collect::<Vec<_>>()
        );
        let unpermuted = |x: &[u8]| -> Vec<u8> {
            let mut y = vec![0; x.len()];
            for k in 0..x.len() {
                y[(k / inp) * inp + order[k % inp]] = x[k];
            }
            y
        };
        // The mean diagonal (the damping's reference) sums in another order: allow a tie flip.
        let flipped = unpermuted(&natural.codes)
            .iter()
            .zip(&gar.codes)
            .filter(|(a, b)| a != b)
            .count();
        assert!(
            flipped * 500 <= out * inp,
            "inp {inp}: {flipped} codes differ"
        );
        let rel = (gar.loss - natural.loss).abs() / natural.loss;
        assert!(
            rel < 1e-6,
            "inp {inp}: loss {} vs {}",
            gar.loss,
            natural.loss
        );
        // Loop group k of the permuted problem is original group order[k·gs] / gs.
        let groups = inp.div_ceil(gs);
        let mut same_params = 0;
        for k in 0..groups {
            let g = order[k * gs] / gs;
            for r in 0..out {
                same_params += usize::from(gar.params[g * out + r] == natural.params[k * out + r]);
            }
        }
        assert!(same_params * 100 >= 99 * groups * out, "inp {inp}");
        assert_eq!(gar.pack().unwrap().dequantize().unwrap(), gar.dequantized);
        let textbook = gptq_sequential(&gar_cfg, &w, out, inp, &h).unwrap();
        assert!(
            differing_codes(&gar, &textbook) * 200 <= out * inp,
            "inp {inp}"
        );
        assert_eq!(gar.g_idx, textbook.g_idx);
    }
    // GAR is one column order: act-order or no groups are refused.
    let refused = [
        GptqConfig {
            group_aware_order: true,
            act_order: true,
            ..config(4, IntScheme::SymmetricIst, Some(gs))
        },
        GptqConfig {
            group_aware_order: true,
            ..config(4, IntScheme::SymmetricIst, None)
        },
    ];
    for cfg in refused {
        let err = Gptq::new(cfg).unwrap_err().to_string();
        assert!(err.contains("group_aware_order"), "{err}");
    }
}

#[test]
fn rank_deficient_hessian_triggers_retries_and_succeeds() {
    let mut rng = rng(6);
    let (out, inp) = (8, 64);
    // 12 tokens of 4 latent factors: rank 4 of 64.
    let x = correlated_activations(&mut rng, 12, inp, 4);
    let mut acc = sala_hessian::HessianAccumulator::<f32>::new(inp, Default::default()).unwrap();
    acc.add_sample(&x, 12).unwrap();
    let h = acc.finalize().unwrap();
    let cfg = GptqConfig {
        damping: Damping {
            percdamp: 1e-12,
            growth: 100.0,
            max_retries: 6,
        },
        ..GptqConfig::default()
    };
    let w = weights(&mut rng, out, inp);
    let result = Gptq::new(cfg).unwrap().solve(&w, out, inp, &h).unwrap();
    assert!(
        result.damping_retries >= 1,
        "retries {}",
        result.damping_retries
    );
    assert!(result.percdamp > 1e-12);
    assert_eq!(result.method, Method::Gptq);
    assert!(result.dequantized.iter().all(|v| v.is_finite()));
    assert!(result.loss.is_finite() && result.proxy_error.unwrap().is_finite());
}

#[test]
fn failed_inverse_is_an_error_or_an_rtn_fallback() {
    let (out, inp) = (4, 32);
    let w = weights(&mut rng(7), out, inp);
    let h = indefinite_hessian(inp);
    let cfg = GptqConfig {
        damping: Damping {
            max_retries: 2,
            ..Damping::default()
        },
        ..GptqConfig::default()
    };
    let err = Gptq::new(cfg).unwrap().solve(&w, out, inp, &h).unwrap_err();
    assert!(
        matches!(err, HessianError::NotPositiveDefinite { attempts: 3, .. }),
        "{err}"
    );
    let fallback = Gptq::new(GptqConfig {
        on_failure: FailurePolicy::Rtn,
        ..cfg
    })
    .unwrap()
    .solve(&w, out, inp, &h)
    .unwrap();
    assert_eq!(fallback.method, Method::RtnFallback);
    let rtn = Rtn::new(cfg.grid)
        .unwrap()
        .quantize::<f64>(&w, out, inp, None)
        .unwrap();
    assert_eq!(fallback.codes, rtn.codes);
}

#[test]
fn non_finite_inputs_are_clear_errors() {
    let (out, inp) = (4, 32);
    let w = weights(&mut rng(8), out, inp);
    let mut h = Hessian::<f64>::identity(inp).to_row_major();
    h[5 * inp + 3] = f64::NAN;
    let h = Hessian::from_row_major(inp, &h).unwrap();
    let gptq = Gptq::new(GptqConfig::default()).unwrap();
    match gptq.solve(&w, out, inp, &h).unwrap_err() {
        HessianError::NonFinite { what, row, col, .. } => {
            assert_eq!((what, row, col), ("hessian", 5, 3))
        }
        e => panic!("unexpected {e}"),
    }
    let mut bad_w = w.clone();
    bad_w[inp + 2] = f32::INFINITY;
    let err = gptq
        .solve(&bad_w, out, inp, &Hessian::<f64>::identity(inp))
        .unwrap_err();
    assert!(matches!(
        err,
        HessianError::NonFinite {
            what: "weights",
            row: 1,
            col: 2,
            ..
        }
    ));
    let err = gptq
        .solve(&w, out, inp + 1, &Hessian::<f64>::identity(inp))
        .unwrap_err();
    assert!(matches!(err, HessianError::LengthMismatch { .. }));
    let err = gptq
        .solve(&w, out, inp, &Hessian::<f64>::identity(inp + 1))
        .unwrap_err();
    assert!(matches!(err, HessianError::DimensionMismatch { .. }));
    let err = Gptq::new(config(9, IntScheme::SymmetricIst, Some(128))).unwrap_err();
    assert!(matches!(err, HessianError::Format(_)));
}

#[test]
fn dead_columns_quantize_to_zero() {
    let mut rng = rng(9);
    let (out, inp) = (8, 64);
    let mut x = correlated_activations(&mut rng, 100, inp, 8);
    for t in 0..100 {
        x[t * inp + 10] = 0.0;
    }
    let mut acc = sala_hessian::HessianAccumulator::<f64>::new(inp, Default::default()).unwrap();
    acc.add_sample(&x, 100).unwrap();
    let h = acc.finalize().unwrap();
    let w = weights(&mut rng, out, inp);
    let result = Gptq::new(GptqConfig::default())
        .unwrap()
        .solve(&w, out, inp, &h)
        .unwrap();
    assert!((0..out).all(|r| result.dequantized[r * inp + 10] == 0.0));
    assert_eq!(result.column_loss[10], 0.0);
}

#[test]
fn proxy_error_is_the_trace_with_the_undamped_hessian() {
    let mut rng = rng(10);
    let (out, inp) = (300, 48); // more rows than one chunk of the proxy GEMM
    let w = weights(&mut rng, out, inp);
    let h = correlated_hessian::<f64>(&mut rng, inp, 2, 100);
    let result = Gptq::new(GptqConfig::default())
        .unwrap()
        .solve(&w, out, inp, &h)
        .unwrap();
    let expected = proxy_naive(&w, &result.dequantized, inp, &h.to_row_major());
    let got = result.proxy_error.unwrap();
    assert!(
        (got - expected).abs() <= 1e-9 * expected,
        "{got} vs {expected}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// On correlated inputs GPTQ's output error is never above round-to-nearest's.
    #[test]
    fn gptq_output_error_never_exceeds_rtn(seed in any::<u8>(), bits in 3u32..=4, act_order in any::<bool>(),
                                           scheme in prop::sample::select(SCHEMES.to_vec())) {
        let mut rng = rng(seed);
        let (out, inp) = (16, 64);
        let w = weights(&mut rng, out, inp);
        let h = correlated_hessian::<f64>(&mut rng, inp, 2, 96);
        let cfg = GptqConfig { act_order, ..config(bits, scheme, Some(32)) };
        let gptq = Gptq::new(cfg).unwrap().solve(&w, out, inp, &h).unwrap();
        let rtn = Rtn::new(cfg.grid).unwrap().quantize(&w, out, inp, Some(&h)).unwrap();
        let (g, r) = (gptq.proxy_error.unwrap(), rtn.proxy_error.unwrap());
        prop_assert!(g <= r, "gptq {} > rtn {}", g, r);
    }
}

/// A factorizer on the host through the textbook route in f64: stands in for a GPU's
/// Cholesky, and refuses its first `refuse` calls (a "not positive definite" device answer).
struct TextbookFactorizer {
    refuse: usize,
    calls: std::sync::atomic::AtomicUsize,
}

impl UpperFactorizer for TextbookFactorizer {
    fn upper_factor(
        &self,
        a: &[f32],
        n: usize,
    ) -> Result<Option<sala_hessian::faer::Mat<f32>>, HessianError> {
        let call = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        if call <= self.refuse {
            return Ok(None);
        }
        let a: Vec<f64> = a.iter().map(|&v| v as f64).collect();
        let u = inverse_upper_textbook(&Hessian::from_row_major(n, &a)?, 0.0)?;
        Ok(Some(sala_hessian::faer::Mat::from_fn(n, n, |i, j| {
            u[(i, j)] as f32
        })))
    }
}

/// A column loop that is the host's, with its damped inverse from a [`TextbookFactorizer`].
struct FactoredElsewhere(TextbookFactorizer);

impl GptqColumnLoop for FactoredElsewhere {
    fn run(
        &self,
        problem: &ColumnProblem<'_>,
        w: &mut [f32],
    ) -> Result<ColumnSolution, HessianError> {
        BlockedLoop.run(problem, w)
    }
    fn factorizer(&self) -> Option<&dyn UpperFactorizer> {
        Some(&self.0)
    }
}

#[test]
fn a_pluggable_factorizer_gives_the_same_inverse_and_retries_like_the_host() {
    let inp = 48;
    let h = correlated_hessian::<f64>(&mut rng(12), inp, 4, inp);
    let order: Vec<usize> = (0..inp).rev().collect();
    let damping = Damping::default();
    let host = CholeskyInverse::with_order(&h, &order, &damping).unwrap();
    let refusing = TextbookFactorizer {
        refuse: 2,
        calls: Default::default(),
    };
    let other = CholeskyInverse::with_order_using(&h, &order, &damping, Some(&refusing)).unwrap();
    assert_eq!(refusing.calls.load(std::sync::atomic::Ordering::SeqCst), 3);
    assert_eq!(other.retries(), 2);
    assert!((other.percdamp() - damping.percdamp * damping.growth.powi(2)).abs() < 1e-15);
    let accepting = TextbookFactorizer {
        refuse: 0,
        calls: Default::default(),
    };
    let same = CholeskyInverse::with_order_using(&h, &order, &damping, Some(&accepting)).unwrap();
    assert_eq!((same.retries(), same.damp()), (0, host.damp()));
    let scale = (0..inp)
        .map(|i| host.upper()[(i, i)].abs())
        .fold(0.0, f32::max);
    for i in 0..inp {
        for j in 0..inp {
            let (a, b) = (same.upper()[(i, j)], host.upper()[(i, j)]);
            assert!((a - b).abs() <= 1e-5 * scale, "({i}, {j}): {a} vs {b}");
        }
    }

    // Through a whole solve: the column loop's factorizer is the one used.
    let (out, cfg) = (8, config(4, IntScheme::SymmetricIst, Some(16)));
    let w = weights(&mut rng(13), out, inp);
    let column_loop = FactoredElsewhere(TextbookFactorizer {
        refuse: 1,
        calls: Default::default(),
    });
    let solved = Gptq::new(cfg)
        .unwrap()
        .solve_with_loop(&w, out, inp, &h, &column_loop)
        .unwrap();
    assert_eq!(
        column_loop
            .0
            .calls
            .load(std::sync::atomic::Ordering::SeqCst),
        2
    );
    assert_eq!(solved.damping_retries, 1);
}

/// The host's column loop, keeping a copy of its solution.
#[derive(Default)]
struct Recording(std::sync::Mutex<Option<ColumnSolution>>);

impl GptqColumnLoop for Recording {
    fn run(
        &self,
        problem: &ColumnProblem<'_>,
        w: &mut [f32],
    ) -> Result<ColumnSolution, HessianError> {
        let sol = BlockedLoop.run(problem, w)?;
        *self.0.lock().unwrap() = Some(sol.clone());
        Ok(sol)
    }
}

/// A solve through a [`Recording`] loop: its result, and what finishing it again needs.
fn solved_and_unfinished_parts(
    gptq: &Gptq,
    w: &[f32],
    out: usize,
    inp: usize,
    h: &Hessian<f64>,
) -> (
    QuantizedLinear,
    ColumnSolution,
    GptqPreparation,
    DampingAttempt,
) {
    let recording = Recording::default();
    let solved = gptq.solve_with_loop(w, out, inp, h, &recording).unwrap();
    let sol = recording.0.lock().unwrap().take().unwrap();
    let prepared = gptq.prepare(w, out, inp, &h.diagonal()).unwrap();
    let attempt = DampingAttempt {
        retries: solved.damping_retries,
        percdamp: solved.percdamp,
    };
    (solved, sol, prepared, attempt)
}

#[test]
fn finishing_later_gives_the_solve_s_result_exactly() {
    let mut rng = rng(21);
    let (out, inp, gs) = (12, 160, 32);
    let w = weights(&mut rng, out, inp);
    let h = correlated_hessian::<f64>(&mut rng, inp, 3, 120);
    let natural = config(4, IntScheme::SymmetricIst, Some(gs));
    let orders = [
        natural,
        GptqConfig {
            group_aware_order: true,
            ..natural
        },
        GptqConfig {
            act_order: true,
            ..natural
        },
    ];
    for cfg in orders {
        let gptq = Gptq::new(cfg).unwrap();
        let (solved, sol, prepared, attempt) = solved_and_unfinished_parts(&gptq, &w, out, inp, &h);
        let unfinished = gptq.unfinished(out, prepared, sol, attempt, solved.proxy_error);
        assert!(unfinished.needs_finishing());
        // Finished on another thread, as the pipeline does.
        let later = std::thread::spawn(move || unfinished.finish())
            .join()
            .unwrap()
            .unwrap();
        assert_eq!(later, solved, "{cfg:?}");

        let done = UnfinishedGptq::finished(solved.clone());
        assert!(!done.needs_finishing());
        assert_eq!(done.finish().unwrap(), solved);
    }
    // Without the proxy error the options ask for, finishing is an error, not a guess.
    let gptq = Gptq::new(natural).unwrap();
    let (_, sol, prepared, attempt) = solved_and_unfinished_parts(&gptq, &w, out, inp, &h);
    let err = gptq
        .unfinished(out, prepared, sol, attempt, None)
        .finish()
        .unwrap_err();
    assert!(err.to_string().contains("proxy error"), "{err}");
}
