//! What a run did, per linear and per layer, as JSON (written into the output directory) and as
//! a table for the terminal.

use crate::hidden::HiddenLocation;
use sala_model::DeviceMemory;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;

/// One linear.
#[derive(Debug, Clone, Serialize)]
pub struct LinearReport {
    /// Module name.
    pub name: String,
    /// `INT4 g128`, `FP4` or `bf16`.
    pub treatment: String,
    /// Rows.
    pub out_features: usize,
    /// Columns.
    pub in_features: usize,
    /// GPTQ's loss `Σ (w−q)²/d²` (halved per IST), GPTQ only.
    pub gptq_loss: Option<f64>,
    /// Proxy output error of the chosen quantization: `tr((W−Q) H (W−Q)ᵀ)` with the
    /// (smoothed) Hessian that [`error_hessian`](Self::error_hessian) names.
    pub output_error: Option<f64>,
    /// The same error for the baseline: round-to-nearest on each group's min/max range, without
    /// the clipping search (GPTQ), or max calibration (NVFP4).
    pub baseline_output_error: Option<f64>,
    /// Which Hessian `output_error` and `baseline_output_error` are measured with: the full
    /// one where GPTQ solved the linear (the integer grid or the FP4 grid), its diagonal
    /// `E[x²]` where NVFP4's block search did. A run of NVFP4's hybrid solver has both kinds,
    /// so its totals add figures of the two; each linear's ratio compares like with like.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_hessian: Option<ErrorHessian>,
    /// Range of the smoothing scales folded into this linear's input columns.
    pub smooth_scale_range: Option<(f32, f32)>,
    /// SmoothQuant's migration strength α of this linear's group, fixed or searched; `None`
    /// when the input is not smoothed (smoothing off, not foldable, or the α search found the
    /// unsmoothed weights best).
    pub smooth_alpha: Option<f32>,
    /// Damping retries of the Cholesky inverse (GPTQ).
    pub damping_retries: usize,
    /// Whether GPTQ fell back to RTN.
    pub rtn_fallback: bool,
    /// Wall time of the solve, seconds.
    pub seconds: f64,
    /// Where the solve's seconds went, by step: the pipeline's `solve`, `baseline`, `pack`…,
    /// and the solver's own steps inside them as `solver: STEP` (a device solver's uploads,
    /// factor, column loop, downloads, host finishing; a host solver reports none).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub solve_steps: BTreeMap<String, f64>,
}

/// The Hessian a linear's proxy errors are measured with ([`LinearReport::error_hessian`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ErrorHessian {
    /// The full `[in, in]` Hessian `E[x xᵀ]`: GPTQ's objective.
    Full,
    /// Its diagonal `E[x²]`: the NVFP4 block search's objective.
    Diagonal,
}

impl LinearReport {
    /// Adds `seconds` to the step `step` of [`LinearReport::solve_steps`].
    pub fn add_step(&mut self, step: &str, seconds: f64) {
        *self.solve_steps.entry(step.to_owned()).or_default() += seconds;
    }
}

/// Seconds of the stages of a layer's quantization (wall clock; on a GPU each stage ends with
/// a device synchronization, so work is charged to the stage that queued it).
///
/// The one list of the stages: a layer's timing ([`LayerReport::stages`]) and a run's sums
/// over layers ([`StageTotals`]) are both this.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct StageSeconds {
    /// Waiting for the layer's weights: reading and decoding them from the source, or, where
    /// they were read on a thread beside the previous layer's work, what was left of that
    /// (does not grow with the tokens). Absent (0) in reports of earlier versions, whose
    /// capture includes the loading.
    #[serde(default)]
    pub load: f64,
    /// The forward passes with taps (statistics excluded), uploading the weights included.
    pub capture: f64,
    /// Accumulating each sample's contribution to the Hessians / channel statistics of the
    /// tapped inputs (grows with the tokens).
    pub accumulate: f64,
    /// Finalizing the statistics once per layer: downloading them from the device when they
    /// are accumulated there, normalizing, converting to f64 (does not grow with the tokens).
    pub finalize: f64,
    /// Smoothing: scales, folding into the weights, transforming the statistics.
    pub smooth: f64,
    /// Solving the quantized linears.
    pub solve: f64,
    /// Forward passes with the quantized weights.
    pub propagate: f64,
    /// Writing tensors, with the AutoGPTQ packing of each stage's last GPTQ linear (the others
    /// pack beside the next solve): on a thread of its own, beside
    /// [`propagate`](Self::propagate) (so not part of the layer's wall time unless it outlasts
    /// the forward).
    pub write: f64,
}

impl StageSeconds {
    /// Seconds that grow with the calibration tokens: capture, accumulate, propagate.
    pub fn token_seconds(&self) -> f64 {
        self.capture + self.accumulate + self.propagate
    }

    /// Seconds that do not depend on the calibration tokens: load, finalize, smooth, solve,
    /// write.
    pub fn fixed_seconds(&self) -> f64 {
        self.load + self.finalize + self.smooth + self.solve + self.write
    }
}

impl std::ops::Add for StageSeconds {
    type Output = Self;

    /// Stage by stage.
    fn add(self, other: Self) -> Self {
        Self {
            load: self.load + other.load,
            capture: self.capture + other.capture,
            accumulate: self.accumulate + other.accumulate,
            finalize: self.finalize + other.finalize,
            smooth: self.smooth + other.smooth,
            solve: self.solve + other.solve,
            propagate: self.propagate + other.propagate,
            write: self.write + other.write,
        }
    }
}

impl std::iter::Sum for StageSeconds {
    /// Stage by stage, from zero.
    fn sum<I: Iterator<Item = Self>>(iter: I) -> Self {
        iter.fold(Self::default(), |total, s| total + s)
    }
}

/// Seconds per stage, summed over layers (see [`stage_totals`]).
pub type StageTotals = StageSeconds;

/// One decoder layer: its timing by stage, its tokens and its peak memory.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LayerReport {
    /// Layer index.
    pub layer: usize,
    /// `minicpm4`, `lightning` or `llama`.
    pub kind: String,
    /// Calibration samples run through the layer.
    pub samples: usize,
    /// Their tokens.
    pub tokens: u64,
    /// Seconds per stage. Flattened: in the JSON report the stages stay keys of the layer
    /// (`"capture"`, `"solve"`, ...), which bench/real_job_summary.py and the tests read.
    #[serde(flatten)]
    pub stages: StageSeconds,
    /// Peak of the device allocator's memory over the layer (sampled after every sample and
    /// stage), when the pipeline was given a memory probe (GPU runs).
    pub peak_device_memory: Option<DeviceMemory>,
    /// Peak resident memory of the process so far, bytes (Linux `VmHWM`), at the layer's end.
    pub peak_rss_bytes: Option<u64>,
    /// With profiled fast ops (`quantize_sala --profile-ops`): the layer's forward passes op
    /// by op.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ops: Option<LayerOps>,
}

/// One layer's fast ops, op by op ([`sala_model::ProfiledOps`]): each op synchronised, so the
/// stages take longer than without the profile.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LayerOps {
    /// The capture passes (their Hessian products are `accumulate_gram`).
    pub capture: Vec<sala_model::OpTotal>,
    /// The propagate pass.
    pub propagate: Vec<sala_model::OpTotal>,
}

impl LayerReport {
    /// Seconds that grow with the calibration tokens: capture, accumulate, propagate.
    pub fn token_seconds(&self) -> f64 {
        self.stages.token_seconds()
    }

    /// Seconds that do not depend on the calibration tokens: finalize, smooth, solve, write.
    pub fn fixed_seconds(&self) -> f64 {
        self.stages.fixed_seconds()
    }

    /// Calibration tokens per second through the layer's token-proportional stages.
    pub fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.token_seconds().max(f64::MIN_POSITIVE)
    }
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
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
    pub failed_samples: Vec<String>,
    /// Per layer.
    pub layers: Vec<LayerReport>,
    /// Per linear.
    pub linears: Vec<LinearReport>,
    /// Total wall time, seconds.
    pub seconds: f64,
    /// Peak resident memory of the process, bytes (Linux `VmHWM`), if known.
    pub peak_rss_bytes: Option<u64>,
    /// Bytes of hidden states held between layers.
    pub hidden_state_bytes: u64,
    /// Whether they were memory-mapped from disk.
    pub hidden_states_on_disk: bool,
    /// Where they were kept: on the device, in host memory or in a memory-mapped file.
    pub hidden_states_location: HiddenLocation,
    /// Whether the Hessians / channel statistics were accumulated on the device.
    pub statistics_on_device: bool,
    /// The [`LinearSolver`](crate::LinearSolver) that solved the linears.
    pub solver: String,
    /// Peak of the device allocator's memory over the run (GPU runs with a memory probe).
    pub peak_device_memory: Option<DeviceMemory>,
    /// Tensor bytes written.
    pub output_bytes: u64,
    /// The verifier's summary of the written checkpoint.
    pub verify_summary: String,
}

impl Report {
    /// Sum of the solver's output errors over quantized linears.
    pub fn total_output_error(&self) -> f64 {
        total_errors(&self.linears).0
    }

    /// Sum of the baseline's output errors over quantized linears.
    pub fn total_baseline_error(&self) -> f64 {
        total_errors(&self.linears).1
    }

    /// Seconds per solve step summed over the linears ([`solve_step_totals`]).
    pub fn solve_step_totals(&self) -> Vec<(String, f64)> {
        solve_step_totals(&self.linears)
    }

    /// Seconds per stage summed over layers.
    pub fn stage_totals(&self) -> StageTotals {
        stage_totals(&self.layers)
    }
}

impl fmt::Display for LayerReport {
    /// One line: `layer 3 (lightning): load 0.00 s, capture 1.20 s, accumulate 0.31 s, finalize 0.05 s,
    /// smooth 0.02 s, solve 4.50 s, write 0.00 s, propagate 0.98 s; 4096 tokens, 1655
    /// tokens/s; <memory>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "layer {} ({}): load {:.2} s, capture {:.2} s, accumulate {:.2} s, finalize {:.2} s, smooth {:.2} s, solve {:.2} s, write {:.2} s, propagate {:.2} s; {} tokens, {:.0} tokens/s",
            self.layer,
            self.kind,
            self.stages.load,
            self.stages.capture,
            self.stages.accumulate,
            self.stages.finalize,
            self.stages.smooth,
            self.stages.solve,
            self.stages.write,
            self.stages.propagate,
            self.tokens,
            self.tokens_per_second()
        )?;
        if let Some(m) = self.peak_device_memory {
            write!(f, "; peak {}", device_memory_text(m))?;
        }
        if let Some(b) = self.peak_rss_bytes {
            write!(f, "; peak RSS {:.2} GB", b as f64 / 1e9)?;
        }
        Ok(())
    }
}

impl Report {
    /// The per-linear table (one row per quantized linear: 65 on the tiny fixture, 225 on the
    /// real model), as Markdown.
    pub fn table(&self) -> ReportTable<'_> {
        ReportTable(self)
    }

    /// A few lines: the run's totals, the errors against the baseline, memory, skipped samples
    /// and the verifier's verdict.
    pub fn summary(&self) -> ReportSummary<'_> {
        ReportSummary(self)
    }

    /// With profiled fast ops: per layer kind and stage, each op's calls and seconds summed
    /// over the layers, largest first, and the `rest` of the stage that no fast op took (the
    /// graph's own ops, statistics accumulated on the host; for capture, the stage's capture
    /// and accumulate seconds together). `None` when no layer was profiled.
    pub fn op_summary(&self) -> Option<String> {
        // (kind, stage) → (stage seconds, op → (calls, seconds))
        type Totals = BTreeMap<(String, &'static str), (f64, BTreeMap<String, (u64, f64)>)>;
        let mut totals: Totals = BTreeMap::new();
        for layer in &self.layers {
            let Some(ops) = &layer.ops else { continue };
            let stages = [
                (
                    "capture",
                    layer.stages.capture + layer.stages.accumulate,
                    &ops.capture,
                ),
                ("propagate", layer.stages.propagate, &ops.propagate),
            ];
            for (stage, seconds, list) in stages {
                let entry = totals.entry((layer.kind.clone(), stage)).or_default();
                entry.0 += seconds;
                for op in list {
                    let sum = entry.1.entry(op.op.clone()).or_default();
                    sum.0 += op.calls;
                    sum.1 += op.seconds;
                }
            }
        }
        if totals.is_empty() {
            return None;
        }
        let mut text = String::from("fast ops, each synchronised (seconds summed over layers):\n");
        for ((kind, stage), (seconds, ops)) in totals {
            text += &format!("{kind} {stage}: {seconds:.2} s\n");
            let mut ops: Vec<(String, (u64, f64))> = ops.into_iter().collect();
            ops.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
            let share = |s: f64| 100.0 * s / seconds.max(f64::MIN_POSITIVE);
            for (op, (calls, s)) in &ops {
                text += &format!(
                    "  {op:>18} {calls:>7} calls {s:>9.2} s {:>5.1} %\n",
                    share(*s)
                );
            }
            let rest = seconds - ops.iter().map(|(_, (_, s))| s).sum::<f64>();
            text += &format!(
                "  {:>18} {:>13} {rest:>9.2} s {:>5.1} %\n",
                "rest",
                "",
                share(rest)
            );
        }
        Some(text)
    }
}

/// [`Report::table`].
#[derive(Debug, Clone, Copy)]
pub struct ReportTable<'a>(&'a Report);

/// [`Report::summary`].
#[derive(Debug, Clone, Copy)]
pub struct ReportSummary<'a>(&'a Report);

impl fmt::Display for Report {
    /// The table, a blank line, the summary.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.table())?;
        write!(f, "{}", self.summary())
    }
}

impl fmt::Display for ReportTable<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "| linear | treatment | shape | output error | baseline | smooth s | retries | s |"
        )?;
        writeln!(f, "|---|---|---|---|---|---|---|---|")?;
        for l in self.0.linears.iter().filter(|l| l.output_error.is_some()) {
            let opt = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.4e}"));
            let smooth = l
                .smooth_scale_range
                .map_or("-".to_owned(), |(a, b)| format!("{a:.3}..{b:.3}"));
            writeln!(
                f,
                "| {} | {} | {}x{} | {} | {} | {} | {} | {:.2} |",
                l.name,
                l.treatment,
                l.out_features,
                l.in_features,
                opt(l.output_error),
                opt(l.baseline_output_error),
                smooth,
                l.damping_retries,
                l.seconds
            )?;
        }
        Ok(())
    }
}

/// `; full Hessian on N linears, its diagonal on M` where a run measured its linears' errors
/// with both (NVFP4's hybrid solver), since its totals then add figures of two kinds; nothing
/// where every linear used one.
struct MixedHessians<'a>(&'a Report);

impl fmt::Display for MixedHessians<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let count = |kind| {
            let linears = self.0.linears.iter();
            linears.filter(|l| l.error_hessian == Some(kind)).count()
        };
        match (count(ErrorHessian::Full), count(ErrorHessian::Diagonal)) {
            (full, diagonal) if full > 0 && diagonal > 0 => {
                write!(
                    f,
                    "; full Hessian on {full} linears, its diagonal on {diagonal}"
                )
            }
            _ => Ok(()),
        }
    }
}

impl fmt::Display for ReportSummary<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = self.0;
        writeln!(
            f,
            "{} recipe: {} samples, {} tokens, {} layers, {:.1} s ({})",
            r.recipe,
            r.samples,
            r.tokens,
            r.layers.len(),
            r.seconds,
            r.stage_totals()
        )?;
        // How many linears the solver brought below the baseline: the one question the table
        // is mostly read for.
        let compared: Vec<f64> = r
            .linears
            .iter()
            .filter_map(|l| match (l.output_error, l.baseline_output_error) {
                (Some(o), Some(b)) if b > 0.0 => Some(o / b),
                _ => None,
            })
            .collect();
        let above = compared.iter().filter(|&&q| q > 1.0).count();
        writeln!(
            f,
            "total output error {:.4e} (baseline {:.4e}{}); above the baseline on {above} of {} linears",
            r.total_output_error(),
            r.total_baseline_error(),
            MixedHessians(r),
            compared.len()
        )?;
        writeln!(
            f,
            "hidden states {:.1} MB {}; statistics on the {}; solver {}; peak RSS {}{}",
            r.hidden_state_bytes as f64 / 1e6,
            r.hidden_states_location,
            if r.statistics_on_device {
                "device"
            } else {
                "host"
            },
            r.solver,
            r.peak_rss_bytes.map_or("unknown".to_owned(), |b| format!(
                "{:.1} MB",
                b as f64 / 1e6
            )),
            r.peak_device_memory
                .map_or(String::new(), |m| format!("; {}", device_memory_text(m)))
        )?;
        let steps = r.solve_step_totals();
        if !steps.is_empty() {
            let listed: Vec<String> = steps
                .iter()
                .map(|(step, seconds)| format!("{step} {seconds:.1}"))
                .collect();
            writeln!(f, "solve steps (s): {}", listed.join(", "))?;
        }
        if !r.failed_samples.is_empty() {
            writeln!(f, "skipped samples: {}", r.failed_samples.join("; "))?;
        }
        write!(f, "{} -> {}: {}", r.input, r.output, r.verify_summary)
    }
}

/// Sums of the solver's and of the baseline's output errors over `linears`.
pub fn total_errors(linears: &[LinearReport]) -> (f64, f64) {
    linears.iter().fold((0.0, 0.0), |(out, base), l| {
        (
            out + l.output_error.unwrap_or(0.0),
            base + l.baseline_output_error.unwrap_or(0.0),
        )
    })
}

impl fmt::Display for StageSeconds {
    /// `capture 1.2, accumulate 0.3, finalize 0.1, smooth 0.0, solve 4.5, propagate 1.0, write 0.0`
    /// (seconds).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "capture {:.1}, accumulate {:.1}, finalize {:.1}, smooth {:.1}, solve {:.1}, propagate {:.1}, write {:.1}",
            self.capture,
            self.accumulate,
            self.finalize,
            self.smooth,
            self.solve,
            self.propagate,
            self.write
        )
    }
}

/// Seconds per solve step ([`LinearReport::solve_steps`]) summed over `linears`: the
/// pipeline's steps first, then the solver's (`solver: …`), each in decreasing seconds.
pub fn solve_step_totals(linears: &[LinearReport]) -> Vec<(String, f64)> {
    let mut totals: BTreeMap<&str, f64> = BTreeMap::new();
    for (step, seconds) in linears.iter().flat_map(|l| &l.solve_steps) {
        *totals.entry(step.as_str()).or_default() += seconds;
    }
    let mut listed: Vec<(String, f64)> = totals
        .into_iter()
        .map(|(step, total)| (step.to_owned(), total))
        .collect();
    let solver_step = |step: &str| step.starts_with("solver: ");
    listed.sort_by(|a, b| {
        solver_step(&a.0)
            .cmp(&solver_step(&b.0))
            .then(b.1.total_cmp(&a.1))
    });
    listed
}

/// Seconds per stage summed over `layers`.
pub fn stage_totals(layers: &[LayerReport]) -> StageTotals {
    layers.iter().map(|l| l.stages).sum()
}

/// `device memory 12.3 GB in use, 14.0 GB reserved`.
pub fn device_memory_text(m: DeviceMemory) -> String {
    format!(
        "device memory {:.2} GB in use, {:.2} GB reserved",
        m.in_use as f64 / 1e9,
        m.reserved as f64 / 1e9
    )
}

/// Keys of a report's JSON whose values differ between two runs of the same job: wall-clock
/// seconds (per stage, per step) and memory peaks.
pub const RUN_DEPENDENT_KEYS: [&str; 12] = [
    "seconds",
    "solve_steps",
    "load",
    "capture",
    "accumulate",
    "finalize",
    "smooth",
    "solve",
    "propagate",
    "write",
    "peak_rss_bytes",
    "peak_device_memory",
];

/// Removes the [`RUN_DEPENDENT_KEYS`] at every depth of a report's JSON `value`. What is left
/// must be equal for two runs of the same job (a resumed run and an uninterrupted one, two
/// thread counts).
pub fn strip_run_dependent(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            for key in RUN_DEPENDENT_KEYS {
                map.remove(key);
            }
            map.values_mut().for_each(strip_run_dependent);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(strip_run_dependent),
        _ => {}
    }
}

/// Peak resident set size of this process (Linux `/proc/self/status` `VmHWM`), bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stages are flattened: a layer's JSON keeps the keys it had before they were grouped
    /// (quantization_report.json is read by bench/real_job_summary.py), in the same order.
    #[test]
    fn a_layer_serializes_with_the_stages_as_its_own_keys() {
        let layer = LayerReport {
            layer: 3,
            stages: StageSeconds {
                capture: 1.5,
                write: 0.25,
                ..StageSeconds::default()
            },
            ..LayerReport::default()
        };
        let json = serde_json::to_string(&layer).unwrap();
        assert_eq!(
            json,
            r#"{"layer":3,"kind":"","samples":0,"tokens":0,"load":0.0,"capture":1.5,"accumulate":0.0,"finalize":0.0,"smooth":0.0,"solve":0.0,"propagate":0.0,"write":0.25,"peak_device_memory":null,"peak_rss_bytes":null}"#
        );
    }

    #[test]
    fn totals_sum_each_stage_over_layers() {
        let layer = |capture, solve| LayerReport {
            stages: StageSeconds {
                capture,
                solve,
                ..StageSeconds::default()
            },
            ..LayerReport::default()
        };
        let totals = stage_totals(&[layer(1.0, 2.0), layer(0.5, 4.0)]);
        assert_eq!(
            (totals.capture, totals.solve, totals.write),
            (1.5, 6.0, 0.0)
        );
        assert_eq!(stage_totals(&[]), StageTotals::default());
    }

    #[test]
    fn solve_steps_sum_over_linears_pipeline_steps_first() {
        let linear = |steps: &[(&str, f64)]| LinearReport {
            name: "l".into(),
            treatment: "INT4 g128".into(),
            out_features: 1,
            in_features: 1,
            gptq_loss: None,
            output_error: None,
            baseline_output_error: None,
            error_hessian: None,
            smooth_scale_range: None,
            smooth_alpha: None,
            damping_retries: 0,
            rtn_fallback: false,
            seconds: 0.0,
            solve_steps: steps.iter().map(|&(s, t)| (s.to_owned(), t)).collect(),
        };
        let mut first = linear(&[("solve", 1.0), ("solver: column loop", 0.25)]);
        first.add_step("pack", 0.5);
        first.add_step("pack", 0.5);
        let second = linear(&[("solve", 2.0), ("solver: factor", 0.5), ("baseline", 0.75)]);
        assert_eq!(
            solve_step_totals(&[first, second]),
            vec![
                ("solve".to_owned(), 3.0),
                ("pack".to_owned(), 1.0),
                ("baseline".to_owned(), 0.75),
                ("solver: factor".to_owned(), 0.5),
                ("solver: column loop".to_owned(), 0.25),
            ]
        );
        assert!(solve_step_totals(&[]).is_empty());
    }
}
