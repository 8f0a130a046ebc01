//! `config.json` parsing and validation.

use crate::common;

use std::path::Path;

use sala_model::{LayerKind, ModelArch, ModelError, SalaConfig};
use serde_json::Value;

fn fixture_config(name: &str) -> Value {
    let path = common::fixtures().join(name).join("config.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn parse(value: &Value) -> Result<SalaConfig, ModelError> {
    SalaConfig::from_json_str(&value.to_string(), Path::new("test/config.json"))
}

fn config_error(value: &Value) -> String {
    match parse(value) {
        Ok(_) => panic!("config was accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn tiny_sala_config_parses_with_its_layer_pattern() {
    let config = parse(&fixture_config("tiny-sala")).unwrap();
    assert_eq!(config.arch(), ModelArch::MiniCpmSala);
    let sparse: Vec<usize> = (0..config.num_layers())
        .filter(|&i| config.layer_kind(i) == LayerKind::Minicpm4)
        .collect();
    assert_eq!(sparse, vec![0, 2, 5, 7]);
    assert!((config.residual_scale() - 1.4 / 8f64.sqrt()).abs() < 1e-12);
    assert_eq!(config.logit_divisor(), 4.0);
    assert_eq!(config.dense_len(), Some(8192));
}

/// Every linear of the fixtures respects the kernels' shape rule (in % 128, out % 64).
#[test]
fn fixture_linears_respect_kernel_shape_rule() {
    for name in ["tiny-sala", "tiny-llama"] {
        let config = parse(&fixture_config(name)).unwrap();
        for layer in 0..config.num_layers() {
            for spec in config.linear_specs(layer) {
                assert_eq!(spec.in_features % 128, 0, "{}", spec.name);
                assert_eq!(spec.out_features % 64, 0, "{}", spec.name);
            }
        }
    }
}

#[test]
fn linear_names_and_shapes_per_layer_kind() {
    let config = parse(&fixture_config("tiny-sala")).unwrap();
    let names = |layer| -> Vec<String> {
        config
            .linear_specs(layer)
            .into_iter()
            .map(|s| s.name.rsplit('.').next().unwrap().to_owned())
            .collect()
    };
    assert_eq!(
        names(0),
        [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_gate",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj"
        ]
    );
    assert_eq!(
        names(1),
        [
            "q_proj",
            "k_proj",
            "v_proj",
            "z_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj"
        ]
    );
    let k = &config.linear_specs(0)[1];
    assert_eq!(k.name, "model.layers.0.self_attn.k_proj");
    assert_eq!((k.out_features, k.in_features), (128, 256));
    let norms = config.layer_tensor_specs(3);
    assert!(norms
        .iter()
        .any(|s| s.name == "model.layers.3.self_attn.o_norm.weight" && s.shape == [256]));
    let llama = parse(&fixture_config("tiny-llama")).unwrap();
    assert_eq!(llama.arch(), ModelArch::Llama);
    assert_eq!(llama.linear_specs(0).len(), 7);
    assert_eq!(llama.lm_head_name(), sala_model::EMBED_TOKENS);
}

#[test]
fn rejects_unknown_mixer_type() {
    let mut value = fixture_config("tiny-sala");
    value["mixer_types"][3] = "mamba".into();
    let msg = config_error(&value);
    assert!(
        msg.contains("mixer_types[3]") && msg.contains("mamba"),
        "{msg}"
    );
}

#[test]
fn rejects_heads_that_do_not_divide() {
    let mut value = fixture_config("tiny-sala");
    value["num_key_value_heads"] = 3.into();
    let msg = config_error(&value);
    assert!(msg.contains("num_key_value_heads 3"), "{msg}");
}

#[test]
fn rejects_missing_field() {
    let mut value = fixture_config("tiny-sala");
    value.as_object_mut().unwrap().remove("sparse_config");
    assert!(config_error(&value).contains("sparse_config"));
    let mut value = fixture_config("tiny-sala");
    value.as_object_mut().unwrap().remove("hidden_size");
    let msg = config_error(&value);
    assert!(
        msg.contains("hidden_size") && msg.contains("test/config.json"),
        "{msg}"
    );
}

#[test]
fn rejects_lightning_heads_not_power_of_two() {
    let mut value = fixture_config("tiny-sala");
    for key in ["num_attention_heads", "lightning_nh", "lightning_nkv"] {
        value[key] = 6.into();
    }
    value["num_key_value_heads"] = 2.into();
    assert!(config_error(&value).contains("power of two"));
}

#[test]
fn rejects_mismatched_layer_count_and_unsupported_switches() {
    let mut value = fixture_config("tiny-sala");
    value["num_hidden_layers"] = 9.into();
    assert!(config_error(&value).contains("mixer_types has 8 entries"));
    let mut value = fixture_config("tiny-sala");
    value["attn_use_rope"] = true.into();
    assert!(config_error(&value).contains("attn_use_rope"));
    let mut value = fixture_config("tiny-llama");
    value["rope_scaling"] = serde_json::json!({"rope_type": "llama3"});
    assert!(config_error(&value).contains("rope_scaling"));
}

#[test]
fn dimensions_whose_products_overflow_are_refused_naming_the_fields() {
    let huge = 1u64 << 62;
    for (field, needles) in [
        ("vocab_size", &["vocab_size × hidden_size", "overflows"][..]),
        ("intermediate_size", &["intermediate_size × hidden_size"]),
        ("head_dim", &["head_dim"]),
    ] {
        let mut config = fixture_config("tiny-sala");
        config[field] = huge.into();
        let err = config_error(&config);
        for needle in needles {
            assert!(err.contains(needle), "{field}: {err}");
        }
        assert!(err.contains("test/config.json"), "{err}");
    }
    // A Llama config with an absurd layer count: refused before any per-layer list is built.
    let mut config = fixture_config("tiny-llama");
    config["num_hidden_layers"] = huge.into();
    assert!(config_error(&config).contains("num_hidden_layers"));
}

/// transformers 5 moves the RoPE base into `rope_parameters` and may leave `architectures` out:
/// both are read, a scaled RoPE or two disagreeing bases are refused naming the fields.
#[test]
fn transformers_5_rope_parameters_are_read_and_scaled_rope_refused() {
    let mut value = fixture_config("tiny-llama");
    let object = value.as_object_mut().unwrap();
    object.remove("rope_theta");
    object.remove("rope_scaling");
    object.remove("architectures");
    value["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 100000.0});
    assert_eq!(parse(&value).unwrap().rope_theta(), 100000.0);

    value["rope_theta"] = 50000.0.into();
    let err = config_error(&value);
    assert!(
        err.contains("disagree") && err.contains("rope_parameters"),
        "{err}"
    );
    value["rope_theta"] = 100000.0.into();
    assert_eq!(parse(&value).unwrap().rope_theta(), 100000.0);

    value["rope_parameters"] = serde_json::json!({"rope_type": "yarn", "rope_theta": 100000.0});
    let err = config_error(&value);
    assert!(err.contains("rope_type \"yarn\""), "{err}");
    value["rope_parameters"] = serde_json::json!({"rope_theta": "big"});
    assert!(config_error(&value).contains("must be a number"));

    let mut value = fixture_config("tiny-llama");
    value["attention_bias"] = true.into();
    assert!(config_error(&value).contains("attention_bias"));
}
