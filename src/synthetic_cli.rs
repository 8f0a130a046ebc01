//! The `synthetic_sala` command: the real MiniCPM-SALA configuration with random weights
//! generated on the device, random calibration tokens, and the pipeline's per-layer stages
//! (no checkpoint written); prints seconds per stage, memory and tokens/s per layer, then the
//! projection of a full run. Kept in the library so that a test runs it on a tiny config.

use crate::device::{dispatch, DeviceArg, DeviceJob, GpuPath};
use burn::tensor::backend::Backend;
use clap::{Parser, ValueEnum};
use sala_gptq::model::{FastOps, SalaConfig};
use sala_gptq::report::device_memory_text;
use sala_gptq::synthetic::{random_samples, PRODUCTION_TOKENS};
use sala_gptq::{
    LayerReport, LinearSolver, MemoryProbe, Progress, QuantizeOptions, Recipe, ResidentSolver,
    Sample, Stage, SyntheticModel, SyntheticReport, SyntheticRun,
};
use std::error::Error;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// The released MiniCPM-SALA 9B `config.json` (a copy under `fixtures/`).
pub const SALA_9B_CONFIG: &str = include_str!("../fixtures/minicpm-sala-9b-config.json");

#[derive(Parser, Debug)]
#[command(
    about = "Time the quantization pipeline's stages on a full-size MiniCPM-SALA with random weights (nothing written)"
)]
pub struct Args {
    /// Where the model runs (`cuda` needs a binary built with `--features cuda`).
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
    /// A `config.json` to use instead of the released 9B one (e.g. fixtures/tiny-sala/config.json).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Calibration sequences.
    #[arg(long, default_value_t = 4)]
    samples: usize,
    /// Tokens per sequence (random ids).
    #[arg(long, default_value_t = 1024)]
    seq_len: usize,
    /// Process only the first K decoder layers.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Recipe.
    #[arg(long, value_enum, default_value_t = RecipeArg::Gptq)]
    recipe: RecipeArg,
    /// Seed of the weights and the token ids.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write the report (per layer, per linear, projection) as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Calibration tokens of the projected full run.
    #[arg(long, default_value_t = PRODUCTION_TOKENS)]
    target_tokens: u64,
    /// Device memory for hidden states with `--device cuda`, in MB.
    #[arg(long, default_value_t = 64_000)]
    max_device_memory: u64,
    /// With `--device cuda`: accumulate statistics on the host in f64.
    #[arg(long)]
    host_statistics: bool,
    /// With `--device cuda`: solve on the host (faer) instead of the GPU kernels.
    #[arg(long)]
    host_solver: bool,
    /// Run in f32 without bf16 rounding or storage.
    #[arg(long)]
    f32: bool,
    /// Skip the RTN / max-calibration baseline of every linear (time the solver alone).
    #[arg(long)]
    no_baseline: bool,
    /// Worker threads of the host solvers (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

/// `--recipe`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum RecipeArg {
    Gptq,
    Nvfp4,
}

/// Runs the command and returns its report (also printed, and written with `--json`).
pub fn run(args: Args) -> Result<SyntheticReport, Box<dyn Error>> {
    args.device.check_available("synthetic_sala")?;
    if let Some(n) = args.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()?;
    }
    if args.samples == 0 || args.seq_len == 0 {
        return Err("--samples and --seq-len must be at least 1".into());
    }
    let config = match &args.config {
        Some(path) => SalaConfig::from_file(path)?,
        None => SalaConfig::from_json_str(
            SALA_9B_CONFIG,
            Path::new("fixtures/minicpm-sala-9b-config.json"),
        )?,
    };
    if args.layers == 0 || args.layers > config.num_layers() {
        return Err(format!(
            "--layers {}: the model has {} layers (ask for 1 to {})",
            args.layers,
            config.num_layers(),
            config.num_layers()
        )
        .into());
    }
    let recipe = match args.recipe {
        RecipeArg::Gptq => Recipe::Gptq,
        RecipeArg::Nvfp4 => Recipe::Nvfp4,
    };
    let mut options = QuantizeOptions::new(recipe);
    if args.f32 {
        options.run.numerics = sala_gptq::model::Numerics::F32;
    }
    options.compare_rtn = !args.no_baseline;
    args.device
        .configure(&mut options, args.f32, args.host_statistics);
    if args.device == DeviceArg::Cuda {
        options.max_device_memory = Some(args.max_device_memory.saturating_mul(1_000_000));
    }
    let samples = random_samples(args.samples, args.seq_len, config.vocab_size(), args.seed);
    println!(
        "{} layers of {} ({} hidden, {} intermediate), {} × {} random tokens, {} on the {}",
        args.layers,
        config.num_layers(),
        config.hidden_size(),
        config.intermediate_size(),
        args.samples,
        args.seq_len,
        match recipe {
            Recipe::Gptq => "GPTQ",
            Recipe::Nvfp4 => "NVFP4",
        },
        match args.device {
            DeviceArg::Cpu => "CPU",
            DeviceArg::Cuda => "GPU",
        }
    );
    let job = SyntheticJob {
        config,
        options,
        samples: &samples,
        layers: args.layers,
        seed: args.seed,
        target_tokens: args.target_tokens,
    };
    let numerics = if args.f32 {
        sala_gptq::model::Numerics::F32
    } else {
        sala_gptq::model::Numerics::Bf16Rounding
    };
    let report = dispatch(
        args.device,
        "synthetic_sala",
        GpuPath {
            host_solver: args.host_solver,
            ..GpuPath::default()
        },
        Some(numerics),
        job,
    )?;
    print_summary(&report);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
        println!("report: {}", path.display());
    }
    Ok(report)
}

/// The synthetic run on the backend `--device` picks.
struct SyntheticJob<'a> {
    config: SalaConfig,
    options: QuantizeOptions,
    samples: &'a [Sample],
    layers: usize,
    seed: u64,
    target_tokens: u64,
}

impl DeviceJob for SyntheticJob<'_> {
    type Output = SyntheticReport;

    fn run<B: Backend>(
        self,
        device: B::Device,
        memory: Option<MemoryProbe<B>>,
        solver: Box<dyn LinearSolver>,
        resident: Option<Arc<dyn ResidentSolver<B>>>,
        fast: Option<Arc<dyn FastOps<B>>>,
    ) -> Result<SyntheticReport, Box<dyn Error>> {
        let model = SyntheticModel::<B>::new(self.config, self.seed, &device);
        let scratch = std::env::temp_dir();
        let run = SyntheticRun {
            model: &model,
            options: &self.options,
            solver: solver.as_ref(),
            memory,
            fast,
            resident,
            layers: self.layers,
            target_tokens: self.target_tokens,
            scratch: &scratch,
        };
        Ok(run.run(self.samples, &mut LinePrinter::new())?)
    }
}

/// Prints each finished layer and every message, one line each, and a timestamped line when
/// a stage starts and when each linear is solved (a full-size layer takes minutes: this says
/// where the time goes while it runs).
struct LinePrinter {
    start: Instant,
    layer: usize,
    stage: Option<Stage>,
    steps: usize,
    done: usize,
}

impl LinePrinter {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            layer: 0,
            stage: None,
            steps: 0,
            done: 0,
        }
    }

    fn elapsed(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }
}

impl Progress for LinePrinter {
    fn layer(&mut self, layer: usize) {
        self.layer = layer;
    }
    fn stage(&mut self, stage: Stage, steps: usize) {
        (self.stage, self.steps, self.done) = (Some(stage), steps, 0);
        println!(
            "  [{:8.1} s] layer {}: {stage:?} ({steps} steps)",
            self.elapsed(),
            self.layer
        );
    }
    fn step(&mut self) {
        self.done += 1;
        if self.stage == Some(Stage::Solve) {
            println!(
                "  [{:8.1} s] layer {}: solved {}/{}",
                self.elapsed(),
                self.layer,
                self.done,
                self.steps
            );
        }
    }
    fn layer_done(&mut self, report: &LayerReport) {
        println!("{report}");
    }
    fn message(&mut self, text: &str) {
        println!("{text}");
    }
}

fn print_summary(report: &SyntheticReport) {
    println!(
        "{} layers, {} samples, {} tokens in {:.1} s (embed {:.1}, {}); hidden states {:.1} MB {}; statistics on the {}; solver {}",
        report.layers.len(),
        report.samples,
        report.tokens,
        report.seconds,
        report.embed_seconds,
        sala_gptq::report::stage_totals(&report.layers),
        report.hidden_state_bytes as f64 / 1e6,
        report.hidden_states_location,
        if report.statistics_on_device { "device" } else { "host" },
        report.solver,
    );
    if let Some(m) = report.peak_device_memory {
        println!("peak {}", device_memory_text(m));
    }
    if let Some(b) = report.peak_rss_bytes {
        println!("peak RSS {:.2} GB", b as f64 / 1e9);
    }
    println!(
        "total output error {:.4e} (baseline {:.4e})",
        report.total_output_error(),
        report.total_baseline_error()
    );
    if let Some(p) = &report.projection {
        println!("projection to {} layers:\n{}", p.model_layers, p.formula);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_config_is_the_released_9b_one() {
        let config = SalaConfig::from_json_str(SALA_9B_CONFIG, Path::new("embedded")).unwrap();
        assert_eq!(
            (
                config.num_layers(),
                config.hidden_size(),
                config.vocab_size()
            ),
            (32, 4096, 73448)
        );
    }

    #[test]
    fn a_tiny_run_prints_and_writes_its_json() {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("synth.json");
        let tiny = crate::fixtures_dir().join("tiny-sala/config.json");
        let args = Args::try_parse_from([
            "synthetic_sala",
            "--config",
            tiny.to_str().unwrap(),
            "--layers",
            "2",
            "--samples",
            "2",
            "--seq-len",
            "64",
            "--json",
            json.to_str().unwrap(),
        ])
        .unwrap();
        let report = run(args).unwrap();
        assert_eq!((report.layers.len(), report.tokens), (2, 128));
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(written["layers"].as_array().unwrap().len(), 2);
        assert!(written["projection"]["seconds"].as_f64().unwrap() > 0.0);
    }

    #[test]
    fn bad_sizes_are_refused_before_any_work() {
        let tiny = crate::fixtures_dir().join("tiny-sala/config.json");
        let tiny = tiny.to_str().unwrap();
        for flags in [
            ["--samples", "0"],
            ["--seq-len", "0"],
            ["--layers", "0"],
            ["--layers", "9"],
        ] {
            let mut argv = vec!["synthetic_sala", "--config", tiny];
            argv.extend(flags);
            let err = run(Args::try_parse_from(argv).unwrap()).unwrap_err();
            assert!(err.to_string().contains(flags[0]), "{err}");
        }
    }
}
