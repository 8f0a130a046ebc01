//! What the page is rendered from: `quantization_report.json` as `quantize_sala` writes it, and
//! the JSON files of `eval_quant --json` and `drift --json`, read with serde.
//!
//! These are mirrors of the writers' structures (in `sala-gptq`, `sala-calib`, `sala-eval`), not
//! those structures themselves: the JSON files are the interface, so the report can be rendered
//! again from a committed checkpoint without the GPU stack, and a report written before a field
//! existed still renders (new fields are `Option` or `#[serde(default)]`).

use crate::error::ReportError;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;

/// `quantization_report.json`: the run report, the calibration coverage and (from
/// `quantize_sala`) the plan, the model and the settings.
#[derive(Debug, Clone, Deserialize)]
pub struct QuantizationReport {
    /// What the run did, per linear and per layer.
    pub report: RunReport,
    /// The calibration set's coverage (absent in a library run's report).
    #[serde(default)]
    pub calibration: Option<Calibration>,
    /// The plan: every linear's treatment, bf16 ones included.
    #[serde(default)]
    pub plan: Option<Plan>,
    /// The source model's size.
    #[serde(default)]
    pub model: Option<ModelInfo>,
    /// The options that change the result, as `(flag, value)`.
    #[serde(default)]
    pub settings: Vec<(String, String)>,
}

/// The `report` object (`sala_gptq::Report`).
#[derive(Debug, Clone, Deserialize)]
pub struct RunReport {
    /// `gptq` or `nvfp4`.
    pub recipe: String,
    /// Input model directory.
    pub input: String,
    /// Output directory.
    pub output: String,
    /// Calibration samples used.
    pub samples: usize,
    /// Calibration tokens.
    pub tokens: u64,
    /// Samples whose forward pass failed and were skipped.
    #[serde(default)]
    pub failed_samples: Vec<String>,
    /// Per layer.
    pub layers: Vec<LayerReport>,
    /// Per quantized linear.
    pub linears: Vec<LinearReport>,
    /// Total wall time, seconds.
    pub seconds: f64,
    /// Peak resident memory of the process, bytes.
    #[serde(default)]
    pub peak_rss_bytes: Option<u64>,
    /// Where the hidden states were kept between layers.
    #[serde(default)]
    pub hidden_states_location: Option<String>,
    /// Bytes of hidden states held between layers.
    #[serde(default)]
    pub hidden_state_bytes: u64,
    /// Whether the statistics were accumulated on the device.
    #[serde(default)]
    pub statistics_on_device: bool,
    /// The solver's name.
    #[serde(default)]
    pub solver: String,
    /// Peak of the device allocator over the run.
    #[serde(default)]
    pub peak_device_memory: Option<DeviceMemory>,
    /// Tensor bytes written.
    pub output_bytes: u64,
    /// The verifier's summary.
    pub verify_summary: String,
}

impl RunReport {
    /// Whether any layer reports the seconds it waited for its weights (reports from the
    /// twenty-sixth session on): the layer table and the time chart then show a load stage.
    pub fn reports_load(&self) -> bool {
        self.layers.iter().any(|l| l.stages.load.is_some())
    }
}

/// One quantized linear.
#[derive(Debug, Clone, Deserialize)]
pub struct LinearReport {
    /// Module name (`model.layers.3.self_attn.q_proj`).
    pub name: String,
    /// `INT4 g128`, `FP4`, …
    pub treatment: String,
    /// Rows.
    pub out_features: usize,
    /// Columns.
    pub in_features: usize,
    /// Proxy output error of the chosen quantization.
    pub output_error: Option<f64>,
    /// The same error of the baseline (RTN or max calibration).
    pub baseline_output_error: Option<f64>,
    /// Which Hessian both errors are measured with; absent in older reports.
    #[serde(default)]
    pub error_hessian: Option<ErrorHessian>,
    /// Range of the smoothing scales folded into the input columns.
    pub smooth_scale_range: Option<(f32, f32)>,
    /// The smoothing group's migration strength α (fixed or searched); absent in older reports.
    #[serde(default)]
    pub smooth_alpha: Option<f32>,
    /// Damping retries of the Cholesky inverse.
    #[serde(default)]
    pub damping_retries: usize,
    /// Whether GPTQ fell back to RTN.
    #[serde(default)]
    pub rtn_fallback: bool,
    /// Wall time of the solve, seconds.
    #[serde(default)]
    pub seconds: f64,
    /// Where the solve's seconds went, by step (`solve`, `baseline`, `pack`, `solver: …`);
    /// absent in older reports.
    #[serde(default)]
    pub solve_steps: BTreeMap<String, f64>,
}

/// The Hessian of a linear's proxy errors: the full one where GPTQ solved it, its diagonal
/// `E[x²]` where NVFP4's block search did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ErrorHessian {
    /// `E[x xᵀ]`.
    Full,
    /// `E[x²]`.
    Diagonal,
}

impl LinearReport {
    /// The projection's short name: the last component of the module name (`q_proj`).
    pub fn projection(&self) -> &str {
        self.name.rsplit('.').next().unwrap_or(&self.name)
    }

    /// The decoder layer, read off `model.layers.N.` in the name.
    pub fn layer(&self) -> Option<usize> {
        layer_of(&self.name)
    }

    /// `output_error / baseline_output_error`, when both are known and the baseline is not 0.
    pub fn ratio(&self) -> Option<f64> {
        match (self.output_error, self.baseline_output_error) {
            (Some(o), Some(b)) if b > 0.0 => Some(o / b),
            _ => None,
        }
    }
}

/// The decoder layer of a module name `model.layers.N.…`.
pub fn layer_of(name: &str) -> Option<usize> {
    let rest = name.split("layers.").nth(1)?;
    rest.split('.').next()?.parse().ok()
}

/// Device allocator memory.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct DeviceMemory {
    /// Bytes in use.
    pub in_use: u64,
    /// Bytes reserved.
    pub reserved: u64,
}

/// One decoder layer's timing and memory.
#[derive(Debug, Clone, Deserialize)]
pub struct LayerReport {
    /// Layer index.
    pub layer: usize,
    /// `minicpm4`, `lightning` or `llama`.
    pub kind: String,
    /// Calibration samples run through the layer.
    #[serde(default)]
    pub samples: usize,
    /// Their tokens.
    #[serde(default)]
    pub tokens: u64,
    /// Seconds per stage (the JSON keeps them as keys of the layer).
    #[serde(flatten)]
    pub stages: StageSeconds,
    /// Peak device memory over the layer.
    #[serde(default)]
    pub peak_device_memory: Option<DeviceMemory>,
    /// Peak resident memory of the process at the layer's end, bytes.
    #[serde(default)]
    pub peak_rss_bytes: Option<u64>,
}

/// Seconds per stage of one layer.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(default)]
pub struct StageSeconds {
    /// Waiting for the layer's weights; absent from reports of versions whose capture held it.
    pub load: Option<f64>,
    /// The forward passes with taps (loading the weights included where `load` is absent).
    pub capture: f64,
    /// Accumulating the statistics.
    pub accumulate: f64,
    /// Finalizing the statistics.
    pub finalize: f64,
    /// Smoothing.
    pub smooth: f64,
    /// Solving the linears.
    pub solve: f64,
    /// Forward passes with the quantized weights.
    pub propagate: f64,
    /// Writing tensors.
    pub write: f64,
}

impl StageSeconds {
    /// `(name, seconds)` in the order of a layer's work, `load` first when `with_load` (0 for a
    /// layer that lacks it): one list of columns for every layer of a run
    /// ([`RunReport::reports_load`]).
    pub fn named(&self, with_load: bool) -> Vec<(&'static str, f64)> {
        let load = with_load.then(|| ("load", self.load.unwrap_or(0.0)));
        load.into_iter()
            .chain([
                ("capture", self.capture),
                ("accumulate", self.accumulate),
                ("finalize", self.finalize),
                ("smooth", self.smooth),
                ("solve", self.solve),
                ("propagate", self.propagate),
                ("write", self.write),
            ])
            .collect()
    }

    /// All stages.
    pub fn total(&self) -> f64 {
        self.named(true).iter().map(|(_, s)| s).sum()
    }
}

/// The calibration coverage (`sala_calib::CalibStats`).
#[derive(Debug, Clone, Deserialize)]
pub struct Calibration {
    /// The JSONL file.
    pub path: String,
    /// Samples (records plus cyclic repeats).
    pub samples: usize,
    /// Distinct records used.
    pub distinct_records: usize,
    /// Malformed lines skipped.
    #[serde(default)]
    pub skipped_lines: usize,
    /// Samples cut to `max_len`.
    #[serde(default)]
    pub truncated: usize,
    /// The length samples were cut to.
    pub max_len: usize,
    /// Sum of sample lengths.
    pub total_tokens: u64,
    /// Shortest sample.
    pub min_tokens: usize,
    /// Mean sample length.
    pub mean_tokens: f64,
    /// Longest sample.
    pub max_tokens: usize,
    /// Length distribution.
    pub buckets: Vec<LengthBucket>,
    /// Token uniqueness per sample.
    pub uniqueness: Uniqueness,
}

/// Samples in one length bucket.
#[derive(Debug, Clone, Deserialize)]
pub struct LengthBucket {
    /// `[1k,5k)`.
    pub label: String,
    /// Samples in it.
    pub samples: usize,
}

/// `unique tokens / tokens` per sample.
#[derive(Debug, Clone, Deserialize)]
pub struct Uniqueness {
    /// Lowest ratio.
    pub min: f64,
    /// Its JSONL line.
    pub min_line: usize,
    /// Mean ratio.
    pub mean: f64,
}

/// The plan (`sala_gptq::QuantPlan`) and the kind of each layer.
#[derive(Debug, Clone, Deserialize)]
pub struct Plan {
    /// Every linear, bf16 ones included.
    pub linears: Vec<PlannedLinear>,
    /// `minicpm4`, `lightning`, … per layer index.
    #[serde(default)]
    pub layer_kinds: Vec<String>,
}

/// One linear of the plan.
#[derive(Debug, Clone, Deserialize)]
pub struct PlannedLinear {
    /// Module name.
    pub name: String,
    /// Decoder layer, `None` for `lm_head`.
    pub layer: Option<usize>,
    /// What happens to it.
    pub treatment: Treatment,
    /// The SmoothQuant group of its input columns.
    #[serde(default)]
    pub smooth_group: Option<String>,
}

/// A linear's treatment as the plan serializes it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Treatment {
    /// Integers with group scales.
    Int {
        /// Bits per weight.
        bits: u32,
        /// Input columns per group.
        group_size: usize,
    },
    /// NVFP4.
    Nvfp4,
    /// Kept 16-bit.
    Keep {
        /// Why.
        #[serde(default)]
        reason: String,
    },
}

impl Treatment {
    /// `INT4 g128`, `FP4`, `bf16`: the labels of the terminal plan.
    pub fn label(&self) -> String {
        match self {
            Treatment::Int { bits, group_size } => format!("INT{bits} g{group_size}"),
            Treatment::Nvfp4 => "FP4".into(),
            Treatment::Keep { .. } => "bf16".into(),
        }
    }
}

/// One row of the plan summary: the layers of one kind and each projection's treatment.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PlanRow {
    /// `minicpm4`, `lightning`, `head`.
    pub kind: String,
    /// The layers of this kind (`0, 2, 5, 7`).
    pub layers: String,
    /// `q k v INT4 g128; o_gate bf16`: projections in forward order, consecutive ones with the
    /// same treatment joined; a projection whose treatment differs between the layers lists
    /// each with its count (`INT4 g128 ×3, INT8 g128 ×1`).
    pub projections: String,
}

impl Plan {
    /// One row per layer kind (in order of first appearance), and one for `lm_head`.
    pub fn summary(&self) -> Vec<PlanRow> {
        // kind → (layers, projection → treatment → count), each in first-seen order.
        type Counts = Vec<(String, Vec<(String, usize)>)>;
        let mut kinds: Vec<(String, Vec<usize>, Counts)> = Vec::new();
        for l in &self.linears {
            let kind = match l.layer {
                Some(layer) => self
                    .layer_kinds
                    .get(layer)
                    .cloned()
                    .unwrap_or_else(|| "layer".into()),
                None => "head".into(),
            };
            let at = match kinds.iter().position(|(k, _, _)| *k == kind) {
                Some(i) => i,
                None => {
                    kinds.push((kind, Vec::new(), Vec::new()));
                    kinds.len() - 1
                }
            };
            let (_, layers, projections) = &mut kinds[at];
            if let Some(layer) = l.layer {
                if !layers.contains(&layer) {
                    layers.push(layer);
                }
            }
            let projection = l.name.rsplit('.').next().unwrap_or(&l.name).to_owned();
            let label = l.treatment.label();
            let p = match projections.iter().position(|(p, _)| *p == projection) {
                Some(i) => i,
                None => {
                    projections.push((projection, Vec::new()));
                    projections.len() - 1
                }
            };
            let counts = &mut projections[p].1;
            match counts.iter_mut().find(|(t, _)| *t == label) {
                Some((_, n)) => *n += 1,
                None => counts.push((label, 1)),
            }
        }
        kinds
            .into_iter()
            .map(|(kind, layers, projections)| {
                let cells: Vec<(String, String)> = projections
                    .into_iter()
                    .map(|(p, counts)| {
                        let t = match counts.as_slice() {
                            [(t, _)] => t.clone(),
                            _ => counts
                                .iter()
                                .map(|(t, n)| format!("{t} ×{n}"))
                                .collect::<Vec<_>>()
                                .join(", "),
                        };
                        (p, t)
                    })
                    .collect();
                PlanRow {
                    kind,
                    layers: layers
                        .iter()
                        .map(|l| l.to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    projections: join_same(&cells),
                }
            })
            .collect()
    }
}

/// `[(q_proj, INT4), (k_proj, INT4), (o_proj, bf16)]` → `q k INT4; o bf16`.
fn join_same(cells: &[(String, String)]) -> String {
    let mut out: Vec<(Vec<&str>, &str)> = Vec::new();
    for (p, t) in cells {
        let short = p.strip_suffix("_proj").unwrap_or(p);
        match out.last_mut() {
            Some((names, last)) if *last == t.as_str() => names.push(short),
            _ => out.push((vec![short], t)),
        }
    }
    out.iter()
        .map(|(names, t)| format!("{} {t}", names.join(" ")))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The source model: its name and size.
#[derive(Debug, Clone, Deserialize)]
pub struct ModelInfo {
    /// The model directory's name.
    pub name: String,
    /// `model_type` of its config.json.
    #[serde(default)]
    pub model_type: String,
    /// Parameters (elements of every tensor).
    pub parameters: u64,
    /// Bytes of its safetensors files.
    pub bytes: u64,
}

/// `eval_quant --json`: perplexity, KL and top-1 per length bucket.
#[derive(Debug, Clone, Deserialize)]
pub struct EvalResults {
    /// The original model directory.
    pub original: String,
    /// The quantized checkpoint directory.
    pub quantized: String,
    /// The quantized checkpoint's format.
    #[serde(default)]
    pub quantized_format: String,
    /// One entry per length, ascending.
    pub buckets: Vec<EvalBucket>,
    /// All positions.
    pub overall: EvalMetrics,
}

/// One length bucket of [`EvalResults`].
#[derive(Debug, Clone, Deserialize)]
pub struct EvalBucket {
    /// Sequence length, tokens.
    pub length: usize,
    /// Sequences.
    pub sequences: usize,
    /// Their metrics.
    pub metrics: EvalMetrics,
}

/// Quality of the quantized model against the original.
#[derive(Debug, Clone, Deserialize)]
pub struct EvalMetrics {
    /// Positions compared.
    pub tokens: usize,
    /// Perplexity of the original.
    pub perplexity_original: f64,
    /// Perplexity of the quantized model.
    pub perplexity_quantized: f64,
    /// Mean per-token KL, nats.
    pub kl_mean: f64,
    /// Largest per-token KL, nats.
    pub kl_max: f64,
    /// Fraction of positions with the same top token.
    pub top1_agreement: f64,
}

/// `drift --json`: per text (`diverse`, `repeated`), the drift of every lightning layer.
pub type DriftResults = BTreeMap<String, Vec<LayerDrift>>;

/// The GLA state drift of one lightning layer.
#[derive(Debug, Clone, Deserialize)]
pub struct LayerDrift {
    /// Decoder layer.
    pub layer: usize,
    /// One point per prefix length.
    pub points: Vec<DriftPoint>,
    /// Growth exponent of the absolute state error.
    pub p_state_abs: Option<f64>,
    /// Growth exponent of the relative state error.
    pub p_state_rel: Option<f64>,
    /// Growth exponent of the output's relative error.
    pub p_output_rel: Option<f64>,
}

/// The errors after a prefix.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct DriftPoint {
    /// Prefix length, tokens.
    pub tokens: usize,
    /// `‖S_q − S_o‖_F`.
    pub state_abs: f64,
    /// `‖S_q − S_o‖_F / ‖S_o‖_F`.
    pub state_rel: f64,
    /// Relative error of the layer output since the previous point.
    pub output_rel: f64,
}

/// Reads and parses a JSON file; both errors name the file.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ReportError> {
    let bytes = std::fs::read(path).map_err(|source| ReportError::Read {
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_slice(&bytes).map_err(|source| ReportError::Parse {
        path: path.to_owned(),
        source,
    })
}

impl QuantizationReport {
    /// Reads `quantization_report.json`.
    pub fn from_file(path: &Path) -> Result<Self, ReportError> {
        read_json(path)
    }
}

impl EvalResults {
    /// Reads the JSON of `eval_quant --json`.
    pub fn from_file(path: &Path) -> Result<Self, ReportError> {
        read_json(path)
    }
}

/// Reads the JSON of `drift --json`; a file without any layer is refused (it would plot
/// nothing, and is most likely another tool's JSON).
pub fn drift_from_file(path: &Path) -> Result<DriftResults, ReportError> {
    let drift: DriftResults = read_json(path)?;
    if drift.values().all(|layers| layers.is_empty()) {
        return Err(ReportError::Invalid {
            path: path.to_owned(),
            message: "no lightning layer's drift in it (expected the JSON of `drift --json`)"
                .into(),
        });
    }
    Ok(drift)
}
