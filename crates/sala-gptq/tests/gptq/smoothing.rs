//! Function preservation: smoothing every SALA group (random α, random statistics) leaves each
//! layer's output and the full model's logits unchanged up to f32 rounding, in both layer types;
//! a group that forgets a reader (`o_gate`, the original `dense_all` bug) is refused and, folded
//! anyway, visibly changes the layer.

use burn::tensor::{Tensor, TensorData};
use sala_gptq::model::{
    input_groups, LayerKind, LayerRunner, LayerWeights, Numerics, RunOptions, SalaConfig,
    TensorStore,
};
use sala_gptq::smooth::{ScaleRecipe, SmoothError, SmoothGroup};
use sala_gptq::smoothing::{fixed_scales, fold_group, reader_map, smooth_group_of};
use sala_gptq::CpuBackend;
use std::path::PathBuf;

/// Relative tolerance: max |Δ| / max |y|. f32 folding measured ≈ 1e-6 here.
const TOLERANCE: f32 = 1e-4;

fn model() -> (SalaConfig, TensorStore, LayerRunner<CpuBackend>) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-sala");
    let config = SalaConfig::from_file(&dir.join("config.json")).unwrap();
    let store = TensorStore::open(&dir).unwrap();
    let options = RunOptions {
        numerics: Numerics::F32,
        ..RunOptions::default()
    };
    let runner = LayerRunner::new(config.clone(), Default::default(), options);
    (config, store, runner)
}

/// Deterministic pseudo-random numbers in (0, 1).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
}

/// `[rows, channels]` activations uniform in (-√3, √3) (unit variance) from `rng`. Not drawn
/// by the backend's generator: that one is process-wide, and the synthetic runs of this test
/// binary rely on it giving the same weights from the same seed (a draw here between their
/// seeding and their draws changed their weights, a flaky failure).
fn activations(
    rows: usize,
    channels: usize,
    rng: &mut Lcg,
    device: &burn::tensor::Device<CpuBackend>,
) -> Tensor<CpuBackend, 2> {
    let values: Vec<f32> = (0..rows * channels)
        .map(|_| (2.0 * rng.next() - 1.0) * 3f32.sqrt())
        .collect();
    Tensor::from_data(TensorData::new(values, [rows, channels]), device)
}

fn relative_change(a: &Tensor<CpuBackend, 2>, b: &Tensor<CpuBackend, 2>) -> f32 {
    let scale = a.clone().abs().max().into_scalar();
    (a.clone() - b.clone()).abs().max().into_scalar() / scale
}

/// Folds one group with a random α and random positive activation magnitudes.
fn fold_randomly(weights: &mut LayerWeights, group: &SmoothGroup, rng: &mut Lcg) -> Vec<f32> {
    let channels = weights
        .get(&format!("{}.weight", group.targets[0]))
        .unwrap()
        .shape[1];
    let act: Vec<f32> = (0..channels)
        .map(|_| 0.05 + 20.0 * rng.next().powi(3))
        .collect();
    let recipe = ScaleRecipe::original(rng.next());
    fold_group(weights, group, fixed_scales(&recipe, &act))
        .unwrap()
        .expect("a fixed recipe always smooths")
}

#[test]
fn every_group_of_every_layer_preserves_the_layer_output() {
    let (config, store, runner) = model();
    let mut rng = Lcg(7);
    let mut kinds_seen = Vec::new();
    for layer in 0..config.num_layers() {
        let original = LayerWeights::load(&store, &config, layer).unwrap();
        let x = activations(40, config.hidden_size(), &mut rng, runner.device());
        let y = runner
            .run_layer(&original, x.clone(), |_, _, _| {})
            .unwrap();
        for group in input_groups(&config, layer)
            .iter()
            .filter_map(smooth_group_of)
        {
            let mut weights = original.clone();
            let scales = fold_randomly(&mut weights, &group, &mut rng);
            assert!(
                scales.iter().any(|&s| (s - 1.0).abs() > 0.1),
                "a trivial fold proves nothing"
            );
            let z = runner.run_layer(&weights, x.clone(), |_, _, _| {}).unwrap();
            let change = relative_change(&y, &z);
            assert!(
                change < TOLERANCE,
                "layer {layer}, group {:?}: relative change {change}",
                group.source
            );
        }
        kinds_seen.push(config.layer_kind(layer));
    }
    assert!(
        kinds_seen.contains(&LayerKind::Minicpm4) && kinds_seen.contains(&LayerKind::Lightning)
    );
}

#[test]
fn smoothing_every_group_preserves_the_logits() {
    let (config, store, runner) = model();
    let ids: Vec<u32> = (3..60).collect();
    let reference = runner.forward_logits(&store, &ids).unwrap();
    let mut rng = Lcg(11);
    let mut hidden = runner.embed(&store, &ids).unwrap();
    for layer in 0..config.num_layers() {
        let mut weights = LayerWeights::load(&store, &config, layer).unwrap();
        for group in input_groups(&config, layer)
            .iter()
            .filter_map(smooth_group_of)
        {
            fold_randomly(&mut weights, &group, &mut rng);
        }
        hidden = runner.run_layer(&weights, hidden, |_, _, _| {}).unwrap();
    }
    let head = sala_gptq::model::HeadWeights::load(&store, &config).unwrap();
    let logits = runner.logits(&head, hidden).unwrap();
    let change = relative_change(&reference, &logits);
    assert!(change < 10.0 * TOLERANCE, "relative logits change {change}");
}

#[test]
fn forgetting_o_gate_is_refused_and_would_change_the_layer() {
    let (config, store, runner) = model();
    let layer = (0..config.num_layers())
        .find(|&l| config.layer_kind(l) == LayerKind::Minicpm4)
        .unwrap();
    let groups = input_groups(&config, layer);
    let p = format!("model.layers.{layer}");
    // The original dense_all script's group: q, k, v (and z_proj, absent here) but not o_gate.
    let buggy = SmoothGroup::norm(
        &format!("{p}.input_layernorm"),
        &[
            &format!("{p}.self_attn.q_proj"),
            &format!("{p}.self_attn.k_proj"),
            &format!("{p}.self_attn.v_proj"),
        ],
    );
    let err = buggy.validate(&reader_map(&groups)).unwrap_err();
    assert!(
        matches!(err, SmoothError::MissingReader { ref linear, .. } if linear.ends_with("o_gate")),
        "{err}"
    );
    // Folded anyway, the layer computes something else: the test above would catch it.
    let original = LayerWeights::load(&store, &config, layer).unwrap();
    let x = activations(40, config.hidden_size(), &mut Lcg(5), runner.device());
    let y = runner
        .run_layer(&original, x.clone(), |_, _, _| {})
        .unwrap();
    let mut weights = original.clone();
    fold_randomly(&mut weights, &buggy, &mut Lcg(3));
    let z = runner.run_layer(&weights, x, |_, _, _| {}).unwrap();
    assert!(relative_change(&y, &z) > 100.0 * TOLERANCE);
}
