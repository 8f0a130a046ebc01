//! Both comparisons on the bundled tiny SALA (short sequences): a model against itself, and
//! against a copy with one perturbed weight.

use sala_eval::drift::{drift, DriftInput, DriftOptions};
use sala_eval::model::read_config;
use sala_eval::{evaluate, split_sequences, LoadedModel};
use sala_gptq::model::{AttentionMode, LayerRunner, RunOptions};
use sala_gptq::CpuBackend;
use std::path::{Path, PathBuf};

fn tiny_sala() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-sala")
}

fn runner() -> LayerRunner<CpuBackend> {
    let options = RunOptions {
        attention: AttentionMode::Dense,
        ..RunOptions::default()
    };
    LayerRunner::new(
        read_config(&tiny_sala()).unwrap(),
        Default::default(),
        options,
    )
}

fn stream(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 3 + (i * 37 + i * i) % 2000).collect()
}

/// The model with `v_proj` of lightning layer 1 scaled by 1.5.
fn perturbed(runner: &LayerRunner<CpuBackend>) -> LoadedModel {
    let mut model = LoadedModel::open(&tiny_sala(), runner.config()).unwrap();
    let w = model.layers_mut()[1]
        .get_mut("model.layers.1.self_attn.v_proj.weight")
        .unwrap();
    w.data.iter_mut().for_each(|x| *x *= 1.5);
    model
}

#[test]
fn a_model_against_itself_has_zero_kl_and_full_agreement() {
    let runner = runner();
    let model = LoadedModel::open(&tiny_sala(), runner.config()).unwrap();
    assert_eq!(model.format(), "unquantized");
    let seqs = split_sequences(&stream(100), Some(1), &[16, 48], 2);
    let report = evaluate(&runner, &model, &model, &seqs).unwrap();
    assert_eq!(report.buckets.len(), 2);
    assert_eq!(report.overall.tokens, 2 * 16 + 2 * 48);
    assert_eq!(report.overall.kl_max, 0.0);
    assert_eq!(report.overall.top1_agreement, 1.0);
    let ppl = report.overall.perplexity_original;
    assert!(ppl.is_finite() && ppl > 1.0);
    assert!(report.table().contains("| all | 4 | 128 |"));
}

#[test]
fn a_perturbed_model_has_positive_kl_and_drift() {
    let runner = runner();
    let model = LoadedModel::open(&tiny_sala(), runner.config()).unwrap();
    let other = perturbed(&runner);
    let seqs = split_sequences(&stream(64), Some(1), &[32], 1);
    let report = evaluate(&runner, &model, &other, &seqs).unwrap();
    assert!(report.overall.kl_mean > 0.0 && report.overall.kl_max >= report.overall.kl_mean);
    assert_ne!(
        report.overall.perplexity_original,
        report.overall.perplexity_quantized
    );

    let options = DriftOptions {
        checkpoints: vec![8, 16, 32],
        input: DriftInput::Original,
    };
    let layers = drift(&runner, &model, &other, &seqs[0].ids, &options).unwrap();
    let indices: Vec<usize> = layers.iter().map(|l| l.layer).collect();
    assert_eq!(indices, vec![1, 3, 4, 6]);
    // v scaled by 1.5 scales the state by exactly 1.5: relative state error 0.5.
    for p in &layers[0].points {
        assert!((p.state_rel - 0.5).abs() < 1e-5, "{p:?}");
        assert!(p.output_rel > 0.0);
    }
    // With the original input, the other layers are unchanged.
    assert!(layers[1..].iter().all(|l| l
        .points
        .iter()
        .all(|p| p.state_abs == 0.0 && p.output_rel == 0.0)));
    let bad = DriftOptions {
        checkpoints: vec![16, 8],
        input: DriftInput::Original,
    };
    assert!(drift(&runner, &model, &other, &seqs[0].ids, &bad).is_err());
}
