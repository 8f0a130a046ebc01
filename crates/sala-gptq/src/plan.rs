//! The quantization plan: for every linear of the model, what happens to it, decided and checked
//! before any compute.

use crate::error::PlanError;
use regex::Regex;
pub use sala_export::loaders::{GptqLoader, LoaderTarget, LoaderVerdict};
use sala_model::{LayerKind, SalaConfig};
use std::fmt;

/// The two production recipes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Recipe {
    /// GPTQ W4A16 (INTn, group-wise, AutoGPTQ layout for `gptq_marlin`).
    Gptq,
    /// NVFP4 (E2M1 + FP8 block scales, ModelOpt layout) with the block-scale search.
    Nvfp4,
}

/// Which linears the NVFP4 recipe quantizes (the original scripts' variants).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Nvfp4Coverage {
    /// The original default (`L_4_Mini_16`, `dense_flashinfer`): minicpm4 attention stays bf16,
    /// everything else FP4.
    #[default]
    Minicpm4AttentionBf16,
    /// `dense_all`: every decoder linear in FP4.
    All,
    /// `mixed_bf16attn`: only the MLPs in FP4, all attention bf16.
    MlpOnly,
}

/// What happens to one linear.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Treatment {
    /// GPTQ to `bits`-bit integers with `group_size` input columns per scale.
    Int {
        /// Bits per weight.
        bits: u32,
        /// Input columns per group.
        group_size: usize,
    },
    /// NVFP4 with the block-scale search.
    Nvfp4,
    /// Kept in its original 16-bit dtype.
    Keep {
        /// Why it is kept.
        reason: String,
    },
}

impl Treatment {
    /// Whether the linear is quantized.
    pub fn is_quantized(&self) -> bool {
        !matches!(self, Treatment::Keep { .. })
    }

    fn short(&self) -> String {
        match self {
            Treatment::Int { bits, group_size } => format!("INT{bits} g{group_size}"),
            Treatment::Nvfp4 => "FP4".into(),
            Treatment::Keep { .. } => "bf16".into(),
        }
    }
}

/// A per-layer bit-width override list, e.g. `"0:4,2-7:8,8:16"` (inclusive ranges).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayerBits(Vec<(usize, usize, u32)>);

impl LayerBits {
    /// Parses `layer[-layer]:bits` items separated by commas; an empty string is no override.
    pub fn parse(text: &str) -> Result<Self, PlanError> {
        let bad = |item: &str| PlanError::LayerBits {
            item: item.to_owned(),
        };
        let mut out = Vec::new();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (layers, bits) = item.split_once(':').ok_or_else(|| bad(item))?;
            let bits: u32 = bits.trim().parse().map_err(|_| bad(item))?;
            let (a, b) = match layers.split_once('-') {
                Some((a, b)) => (a.trim().parse(), b.trim().parse()),
                None => (layers.trim().parse(), layers.trim().parse()),
            };
            let (a, b): (usize, usize) = (a.map_err(|_| bad(item))?, b.map_err(|_| bad(item))?);
            if a > b {
                return Err(bad(item));
            }
            if let Some((_, _, first)) = out.iter().find(|&&(x, y, _)| (x, y) == (a, b)) {
                return Err(PlanError::DuplicateLayerBits {
                    layers: layers.trim().to_owned(),
                    first: *first,
                    second: bits,
                });
            }
            out.push((a, b, bits));
        }
        Ok(Self(out))
    }

    /// The override for `layer` (the last matching item wins).
    pub fn get(&self, layer: usize) -> Option<u32> {
        self.0
            .iter()
            .rev()
            .find(|(a, b, _)| (*a..=*b).contains(&layer))
            .map(|&(_, _, bits)| bits)
    }

    /// The largest layer index named.
    fn max_layer(&self) -> Option<usize> {
        self.0.iter().map(|&(_, b, _)| b).max()
    }
}

/// Everything that decides the plan (the CLI flags of the original scripts).
#[derive(Debug, Clone)]
pub struct PlanOptions {
    /// The recipe.
    pub recipe: Recipe,
    /// Global bits (GPTQ); ≥ 16 keeps 16-bit.
    pub bits: u32,
    /// Input columns per group (GPTQ).
    pub group_size: usize,
    /// Bits for minicpm4 (sparse) layers, overriding `bits`.
    pub minicpm4_bits: Option<u32>,
    /// Bits for lightning layers, overriding `bits`.
    pub lightning_bits: Option<u32>,
    /// Per-layer overrides (highest priority).
    pub layer_bits: LayerBits,
    /// Module-name regexes (matched from the start, as vLLM's `re.match`) kept 16-bit.
    pub exclude: Vec<Regex>,
    /// Quantize `lm_head` too.
    pub quantize_lm_head: bool,
    /// NVFP4 coverage variant.
    pub nvfp4_coverage: Nvfp4Coverage,
    /// GPTQ: the loaders the checkpoint must load in; only their shape rules apply
    /// (`gptq_marlin` by default).
    pub target: LoaderTarget,
}

impl PlanOptions {
    /// The original scripts' defaults for a recipe (GPTQ: 4 bits, group 128; NVFP4: minicpm4
    /// attention bf16).
    pub fn new(recipe: Recipe) -> Self {
        Self {
            recipe,
            bits: 4,
            group_size: 128,
            minicpm4_bits: None,
            lightning_bits: None,
            layer_bits: LayerBits::default(),
            exclude: Vec::new(),
            quantize_lm_head: false,
            nvfp4_coverage: Nvfp4Coverage::default(),
            target: LoaderTarget::default(),
        }
    }
}

/// One linear and its treatment.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PlannedLinear {
    /// Module name without `.weight`.
    pub name: String,
    /// Decoder layer, `None` for `lm_head`.
    pub layer: Option<usize>,
    /// Rows of the weight.
    pub out_features: usize,
    /// Columns of the weight.
    pub in_features: usize,
    /// What happens to it.
    pub treatment: Treatment,
    /// Fused group whose members must share precision (and, for NVFP4, the global scale):
    /// `model.layers.N.qkv` or `model.layers.N.gate_up`.
    pub fused_group: Option<String>,
    /// The SmoothQuant group this linear's input columns belong to when smoothing is on, named
    /// by its source (`model.layers.N.input_layernorm`, `…o_norm`, `…post_attention_layernorm`,
    /// `…mlp.up_proj`); `None` when its input cannot absorb a scale or the recipe does not smooth
    /// it (NVFP4 has no up→down group). Groups whose readers are all kept 16-bit are skipped.
    pub smooth_group: Option<String>,
}

impl PlannedLinear {
    /// The projection's short name (`q_proj`, `down_proj`, `lm_head`).
    pub fn projection(&self) -> &str {
        self.name.rsplit('.').next().unwrap_or(&self.name)
    }
}

/// The plan for a whole model.
#[derive(Debug, Clone, serde::Serialize)]
pub struct QuantPlan {
    /// The recipe.
    pub recipe: Recipe,
    /// GPTQ: the loaders the checkpoint must load in.
    pub target: LoaderTarget,
    /// Every linear, in layer order then forward order; `lm_head` last.
    pub linears: Vec<PlannedLinear>,
    /// The layer kinds, for display.
    #[serde(skip)]
    layer_kinds: Vec<LayerKind>,
}

impl QuantPlan {
    /// Builds and checks the plan; every loader rule it can know without data is checked here.
    pub fn build(config: &SalaConfig, options: &PlanOptions) -> Result<Self, PlanError> {
        if let Some(max) = options.layer_bits.max_layer() {
            if max >= config.num_layers() {
                return Err(PlanError::LayerOutOfRange {
                    layer: max,
                    layers: config.num_layers(),
                });
            }
        }
        let mut linears = Vec::new();
        for layer in 0..config.num_layers() {
            let kind = config.layer_kind(layer);
            let groups = sala_model::input_groups(config, layer);
            for spec in config.linear_specs(layer) {
                let treatment = treatment_for(&spec.name, layer, kind, options)?;
                linears.push(PlannedLinear {
                    smooth_group: smooth_source(&groups, &spec.name, options.recipe),
                    fused_group: fused_group(&spec.name, layer),
                    name: spec.name,
                    layer: Some(layer),
                    out_features: spec.out_features,
                    in_features: spec.in_features,
                    treatment,
                });
            }
        }
        let lm_head = PlannedLinear {
            name: "lm_head".into(),
            layer: None,
            out_features: config.vocab_size(),
            in_features: config.hidden_size(),
            treatment: if options.quantize_lm_head {
                global_treatment(options.bits, options)?
            } else {
                keep("lm_head is not quantized (--quantize-lm-head)")
            },
            fused_group: None,
            smooth_group: None,
        };
        if !config.tie_word_embeddings() || options.quantize_lm_head {
            linears.push(lm_head);
        }
        if options.recipe != Recipe::Gptq && options.target != LoaderTarget::Marlin {
            return Err(PlanError::Option {
                option: "--target",
                message: format!(
                    "{} names GPTQ loaders; the {:?} recipe writes ModelOpt's layout",
                    options.target, options.recipe
                ),
            });
        }
        let plan = Self {
            recipe: options.recipe,
            target: options.target,
            linears,
            layer_kinds: config.layer_kinds().to_vec(),
        };
        plan.check()?;
        Ok(plan)
    }

    /// The planned linears of one decoder layer.
    pub fn layer(&self, layer: usize) -> impl Iterator<Item = &PlannedLinear> {
        self.linears.iter().filter(move |l| l.layer == Some(layer))
    }

    /// Looks a linear up by module name.
    pub fn get(&self, name: &str) -> Option<&PlannedLinear> {
        self.linears.iter().find(|l| l.name == name)
    }

    /// Quantized linears.
    pub fn quantized(&self) -> impl Iterator<Item = &PlannedLinear> {
        self.linears.iter().filter(|l| l.treatment.is_quantized())
    }

    /// GPTQ: whether each known loader would accept the result, and why not (`name: rule`, one
    /// per refused linear); empty for NVFP4.
    pub fn loader_verdicts(&self) -> Vec<LoaderVerdict> {
        if self.recipe != Recipe::Gptq {
            return Vec::new();
        }
        GptqLoader::ALL
            .into_iter()
            .map(|loader| LoaderVerdict {
                loader,
                refusals: self
                    .quantized()
                    .filter_map(|l| int_refusal(loader, l))
                    .collect(),
            })
            .collect()
    }

    fn check(&self) -> Result<(), PlanError> {
        for l in &self.linears {
            check_shape(l, self.target)?;
        }
        for group in self.fused_groups() {
            let members: Vec<&PlannedLinear> = self
                .linears
                .iter()
                .filter(|l| l.fused_group.as_deref() == Some(group))
                .collect();
            if members.windows(2).any(|w| w[0].treatment != w[1].treatment) {
                return Err(PlanError::FusedMismatch {
                    group: group.to_owned(),
                    members: members
                        .iter()
                        .map(|l| format!("{} = {}", l.projection(), l.treatment.short()))
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        }
        Ok(())
    }

    fn fused_groups(&self) -> Vec<&str> {
        let mut groups: Vec<&str> = self
            .linears
            .iter()
            .filter_map(|l| l.fused_group.as_deref())
            .collect();
        groups.dedup();
        groups
    }
}

/// The rules of `loader` that the INT linear `l` breaks (none for other treatments).
fn int_violations(loader: GptqLoader, l: &PlannedLinear) -> Vec<String> {
    let Treatment::Int { bits, group_size } = l.treatment else {
        return Vec::new();
    };
    let mut broken: Vec<String> = loader
        .group_violation(group_size as i64)
        .into_iter()
        .collect();
    broken.extend(loader.linear_violations(l.out_features, l.in_features, bits, Some(group_size)));
    broken
}

/// Why `loader` refuses the INT linear `l` (`name: rules`), if it does.
fn int_refusal(loader: GptqLoader, l: &PlannedLinear) -> Option<String> {
    let broken = int_violations(loader, l);
    (!broken.is_empty()).then(|| format!("{}: {}", l.name, broken.join(", ")))
}

/// The target's loaders' shape gates for one linear.
fn check_shape(l: &PlannedLinear, target: LoaderTarget) -> Result<(), PlanError> {
    let fail = |rule: String| {
        Err(PlanError::Shape {
            linear: l.name.clone(),
            out_features: l.out_features,
            in_features: l.in_features,
            rule,
        })
    };
    match l.treatment {
        Treatment::Int { bits, .. } => {
            if ![2, 4, 8].contains(&bits) {
                return fail(format!(
                    "{bits}-bit weights cannot be packed into int32 words (2, 4 or 8; set by \
                     --bits, --layer-bits, --minicpm4-bits or --lightning-bits)"
                ));
            }
            for &loader in target.required() {
                let broken = int_violations(loader, l);
                if !broken.is_empty() {
                    let hint = match target {
                        LoaderTarget::Marlin => "; --target gptq writes for the torch kernels",
                        LoaderTarget::Gptq => "",
                    };
                    return fail(format!(
                        "of {loader} (--target {target}): {}{hint}",
                        broken.join(", ")
                    ));
                }
            }
        }
        Treatment::Nvfp4 => {
            if l.in_features % 16 != 0 {
                return fail("in % 16 == 0 (NVFP4 blocks)".into());
            }
        }
        Treatment::Keep { .. } => {}
    }
    Ok(())
}

fn keep(reason: impl Into<String>) -> Treatment {
    Treatment::Keep {
        reason: reason.into(),
    }
}

/// The treatment of a linear in a decoder layer: exclusions, then NVFP4 coverage, then bits by
/// priority layer > layer type > global.
fn treatment_for(
    name: &str,
    layer: usize,
    kind: LayerKind,
    options: &PlanOptions,
) -> Result<Treatment, PlanError> {
    if let Some(re) = options
        .exclude
        .iter()
        .find(|re| re.find(name).is_some_and(|m| m.start() == 0))
    {
        return Ok(keep(format!("excluded by --exclude {}", re.as_str())));
    }
    let is_attention = name.contains(".self_attn.");
    if options.recipe == Recipe::Nvfp4 && is_attention {
        match options.nvfp4_coverage {
            Nvfp4Coverage::MlpOnly => return Ok(keep("attention kept bf16 (mlp-only FP4)")),
            Nvfp4Coverage::Minicpm4AttentionBf16 if kind == LayerKind::Minicpm4 => {
                return Ok(keep("minicpm4 attention kept bf16"))
            }
            _ => {}
        }
    }
    let type_bits = match kind {
        LayerKind::Minicpm4 => options.minicpm4_bits,
        LayerKind::Lightning => options.lightning_bits,
        LayerKind::Llama => None,
    };
    let bits = options
        .layer_bits
        .get(layer)
        .or(type_bits)
        .unwrap_or(options.bits);
    global_treatment(bits, options)
}

/// The treatment a bit width means under the recipe.
fn global_treatment(bits: u32, options: &PlanOptions) -> Result<Treatment, PlanError> {
    if bits >= 16 {
        return Ok(keep(format!("{bits} bits requested")));
    }
    match options.recipe {
        Recipe::Gptq => {
            if !(2..=8).contains(&bits) {
                return Err(PlanError::Bits {
                    bits,
                    recipe: "gptq",
                    allowed: "2..=8 or >= 16",
                });
            }
            Ok(Treatment::Int {
                bits,
                group_size: options.group_size,
            })
        }
        Recipe::Nvfp4 => {
            if bits != 4 {
                return Err(PlanError::Bits {
                    bits,
                    recipe: "nvfp4",
                    allowed: "4 or >= 16",
                });
            }
            Ok(Treatment::Nvfp4)
        }
    }
}

/// The smoothing source of `linear` under `recipe`: GPTQ smooths the four foldable inputs of a
/// layer, NVFP4 all but up→down (the original scripts' 4 and 3 groups).
fn smooth_source(
    groups: &[sala_model::InputGroup],
    linear: &str,
    recipe: Recipe,
) -> Option<String> {
    let group = groups
        .iter()
        .find(|g| g.readers.iter().any(|r| r == linear))?;
    let excluded = recipe == Recipe::Nvfp4
        && matches!(group.source, sala_model::InputSource::UpProjection { .. });
    (group.source.is_foldable() && !excluded).then(|| group.source.name().to_owned())
}

/// q/k/v and gate/up of one layer form fused groups (one fused linear in the serving engines).
fn fused_group(name: &str, layer: usize) -> Option<String> {
    let projection = name.rsplit('.').next()?;
    match projection {
        "q_proj" | "k_proj" | "v_proj" => Some(format!("model.layers.{layer}.qkv")),
        "gate_proj" | "up_proj" => Some(format!("model.layers.{layer}.gate_up")),
        _ => None,
    }
}

impl fmt::Display for QuantPlan {
    /// One row per layer: its kind and each projection's treatment, then `lm_head`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "| layer | kind | attention | mlp |")?;
        writeln!(f, "|---|---|---|---|")?;
        for (layer, kind) in self.layer_kinds.iter().enumerate() {
            let cells = |attention: bool| {
                let mut parts: Vec<String> = Vec::new();
                for l in self
                    .layer(layer)
                    .filter(|l| l.name.contains(".self_attn.") == attention)
                {
                    parts.push(format!("{} {}", l.projection(), l.treatment.short()));
                }
                compress(&parts)
            };
            writeln!(
                f,
                "| {layer} | {} | {} | {} |",
                kind_name(*kind),
                cells(true),
                cells(false)
            )?;
        }
        if let Some(l) = self.linears.iter().find(|l| l.layer.is_none()) {
            writeln!(f, "| - | head | lm_head {} | |", l.treatment.short())?;
        }
        let quantized = self.quantized().count();
        write!(f, "{quantized} of {} linears quantized", self.linears.len())?;
        if self.recipe == Recipe::Gptq {
            write!(f, "; written for --target {}", self.target)?;
        }
        for verdict in self.loader_verdicts() {
            write!(f, "\nloads in {verdict}")?;
        }
        Ok(())
    }
}

/// `["q_proj INT4 g128", "k_proj INT4 g128"]` → `"q k INT4 g128"`: consecutive projections with the
/// same treatment share one label.
fn compress(parts: &[String]) -> String {
    let mut out: Vec<(Vec<String>, String)> = Vec::new();
    for p in parts {
        let (proj, t) = p.split_once(' ').unwrap_or((p, ""));
        let proj = proj.trim_end_matches("_proj").to_owned();
        match out.last_mut() {
            Some((names, last)) if last == t => names.push(proj),
            _ => out.push((vec![proj], t.to_owned())),
        }
    }
    out.into_iter()
        .map(|(names, t)| format!("{} {t}", names.join(" ")))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The config name of a layer kind.
pub fn kind_name(kind: LayerKind) -> &'static str {
    match kind {
        LayerKind::Minicpm4 => "minicpm4",
        LayerKind::Lightning => "lightning",
        LayerKind::Llama => "llama",
    }
}
