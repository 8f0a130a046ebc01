//! `bench_forward` on the tiny fixture's configuration: the op-by-op profile.

use clap::Parser;
use sala_quant::forward_cli::{run, Args};

fn args(extra: &[&str]) -> Args {
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/tiny-sala/config.json"
    );
    let mut argv = vec!["bench_forward", "--config", config, "--reps", "1"];
    argv.extend_from_slice(extra);
    Args::try_parse_from(argv).expect("flags parse")
}

/// One profile per layer kind and case, each pass with its linears, its mixer and (capture)
/// its Hessian products, their seconds inside the pass's own.
#[test]
fn profile_ops_reports_each_pass_op_by_op() {
    let report = run(args(&["--cases", "2x16,1x40", "--profile-ops"])).unwrap();
    let cases: Vec<(&str, &str)> = report
        .profiles
        .iter()
        .map(|p| (p.kind.as_str(), p.case.as_str()))
        .collect();
    assert_eq!(
        cases,
        [
            ("minicpm4", "packed_16_x2"),
            ("minicpm4", "single_40"),
            ("lightning", "packed_16_x2"),
            ("lightning", "single_40"),
        ]
    );
    for p in &report.profiles {
        let calls = |ops: &[sala_gptq::model::OpTotal], op: &str| {
            ops.iter().find(|t| t.op == op).map_or(0, |t| t.calls)
        };
        let mixer = match p.kind.as_str() {
            "lightning" => "simple_gla",
            _ => "causal_attention",
        };
        for (pass, seconds, ops) in [
            ("capture", p.capture_s, &p.capture_ops),
            ("propagate", p.propagate_s, &p.propagate_ops),
        ] {
            assert!(calls(ops, "linear") > 0, "{} {pass}: {ops:?}", p.case);
            assert_eq!(
                calls(ops, mixer),
                1,
                "{} {} {pass}: {ops:?}",
                p.kind,
                p.case
            );
            let timed: f64 = ops.iter().map(|o| o.seconds).sum();
            assert!(
                timed <= seconds,
                "{} {pass}: ops {timed} s of {seconds} s",
                p.case
            );
        }
        assert!(
            calls(&p.capture_ops, "accumulate_gram") > 0,
            "{:?}",
            p.capture_ops
        );
        assert_eq!(calls(&p.propagate_ops, "accumulate_gram"), 0);
    }
}

#[test]
fn profile_ops_without_fast_ops_is_refused_up_front() {
    let err = run(args(&["--cases", "1x8", "--profile-ops", "--graph-ops"]))
        .expect_err("no fast ops to profile")
        .to_string();
    assert!(
        err.contains("--profile-ops") && err.contains("--graph-ops"),
        "{err}"
    );
}
