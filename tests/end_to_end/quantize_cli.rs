//! `quantize_sala`'s error paths: one-line errors, nothing written.

use clap::Parser;
use sala_quant::quantize_cli::{run, Args};
use std::path::Path;

fn args(extra: &[&str]) -> Args {
    let mut argv = vec!["quantize_sala", "--quiet"];
    argv.extend_from_slice(extra);
    Args::try_parse_from(argv).expect("flags parse")
}

fn error_of(extra: &[&str]) -> String {
    run(args(extra)).expect_err("the run must fail").to_string()
}

fn assert_absent(path: &Path) {
    assert!(!path.exists(), "{} was written", path.display());
    let parent = path.parent().unwrap();
    let leftovers: Vec<_> = std::fs::read_dir(parent)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".partial"))
        .collect();
    assert!(
        leftovers.is_empty(),
        "staging directories left behind: {leftovers:?}"
    );
}

#[test]
fn a_missing_calibration_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let missing = dir.path().join("nope.jsonl");
    let err = error_of(&[
        "--output",
        out.to_str().unwrap(),
        "--calib-data",
        missing.to_str().unwrap(),
    ]);
    assert!(err.contains("nope.jsonl"), "{err}");
    assert!(!err.contains('\n'), "one line: {err}");
    assert_absent(&out);
}

#[test]
fn an_empty_calibration_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let err = error_of(&[
        "--output",
        out.to_str().unwrap(),
        "--calib-data",
        empty.to_str().unwrap(),
    ]);
    assert!(err.contains("empty.jsonl"), "{err}");
    assert_absent(&out);
}

#[test]
fn a_malformed_line_is_named_by_number() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"fine\"}\n{not json\n").unwrap();
    let err = error_of(&[
        "--output",
        out.to_str().unwrap(),
        "--calib-data",
        bad.to_str().unwrap(),
    ]);
    assert!(err.contains("bad.jsonl") && err.contains('2'), "{err}");
    assert_absent(&out);
}

#[test]
fn an_output_inside_the_input_is_refused() {
    // A copy of the fixture, so that nothing can be written into the repository's.
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for entry in std::fs::read_dir(sala_quant::fixtures_dir().join("tiny-sala")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), model.join(entry.file_name())).unwrap();
    }
    let before: Vec<_> = std::fs::read_dir(&model)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    let out = model.join("quantized");
    let err = error_of(&[
        "--input",
        model.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--max-samples",
        "2",
        "--max-len",
        "32",
    ]);
    assert!(err.contains("quantized") || err.contains("input"), "{err}");
    let after: Vec<_> = std::fs::read_dir(&model)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(before, after, "the input directory changed");
}

#[test]
fn bad_plan_flags_fail_before_any_compute() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let o = out.to_str().unwrap();
    for (flags, needle) in [
        (vec!["--layer-bits", "3-x:4"], "--layer-bits"),
        (vec!["--group-size", "96"], "group size 96"),
        (vec!["--recipe", "nvfp4", "--bits", "8"], "8 bits"),
        (
            vec!["--exclude", "model.layers.1.self_attn.k_proj"],
            "fused group",
        ),
        (vec!["--exclude", "("], "--exclude"),
    ] {
        let mut all = vec!["--output", o];
        all.extend(flags);
        let err = error_of(&all);
        assert!(err.contains(needle), "{err}");
        assert_absent(&out);
    }
}

#[test]
fn flags_that_could_only_fail_later_fail_before_any_compute() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let o = out.to_str().unwrap();
    for (flags, needles) in [
        (vec!["--bits", "2"], &["2-bit symmetric", "gptq_marlin"][..]),
        (
            vec!["--bits", "2", "--plan-only"],
            &["2-bit", "gptq_marlin"],
        ),
        (vec!["--no-sym"], &["asymmetric", "--no-sym"]),
        (vec!["--layer-bits", "0:2"], &["model.layers.0.", "2-bit"]),
        (vec!["--bits", "16"], &["nothing to quantize"]),
        (vec!["--exclude", ""], &["nothing to quantize"]),
        (vec!["--damp", "0"], &["--damp", "percdamp"]),
        (vec!["--damp=-1", "--plan-only"], &["--damp"]),
        (
            vec!["--recipe", "nvfp4", "--mse-iters", "0"],
            &["--mse-iters", "iters"],
        ),
        (
            vec!["--recipe", "nvfp4", "--mse-max-shrink", "1"],
            &["max_shrink"],
        ),
    ] {
        let mut all = vec!["--output", o];
        all.extend(flags.iter().copied());
        let err = error_of(&all);
        for needle in needles {
            assert!(err.contains(needle), "{flags:?}: {err}");
        }
        assert!(!err.contains('\n'), "one line: {err}");
        assert_absent(&out);
    }
}

#[test]
fn smooth_alpha_is_a_number_in_0_1_or_search() {
    let err = Args::try_parse_from(["quantize_sala", "--smooth-alpha", "1.5"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--smooth-alpha") && err.contains("1.5"),
        "{err}"
    );
    assert!(Args::try_parse_from(["quantize_sala", "--smooth-alpha", "searched"]).is_err());
    for ok in ["search", "0", "0.5", "1"] {
        assert!(
            Args::try_parse_from(["quantize_sala", "--smooth-alpha", ok]).is_ok(),
            "{ok}"
        );
    }
}

#[test]
fn unknown_flags_are_usage_errors() {
    assert!(Args::try_parse_from(["quantize_sala", "--recipe", "awq"]).is_err());
    assert!(Args::try_parse_from(["quantize_sala", "--bogus"]).is_err());
}

/// A small `--max-device-memory` shrinks the packs (here from 16,384 tokens to a few hundred)
/// and changes nothing else on the CPU: the checkpoint's bytes are those of the run without a
/// budget. A budget too small for the longest sample is refused, naming its line.
#[test]
fn a_small_device_budget_shrinks_the_packs_not_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let quantize = |name: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let mut flags = vec![
            "--output",
            out.to_str().unwrap(),
            "--max-samples",
            "24",
            "--max-len",
            "512",
        ];
        flags.extend_from_slice(extra);
        run(args(&flags)).expect("the run succeeds");
        let report: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("quantization_report.json")).unwrap(),
        )
        .unwrap();
        let shards = std::fs::read(out.join("model.safetensors")).unwrap();
        (shards, report["memory_plan"].clone())
    };
    let (unbounded, no_plan) = quantize("unbounded", &[]);
    assert!(no_plan.is_null(), "no budget on the CPU unless given");
    let (small, plan) = quantize("small", &["--max-device-memory", "30"]);
    let pack_tokens = plan["pack_tokens"].as_u64().unwrap();
    assert!(
        (512..16_384).contains(&pack_tokens),
        "the budget shrinks the packs: {plan}"
    );
    assert!(small == unbounded, "the same checkpoint bytes");
    let out = dir.path().join("refused");
    let err = error_of(&[
        "--output",
        out.to_str().unwrap(),
        "--max-len",
        "512",
        "--max-device-memory",
        "8",
    ]);
    assert!(err.contains("calibration line"), "{err}");
    assert!(
        err.contains("tokens") && err.contains("8 MB budget"),
        "{err}"
    );
    assert_absent(&out);
}
