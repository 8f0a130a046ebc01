//! H200 benchmark of the CUDA path: cuBLAS/cuSOLVER glue and the CubeCL kernels on the SALA
//! linear shapes, each checked against the CPU references of `sala-hessian`.
//!
//! ```text
//! bench_gpu [--data DIR] [--json FILE] [--shapes 4096x4096,16384x4096,4096x16384]
//!           [--tokens 8192] [--reps 3] [--warmup 1] [--cpu-reps 3] [--crop-rows 64]
//!           [--seed 1] [--tf32] [--skip STAGE,...] [--cpu-only]
//! ```
//!
//! Per shape `out × in` (from a fixed seed): activations X `[tokens, in]` bf16, the Hessian
//! H = XᵀX/tokens, the weight W `[out, in]` f32; then
//! - `hessian_cublas_bf16` (`xtx_bf16`) and `hessian_cubecl_f32` (`accumulate_xtx` on
//!   `CubeGemm`, checked against cuBLAS), TFLOP/s = 2·tokens·in²/t;
//! - `hessian_sym_BLOCK_{single,batched}` (`xtx_runs_bf16_blocked`: the symmetric product's
//!   lower blocks, one GEMM each or one strided-batched GEMM per block diagonal, for blocks
//!   of 2048, 1024 and 512) and `hessian_halving_BLOCK_{single,batched}` (the same split by
//!   recursive halving down to diagonal blocks of 2048, 1024 or 512), TFLOP/s of the full
//!   product's FLOP (so that they compare by time), the fraction of it done and the
//!   difference to `hessian_cublas_bf16`;
//! - `inverse_cusolver` and `inverse_faer_cpu` (H + 1% mean-diagonal damping), check
//!   max|U_gpu − U_cpu| / max|U|;
//! - `gptq_cublas`, `gptq_cubecl` (the solve given U) and `*_total` (with the inverse): INT4
//!   symmetric, group 128, block 128, natural order; loss Σ(w−q)²/(2·U_cc²); codes of the first
//!   `--crop-rows` rows compared with `sala_hessian::Gptq` (`gptq_cpu_crop`);
//! - `nvfp4_search` (120 candidates, shrink 0.6, p = 2, weighted by diag H), total weighted
//!   error; the first rows compared byte for byte with
//!   `sala_hessian::reference::nvfp4_block_search_naive` (`nvfp4_cpu_crop`);
//! - `nvfp4_gptq`: GPTQ on the NVFP4 grid given the cuSOLVER factor (`nvfp4_gptq_solve`, lazy
//!   block 128), total loss.
//!
//! Every stage is timed with warm-up and device synchronization (median of `--reps`); a stage
//! that fails prints its error and the others still run. `--data` writes the inputs for
//! `bench/torch_gptq.py` (safetensors + manifest.json), `--json` the results for
//! `bench/compare.py`. `--cpu-only` runs the CPU stages alone (no GPU needed: to test the
//! inputs and files on a small `--shapes`). `--skip` takes stage names: selftest, hessian,
//! hessian_blocks,
//! inverse, inverse_cpu, gptq_cublas, gptq_cubecl, gptq_cpu, nvfp4, nvfp4_cpu, nvfp4_gptq.
//! The self-tests (first) check both GEMMs on strided windows in every transpose combination,
//! the bf16 XᵀX and the cuSOLVER factor on small problems against f64 references.

mod data;
mod report;
mod selftest;
mod stages;

const USAGE: &str = "usage: bench_gpu [--data DIR] [--json FILE] [--shapes OUTxIN,...] \
[--tokens N] [--reps N] [--warmup N] [--cpu-reps N] [--crop-rows N] [--seed N] [--tf32] \
[--skip selftest,hessian,hessian_blocks,inverse,inverse_cpu,gptq_cublas,gptq_cubecl,gptq_cpu,nvfp4,nvfp4_cpu,\
nvfp4_gptq] [--cpu-only]";

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::ExitCode;

use report::{cell, print_table, Json, Row};

/// Command-line options.
#[derive(Debug, Clone)]
pub struct Args {
    pub data: Option<PathBuf>,
    pub json: Option<PathBuf>,
    pub shapes: Vec<(usize, usize)>,
    pub tokens: usize,
    pub reps: usize,
    pub warmup: usize,
    pub cpu_reps: usize,
    pub crop_rows: usize,
    pub seed: u64,
    pub tf32: bool,
    pub cpu_only: bool,
    pub skip: HashSet<String>,
}

impl Args {
    fn parse() -> Result<Self, String> {
        let mut args = Args {
            data: None,
            json: None,
            shapes: vec![(4096, 4096), (16384, 4096), (4096, 16384)],
            tokens: 8192,
            reps: 3,
            warmup: 1,
            cpu_reps: 3,
            crop_rows: 64,
            seed: 1,
            tf32: false,
            cpu_only: false,
            skip: HashSet::new(),
        };
        let mut it = std::env::args().skip(1);
        while let Some(flag) = it.next() {
            let mut value = || it.next().ok_or(format!("{flag} needs a value"));
            match flag.as_str() {
                "--data" => args.data = Some(value()?.into()),
                "--json" => args.json = Some(value()?.into()),
                "--shapes" => args.shapes = parse_shapes(&value()?)?,
                "--tokens" => args.tokens = number(&flag, &value()?)?,
                "--reps" => args.reps = number(&flag, &value()?)?,
                "--warmup" => args.warmup = number(&flag, &value()?)?,
                "--cpu-reps" => args.cpu_reps = number(&flag, &value()?)?,
                "--crop-rows" => args.crop_rows = number(&flag, &value()?)?,
                "--seed" => args.seed = number(&flag, &value()?)? as u64,
                "--skip" => args.skip = value()?.split(',').map(str::to_string).collect(),
                "--tf32" => args.tf32 = true,
                "--cpu-only" => args.cpu_only = true,
                "-h" | "--help" => return Err(String::new()),
                other => return Err(format!("unknown option {other}")),
            }
        }
        Ok(args)
    }

    /// Whether a stage was not skipped.
    pub fn runs(&self, stage: &str) -> bool {
        !self.skip.contains(stage)
    }
}

fn number(flag: &str, text: &str) -> Result<usize, String> {
    text.parse()
        .map_err(|_| format!("{flag}: {text:?} is not a number"))
}

fn parse_shapes(text: &str) -> Result<Vec<(usize, usize)>, String> {
    text.split(',')
        .map(|s| {
            let (o, i) = s
                .split_once(['x', 'X'])
                .ok_or(format!("shape {s:?} is not OUTxIN"))?;
            Ok((number("--shapes", o)?, number("--shapes", i)?))
        })
        .collect()
}

/// The results of one shape (`out = inp = 0` for the self-tests).
pub struct ShapeResult {
    pub name: String,
    pub out: usize,
    pub inp: usize,
    pub rows: Vec<Row>,
}

fn main() -> ExitCode {
    let args = match Args::parse() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("{e}");
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let gpu = if args.cpu_only {
        Err("--cpu-only".to_string())
    } else {
        stages::Gpu::open(&args)
    };
    if let Err(e) = &gpu {
        println!("GPU stages skipped: {e}");
    }
    let mut bench = stages::Bench::new(&args, gpu.as_ref().ok());
    let mut results = Vec::new();
    if let (Ok(gpu), true) = (&gpu, args.runs("selftest")) {
        println!("\n== self-tests of the CUDA glue");
        results.push(ShapeResult {
            name: "selftest".into(),
            out: 0,
            inp: 0,
            rows: selftest::run(gpu),
        });
    }
    for &(out, inp) in &args.shapes {
        println!("\n== shape {out}x{inp} (out × in), tokens {}", args.tokens);
        let rows = bench.run_shape(out, inp);
        let name = format!("{out}x{inp}");
        results.push(ShapeResult {
            name,
            out,
            inp,
            rows,
        });
        if let Err(e) = write_results(&args, &bench, &results) {
            println!("writing the JSON failed: {e}");
        }
    }
    print_summary(&results);
    let failed = results
        .iter()
        .flat_map(|s| &s.rows)
        .filter(|r| r.error.is_some())
        .count();
    println!("\n{failed} failed measurement(s)");
    if failed > 0 || gpu.is_err() && !args.cpu_only {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// The JSON of the whole run (rewritten after every shape, so a crash keeps what was done).
fn write_results(
    args: &Args,
    bench: &stages::Bench<'_>,
    results: &[ShapeResult],
) -> std::io::Result<()> {
    let Some(path) = &args.json else {
        return Ok(());
    };
    let shapes = results
        .iter()
        .map(|s| {
            Json::obj(vec![
                ("name", Json::Str(s.name.clone())),
                ("out", Json::Num(s.out as f64)),
                ("in", Json::Num(s.inp as f64)),
                (
                    "results",
                    Json::Arr(s.rows.iter().map(Row::to_json).collect()),
                ),
            ])
        })
        .collect();
    let mut fields = vec![
        ("producer", Json::Str("bench_gpu".into())),
        ("tokens", Json::Num(args.tokens as f64)),
        ("reps", Json::Num(args.reps as f64)),
        ("crop_rows", Json::Num(args.crop_rows as f64)),
    ];
    fields.extend(bench.meta());
    fields.push(("shapes", Json::Arr(shapes)));
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, format!("{}\n", Json::obj(fields)))
}

fn print_summary(results: &[ShapeResult]) {
    let rows: Vec<Vec<String>> = results
        .iter()
        .flat_map(|s| {
            s.rows.iter().map(move |r| {
                vec![
                    s.name.clone(),
                    r.kernel.to_string(),
                    cell(r.time_s),
                    cell(r.tflops()),
                    cell(r.bytes.zip(r.time_s).map(|(b, t)| b / t / 1e9)),
                    cell(r.loss),
                    r.checks(),
                    r.error.clone().unwrap_or_default(),
                ]
            })
        })
        .collect();
    println!();
    print_table(
        &[
            "shape", "kernel", "time s", "TFLOP/s", "GB/s", "loss", "checks", "failure",
        ],
        &rows,
    );
}
