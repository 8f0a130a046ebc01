//! Every verifier rule, broken one at a time on an otherwise valid fixture: the report must
//! name the rule and the tensor, and no other rule.

use crate::common;

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use common::*;
use sala_export::loaders::{GptqLoader, LoaderTarget};
use sala_export::{
    verify, verify_for, CheckpointWriter, Dtype, Rule, Tensor, VerifyReport, INDEX_FILE,
};
use tempfile::TempDir;

fn fixture(
    format: Format,
    dense: &[&str],
    hook: impl FnMut(&str, &mut Linear),
) -> (TempDir, PathBuf) {
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("ckpt");
    write_fixture(&target, format, dense, hook);
    (root, target)
}

/// Asserts that the report has exactly the rule `rule`, naming `name`.
fn assert_only(report: &VerifyReport, rule: Rule, name: &str) {
    let rules: BTreeSet<Rule> = report.violations.iter().map(|v| v.rule).collect();
    assert_eq!(rules, BTreeSet::from([rule]), "{:#?}", report.violations);
    assert!(report.has(rule, name), "{:#?}", report.violations);
}

fn edit_both_gptq_configs(dir: &Path, edit: impl Fn(&mut serde_json::Value)) {
    edit_json(&dir.join("config.json"), |c| {
        edit(&mut c["quantization_config"])
    });
    edit_json(&dir.join("quantize_config.json"), edit);
}

const Q0: &str = "model.layers.0.self_attn.q_proj";
const K0: &str = "model.layers.0.self_attn.k_proj";
const V0: &str = "model.layers.0.self_attn.v_proj";
const O1: &str = "model.layers.1.self_attn.o_proj";
const UP1: &str = "model.layers.1.mlp.up_proj";

#[test]
fn valid_fixtures_pass_with_a_summary() {
    for format in [Format::Gptq, Format::Nvfp4] {
        let (_root, dir) = fixture(format, &[O1], |_, _| {});
        let report = verify(&dir).unwrap();
        assert!(report.is_ok(), "{:#?}", report.violations);
        let s = report.summary;
        assert_eq!(s.quantized_linears, 2 * LINEARS.len() - 1);
        let weights: usize =
            LINEARS.iter().map(|(_, o, i)| o * i).sum::<usize>() * 2 - HIDDEN * HIDDEN;
        assert_eq!(s.quantized_weights, weights as u64);
        let bits = s.bits_per_quantized_weight();
        // INT4 g64: 4 + 16/64 (scales) + 4/64 (zeros) + g_idx; NVFP4: 4 + 8/16 + scalars.
        assert!((4.3..4.6).contains(&bits), "{format:?} {bits}");
    }
}

#[test]
fn config_rule() {
    let (_root, dir) = fixture(Format::Gptq, &[], |_, _| {});
    edit_both_gptq_configs(&dir, |q| {
        q.as_object_mut().unwrap().remove("sym");
    });
    assert_only(&verify(&dir).unwrap(), Rule::Config, "quantization_config");

    let (_root, dir) = fixture(Format::Gptq, &[], |_, _| {});
    edit_both_gptq_configs(&dir, |q| q["checkpoint_format"] = "marlin".into());
    assert_only(&verify(&dir).unwrap(), Rule::Config, "quantization_config");

    let (_root, dir) = fixture(Format::Gptq, &[], |_, _| {});
    edit_json(&dir.join("quantize_config.json"), |q| {
        q["damp_percent"] = 0.1.into()
    });
    assert_only(&verify(&dir).unwrap(), Rule::Config, "quantize_config.json");

    let (_root, dir) = fixture(Format::Nvfp4, &[], |_, _| {});
    edit_json(&dir.join("config.json"), |c| {
        c["quantization_config"]
            .as_object_mut()
            .unwrap()
            .remove("ignore");
    });
    assert_only(&verify(&dir).unwrap(), Rule::Config, "quantization_config");

    let (_root, dir) = fixture(Format::Nvfp4, &[], |_, _| {});
    edit_json(&dir.join("hf_quant_config.json"), |c| {
        c["quantization"]["exclude_modules"] = serde_json::Value::Null
    });
    assert_only(&verify(&dir).unwrap(), Rule::Config, "hf_quant_config.json");
}

#[test]
fn index_rule() {
    let (_root, dir) = fixture(Format::Gptq, &[], |_, _| {});
    let tensor = format!("{Q0}.scales");
    edit_json(&dir.join(INDEX_FILE), |i| {
        i["weight_map"].as_object_mut().unwrap().remove(&tensor);
    });
    assert_only(&verify(&dir).unwrap(), Rule::Index, &tensor);

    let (_root, dir) = fixture(Format::Gptq, &[], |_, _| {});
    edit_json(&dir.join(INDEX_FILE), |i| {
        i["metadata"]["total_size"] = 12.into()
    });
    assert_only(&verify(&dir).unwrap(), Rule::Index, INDEX_FILE);

    // A missing shard also loses its tensors, so other rules fire too; the file is named.
    let (_root, dir) = fixture(Format::Gptq, &[], |_, _| {});
    let shard = entries(&dir)
        .into_iter()
        .find(|n| n.starts_with("model-00002-of-"))
        .unwrap();
    fs::remove_file(dir.join(&shard)).unwrap();
    let report = verify(&dir).unwrap();
    assert!(
        report.has(Rule::Index, "model-00002-of-"),
        "{:#?}",
        report.violations
    );
}

#[test]
fn tensor_layout_rule() {
    // GPTQ scales stored as F32 instead of F16.
    let (_root, dir) = raw_linear(Format::Gptq, Q0, |t| {
        let scales = tensor_mut(t, ".scales");
        let values = sala_export::decode_f32("s", scales.dtype, &scales.data).unwrap();
        *scales = Tensor::from_f32("s", Dtype::F32, &scales.shape.clone(), &values).unwrap();
    });
    assert_only(
        &verify(&dir).unwrap(),
        Rule::TensorLayout,
        &format!("{Q0}.scales"),
    );

    // NVFP4 linear without input_scale.
    let (_root, dir) = raw_linear(Format::Nvfp4, O1, |t| {
        t.retain(|(n, _)| !n.ends_with(".input_scale"));
    });
    assert_only(
        &verify(&dir).unwrap(),
        Rule::TensorLayout,
        &format!("{O1}.input_scale"),
    );

    // NVFP4 block scales with the wrong shape.
    let (_root, dir) = raw_linear(Format::Nvfp4, O1, |t| {
        let s = tensor_mut(t, ".weight_scale");
        s.shape = vec![s.shape[1], s.shape[0]];
    });
    assert_only(
        &verify(&dir).unwrap(),
        Rule::TensorLayout,
        &format!("{O1}.weight_scale"),
    );
}

#[test]
fn marlin_shape_and_group_size_rules() {
    // A GPTQ linear with out = 32 (not a multiple of 64).
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("narrow");
    let mut w = sala_export::CheckpointWriter::create(&target, Default::default()).unwrap();
    let weights = random(&mut rng(3), 32 * 128);
    let module = "model.layers.0.self_attn.o_gate";
    w.add_gptq_linear(module, &gptq_linear(&weights, 32, 128))
        .unwrap();
    w.finish(model_config(), &quant_config(Format::Gptq, &[]))
        .unwrap();
    assert_only(&verify(&target).unwrap(), Rule::LoaderShape, module);
    // For the torch kernels (`--target gptq`) the same files are fine, and the report says
    // which loaders take them.
    let torch = verify_for(&target, LoaderTarget::Gptq).unwrap();
    assert!(torch.is_ok(), "{torch}");
    let refused: Vec<_> = torch.loaders.iter().filter(|v| !v.accepts()).collect();
    assert_eq!(refused.len(), 1, "{:?}", torch.loaders);
    assert_eq!(refused[0].loader, GptqLoader::Marlin);
    assert!(
        refused[0].refusals[0].contains("out 32 % 64"),
        "{}",
        refused[0]
    );

    // group_size 16 is not a Marlin group size (the tensors, packed at 64, then disagree too).
    let (_root, dir) = fixture(Format::Gptq, &[], |_, _| {});
    edit_both_gptq_configs(&dir, |q| q["group_size"] = 16.into());
    let report = verify(&dir).unwrap();
    assert!(
        report.has(Rule::GroupSize, "quantization_config"),
        "{:#?}",
        report.violations
    );
    // The torch kernels take group 16; the packed tensors still disagree with it.
    let torch = verify_for(&dir, LoaderTarget::Gptq).unwrap();
    assert!(
        !torch.has(Rule::GroupSize, "quantization_config"),
        "{torch}"
    );
    assert!(torch.has(Rule::TensorLayout, ""), "{torch}");
}

#[test]
fn fused_precision_rule() {
    // k_proj kept in bf16 (declared), q and v quantized.
    let (_root, dir) = fixture(Format::Gptq, &[K0], |_, _| {});
    assert_only(
        &verify(&dir).unwrap(),
        Rule::FusedPrecision,
        "model.layers.0.self_attn.qkv_proj",
    );
    let (_root, dir) = fixture(Format::Nvfp4, &["model.layers.1.mlp.gate_proj"], |_, _| {});
    assert_only(
        &verify(&dir).unwrap(),
        Rule::FusedPrecision,
        "model.layers.1.mlp.gate_up_proj",
    );
}

#[test]
fn fused_scales_rule() {
    let (_root, dir) = fixture(Format::Nvfp4, &[], |module, linear| {
        if let (V0, Linear::Nvfp4(m, _)) = (module, linear) {
            m.global_scale *= 2.0;
        }
    });
    assert_only(
        &verify(&dir).unwrap(),
        Rule::FusedScales,
        &format!("{V0}.weight_scale_2"),
    );

    let (_root, dir) = fixture(Format::Nvfp4, &[], |module, linear| {
        if let (UP1, Linear::Nvfp4(_, input_scale)) = (module, linear) {
            *input_scale *= 0.5;
        }
    });
    assert_only(
        &verify(&dir).unwrap(),
        Rule::FusedScales,
        &format!("{UP1}.input_scale"),
    );
}

/// A checkpoint holding one linear written tensor by tensor (to store what the writer refuses).
fn raw_linear(
    format: Format,
    module: &str,
    edit: impl FnOnce(&mut Vec<(String, Tensor)>),
) -> (TempDir, PathBuf) {
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("raw");
    let linears = build_linears(format, &[], 7);
    let linear = &linears.iter().find(|(m, _)| m == module).unwrap().1;
    let mut tensors = match linear {
        Linear::Gptq(p) => sala_export::layout::gptq_tensors(module, p).unwrap(),
        Linear::Nvfp4(m, s) => sala_export::layout::nvfp4_tensors(module, m, *s).unwrap(),
        Linear::Dense(..) => unreachable!(),
    };
    edit(&mut tensors);
    let mut w = CheckpointWriter::create(&target, Default::default()).unwrap();
    for (name, t) in tensors {
        w.add_tensor(&name, t.dtype, &t.shape, &t.data).unwrap();
    }
    w.finish(model_config(), &quant_config(format, &[]))
        .unwrap();
    (root, target)
}

fn tensor_mut<'a>(tensors: &'a mut [(String, Tensor)], suffix: &str) -> &'a mut Tensor {
    &mut tensors
        .iter_mut()
        .find(|(n, _)| n.ends_with(suffix))
        .unwrap()
        .1
}

#[test]
fn finite_scales_rule() {
    // An E4M3FN block scale byte 0x7F is NaN.
    let (_root, dir) = raw_linear(Format::Nvfp4, O1, |t| {
        tensor_mut(t, ".weight_scale").data[5] = 0x7F;
    });
    assert_only(
        &verify(&dir).unwrap(),
        Rule::FiniteScales,
        &format!("{O1}.weight_scale"),
    );

    // An infinite weight_scale_2.
    let (_root, dir) = raw_linear(Format::Nvfp4, O1, |t| {
        tensor_mut(t, ".weight_scale_2").data = f32::INFINITY.to_le_bytes().to_vec();
    });
    assert_only(
        &verify(&dir).unwrap(),
        Rule::FiniteScales,
        &format!("{O1}.weight_scale_2"),
    );

    // An fp16 GPTQ scale that is +inf (0x7C00).
    let (_root, dir) = raw_linear(Format::Gptq, O1, |t| {
        tensor_mut(t, ".scales").data[6..8].copy_from_slice(&[0x00, 0x7C]);
    });
    assert_only(
        &verify(&dir).unwrap(),
        Rule::FiniteScales,
        &format!("{O1}.scales"),
    );
}

#[test]
fn zero_block_scale_rule() {
    let (_root, dir) = fixture(Format::Nvfp4, &[], |module, linear| {
        if let (O1, Linear::Nvfp4(m, _)) = (module, linear) {
            assert!(m.packed[8 * 9..8 * 10].iter().any(|&b| b & 0x77 != 0));
            m.block_scales[9] = 0;
        }
    });
    assert_only(
        &verify(&dir).unwrap(),
        Rule::ZeroBlockScale,
        &format!("{O1}.weight_scale"),
    );
}

#[test]
fn g_idx_rule() {
    let (_root, dir) = fixture(Format::Gptq, &[], |module, linear| {
        if let (UP1, Linear::Gptq(p)) = (module, linear) {
            p.g_idx.swap(0, HIDDEN - 1);
        }
    });
    assert_only(&verify(&dir).unwrap(), Rule::GIdx, &format!("{UP1}.g_idx"));
}

#[test]
fn sym_zeros_rule() {
    let (_root, dir) = fixture(Format::Gptq, &[], |module, linear| {
        if let (Q0, Linear::Gptq(p)) = (module, linear) {
            p.qzeros[1] = 0x8888_8888u32 as i32; // v2-style zeros in a v1 checkpoint
        }
    });
    assert_only(
        &verify(&dir).unwrap(),
        Rule::SymZeros,
        &format!("{Q0}.qzeros"),
    );
}

#[test]
fn exclusions_rule() {
    // o_proj kept in bf16, but the config does not say so.
    let (_root, dir) = fixture(Format::Gptq, &[O1], |_, _| {});
    edit_both_gptq_configs(&dir, |q| q["dynamic"] = serde_json::json!({}));
    assert_only(&verify(&dir).unwrap(), Rule::Exclusions, O1);

    let (_root, dir) = fixture(Format::Nvfp4, &[O1], |_, _| {});
    let list = serde_json::json!(["lm_head"]);
    edit_json(&dir.join("config.json"), |c| {
        c["quantization_config"]["ignore"] = list.clone();
        c["quantization_config"]["exclude_modules"] = list.clone();
    });
    edit_json(&dir.join("hf_quant_config.json"), |c| {
        c["quantization"]["exclude_modules"] = list.clone()
    });
    assert_only(&verify(&dir).unwrap(), Rule::Exclusions, O1);

    // A quantized module listed as excluded.
    let (_root, dir) = fixture(Format::Nvfp4, &[], |_, _| {});
    let list = serde_json::json!(["lm_head", "model.layers.1.mlp.down_proj"]);
    edit_json(&dir.join("config.json"), |c| {
        c["quantization_config"]["ignore"] = list.clone();
        c["quantization_config"]["exclude_modules"] = list.clone();
    });
    edit_json(&dir.join("hf_quant_config.json"), |c| {
        c["quantization"]["exclude_modules"] = list.clone()
    });
    assert_only(
        &verify(&dir).unwrap(),
        Rule::Exclusions,
        "model.layers.1.mlp.down_proj",
    );
}

#[test]
fn finite_tensors_rule() {
    // A NaN in the embedding (copied, not quantized) and an infinity in a linear kept in bf16.
    for format in [Format::Gptq, Format::Nvfp4] {
        let (_root, dir) = fixture(format, &[O1], |module, linear| {
            if let (O1, Linear::Dense(w, ..)) = (module, linear) {
                w[3] = f32::INFINITY;
            }
        });
        let report = verify(&dir).unwrap();
        assert!(
            report.has(Rule::FiniteTensors, &format!("{O1}.weight")),
            "{:#?}",
            report.violations
        );
        assert_eq!(report.violations.len(), 1, "{:#?}", report.violations);
    }
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("ckpt");
    let mut writer = CheckpointWriter::create(&target, Default::default()).unwrap();
    for (name, shape, mut values) in passthrough(7) {
        if name == "model.embed_tokens.weight" {
            values[HIDDEN + 2] = f32::NAN;
        }
        writer.add_f32(&name, Dtype::BF16, &shape, &values).unwrap();
    }
    for (module, linear) in build_linears(Format::Gptq, &[], 7) {
        write_linear(&mut writer, &module, &linear);
    }
    let staged = writer
        .finish_staged(model_config(), &quant_config(Format::Gptq, &[]))
        .unwrap();
    let report = staged.verify().unwrap();
    assert_only(&report, Rule::FiniteTensors, "model.embed_tokens.weight");
    assert!(report
        .to_string()
        .contains(&format!("index {}", HIDDEN + 2)));
    // Never committed: dropping the staged checkpoint leaves nothing.
    drop(staged);
    assert!(
        entries(root.path()).is_empty(),
        "{:?}",
        entries(root.path())
    );
}
