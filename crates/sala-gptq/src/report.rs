//! What a run did, per linear and per layer, as JSON (written into the output directory) and as
//! a table for the terminal.

use serde::Serialize;
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
    /// Proxy output error of the chosen quantization: `tr((W−Q) H (W−Q)ᵀ)` with the full
    /// (smoothed) Hessian for GPTQ, with its diagonal `E[x²]` for NVFP4.
    pub output_error: Option<f64>,
    /// The same error for the baseline: RTN (GPTQ) or max calibration (NVFP4).
    pub baseline_output_error: Option<f64>,
    /// Range of the smoothing scales folded into this linear's input columns.
    pub smooth_scale_range: Option<(f32, f32)>,
    /// Damping retries of the Cholesky inverse (GPTQ).
    pub damping_retries: usize,
    /// Whether GPTQ fell back to RTN.
    pub rtn_fallback: bool,
    /// Wall time of the solve, seconds.
    pub seconds: f64,
}

/// One decoder layer's timing by stage, seconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LayerReport {
    /// Layer index.
    pub layer: usize,
    /// `minicpm4`, `lightning` or `llama`.
    pub kind: String,
    /// Forward passes with taps and statistics.
    pub capture: f64,
    /// Smoothing and solving.
    pub solve: f64,
    /// Forward passes with the quantized weights.
    pub propagate: f64,
    /// Writing tensors.
    pub write: f64,
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
    /// Tensor bytes written.
    pub output_bytes: u64,
    /// The verifier's summary of the written checkpoint.
    pub verify_summary: String,
}

impl Report {
    /// Sum of the solver's output errors over quantized linears.
    pub fn total_output_error(&self) -> f64 {
        self.linears.iter().filter_map(|l| l.output_error).sum()
    }

    /// Sum of the baseline's output errors over quantized linears.
    pub fn total_baseline_error(&self) -> f64 {
        self.linears
            .iter()
            .filter_map(|l| l.baseline_output_error)
            .sum()
    }

    /// Seconds per stage summed over layers: capture, solve, propagate, write.
    pub fn stage_totals(&self) -> [f64; 4] {
        self.layers.iter().fold([0.0; 4], |acc, l| {
            [
                acc[0] + l.capture,
                acc[1] + l.solve,
                acc[2] + l.propagate,
                acc[3] + l.write,
            ]
        })
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "| linear | treatment | shape | output error | baseline | smooth s | retries | s |"
        )?;
        writeln!(f, "|---|---|---|---|---|---|---|---|")?;
        for l in self.linears.iter().filter(|l| l.output_error.is_some()) {
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
        let [capture, solve, propagate, write] = self.stage_totals();
        writeln!(f)?;
        writeln!(
            f,
            "{} recipe: {} samples, {} tokens, {} layers, {:.1} s (capture {capture:.1}, solve {solve:.1}, propagate {propagate:.1}, write {write:.1})",
            self.recipe,
            self.samples,
            self.tokens,
            self.layers.len(),
            self.seconds
        )?;
        writeln!(
            f,
            "total output error {:.4e} (baseline {:.4e}); hidden states {:.1} MB{}; peak RSS {}",
            self.total_output_error(),
            self.total_baseline_error(),
            self.hidden_state_bytes as f64 / 1e6,
            if self.hidden_states_on_disk {
                " (memory-mapped file)"
            } else {
                ""
            },
            self.peak_rss_bytes
                .map_or("unknown".to_owned(), |b| format!(
                    "{:.1} MB",
                    b as f64 / 1e6
                ))
        )?;
        if !self.failed_samples.is_empty() {
            writeln!(f, "skipped samples: {}", self.failed_samples.join("; "))?;
        }
        write!(
            f,
            "{} -> {}: {}",
            self.input, self.output, self.verify_summary
        )
    }
}

/// Peak resident set size of this process (Linux `/proc/self/status` `VmHWM`), bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
