//! [`verify`]: checks an exported directory against the rules the serving stacks enforce
//! (or, worse, silently assume), and reports every violation with the tensor it concerns.
//!
//! | rule | what it checks |
//! |---|---|
//! | `config` | the keys SGLang / vLLM require: GPTQ `bits, group_size, desc_act, sym`, `quant_method: "gptq"`, never `checkpoint_format: "marlin"`, a `(bits, sym)` the target's loaders serve, `quantize_config.json` identical; NVFP4 `quant_method: "modelopt…"`, `quant_algo: "NVFP4"`, `group_size: 16`, both `ignore` and `exclude_modules` (equal), `hf_quant_config.json` with a non-null `exclude_modules` |
//! | `index` | index ↔ shards: every file present, every tensor where the index says and nowhere else, `total_size` |
//! | `tensor-layout` | each quantized linear has all its tensors with the dtype and shape of its format and config |
//! | `loader-shape` | GPTQ: the shape rules of the target's loaders (`gptq_marlin`: `out % 64`, `in % 128`, `in % group_size`; see [`crate::loaders`]) |
//! | `group-size` | GPTQ group size the target's loaders accept (`gptq_marlin`: −1, 32, 64, 128; base and overrides) |
//! | `fused-precision` | q/k/v and gate/up all quantized or all not, with one bit width |
//! | `fused-scales` | NVFP4 q/k/v and gate/up share `weight_scale_2` and `input_scale` |
//! | `finite-scales` | no NaN / Inf scales, global scales positive |
//! | `zero-block-scale` | NVFP4: no zero FP8 block scale on a block with non-zero codes |
//! | `g-idx` | `g_idx` in range, and `k / group_size` when `desc_act` is false |
//! | `sym-zeros` | symmetric GPTQ: every v1 zero is `2^(bits−1) − 1` (`0x77777777` at 4 bits) |
//! | `exclusions` | 16-bit decoder linears are declared (`-:` dynamic rule, `exclude_modules`) and quantized ones are not |
//! | `finite-tensors` | every floating-point tensor outside the quantized linears (embedding, norms, `lm_head`, 16-bit linears) is free of NaN / Inf |

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use sala_formats::gptq_pack::unpack_qzeros;
use sala_formats::minifloat::e4m3_decode;
use sala_formats::ZeroConvention;
use serde_json::Value;

use crate::config::{
    read_json, DynamicRules, Exclusions, GptqConfig, ModulePrecision, Nvfp4Config,
    HF_QUANT_CONFIG_FILE, NVFP4_GROUP_SIZE, QUANTIZE_CONFIG_FILE,
};
use crate::layout::{
    tensor_name, GPTQ_G_IDX, GPTQ_QWEIGHT, GPTQ_QZEROS, GPTQ_SCALES, NVFP4_INPUT_SCALE,
    NVFP4_WEIGHT, NVFP4_WEIGHT_SCALE, NVFP4_WEIGHT_SCALE_2,
};
use crate::loaders::{GptqLoader, LoaderTarget, LoaderVerdict};
use crate::modules::{decoder_linear, fused_member, FusedKind};
use crate::reader::{gptq_bits, Checkpoint, CheckpointFormat};
use crate::tensor::byte_len;
use crate::writer::LinearFormat;
use crate::ExportError;

/// `gptq_marlin`'s minimum output tile (`GPTQ_MARLIN_MIN_THREAD_N`).
pub const MARLIN_MIN_OUT: usize = 64;
/// `gptq_marlin`'s minimum input tile (`GPTQ_MARLIN_MIN_THREAD_K`).
pub const MARLIN_MIN_IN: usize = 128;

/// A rule of the verifier (see the module table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rule {
    /// Required config keys and values.
    Config,
    /// Index ↔ shard consistency.
    Index,
    /// Dtype and shape of each quantized linear's tensors.
    TensorLayout,
    /// The shape gates of the target's loaders (`gptq_marlin`'s by default).
    LoaderShape,
    /// Supported group sizes.
    GroupSize,
    /// Fused shards all or none quantized, same precision.
    FusedPrecision,
    /// Fused NVFP4 shards share global and input scales.
    FusedScales,
    /// No NaN / Inf scales.
    FiniteScales,
    /// No zero FP8 block scale on a non-zero block.
    ZeroBlockScale,
    /// `g_idx` range and order.
    GIdx,
    /// Symmetric v1 zeros.
    SymZeros,
    /// 16-bit linears declared, quantized ones not excluded.
    Exclusions,
    /// No NaN / Inf in the tensors copied rather than quantized.
    FiniteTensors,
}

impl Rule {
    /// The rule's short name, as printed.
    pub fn name(self) -> &'static str {
        match self {
            Rule::Config => "config",
            Rule::Index => "index",
            Rule::TensorLayout => "tensor-layout",
            Rule::LoaderShape => "loader-shape",
            Rule::GroupSize => "group-size",
            Rule::FusedPrecision => "fused-precision",
            Rule::FusedScales => "fused-scales",
            Rule::FiniteScales => "finite-scales",
            Rule::ZeroBlockScale => "zero-block-scale",
            Rule::GIdx => "g-idx",
            Rule::SymZeros => "sym-zeros",
            Rule::Exclusions => "exclusions",
            Rule::FiniteTensors => "finite-tensors",
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One broken rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// Which rule.
    pub rule: Rule,
    /// The tensor, module or file concerned.
    pub name: String,
    /// What is wrong, with the numbers.
    pub detail: String,
}

impl Violation {
    pub(crate) fn new(rule: Rule, name: impl Into<String>, detail: impl Into<String>) -> Self {
        Self {
            rule,
            name: name.into(),
            detail: detail.into(),
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] {}: {}", self.rule, self.name, self.detail)
    }
}

/// Sizes of a checkpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Summary {
    /// Number of tensors.
    pub tensors: usize,
    /// Number of quantized linears.
    pub quantized_linears: usize,
    /// Bytes of tensor data (headers excluded).
    pub tensor_bytes: u64,
    /// Weights (`out · in`) of the quantized linears.
    pub quantized_weights: u64,
    /// Bytes of the quantized linears' tensors (codes, scales, zeros, `g_idx`).
    pub quantized_bytes: u64,
    /// Parameters of the model (quantized weights plus every other tensor's elements).
    pub parameters: u64,
}

impl Summary {
    /// Stored bits per weight of the quantized linears (≈4.16 for INT4 g128, 4.5 for NVFP4).
    pub fn bits_per_quantized_weight(&self) -> f64 {
        ratio_bits(self.quantized_bytes, self.quantized_weights)
    }

    /// Stored bits per parameter over the whole checkpoint.
    pub fn bits_per_parameter(&self) -> f64 {
        ratio_bits(self.tensor_bytes, self.parameters)
    }
}

fn ratio_bits(bytes: u64, count: u64) -> f64 {
    match count {
        0 => 0.0,
        n => bytes as f64 * 8.0 / n as f64,
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} tensors, {} quantized linears, {} bytes, {:.3} bits per quantized weight, \
             {:.3} bits per parameter",
            self.tensors,
            self.quantized_linears,
            self.tensor_bytes,
            self.bits_per_quantized_weight(),
            self.bits_per_parameter()
        )
    }
}

/// What [`verify`] found.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyReport {
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// `"gptq"`, `"nvfp4"` or `"unquantized"`.
    pub format: &'static str,
    /// Every violation, ordered by rule then name.
    pub violations: Vec<Violation>,
    /// Sizes.
    pub summary: Summary,
    /// The loaders the checkpoint had to satisfy (GPTQ; `gptq_marlin` unless
    /// [`verify_for`] named another target).
    pub target: LoaderTarget,
    /// GPTQ: whether each known loader accepts the checkpoint, and why not (empty otherwise).
    pub loaders: Vec<LoaderVerdict>,
}

impl VerifyReport {
    /// No violation.
    pub fn is_ok(&self) -> bool {
        self.violations.is_empty()
    }

    /// Whether some violation of `rule` names something containing `name`.
    pub fn has(&self, rule: Rule, name: &str) -> bool {
        self.violations
            .iter()
            .any(|v| v.rule == rule && v.name.contains(name))
    }
}

impl fmt::Display for VerifyReport {
    /// `ok: <summary>`, or one `[rule] name: detail` line per violation and a count.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_ok() {
            return write!(f, "ok: {}", self.summary);
        }
        for violation in &self.violations {
            writeln!(f, "{violation}")?;
        }
        write!(
            f,
            "{} violation(s); {}",
            self.violations.len(),
            self.summary
        )
    }
}

/// Checks the checkpoint in `dir` against every rule, for `gptq_marlin` (the default target);
/// fails only if `dir` is not a directory.
pub fn verify(dir: impl AsRef<Path>) -> Result<VerifyReport, ExportError> {
    verify_for(dir, LoaderTarget::Marlin)
}

/// Checks the checkpoint in `dir` against every rule, with the loader rules of `target` only
/// (GPTQ); the report also says which other loaders would accept it. Fails only if `dir` is not
/// a directory.
pub fn verify_for(
    dir: impl AsRef<Path>,
    target: LoaderTarget,
) -> Result<VerifyReport, ExportError> {
    let dir = dir.as_ref();
    let (checkpoint, mut violations) = Checkpoint::open_lenient(dir)?;
    let mut v = Verifier {
        ck: &checkpoint,
        out: Vec::new(),
        target,
        loaders: BTreeMap::new(),
    };
    v.check(dir);
    let loaders = std::mem::take(&mut v.loaders)
        .into_iter()
        .map(|(loader, refusals)| LoaderVerdict { loader, refusals })
        .collect();
    violations.append(&mut v.out);
    violations.sort_by(|a, b| (a.rule, &a.name).cmp(&(b.rule, &b.name)));
    violations.dedup();
    Ok(VerifyReport {
        dir: dir.to_path_buf(),
        format: checkpoint.format().name(),
        violations,
        summary: summarize(&checkpoint),
        target,
        loaders,
    })
}

struct Verifier<'a> {
    ck: &'a Checkpoint,
    out: Vec<Violation>,
    target: LoaderTarget,
    /// GPTQ: every loader's refusals (`"name: rule"`), whether or not the target requires it.
    loaders: BTreeMap<GptqLoader, Vec<String>>,
}

/// How a linear is stored, for the fused-group and exclusion rules.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Storage {
    /// Quantized with this many bits (4 for NVFP4).
    Quantized(u32),
    /// A floating-point `weight`.
    Dense,
}

impl Verifier<'_> {
    fn push(&mut self, rule: Rule, name: impl Into<String>, detail: impl Into<String>) {
        self.out.push(Violation::new(rule, name, detail));
    }

    fn check(&mut self, dir: &Path) {
        let linears = self.ck.quantized_linears();
        match self.ck.format().clone() {
            CheckpointFormat::Gptq(config) => self.check_gptq(dir, &config, &linears),
            CheckpointFormat::Nvfp4(config) => self.check_nvfp4(dir, &config, &linears),
            CheckpointFormat::Unquantized => {
                let declared = self.ck.config().get("quantization_config").is_some();
                if let (false, Some((module, _))) = (declared, linears.first()) {
                    let detail = "quantized tensors but no quantization_config";
                    self.push(Rule::Config, module, detail);
                }
            }
        }
        self.check_fused_precision(&linears);
        self.check_finite_tensors(&linears);
    }

    /// Every floating-point tensor that belongs to no quantized linear: no NaN, no infinity.
    fn check_finite_tensors(&mut self, linears: &[(String, LinearFormat)]) {
        let owned = quantized_tensor_names(self.ck, linears);
        let mut found = Vec::new();
        for name in self.ck.tensor_names().filter(|n| !owned.contains(*n)) {
            let Ok(view) = self.ck.tensor(name) else {
                continue;
            };
            if let Some(index) = first_non_finite(view.data(), view.dtype()) {
                found.push((name.to_string(), index));
            }
            self.ck.release(name);
        }
        for (name, index) in found {
            let detail = format!("NaN or infinity at flat index {index}");
            self.push(Rule::FiniteTensors, name, detail);
        }
    }

    // ---------------------------------------------------------------- GPTQ

    fn check_gptq(&mut self, dir: &Path, config: &GptqConfig, linears: &[(String, LinearFormat)]) {
        // Every loader gets a verdict, accepted ones too.
        for loader in GptqLoader::ALL {
            self.loaders.entry(loader).or_default();
        }
        self.check_gptq_config(dir, config);
        let rules = match config.rules() {
            Ok(rules) => Some(rules),
            Err((key, e)) => {
                self.push(Rule::Config, format!("dynamic {key}"), e.to_string());
                None
            }
        };
        for (module, format) in linears {
            match format {
                LinearFormat::Gptq => self.check_gptq_linear(module, config, rules.as_ref()),
                LinearFormat::Nvfp4 => self.push(
                    Rule::TensorLayout,
                    module,
                    "an NVFP4 linear in a GPTQ checkpoint",
                ),
            }
        }
        if let Some(rules) = rules {
            self.check_gptq_dense_linears(&rules);
        }
    }

    fn check_gptq_config(&mut self, dir: &Path, config: &GptqConfig) {
        let section = self.ck.config().get("quantization_config");
        let section = section.cloned().unwrap_or(Value::Null);
        for key in ["bits", "group_size", "desc_act", "sym"] {
            if section.get(key).is_none() {
                self.push(
                    Rule::Config,
                    "quantization_config",
                    format!("missing `{key}`"),
                );
            }
        }
        if config.checkpoint_format == "marlin"
            || section.get("is_marlin_format") == Some(&true.into())
        {
            let detail =
                "checkpoint_format \"marlin\" means pre-repacked weights; ours are AutoGPTQ v1";
            self.push(Rule::Config, "quantization_config", detail);
        }
        for loader in GptqLoader::ALL {
            if let Some(broken) = loader.bits_violation(config.bits, config.sym) {
                self.refuse(loader, Rule::Config, "quantization_config", &broken);
            }
        }
        self.check_group_size("quantization_config", config.group_size);
        for (key, over) in &config.dynamic {
            if let Some(g) = over.group_size {
                self.check_group_size(&format!("dynamic {key}"), g);
            }
        }
        let path = dir.join(QUANTIZE_CONFIG_FILE);
        match read_json(&path) {
            Ok(copy) if copy == section => {}
            Ok(_) => self.push(
                Rule::Config,
                QUANTIZE_CONFIG_FILE,
                "differs from config.json's quantization_config",
            ),
            Err(e) => self.push(Rule::Config, QUANTIZE_CONFIG_FILE, e.to_string()),
        }
    }

    fn check_group_size(&mut self, name: &str, group_size: i64) {
        for loader in GptqLoader::ALL {
            if let Some(detail) = loader.group_violation(group_size) {
                self.refuse(loader, Rule::GroupSize, name, &detail);
            }
        }
    }

    /// `loader` refuses `name` because of `detail`: recorded in its verdict, and a violation
    /// of `rule` when the target requires that loader.
    fn refuse(&mut self, loader: GptqLoader, rule: Rule, name: &str, detail: &str) {
        let refusals = self.loaders.entry(loader).or_default();
        refusals.push(format!("{name}: {detail}"));
        if self.target.required().contains(&loader) {
            self.push(rule, name, format!("{loader}: {detail}"));
        }
    }

    /// Reads the dtype and shape of `module.suffix`, reporting a missing tensor or wrong dtype.
    fn expect_tensor(&mut self, module: &str, suffix: &str, dtype: Dtype) -> Option<Vec<usize>> {
        let name = tensor_name(module, suffix);
        match self.ck.tensor_info(&name) {
            None => {
                self.push(Rule::TensorLayout, &name, "missing");
                None
            }
            Some((found, _)) if found != dtype => {
                self.push(
                    Rule::TensorLayout,
                    &name,
                    format!("dtype {found}, expected {dtype}"),
                );
                None
            }
            Some((_, shape)) => Some(shape.to_vec()),
        }
    }

    fn expect_shape(&mut self, name: &str, shape: &[usize], expected: &[usize]) -> bool {
        if shape == expected {
            return true;
        }
        let detail = format!("shape {shape:?}, expected {expected:?}");
        self.push(Rule::TensorLayout, name, detail);
        false
    }

    fn check_gptq_linear(
        &mut self,
        module: &str,
        config: &GptqConfig,
        rules: Option<&DynamicRules>,
    ) {
        let shapes = [
            self.expect_tensor(module, GPTQ_QWEIGHT, Dtype::I32),
            self.expect_tensor(module, GPTQ_QZEROS, Dtype::I32),
            self.expect_tensor(module, GPTQ_SCALES, Dtype::F16),
            self.expect_tensor(module, GPTQ_G_IDX, Dtype::I32),
        ];
        let [Some(qweight), Some(qzeros), Some(scales), Some(g_idx)] = shapes else {
            return;
        };
        let qweight_name = tensor_name(module, GPTQ_QWEIGHT);
        let (&[words, out], &[inp]) = (&qweight[..], &g_idx[..]) else {
            let detail = format!("qweight {qweight:?} must be 2-D and g_idx {g_idx:?} 1-D");
            self.push(Rule::TensorLayout, &qweight_name, detail);
            return;
        };
        let Some(bits) = gptq_bits(words, inp) else {
            let detail = format!("{words} rows cannot pack {inp} inputs at 2, 4 or 8 bits");
            self.push(Rule::TensorLayout, &qweight_name, detail);
            return;
        };
        let precision = rules.map(|r| r.precision(module));
        let group_size = match precision {
            Some(ModulePrecision::Quantized {
                bits: want,
                group_size,
                ..
            }) => {
                if want != bits {
                    let detail = format!("packed at {bits} bits, the config says {want}");
                    self.push(Rule::TensorLayout, &qweight_name, detail);
                }
                group_size
            }
            Some(ModulePrecision::Skipped) => {
                let detail = "quantized, but a `-:` dynamic rule leaves it in 16 bits";
                self.push(Rule::Exclusions, module, detail);
                config.group_size
            }
            None => config.group_size,
        };
        let groups = if group_size > 0 {
            inp.div_ceil(group_size as usize)
        } else {
            1
        };
        let per = (32 / bits) as usize;
        let scales_ok =
            self.expect_shape(&tensor_name(module, GPTQ_SCALES), &scales, &[groups, out]);
        let zeros_ok = out % per == 0
            && self.expect_shape(
                &tensor_name(module, GPTQ_QZEROS),
                &qzeros,
                &[groups, out / per],
            );
        self.check_loader_shapes(module, out, inp, bits, group_size);
        if scales_ok {
            self.check_gptq_scales(module);
        }
        self.check_g_idx(module, inp, groups, group_size, config.desc_act);
        if zeros_ok && config.sym && config.checkpoint_format != "gptq_v2" {
            self.check_sym_zeros(module, groups, out, bits);
        }
    }

    fn check_loader_shapes(
        &mut self,
        module: &str,
        out: usize,
        inp: usize,
        bits: u32,
        group_size: i64,
    ) {
        let group = usize::try_from(group_size).ok().filter(|&g| g > 0);
        for loader in GptqLoader::ALL {
            let broken = loader.linear_violations(out, inp, bits, group);
            if !broken.is_empty() {
                self.refuse(loader, Rule::LoaderShape, module, &broken.join(", "));
            }
        }
    }

    fn check_gptq_scales(&mut self, module: &str) {
        let name = tensor_name(module, GPTQ_SCALES);
        if let Ok(scales) = self.ck.tensor_f32(&name) {
            self.check_finite(&name, &scales.values);
        }
    }

    fn check_finite(&mut self, name: &str, values: &[f32]) {
        let bad: Vec<usize> = (0..values.len())
            .filter(|&i| !values[i].is_finite())
            .collect();
        if let Some(&first) = bad.first() {
            let detail = format!(
                "{} NaN/Inf value(s), first at flat index {first} ({})",
                bad.len(),
                values[first]
            );
            self.push(Rule::FiniteScales, name, detail);
        }
    }

    fn check_g_idx(
        &mut self,
        module: &str,
        inp: usize,
        groups: usize,
        group_size: i64,
        desc_act: bool,
    ) {
        let name = tensor_name(module, GPTQ_G_IDX);
        let Ok(g_idx) = self.ck.tensor_f32(&name) else {
            return;
        };
        let out_of_range = g_idx
            .values
            .iter()
            .position(|&g| g < 0.0 || g as usize >= groups);
        if let Some(k) = out_of_range {
            let detail = format!("g_idx[{k}] = {} is outside 0..{groups}", g_idx.values[k]);
            self.push(Rule::GIdx, &name, detail);
            return;
        }
        let size = if group_size > 0 {
            group_size as usize
        } else {
            inp.max(1)
        };
        let unordered = (0..inp).find(|&k| g_idx.values[k] as usize != k / size);
        if let (false, Some(k)) = (desc_act, unordered) {
            let detail = format!(
                "desc_act is false but g_idx[{k}] = {} (expected {})",
                g_idx.values[k],
                k / size
            );
            self.push(Rule::GIdx, &name, detail);
        }
    }

    fn check_sym_zeros(&mut self, module: &str, groups: usize, out: usize, bits: u32) {
        let name = tensor_name(module, GPTQ_QZEROS);
        let Ok(view) = self.ck.tensor(&name) else {
            return;
        };
        let words: Vec<i32> =
            crate::tensor::decode_i32(&name, view.dtype(), view.data()).unwrap_or_default();
        self.ck.release(&name);
        let Ok(zeros) = unpack_qzeros(&words, groups, out, bits, ZeroConvention::V1) else {
            return;
        };
        let expected = 1u8 << (bits - 1);
        if let Some(i) = zeros.iter().position(|&z| z != expected) {
            let detail = format!(
                "sym = true needs every zero = {expected} (stored v1 as {}), but group {} \
                 output {} has {}",
                expected - 1,
                i / out,
                i % out,
                zeros[i]
            );
            self.push(Rule::SymZeros, &name, detail);
        }
    }

    /// Every 16-bit decoder linear must be left in 16 bits by a `-:` rule that also matches its
    /// fused layer (SGLang creates GPTQ parameters for every other linear).
    fn check_gptq_dense_linears(&mut self, rules: &DynamicRules) {
        for module in self.dense_decoder_linears() {
            let mut names = vec![module.clone()];
            names.extend(fused_member(&module).map(|m| m.fused_module()));
            for name in names {
                if rules.precision(&name) != ModulePrecision::Skipped {
                    let detail = format!(
                        "stored in 16 bits, but no `-:` dynamic rule matches {name}, so loaders \
                         expect GPTQ tensors"
                    );
                    self.push(Rule::Exclusions, &module, detail);
                }
            }
        }
    }

    /// Decoder-layer linears stored as a floating-point `weight` (not quantized).
    fn dense_decoder_linears(&self) -> Vec<String> {
        self.ck
            .tensor_names()
            .filter_map(|name| {
                let (dtype, shape) = self.ck.tensor_info(name)?;
                let module = decoder_linear(name, shape)?;
                let float = matches!(dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32);
                (float && !self.ck.contains(&tensor_name(module, NVFP4_WEIGHT_SCALE)))
                    .then(|| module.to_string())
            })
            .collect()
    }

    // ---------------------------------------------------------------- NVFP4

    fn check_nvfp4(
        &mut self,
        dir: &Path,
        config: &Nvfp4Config,
        linears: &[(String, LinearFormat)],
    ) {
        self.check_nvfp4_config(dir);
        let exclusions = config.exclusions();
        for (module, format) in linears {
            match format {
                LinearFormat::Nvfp4 => self.check_nvfp4_linear(module, &exclusions),
                LinearFormat::Gptq => self.push(
                    Rule::TensorLayout,
                    module,
                    "a GPTQ linear in an NVFP4 checkpoint",
                ),
            }
        }
        for module in self.dense_decoder_linears() {
            if !exclusions.excludes(&module) {
                let detail = "stored in 16 bits but not in exclude_modules / ignore, so loaders \
                              expect NVFP4 tensors";
                self.push(Rule::Exclusions, &module, detail);
            }
        }
        self.check_fused_scales(linears);
    }

    fn check_nvfp4_config(&mut self, dir: &Path) {
        let section = self.ck.config().get("quantization_config").cloned();
        let section = section.unwrap_or(Value::Null);
        let name = "quantization_config";
        let method = section.get("quant_method").and_then(Value::as_str);
        if !method.is_some_and(|m| m.starts_with("modelopt")) {
            self.push(
                Rule::Config,
                name,
                format!("quant_method {method:?}, expected \"modelopt\""),
            );
        }
        self.check_nvfp4_section(name, &section);
        let lists = [section.get("ignore"), section.get("exclude_modules")];
        match lists {
            [Some(a), Some(b)] if a == b && a.is_array() => {}
            [Some(_), Some(_)] => self.push(
                Rule::Config,
                name,
                "`ignore` and `exclude_modules` differ or are not lists",
            ),
            _ => self.push(
                Rule::Config,
                name,
                "needs both `ignore` (SGLang's flat parser) and `exclude_modules`",
            ),
        }
        let hf_path = dir.join(HF_QUANT_CONFIG_FILE);
        match read_json(&hf_path) {
            Ok(hf) => {
                let nested = hf.get("quantization").cloned().unwrap_or(Value::Null);
                self.check_nvfp4_section(HF_QUANT_CONFIG_FILE, &nested);
                match nested.get("exclude_modules") {
                    Some(list) if list.is_array() => {
                        if section.get("exclude_modules").is_some_and(|l| l != list) {
                            let detail = "exclude_modules differs from config.json's";
                            self.push(Rule::Config, HF_QUANT_CONFIG_FILE, detail);
                        }
                    }
                    _ => self.push(
                        Rule::Config,
                        HF_QUANT_CONFIG_FILE,
                        "quantization.exclude_modules must be a list ([] when empty); SGLang \
                         raises on null",
                    ),
                }
            }
            Err(e) => self.push(Rule::Config, HF_QUANT_CONFIG_FILE, e.to_string()),
        }
    }

    fn check_nvfp4_section(&mut self, name: &str, section: &Value) {
        let algo = section.get("quant_algo").and_then(Value::as_str);
        if algo != Some("NVFP4") {
            self.push(
                Rule::Config,
                name,
                format!("quant_algo {algo:?}, expected \"NVFP4\""),
            );
        }
        let group = section.get("group_size").and_then(Value::as_u64);
        if group != Some(NVFP4_GROUP_SIZE as u64) {
            self.push(
                Rule::Config,
                name,
                format!("group_size {group:?}, expected 16"),
            );
        }
    }

    fn check_nvfp4_linear(&mut self, module: &str, exclusions: &Exclusions) {
        if exclusions.excludes(module) {
            self.push(
                Rule::Exclusions,
                module,
                "quantized, but listed in exclude_modules",
            );
        }
        let shapes = [
            self.expect_tensor(module, NVFP4_WEIGHT, Dtype::U8),
            self.expect_tensor(module, NVFP4_WEIGHT_SCALE, Dtype::F8_E4M3),
            self.expect_tensor(module, NVFP4_WEIGHT_SCALE_2, Dtype::F32),
            self.expect_tensor(module, NVFP4_INPUT_SCALE, Dtype::F32),
        ];
        for (suffix, shape) in [NVFP4_WEIGHT_SCALE_2, NVFP4_INPUT_SCALE]
            .iter()
            .zip(&shapes[2..])
        {
            if let Some(shape) = shape {
                self.check_positive_scalar(&tensor_name(module, suffix), shape);
            }
        }
        let [Some(weight), Some(scales), ..] = &shapes else {
            return;
        };
        let weight_name = tensor_name(module, NVFP4_WEIGHT);
        let [rows, half_cols] = weight[..] else {
            self.push(
                Rule::TensorLayout,
                &weight_name,
                format!("shape {weight:?} is not 2-D"),
            );
            return;
        };
        let cols = 2 * half_cols;
        if cols % 16 != 0 {
            self.push(
                Rule::TensorLayout,
                &weight_name,
                format!("in = {cols} is not a multiple of 16"),
            );
            return;
        }
        let scale_name = tensor_name(module, NVFP4_WEIGHT_SCALE);
        if self.expect_shape(&scale_name, scales, &[rows, cols / 16]) {
            self.check_block_scales(module);
        }
    }

    fn check_positive_scalar(&mut self, name: &str, shape: &[usize]) {
        if !(shape.is_empty() || shape == [1]) {
            self.push(
                Rule::TensorLayout,
                name,
                format!("shape {shape:?}, expected [] or [1]"),
            );
            return;
        }
        let Ok(v) = self.ck.scalar(name) else { return };
        if !v.is_finite() {
            self.push(Rule::FiniteScales, name, format!("{v}"));
        } else if v <= 0.0 {
            self.push(Rule::FiniteScales, name, format!("{v} is not positive"));
        }
    }

    /// FP8 block scales: no NaN, and no zero where the block holds a non-zero code.
    fn check_block_scales(&mut self, module: &str) {
        let scale_name = tensor_name(module, NVFP4_WEIGHT_SCALE);
        let (Ok(weight), Ok(scales)) = (
            self.ck.tensor(&tensor_name(module, NVFP4_WEIGHT)),
            self.ck.tensor(&scale_name),
        ) else {
            return;
        };
        let decoded: Vec<f32> = scales.data().iter().map(|&b| e4m3_decode(b)).collect();
        self.check_finite(&scale_name, &decoded);
        let blocks_per_row = scales.shape()[1].max(1);
        // 16 codes = 8 bytes per block; codes 0 and 8 are ±0.
        let zero_scaled: Vec<usize> = weight
            .data()
            .chunks_exact(8)
            .zip(&decoded)
            .enumerate()
            .filter(|(_, (bytes, &s))| {
                s == 0.0 && bytes.iter().any(|&b| b & 0x7 != 0 || (b >> 4) & 0x7 != 0)
            })
            .map(|(i, _)| i)
            .collect();
        // Every code of the checkpoint passes here: their pages leave the resident set.
        self.ck.release(&tensor_name(module, NVFP4_WEIGHT));
        self.ck.release(&scale_name);
        if let Some(&first) = zero_scaled.first() {
            let detail = format!(
                "{} block(s) with a zero FP8 scale but non-zero codes, first at row {} block {}",
                zero_scaled.len(),
                first / blocks_per_row,
                first % blocks_per_row
            );
            self.push(Rule::ZeroBlockScale, &scale_name, detail);
        }
    }

    /// SGLang keeps the max of the shards' scalars and never requantizes: they must be equal.
    fn check_fused_scales(&mut self, linears: &[(String, LinearFormat)]) {
        let mut groups: BTreeMap<String, Vec<&str>> = BTreeMap::new();
        for (module, _) in linears {
            if let Some(member) = fused_member(module) {
                groups
                    .entry(member.fused_module())
                    .or_default()
                    .push(module);
            }
        }
        for members in groups.values() {
            for suffix in [NVFP4_WEIGHT_SCALE_2, NVFP4_INPUT_SCALE] {
                let values: Vec<(&str, f32)> = members
                    .iter()
                    .filter_map(|m| Some((*m, self.ck.scalar(&tensor_name(m, suffix)).ok()?)))
                    .collect();
                let Some(&(first, reference)) = values.first() else {
                    continue;
                };
                for &(module, value) in &values[1..] {
                    if value.to_bits() != reference.to_bits() {
                        let detail = format!("{value} differs from {first}'s {reference}");
                        self.push(Rule::FusedScales, tensor_name(module, suffix), detail);
                    }
                }
            }
        }
    }

    // ---------------------------------------------------------------- both formats

    /// q/k/v and gate/up: all quantized or all not, with one bit width.
    fn check_fused_precision(&mut self, linears: &[(String, LinearFormat)]) {
        let quantized: BTreeMap<&str, LinearFormat> =
            linears.iter().map(|(m, f)| (m.as_str(), *f)).collect();
        let dense: BTreeSet<String> = self.dense_decoder_linears().into_iter().collect();
        let mut groups: BTreeMap<(String, FusedKind), Vec<String>> = BTreeMap::new();
        for module in quantized
            .keys()
            .copied()
            .chain(dense.iter().map(String::as_str))
        {
            if let Some(m) = fused_member(module) {
                groups.insert((m.parent.to_string(), m.kind), m.sibling_modules());
            }
        }
        for ((parent, kind), members) in groups {
            let storage: Vec<(String, Option<Storage>)> = members
                .into_iter()
                .map(|m| {
                    let s = match quantized.get(m.as_str()) {
                        Some(f) => self.quantized_bits(&m, *f).map(Storage::Quantized),
                        None => dense.contains(&m).then_some(Storage::Dense),
                    };
                    (m, s)
                })
                .collect();
            let present: BTreeSet<String> = storage
                .iter()
                .filter_map(|(_, s)| s.map(|s| format!("{s:?}")))
                .collect();
            if present.len() > 1 {
                let listing: Vec<String> = storage
                    .iter()
                    .map(|(m, s)| format!("{} {}", m.rsplit('.').next().unwrap_or(m), describe(*s)))
                    .collect();
                let name = format!("{parent}.{}", kind.fused_name());
                let detail = format!("shards differ in precision: {}", listing.join(", "));
                self.push(Rule::FusedPrecision, name, detail);
            }
        }
    }

    fn quantized_bits(&self, module: &str, format: LinearFormat) -> Option<u32> {
        match format {
            LinearFormat::Nvfp4 => Some(4),
            LinearFormat::Gptq => {
                let (_, qweight) = self.ck.tensor_info(&tensor_name(module, GPTQ_QWEIGHT))?;
                let (_, g_idx) = self.ck.tensor_info(&tensor_name(module, GPTQ_G_IDX))?;
                gptq_bits(*qweight.first()?, *g_idx.first()?)
            }
        }
    }
}

fn describe(storage: Option<Storage>) -> String {
    match storage {
        Some(Storage::Quantized(bits)) => format!("{bits}-bit"),
        Some(Storage::Dense) => "16-bit".to_string(),
        None => "absent".to_string(),
    }
}

/// The tensors of the quantized linears (codes, scales, zeros, `g_idx`).
fn quantized_tensor_names(ck: &Checkpoint, linears: &[(String, LinearFormat)]) -> BTreeSet<String> {
    linears
        .iter()
        .flat_map(|(module, format)| {
            let suffixes = match format {
                LinearFormat::Gptq => [GPTQ_QWEIGHT, GPTQ_QZEROS, GPTQ_SCALES, GPTQ_G_IDX],
                LinearFormat::Nvfp4 => [
                    NVFP4_WEIGHT,
                    NVFP4_WEIGHT_SCALE,
                    NVFP4_WEIGHT_SCALE_2,
                    NVFP4_INPUT_SCALE,
                ],
            };
            suffixes.map(|suffix| tensor_name(module, suffix))
        })
        .filter(|name| ck.contains(name))
        .collect()
}

/// Index of the first NaN or infinity among the little-endian values of `dtype` (an all-ones
/// exponent); `None` if there is none or the dtype is not a float.
fn first_non_finite(bytes: &[u8], dtype: Dtype) -> Option<usize> {
    let u16s = |mask: u16| {
        bytes
            .chunks_exact(2)
            .position(move |b| u16::from_le_bytes([b[0], b[1]]) & mask == mask)
    };
    match dtype {
        Dtype::BF16 => u16s(0x7f80),
        Dtype::F16 => u16s(0x7c00),
        Dtype::F32 => bytes.chunks_exact(4).position(|b| {
            u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7f80_0000 == 0x7f80_0000
        }),
        Dtype::F64 => bytes.chunks_exact(8).position(|b| {
            let bits = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
            bits & 0x7ff0_0000_0000_0000 == 0x7ff0_0000_0000_0000
        }),
        _ => None,
    }
}

fn summarize(ck: &Checkpoint) -> Summary {
    let linears = ck.quantized_linears();
    let mut summary = Summary {
        tensors: ck.tensor_names().count(),
        quantized_linears: linears.len(),
        tensor_bytes: ck.tensor_bytes(),
        ..Summary::default()
    };
    let mut owned = BTreeSet::new();
    for (module, format) in &linears {
        let suffixes = match format {
            LinearFormat::Gptq => [GPTQ_QWEIGHT, GPTQ_QZEROS, GPTQ_SCALES, GPTQ_G_IDX],
            LinearFormat::Nvfp4 => [
                NVFP4_WEIGHT,
                NVFP4_WEIGHT_SCALE,
                NVFP4_WEIGHT_SCALE_2,
                NVFP4_INPUT_SCALE,
            ],
        };
        for suffix in suffixes {
            let name = tensor_name(module, suffix);
            if let Some((dtype, shape)) = ck.tensor_info(&name) {
                summary.quantized_bytes += byte_len(dtype, shape).unwrap_or(0) as u64;
                owned.insert(name);
            }
        }
        summary.quantized_weights += linear_weights(ck, module, *format);
    }
    summary.parameters = summary.quantized_weights
        + ck.tensor_names()
            .filter(|n| !owned.contains(*n))
            .filter_map(|n| ck.tensor_info(n))
            .map(|(_, shape)| shape.iter().product::<usize>() as u64)
            .sum::<u64>();
    summary
}

/// `out · in` of a quantized linear, from its tensor shapes.
fn linear_weights(ck: &Checkpoint, module: &str, format: LinearFormat) -> u64 {
    let shape = |suffix| {
        ck.tensor_info(&tensor_name(module, suffix))
            .map(|(_, s)| s.to_vec())
    };
    let n = match format {
        LinearFormat::Gptq => match (shape(GPTQ_QWEIGHT), shape(GPTQ_G_IDX)) {
            (Some(q), Some(g)) if q.len() == 2 && g.len() == 1 => q[1] * g[0],
            _ => 0,
        },
        LinearFormat::Nvfp4 => match shape(NVFP4_WEIGHT) {
            Some(w) if w.len() == 2 => w[0] * w[1] * 2,
            _ => 0,
        },
    };
    n as u64
}
