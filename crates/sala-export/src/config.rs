//! The quantization configs the loaders read, as serde types.
//!
//! - GPTQ: `config.json["quantization_config"]` and `quantize_config.json`, identical (AutoGPTQ /
//!   GPTQModel keys; vLLM and SGLang require `bits, group_size, desc_act, sym`). Mixed precision
//!   is GPTQModel's `dynamic`: `-:regex` leaves matching modules in 16 bits, `+:regex` overrides
//!   `bits` / `group_size` / `desc_act` / `sym`. The loaders apply `re.match` (anchored at the
//!   start) to the *fused* layer name (`qkv_proj`, `gate_up_proj`), so the per-module patterns
//!   written here match both the module and its fused layer.
//! - NVFP4: `hf_quant_config.json` (nested, ModelOpt) and a flat `config.json` quantization
//!   config with `quant_method: "modelopt"` and **both** `ignore` (what SGLang's flat parser
//!   reads) and `exclude_modules` (what the nested parser and vLLM read).

use std::collections::BTreeMap;
use std::path::Path;

use regex::Regex;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::modules::fused_member;
use crate::ExportError;

/// `config.json`.
pub const CONFIG_FILE: &str = "config.json";
/// AutoGPTQ's copy of the GPTQ quantization config.
pub const QUANTIZE_CONFIG_FILE: &str = "quantize_config.json";
/// ModelOpt's quantization config.
pub const HF_QUANT_CONFIG_FILE: &str = "hf_quant_config.json";
/// The name this project writes as producer / quantizer.
pub const PRODUCER: &str = "sala-quant";

/// Group sizes `gptq_marlin` accepts (`-1` = one group per output channel).
pub const MARLIN_GROUP_SIZES: [i64; 4] = [-1, 32, 64, 128];

/// Reads a JSON file.
pub fn read_json(path: &Path) -> Result<Value, ExportError> {
    let text = std::fs::read_to_string(path).map_err(ExportError::io(path))?;
    serde_json::from_str(&text).map_err(|e| ExportError::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// Writes a value as pretty JSON with a trailing newline.
pub fn write_json<T: Serialize + ?Sized>(path: &Path, value: &T) -> Result<(), ExportError> {
    let mut text = serde_json::to_string_pretty(value).map_err(|e| ExportError::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    text.push('\n');
    std::fs::write(path, text).map_err(ExportError::io(path))
}

/// Which quantization config a checkpoint carries.
#[derive(Debug, Clone, PartialEq)]
pub enum QuantizationConfig {
    /// AutoGPTQ layout, served by `gptq_marlin`.
    Gptq(GptqConfig),
    /// ModelOpt NVFP4 layout.
    Nvfp4(Nvfp4Config),
}

/// Per-module overrides of a GPTQ `dynamic` entry (absent keys keep the base value).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DynamicOverride {
    /// Bits per weight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bits: Option<u32>,
    /// Input columns per group (`-1`: per channel).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_size: Option<i64>,
    /// Act-order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desc_act: Option<bool>,
    /// Symmetric grid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sym: Option<bool>,
}

/// `meta` of a GPTQModel config.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GptqMeta {
    /// Tools that produced the checkpoint, `"name:version"`.
    #[serde(default)]
    pub quantizer: Vec<String>,
}

/// The GPTQ quantization config (AutoGPTQ v1 layout, never `marlin`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GptqConfig {
    /// Bits per weight of quantized modules (4 or 8 for `gptq_marlin`).
    pub bits: u32,
    /// Input columns per group; `-1` means one group per output channel.
    pub group_size: i64,
    /// Act-order (`g_idx` is a permutation); `false` for plain Marlin. Read as `false` when
    /// absent (the verifier reports the missing key: vLLM and SGLang require it).
    #[serde(default)]
    pub desc_act: bool,
    /// Symmetric grid (zero `2^(bits−1)`). Read as `true` when absent, as AutoGPTQ does.
    #[serde(default = "default_sym")]
    pub sym: bool,
    /// Group parameters fixed before the GPTQ sweep.
    #[serde(default)]
    pub static_groups: bool,
    /// Relative Hessian damping (`0.01` = 1 % of the mean diagonal).
    #[serde(default = "default_damp_percent")]
    pub damp_percent: f64,
    /// Sub-blocks quantized in sequence.
    #[serde(default)]
    pub true_sequential: bool,
    /// Whether `lm_head` is quantized.
    #[serde(default)]
    pub lm_head: bool,
    /// Always `"gptq"`.
    pub quant_method: String,
    /// `"gptq"` (v1 zeros); `"gptq_v2"` is read but never written.
    #[serde(default = "default_checkpoint_format")]
    pub checkpoint_format: String,
    /// GPTQModel / vLLM per-module overrides, keyed by `-:regex` or `+:regex`.
    #[serde(default)]
    pub dynamic: BTreeMap<String, DynamicOverride>,
    /// Producer information.
    #[serde(default)]
    pub meta: GptqMeta,
}

fn default_sym() -> bool {
    true
}

fn default_damp_percent() -> f64 {
    0.01
}

fn default_checkpoint_format() -> String {
    "gptq".to_string()
}

/// The precision a module gets under a GPTQ config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModulePrecision {
    /// Left in 16 bits by a `-:` rule.
    Skipped,
    /// Quantized with these parameters.
    Quantized {
        /// Bits per weight.
        bits: u32,
        /// Group size (`-1`: per channel).
        group_size: i64,
        /// Act-order.
        desc_act: bool,
        /// Symmetric.
        sym: bool,
    },
}

/// A GPTQ config's `dynamic` rules, compiled.
#[derive(Debug, Clone)]
pub struct DynamicRules {
    base: GptqConfig,
    rules: Vec<(bool, Regex, DynamicOverride)>,
}

impl DynamicRules {
    /// The precision of `module`: the first rule whose regex matches at the start of the name
    /// (Python's `re.match`, as vLLM's `get_dynamic_override`), else the base config.
    pub fn precision(&self, module: &str) -> ModulePrecision {
        let over = match self.rules.iter().find(|(_, re, _)| re.is_match(module)) {
            Some((true, _, _)) => return ModulePrecision::Skipped,
            Some((false, _, over)) => over.clone(),
            None => DynamicOverride::default(),
        };
        ModulePrecision::Quantized {
            bits: over.bits.unwrap_or(self.base.bits),
            group_size: over.group_size.unwrap_or(self.base.group_size),
            desc_act: over.desc_act.unwrap_or(self.base.desc_act),
            sym: over.sym.unwrap_or(self.base.sym),
        }
    }
}

impl GptqConfig {
    /// A config for symmetric `bits`-bit GPTQ with `group_size` columns per group, no act-order,
    /// 1 % damping, true-sequential, `lm_head` not quantized, v1 zeros.
    pub fn new(bits: u32, group_size: i64) -> Self {
        Self {
            bits,
            group_size,
            desc_act: false,
            sym: true,
            static_groups: false,
            damp_percent: default_damp_percent(),
            true_sequential: true,
            lm_head: false,
            quant_method: "gptq".to_string(),
            checkpoint_format: default_checkpoint_format(),
            dynamic: BTreeMap::new(),
            meta: GptqMeta {
                quantizer: vec![format!("{PRODUCER}:{}", env!("CARGO_PKG_VERSION"))],
            },
        }
    }

    /// Leaves `module` (and its fused layer) in 16 bits: adds `-:<pattern>` to `dynamic`.
    pub fn skip_module(&mut self, module: &str) {
        self.dynamic.insert(
            format!("-:{}", module_pattern(module)),
            DynamicOverride::default(),
        );
    }

    /// Gives `module` (and its fused layer) its own parameters: adds `+:<pattern>`.
    pub fn override_module(&mut self, module: &str, over: DynamicOverride) {
        self.dynamic
            .insert(format!("+:{}", module_pattern(module)), over);
    }

    /// Compiles `dynamic`; an invalid regex is reported with its key.
    pub fn rules(&self) -> Result<DynamicRules, (String, regex::Error)> {
        let rules = self
            .dynamic
            .iter()
            .map(|(key, over)| {
                let (skip, pattern) = match key.strip_prefix("-:") {
                    Some(p) => (true, p),
                    None => (false, key.strip_prefix("+:").unwrap_or(key)),
                };
                // `re.match` anchors at the start only.
                Regex::new(&format!("^(?:{pattern})"))
                    .map(|re| (skip, re, over.clone()))
                    .map_err(|e| (key.clone(), e))
            })
            .collect::<Result<_, _>>()?;
        Ok(DynamicRules {
            base: self.clone(),
            rules,
        })
    }
}

/// An anchored regex matching exactly `module` and, for a fused member, its fused layer
/// (`…\.self_attn\.(?:k_proj|qkv_proj)$`), since the loaders match the fused name.
pub fn module_pattern(module: &str) -> String {
    match fused_member(module) {
        Some(m) => format!(
            "{}\\.(?:{}|{})$",
            regex::escape(m.parent),
            m.member,
            m.kind.fused_name()
        ),
        None => format!("{}$", regex::escape(module)),
    }
}

/// `producer` of ModelOpt configs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Producer {
    /// Tool name.
    pub name: String,
    /// Tool version.
    pub version: String,
}

impl Default for Producer {
    fn default() -> Self {
        Self {
            name: PRODUCER.to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }
}

/// The NVFP4 quantization config (ModelOpt, `quant_algo: "NVFP4"`, group 16).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Nvfp4Config {
    /// KV-cache quantization (`None`: not quantized, written as `null`).
    pub kv_cache_quant_algo: Option<String>,
    /// Unfused module names (or `*` wildcards) left in 16 bits; `[]` when none.
    pub exclude_modules: Vec<String>,
    /// Who wrote the checkpoint.
    pub producer: Producer,
}

/// The nested `hf_quant_config.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HfQuantConfig {
    /// Who wrote the checkpoint.
    pub producer: Producer,
    /// The quantization section.
    pub quantization: HfQuantization,
}

/// `hf_quant_config.json["quantization"]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HfQuantization {
    /// `"NVFP4"`.
    pub quant_algo: String,
    /// KV-cache algorithm or `null`.
    pub kv_cache_quant_algo: Option<String>,
    /// Elements per block scale (16).
    pub group_size: u32,
    /// Modules left unquantized (SGLang raises if this is `null`).
    pub exclude_modules: Vec<String>,
}

/// One `config_groups` entry's argument set (`weights` or `input_activations`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FloatArgs {
    /// Static scales.
    pub dynamic: bool,
    /// 4.
    pub num_bits: u32,
    /// `"float"`.
    #[serde(rename = "type")]
    pub kind: String,
    /// 16.
    pub group_size: u32,
}

/// One `config_groups` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfigGroup {
    /// Activation quantization.
    pub input_activations: FloatArgs,
    /// Weight quantization.
    pub weights: FloatArgs,
    /// `["Linear"]`.
    pub targets: Vec<String>,
}

/// The flat `config.json["quantization_config"]` of an NVFP4 checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModeloptFlatConfig {
    /// `"modelopt"`.
    pub quant_method: String,
    /// `"NVFP4"`.
    pub quant_algo: String,
    /// KV-cache algorithm or `null`.
    pub kv_cache_quant_algo: Option<String>,
    /// 16.
    pub group_size: u32,
    /// Excluded modules, as SGLang's flat parser reads them.
    pub ignore: Vec<String>,
    /// The same list, as the nested parser and vLLM read it.
    pub exclude_modules: Vec<String>,
    /// `{"group_0": …}` as ModelOpt writes it.
    pub config_groups: BTreeMap<String, ConfigGroup>,
    /// Who wrote the checkpoint.
    pub producer: Producer,
}

/// NVFP4 elements per block scale.
pub const NVFP4_GROUP_SIZE: u32 = 16;

impl Nvfp4Config {
    /// A config excluding `exclude_modules` (unfused names), KV cache not quantized.
    pub fn new(exclude_modules: Vec<String>) -> Self {
        Self {
            kv_cache_quant_algo: None,
            exclude_modules,
            producer: Producer::default(),
        }
    }

    /// `hf_quant_config.json`.
    pub fn hf_quant_config(&self) -> HfQuantConfig {
        HfQuantConfig {
            producer: self.producer.clone(),
            quantization: HfQuantization {
                quant_algo: "NVFP4".to_string(),
                kv_cache_quant_algo: self.kv_cache_quant_algo.clone(),
                group_size: NVFP4_GROUP_SIZE,
                exclude_modules: self.exclude_modules.clone(),
            },
        }
    }

    /// The flat `config.json["quantization_config"]`.
    pub fn flat_config(&self) -> ModeloptFlatConfig {
        let args = FloatArgs {
            dynamic: false,
            num_bits: 4,
            kind: "float".to_string(),
            group_size: NVFP4_GROUP_SIZE,
        };
        let group = ConfigGroup {
            input_activations: args.clone(),
            weights: args,
            targets: vec!["Linear".to_string()],
        };
        ModeloptFlatConfig {
            quant_method: "modelopt".to_string(),
            quant_algo: "NVFP4".to_string(),
            kv_cache_quant_algo: self.kv_cache_quant_algo.clone(),
            group_size: NVFP4_GROUP_SIZE,
            ignore: self.exclude_modules.clone(),
            exclude_modules: self.exclude_modules.clone(),
            config_groups: BTreeMap::from([("group_0".to_string(), group)]),
            producer: self.producer.clone(),
        }
    }

    /// Reads the flat form (`ignore` / `exclude_modules` at top level) or the nested form
    /// (`quantization.exclude_modules`); `None` if neither list is present.
    pub fn from_json(value: &Value) -> Option<Self> {
        let section = value.get("quantization").unwrap_or(value);
        let list = section
            .get("exclude_modules")
            .or_else(|| section.get("ignore"))?;
        let exclude_modules = serde_json::from_value(list.clone()).ok()?;
        let producer = value
            .get("producer")
            .and_then(|p| serde_json::from_value(p.clone()).ok())
            .unwrap_or_default();
        Some(Self {
            kv_cache_quant_algo: section
                .get("kv_cache_quant_algo")
                .and_then(Value::as_str)
                .map(str::to_string),
            exclude_modules,
            producer,
        })
    }

    /// Compiled exclusion patterns; see [`Exclusions::excludes`].
    pub fn exclusions(&self) -> Exclusions {
        Exclusions::new(&self.exclude_modules)
    }
}

/// `exclude_modules` patterns, compiled.
#[derive(Debug, Clone)]
pub struct Exclusions {
    patterns: Vec<(String, Option<Regex>)>,
}

impl Exclusions {
    fn new(patterns: &[String]) -> Self {
        let compile = |p: &str| {
            let glob = regex::escape(p).replace(r"\*", ".*");
            Regex::new(&format!("^(?:{glob})$")).ok()
        };
        Self {
            patterns: patterns
                .iter()
                .map(|p| (p.clone(), p.contains('*').then(|| compile(p)).flatten()))
                .collect(),
        }
    }

    /// Whether `module` is excluded: an exact entry, a `*` wildcard matching the whole name
    /// (SGLang's `is_layer_excluded`), or an entry naming a parent module (`model.layers.0`).
    pub fn excludes(&self, module: &str) -> bool {
        self.patterns.iter().any(|(p, re)| match re {
            Some(re) => re.is_match(module),
            None => {
                module == p
                    || module
                        .strip_prefix(p.as_str())
                        .is_some_and(|rest| rest.starts_with('.'))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_rules_follow_vllm_semantics() {
        let mut c = GptqConfig::new(4, 128);
        c.skip_module("model.layers.0.self_attn.q_proj");
        c.override_module(
            "model.layers.1.mlp.down_proj",
            DynamicOverride {
                bits: Some(8),
                ..Default::default()
            },
        );
        let rules = c.rules().unwrap();
        assert_eq!(
            rules.precision("model.layers.0.self_attn.qkv_proj"),
            ModulePrecision::Skipped
        );
        assert_eq!(
            rules.precision("model.layers.0.self_attn.q_proj"),
            ModulePrecision::Skipped
        );
        assert!(matches!(
            rules.precision("model.layers.10.self_attn.q_proj"),
            ModulePrecision::Quantized { bits: 4, .. }
        ));
        assert!(matches!(
            rules.precision("model.layers.1.mlp.down_proj"),
            ModulePrecision::Quantized {
                bits: 8,
                group_size: 128,
                ..
            }
        ));
        let json = serde_json::to_value(&c).unwrap();
        assert_eq!(json["checkpoint_format"], "gptq");
        assert_eq!(json["dynamic"].as_object().unwrap().len(), 2);
        let back: GptqConfig = serde_json::from_value(json).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn nvfp4_configs_carry_both_lists() {
        let c = Nvfp4Config::new(vec!["lm_head".into(), "model.layers.0.self_attn*".into()]);
        let flat = serde_json::to_value(c.flat_config()).unwrap();
        assert_eq!(flat["ignore"], flat["exclude_modules"]);
        assert_eq!(flat["quant_method"], "modelopt");
        assert_eq!(Nvfp4Config::from_json(&flat).unwrap(), c);
        let nested = serde_json::to_value(c.hf_quant_config()).unwrap();
        assert_eq!(Nvfp4Config::from_json(&nested).unwrap(), c);
        let empty = serde_json::to_value(Nvfp4Config::default().hf_quant_config()).unwrap();
        assert_eq!(
            empty["quantization"]["exclude_modules"],
            serde_json::json!([])
        );

        let ex = c.exclusions();
        assert!(ex.excludes("lm_head"));
        assert!(ex.excludes("model.layers.0.self_attn.q_proj"));
        assert!(!ex.excludes("model.layers.0.mlp.up_proj"));
        assert!(!ex.excludes("lm_head_x"));
    }
}
