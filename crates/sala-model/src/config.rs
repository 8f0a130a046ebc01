//! `config.json`: the Hugging Face configuration of a MiniCPM-SALA or Llama model, parsed with
//! serde and validated, plus the tensor names and shapes it implies.
//!
//! Field meanings follow `MiniCPMSALAConfig` (see `docs/` and the design notes on the model) and
//! `LlamaConfig`. Fields this crate does not need (`auto_map`, `initializer_range`, ...) are
//! kept in [`HfConfig`] when present so that callers can read them, but never interpreted.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{ModelError, Result};

/// The model families this crate can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelArch {
    /// `MiniCPMSALAForCausalLM` (`model_type = "minicpm_sala"`): hybrid sparse + linear attention.
    MiniCpmSala,
    /// `LlamaForCausalLM` (`model_type = "llama"`): RoPE, GQA softmax attention, SwiGLU.
    Llama,
}

/// The token mixer of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// SALA `"minicpm4"`: GQA softmax attention without RoPE, sigmoid `o_gate` on the normed input.
    Minicpm4,
    /// SALA `"lightning-attn"`: Simple GLA with fixed per-head decay, qk-norm, RoPE, `o_norm`, `z_proj` gate.
    Lightning,
    /// Llama: GQA softmax attention with RoPE, no gate.
    Llama,
}

/// Head layout of one attention type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadDims {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (`heads % kv_heads == 0`).
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

impl HeadDims {
    /// Width of all query heads together, `heads * head_dim`.
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }
    /// Width of all key (or value) heads together, `kv_heads * head_dim`.
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// `sparse_config` of a SALA model (InfLLM-v2 parameters; only `dense_len` matters here).
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct SparseConfig {
    /// Tokens per key block.
    pub block_size: usize,
    /// Sequences with `total_len < dense_len` use plain causal attention in minicpm4 layers.
    pub dense_len: usize,
    /// Always-selected initial blocks.
    pub init_blocks: usize,
    /// Window of the first key compression.
    pub kernel_size: usize,
    /// Stride of the first key compression.
    pub kernel_stride: usize,
    /// Selected blocks per query.
    pub topk: usize,
    /// Whether compression uses keys without position encoding.
    pub use_nope: bool,
    /// Local window in tokens.
    pub window_size: usize,
}

/// A scalar or a list of token ids (`eos_token_id` is either in the wild).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum TokenIds {
    /// One id.
    One(u32),
    /// Several ids.
    Many(Vec<u32>),
}

/// `config.json` exactly as serde reads it, before validation. Optional fields are those that
/// only one of the two architectures has, or that have a documented default.
#[derive(Debug, Clone, Deserialize)]
pub struct HfConfig {
    /// e.g. `["MiniCPMSALAForCausalLM"]`.
    #[serde(default)]
    pub architectures: Vec<String>,
    /// `"minicpm_sala"` or `"llama"`.
    pub model_type: String,
    /// Storage dtype (`"bfloat16"`); older files call it `torch_dtype`.
    #[serde(default, alias = "torch_dtype")]
    pub dtype: Option<String>,
    /// Vocabulary size (rows of the embedding and of `lm_head`).
    pub vocab_size: usize,
    /// Residual stream width.
    pub hidden_size: usize,
    /// MLP inner width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// MLP activation; only `"silu"` is supported.
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// Query heads of softmax attention layers.
    pub num_attention_heads: usize,
    /// KV heads of softmax attention layers (defaults to `num_attention_heads`).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Head width (defaults to `hidden_size / num_attention_heads`).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Lightning heads (SALA).
    #[serde(default)]
    pub lightning_nh: Option<usize>,
    /// Lightning KV heads (SALA; must equal `lightning_nh`).
    #[serde(default)]
    pub lightning_nkv: Option<usize>,
    /// Lightning head width (SALA).
    #[serde(default)]
    pub lightning_head_dim: Option<usize>,
    /// Lightning attention scale; only `"1/sqrt(d)"` is supported.
    #[serde(default)]
    pub lightning_scale: Option<String>,
    /// RoPE in lightning layers (SALA; must be true).
    #[serde(default)]
    pub lightning_use_rope: Option<bool>,
    /// RoPE in minicpm4 layers (SALA; must be false).
    #[serde(default)]
    pub attn_use_rope: Option<bool>,
    /// q/k RMSNorm in lightning layers (SALA; must be true).
    #[serde(default)]
    pub qk_norm: Option<bool>,
    /// `o_norm` in lightning layers (SALA; must be true).
    #[serde(default)]
    pub use_output_norm: Option<bool>,
    /// `z_proj` gate in lightning layers (SALA; must be true).
    #[serde(default)]
    pub use_output_gate: Option<bool>,
    /// `o_gate` in minicpm4 layers (SALA; must be true).
    #[serde(default)]
    pub attn_use_output_gate: Option<bool>,
    /// Biases on q/k/v/o; only `false` is supported.
    #[serde(default)]
    pub attention_bias: bool,
    /// Biases on the MLP (Llama); only `false` is supported.
    #[serde(default)]
    pub mlp_bias: bool,
    /// RMSNorm epsilon (all norms).
    pub rms_norm_eps: f64,
    /// RoPE base (transformers 4; default 10000); transformers 5 writes it in
    /// `rope_parameters` instead.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// transformers 5's RoPE settings, `{"rope_type": "default", "rope_theta": …}`: only the
    /// default (unscaled) RoPE is supported.
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    /// RoPE scaling; only `null` is supported.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Longest position the model was built for.
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    /// µP embedding multiplier (SALA).
    #[serde(default)]
    pub scale_emb: Option<f64>,
    /// µP residual multiplier, divided by `sqrt(num_hidden_layers)` (SALA).
    #[serde(default)]
    pub scale_depth: Option<f64>,
    /// µP base width: logits are divided by `hidden_size / dim_model_base` (SALA).
    #[serde(default)]
    pub dim_model_base: Option<f64>,
    /// Unused by the forward pass (SALA).
    #[serde(default)]
    pub mup_denominator: Option<f64>,
    /// Whether `lm_head` reuses `model.embed_tokens.weight`.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Beginning-of-sequence id.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence id(s).
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    /// Padding id.
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    /// InfLLM-v2 parameters (SALA).
    #[serde(default)]
    pub sparse_config: Option<SparseConfig>,
    /// Per-layer mixer, `"minicpm4"` or `"lightning-attn"` (SALA).
    #[serde(default)]
    pub mixer_types: Option<Vec<String>>,
}

fn default_act() -> String {
    "silu".to_owned()
}

/// RoPE's base when the config names none (transformers' default).
pub const DEFAULT_ROPE_THETA: f64 = 10_000.0;

/// The RoPE base from `rope_theta` or transformers 5's `rope_parameters` (which must then agree),
/// refusing every scaled RoPE.
fn resolve_rope_theta(raw: &HfConfig) -> std::result::Result<f64, String> {
    let from_parameters = match &raw.rope_parameters {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::Object(map)) => {
            let kind = map.get("rope_type").or_else(|| map.get("type"));
            match kind.and_then(|k| k.as_str()) {
                None | Some("default") => {}
                Some(other) => {
                    return Err(format!(
                        "rope_parameters.rope_type {other:?} is not supported (only \"default\": \
                         scaled RoPE variants are not implemented)"
                    ))
                }
            }
            match map.get("rope_theta") {
                None => None,
                Some(v) => Some(v.as_f64().ok_or_else(|| {
                    format!("rope_parameters.rope_theta must be a number, got {v}")
                })?),
            }
        }
        Some(other) => return Err(format!("rope_parameters must be an object, got {other}")),
    };
    let theta = match (raw.rope_theta, from_parameters) {
        (Some(a), Some(b)) if a != b => {
            return Err(format!(
                "rope_theta {a} and rope_parameters.rope_theta {b} disagree"
            ))
        }
        (Some(a), _) => a,
        (None, Some(b)) => b,
        (None, None) => DEFAULT_ROPE_THETA,
    };
    if !(theta > 0.0 && theta.is_finite()) {
        return Err(format!("rope_theta must be positive, got {theta}"));
    }
    Ok(theta)
}

/// Full name and `[out, in]` shape of one linear layer (`y = x Wᵀ`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinearSpec {
    /// Module name without `.weight`, e.g. `model.layers.3.self_attn.q_proj`.
    pub name: String,
    /// Rows of the weight (output features).
    pub out_features: usize,
    /// Columns of the weight (input features).
    pub in_features: usize,
}

impl LinearSpec {
    /// The weight tensor's name in the checkpoint (`<name>.weight`).
    pub fn weight_name(&self) -> String {
        format!("{}.weight", self.name)
    }
}

/// Full name and shape of one tensor the configuration requires.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Tensor name in the checkpoint.
    pub name: String,
    /// Expected shape.
    pub shape: Vec<usize>,
}

/// A validated model configuration. Build it with [`SalaConfig::from_file`] or
/// [`SalaConfig::from_json_str`]; every accessor then answers without failing.
#[derive(Debug, Clone)]
pub struct SalaConfig {
    raw: HfConfig,
    arch: ModelArch,
    kinds: Vec<LayerKind>,
    attention: HeadDims,
    lightning: Option<HeadDims>,
    rope_theta: f64,
}

impl SalaConfig {
    /// Reads and validates `config.json` (or any file with its content).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::from_json_str(&text, path)
    }

    /// Parses and validates the JSON text; `path` only names the source in errors.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let raw: HfConfig = serde_json::from_str(text).map_err(|e| ModelError::Json {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        Self::validate(raw, path)
    }

    fn validate(raw: HfConfig, path: &Path) -> Result<Self> {
        let bad = |message: String| ModelError::Config {
            path: path.to_owned(),
            message,
        };
        let arch = match raw.model_type.as_str() {
            "minicpm_sala" => ModelArch::MiniCpmSala,
            "llama" => ModelArch::Llama,
            other => {
                return Err(bad(format!(
                    "model_type {other:?} is not supported (expected \"minicpm_sala\" or \"llama\")"
                )))
            }
        };
        check_common(&raw).map_err(&bad)?;
        let rope_theta = resolve_rope_theta(&raw).map_err(&bad)?;
        let attention = softmax_heads(&raw).map_err(&bad)?;
        check_sizes(&raw, &attention).map_err(&bad)?;
        let (kinds, lightning) = match arch {
            ModelArch::Llama => (vec![LayerKind::Llama; raw.num_hidden_layers], None),
            ModelArch::MiniCpmSala => {
                check_sala_fields(&raw).map_err(&bad)?;
                let kinds = sala_layer_kinds(&raw).map_err(&bad)?;
                (
                    kinds,
                    Some(lightning_heads(&raw, &attention).map_err(&bad)?),
                )
            }
        };
        Ok(Self {
            raw,
            arch,
            kinds,
            attention,
            lightning,
            rope_theta,
        })
    }

    /// The parsed file, for fields this type has no accessor for.
    pub fn raw(&self) -> &HfConfig {
        &self.raw
    }
    /// Which model family.
    pub fn arch(&self) -> ModelArch {
        self.arch
    }
    /// Decoder layers.
    pub fn num_layers(&self) -> usize {
        self.kinds.len()
    }
    /// Mixer of layer `layer` (panics if `layer >= num_layers()`, a caller bug).
    pub fn layer_kind(&self, layer: usize) -> LayerKind {
        self.kinds[layer]
    }
    /// Mixers of all layers, in order.
    pub fn layer_kinds(&self) -> &[LayerKind] {
        &self.kinds
    }
    /// Residual stream width.
    pub fn hidden_size(&self) -> usize {
        self.raw.hidden_size
    }
    /// MLP inner width.
    pub fn intermediate_size(&self) -> usize {
        self.raw.intermediate_size
    }
    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.raw.vocab_size
    }
    /// RMSNorm epsilon.
    pub fn rms_norm_eps(&self) -> f64 {
        self.raw.rms_norm_eps
    }
    /// RoPE base.
    pub fn rope_theta(&self) -> f64 {
        self.rope_theta
    }
    /// Head layout of the softmax attention layers (minicpm4 or Llama).
    pub fn attention_heads(&self) -> HeadDims {
        self.attention
    }
    /// Head layout of the lightning layers (`None` for Llama).
    pub fn lightning_heads(&self) -> Option<HeadDims> {
        self.lightning
    }
    /// Whether `lm_head` is the embedding matrix.
    pub fn tie_word_embeddings(&self) -> bool {
        self.raw.tie_word_embeddings
    }
    /// Embedding multiplier (`scale_emb`; 1 for Llama).
    pub fn embedding_scale(&self) -> f64 {
        self.raw.scale_emb.unwrap_or(1.0)
    }
    /// Multiplier of each residual branch, `scale_depth / sqrt(num_hidden_layers)` (1 for Llama).
    pub fn residual_scale(&self) -> f64 {
        match self.raw.scale_depth {
            Some(depth) => depth / (self.raw.num_hidden_layers as f64).sqrt(),
            None => 1.0,
        }
    }
    /// Divisor of the final hidden state before `lm_head`, `hidden_size / dim_model_base` (1 for Llama).
    pub fn logit_divisor(&self) -> f64 {
        match self.raw.dim_model_base {
            Some(base) => self.raw.hidden_size as f64 / base,
            None => 1.0,
        }
    }
    /// `sparse_config.dense_len` (SALA), the sequence length from which minicpm4 layers go sparse.
    pub fn dense_len(&self) -> Option<usize> {
        self.raw.sparse_config.as_ref().map(|s| s.dense_len)
    }

    /// The linear layers of decoder layer `layer`, in forward order, with full HF names.
    pub fn linear_specs(&self, layer: usize) -> Vec<LinearSpec> {
        let hidden = self.hidden_size();
        let inter = self.intermediate_size();
        let attn = |name: &str| format!("model.layers.{layer}.self_attn.{name}");
        let mlp = |name: &str| format!("model.layers.{layer}.mlp.{name}");
        let spec = |name: String, out_features, in_features| LinearSpec {
            name,
            out_features,
            in_features,
        };
        let mut specs = match self.layer_kind(layer) {
            LayerKind::Minicpm4 | LayerKind::Llama => {
                let h = self.attention;
                let mut v = vec![
                    spec(attn("q_proj"), h.q_width(), hidden),
                    spec(attn("k_proj"), h.kv_width(), hidden),
                    spec(attn("v_proj"), h.kv_width(), hidden),
                ];
                if self.layer_kind(layer) == LayerKind::Minicpm4 {
                    v.push(spec(attn("o_gate"), h.q_width(), hidden));
                }
                v.push(spec(attn("o_proj"), hidden, h.q_width()));
                v
            }
            LayerKind::Lightning => {
                let w = self.lightning.map(|h| h.q_width()).unwrap_or_default();
                vec![
                    spec(attn("q_proj"), w, hidden),
                    spec(attn("k_proj"), w, hidden),
                    spec(attn("v_proj"), w, hidden),
                    spec(attn("z_proj"), w, hidden),
                    spec(attn("o_proj"), hidden, w),
                ]
            }
        };
        specs.push(spec(mlp("gate_proj"), inter, hidden));
        specs.push(spec(mlp("up_proj"), inter, hidden));
        specs.push(spec(mlp("down_proj"), hidden, inter));
        specs
    }

    /// Every tensor of decoder layer `layer` (norm weights, then linear weights).
    pub fn layer_tensor_specs(&self, layer: usize) -> Vec<TensorSpec> {
        let hidden = self.hidden_size();
        let prefix = format!("model.layers.{layer}");
        let mut specs = vec![
            TensorSpec {
                name: format!("{prefix}.input_layernorm.weight"),
                shape: vec![hidden],
            },
            TensorSpec {
                name: format!("{prefix}.post_attention_layernorm.weight"),
                shape: vec![hidden],
            },
        ];
        if let (LayerKind::Lightning, Some(h)) = (self.layer_kind(layer), self.lightning) {
            for (name, width) in [
                ("q_norm", h.head_dim),
                ("k_norm", h.head_dim),
                ("o_norm", h.q_width()),
            ] {
                specs.push(TensorSpec {
                    name: format!("{prefix}.self_attn.{name}.weight"),
                    shape: vec![width],
                });
            }
        }
        specs.extend(self.linear_specs(layer).into_iter().map(|l| TensorSpec {
            name: l.weight_name(),
            shape: vec![l.out_features, l.in_features],
        }));
        specs
    }

    /// Tensors outside the decoder layers: embedding, final norm and (unless tied) `lm_head`.
    pub fn global_tensor_specs(&self) -> Vec<TensorSpec> {
        let matrix = vec![self.vocab_size(), self.hidden_size()];
        let mut specs = vec![
            TensorSpec {
                name: EMBED_TOKENS.to_owned(),
                shape: matrix.clone(),
            },
            TensorSpec {
                name: FINAL_NORM.to_owned(),
                shape: vec![self.hidden_size()],
            },
        ];
        if !self.tie_word_embeddings() {
            specs.push(TensorSpec {
                name: LM_HEAD.to_owned(),
                shape: matrix,
            });
        }
        specs
    }

    /// Name of the matrix `lm_head` uses (the embedding when tied).
    pub fn lm_head_name(&self) -> &'static str {
        if self.tie_word_embeddings() {
            EMBED_TOKENS
        } else {
            LM_HEAD
        }
    }
}

/// Name of the token embedding matrix `[vocab, hidden]`.
pub const EMBED_TOKENS: &str = "model.embed_tokens.weight";
/// Name of the final RMSNorm weight `[hidden]`.
pub const FINAL_NORM: &str = "model.norm.weight";
/// Name of the output projection `[vocab, hidden]`.
pub const LM_HEAD: &str = "lm_head.weight";

type Check = std::result::Result<(), String>;

fn check_common(raw: &HfConfig) -> Check {
    for (name, value) in [
        ("vocab_size", raw.vocab_size),
        ("hidden_size", raw.hidden_size),
        ("intermediate_size", raw.intermediate_size),
        ("num_hidden_layers", raw.num_hidden_layers),
        ("num_attention_heads", raw.num_attention_heads),
    ] {
        if value == 0 {
            return Err(format!("{name} must be positive"));
        }
    }
    if raw.hidden_act != "silu" {
        return Err(format!(
            "hidden_act {:?} is not supported (only \"silu\")",
            raw.hidden_act
        ));
    }
    if raw.attention_bias || raw.mlp_bias {
        return Err(
            "attention_bias / mlp_bias = true is not supported (the graph has no bias terms)"
                .to_owned(),
        );
    }
    if raw.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
        return Err("rope_scaling is not supported (only null)".to_owned());
    }
    if !(raw.rms_norm_eps > 0.0 && raw.rms_norm_eps.is_finite()) {
        return Err(format!(
            "rms_norm_eps must be positive, got {}",
            raw.rms_norm_eps
        ));
    }
    Ok(())
}

/// The most decoder layers a config may declare (the released model has 32).
pub const MAX_LAYERS: usize = 4096;

/// Every size the model derives from the config, computed with checked arithmetic: each
/// tensor's elements as f32 bytes must fit the address space, so no later product of them
/// (shapes, byte counts, allocations) can overflow. The error names the fields.
fn check_sizes(raw: &HfConfig, attention: &HeadDims) -> Check {
    if raw.num_hidden_layers > MAX_LAYERS {
        return Err(format!(
            "num_hidden_layers {} is more than {MAX_LAYERS}",
            raw.num_hidden_layers
        ));
    }
    let limit = isize::MAX as usize / 4;
    let product = |fields: &[(&str, usize)]| -> std::result::Result<usize, String> {
        let value = fields
            .iter()
            .try_fold(1usize, |acc, &(_, v)| acc.checked_mul(v))
            .filter(|&v| v <= limit);
        value.ok_or_else(|| {
            let names: Vec<&str> = fields.iter().map(|(n, _)| *n).collect();
            let values: Vec<String> = fields.iter().map(|(_, v)| v.to_string()).collect();
            format!(
                "{} = {} overflows (a tensor's f32 bytes must fit the address space)",
                names.join(" × "),
                values.join(" × ")
            )
        })
    };
    let heads = ("num_attention_heads", attention.heads);
    let kv_heads = ("num_key_value_heads", attention.kv_heads);
    let head_dim = ("head_dim", attention.head_dim);
    let hidden = ("hidden_size", raw.hidden_size);
    product(&[heads, head_dim, hidden])?;
    product(&[kv_heads, head_dim, hidden])?;
    product(&[("vocab_size", raw.vocab_size), hidden])?;
    product(&[("intermediate_size", raw.intermediate_size), hidden])?;
    if let (Some(nh), Some(d)) = (raw.lightning_nh, raw.lightning_head_dim) {
        product(&[("lightning_nh", nh), ("lightning_head_dim", d), hidden])?;
    }
    Ok(())
}

fn softmax_heads(raw: &HfConfig) -> std::result::Result<HeadDims, String> {
    let heads = raw.num_attention_heads;
    let kv_heads = raw.num_key_value_heads.unwrap_or(heads);
    let head_dim = match raw.head_dim {
        Some(d) => d,
        None if raw.hidden_size % heads == 0 => raw.hidden_size / heads,
        None => {
            return Err(format!(
            "hidden_size {} is not divisible by num_attention_heads {heads} and head_dim is absent",
            raw.hidden_size
        ))
        }
    };
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(format!(
            "num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        ));
    }
    if head_dim == 0 || head_dim % 2 != 0 {
        return Err(format!("head_dim {head_dim} must be even and positive"));
    }
    Ok(HeadDims {
        heads,
        kv_heads,
        head_dim,
    })
}

fn required<T: Copy>(value: Option<T>, name: &str) -> std::result::Result<T, String> {
    value.ok_or_else(|| format!("missing field {name} (required for minicpm_sala)"))
}

/// The SALA switches select code paths; this crate implements the released model's values only.
fn check_sala_fields(raw: &HfConfig) -> Check {
    for (name, value, wanted) in [
        ("lightning_use_rope", raw.lightning_use_rope, true),
        ("attn_use_rope", raw.attn_use_rope, false),
        ("qk_norm", raw.qk_norm, true),
        ("use_output_norm", raw.use_output_norm, true),
        ("use_output_gate", raw.use_output_gate, true),
        ("attn_use_output_gate", raw.attn_use_output_gate, true),
    ] {
        if required(value, name)? != wanted {
            return Err(format!(
                "{name} = {} is not supported (the released MiniCPM-SALA uses {wanted})",
                !wanted
            ));
        }
    }
    for (name, value) in [
        ("scale_emb", raw.scale_emb),
        ("scale_depth", raw.scale_depth),
        ("dim_model_base", raw.dim_model_base),
    ] {
        let v = required(value, name)?;
        if !(v > 0.0 && v.is_finite()) {
            return Err(format!("{name} must be positive, got {v}"));
        }
    }
    match raw.lightning_scale.as_deref() {
        Some("1/sqrt(d)") => {}
        other => {
            return Err(format!(
                "lightning_scale {other:?} is not supported (only \"1/sqrt(d)\")"
            ))
        }
    }
    if raw.sparse_config.is_none() {
        return Err("missing field sparse_config (required for minicpm_sala)".to_owned());
    }
    Ok(())
}

fn sala_layer_kinds(raw: &HfConfig) -> std::result::Result<Vec<LayerKind>, String> {
    let types = raw
        .mixer_types
        .as_ref()
        .ok_or("missing field mixer_types (required for minicpm_sala)")?;
    if types.len() != raw.num_hidden_layers {
        return Err(format!(
            "mixer_types has {} entries but num_hidden_layers is {}",
            types.len(),
            raw.num_hidden_layers
        ));
    }
    types
        .iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            "minicpm4" => Ok(LayerKind::Minicpm4),
            // The original scripts accept these spellings; the released config uses "lightning-attn".
            "lightning-attn" | "lightning_attn" | "lightning" => Ok(LayerKind::Lightning),
            other => Err(format!(
                "mixer_types[{i}] = {other:?} is unknown (expected \"minicpm4\" or \"lightning-attn\")"
            )),
        })
        .collect()
}

/// HF builds lightning layers from `num_attention_heads`/`head_dim`, SGLang and vLLM from the
/// `lightning_*` fields; a config where they differ would give different models, so refuse it.
fn lightning_heads(raw: &HfConfig, softmax: &HeadDims) -> std::result::Result<HeadDims, String> {
    let heads = required(raw.lightning_nh, "lightning_nh")?;
    let kv_heads = required(raw.lightning_nkv, "lightning_nkv")?;
    let head_dim = required(raw.lightning_head_dim, "lightning_head_dim")?;
    if kv_heads != heads {
        return Err(format!(
            "lightning_nkv {kv_heads} differs from lightning_nh {heads} (lightning layers are MHA)"
        ));
    }
    if heads != softmax.heads || head_dim != softmax.head_dim {
        return Err(format!(
            "lightning heads {heads}x{head_dim} differ from num_attention_heads x head_dim {}x{} \
             (HF and SGLang would build different models)",
            softmax.heads, softmax.head_dim
        ));
    }
    if !heads.is_power_of_two() {
        return Err(format!(
            "lightning_nh {heads} is not a power of two: the ALiBi decay slopes are defined only for powers of two"
        ));
    }
    Ok(HeadDims {
        heads,
        kv_heads,
        head_dim,
    })
}

/// `config.json` inside a model directory.
pub fn config_path(model_dir: &Path) -> PathBuf {
    model_dir.join("config.json")
}
