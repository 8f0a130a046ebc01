//! The `quantize_sala` command: a thin layer of flags over the `sala-gptq` facade, kept in the
//! library so that its error paths are tested (`tests/quantize_cli.rs`); the example binary only
//! parses and prints.

use crate::device::{dispatch, hessian_in_flight_bytes, DeviceArg, DeviceJob, GpuPath};
use burn::tensor::backend::Backend;
use clap::{Parser, ValueEnum};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use regex::Regex;
use sala_gptq::calib::{CalibOptions, CalibSet, CalibStats, CalibTokenizer};
use sala_gptq::hessian::{ClipSearch, IntScheme, Nvfp4BlockSearch};
use sala_gptq::model::{AttentionMode, FastOps, Numerics, ProfiledOps, SalaConfig};
use sala_gptq::plan::LoaderTarget;
use sala_gptq::smooth::AlphaGrid;
use sala_gptq::{
    LayerBits, LayerFootprint, LayerReport, LinearSolver, MemoryPlan, MemoryProbe, Nvfp4Coverage,
    Nvfp4Solver, Pipeline, Progress, QuantPlan, QuantizeOptions, Recipe, ResidentSolver, Sample,
    Smoothing, Stage, StagedRun,
};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(
    about = "Quantize MiniCPM-SALA (GPTQ W4A16 or NVFP4) into a checkpoint SGLang and vLLM serve"
)]
pub struct Args {
    /// Model directory (config.json, safetensors, tokenizer.json). Default: the bundled trained
    /// tiny SALA, fixtures/tiny-sala-trained (fixtures/tiny-sala has random weights).
    #[arg(long)]
    input: Option<PathBuf>,
    /// Output directory (must not exist unless --overwrite). Default:
    /// target/quantized/MODEL-RECIPE, MODEL the input directory's name and RECIPE gptq or nvfp4.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Recipe.
    #[arg(long, value_enum, default_value_t = RecipeArg::Gptq)]
    recipe: RecipeArg,
    /// Bits of quantized linears (GPTQ: 4 or 8, what gptq_marlin serves; NVFP4: 4); 16 keeps
    /// bf16 (useful per layer: --layer-bits).
    #[arg(long, default_value_t = 4)]
    bits: u32,
    /// Input columns per GPTQ group (gptq_marlin: 32, 64 or 128; --target gptq: any; the last
    /// group may then be partial).
    #[arg(long, default_value_t = 128)]
    group_size: usize,
    /// Bits for minicpm4 (sparse-attention) layers.
    #[arg(long)]
    minicpm4_bits: Option<u32>,
    /// Bits for lightning (linear-attention) layers.
    #[arg(long)]
    lightning_bits: Option<u32>,
    /// Per-layer bits, e.g. "0:4,2-7:8,8:16" (priority: layer > type > --bits); a later, narrower
    /// range overrides a wider one, the same range given twice is refused.
    #[arg(long, default_value = "")]
    layer_bits: String,
    /// Keep modules whose name matches (from the start) in 16 bits; repeatable.
    #[arg(long)]
    exclude: Vec<String>,
    /// Quantize lm_head too.
    #[arg(long)]
    quantize_lm_head: bool,
    /// NVFP4 coverage: minicpm4 attention bf16 (original default), all linears, or MLP only.
    #[arg(long, value_enum, default_value_t = CoverageArg::Minicpm4Bf16)]
    nvfp4_coverage: CoverageArg,
    /// GPTQ: the loaders the checkpoint must load in; only their shape rules apply. marlin:
    /// vLLM / SGLang gptq_marlin (out % 64, in % 128, whole groups of 32, 64 or 128); gptq:
    /// transformers + GPTQModel's torch kernel (any shape whose int32 words pack, a partial last
    /// group allowed). The plan says which loaders will take the result.
    #[arg(long, value_enum, default_value_t = TargetArg::Marlin)]
    target: TargetArg,
    /// Calibration JSONL (`question`, `text` or `messages` per line). Default: the bundled set.
    #[arg(long)]
    calib_data: Option<PathBuf>,
    /// Calibration samples (the file is repeated cyclically when shorter). Default 96, or every
    /// record of the bundled set once when --input is not given.
    #[arg(long)]
    max_samples: Option<usize>,
    /// Longest calibration sample in tokens (the head is kept). Default 131072, or 2048 for the
    /// bundled tiny model (its long samples would make the CPU run take minutes).
    #[arg(long)]
    max_len: Option<usize>,
    /// Skip malformed JSONL lines (counted) instead of failing.
    #[arg(long)]
    skip_malformed: bool,
    /// SmoothQuant migration strength: α in [0, 1] for every group, or `search` for AWQ's
    /// search per group (20 points, α = 0, 0.05, …, 0.95, and the unsmoothed weights, scored by
    /// the group's round-to-nearest output error on the calibration's E[x²]). Default: 0.5 for
    /// NVFP4; off for GPTQ (measured better unsmoothed, docs/quality.md), which this turns on.
    #[arg(long, value_parser = parse_smooth_alpha)]
    smooth_alpha: Option<SmoothAlphaArg>,
    /// Turn SmoothQuant off (NVFP4; GPTQ runs without it unless --smooth-alpha is given).
    #[arg(long, conflicts_with = "smooth_alpha")]
    no_smooth: bool,
    /// GPTQ relative damping `λ / mean(diag H)` (GPTQModel's `damp_percent`; 0.05 measured
    /// better than IST's 0.01 on SmolLM2-135M at group 128, docs/quality.md).
    #[arg(long, default_value_t = sala_gptq::DEFAULT_DAMP_PERCENT)]
    damp: f64,
    /// Symmetric GPTQ grid (default).
    #[arg(long, overrides_with = "no_sym")]
    sym: bool,
    /// Asymmetric GPTQ grid.
    #[arg(long)]
    no_sym: bool,
    /// Symmetric grid: `ist` (2·absmax/15, AutoGPTQ) or `absmax7` (absmax/7, the original script).
    #[arg(long, value_enum, default_value_t = GridArg::Ist)]
    grid: GridArg,
    /// GPTQ act-order (desc_act).
    #[arg(long)]
    act_order: bool,
    /// GPTQ static groups.
    #[arg(long)]
    static_groups: bool,
    /// GPTQ: solve in the natural column order instead of the default group-aware reordering
    /// (GAR, GPTQModel's act_group_aware: groups by decreasing max diag(H), columns inside each
    /// by decreasing diag(H); the checkpoint keeps the natural g_idx either way).
    /// --act-order replaces both.
    #[arg(long)]
    no_group_aware_order: bool,
    /// True-sequential: capture each linear's inputs from the layer whose earlier linears
    /// (attention inputs, o_proj, gate/up) are already quantized; one more forward pass of the
    /// layer per input group.
    #[arg(long)]
    true_sequential: bool,
    /// Read each layer's weights only when its turn comes, instead of on a thread beside the
    /// previous layer's work (which holds one more layer's weights in host memory: 1.1 GB at
    /// full size). The checkpoint is the same either way.
    #[arg(long)]
    no_prefetch: bool,
    /// Fall back to RTN for a linear whose Hessian cannot be factored even after retries.
    #[arg(long)]
    rtn_fallback: bool,
    /// Plain round-to-nearest instead of the GPTQ solver (a baseline for comparisons).
    #[arg(long)]
    rtn: bool,
    /// GPTQ: search each group's range for the least diag(H)-weighted error |w − q|^norm at
    /// each group start of the column loop (GPTQModel's `mse`): shrink factors 1 − i/100 down
    /// to 1 − --clip-max-shrink. On by default (this flag is kept for scripts); on a GPU the
    /// search runs on the device.
    #[arg(long, conflicts_with = "no_clip_search")]
    clip_search: bool,
    /// GPTQ: no clipping search; each group's range is its min/max (the default until
    /// 2026-12-03).
    #[arg(long)]
    no_clip_search: bool,
    /// GPTQ clipping search: the largest shrink of a group's range.
    #[arg(long, default_value_t = 0.8)]
    clip_max_shrink: f32,
    /// GPTQ clipping search: the error exponent (1 to 4 are products; any other one costs
    /// a `powf` per weight and candidate, about ten times as much on the CPU).
    #[arg(long, default_value_t = 2.0)]
    clip_norm: f32,
    /// NVFP4 block-scale search iterations (1 = plain max calibration).
    #[arg(long, default_value_t = 120)]
    mse_iters: usize,
    /// NVFP4 search: smallest candidate is (1 − max_shrink) × the max-calibrated scale.
    #[arg(long, default_value_t = 0.60)]
    mse_max_shrink: f32,
    /// NVFP4 search: error norm p in Σ|w − q|^p · E[x²].
    #[arg(long, default_value_t = 2.0)]
    mse_error_norm: f32,
    /// NVFP4 solver: `search` rounds each block with its searched scale; `gptq` runs GPTQ on
    /// the FP4 grid (the same search at each block, errors spread with the full Hessian;
    /// `--damp` and `--rtn-fallback` apply). GPTQ keeps a full Hessian per input,
    /// as the GPTQ recipe does. `hybrid`: GPTQ on every input narrower than its layer's
    /// widest, the search on the widest (the MLP's down projection, whose Hessian is most of
    /// the Hessian work; the default).
    #[arg(long, value_enum, default_value_t = Nvfp4SolverArg::Hybrid)]
    nvfp4_solver: Nvfp4SolverArg,
    /// Samples at or beyond this many tokens are refused (minicpm4 layers run dense attention
    /// below it; the original scripts' override is 655360).
    #[arg(long, default_value_t = 655360)]
    dense_len: usize,
    /// Run in f32 without the bf16 roundings of the reference model.
    #[arg(long)]
    f32: bool,
    /// Where the model runs: `cpu` (ndarray, f32 with bf16 rounding) or `cuda` (burn-cuda, bf16
    /// storage; needs a binary built with `--features cuda`).
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
    /// Device memory the run may use, in MB: each layer's work on a pack of samples, and the
    /// hidden states of every sample when they fit beside it (else they stay on the host; see
    /// --max-host-memory). Packs shrink to fit it; a sample too long for it is refused before
    /// any compute. Default with `--device cuda`: the GPU's free memory at start less 5 % of
    /// its total; with `--device cpu`: no budget unless given (then it bounds the packs).
    #[arg(long)]
    max_device_memory: Option<u64>,
    /// With `--device cuda`: accumulate Hessians / statistics on the host in f64 instead of on
    /// the device (slower; names a sample whose activations overflow).
    #[arg(long)]
    host_statistics: bool,
    /// With `--device cuda`: solve GPTQ and the NVFP4 search on the host (faer, all cores)
    /// instead of the GPU kernels.
    #[arg(long)]
    host_solver: bool,
    /// With `--device cuda`: run each input's Hessian products before the forward goes on,
    /// instead of on a stream of their own beside the next steps (which holds up to 640 MiB
    /// of inputs longer). The checkpoint is the same either way.
    #[arg(long)]
    serial_hessians: bool,
    /// With `--device cuda`: add `o_proj`'s and `down_proj`'s scaled residual in a pass of its
    /// own after the product (rounded twice), as before the product's epilogue (cuBLASLt) took
    /// it over; the checkpoint differs from the default's by rounding.
    #[arg(long)]
    unfused_residual: bool,
    /// With `--device cuda`: order the forward's library calls (cuBLAS, the NVRTC kernels, the
    /// Hessians' stream) with CubeCL's kernels by the host waiting around each, instead of on
    /// the device (a counter each way, polled by a one-thread kernel). The checkpoint is the
    /// same bit for bit.
    #[arg(long)]
    host_waits: bool,
    /// With `--device cpu`: run the layers with burn-ndarray's graph ops (the reference)
    /// instead of the parallel CPU fast ops (faer GEMMs, fused element-wise passes).
    #[arg(long)]
    graph_ops: bool,
    /// Time every fast op of the forward passes between device synchronisations, and report
    /// the seconds per op for each layer (in the JSON report) and per layer kind (printed).
    /// The synchronisations slow the run down: use it to see where the time goes, not how
    /// long a run takes. Needs the fast ops (not with `--graph-ops`).
    #[arg(long)]
    profile_ops: bool,
    /// Host memory for hidden states, in MB; beyond it they go to a memory-mapped file.
    #[arg(long)]
    max_host_memory: Option<u64>,
    /// Samples of similar length run through a layer together until a pack holds this many
    /// tokens (a longer sample runs alone); 1 runs one sample at a time.
    #[arg(long, default_value_t = sala_gptq::DEFAULT_PACK_TOKENS)]
    pack_tokens: usize,
    /// Skip (and report) samples whose forward pass fails instead of stopping.
    #[arg(long)]
    skip_failed_samples: bool,
    /// Replace an existing output directory, once the new one is complete and verified; only a
    /// quantized checkpoint (or an empty directory) is replaced, anything else is refused.
    #[arg(long)]
    overwrite: bool,
    /// Resumable run: keep each completed layer's state (tensors, report entries, the next
    /// layer's hidden states; synced) in the staging directory next to the output, and
    /// continue where a run with the same arguments stopped (killed, interrupted, failed).
    /// Refused, naming what differs, if the model files, the calibration data or an option
    /// changed; with nothing to resume it starts a fresh run. A run started with --resume
    /// keeps its staging directory on an error, SIGINT, SIGTERM or SIGHUP once it holds a
    /// completed layer (otherwise it is removed as without --resume); a run without --resume
    /// removes a stopped run's staging directory. Costs a write of the hidden states per layer.
    #[arg(long)]
    resume: bool,
    /// Print the plan and exit.
    #[arg(long)]
    plan_only: bool,
    /// Worker threads, 1 to 1024 (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Accepted for compatibility with the original scripts: nothing in this pipeline is random.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// No progress bars.
    #[arg(long)]
    quiet: bool,
    /// Print the full tables: the calibration coverage, the plan per layer and one row per
    /// quantized linear (by default a summary of each; the full figures are always in
    /// quantization_report.json and quantization_report.html).
    #[arg(long)]
    full_table: bool,
}

/// `--recipe`.
/// `--nvfp4-solver`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Nvfp4SolverArg {
    /// The block-scale search, then round to nearest.
    Search,
    /// GPTQ on the FP4 grid.
    Gptq,
    /// GPTQ on the FP4 grid below each layer's widest input, the search on the widest.
    Hybrid,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum RecipeArg {
    Gptq,
    Nvfp4,
}

/// `--target`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum TargetArg {
    Marlin,
    Gptq,
}

/// `--nvfp4-coverage`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum CoverageArg {
    Minicpm4Bf16,
    All,
    MlpOnly,
}

/// `--grid`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum GridArg {
    Ist,
    Absmax7,
}

/// The whole `quantize_sala` binary: process settings (allocator, interrupt handler), flags
/// from `argv` (its first item is the program name), [`run`], and the error on standard error.
/// Exit status 0 on success, 1 on an error, 2 on a usage error.
pub fn main<I, T>(argv: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let _ = COMMAND_STARTED.set(std::time::Instant::now());
    crate::allocator::reuse_freed_memory();
    // A panic (the GPU runtime's failed allocation, a bug) becomes one error line.
    crate::panic_boundary::install_hook();
    // SIGINT / SIGTERM / SIGHUP remove the staging directory before the process ends (a
    // resumable run's with a completed layer is kept).
    if let Err(e) = sala_export::remove_staging_on_interrupt() {
        return fail(&format!("cannot install the interrupt handler: {e}"));
    }
    // A write beyond the file-size limit (`ulimit -f`) fails with EFBIG, an error that names
    // the file, instead of killing the process with SIGXFSZ and leaving the staging directory.
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to "ignore" involves no handler code.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
    let args = match Args::try_parse_from(argv) {
        Ok(args) => args,
        Err(e) => {
            // --help and --version go to standard output, usage errors to standard error.
            let _ = e.print();
            return match e.use_stderr() {
                true => ExitCode::from(2),
                false => ExitCode::SUCCESS,
            };
        }
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e.to_string()),
    }
}

/// When [`main`] started, for the start-up time printed before the first layer.
static COMMAND_STARTED: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

/// Prints `error: <message>` (even to a closed standard error, without panicking); status 1.
fn fail(message: &str) -> ExitCode {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "error: {message}");
    ExitCode::FAILURE
}

/// Runs the command: plan, calibration, quantization, report. Errors are one line each.
pub fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    args.device.check_available("quantize_sala")?;
    if args.profile_ops && args.graph_ops {
        return Err("--profile-ops times the fast ops; --graph-ops turns them off".into());
    }
    if let Some(n) = args.threads {
        if !(1..=MAX_THREADS).contains(&n) {
            return Err(format!("--threads {n}: give 1 to {MAX_THREADS} worker threads").into());
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .map_err(|e| format!("--threads {n}: cannot start the worker threads: {e}"))?;
    }
    let fixtures = crate::fixtures_dir();
    let input = args
        .input
        .clone()
        .unwrap_or_else(|| fixtures.join("tiny-sala-trained"));
    let recipe = match args.recipe {
        RecipeArg::Gptq => Recipe::Gptq,
        RecipeArg::Nvfp4 => Recipe::Nvfp4,
    };
    let options = options_from(&args, recipe)?;
    let config = SalaConfig::from_file(&input.join("config.json"))?;
    let plan = QuantPlan::build(&config, &options.plan)?;
    options.check(&plan)?;
    let plan_json = plan_json(&plan, &config)?;
    let calib_path = args
        .calib_data
        .clone()
        .unwrap_or_else(|| fixtures.join("calib/calib.jsonl"));
    if args.plan_only {
        say(&plan)?;
        // The memory plan needs the samples' lengths: tokenizing is the only work done.
        let (calib, _) = load_calibration(&args, &input, &config, &calib_path)?;
        if let Some(memory) = memory_plan(&args, &config, &options, &calib, &calib_path)? {
            say(memory)?;
        }
        return Ok(());
    }
    let default_output = args.output.is_none();
    let output = args.output.clone().unwrap_or_else(|| {
        let model = input
            .file_name()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned());
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("target/quantized")
            .join(format!("{model}-{}", recipe_name(recipe)))
    });
    let resume_identity = match args.resume {
        true => resume_identity(&args, &calib_path)?,
        false => Vec::new(),
    };
    let mut options = QuantizeOptions {
        // The default output under target/ is re-created on every run.
        overwrite: args.overwrite || default_output,
        resume: args.resume,
        resume_identity,
        ..options
    };
    // What dead runs on this output left: their staging directories go (with --resume, those
    // holding completed layers stay, for the pipeline to check and continue), an old output
    // that a killed commit had moved aside comes back. Fails now if another run is writing it.
    let stale = match args.resume {
        true => sala_export::StaleStaging::KeepResumable,
        false => sala_export::StaleStaging::Remove,
    };
    for line in sala_export::recover_output_with(&output, stale)? {
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "{line}");
    }
    // Everything the commit would refuse, refused now: an existing output without --overwrite,
    // one --overwrite may not replace, one another run is writing.
    sala_export::check_output(
        &output,
        options.overwrite,
        Some(&input),
        &[&calib_path, &input],
    )?;
    let (calib, stats) = load_calibration(&args, &input, &config, &calib_path)?;
    let memory = memory_plan(&args, &config, &options, &calib, &calib_path)?;
    if let Some(memory) = &memory {
        options.pack_tokens = memory.pack_tokens;
        if args.device == DeviceArg::Cuda {
            options.max_device_memory = memory.hidden_allowance();
            args.device.keep_freed_memory(memory.pool_keep());
        }
    }
    // Before any compute, a standard output that cannot be written is an error.
    if args.full_table && !args.quiet {
        say(&stats)?;
        say(&plan)?;
    } else if !args.quiet {
        say(calibration_line(&stats))?;
        say(plan_summary(&plan_json, &plan)?)?;
    }
    if let (Some(memory), false) = (&memory, args.quiet) {
        say(memory)?;
    }
    let model = model_json(&input, &config)?;
    let samples: Vec<Sample> = calib
        .samples
        .into_iter()
        .map(|s| Sample {
            ids: s.ids,
            line: s.line,
        })
        .collect();
    let run_numerics = options.run.numerics;
    let job = QuantizeJob {
        options,
        input: &input,
        output: &output,
        samples: &samples,
        quiet: args.quiet,
        kill_after_layer: kill_after_layer()?,
        profile_ops: args.profile_ops,
    };
    // The checkpoint is verified, and its report written, inside the staging directory; the
    // commit (a rename) comes last, so a failure anywhere leaves the output as it was.
    let StagedRun {
        report,
        mut checkpoint,
    } = crate::panic_boundary::run_guarded(
        memory.map(|m| crate::panic_boundary::DeviceBudget {
            bytes: m.budget,
            hidden_on_device: m.hidden_on_device,
        }),
        || {
            dispatch(
                args.device,
                "quantize_sala",
                gpu_path(&args),
                (!args.graph_ops).then_some(run_numerics),
                job,
            )
        },
    )?;
    let value = serde_json::json!({
        "report": &report,
        "calibration": &stats,
        "plan": plan_json,
        "memory_plan": memory,
        "model": model,
        "settings": report_settings(&args),
    });
    let json = serde_json::to_string_pretty(&value)?;
    checkpoint.write_file(sala_export::REPORT_FILE, json.as_bytes())?;
    // The page is rendered from the JSON just written (not from the structures behind it), so
    // its figures are the file's and `render_report` renders the same page again.
    let page = sala_report_html::render(&sala_report_html::Inputs {
        report: serde_json::from_value(value)
            .map_err(|e| format!("{}: {e}", sala_export::REPORT_FILE))?,
        eval: None,
        drift: None,
    })?;
    checkpoint.write_file(sala_report_html::HTML_FILE, page.as_bytes())?;
    let written = checkpoint.commit()?;
    // The checkpoint and its report are committed: a standard output that cannot be written
    // now (closed, full) changes nothing about them, so it is a warning and the run succeeds.
    let report_path = written.dir.join(sala_export::REPORT_FILE);
    let html_path = written.dir.join(sala_report_html::HTML_FILE);
    let table = match args.full_table {
        true => format!("{}\n", report.table()),
        false => String::new(),
    };
    let ops = report.op_summary().unwrap_or_default();
    if let Err(e) = say(format_args!("{table}{ops}{}", report.summary())).and_then(|()| {
        say(format!(
            "report: {}\n        {}",
            html_path.display(),
            report_path.display()
        ))
    }) {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "warning: {e}; the checkpoint {} is complete and verified, its report is {} ({})",
            written.dir.display(),
            html_path.display(),
            report_path.display()
        );
    }
    Ok(())
}

/// The plan as `quantization_report.json` holds it: every linear's treatment and each
/// layer's kind (which the plan's own serialization leaves out).
fn plan_json(
    plan: &QuantPlan,
    config: &SalaConfig,
) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let mut value = serde_json::to_value(plan)?;
    let kinds: Vec<&str> = config
        .layer_kinds()
        .iter()
        .map(|&k| sala_gptq::plan::kind_name(k))
        .collect();
    if let Some(map) = value.as_object_mut() {
        map.insert("layer_kinds".into(), serde_json::json!(kinds));
        map.insert(
            "loaders".into(),
            serde_json::to_value(plan.loader_verdicts())?,
        );
    }
    Ok(value)
}

/// The plan in a few lines: one per layer kind (the HTML report's summary), then the count.
fn plan_summary(
    plan_json: &serde_json::Value,
    plan: &QuantPlan,
) -> Result<String, Box<dyn std::error::Error>> {
    let summary: sala_report_html::Plan = serde_json::from_value(plan_json.clone())?;
    let mut out = String::from("plan:\n");
    for row in summary.summary() {
        let layers = match row.layers.is_empty() {
            true => String::new(),
            false => format!(" (layers {})", row.layers),
        };
        out += &format!("  {}{layers}: {}\n", row.kind, row.projections);
    }
    out += &format!(
        "  {} of {} linears quantized",
        plan.quantized().count(),
        plan.linears.len()
    );
    for verdict in plan.loader_verdicts() {
        out += &format!("\n  loads in {verdict}");
    }
    Ok(out)
}

/// The calibration coverage in one line (`--full-table` prints the table).
fn calibration_line(stats: &CalibStats) -> String {
    format!(
        "calibration: {} samples ({} distinct), {} tokens (min {}, mean {:.0}, max {}), {} truncated, uniqueness mean {:.3}",
        stats.samples,
        stats.distinct_records,
        stats.total_tokens,
        stats.min_tokens,
        stats.mean_tokens,
        stats.max_tokens,
        stats.truncated,
        stats.uniqueness.mean
    )
}

/// The source model's name, type and size, for the report (bits per parameter, size ratio).
fn model_json(
    input: &Path,
    config: &SalaConfig,
) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let store = sala_gptq::model::TensorStore::open(input)?;
    let mut parameters = 0u64;
    for name in store.names() {
        let info = store.info(name)?;
        parameters += info.shape.iter().map(|&d| d as u64).product::<u64>();
    }
    let mut bytes = 0u64;
    for entry in std::fs::read_dir(input).map_err(|e| format!("{}: {e}", input.display()))? {
        let path = entry
            .map_err(|e| format!("{}: {e}", input.display()))?
            .path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            bytes += std::fs::metadata(&path)
                .map_err(|e| format!("{}: {e}", path.display()))?
                .len();
        }
    }
    let name = input
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| input.display().to_string());
    Ok(serde_json::json!({
        "name": name,
        "model_type": config.raw().model_type,
        "parameters": parameters,
        "bytes": bytes,
    }))
}

/// The most worker threads `--threads` starts.
const MAX_THREADS: usize = 1024;

/// Test hook (for the resume tests, not for users): with `--resume` and this variable set to
/// `k`, the process kills itself with SIGKILL right after layer `k`'s resume state is on disk,
/// as a crash or `kill -9` would, so that nothing is cleaned up.
pub const KILL_AFTER_LAYER_ENV: &str = "SALA_QUANTIZE_KILL_AFTER_LAYER";

/// The layer of [`KILL_AFTER_LAYER_ENV`], if set.
fn kill_after_layer() -> Result<Option<usize>, String> {
    match std::env::var(KILL_AFTER_LAYER_ENV) {
        Err(_) => Ok(None),
        Ok(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| format!("{KILL_AFTER_LAYER_ENV}={v:?}: expected a layer index")),
    }
}

/// The resume fingerprint's entries from the command line: every flag that changes the
/// numbers or the layout, as the user spells it, and the calibration file's hash (the
/// pipeline adds the model files, the samples' token ids and the library options).
fn resume_identity(
    args: &Args,
    calib_path: &Path,
) -> Result<Vec<(String, String)>, Box<dyn std::error::Error>> {
    let hash = sala_gptq::file_hash(calib_path, None)
        .map_err(|e| format!("{}: {e}", calib_path.display()))?;
    let mut identity = settings(args);
    identity.push((
        "calibration file (--calib-data)".into(),
        format!("{}: sha256 {hash}", calib_path.display()),
    ));
    Ok(identity)
}

/// The calibration set tokenized with the model's tokenizer, and its statistics; refuses ids
/// outside the vocabulary and samples at or beyond `--dense-len`, naming the line.
fn load_calibration(
    args: &Args,
    input: &Path,
    config: &SalaConfig,
    calib_path: &Path,
) -> Result<(CalibSet, CalibStats), Box<dyn std::error::Error>> {
    let bundled = args.input.is_none();
    let max_len = args.max_len.unwrap_or(if bundled { 2048 } else { 131_072 });
    let max_samples = args.max_samples.or((!bundled).then_some(96));
    let tokenizer = CalibTokenizer::from_model_dir(input)?;
    let calib = CalibSet::load(
        calib_path,
        &tokenizer,
        &CalibOptions {
            max_len,
            max_samples,
            skip_malformed: args.skip_malformed,
        },
    )?;
    // A tokenizer that is not the model's gives ids the embedding has no row for.
    for sample in &calib.samples {
        if let Some(&id) = sample
            .ids
            .iter()
            .find(|&&id| id as usize >= config.vocab_size())
        {
            return Err(format!(
                "{}:{}: token id {id} is outside the model's vocabulary (vocab_size {} in \
                 config.json); is {} this model's tokenizer?",
                calib_path.display(),
                sample.line,
                config.vocab_size(),
                input.join("tokenizer.json").display()
            )
            .into());
        }
    }
    let stats = CalibStats::of(&calib, Some(args.dense_len));
    if let Some(long) = calib.at_or_above(args.dense_len).first() {
        return Err(format!(
            "{}: calibration line {} has {} tokens, at or beyond --dense-len {} (lower --max-len or raise --dense-len)",
            calib_path.display(),
            long.line,
            long.tokens,
            args.dense_len
        )
        .into());
    }
    let tokens: usize = calib.samples.iter().map(|s| s.ids.len()).sum();
    if tokens < config.hidden_size() {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "warning: the calibration set holds {tokens} tokens, fewer than the hidden size {}: \
             the Hessians cannot be well conditioned and the result will be poor (more \
             samples, --max-samples, or longer ones, --max-len)",
            config.hidden_size()
        );
    }
    Ok((calib, stats))
}

/// The GPU path's choices from the flags.
fn gpu_path(args: &Args) -> GpuPath {
    GpuPath {
        host_solver: args.host_solver,
        serial_hessians: args.serial_hessians,
        unfused_residual: args.unfused_residual,
        host_waits: args.host_waits,
    }
}

/// The run's device-memory plan ([`MemoryPlan`]): the budget is `--max-device-memory`, else
/// the GPU's free memory now less 5 % of its total; `None` on the CPU without the option.
/// Refuses a sample too long for the budget, naming its calibration line.
fn memory_plan(
    args: &Args,
    config: &SalaConfig,
    options: &QuantizeOptions,
    calib: &CalibSet,
    calib_path: &Path,
) -> Result<Option<MemoryPlan>, Box<dyn std::error::Error>> {
    let budget = match (args.max_device_memory, args.device.memory_info()?) {
        (Some(mb), _) => mb.saturating_mul(1_000_000),
        (None, Some((free, total))) => free.saturating_sub(total / 20),
        (None, None) => return Ok(None),
    };
    let elem = match options.run.numerics {
        Numerics::Bf16Storage => 2,
        _ => 4,
    };
    let mut footprint =
        LayerFootprint::estimate(config, options.statistics(), elem, options.run.mlp_rows);
    footprint.fixed += hessian_in_flight_bytes(args.device, gpu_path(args));
    let lengths: Vec<usize> = calib.samples.iter().map(|s| s.ids.len()).collect();
    let device_hidden = args.device == DeviceArg::Cuda;
    MemoryPlan::new(
        &lengths,
        footprint,
        config.hidden_size(),
        elem,
        budget,
        args.pack_tokens,
        device_hidden,
    )
    .map(Some)
    .map_err(|e| {
        let line = calib.samples.get(e.index).map_or(0, |s| s.line);
        format!("{}: calibration line {line}: {e}", calib_path.display()).into()
    })
}

/// Every flag that changes the numbers or the layout, as the user spells it: the resume
/// fingerprint's entries and the start of the report's settings ([`report_settings`]).
fn settings(args: &Args) -> Vec<(String, String)> {
    let a = args;
    let flags: [(&str, String); 44] = [
        ("--recipe", format!("{:?}", a.recipe)),
        ("--bits", a.bits.to_string()),
        ("--group-size", a.group_size.to_string()),
        ("--minicpm4-bits", format!("{:?}", a.minicpm4_bits)),
        ("--lightning-bits", format!("{:?}", a.lightning_bits)),
        ("--layer-bits", format!("{:?}", a.layer_bits)),
        ("--exclude", format!("{:?}", a.exclude)),
        ("--quantize-lm-head", a.quantize_lm_head.to_string()),
        ("--nvfp4-coverage", format!("{:?}", a.nvfp4_coverage)),
        ("--target", format!("{:?}", a.target)),
        ("--max-samples", format!("{:?}", a.max_samples)),
        ("--max-len", format!("{:?}", a.max_len)),
        ("--skip-malformed", a.skip_malformed.to_string()),
        // The α in effect when smoothing is on, and whether it is off: a run's fingerprint
        // names what it did, whichever flags said so.
        (
            "--smooth-alpha",
            a.smooth_alpha.unwrap_or(DEFAULT_SMOOTH_ALPHA).to_string(),
        ),
        ("--no-smooth", smoothing_of(a).is_none().to_string()),
        ("--damp", a.damp.to_string()),
        ("--no-sym", a.no_sym.to_string()),
        ("--grid", format!("{:?}", a.grid)),
        ("--act-order", a.act_order.to_string()),
        ("--static-groups", a.static_groups.to_string()),
        ("--no-group-aware-order", a.no_group_aware_order.to_string()),
        ("--true-sequential", a.true_sequential.to_string()),
        ("--rtn-fallback", a.rtn_fallback.to_string()),
        ("--rtn", a.rtn.to_string()),
        ("--clip-search", a.clip_search.to_string()),
        ("--no-clip-search", a.no_clip_search.to_string()),
        ("--clip-max-shrink", a.clip_max_shrink.to_string()),
        ("--clip-norm", a.clip_norm.to_string()),
        ("--mse-iters", a.mse_iters.to_string()),
        ("--mse-max-shrink", a.mse_max_shrink.to_string()),
        ("--mse-error-norm", a.mse_error_norm.to_string()),
        ("--nvfp4-solver", format!("{:?}", a.nvfp4_solver)),
        ("--dense-len", a.dense_len.to_string()),
        ("--f32", a.f32.to_string()),
        ("--device", format!("{:?}", a.device)),
        ("--max-device-memory", format!("{:?}", a.max_device_memory)),
        ("--host-statistics", a.host_statistics.to_string()),
        ("--host-solver", a.host_solver.to_string()),
        // The residual's sum is rounded twice instead of once: other bits on CUDA.
        ("--unfused-residual", a.unfused_residual.to_string()),
        ("--graph-ops", a.graph_ops.to_string()),
        ("--profile-ops", a.profile_ops.to_string()),
        ("--pack-tokens", a.pack_tokens.to_string()),
        ("--skip-failed-samples", a.skip_failed_samples.to_string()),
        ("--threads", format!("{:?}", a.threads)),
    ];
    flags
        .into_iter()
        .map(|(flag, value)| (flag.to_owned(), value))
        .collect()
}

/// The report's settings: [`settings`], then the flags that change how the run goes but not
/// what it writes (a resume may change them: after running out of memory, say), so that the
/// report names every choice the user made.
fn report_settings(args: &Args) -> Vec<(String, String)> {
    let a = args;
    let mut all = settings(a);
    all.extend(
        [
            ("--no-prefetch", a.no_prefetch.to_string()),
            ("--serial-hessians", a.serial_hessians.to_string()),
            ("--host-waits", a.host_waits.to_string()),
            ("--max-host-memory", format!("{:?}", a.max_host_memory)),
        ]
        .map(|(flag, value)| (flag.to_owned(), value)),
    );
    all
}

/// Writes `text` and a newline to standard output and flushes it; the error names standard
/// output (a closed pipe or a full disk is an error here, not a panic).
fn say(text: impl std::fmt::Display) -> Result<(), String> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{text}")
        .and_then(|()| out.flush())
        .map_err(|e| format!("cannot write to standard output: {e}"))
}

/// The pipeline run on the backend `--device` picks.
struct QuantizeJob<'a> {
    options: QuantizeOptions,
    input: &'a Path,
    output: &'a Path,
    samples: &'a [Sample],
    quiet: bool,
    /// [`KILL_AFTER_LAYER_ENV`].
    kill_after_layer: Option<usize>,
    /// `--profile-ops`.
    profile_ops: bool,
}

impl DeviceJob for QuantizeJob<'_> {
    type Output = StagedRun;

    fn run<B: Backend>(
        self,
        device: B::Device,
        memory: Option<MemoryProbe<B>>,
        solver: Box<dyn LinearSolver>,
        resident: Option<Arc<dyn ResidentSolver<B>>>,
        fast: Option<Arc<dyn FastOps<B>>>,
    ) -> Result<StagedRun, Box<dyn std::error::Error>> {
        let mut pipeline = Pipeline::<B>::new(device, self.options).with_solver(solver);
        if let Some(resident) = resident {
            pipeline = pipeline.with_resident_solver(resident);
        }
        if let Some(probe) = memory {
            pipeline = pipeline.with_memory_probe(probe);
        }
        if let Some(fast) = fast {
            pipeline = pipeline.with_fast_ops(match self.profile_ops {
                true => Arc::new(ProfiledOps::new(fast).switched_on()),
                false => fast,
            });
        }
        let mut progress = Bars::new(self.quiet);
        progress.kill_after_layer = self.kill_after_layer;
        Ok(pipeline.run_staged(self.input, self.output, self.samples, &mut progress)?)
    }
}

fn recipe_name(recipe: Recipe) -> &'static str {
    match recipe {
        Recipe::Gptq => "gptq",
        Recipe::Nvfp4 => "nvfp4",
    }
}

fn options_from(
    args: &Args,
    recipe: Recipe,
) -> Result<QuantizeOptions, Box<dyn std::error::Error>> {
    let mut options = QuantizeOptions::new(recipe);
    let plan = &mut options.plan;
    plan.bits = args.bits;
    plan.group_size = args.group_size;
    plan.minicpm4_bits = args.minicpm4_bits;
    plan.lightning_bits = args.lightning_bits;
    plan.layer_bits = LayerBits::parse(&args.layer_bits)?;
    plan.exclude = args
        .exclude
        .iter()
        .map(|p| Regex::new(p).map_err(|e| format!("--exclude {p:?}: {e}")))
        .collect::<Result<_, _>>()?;
    plan.quantize_lm_head = args.quantize_lm_head;
    plan.nvfp4_coverage = match args.nvfp4_coverage {
        CoverageArg::Minicpm4Bf16 => Nvfp4Coverage::Minicpm4AttentionBf16,
        CoverageArg::All => Nvfp4Coverage::All,
        CoverageArg::MlpOnly => Nvfp4Coverage::MlpOnly,
    };
    plan.target = match args.target {
        TargetArg::Marlin => LoaderTarget::Marlin,
        TargetArg::Gptq => LoaderTarget::Gptq,
    };
    options.gptq.scheme = match (args.no_sym, args.grid) {
        (true, _) => IntScheme::Asymmetric,
        (false, GridArg::Ist) => IntScheme::SymmetricIst,
        (false, GridArg::Absmax7) => IntScheme::SymmetricAbsMax,
    };
    options.gptq.damping.percdamp = args.damp;
    options.gptq.act_order = args.act_order;
    options.gptq.static_groups = args.static_groups;
    options.gptq.group_aware_order = !args.no_group_aware_order;
    options.true_sequential = args.true_sequential;
    options.prefetch_weights = !args.no_prefetch;
    options.gptq.rtn_fallback = args.rtn_fallback;
    options.gptq.rtn = args.rtn;
    options.gptq.clip = match args.no_clip_search {
        true => None,
        false => Some(
            ClipSearch::new(100, args.clip_max_shrink, args.clip_norm)
                .map_err(|e| format!("--clip-max-shrink / --clip-norm: {e}"))?,
        ),
    };
    options.nvfp4_search = Nvfp4BlockSearch {
        iters: args.mse_iters,
        max_shrink: args.mse_max_shrink,
        error_norm: args.mse_error_norm,
    };
    options.nvfp4_solver = match args.nvfp4_solver {
        Nvfp4SolverArg::Search => Nvfp4Solver::BlockSearch,
        Nvfp4SolverArg::Gptq => Nvfp4Solver::Gptq,
        Nvfp4SolverArg::Hybrid => Nvfp4Solver::Hybrid,
    };
    options.smoothing = smoothing_of(args);
    options.run.attention = AttentionMode::Dense;
    if args.f32 {
        options.run.numerics = Numerics::F32;
    }
    options.max_host_memory = match args.max_host_memory {
        None => None,
        Some(mb) => Some(mb.checked_mul(1_000_000).ok_or_else(|| {
            format!("--max-host-memory {mb}: more bytes than a 64-bit count holds")
        })?),
    };
    if let Some(mb) = args.max_device_memory {
        if mb == 0 || mb.checked_mul(1_000_000).is_none() {
            return Err(format!(
                "--max-device-memory {mb}: give a positive number of MB that a 64-bit byte \
                 count holds"
            )
            .into());
        }
    }
    options.skip_failed_samples = args.skip_failed_samples;
    options.pack_tokens = args.pack_tokens;
    args.device
        .configure(&mut options, args.f32, args.host_statistics);
    Ok(options)
}

/// indicatif bars: one for layers, one for the current stage's samples or linears. When
/// standard error is not a terminal (a log), one plain line per finished layer instead.
struct Bars {
    bars: Option<(MultiProgress, ProgressBar, ProgressBar)>,
    lines: bool,
    /// [`KILL_AFTER_LAYER_ENV`].
    kill_after_layer: Option<usize>,
    /// The layer in progress, for the place a panic is reported at.
    layer: usize,
    /// When the command started, until the first layer reports its start-up time.
    started: Option<std::time::Instant>,
}

impl Bars {
    fn new(quiet: bool) -> Self {
        use std::io::IsTerminal;
        let interactive = std::io::stderr().is_terminal();
        let bars = (!quiet && interactive).then(|| {
            let multi = MultiProgress::new();
            // The ETA of each bar: of the run on the layers' bar, of the current stage on the
            // steps' bar.
            let style = ProgressStyle::with_template(
                "{prefix:>10} [{bar:30}] {pos}/{len} {msg} (ETA {eta})",
            )
            .expect("static template")
            .progress_chars("=> ");
            let layers = multi.add(
                ProgressBar::new(0)
                    .with_style(style.clone())
                    .with_prefix("layers"),
            );
            let steps = multi.add(ProgressBar::new(0).with_style(style));
            (multi, layers, steps)
        });
        Self {
            bars,
            lines: !quiet && !interactive,
            kill_after_layer: None,
            layer: 0,
            started: COMMAND_STARTED.get().copied(),
        }
    }
}

impl Progress for Bars {
    fn start(&mut self, layers: usize, _samples: usize) {
        // What runs next, before layer 0's first stage.
        crate::panic_boundary::set_place("the embedding, before layer 0".to_owned());
        if let Some((_, l, _)) = &self.bars {
            l.set_length(layers as u64);
        }
    }
    fn layer(&mut self, layer: usize) {
        self.layer = layer;
        crate::panic_boundary::set_place(format!("layer {layer}"));
        if let (Some(started), true) = (self.started, self.bars.is_some() || self.lines) {
            self.message(&format!(
                "start-up: layer {layer} starts {:.1} s after the command started (flags, \
                 tokenizing, device set-up, embedding)",
                started.elapsed().as_secs_f64()
            ));
            self.started = None;
        }
        if let Some((_, l, _)) = &self.bars {
            l.set_position(layer as u64);
            l.set_message(format!("layer {layer}"));
        }
    }
    fn stage(&mut self, stage: Stage, steps: usize) {
        let name = match stage {
            Stage::Capture => "capture",
            Stage::Solve => "solve",
            Stage::Propagate => "propagate",
        };
        crate::panic_boundary::set_place(format!("layer {}, {name}", self.layer));
        if let Some((_, _, s)) = &self.bars {
            s.set_prefix(name);
            // A new stage starts its own clock: the ETA is the stage's.
            s.reset();
            s.set_length(steps as u64);
        }
    }
    fn step(&mut self) {
        if let Some((_, _, s)) = &self.bars {
            s.inc(1);
        }
    }
    fn layer_done(&mut self, report: &LayerReport) {
        if self.bars.is_some() || self.lines {
            self.message(&report.to_string());
        }
    }
    fn layer_saved(&mut self, layer: usize) {
        if self.kill_after_layer == Some(layer) {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "{KILL_AFTER_LAYER_ENV}: killing the process after layer {layer}"
            );
            // SAFETY: sends SIGKILL to this process (the test hook's crash).
            #[cfg(unix)]
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
            std::process::abort();
        }
    }
    fn message(&mut self, text: &str) {
        match &self.bars {
            Some((m, _, _)) => {
                let _ = m.println(text);
            }
            None => {
                use std::io::Write;
                // Progress lines are not worth a failed run when standard error is closed.
                let _ = writeln!(std::io::stderr(), "{text}");
            }
        }
    }
    fn finish(&mut self) {
        if let Some((_, l, s)) = &self.bars {
            l.finish_and_clear();
            s.finish_and_clear();
        }
    }
}

#[cfg(all(test, not(feature = "cuda")))]
mod tests {
    use super::*;

    #[test]
    fn smoothing_defaults_to_alpha_half_for_nvfp4_and_off_for_gptq() {
        let smoothing = |flags: &[&str]| {
            let argv = ["quantize_sala"].iter().chain(flags).copied();
            smoothing_of(&Args::try_parse_from(argv).expect("flags parse"))
        };
        assert_eq!(smoothing(&[]), None);
        assert_eq!(smoothing(&["--recipe", "gptq", "--no-smooth"]), None);
        assert_eq!(
            smoothing(&["--recipe", "gptq", "--smooth-alpha", "0.5"]),
            Some(Smoothing::Fixed(0.5))
        );
        assert_eq!(
            smoothing(&["--recipe", "nvfp4"]),
            Some(Smoothing::Fixed(0.5))
        );
        assert_eq!(smoothing(&["--recipe", "nvfp4", "--no-smooth"]), None);
        assert_eq!(
            smoothing(&["--recipe", "nvfp4", "--smooth-alpha", "search"]),
            Some(Smoothing::Searched(AlphaGrid::DEFAULT))
        );
        // Both at once are a contradiction, refused as a usage error.
        let both = ["quantize_sala", "--no-smooth", "--smooth-alpha", "0.3"];
        assert!(Args::try_parse_from(both).is_err());
    }

    /// Each GPU flag sets its own choice of the path and no other; none sets none.
    #[test]
    fn gpu_flags_set_their_own_choices() {
        let path = |flags: &[&str]| {
            let argv = ["quantize_sala"].iter().chain(flags).copied();
            gpu_path(&Args::try_parse_from(argv).expect("flags parse"))
        };
        assert_eq!(path(&[]), GpuPath::default());
        let each = [
            (
                "--host-solver",
                GpuPath {
                    host_solver: true,
                    ..GpuPath::default()
                },
            ),
            (
                "--serial-hessians",
                GpuPath {
                    serial_hessians: true,
                    ..GpuPath::default()
                },
            ),
            (
                "--unfused-residual",
                GpuPath {
                    unfused_residual: true,
                    ..GpuPath::default()
                },
            ),
            (
                "--host-waits",
                GpuPath {
                    host_waits: true,
                    ..GpuPath::default()
                },
            ),
        ];
        for (flag, want) in each {
            assert_eq!(path(&[flag]), want, "{flag}");
        }
    }

    /// `--unfused-residual` changes the checkpoint's bits, so a resume across it is refused (it
    /// is in the fingerprint); the flags that change only how the run goes are in the report's
    /// settings and not in the fingerprint, so a resume may change them.
    #[test]
    fn resume_identity_holds_what_changes_the_bits_and_the_report_all_flags() {
        let dir = tempfile::tempdir().unwrap();
        let calib = dir.path().join("calib.jsonl");
        std::fs::write(&calib, "{\"text\": \"a\"}\n").unwrap();
        let parse = |flags: &[&str]| {
            let argv = ["quantize_sala"].iter().chain(flags).copied();
            Args::try_parse_from(argv).expect("flags parse")
        };
        let value = |entries: &[(String, String)], flag: &str| {
            let found = entries.iter().filter(|(name, _)| name == flag);
            found.map(|(_, v)| v.clone()).collect::<Vec<_>>()
        };
        let identity = |flags: &[&str]| resume_identity(&parse(flags), &calib).unwrap();
        assert_eq!(value(&identity(&[]), "--unfused-residual"), ["false"]);
        assert_eq!(
            value(&identity(&["--unfused-residual"]), "--unfused-residual"),
            ["true"]
        );
        let run_only = [
            ("--no-prefetch", None),
            ("--serial-hessians", None),
            ("--host-waits", None),
            ("--max-host-memory", Some("4000")),
        ];
        for (flag, arg) in run_only {
            let flags: Vec<&str> = std::iter::once(flag).chain(arg).collect();
            assert_eq!(
                identity(&flags),
                identity(&[]),
                "{flag} is not in the fingerprint"
            );
            let report = report_settings(&parse(&flags));
            let want = arg.map_or("true".to_owned(), |mb| format!("Some({mb})"));
            assert_eq!(value(&report, flag), [want], "{flag} in the report");
            assert_eq!(
                report[..settings(&parse(&flags)).len()],
                settings(&parse(&flags))
            );
        }
    }

    #[test]
    fn cuda_is_refused_in_a_build_without_the_feature_before_any_work() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing-model");
        let args = Args::try_parse_from([
            "quantize_sala",
            "--device",
            "cuda",
            "--input",
            missing.to_str().unwrap(),
        ])
        .unwrap();
        let err = run(args).unwrap_err().to_string();
        // The device is refused first: the missing model is never looked at.
        assert!(err.contains("--features cuda"), "{err}");
        assert!(!err.contains("missing-model"), "{err}");
    }
}

/// NVFP4's α when `--smooth-alpha` is not given (the original scripts').
const DEFAULT_SMOOTH_ALPHA: SmoothAlphaArg = SmoothAlphaArg::Fixed(0.5);

/// The smoothing the flags ask for: `--smooth-alpha` when given, none under `--no-smooth`,
/// else the recipe's default (NVFP4: α = 0.5; GPTQ: none).
fn smoothing_of(args: &Args) -> Option<Smoothing> {
    let alpha = match (args.smooth_alpha, args.no_smooth, args.recipe) {
        (_, true, _) => return None,
        (Some(alpha), false, _) => alpha,
        (None, false, RecipeArg::Gptq) => return None,
        (None, false, RecipeArg::Nvfp4) => DEFAULT_SMOOTH_ALPHA,
    };
    Some(match alpha {
        SmoothAlphaArg::Fixed(alpha) => Smoothing::Fixed(alpha),
        SmoothAlphaArg::Search => Smoothing::Searched(AlphaGrid::DEFAULT),
    })
}

/// `--smooth-alpha`: a fixed α or `search`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum SmoothAlphaArg {
    Fixed(f32),
    Search,
}

impl std::fmt::Display for SmoothAlphaArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SmoothAlphaArg::Fixed(alpha) => write!(f, "{alpha}"),
            SmoothAlphaArg::Search => f.write_str("search"),
        }
    }
}

fn parse_smooth_alpha(value: &str) -> Result<SmoothAlphaArg, String> {
    if value == "search" {
        return Ok(SmoothAlphaArg::Search);
    }
    match value.parse::<f32>() {
        Ok(alpha) if (0.0..=1.0).contains(&alpha) => Ok(SmoothAlphaArg::Fixed(alpha)),
        _ => Err(format!(
            "{value:?} is neither a number in [0, 1] nor `search`"
        )),
    }
}
