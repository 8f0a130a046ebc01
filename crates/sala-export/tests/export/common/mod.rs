//! A tiny two-layer Llama/SALA-shaped model with seeded random weights, written in either
//! format by the real writer, with hooks to break one thing at a time.
#![allow(dead_code)] // each test binary uses a different part

use std::fs;
use std::path::{Path, PathBuf};

use proptest::prelude::RngExt;
use proptest::test_runner::{RngAlgorithm, TestRng};
use sala_export::{
    CheckpointWriter, Dtype, GptqConfig, Nvfp4Config, QuantizationConfig, WriterOptions,
    WrittenCheckpoint,
};
use sala_formats::gptq_pack::sequential_g_idx;
use sala_formats::nvfp4::global_scale_from_amax;
use sala_formats::{
    quantize_groupwise, BlockScales, GptqPacked, IntQuantizer, IntScheme, Nvfp4Matrix,
    ZeroConvention,
};
use serde_json::{json, Value};

pub const HIDDEN: usize = 128;
pub const INTERMEDIATE: usize = 256;
pub const KV: usize = 64;
pub const VOCAB: usize = 64;
pub const LAYERS: usize = 2;
pub const GROUP: usize = 64;

/// `(name inside the layer, out, in)`.
pub const LINEARS: [(&str, usize, usize); 7] = [
    ("self_attn.q_proj", HIDDEN, HIDDEN),
    ("self_attn.k_proj", KV, HIDDEN),
    ("self_attn.v_proj", KV, HIDDEN),
    ("self_attn.o_proj", HIDDEN, HIDDEN),
    ("mlp.gate_proj", INTERMEDIATE, HIDDEN),
    ("mlp.up_proj", INTERMEDIATE, HIDDEN),
    ("mlp.down_proj", HIDDEN, INTERMEDIATE),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Gptq,
    Nvfp4,
}

/// One linear as it will be handed to the writer (hooks may change it).
#[derive(Debug, Clone)]
pub enum Linear {
    Gptq(GptqPacked),
    Nvfp4(Nvfp4Matrix, f32),
    /// bf16-kept weight `[out, in]`.
    Dense(Vec<f32>, usize, usize),
}

pub fn rng(seed: u64) -> TestRng {
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes)
}

pub fn random(rng: &mut TestRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-0.5f32..0.5)).collect()
}

/// Round-to-nearest symmetric INT4, group 64, packed AutoGPTQ v1.
pub fn gptq_linear(weights: &[f32], out: usize, inp: usize) -> GptqPacked {
    let q = IntQuantizer::new(4, IntScheme::SymmetricIst).unwrap();
    let rtn = quantize_groupwise(weights, out, inp, GROUP, q).unwrap();
    let g_idx = sequential_g_idx(inp, GROUP).unwrap();
    GptqPacked::pack(
        &rtn.codes,
        &rtn.params,
        &g_idx,
        out,
        inp,
        4,
        GROUP,
        ZeroConvention::V1,
    )
    .unwrap()
}

fn amax(values: &[f32]) -> f32 {
    values.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

pub fn layer_module(layer: usize, name: &str) -> String {
    format!("model.layers.{layer}.{name}")
}

/// Every linear of the model with its random weight, in writing order.
pub fn random_weights(seed: u64) -> Vec<(String, Vec<f32>, usize, usize)> {
    let mut rng = rng(seed);
    (0..LAYERS)
        .flat_map(|l| {
            LINEARS
                .iter()
                .map(move |&(n, o, i)| (layer_module(l, n), o, i))
        })
        .map(|(module, out, inp)| {
            let w = random(&mut rng, out * inp);
            (module, w, out, inp)
        })
        .collect()
}

/// The linears in `format`; modules in `dense` stay bf16. NVFP4 fused groups share one global
/// scale (from the group amax) and one input scale.
pub fn build_linears(format: Format, dense: &[&str], seed: u64) -> Vec<(String, Linear)> {
    let weights = random_weights(seed);
    let group_amax = |module: &str| {
        let key = fused_key(module);
        weights
            .iter()
            .filter(|(m, ..)| fused_key(m) == key)
            .map(|(_, w, ..)| amax(w))
            .fold(0.0f32, f32::max)
    };
    weights
        .iter()
        .map(|(module, w, out, inp)| {
            let linear = if dense.contains(&module.as_str()) {
                Linear::Dense(w.clone(), *out, *inp)
            } else {
                match format {
                    Format::Gptq => Linear::Gptq(gptq_linear(w, *out, *inp)),
                    Format::Nvfp4 => {
                        let global = global_scale_from_amax(group_amax(module)).unwrap();
                        let m =
                            Nvfp4Matrix::quantize(w, *out, *inp, global, BlockScales::Max).unwrap();
                        let input_scale =
                            global_scale_from_amax(3.0 + fused_key(module).len() as f32).unwrap();
                        Linear::Nvfp4(m, input_scale)
                    }
                }
            };
            (module.clone(), linear)
        })
        .collect()
}

/// The fused layer a module belongs to (or itself).
pub fn fused_key(module: &str) -> String {
    match sala_export::modules::fused_member(module) {
        Some(m) => m.fused_module(),
        None => module.to_string(),
    }
}

pub fn model_config() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "vocab_size": VOCAB,
        "torch_dtype": "bfloat16"
    })
}

/// A source model directory with the files a real one has besides weights.
pub fn source_model(root: &Path) -> PathBuf {
    let dir = root.join("source-model");
    fs::create_dir_all(&dir).unwrap();
    let files = [
        ("config.json", model_config().to_string()),
        ("tokenizer.json", "{\"model\": {}}".to_string()),
        ("tokenizer_config.json", "{}".to_string()),
        ("tokenizer.model", "sentencepiece bytes".to_string()),
        ("chat_template.jinja", "{{ messages }}".to_string()),
        (
            "generation_config.json",
            "{\"eos_token_id\": 2}".to_string(),
        ),
        ("modeling_minicpm.py", "# remote code".to_string()),
        ("model.safetensors", "not copied".to_string()),
        ("notes.txt", "not copied".to_string()),
    ];
    for (name, text) in files {
        fs::write(dir.join(name), text).unwrap();
    }
    dir
}

/// The quantization config matching `dense` (skip rules / exclusions for the bf16 modules).
pub fn quant_config(format: Format, dense: &[&str]) -> QuantizationConfig {
    match format {
        Format::Gptq => {
            let mut c = GptqConfig::new(4, GROUP as i64);
            for m in dense {
                c.skip_module(m);
            }
            QuantizationConfig::Gptq(c)
        }
        Format::Nvfp4 => {
            let mut exclude: Vec<String> = dense.iter().map(|m| m.to_string()).collect();
            exclude.push("lm_head".to_string());
            QuantizationConfig::Nvfp4(Nvfp4Config::new(exclude))
        }
    }
}

/// Passthrough tensors: embeddings, norms and lm_head in bf16.
pub fn passthrough(seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut rng = rng(seed ^ 0xA5A5);
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![VOCAB, HIDDEN],
        random(&mut rng, VOCAB * HIDDEN),
    )];
    for l in 0..LAYERS {
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            let values = random(&mut rng, HIDDEN).iter().map(|v| 1.0 + v).collect();
            out.push((
                layer_module(l, &format!("{norm}.weight")),
                vec![HIDDEN],
                values,
            ));
        }
    }
    out.push((
        "model.norm.weight".to_string(),
        vec![HIDDEN],
        vec![1.0; HIDDEN],
    ));
    out.push((
        "lm_head.weight".to_string(),
        vec![VOCAB, HIDDEN],
        random(&mut rng, VOCAB * HIDDEN),
    ));
    out
}

pub fn write_linear(w: &mut CheckpointWriter, module: &str, linear: &Linear) {
    match linear {
        Linear::Gptq(p) => w.add_gptq_linear(module, p).unwrap(),
        Linear::Nvfp4(m, s) => w.add_nvfp4_linear(module, m, *s).unwrap(),
        Linear::Dense(v, o, i) => w
            .add_f32(&format!("{module}.weight"), Dtype::BF16, &[*o, *i], v)
            .unwrap(),
    }
}

/// Small shards so that the fixture has an index and several files.
pub const SMALL_SHARDS: u64 = 24_000;

/// Writes the fixture; `hook` may change any linear before it is written.
pub fn write_fixture(
    target: &Path,
    format: Format,
    dense: &[&str],
    mut hook: impl FnMut(&str, &mut Linear),
) -> WrittenCheckpoint {
    let source = source_model(target.parent().unwrap());
    let options = WriterOptions {
        max_shard_bytes: SMALL_SHARDS,
        overwrite: false,
        source_model: Some(source),
    };
    let mut writer = CheckpointWriter::create(target, options).unwrap();
    for (name, shape, values) in passthrough(7) {
        writer.add_f32(&name, Dtype::BF16, &shape, &values).unwrap();
    }
    for (module, mut linear) in build_linears(format, dense, 7) {
        hook(&module, &mut linear);
        write_linear(&mut writer, &module, &linear);
    }
    writer
        .finish(model_config(), &quant_config(format, dense))
        .unwrap()
}

/// Rewrites a JSON file in place.
pub fn edit_json(path: &Path, edit: impl FnOnce(&mut Value)) {
    let mut value: Value = serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut value);
    fs::write(path, serde_json::to_string_pretty(&value).unwrap()).unwrap();
}

/// Directory entries, sorted.
pub fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}
