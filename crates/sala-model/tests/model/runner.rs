//! The layer runner: taps, weight replacement, dense mode, numerics, end to end.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::Tensor;
use common::*;
use sala_model::ops::norm::rms_norm;
use sala_model::{
    AttentionMode, CpuFastOps, FastOps, LayerKind, LayerRunner, LayerWeights, ModelError, Numerics,
    ProfiledOps, RowRun, RunOptions, SalaConfig, TensorStore, HOST_EMBED_TOKENS,
};
use std::sync::Arc;

fn open(name: &str) -> (SalaConfig, TensorStore) {
    let dir = fixtures().join(name);
    let config = SalaConfig::from_file(&dir.join("config.json")).unwrap();
    (config, TensorStore::open(&dir).unwrap())
}

fn ids(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 1 + (i * 37) % 2000).collect()
}

fn run_with_taps(
    runner: &LayerRunner<B>,
    weights: &LayerWeights,
    hidden: Tensor<B, 2>,
) -> (Tensor<B, 2>, Vec<String>, BTreeMap<String, Tensor<B, 2>>) {
    let mut order = Vec::new();
    let mut inputs = BTreeMap::new();
    let out = runner
        .run_layer(weights, hidden, |name, x, _| {
            order.push(name.to_owned());
            inputs.insert(name.to_owned(), x.clone());
        })
        .unwrap();
    (out, order, inputs)
}

fn zero(weights: &mut LayerWeights, linear: &str) {
    let name = format!("model.layers.{}.{linear}.weight", weights.layer);
    weights.get_mut(&name).unwrap().data.fill(0.0);
}

fn weight(weights: &LayerWeights, linear: &str) -> Tensor<B, 2> {
    let name = format!("model.layers.{}.{linear}.weight", weights.layer);
    weights.get(&name).unwrap().to_tensor(&Default::default())
}

fn norm_weight(weights: &LayerWeights, norm: &str) -> Tensor<B, 1> {
    let name = format!("model.layers.{}.{norm}.weight", weights.layer);
    weights.get(&name).unwrap().to_tensor(&Default::default())
}

fn assert_close(a: Tensor<B, 2>, b: Tensor<B, 2>, what: &str) {
    let (a, b) = (to_vec(a), to_vec(b));
    let err = max_abs_diff(&a, &b);
    assert!(
        err <= 1e-5 * max_abs(&b).max(1.0),
        "{what}: max error {err}"
    );
}

/// Every linear is tapped once, in forward order, and the tapped tensor is the one the layer
/// multiplies. Inputs of q/k/v/gates and gate/up are checked against the RMSNorm of the known
/// residual; o_proj and down_proj through the layer's linearity in their weights: zeroing
/// `down_proj` removes exactly `rs · x_down W_downᵀ` from the output, and zeroing `o_proj` too
/// leaves the input unchanged.
fn check_taps(model: &str, layer: usize) {
    let (config, store) = open(model);
    let runner = LayerRunner::<B>::new(config.clone(), Default::default(), RunOptions::default());
    let hidden = runner.embed(&store, &ids(40)).unwrap();
    let weights = LayerWeights::load(&store, &config, layer).unwrap();
    let (out, order, taps) = run_with_taps(&runner, &weights, hidden.clone());
    let expected: Vec<String> = config
        .linear_specs(layer)
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(order, expected);

    let eps = config.rms_norm_eps();
    let normed_in = rms_norm(
        hidden.clone(),
        norm_weight(&weights, "input_layernorm"),
        eps,
        Numerics::F32,
    );
    for spec in config.linear_specs(layer) {
        let x = &taps[&spec.name];
        assert_eq!(x.dims()[1], spec.in_features, "{}", spec.name);
        let reads_layer_input = ["q_proj", "k_proj", "v_proj", "o_gate", "z_proj"]
            .iter()
            .any(|p| spec.name.ends_with(p));
        if reads_layer_input {
            assert_close(x.clone(), normed_in.clone(), &spec.name);
        }
    }

    let rs = config.residual_scale();
    let mut no_down = weights.clone();
    zero(&mut no_down, "mlp.down_proj");
    let (mid, _, _) = run_with_taps(&runner, &no_down, hidden.clone());
    let down_x = taps[&expected[expected.len() - 1]].clone();
    let down_y = down_x
        .matmul(weight(&weights, "mlp.down_proj").transpose())
        .mul_scalar(rs);
    assert_close(out - mid.clone(), down_y, "down_proj");
    let normed_post = rms_norm(
        mid.clone(),
        norm_weight(&weights, "post_attention_layernorm"),
        eps,
        Numerics::F32,
    );
    for name in ["gate_proj", "up_proj"] {
        assert_close(
            taps[&format!("model.layers.{layer}.mlp.{name}")].clone(),
            normed_post.clone(),
            name,
        );
    }

    let o_x = taps[&format!("model.layers.{layer}.self_attn.o_proj")].clone();
    let o_y = o_x
        .matmul(weight(&weights, "self_attn.o_proj").transpose())
        .mul_scalar(rs);
    assert_close(mid.clone() - hidden.clone(), o_y, "o_proj");
    let mut no_attn = no_down;
    zero(&mut no_attn, "self_attn.o_proj");
    let (unchanged, _, _) = run_with_taps(&runner, &no_attn, hidden.clone());
    assert_eq!(to_vec(unchanged), to_vec(hidden));
}

#[test]
fn taps_see_the_inputs_of_a_minicpm4_layer() {
    check_taps("tiny-sala", 0);
}

#[test]
fn taps_see_the_inputs_of_a_lightning_layer() {
    check_taps("tiny-sala", 1);
}

#[test]
fn taps_see_the_inputs_of_a_llama_layer() {
    check_taps("tiny-llama", 2);
}

fn config_with_dense_len(dense_len: usize) -> SalaConfig {
    let path = fixtures().join("tiny-sala/config.json");
    let mut value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    value["sparse_config"]["dense_len"] = dense_len.into();
    SalaConfig::from_json_str(&value.to_string(), Path::new("edited/config.json")).unwrap()
}

#[test]
fn minicpm4_layer_refuses_long_sequences_unless_dense_mode() {
    let (_, store) = open("tiny-sala");
    let config = config_with_dense_len(16);
    let strict = LayerRunner::<B>::new(config.clone(), Default::default(), RunOptions::default());
    let hidden = strict.embed(&store, &ids(16)).unwrap();
    let sparse_layer = LayerWeights::load(&store, &config, 0).unwrap();
    let err = strict
        .run_layer(&sparse_layer, hidden.clone(), |_, _, _| {})
        .unwrap_err();
    assert!(matches!(
        err,
        ModelError::SparseAttentionRequired {
            layer: 0,
            tokens: 16,
            dense_len: 16
        }
    ));
    // One token fewer is dense under the config's own rule; lightning layers never care.
    let shorter = strict.embed(&store, &ids(15)).unwrap();
    strict
        .run_layer(&sparse_layer, shorter, |_, _, _| {})
        .unwrap();
    let lightning = LayerWeights::load(&store, &config, 1).unwrap();
    strict
        .run_layer(&lightning, hidden.clone(), |_, _, _| {})
        .unwrap();
    let options = RunOptions {
        attention: AttentionMode::Dense,
        ..RunOptions::default()
    };
    let dense = LayerRunner::<B>::new(config, Default::default(), options);
    let out = dense
        .run_layer(&sparse_layer, hidden, |_, _, _| {})
        .unwrap();
    assert!(to_vec(out).iter().all(|v| v.is_finite()));
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let (config, store) = open("tiny-sala");
    let runner = LayerRunner::<B>::new(config.clone(), Default::default(), RunOptions::default());
    assert!(runner.embed(&store, &[]).is_err());
    let weights = LayerWeights::load(&store, &config, 1).unwrap();
    let err = runner
        .run_layer(&weights, random([4, 100]), |_, _, _| {})
        .unwrap_err();
    assert!(err.to_string().contains("[4, 100]"), "{err}");
    let mut broken = weights.clone();
    broken
        .get_mut("model.layers.1.self_attn.q_proj.weight")
        .unwrap()
        .data
        .pop();
    let err = runner
        .run_layer(&broken, random([4, 256]), |_, _, _| {})
        .unwrap_err();
    assert!(err.to_string().contains("q_proj"), "{err}");
    assert!(LayerWeights::load(&store, &config, 8).is_err());
}

/// The whole model runs; bf16 rounding changes logits only by bf16-sized amounts, and under
/// `Bf16Rounding` every logit is a bf16 value.
#[test]
fn end_to_end_logits_in_both_numerics() {
    let (config, store) = open("tiny-sala");
    let tokens = ids(24);
    let run = |numerics| {
        let options = RunOptions {
            numerics,
            ..RunOptions::default()
        };
        let runner = LayerRunner::<B>::new(config.clone(), Default::default(), options);
        to_vec(runner.forward_logits(&store, &tokens).unwrap())
    };
    let exact = run(Numerics::F32);
    let rounded = run(Numerics::Bf16Rounding);
    assert_eq!(exact.len(), tokens.len() * config.vocab_size());
    assert!(exact.iter().all(|v| v.is_finite()));
    assert!(rounded
        .iter()
        .all(|&v| half::bf16::from_f32(v).to_f32() == v));
    let err = max_abs_diff(&exact, &rounded);
    // bf16 has 8 significant bits (relative step 2^-8 ≈ 0.4%); after 8 layers a few steps.
    assert!(
        err > 0.0 && err < 0.1 * max_abs(&exact),
        "max difference {err}"
    );
}

/// The GLA inputs exposed for the drift study are the ones the layer uses: the recurrence
/// reference on them, `o_norm` and the `z_proj` gate reproduce the tapped input of `o_proj`.
#[test]
fn lightning_gla_inputs_reproduce_the_layer() {
    let (config, store) = open("tiny-sala");
    let runner = LayerRunner::<B>::new(config.clone(), Default::default(), RunOptions::default());
    let layer = 1;
    let hidden = runner.embed(&store, &ids(24)).unwrap();
    let weights = LayerWeights::load(&store, &config, layer).unwrap();
    let (_, _, taps) = run_with_taps(&runner, &weights, hidden.clone());
    let [q, k, v] = runner.lightning_gla_inputs(&weights, hidden).unwrap();
    let [tokens, heads, d] = q.dims();
    assert_eq!([tokens, heads, d], [24, 4, 64]);
    let out = sala_model::ops::gla::recurrent_reference(
        &to_vec(q),
        &to_vec(k),
        &to_vec(v),
        tokens,
        heads,
        d,
        &sala_model::ops::gla::log_decays(heads),
    );
    let normed = rms_norm(
        from_vec(out, [tokens, heads * d]),
        norm_weight(&weights, "self_attn.o_norm"),
        config.rms_norm_eps(),
        Numerics::F32,
    );
    let z_in = taps[&format!("model.layers.{layer}.self_attn.z_proj")].clone();
    let gate = burn::tensor::activation::sigmoid(
        z_in.matmul(weight(&weights, "self_attn.z_proj").transpose()),
    );
    let o_in = taps[&format!("model.layers.{layer}.self_attn.o_proj")].clone();
    assert_close(normed * gate, o_in, "o_proj input");
}

#[test]
fn lightning_gla_inputs_refuse_other_layers() {
    let (config, store) = open("tiny-sala");
    let runner = LayerRunner::<B>::new(config.clone(), Default::default(), RunOptions::default());
    let hidden = runner.embed(&store, &ids(8)).unwrap();
    let weights = LayerWeights::load(&store, &config, 0).unwrap();
    assert!(matches!(
        runner.lightning_gla_inputs(&weights, hidden),
        Err(ModelError::InvalidInput(_))
    ));
}

/// A pack runs every sequence as if it ran alone: each layer kind (minicpm4 attention,
/// lightning GLA with RoPE, Llama attention with RoPE), sequences of unequal and equal
/// lengths (equal neighbours share one batched GLA), the taps seeing the inputs stacked, and
/// the capture-only pass tapping the same inputs. A one-sequence pack is the plain run.
fn check_pack(model: &str, layer: usize) {
    let (config, store) = open(model);
    let runner = LayerRunner::<B>::new(config.clone(), Default::default(), RunOptions::default());
    let weights = LayerWeights::load(&store, &config, layer).unwrap();
    let lengths = [13, 7, 7, 1, 20];
    let sequences: Vec<Tensor<B, 2>> = lengths
        .iter()
        .enumerate()
        .map(|(s, &n)| {
            let seq: Vec<u32> = ids(n + s).into_iter().skip(s).collect();
            runner.embed(&store, &seq).unwrap()
        })
        .collect();
    let pack = Tensor::cat(sequences.clone(), 0);
    let mut pack_taps = BTreeMap::new();
    let packed = runner
        .run_pack_from(&weights, pack.clone(), &lengths, |name, x, _| {
            pack_taps.insert(name.to_owned(), x.clone());
        })
        .unwrap();
    let mut start = 0;
    let mut alone_taps: BTreeMap<String, Vec<Tensor<B, 2>>> = BTreeMap::new();
    for (seq, &n) in sequences.iter().zip(&lengths) {
        let (alone, _, taps) = run_with_taps(&runner, &weights, seq.clone());
        let rows = packed
            .clone()
            .slice([start..start + n, 0..config.hidden_size()]);
        assert_close(
            rows,
            alone,
            &format!("{model} layer {layer}: rows {start}.."),
        );
        for (name, x) in taps {
            alone_taps.entry(name).or_default().push(x);
        }
        start += n;
    }
    assert_eq!(pack_taps.len(), alone_taps.len());
    for (name, parts) in alone_taps {
        assert_close(pack_taps[&name].clone(), Tensor::cat(parts, 0), &name);
    }
    let mut captured = BTreeMap::new();
    runner
        .capture_pack_from(&weights, pack, &lengths, |name, x, _| {
            captured.insert(name.to_owned(), x.clone());
        })
        .unwrap();
    assert_eq!(
        captured.keys().collect::<Vec<_>>(),
        pack_taps.keys().collect::<Vec<_>>()
    );
    for (name, x) in captured {
        assert_close(x, pack_taps[&name].clone(), &format!("capture {name}"));
    }
    let single = runner
        .run_pack_from(&weights, sequences[0].clone(), &lengths[..1], |_, _, _| {})
        .unwrap();
    let plain = runner
        .run_layer(&weights, sequences[0].clone(), |_, _, _| {})
        .unwrap();
    assert_eq!(to_vec(single), to_vec(plain));
}

#[test]
fn packs_run_each_sequence_as_alone_in_every_layer_kind() {
    check_pack("tiny-sala", 0);
    check_pack("tiny-sala", 1);
    check_pack("tiny-llama", 0);
}

/// An MLP run in chunks of rows (`RunOptions::mlp_rows`, chunks cutting through the pack's
/// sequences) gives the output of the whole pack at once, and `down_proj`'s taps, one per
/// chunk in order with the rows they hold, stack up to the whole pack's tap; the capture-only
/// pass taps the same chunks.
#[test]
fn a_chunked_mlp_gives_the_whole_packs_output_and_taps() {
    let (config, store) = open("tiny-sala");
    let whole = LayerRunner::<B>::new(config.clone(), Default::default(), RunOptions::default());
    let chunked = LayerRunner::<B>::new(
        config.clone(),
        Default::default(),
        RunOptions {
            mlp_rows: Some(8),
            ..RunOptions::default()
        },
    );
    let lengths = [13, 7, 1];
    let pack = whole.embed(&store, &ids(21)).unwrap();
    let down = |layer: usize| format!("model.layers.{layer}.mlp.down_proj");
    for layer in [0, 1] {
        let weights = LayerWeights::load(&store, &config, layer).unwrap();
        let mut full_tap = None;
        let expected = whole
            .run_pack_from(&weights, pack.clone(), &lengths, |name, x, rows| {
                if name == down(layer) {
                    assert_eq!(rows, 0..21);
                    full_tap = Some(x.clone());
                }
            })
            .unwrap();
        let (mut parts, mut seen) = (Vec::new(), Vec::new());
        let out = chunked
            .run_pack_from(&weights, pack.clone(), &lengths, |name, x, rows| {
                if name == down(layer) {
                    assert_eq!(x.dims()[0], rows.len());
                    seen.push(rows);
                    parts.push(x.clone());
                }
            })
            .unwrap();
        assert_eq!(seen, vec![0..8, 8..16, 16..21]);
        assert_close(out, expected, &format!("layer {layer} output"));
        assert_close(
            Tensor::cat(parts, 0),
            full_tap.unwrap(),
            &format!("layer {layer} down_proj tap"),
        );
        let mut captured = Vec::new();
        chunked
            .capture_pack_from(&weights, pack.clone(), &lengths, |name, _, rows| {
                if name == down(layer) {
                    captured.push(rows);
                }
            })
            .unwrap();
        assert_eq!(captured, seen);
    }
}

#[test]
fn pack_lengths_must_split_the_rows() {
    let (config, store) = open("tiny-sala");
    let runner = LayerRunner::<B>::new(config.clone(), Default::default(), RunOptions::default());
    let weights = LayerWeights::load(&store, &config, 0).unwrap();
    let hidden = runner.embed(&store, &ids(10)).unwrap();
    for lengths in [&[4, 5][..], &[10, 0], &[], &[11]] {
        let err = runner
            .run_pack_from(&weights, hidden.clone(), lengths, |_, _, _| {})
            .unwrap_err();
        assert!(
            err.to_string().contains("do not split a pack of 10"),
            "{err}"
        );
    }
}

/// The embedding gathered on the device from the uploaded table is the host lookup, bit for
/// bit, in every numerics the CPU backend runs; bad ids are errors.
#[test]
fn embedding_on_the_device_equals_the_host_lookup() {
    for model in ["tiny-sala", "tiny-llama"] {
        let (config, store) = open(model);
        for numerics in [Numerics::F32, Numerics::Bf16Rounding] {
            let options = RunOptions {
                numerics,
                ..RunOptions::default()
            };
            let runner = LayerRunner::<B>::new(config.clone(), Default::default(), options);
            let table = runner.upload_embedding(&store).unwrap();
            assert_eq!(table.vocab(), config.vocab_size());
            // Every id of the vocabulary's ends, repeated ids, and a long mixed sequence.
            let last = config.vocab_size() as u32 - 1;
            let mut tokens = vec![0, last, 1, last, 0, 0];
            tokens.extend(ids(300));
            let host = to_vec(runner.embed(&store, &tokens).unwrap());
            let device = to_vec(runner.embed_on_device(&table, &tokens).unwrap());
            assert_eq!(host.len(), tokens.len() * config.hidden_size());
            let same = host
                .iter()
                .zip(&device)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{model} {numerics:?}: device lookup differs");
            assert!(runner.embed_on_device(&table, &[]).is_err());
            let err = runner
                .embed_on_device(&table, &[1, last + 1])
                .unwrap_err()
                .to_string();
            assert!(err.contains(&format!("token id {}", last + 1)), "{err}");
        }
    }
}

/// The bf16 embedding written on the host is the graph's embedding rounded to bf16, bit for
/// bit, in every numerics the CPU backend runs, across several parallel tasks; a wrong
/// destination, no ids and bad ids are errors.
#[test]
fn embedding_in_bf16_on_the_host_equals_the_graph_rounded() {
    use half::bf16;
    for model in ["tiny-sala", "tiny-llama"] {
        let (config, store) = open(model);
        let hidden = config.hidden_size();
        for numerics in [Numerics::F32, Numerics::Bf16Rounding] {
            let options = RunOptions {
                numerics,
                ..RunOptions::default()
            };
            let runner = LayerRunner::<B>::new(config.clone(), Default::default(), options);
            let last = config.vocab_size() as u32 - 1;
            let mut tokens = vec![0, last, 1, last];
            tokens.extend(ids(2 * HOST_EMBED_TOKENS + 77));
            let want: Vec<bf16> = to_vec(runner.embed(&store, &tokens).unwrap())
                .into_iter()
                .map(bf16::from_f32)
                .collect();
            let mut got = vec![bf16::NAN; tokens.len() * hidden];
            runner.embed_bf16_into(&store, &tokens, &mut got).unwrap();
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{model} {numerics:?}: host embedding differs");
            let mut short = vec![bf16::ZERO; hidden];
            let err = runner
                .embed_bf16_into(&store, &[1, 2], &mut short)
                .unwrap_err();
            assert!(err.to_string().contains("2 tokens"), "{err}");
            assert!(runner.embed_bf16_into(&store, &[], &mut []).is_err());
            let mut two = vec![bf16::ZERO; 2 * hidden];
            let err = runner
                .embed_bf16_into(&store, &[1, last + 1], &mut two)
                .unwrap_err();
            assert!(
                err.to_string().contains(&format!("token id {}", last + 1)),
                "{err}"
            );
        }
    }
}

/// Profiled fast ops compute what the fast ops compute, bit for bit, and time each op they
/// answer only while the profile is on: a lightning and a minicpm4 layer on a pack, the
/// capture pass's Hessian products included.
#[test]
fn profiled_ops_give_the_same_layer_and_count_each_op() {
    let (config, store) = open("tiny-sala");
    let cpu: Arc<dyn FastOps<B>> = Arc::new(CpuFastOps::new(Numerics::Bf16Rounding));
    let profiled = Arc::new(ProfiledOps::new(cpu.clone()));
    let options = RunOptions {
        numerics: Numerics::Bf16Rounding,
        ..RunOptions::default()
    };
    let plain = LayerRunner::<B>::new(config.clone(), Default::default(), options)
        .with_fast_ops(cpu.clone());
    let timed = LayerRunner::<B>::new(config.clone(), Default::default(), options)
        .with_fast_ops(profiled.clone());
    let profile = timed.fast_ops().and_then(|f| f.profile()).unwrap();
    let lengths = [9, 4, 4];
    let pack = plain.embed(&store, &ids(17)).unwrap();
    for layer in [0, 1] {
        let weights = LayerWeights::load(&store, &config, layer).unwrap();
        let want = plain
            .run_pack_from(&weights, pack.clone(), &lengths, |_, _, _| {})
            .unwrap();
        // Off: nothing is counted.
        let got = timed
            .run_pack_from(&weights, pack.clone(), &lengths, |_, _, _| {})
            .unwrap();
        assert_eq!(to_vec(got), to_vec(want.clone()), "layer {layer}, off");
        assert!(
            profile.take().is_empty(),
            "layer {layer}: counted while off"
        );
        profile.set_enabled(true);
        let got = timed
            .run_pack_from(&weights, pack.clone(), &lengths, |_, _, _| {})
            .unwrap();
        let mut grams = 0;
        timed
            .capture_pack_from(&weights, pack.clone(), &lengths, |_, x, _| {
                let dim = x.dims()[1];
                let h = Tensor::<B, 2>::zeros([dim, dim], &Default::default());
                let runs = [RowRun {
                    rows: x.dims()[0],
                    weight: 1.0,
                }];
                profiled.accumulate_gram(h, x, &runs).unwrap();
                grams += 1;
            })
            .unwrap();
        profile.set_enabled(false);
        assert_eq!(to_vec(got), to_vec(want), "layer {layer}, on");
        let totals = profile.take();
        let calls = |op: &str| totals.iter().find(|t| t.op == op).map_or(0, |t| t.calls);
        let linears = config.linear_specs(layer).len() as u64;
        // The propagate pass runs every linear, the capture pass all but down_proj.
        assert_eq!(
            calls("linear"),
            2 * linears - 1,
            "layer {layer}: {totals:?}"
        );
        assert_eq!(calls("accumulate_gram"), grams, "layer {layer}");
        let mixer = match config.layer_kind(layer) {
            LayerKind::Lightning => "simple_gla",
            _ => "causal_attention",
        };
        assert_eq!(calls(mixer), 2, "layer {layer}: {totals:?}");
        assert!(totals.iter().all(|t| t.seconds >= 0.0 && t.calls > 0));
        assert!(profile.take().is_empty(), "take starts afresh");
    }
}

/// Fast ops that answer host uploads themselves (or, with `answer` off, leave them to burn's
/// `from_data`), counting the bytes they were handed; every other op is the graph's.
#[derive(Debug)]
struct HostUploads {
    answer: bool,
    fail: bool,
    calls: std::sync::atomic::AtomicUsize,
    bytes: std::sync::atomic::AtomicUsize,
}

impl HostUploads {
    fn new(answer: bool, fail: bool) -> Self {
        Self {
            answer,
            fail,
            calls: Default::default(),
            bytes: Default::default(),
        }
    }
}

impl FastOps<B> for HostUploads {
    fn causal_attention(
        &self,
        q: Tensor<B, 3>,
        k: Tensor<B, 3>,
        v: Tensor<B, 3>,
        lengths: &[usize],
        scale: f32,
    ) -> sala_model::Result<Tensor<B, 3>> {
        CpuFastOps::new(Numerics::F32).causal_attention(q, k, v, lengths, scale)
    }

    fn upload_host(
        &self,
        bytes: &[u8],
        dtype: burn::tensor::DType,
        device: &burn_ndarray::NdArrayDevice,
    ) -> sala_model::Result<Option<Tensor<B, 1>>> {
        use std::sync::atomic::Ordering::Relaxed;
        self.calls.fetch_add(1, Relaxed);
        self.bytes.fetch_add(bytes.len(), Relaxed);
        if self.fail {
            return Err(ModelError::InvalidInput("the upload failed".into()));
        }
        let len = bytes.len() / dtype.size();
        Ok(self.answer.then(|| {
            let data = burn::tensor::TensorData::from_bytes_vec(bytes.to_vec(), [len], dtype);
            Tensor::from_data(data, (device, dtype))
        }))
    }
}

/// A layer's weights and the embedding table go up through `FastOps::upload_host` where the fast
/// ops answer it, every byte of them once, and the layer computes the same outputs bit for bit
/// as with burn's own upload; a failed upload is the runner's error.
#[test]
fn uploads_go_through_the_fast_ops_and_change_nothing() {
    use std::sync::atomic::Ordering::Relaxed;
    let (config, store) = open("tiny-sala");
    let runner = |ops: &Arc<HostUploads>| {
        let ops: Arc<dyn FastOps<B>> = ops.clone();
        LayerRunner::<B>::new(config.clone(), Default::default(), RunOptions::default())
            .with_fast_ops(ops)
    };
    let (answering, declining) = (
        Arc::new(HostUploads::new(true, false)),
        Arc::new(HostUploads::new(false, false)),
    );
    let (fast, plain) = (runner(&answering), runner(&declining));
    let lengths = [6, 5];
    let pack = plain.embed(&store, &ids(11)).unwrap();
    for layer in 0..config.num_layers() {
        let weights = LayerWeights::load(&store, &config, layer).unwrap();
        let values: usize = weights.tensors.values().map(|t| t.data.len()).sum();
        let before = answering.bytes.load(Relaxed);
        let on_fast = fast.upload(&weights).unwrap();
        assert_eq!(answering.bytes.load(Relaxed) - before, 4 * values);
        let want = plain
            .run_pack_from(
                &plain.upload(&weights).unwrap(),
                pack.clone(),
                &lengths,
                |_, _, _| {},
            )
            .unwrap();
        let got = fast
            .run_pack_from(&on_fast, pack.clone(), &lengths, |_, _, _| {})
            .unwrap();
        assert_eq!(to_vec(got), to_vec(want), "layer {layer}");
    }
    let calls = answering.calls.load(Relaxed);
    assert_eq!(calls, declining.calls.load(Relaxed), "both were asked");
    let table = fast.upload_embedding(&store).unwrap();
    assert!(
        answering.calls.load(Relaxed) > calls,
        "the embedding went up too"
    );
    let tokens = ids(9);
    assert_eq!(
        to_vec(fast.embed_on_device(&table, &tokens).unwrap()),
        to_vec(plain.embed(&store, &tokens).unwrap())
    );
    let failing = runner(&Arc::new(HostUploads::new(true, true)));
    let weights = LayerWeights::load(&store, &config, 0).unwrap();
    let err = failing.upload(&weights).unwrap_err().to_string();
    assert!(err.contains("the upload failed"), "{err}");

    // Profiled, each answered upload is an op of its own (one per tensor of the layer);
    // declined ones are not counted.
    for (ops, counted) in [(answering, weights.tensors.len() as u64), (declining, 0)] {
        let inner: Arc<dyn FastOps<B>> = ops;
        let profiled: Arc<dyn FastOps<B>> = Arc::new(ProfiledOps::new(inner).switched_on());
        let timed =
            LayerRunner::<B>::new(config.clone(), Default::default(), RunOptions::default())
                .with_fast_ops(profiled);
        timed.upload(&weights).unwrap();
        let totals = timed.fast_ops().and_then(|f| f.profile()).unwrap().take();
        let calls = totals
            .iter()
            .find(|t| t.op == "upload_host")
            .map_or(0, |t| t.calls);
        assert_eq!(calls, counted, "{totals:?}");
    }
}

/// CPU fast ops that answer the grouped calls (`linears`, `gated_causal_attention`,
/// `linear_residual`) by the single ops they replace, recording each, or decline them
/// (`answer` false): the runner's two routes through a layer.
#[derive(Debug)]
struct Grouping {
    inner: CpuFastOps,
    answer: bool,
    /// The grouped calls answered, in call order.
    calls: std::sync::Mutex<Vec<Grouped>>,
}

/// One call [`Grouping`] answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Grouped {
    /// `linears` with this many weights.
    Linears(usize),
    /// `gated_causal_attention`.
    GatedAttention,
    /// `linear_residual` with a weight of this shape.
    LinearResidual([usize; 2]),
}

impl Grouping {
    fn new(answer: bool) -> Self {
        Self {
            inner: CpuFastOps::new(Numerics::Bf16Rounding),
            answer,
            calls: Default::default(),
        }
    }
}

impl FastOps<B> for Grouping {
    fn causal_attention(
        &self,
        q: Tensor<B, 3>,
        k: Tensor<B, 3>,
        v: Tensor<B, 3>,
        lengths: &[usize],
        scale: f32,
    ) -> sala_model::Result<Tensor<B, 3>> {
        self.inner.causal_attention(q, k, v, lengths, scale)
    }

    fn gated_causal_attention(
        &self,
        q: &Tensor<B, 3>,
        k: &Tensor<B, 3>,
        v: &Tensor<B, 3>,
        lengths: &[usize],
        scale: f32,
        gate: &Tensor<B, 2>,
    ) -> sala_model::Result<Option<Tensor<B, 2>>> {
        if !self.answer {
            return Ok(None);
        }
        self.calls.lock().unwrap().push(Grouped::GatedAttention);
        let [tokens, heads, d] = q.dims();
        let att = self
            .inner
            .causal_attention(q.clone(), k.clone(), v.clone(), lengths, scale)?
            .reshape([tokens, heads * d]);
        let att = Numerics::Bf16Rounding.round(att);
        self.inner.sigmoid_gate(&att, gate)
    }

    fn linear(
        &self,
        x: &Tensor<B, 2>,
        w: &Tensor<B, 2>,
    ) -> sala_model::Result<Option<Tensor<B, 2>>> {
        self.inner.linear(x, w)
    }

    fn linears(
        &self,
        x: &Tensor<B, 2>,
        ws: &[&Tensor<B, 2>],
    ) -> sala_model::Result<Option<Vec<Tensor<B, 2>>>> {
        if !self.answer {
            return Ok(None);
        }
        self.calls.lock().unwrap().push(Grouped::Linears(ws.len()));
        ws.iter().map(|w| self.inner.linear(x, w)).collect()
    }

    fn linear_residual(
        &self,
        hidden: &Tensor<B, 2>,
        x: &Tensor<B, 2>,
        w: &Tensor<B, 2>,
        scale: f64,
    ) -> sala_model::Result<Option<Tensor<B, 2>>> {
        if !self.answer {
            return Ok(None);
        }
        self.calls
            .lock()
            .unwrap()
            .push(Grouped::LinearResidual(w.dims()));
        let branch = self.inner.linear(x, w)?.expect("CPU linears answer");
        self.inner.scaled_residual(hidden, &branch, scale)
    }

    fn swiglu(
        &self,
        gate: &Tensor<B, 2>,
        up: &Tensor<B, 2>,
    ) -> sala_model::Result<Option<Tensor<B, 2>>> {
        self.inner.swiglu(gate, up)
    }

    fn sigmoid_gate(
        &self,
        x: &Tensor<B, 2>,
        gate: &Tensor<B, 2>,
    ) -> sala_model::Result<Option<Tensor<B, 2>>> {
        self.inner.sigmoid_gate(x, gate)
    }

    fn rms_norm(
        &self,
        x: &Tensor<B, 2>,
        weight: &Tensor<B, 1>,
        eps: f64,
    ) -> sala_model::Result<Option<Tensor<B, 2>>> {
        self.inner.rms_norm(x, weight, eps)
    }

    fn scaled_residual(
        &self,
        hidden: &Tensor<B, 2>,
        branch: &Tensor<B, 2>,
        scale: f64,
    ) -> sala_model::Result<Option<Tensor<B, 2>>> {
        self.inner.scaled_residual(hidden, branch, scale)
    }

    fn rope(
        &self,
        x: &Tensor<B, 3>,
        cos: &Tensor<B, 2>,
        sin: &Tensor<B, 2>,
        lengths: &[usize],
    ) -> sala_model::Result<Option<Tensor<B, 3>>> {
        self.inner.rope(x, cos, sin, lengths)
    }

    fn rms_norm_rope(
        &self,
        x: &Tensor<B, 3>,
        weight: &Tensor<B, 1>,
        eps: f64,
        cos: &Tensor<B, 2>,
        sin: &Tensor<B, 2>,
        lengths: &[usize],
    ) -> sala_model::Result<Option<Tensor<B, 3>>> {
        self.inner.rms_norm_rope(x, weight, eps, cos, sin, lengths)
    }

    fn simple_gla(
        &self,
        q: &Tensor<B, 3>,
        k: &Tensor<B, 3>,
        v: &Tensor<B, 3>,
        lengths: &[usize],
        log_decays: &[f64],
        scale: f32,
    ) -> sala_model::Result<Option<Tensor<B, 2>>> {
        self.inner.simple_gla(q, k, v, lengths, log_decays, scale)
    }
}

/// Where the fast ops take the grouped calls, the runner makes them: one `linears` for q, k, v
/// (and the minicpm4 output gate), one for the MLP's gate and up, for minicpm4 one gated
/// attention, and `o_proj` and `down_proj` each with its residual add; the layer's output and
/// its taps are those of the single ops, bit for bit.
#[test]
fn grouped_linears_and_the_gated_attention_change_nothing() {
    let (config, store) = open("tiny-sala");
    let options = RunOptions {
        numerics: Numerics::Bf16Rounding,
        ..RunOptions::default()
    };
    let runner = |ops: &Arc<Grouping>| {
        let ops: Arc<dyn FastOps<B>> = ops.clone();
        LayerRunner::<B>::new(config.clone(), Default::default(), options).with_fast_ops(ops)
    };
    let (answering, declining) = (
        Arc::new(Grouping::new(true)),
        Arc::new(Grouping::new(false)),
    );
    let (grouped, single) = (runner(&answering), runner(&declining));
    let lengths = [9, 4, 4];
    let pack = single.embed(&store, &ids(17)).unwrap();
    let mut kinds = std::collections::BTreeSet::new();
    for layer in 0..config.num_layers() {
        let weights = LayerWeights::load(&store, &config, layer).unwrap();
        let run = |r: &LayerRunner<B>| {
            let mut taps = Vec::new();
            let out = r
                .run_pack_from(&weights, pack.clone(), &lengths, |name, x, _| {
                    taps.push((name.to_owned(), to_vec(x.clone())))
                })
                .unwrap();
            (to_vec(out), taps)
        };
        let (want, want_taps) = run(&single);
        let (got, got_taps) = run(&grouped);
        let differing = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert!(
            got.len() == want.len() && differing == 0,
            "layer {layer}: {differing} of {} outputs differ",
            want.len()
        );
        let names =
            |taps: &[(String, Vec<f32>)]| taps.iter().map(|t| t.0.clone()).collect::<Vec<_>>();
        assert_eq!(names(&got_taps), names(&want_taps), "layer {layer}: taps");
        assert!(
            got_taps == want_taps,
            "layer {layer}: a tapped input differs"
        );
        let calls = std::mem::take(&mut *answering.calls.lock().unwrap());
        let (hidden, inter) = (config.hidden_size(), config.intermediate_size());
        let o_proj_name = format!("model.layers.{layer}.self_attn.o_proj.weight");
        let o_width = weights.get(&o_proj_name).unwrap().shape[1];
        let (o_proj, down) = (
            Grouped::LinearResidual([hidden, o_width]),
            Grouped::LinearResidual([hidden, inter]),
        );
        let expected = match weights.kind {
            LayerKind::Minicpm4 => vec![
                Grouped::Linears(4),
                Grouped::GatedAttention,
                o_proj,
                Grouped::Linears(2),
                down,
            ],
            _ => vec![Grouped::Linears(3), o_proj, Grouped::Linears(2), down],
        };
        assert_eq!(calls, expected, "layer {layer} ({:?})", weights.kind);
        assert!(declining.calls.lock().unwrap().is_empty());
        kinds.insert(format!("{:?}", weights.kind));
    }
    assert!(kinds.len() >= 2, "both kinds of layer ran: {kinds:?}");
}
