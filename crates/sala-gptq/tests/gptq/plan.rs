//! The plan on the real MiniCPM-SALA 9B configuration (`tests/data/minicpm-sala-9b-config.json`,
//! the config.json of the released model, no weights): the tables the original scripts produced.

use regex::Regex;
use sala_gptq::{LayerBits, Nvfp4Coverage, PlanError, PlanOptions, QuantPlan, Recipe, Treatment};
use sala_model::SalaConfig;
use std::path::Path;

const MINICPM4_LAYERS: [usize; 8] = [0, 9, 16, 17, 22, 29, 30, 31];

fn sala9b() -> SalaConfig {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/minicpm-sala-9b-config.json");
    SalaConfig::from_file(&path).expect("the bundled config parses")
}

fn kept(plan: &QuantPlan) -> Vec<String> {
    plan.linears
        .iter()
        .filter(|l| !l.treatment.is_quantized())
        .map(|l| l.name.clone())
        .collect()
}

#[test]
fn gptq_default_quantizes_every_decoder_linear_at_int4_g128() {
    let plan = QuantPlan::build(&sala9b(), &PlanOptions::new(Recipe::Gptq)).unwrap();
    // 24 lightning layers × 8 linears + 8 minicpm4 layers × 8 linears, plus lm_head.
    assert_eq!(plan.linears.len(), 32 * 8 + 1);
    assert_eq!(kept(&plan), vec!["lm_head".to_owned()]);
    assert!(plan.quantized().all(|l| l.treatment
        == Treatment::Int {
            bits: 4,
            group_size: 128
        }));
}

#[test]
fn nvfp4_default_keeps_minicpm4_attention_bf16_as_the_original_exclude_list() {
    let plan = QuantPlan::build(&sala9b(), &PlanOptions::new(Recipe::Nvfp4)).unwrap();
    let mut expected: Vec<String> = MINICPM4_LAYERS
        .iter()
        .flat_map(|l| {
            ["q_proj", "k_proj", "v_proj", "o_gate", "o_proj"]
                .map(|p| format!("model.layers.{l}.self_attn.{p}"))
        })
        .collect();
    expected.push("lm_head".into());
    let mut got = kept(&plan);
    got.sort();
    expected.sort();
    assert_eq!(got.len(), 41);
    assert_eq!(got, expected);
}

#[test]
fn nvfp4_dense_all_and_mlp_only() {
    let mut options = PlanOptions::new(Recipe::Nvfp4);
    options.nvfp4_coverage = Nvfp4Coverage::All;
    let plan = QuantPlan::build(&sala9b(), &options).unwrap();
    assert_eq!(kept(&plan), vec!["lm_head".to_owned()]);
    options.nvfp4_coverage = Nvfp4Coverage::MlpOnly;
    let plan = QuantPlan::build(&sala9b(), &options).unwrap();
    assert!(plan.quantized().all(|l| l.name.contains(".mlp.")));
    assert_eq!(plan.quantized().count(), 32 * 3);
}

#[test]
fn bits_priority_is_layer_then_type_then_global() {
    let mut options = PlanOptions::new(Recipe::Gptq);
    options.lightning_bits = Some(8);
    options.minicpm4_bits = Some(16);
    options.layer_bits = LayerBits::parse("0:4,2-7:8,8:16").unwrap();
    let plan = QuantPlan::build(&sala9b(), &options).unwrap();
    let bits_of = |layer: usize| plan.layer(layer).next().unwrap().treatment.clone();
    assert_eq!(
        bits_of(0),
        Treatment::Int {
            bits: 4,
            group_size: 128
        }
    ); // layer beats minicpm4 16
    assert_eq!(
        bits_of(1),
        Treatment::Int {
            bits: 8,
            group_size: 128
        }
    ); // lightning type
    assert!(!bits_of(8).is_quantized()); // layer 8: 16
    assert!(!bits_of(9).is_quantized()); // minicpm4 type: 16
    assert_eq!(
        bits_of(10),
        Treatment::Int {
            bits: 8,
            group_size: 128
        }
    );
}

#[test]
fn loader_rules_are_enforced_before_any_compute() {
    let config = sala9b();
    // q/k/v at different precisions: vLLM and SGLang refuse the fused layer.
    let mut options = PlanOptions::new(Recipe::Gptq);
    options.exclude = vec![Regex::new(r"model\.layers\.3\.self_attn\.k_proj").unwrap()];
    let err = QuantPlan::build(&config, &options).unwrap_err();
    assert!(
        matches!(err, PlanError::FusedMismatch { ref group, .. } if group == "model.layers.3.qkv"),
        "{err}"
    );
    // Excluding the whole fused group is fine.
    options.exclude = vec![Regex::new(r"model\.layers\.3\.self_attn\.[qkv]_proj").unwrap()];
    assert!(QuantPlan::build(&config, &options).is_ok());
    // Group sizes Marlin does not have.
    let mut options = PlanOptions::new(Recipe::Gptq);
    options.group_size = 96;
    assert!(matches!(
        QuantPlan::build(&config, &options),
        Err(PlanError::Shape { .. })
    ));
    // 3 bits cannot be packed in int32 words by this exporter.
    options.group_size = 128;
    options.bits = 3;
    assert!(matches!(
        QuantPlan::build(&config, &options),
        Err(PlanError::Shape { .. })
    ));
    // NVFP4 knows only 4 and 16 bits.
    let mut options = PlanOptions::new(Recipe::Nvfp4);
    options.layer_bits = LayerBits::parse("5:8").unwrap();
    assert!(matches!(
        QuantPlan::build(&config, &options),
        Err(PlanError::Bits { .. })
    ));
    // Layers beyond the model.
    options.layer_bits = LayerBits::parse("40:4").unwrap();
    assert!(matches!(
        QuantPlan::build(&config, &options),
        Err(PlanError::LayerOutOfRange { .. })
    ));
}

#[test]
fn layer_bits_parsing_errors_name_the_item() {
    for bad in ["0-", "a:4", "3-1:4", "2:x", "2"] {
        let err = LayerBits::parse(bad).unwrap_err();
        assert!(
            err.to_string().contains(bad.split(',').next().unwrap()),
            "{err}"
        );
    }
    assert_eq!(LayerBits::parse("").unwrap().get(0), None);
}

#[test]
fn a_layer_range_given_twice_is_refused_but_a_narrower_override_is_not() {
    for dup in ["3:4,3:8", "0-7:4, 0-7:4", "2-5:8,1:4,2 - 5:16"] {
        let err = LayerBits::parse(dup).unwrap_err().to_string();
        assert!(err.contains("twice"), "{dup}: {err}");
    }
    let bits = LayerBits::parse("0-7:4,3:8").unwrap();
    assert_eq!((bits.get(2), bits.get(3)), (Some(4), Some(8)));
}

#[test]
fn the_table_has_one_row_per_layer() {
    let plan = QuantPlan::build(&sala9b(), &PlanOptions::new(Recipe::Nvfp4)).unwrap();
    let table = plan.to_string();
    assert!(
        table.contains("| 0 | minicpm4 | q k v o_gate o bf16 | gate up down FP4 |"),
        "{table}"
    );
    assert!(
        table.contains("| 1 | lightning | q k v z o FP4 | gate up down FP4 |"),
        "{table}"
    );
    assert!(table.ends_with("216 of 257 linears quantized"), "{table}");
}

#[test]
fn smoothing_groups_are_the_original_four_for_gptq_and_three_for_nvfp4() {
    let config = sala9b();
    let group_of = |plan: &QuantPlan, name: &str| plan.get(name).unwrap().smooth_group.clone();
    let gptq = QuantPlan::build(&config, &PlanOptions::new(Recipe::Gptq)).unwrap();
    // minicpm4 layer 0: o_gate reads input_layernorm's output, like q/k/v.
    for p in ["q_proj", "k_proj", "v_proj", "o_gate"] {
        let name = format!("model.layers.0.self_attn.{p}");
        assert_eq!(
            group_of(&gptq, &name).as_deref(),
            Some("model.layers.0.input_layernorm"),
            "{name}"
        );
    }
    assert_eq!(group_of(&gptq, "model.layers.0.self_attn.o_proj"), None); // gated attention output
    assert_eq!(
        group_of(&gptq, "model.layers.1.self_attn.z_proj").as_deref(),
        Some("model.layers.1.input_layernorm")
    );
    assert_eq!(
        group_of(&gptq, "model.layers.1.self_attn.o_proj").as_deref(),
        Some("model.layers.1.self_attn.o_norm")
    );
    assert_eq!(
        group_of(&gptq, "model.layers.1.mlp.up_proj").as_deref(),
        Some("model.layers.1.post_attention_layernorm")
    );
    assert_eq!(
        group_of(&gptq, "model.layers.1.mlp.down_proj").as_deref(),
        Some("model.layers.1.mlp.up_proj")
    );
    let nvfp4 = QuantPlan::build(&config, &PlanOptions::new(Recipe::Nvfp4)).unwrap();
    assert_eq!(group_of(&nvfp4, "model.layers.1.mlp.down_proj"), None);
    assert_eq!(
        group_of(&nvfp4, "model.layers.1.mlp.gate_proj").as_deref(),
        Some("model.layers.1.post_attention_layernorm")
    );
    let groups = |plan: &QuantPlan| {
        let mut g: Vec<String> = plan
            .linears
            .iter()
            .filter(|l| l.layer == Some(1))
            .filter_map(|l| l.smooth_group.clone())
            .collect();
        g.dedup();
        g.len()
    };
    assert_eq!((groups(&gptq), groups(&nvfp4)), (4, 3));
}

/// `--target` applies only its loaders' rules: the 9B model suits every loader; a group size
/// gptq_marlin does not serve (96) is refused for it and accepted for the torch kernels, where
/// the plan says which loaders take it; NVFP4 has no GPTQ target.
#[test]
fn loader_targets_apply_only_their_rules() {
    use sala_gptq::{GptqLoader, LoaderTarget};
    let plan = QuantPlan::build(&sala9b(), &PlanOptions::new(Recipe::Gptq)).unwrap();
    let verdicts = plan.loader_verdicts();
    assert_eq!(verdicts.len(), GptqLoader::ALL.len());
    assert!(verdicts.iter().all(|v| v.accepts()), "{verdicts:?}");
    assert!(plan
        .to_string()
        .contains("loads in gptq_marlin (vLLM, SGLang): yes"));

    let mut options = PlanOptions::new(Recipe::Gptq);
    options.group_size = 96;
    let err = QuantPlan::build(&sala9b(), &options).unwrap_err();
    assert!(matches!(err, PlanError::Shape { .. }), "{err}");
    assert!(err.to_string().contains("group size 96"), "{err}");
    options.target = LoaderTarget::Gptq;
    let plan = QuantPlan::build(&sala9b(), &options).unwrap();
    let verdicts = plan.loader_verdicts();
    let marlin = verdicts
        .iter()
        .find(|v| v.loader == GptqLoader::Marlin)
        .unwrap();
    // Every quantized linear is refused, each by name.
    assert_eq!(marlin.refusals.len(), plan.quantized().count());
    assert!(marlin
        .to_string()
        .starts_with("gptq_marlin (vLLM, SGLang): no: model.layers.0."));
    // 4096 % 96 = 64: a partial last group, which exllama refuses too.
    let exllama = verdicts
        .iter()
        .find(|v| v.loader == GptqLoader::Exllama)
        .unwrap();
    assert!(!exllama.accepts());
    assert!(verdicts
        .iter()
        .find(|v| v.loader == GptqLoader::Torch)
        .unwrap()
        .accepts());

    let mut nvfp4 = PlanOptions::new(Recipe::Nvfp4);
    nvfp4.target = LoaderTarget::Gptq;
    let err = QuantPlan::build(&sala9b(), &nvfp4).unwrap_err().to_string();
    assert!(err.contains("--target"), "{err}");
}
