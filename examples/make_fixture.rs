//! Writes the bundled tiny models `fixtures/tiny-sala/`, `fixtures/tiny-llama/` and
//! `fixtures/tiny-smollm/`: a BPE tokenizer trained on `fixtures/text/train.txt`, seeded-random
//! weights (bf16; f16 for tiny-smollm), `config.json`, `generation_config.json` and the
//! tokenizer files.
//!
//! ```text
//! cargo run --release --example make_fixture            # rewrites fixtures/tiny-{sala,llama,smollm}
//! cargo run --release --example make_fixture -- --only tiny-smollm
//! cargo run --release --example make_fixture -- --out /tmp/fx
//! cargo run --release --example make_fixture -- --full-size DIR [--seed N] [--config PATH]
//! ```
//!
//! `--full-size DIR` writes instead a random-weight checkpoint of the released MiniCPM-SALA 9B
//! config (or `--config`) into `DIR` in the released layout: 4 bf16 shards and their index,
//! a byte-level BPE padded to the config's vocabulary and the auxiliary files (~19 GB; see
//! `sala_quant::full_size`).
//!
//! Tiny SALA: hidden 256, 8 layers, minicpm4 (sparse) at layers 0, 2, 5 and 7 (first and last
//! sparse as in the released model, lightning elsewhere), 4 query heads × 64 with 2 KV heads
//! (k/v out = 128), lightning 4 heads × 64 (a power of two, as the decay slopes require),
//! intermediate 512, vocabulary 2048. Every linear has `in % 128 == 0` and `out % 64 == 0`.
//! Tiny Llama: the same widths, 4 layers, tied embeddings.
//! Tiny SmolLM: a Llama shaped like SmolLM2-135M where `gptq_marlin` refuses it: hidden 192 and
//! intermediate 320 are not multiples of 128 (every input ends in a partial group of 128),
//! 3 query heads and 1 KV head of 64, 2 layers, tied embeddings, f16 weights and a
//! transformers-5 config (`dtype`, `rope_parameters`).
//! Norm weights have four outlier channels (gain 10) so that SmoothQuant has something to do.
//! Output goes to a temporary directory next to the target, then is renamed into place.

#![recursion_limit = "256"]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::{Distribution, Tensor};
use burn_ndarray::NdArray;
use clap::Parser;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use sala_model::{SalaConfig, TensorSpec};
use sala_quant::full_size::{
    generation_config, special_tokens_map, tokenizer_config, train_tokenizer, write_checkpoint,
    write_json, Options,
};
use serde_json::{json, Value};

type Backend = NdArray<f32>;
type AnyError = sala_quant::full_size::Error;

/// Vocabulary of both fixtures (special tokens included).
const VOCAB: usize = 2048;
/// Input channels of every layer norm that get a large gain (outliers for SmoothQuant).
const OUTLIER_CHANNELS: [usize; 4] = [7, 61, 130, 201];
const OUTLIER_GAIN: f32 = 10.0;

#[derive(Parser)]
#[command(
    about = "Regenerate the tiny SALA and Llama fixtures, or write a full-size random checkpoint"
)]
struct Args {
    /// Fixtures directory (must contain text/train.txt); defaults to the repository's fixtures/.
    #[arg(long, conflicts_with = "full_size")]
    out: Option<PathBuf>,
    /// Write only this fixture (tiny-sala, tiny-llama or tiny-smollm).
    #[arg(long, conflicts_with = "full_size")]
    only: Option<String>,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 8)]
    seed: u64,
    /// Write a full-size random-weight MiniCPM-SALA checkpoint into DIR (absent or empty)
    /// instead of the tiny fixtures.
    #[arg(long, value_name = "DIR")]
    full_size: Option<PathBuf>,
    /// The config.json of --full-size (default: fixtures/minicpm-sala-9b-config.json).
    #[arg(long, requires = "full_size")]
    config: Option<PathBuf>,
}

fn main() -> Result<(), AnyError> {
    let args = Args::parse();
    if let Some(dir) = args.full_size {
        let mut options = Options::new(args.seed);
        if let Some(config) = args.config {
            options.config = config;
        }
        match write_checkpoint(&dir, &options) {
            Ok(summary) => println!("{summary}"),
            Err(e) => {
                eprintln!("make_fixture --full-size: {e}");
                std::process::exit(1);
            }
        }
        return Ok(());
    }
    let fixtures = args.out.unwrap_or_else(sala_quant::fixtures_dir);
    let models = [
        ("tiny-sala", sala_config(), args.seed),
        ("tiny-llama", llama_config(), args.seed + 1),
        ("tiny-smollm", smollm_config(), args.seed + 2),
    ];
    if let Some(only) = &args.only {
        if !models.iter().any(|(name, ..)| name == only) {
            eprintln!("make_fixture: --only {only:?} names no fixture (tiny-sala, tiny-llama, tiny-smollm)");
            std::process::exit(2);
        }
    }
    let train = fixtures.join("text").join("train.txt");
    let tokenizer = train_tokenizer(&train, VOCAB)?;
    for (name, config, seed) in &models {
        if args.only.as_deref().is_none_or(|only| only == *name) {
            write_model(&fixtures, name, config, &tokenizer, *seed)?;
        }
    }
    Ok(())
}

fn sala_config() -> Value {
    let minicpm4_layers = [0, 2, 5, 7];
    let mixer_types: Vec<&str> = (0..8)
        .map(|i| {
            if minicpm4_layers.contains(&i) {
                "minicpm4"
            } else {
                "lightning-attn"
            }
        })
        .collect();
    json!({
        "architectures": ["MiniCPMSALAForCausalLM"],
        "model_type": "minicpm_sala",
        "dtype": "bfloat16",
        "transformers_version": "4.57.1",
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 8,
        "hidden_act": "silu",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "lightning_nh": 4,
        "lightning_nkv": 4,
        "lightning_head_dim": 64,
        "lightning_scale": "1/sqrt(d)",
        "lightning_use_rope": true,
        "attn_use_rope": false,
        "qk_norm": true,
        "use_output_norm": true,
        "use_output_gate": true,
        "attn_use_output_gate": true,
        "attention_bias": false,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": null,
        "max_position_embeddings": 524288,
        "scale_emb": 12,
        "scale_depth": 1.4,
        "dim_model_base": 64,
        "mup_denominator": 32,
        "tie_word_embeddings": false,
        "bos_token_id": 1,
        "eos_token_id": [2],
        "pad_token_id": 2,
        "pretraining_tp": 1,
        "initializer_range": 0.1,
        "attention_dropout": 0.0,
        "use_cache": true,
        "shift_labels": true,
        "sparse_config": {
            "block_size": 64, "dense_len": 8192, "init_blocks": 1, "kernel_size": 32,
            "kernel_stride": 16, "topk": 64, "use_nope": false, "window_size": 2048
        },
        "mixer_types": mixer_types,
        "auto_map": {
            "AutoConfig": "configuration_minicpm_sala.MiniCPMSALAConfig",
            "AutoModelForCausalLM": "modeling_minicpm_sala.MiniCPMSALAForCausalLM"
        }
    })
}

fn llama_config() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "hidden_act": "silu",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "attention_bias": false,
        "mlp_bias": false,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": null,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": true,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "attention_dropout": 0.0,
        "use_cache": true
    })
}

/// SmolLM2-135M's shape problems at a tiny size (see the module docs).
fn smollm_config() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "dtype": "float16",
        "transformers_version": "5.0.0",
        "vocab_size": VOCAB,
        "hidden_size": 192,
        "intermediate_size": 320,
        "num_hidden_layers": 2,
        "hidden_act": "silu",
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "attention_bias": false,
        "mlp_bias": false,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "max_position_embeddings": 8192,
        "tie_word_embeddings": true,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": true
    })
}

/// Draws the values of one tensor. Scales keep activations near unit RMS: linears get
/// std `1/sqrt(in)`, norms `1 ± 0.1` (times the outlier gain on a few channels), the
/// embedding `1/scale_emb`, `lm_head` so that logits have a spread of about 2.
fn init_tensor(spec: &TensorSpec, config: &SalaConfig) -> Vec<f32> {
    let device = Default::default();
    let n: usize = spec.shape.iter().product();
    let normal = |std: f64| {
        Tensor::<Backend, 1>::random([n], Distribution::Normal(0.0, std), &device)
            .into_data()
            .into_vec::<f32>()
            .expect("f32 data")
    };
    let hidden = config.hidden_size() as f64;
    let name = spec.name.as_str();
    if name.ends_with("norm.weight") {
        let mut w: Vec<f32> = normal(0.1).into_iter().map(|x| 1.0 + x).collect();
        if name.ends_with("layernorm.weight") {
            let channels = w.len();
            for c in OUTLIER_CHANNELS.into_iter().filter(|&c| c < channels) {
                w[c] *= OUTLIER_GAIN;
            }
        }
        w
    } else if name == sala_model::EMBED_TOKENS {
        normal(1.0 / config.embedding_scale())
    } else if name == sala_model::LM_HEAD {
        normal(2.0 * config.logit_divisor() / hidden.sqrt())
    } else {
        normal(1.0 / (spec.shape[1] as f64).sqrt())
    }
}

/// The storage dtype a config names (`dtype`, or transformers 4's `torch_dtype`): f16 or bf16.
fn storage_dtype(config: &Value) -> Dtype {
    let name = config.get("dtype").or_else(|| config.get("torch_dtype"));
    match name.and_then(Value::as_str) {
        Some("float16") => Dtype::F16,
        _ => Dtype::BF16,
    }
}

fn half_bytes(values: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::F16 => values
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        _ => values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
    }
}

fn write_model(
    fixtures: &Path,
    name: &str,
    config_json: &Value,
    tokenizer_json: &str,
    seed: u64,
) -> Result<(), AnyError> {
    let config_text = serde_json::to_string_pretty(config_json)?;
    let config = SalaConfig::from_json_str(&config_text, Path::new(name))?;
    <Backend as burn::tensor::backend::Backend>::seed(&Default::default(), seed);

    let mut specs = config.global_tensor_specs();
    for layer in 0..config.num_layers() {
        specs.extend(config.layer_tensor_specs(layer));
    }
    let dtype = storage_dtype(config_json);
    let mut bytes = BTreeMap::new();
    for spec in &specs {
        bytes.insert(
            spec.name.clone(),
            half_bytes(&init_tensor(spec, &config), dtype),
        );
    }
    let views = specs
        .iter()
        .map(|spec| {
            let view = TensorView::new(dtype, spec.shape.clone(), &bytes[&spec.name])?;
            Ok((spec.name.clone(), view))
        })
        .collect::<Result<BTreeMap<_, _>, safetensors::SafeTensorError>>()?;

    let tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .tempdir_in(fixtures)?;
    let dir = tmp.path();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors"))?;
    std::fs::write(dir.join("config.json"), config_text + "\n")?;
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json)?;
    write_json(&dir.join("generation_config.json"), &generation_config())?;
    write_json(&dir.join("tokenizer_config.json"), &tokenizer_config())?;
    write_json(&dir.join("special_tokens_map.json"), &special_tokens_map())?;

    let target = fixtures.join(name);
    if target.exists() {
        std::fs::remove_dir_all(&target)?;
    }
    std::fs::rename(tmp.keep(), &target)?;
    println!(
        "wrote {} ({} tensors, {} layers)",
        target.display(),
        specs.len(),
        config.num_layers()
    );
    Ok(())
}
