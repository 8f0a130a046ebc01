//! Layer weights held on the device ([`DeviceLayerWeights`]) run exactly like host weights, a
//! mismatched set is refused, and gradients reach every tensor through the runner (what
//! `examples/train_fixture.rs` relies on).

use crate::common;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_autodiff::Autodiff;
use common::*;
use sala_model::{
    DeviceLayerWeights, HeadWeights, LayerKind, LayerRunner, LayerSource, LayerWeights, RunOptions,
    SalaConfig, TensorStore,
};

fn open() -> (SalaConfig, TensorStore) {
    let dir = fixtures().join("tiny-sala");
    let config = SalaConfig::from_file(&dir.join("config.json")).unwrap();
    (config, TensorStore::open(&dir).unwrap())
}

/// The layer's tensors in spec order, flattened, on backend `C`.
fn flat_tensors<C: Backend>(config: &SalaConfig, weights: &LayerWeights) -> Vec<Tensor<C, 1>> {
    config
        .layer_tensor_specs(weights.layer)
        .iter()
        .map(|spec| {
            let host = weights.get(&spec.name).unwrap();
            let data = TensorData::new(host.data.clone(), [host.data.len()]);
            Tensor::from_data(data, &Default::default())
        })
        .collect()
}

#[test]
fn device_weights_run_exactly_like_host_weights() {
    let (config, store) = open();
    let runner = LayerRunner::<B>::new(config.clone(), Default::default(), RunOptions::default());
    let ids: Vec<u32> = (1..50).collect();
    let hidden = runner.embed(&store, &ids).unwrap();
    // Layer 0 is minicpm4, layer 1 lightning.
    for layer in [0, 1] {
        let host = LayerWeights::load(&store, &config, layer).unwrap();
        let device = DeviceLayerWeights::new(&config, layer, flat_tensors(&config, &host)).unwrap();
        assert_eq!(LayerSource::<B>::kind(&device), config.layer_kind(layer));
        let expected = runner
            .run_layer(&host, hidden.clone(), |_, _, _| {})
            .unwrap();
        let got = runner
            .run_layer_from(&device, hidden.clone(), |_, _, _| {})
            .unwrap();
        assert_eq!(to_vec(got), to_vec(expected), "layer {layer}");
    }
    let head = HeadWeights::load(&store, &config).unwrap();
    let expected = runner.logits(&head, hidden.clone()).unwrap();
    let got = runner
        .logits_from(
            head.final_norm.to_tensor(&Default::default()),
            head.lm_head.to_tensor(&Default::default()),
            hidden,
        )
        .unwrap();
    assert_eq!(to_vec(got), to_vec(expected));
}

#[test]
fn mismatched_device_weights_are_refused() {
    let (config, store) = open();
    let host = LayerWeights::load(&store, &config, 1).unwrap();
    let tensors = flat_tensors::<B>(&config, &host);

    let mut fewer = tensors.clone();
    fewer.pop();
    let err = DeviceLayerWeights::new(&config, 1, fewer).unwrap_err();
    assert!(err.to_string().contains("tensors"), "{err}");

    let mut wrong = tensors.clone();
    wrong[0] = Tensor::zeros([3], &Default::default());
    let err = DeviceLayerWeights::new(&config, 1, wrong).unwrap_err();
    assert!(err.to_string().contains("input_layernorm"), "{err}");

    let err = DeviceLayerWeights::new(&config, 99, tensors.clone()).unwrap_err();
    assert!(err.to_string().contains("99"), "{err}");

    let device = DeviceLayerWeights::new(&config, 1, tensors).unwrap();
    let name = "model.layers.1.mlp.down_proj.weight";
    let transposed = [config.intermediate_size(), config.hidden_size()];
    let err = device
        .flat_tensor(name, &transposed, &Default::default())
        .unwrap_err();
    assert!(err.to_string().contains("down_proj"), "{err}");
    let err = device
        .flat_tensor("model.layers.1.nope.weight", &[1], &Default::default())
        .unwrap_err();
    assert!(err.to_string().contains("nope"), "{err}");
}

#[test]
fn gradients_reach_every_device_weight() {
    type A = Autodiff<B>;
    let (config, store) = open();
    let layer = 1;
    assert_eq!(config.layer_kind(layer), LayerKind::Lightning);
    let host = LayerWeights::load(&store, &config, layer).unwrap();
    let tensors: Vec<Tensor<A, 1>> = flat_tensors::<A>(&config, &host)
        .into_iter()
        .map(Tensor::require_grad)
        .collect();
    let device = DeviceLayerWeights::new(&config, layer, tensors.clone()).unwrap();
    let runner = LayerRunner::<A>::new(config.clone(), Default::default(), RunOptions::default());
    let hidden = Tensor::<A, 2>::from_inner(random([24, config.hidden_size()]));
    let out = runner
        .run_layer_from(&device, hidden, |_, _, _| {})
        .unwrap();
    let grads = (out.clone() * out).sum().backward();
    for (spec, tensor) in config.layer_tensor_specs(layer).iter().zip(&tensors) {
        let grad = tensor
            .grad(&grads)
            .unwrap_or_else(|| panic!("{}: no gradient", spec.name));
        let largest = to_vec(grad).iter().fold(0f32, |m, g| m.max(g.abs()));
        assert!(
            largest > 0.0 && largest.is_finite(),
            "{}: gradient {largest}",
            spec.name
        );
    }
}
