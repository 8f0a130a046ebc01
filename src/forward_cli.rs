//! The `bench_forward` command: one layer of each kind of the real MiniCPM-SALA configuration
//! (random weights), timed on packs of short samples and on one long sample — the upload of
//! the weights (per layer) apart from the capture and propagate passes (per token) — and the
//! projection of the production calibration run's forward passes from those figures. Can dump
//! each layer's weights, inputs and outputs for the PyTorch comparison (`bench/torch_layer.py`).

use crate::device::{dispatch, DeviceArg, DeviceJob, GpuPath};
use crate::synthetic_cli::SALA_9B_CONFIG;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use clap::Parser;
use sala_gptq::forward_bench::{
    measure_case, measure_channel_sums, measure_mixer, profile_case, project_forward,
    random_hidden, timed_upload, CaseProfile, ChannelSumsMeasurement, ForwardCase,
    ForwardMeasurement, ForwardProjection, LayerFixedCost, MixerMeasurement, PerTokenCost,
    PRODUCTION_LENGTH_MIX,
};
use sala_gptq::model::{
    FastOps, LayerKind, LayerRunner, LayerWeights, Numerics, OpTotal, ProfiledOps, SalaConfig,
};
use sala_gptq::{LinearSolver, MemoryProbe, ResidentSolver, SyntheticModel, WeightSource};
use serde::Serialize;
use std::collections::BTreeMap;
use std::error::Error;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(
    about = "Time one layer of each kind (capture and propagate passes, weight upload) on packs of short samples and one long sample, and project the production run's forward passes"
)]
pub struct Args {
    /// Where the model runs (`cuda` needs a binary built with `--features cuda`).
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
    /// A `config.json` to use instead of the released 9B one (e.g. fixtures/tiny-sala/config.json).
    #[arg(long)]
    config: Option<PathBuf>,
    /// The cases, `COUNTxLEN` each (COUNT sequences of LEN tokens in one pack), comma-separated.
    /// The projection fits each layer kind's per-token cost through the shortest and the
    /// longest sequence length measured.
    #[arg(long, default_value = "8x1024,16x1024,1x131072")]
    cases: String,
    /// Timed repetitions of each pass (after one untimed run); the best is kept.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Seed of the weights and the inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write each layer's weights and each case's input and output (bf16 safetensors, with a
    /// `meta.json`) into this directory, for `bench/torch_layer.py`.
    #[arg(long)]
    dump: Option<PathBuf>,
    /// With `--device cpu`: burn-ndarray's graph ops (the reference) instead of the parallel
    /// CPU fast ops.
    #[arg(long)]
    graph_ops: bool,
    /// Run in f32 without bf16 storage (GPU) or rounding.
    #[arg(long)]
    f32: bool,
    /// After each case's timed passes, run one capture and one propagate pass with every
    /// fast op timed between device synchronisations, and report the seconds per op (the
    /// synchronised passes are slower than the timed ones; the difference to the sum of the
    /// ops is the graph's own work). Needs the fast ops (not with `--graph-ops`).
    #[arg(long)]
    profile_ops: bool,
    /// With `--device cuda`: `o_proj` and `down_proj` add their residual in a pass of its own
    /// after the product instead of in its epilogue (cuBLASLt), as `quantize_sala
    /// --unfused-residual`.
    #[arg(long)]
    unfused_residual: bool,
    /// With `--device cuda`: the library calls (cuBLAS, the NVRTC kernels) are ordered with
    /// CubeCL's kernels by the host waiting around each instead of on the device, as
    /// `quantize_sala --host-waits`. The outputs are the same bit for bit.
    #[arg(long)]
    host_waits: bool,
}

/// What `bench_forward` measured.
#[derive(Debug, Serialize)]
pub struct ForwardReport {
    /// `cpu` or `cuda`.
    pub device: String,
    /// Whether the kernel cache (`target/sala-kernels/<fingerprint>`) held kernels when the run started
    /// (`warm`) or not (`cold`); a cold run's first passes include compilation, which the
    /// untimed first run of every pass absorbs.
    pub kernel_cache: String,
    /// Whether the backend's fast kernels (`FastOps`) ran.
    pub fast_ops: bool,
    /// What they run, in their own words (`FastOps::describe`), where they ran.
    pub fast_path: Option<String>,
    /// Timed repetitions per pass.
    pub reps: usize,
    /// Per layer kind: seconds to upload its weights.
    pub fixed: Vec<LayerFixedCost>,
    /// Per layer kind and case.
    pub measurements: Vec<ForwardMeasurement>,
    /// The mixers' cores alone (attention, GLA) per layer kind and case.
    pub mixers: Vec<MixerMeasurement>,
    /// Per case: the per-channel statistics of an input as wide as the MLP's (NVFP4's scales,
    /// SmoothQuant), the fast op against the tensor ops.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub channel_sums: Vec<ChannelSumsMeasurement>,
    /// Per layer kind: the fitted per-token cost of the capture and propagate passes.
    pub per_token: Vec<KindCost>,
    /// The production calibration run's forward passes, projected.
    pub projection: ForwardProjection,
    /// With `--profile-ops`: per layer kind and case, the passes op by op.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub profiles: Vec<CaseProfile>,
}

/// The per-token costs of one layer kind.
#[derive(Debug, Serialize)]
pub struct KindCost {
    /// Layer kind.
    pub kind: String,
    /// Capture pass.
    pub capture: PerTokenCost,
    /// Propagate pass.
    pub propagate: PerTokenCost,
}

/// `warm` when the kernel cache of this build ([`sala_gptq::kernel_cache_dir`]) holds
/// compiled kernels, else `cold` (always `cold` without the `cuda` feature).
fn kernel_cache_state() -> &'static str {
    #[cfg(feature = "cuda")]
    if sala_gptq::kernel_cache_dir()
        .read_dir()
        .is_ok_and(|mut d| d.next().is_some())
    {
        return "warm";
    }
    "cold"
}

/// Parses `--cases`.
fn parse_cases(text: &str) -> Result<Vec<ForwardCase>, String> {
    text.split(',')
        .map(|case| {
            let (count, len) = case
                .trim()
                .split_once('x')
                .ok_or_else(|| format!("--cases: {case:?} is not COUNTxLEN"))?;
            let parse = |v: &str| {
                v.parse::<usize>()
                    .ok()
                    .filter(|&n| n > 0 && n <= 1 << 24)
                    .ok_or_else(|| format!("--cases: {case:?}: {v:?} is not a count in 1..=2^24"))
            };
            let (count, len) = (parse(count)?, parse(len)?);
            count
                .checked_mul(len)
                .filter(|&t| t <= 1 << 24)
                .ok_or_else(|| format!("--cases: {case:?} has more than 2^24 tokens"))?;
            Ok(ForwardCase::uniform(count, len))
        })
        .collect()
}

/// Runs `bench_forward` with `args`, prints a table and returns the report.
pub fn run(args: Args) -> Result<ForwardReport, Box<dyn Error>> {
    args.device.check_available("bench_forward")?;
    if args.profile_ops && args.graph_ops {
        return Err("--profile-ops times the fast ops; --graph-ops turns them off".into());
    }
    let cases = parse_cases(&args.cases)?;
    let config = match &args.config {
        Some(path) => SalaConfig::from_file(path)?,
        None => SalaConfig::from_json_str(
            SALA_9B_CONFIG,
            Path::new("fixtures/minicpm-sala-9b-config.json"),
        )?,
    };
    if let Some(dir) = &args.dump {
        std::fs::create_dir_all(dir).map_err(|e| format!("--dump {}: {e}", dir.display()))?;
    }
    let kernel_cache = kernel_cache_state();
    let job = ForwardJob {
        config,
        cases,
        reps: args.reps,
        seed: args.seed,
        dump: args.dump.clone(),
        numerics: if args.f32 {
            Numerics::F32
        } else if args.device == DeviceArg::Cuda {
            Numerics::Bf16Storage
        } else {
            Numerics::Bf16Rounding
        },
        device_name: format!("{:?}", args.device).to_lowercase(),
        kernel_cache: kernel_cache.into(),
        profile_ops: args.profile_ops,
    };
    let cpu_fast_ops = (!args.graph_ops).then_some(job.numerics);
    let report = dispatch(
        args.device,
        "bench_forward",
        GpuPath {
            host_solver: true,
            unfused_residual: args.unfused_residual,
            host_waits: args.host_waits,
            ..GpuPath::default()
        },
        cpu_fast_ops,
        job,
    )?;
    print_report(&report);
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text).map_err(|e| format!("--json {}: {e}", path.display()))?;
    }
    Ok(report)
}

struct ForwardJob {
    config: SalaConfig,
    cases: Vec<ForwardCase>,
    reps: usize,
    seed: u64,
    dump: Option<PathBuf>,
    numerics: Numerics,
    device_name: String,
    kernel_cache: String,
    profile_ops: bool,
}

impl DeviceJob for ForwardJob {
    type Output = ForwardReport;

    fn run<B: Backend>(
        self,
        device: B::Device,
        _memory: Option<MemoryProbe<B>>,
        _solver: Box<dyn LinearSolver>,
        _resident: Option<Arc<dyn ResidentSolver<B>>>,
        fast: Option<Arc<dyn FastOps<B>>>,
    ) -> Result<ForwardReport, Box<dyn Error>> {
        let options = sala_gptq::model::RunOptions {
            numerics: self.numerics,
            attention: sala_gptq::model::AttentionMode::Dense,
            ..Default::default()
        };
        let mut runner = LayerRunner::<B>::new(self.config.clone(), device.clone(), options);
        let fast_ops = fast.is_some();
        let fast_path = fast.as_ref().map(|f| f.describe());
        if let Some(fast) = fast {
            runner = runner.with_fast_ops(match self.profile_ops {
                true => Arc::new(ProfiledOps::new(fast)),
                false => fast,
            });
        }
        let model = SyntheticModel::<B>::new(self.config.clone(), self.seed, &device);
        let mut fixed = Vec::new();
        let mut measurements = Vec::new();
        let mut mixers = Vec::new();
        let mut per_token = Vec::new();
        let mut profiles = Vec::new();
        let started = std::time::Instant::now();
        let mut meta = BTreeMap::new();
        for layer in first_layer_of_each_kind(&self.config) {
            let weights = model.layer(layer)?;
            let (device_weights, cost) = timed_upload(&runner, &weights)?;
            eprintln!("{}: weights uploaded in {:.3} s", cost.kind, cost.upload_s);
            if let Some(dir) = &self.dump {
                dump_weights(dir, &cost.kind, &weights)?;
            }
            let mut kind_measurements = Vec::new();
            for case in &self.cases {
                if let Some(m) = measure_mixer(&runner, layer, case, self.reps)? {
                    eprintln!(
                        "[{:7.1} s] {} {}: {:.4} s ({:.1} TFLOP/s){}",
                        started.elapsed().as_secs_f64(),
                        m.op,
                        m.case,
                        m.seconds,
                        m.tflops,
                        m.max_rel_diff_vs_graph.map_or(String::new(), |d| format!(
                            ", max rel. diff vs graph {d:.1e}"
                        ))
                    );
                    mixers.push(m);
                }
                B::seed(&device, self.seed ^ case.tokens() as u64);
                let hidden = random_hidden(&runner, case.tokens());
                let (m, output) = measure_case(
                    &runner,
                    &weights,
                    &device_weights,
                    case,
                    hidden.clone(),
                    self.reps,
                )?;
                eprintln!(
                    "[{:7.1} s] {} {}: propagate {:.3} ms/1k tokens ({:.1} TFLOP/s), capture {:.3} ms/1k",
                    started.elapsed().as_secs_f64(),
                    m.kind,
                    m.case,
                    m.ms_per_1k_tokens,
                    m.tflops,
                    m.capture_ms_per_1k_tokens
                );
                if let Some(p) =
                    profile_case(&runner, &weights, &device_weights, case, hidden.clone())?
                {
                    profiles.push(p);
                }
                if let Some(dir) = &self.dump {
                    dump_case(dir, &m.kind, &case.name, hidden, output)?;
                    meta.insert(format!("{}_{}", m.kind, case.name), case.lengths.clone());
                }
                kind_measurements.push(m);
            }
            per_token.push(fit_kind(&cost.kind, &kind_measurements, &self.cases)?);
            measurements.extend(kind_measurements);
            fixed.push(cost);
        }
        if let Some(dir) = &self.dump {
            write_meta(dir, &self.config, &meta)?;
        }
        let mut channel_sums = Vec::new();
        for case in &self.cases {
            let channels = self.config.intermediate_size();
            if let Some(m) = measure_channel_sums(&runner, case, channels, self.reps)? {
                eprintln!(
                    "[{:7.1} s] channel_sums {} [{} × {channels}]: one pass {:.3} ms, tensor ops {:.3} ms, max rel. diff {:.1e}",
                    started.elapsed().as_secs_f64(),
                    m.case,
                    case.tokens(),
                    m.fast_seconds * 1e3,
                    m.graph_seconds * 1e3,
                    m.max_rel_diff_vs_graph
                );
                channel_sums.push(m);
            }
        }
        let costs: Vec<(String, PerTokenCost, PerTokenCost)> = per_token
            .iter()
            .map(|k| (k.kind.clone(), k.capture, k.propagate))
            .collect();
        let projection = project_forward(&self.config, &PRODUCTION_LENGTH_MIX, &fixed, &costs)?;
        Ok(ForwardReport {
            device: self.device_name,
            kernel_cache: self.kernel_cache,
            fast_ops,
            fast_path,
            reps: self.reps,
            fixed,
            measurements,
            mixers,
            channel_sums,
            per_token,
            projection,
            profiles,
        })
    }
}

/// The first decoder layer of each kind in `config` (in layer order).
fn first_layer_of_each_kind(config: &SalaConfig) -> Vec<usize> {
    let mut seen: Vec<LayerKind> = Vec::new();
    (0..config.num_layers())
        .filter(|&l| {
            let kind = config.layer_kind(l);
            let new = !seen.contains(&kind);
            seen.push(kind);
            new
        })
        .collect()
}

/// A kind's per-token costs, fitted through its measurements at the shortest and the longest
/// sequence length (the largest pack of each).
fn fit_kind(
    kind: &str,
    measured: &[ForwardMeasurement],
    cases: &[ForwardCase],
) -> Result<KindCost, String> {
    let length = |m: &ForwardMeasurement| m.tokens / m.sequences.max(1);
    let pick = |longest: bool| {
        measured
            .iter()
            .zip(cases)
            .map(|(m, _)| m)
            .max_by_key(|m| {
                let len = length(m) as i64;
                (if longest { len } else { -len }, m.tokens)
            })
            .ok_or_else(|| format!("no case measured for {kind}"))
    };
    let (short, long) = (pick(false)?, pick(true)?);
    let per_token = |m: &ForwardMeasurement, s: f64| s / m.tokens as f64;
    Ok(KindCost {
        kind: kind.to_owned(),
        capture: PerTokenCost::fit(
            length(short),
            per_token(short, short.capture_s),
            length(long),
            per_token(long, long.capture_s),
        ),
        propagate: PerTokenCost::fit(
            length(short),
            per_token(short, short.propagate_s),
            length(long),
            per_token(long, long.propagate_s),
        ),
    })
}

fn print_report(report: &ForwardReport) {
    println!(
        "device {} (kernel cache {}, fast kernels {}), best of {} runs",
        report.device,
        report.kernel_cache,
        if report.fast_ops { "on" } else { "off" },
        report.reps
    );
    if let Some(path) = &report.fast_path {
        println!("fast path: {path}");
    }
    for f in &report.fixed {
        println!(
            "{:>10}: weights upload {:.3} s per layer",
            f.kind, f.upload_s
        );
    }
    println!(
        "{:>10} {:>16} {:>8} {:>14} {:>14} {:>10}",
        "kind", "case", "tokens", "prop ms/1k", "capt ms/1k", "TFLOP/s"
    );
    for m in &report.measurements {
        println!(
            "{:>10} {:>16} {:>8} {:>14.3} {:>14.3} {:>10.1}",
            m.kind, m.case, m.tokens, m.ms_per_1k_tokens, m.capture_ms_per_1k_tokens, m.tflops
        );
    }
    let p = &report.projection;
    println!(
        "projected forward passes of {} samples / {} tokens: {:.1} s fixed + {:.1} s capture + {:.1} s propagate = {:.1} min",
        p.samples,
        p.tokens,
        p.fixed_s,
        p.capture_s,
        p.propagate_s,
        p.total_s / 60.0
    );
    for p in &report.profiles {
        print_profile(&p.kind, &p.case, "capture", p.capture_s, &p.capture_ops);
        print_profile(
            &p.kind,
            &p.case,
            "propagate",
            p.propagate_s,
            &p.propagate_ops,
        );
    }
}

/// One profiled pass: seconds per op, their share of the pass, and the rest (the graph's own
/// work).
fn print_profile(kind: &str, case: &str, pass: &str, seconds: f64, ops: &[OpTotal]) {
    println!(
        "{kind} {case} {pass}, synchronised per op: {:.2} ms",
        1e3 * seconds
    );
    let share = |s: f64| 100.0 * s / seconds.max(f64::MIN_POSITIVE);
    for op in ops {
        println!(
            "  {:>18} {:>5} calls {:>10.3} ms {:>5.1} %",
            op.op,
            op.calls,
            1e3 * op.seconds,
            share(op.seconds)
        );
    }
    let rest = seconds - ops.iter().map(|o| o.seconds).sum::<f64>();
    println!(
        "  {:>18} {:>5}       {:>10.3} ms {:>5.1} %",
        "rest",
        "",
        1e3 * rest,
        share(rest)
    );
}

/// Bytes of `tensor` as bf16 (converted on the host: not every backend has bf16 tensors).
fn bf16_bytes<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Vec<u8> {
    tensor
        .into_data()
        .convert_dtype(DType::BF16)
        .as_bytes()
        .to_vec()
}

fn save(path: &Path, tensors: Vec<(String, Vec<usize>, Vec<u8>)>) -> Result<(), Box<dyn Error>> {
    let views = tensors
        .iter()
        .map(|(name, shape, bytes)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()?;
    safetensors::serialize_to_file(views, None, path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(())
}

fn dump_weights(dir: &Path, kind: &str, weights: &LayerWeights) -> Result<(), Box<dyn Error>> {
    let prefix = format!("model.layers.{}.", weights.layer);
    let tensors = weights
        .tensors
        .iter()
        .map(|(name, t)| {
            let bytes = t
                .data
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect();
            let short = name.strip_prefix(&prefix).unwrap_or(name).to_owned();
            (short, t.shape.clone(), bytes)
        })
        .collect();
    save(&dir.join(format!("{kind}_weights.safetensors")), tensors)
}

fn dump_case<B: Backend>(
    dir: &Path,
    kind: &str,
    case: &str,
    input: Tensor<B, 2>,
    output: Tensor<B, 2>,
) -> Result<(), Box<dyn Error>> {
    let shape = input.dims().to_vec();
    save(
        &dir.join(format!("{kind}_{case}.safetensors")),
        vec![
            ("input".into(), shape.clone(), bf16_bytes(input)),
            ("output".into(), shape, bf16_bytes(output)),
        ],
    )
}

/// `meta.json`: the numbers of the configuration the PyTorch layer needs, and each dumped
/// case's sequence lengths.
fn write_meta(
    dir: &Path,
    config: &SalaConfig,
    cases: &BTreeMap<String, Vec<usize>>,
) -> Result<(), Box<dyn Error>> {
    let attention = config.attention_heads();
    let lightning = config.lightning_heads();
    let meta = serde_json::json!({
        "hidden_size": config.hidden_size(),
        "intermediate_size": config.intermediate_size(),
        "rms_norm_eps": config.rms_norm_eps(),
        "rope_theta": config.rope_theta(),
        "residual_scale": config.residual_scale(),
        "attention": {"heads": attention.heads, "kv_heads": attention.kv_heads, "head_dim": attention.head_dim},
        "lightning": lightning.map(|h| serde_json::json!({"heads": h.heads, "head_dim": h.head_dim})),
        "gla_log_decays": lightning.map(|h| sala_gptq::model::ops::gla::log_decays(h.heads)),
        "cases": cases,
    });
    let path = dir.join("meta.json");
    std::fs::write(&path, serde_json::to_string_pretty(&meta)?)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_parse_and_bad_ones_name_themselves() {
        let cases = parse_cases("16x1024, 1x131072").unwrap();
        assert_eq!(cases[0].name, "packed_1024");
        assert_eq!(cases[0].tokens(), 16_384);
        assert_eq!(cases[1].name, "single_131072");
        for bad in ["16*1024", "0x5", "3x", "x9", "100000x100000"] {
            let err = parse_cases(bad).unwrap_err();
            assert!(err.contains("--cases"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_tiny_run_measures_both_kinds_and_projects() {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("forward.json");
        let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-sala/config.json");
        let args = Args::parse_from([
            "bench_forward",
            "--config",
            config.to_str().unwrap(),
            "--cases",
            "2x16,1x48",
            "--reps",
            "1",
            "--json",
            json.to_str().unwrap(),
            "--dump",
            dir.path().join("dump").to_str().unwrap(),
        ]);
        let report = run(args).unwrap();
        let kinds: Vec<&str> = report.fixed.iter().map(|f| f.kind.as_str()).collect();
        assert_eq!(kinds, ["minicpm4", "lightning"]);
        assert_eq!(report.measurements.len(), 4);
        assert!(report
            .measurements
            .iter()
            .all(|m| m.propagate_s > 0.0 && m.capture_s > 0.0));
        assert_eq!(report.projection.samples, 96);
        assert!(report.projection.total_s > 0.0);
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
        assert_eq!(written["measurements"][0]["case"], "packed_16_x2");
        // The CPU fast ops have causal attention and Simple GLA, each checked against the graph
        // on the small cases: attention to f32 rounding; GLA's output is rounded once to the
        // storage dtype, the graph's is not (within one bf16 step of the largest value).
        let ops: Vec<&str> = report.mixers.iter().map(|m| m.op.as_str()).collect();
        assert!(
            ops.contains(&"simple_gla") && ops.contains(&"causal_attention"),
            "{ops:?}"
        );
        for m in &report.mixers {
            let bound = if m.op == "causal_attention" {
                1e-5
            } else {
                1.0 / 128.0
            };
            let diff = m
                .max_rel_diff_vs_graph
                .unwrap_or_else(|| panic!("{} {}: not checked against the graph", m.op, m.case));
            assert!(diff < bound, "{} {}: {diff}", m.op, m.case);
        }
        let meta = std::fs::read_to_string(dir.path().join("dump/meta.json")).unwrap();
        assert!(meta.contains("lightning_single_48"), "{meta}");
        assert!(dir
            .path()
            .join("dump/lightning_weights.safetensors")
            .exists());
    }
}
