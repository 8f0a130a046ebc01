//! The measurements of one shape. Every stage returns a [`Row`]; a failure (error or panic)
//! becomes a row with its message and the next stage runs.

use std::path::Path;
use std::sync::Arc;

use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::{ComputeClient, Runtime};
use sala_hessian::{
    reference, CholeskyInverse, Damping, FailurePolicy, Gptq, GptqConfig, Hessian,
    HessianAccumulator, IntGrid, IntScheme, Normalization, Nvfp4BlockSearch,
};
use sala_kernels::cuda::{
    inverse_upper_cusolver, inverse_upper_cusolver_timed, library_report, sync_client, xtx_bf16,
    xtx_runs_bf16_blocked, Bf16Matrix, Cublas, CublasGemm, Cusolver, Fp32Math, LibraryStatus,
    XtxBlocking, XtxRun,
};
use sala_kernels::{
    accumulate_xtx, gptq_solve, nvfp4_block_search, nvfp4_gptq_solve, xtx_lower_blocks, CubeGemm,
    DeviceGptqConfig, DeviceGptqResult, MatrixView,
};

use crate::data::{self, Tensor, TensorData};
use crate::report::{cell, time_it, Json, Row};
use crate::Args;

/// Relative damping of the inverse (GPTQ's `damp_percent`).
const PERCDAMP: f64 = 0.01;
/// INT4 GPTQ settings: group and lazy-block length.
const GROUP: usize = 128;
const BLOCK: usize = 128;

/// A stage's own result type: failures are messages.
pub type Stage<T> = Result<T, String>;

fn msg(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// The CUDA device: CubeCL's client and the vendor libraries (each may have failed alone).
pub struct Gpu {
    pub client: ComputeClient<CudaRuntime>,
    pub name: String,
    pub blas: Stage<Arc<Cublas>>,
    pub solver: Stage<Arc<Cusolver>>,
    pub libraries: Vec<LibraryStatus>,
}

impl Gpu {
    /// Loads the libraries (printing which ones load) and opens device 0.
    pub fn open(_args: &Args) -> Stage<Self> {
        let libraries = library_report();
        println!("CUDA libraries:");
        for lib in &libraries {
            println!("  {lib}");
        }
        for needed in ["cuda", "nvrtc"] {
            if let Some(lib) = libraries.iter().find(|l| l.name == needed && !l.ok()) {
                return Err(format!("{} cannot be loaded (see above)", lib.name));
            }
        }
        let client = catch("opening the CubeCL CUDA client", || {
            Ok(CudaRuntime::client(&CudaDevice::default()))
        })?;
        let name = cudarc::driver::CudaContext::new(0)
            .and_then(|ctx| ctx.name())
            .unwrap_or_else(|e| format!("unknown device ({e:?})"));
        let blas = Cublas::new(0).map(Arc::new).map_err(msg);
        let solver = Cusolver::new(0).map(Arc::new).map_err(msg);
        for (what, result) in [
            ("cuBLAS", blas.as_ref().err()),
            ("cuSOLVER", solver.as_ref().err()),
        ] {
            if let Some(e) = result {
                println!("{what} unavailable, its stages will fail: {e}");
            }
        }
        println!("device: {name}");
        Ok(Self {
            client,
            name,
            blas,
            solver,
            libraries,
        })
    }

    fn sync(&self) -> Stage<()> {
        sync_client(&self.client).map_err(msg)
    }

    pub fn blas(&self) -> Stage<&Arc<Cublas>> {
        self.blas
            .as_ref()
            .map_err(|e| format!("cuBLAS unavailable: {e}"))
    }

    pub fn solver(&self) -> Stage<&Arc<Cusolver>> {
        self.solver
            .as_ref()
            .map_err(|e| format!("cuSOLVER unavailable: {e}"))
    }

    fn upload(&self, values: &[f32], rows: usize, cols: usize) -> Stage<MatrixView> {
        MatrixView::upload(&self.client, values, rows, cols).map_err(msg)
    }
}

/// Runs `f`, turning a panic into an error message (CubeCL and cudarc panic on some device
/// failures, e.g. out of memory).
fn catch<T>(what: &str, f: impl FnOnce() -> Stage<T>) -> Stage<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let text = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        Err(format!("{what} panicked: {text}"))
    })
}

/// Runs one stage: its row, or a failed row carrying the error; prints a one-line summary.
pub fn stage(kernel: &'static str, f: impl FnOnce() -> Stage<Row>) -> Row {
    let row = catch(kernel, f).unwrap_or_else(|e| Row::failed(kernel, e));
    match &row.error {
        Some(e) => println!("  {kernel:<22} FAILED: {e}"),
        None => println!(
            "  {kernel:<22} {} s  {} TFLOP/s  loss {}  {}",
            cell(row.time_s),
            cell(row.tflops()),
            cell(row.loss),
            row.checks()
        ),
    }
    row
}

/// `max|a − b| / max|b|` over two equally long sequences.
fn max_rel_diff(a: impl Iterator<Item = f32>, b: impl Iterator<Item = f32>) -> f64 {
    let (mut diff, mut scale) = (0.0f64, 0.0f64);
    for (x, y) in a.zip(b) {
        diff = diff.max((x as f64 - y as f64).abs());
        scale = scale.max((y as f64).abs());
    }
    if scale == 0.0 {
        diff
    } else {
        diff / scale
    }
}

/// The activations of one input width, shared by the shapes that have it.
struct Activations {
    inp: usize,
    x: Vec<u16>,
    h: Option<Vec<f32>>,
    file: Option<String>,
}

/// The benchmark state across shapes.
pub struct Bench<'a> {
    args: &'a Args,
    gpu: Option<&'a Gpu>,
    activations: Option<Activations>,
    manifest: Vec<Json>,
}

impl<'a> Bench<'a> {
    pub fn new(args: &'a Args, gpu: Option<&'a Gpu>) -> Self {
        Self {
            args,
            gpu,
            activations: None,
            manifest: Vec::new(),
        }
    }

    /// Run-level fields of the JSON.
    pub fn meta(&self) -> Vec<(&'static str, Json)> {
        let libraries = self.gpu.map_or(Vec::new(), |g| {
            g.libraries
                .iter()
                .map(|l| {
                    Json::obj(vec![
                        ("name", Json::Str(l.name.into())),
                        ("loaded", l.loaded.clone().map_or(Json::Null, Json::Str)),
                        (
                            "errors",
                            Json::Arr(l.errors.iter().cloned().map(Json::Str).collect()),
                        ),
                    ])
                })
                .collect()
        });
        vec![
            (
                "device",
                Json::Str(
                    self.gpu
                        .map_or("none (cpu only)".into(), |g| g.name.clone()),
                ),
            ),
            ("libraries", Json::Arr(libraries)),
            ("percdamp", Json::Num(PERCDAMP)),
            ("tf32", Json::Bool(self.args.tf32)),
        ]
    }

    /// Every stage of one shape.
    pub fn run_shape(&mut self, out: usize, inp: usize) -> Vec<Row> {
        let args = self.args;
        let gpu = self.gpu;
        let mut rows = Vec::new();
        if self.activations.as_ref().map(|a| a.inp) != Some(inp) {
            println!("  generating X [{}, {inp}] (bf16)", args.tokens);
            self.activations = Some(Activations {
                inp,
                x: data::activations(args.tokens, inp, args.seed ^ inp as u64),
                h: None,
                file: None,
            });
        }
        let Some(acts) = self.activations.as_mut() else {
            return rows;
        };
        let h_new = hessian_stages(args, gpu, &acts.x, inp, &mut rows);
        if acts.h.is_none() {
            acts.h = h_new;
        }
        let Some(h) = acts.h.as_deref() else {
            rows.push(Row::failed("inputs", "no Hessian could be computed".into()));
            return rows;
        };
        println!("  generating W [{out}, {inp}] (f32)");
        let w_seed = args.seed.wrapping_mul(31) ^ (out * 7 + inp) as u64;
        let w = data::weights(out, inp, w_seed);
        let amax = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let global_scale = match sala_formats::nvfp4::global_scale_from_amax(amax) {
            Ok(g) => g,
            Err(e) => {
                rows.push(Row::failed("inputs", e.to_string()));
                return rows;
            }
        };
        if let Some(dir) = &args.data {
            // The activations file is written by the first shape of this width in this run.
            let first = acts.file.is_none();
            let act_file = acts
                .file
                .get_or_insert_with(|| format!("act_in{inp}.safetensors"));
            let inputs = Inputs {
                tokens: args.tokens,
                out,
                inp,
                x: &acts.x,
                h,
                w: &w,
                global_scale,
            };
            match inputs.write(dir, act_file, first) {
                Ok(entry) => {
                    self.manifest.push(entry);
                    if let Err(e) = write_manifest(dir, args, &self.manifest) {
                        println!("  writing the manifest failed: {e}");
                    }
                }
                Err(e) => println!("  writing the inputs failed: {e}"),
            }
        }
        let u_gpu = inverse_stages(args, gpu, h, inp, &mut rows);
        gptq_stages(args, gpu, &w, h, u_gpu.as_ref(), out, inp, &mut rows);
        nvfp4_stages(args, gpu, &w, h, global_scale, out, inp, &mut rows);
        nvfp4_gptq_stage(args, gpu, &w, h, u_gpu.as_ref(), global_scale, &mut rows);
        rows
    }
}

/// The inputs of one shape, as the PyTorch side reads them.
struct Inputs<'a> {
    tokens: usize,
    out: usize,
    inp: usize,
    x: &'a [u16],
    h: &'a [f32],
    w: &'a [f32],
    global_scale: f32,
}

impl Inputs<'_> {
    /// Writes the activations file (when `with_activations`) and the weight file, and
    /// returns the manifest entry of the shape.
    fn write(&self, dir: &Path, act_file: &str, with_activations: bool) -> std::io::Result<Json> {
        let (tokens, out, inp) = (self.tokens, self.out, self.inp);
        std::fs::create_dir_all(dir)?;
        if with_activations {
            let act_path = dir.join(act_file);
            println!("  writing {}", act_path.display());
            data::write_safetensors(
                &act_path,
                &[
                    Tensor {
                        name: "x",
                        dtype: "BF16",
                        shape: vec![tokens, inp],
                        data: TensorData::Bf16(self.x),
                    },
                    Tensor {
                        name: "h",
                        dtype: "F32",
                        shape: vec![inp, inp],
                        data: TensorData::F32(self.h),
                    },
                ],
            )?;
        }
        let w_file = format!("w_{out}x{inp}.safetensors");
        data::write_safetensors(
            &dir.join(&w_file),
            &[Tensor {
                name: "w",
                dtype: "F32",
                shape: vec![out, inp],
                data: TensorData::F32(self.w),
            }],
        )?;
        Ok(Json::obj(vec![
            ("name", Json::Str(format!("{out}x{inp}"))),
            ("out", Json::Num(out as f64)),
            ("in", Json::Num(inp as f64)),
            ("activations", Json::Str(act_file.into())),
            ("weight", Json::Str(w_file)),
            ("global_scale", Json::Num(self.global_scale as f64)),
        ]))
    }
}

/// `manifest.json`: the run's settings and the shapes written so far.
fn write_manifest(dir: &Path, args: &Args, shapes: &[Json]) -> std::io::Result<()> {
    let search = Nvfp4BlockSearch::default();
    let manifest = Json::obj(vec![
        ("producer", Json::Str("bench_gpu".into())),
        ("tokens", Json::Num(args.tokens as f64)),
        ("percdamp", Json::Num(PERCDAMP)),
        ("bits", Json::Num(4.0)),
        ("group_size", Json::Num(GROUP as f64)),
        ("block_size", Json::Num(BLOCK as f64)),
        ("crop_rows", Json::Num(args.crop_rows as f64)),
        (
            "nvfp4",
            Json::obj(vec![
                ("iters", Json::Num(search.iters as f64)),
                ("max_shrink", Json::Num(search.max_shrink as f64)),
                ("error_norm", Json::Num(search.error_norm as f64)),
            ]),
        ),
        ("shapes", Json::Arr(shapes.to_vec())),
    ]);
    std::fs::write(dir.join("manifest.json"), format!("{manifest}\n"))
}

// ---------------------------------------------------------------------------------------------
// (a) Hessian
// ---------------------------------------------------------------------------------------------

/// Times the Hessian paths and returns H = XᵀX/tokens (cuBLAS, else CubeCL, else CPU).
fn hessian_stages(
    args: &Args,
    gpu: Option<&Gpu>,
    x: &[u16],
    inp: usize,
    rows: &mut Vec<Row>,
) -> Option<Vec<f32>> {
    let tokens = args.tokens;
    let flops = 2.0 * tokens as f64 * (inp * inp) as f64;
    let mut h_blas = None;
    let mut h_cube = None;
    if let (Some(gpu), true) = (gpu, args.runs("hessian")) {
        rows.push(stage("hessian_cublas_bf16", || {
            let blas = gpu.blas()?;
            let xd = Bf16Matrix::upload(&gpu.client, x, tokens, inp).map_err(msg)?;
            let h = MatrixView::zeros(&gpu.client, inp, inp).map_err(msg)?;
            let alpha = 1.0 / tokens as f32;
            let (t, ()) = time_it(
                args.warmup,
                args.reps,
                &|| gpu.sync(),
                || Ok(()),
                |()| xtx_bf16(&gpu.client, blas, &xd, &h, alpha, 0.0).map_err(msg),
            )?;
            h_blas = Some(h.download(&gpu.client).map_err(msg)?);
            Ok(Row::timed("hessian_cublas_bf16", &t).flops(flops))
        }));
        rows.push(stage("hessian_cubecl_f32", || {
            let xf: Vec<f32> = x.iter().map(|&b| data::bf16_to_f32(b)).collect();
            let xd = gpu.upload(&xf, tokens, inp)?;
            let h = MatrixView::zeros(&gpu.client, inp, inp).map_err(msg)?;
            let weight = 1.0 / tokens as f32;
            // First run on zeros = the result to check (and the warm-up); the timed runs
            // then keep accumulating into the same buffer.
            accumulate_xtx(&gpu.client, &CubeGemm, &xd, weight, &h).map_err(msg)?;
            let first = h.download(&gpu.client).map_err(msg)?;
            let (t, ()) = time_it(
                0,
                args.reps,
                &|| gpu.sync(),
                || Ok(()),
                |()| {
                    accumulate_xtx(&gpu.client, &CubeGemm, &xd, weight, &h).map_err(msg)?;
                    gpu.sync()
                },
            )?;
            let mut row = Row::timed("hessian_cubecl_f32", &t).flops(flops);
            if let Some(reference) = &h_blas {
                let rel = max_rel_diff(first.iter().copied(), reference.iter().copied());
                row = row.extra("vs_cublas_max_rel", Json::Num(rel));
            }
            h_cube = Some(first);
            Ok(row)
        }));
    }
    if let (Some(gpu), true) = (gpu, args.runs("hessian_blocks")) {
        for (name, blocking) in HESSIAN_BLOCKINGS {
            rows.push(stage(name, || {
                hessian_blocks(args, gpu, x, inp, name, blocking, h_blas.as_deref())
            }));
        }
    }
    if let Some(h) = h_blas.or(h_cube) {
        return Some(h);
    }
    let mut h_cpu = None;
    rows.push(stage("hessian_faer_cpu", || {
        let xf: Vec<f32> = x.iter().map(|&b| data::bf16_to_f32(b)).collect();
        let (t, hessian) = time_it(
            0,
            1,
            &|| Ok(()),
            || Ok(()),
            |()| {
                let mut acc =
                    HessianAccumulator::<f32>::new(inp, Normalization::PerToken).map_err(msg)?;
                acc.add_sample(&xf, tokens).map_err(msg)?;
                acc.finalize().map_err(msg)
            },
        )?;
        h_cpu = Some(hessian.to_row_major());
        Ok(Row::timed("hessian_faer_cpu", &t).flops(flops))
    }));
    h_cpu
}

/// The blockings of the symmetric Hessian `hessian_blocks` compares, by stage name (the
/// engine's default, [`XtxBlocking::default`], is `hessian_halving_1024_batched`).
const HESSIAN_BLOCKINGS: [(&str, XtxBlocking); 9] = [
    ("hessian_sym_2048_single", blocking(2048, false, false)),
    ("hessian_sym_2048_batched", blocking(2048, true, false)),
    ("hessian_sym_1024_batched", blocking(1024, true, false)),
    ("hessian_sym_512_batched", blocking(512, true, false)),
    ("hessian_halving_2048_single", blocking(2048, false, true)),
    ("hessian_halving_2048_batched", blocking(2048, true, true)),
    ("hessian_halving_1024_single", blocking(1024, false, true)),
    ("hessian_halving_1024_batched", blocking(1024, true, true)),
    ("hessian_halving_512_batched", blocking(512, true, true)),
];

const fn blocking(block: usize, batched: bool, halving: bool) -> XtxBlocking {
    XtxBlocking {
        block,
        batched,
        halving,
    }
}

/// `xtx_runs_bf16_blocked` over one run of all tokens (weight `1/tokens`) into zeros, checked
/// against the full product `h_full` when there is one. TFLOP/s counts the full product's
/// `2·tokens·in²`, so that blockings compare by time; `product_fraction` is the work done.
fn hessian_blocks(
    args: &Args,
    gpu: &Gpu,
    x: &[u16],
    inp: usize,
    name: &'static str,
    blocking: XtxBlocking,
    h_full: Option<&[f32]>,
) -> Stage<Row> {
    let blas = gpu.blas()?;
    let tokens = args.tokens;
    let xd = Bf16Matrix::upload(&gpu.client, x, tokens, inp).map_err(msg)?;
    let h = MatrixView::zeros(&gpu.client, inp, inp).map_err(msg)?;
    let runs = [XtxRun {
        first_row: 0,
        rows: tokens,
        weight: 1.0 / tokens as f32,
    }];
    let product = || xtx_runs_bf16_blocked(&gpu.client, blas, &xd, &runs, &h, blocking);
    // The first product into zeros is the result to check; the timed ones accumulate on it.
    product().map_err(msg)?;
    let first = h.download(&gpu.client).map_err(msg)?;
    let (t, ()) = time_it(
        0,
        args.reps,
        &|| gpu.sync(),
        || Ok(()),
        |()| product().map_err(msg),
    )?;
    let lower: usize = xtx_lower_blocks(inp, blocking)
        .iter()
        .map(|g| g.count * g.rows * g.cols)
        .sum();
    let mut row = Row::timed(name, &t)
        .flops(2.0 * tokens as f64 * (inp * inp) as f64)
        .extra(
            "product_fraction",
            Json::Num(lower as f64 / (inp * inp) as f64),
        );
    if let Some(full) = h_full {
        let rel = max_rel_diff(first.iter().copied(), full.iter().copied());
        row = row.extra("vs_full_max_rel", Json::Num(rel));
    }
    Ok(row)
}

// ---------------------------------------------------------------------------------------------
// (b) Inverse upper factor
// ---------------------------------------------------------------------------------------------

/// `H + λI` with `λ = PERCDAMP · mean(diag H)` (dead columns counted, and set, as 1), the
/// matrix `sala_hessian::CholeskyInverse` factors.
fn damped(h: &[f32], n: usize) -> Vec<f32> {
    let mut out = h.to_vec();
    let diag = |k: usize| {
        if h[k * n + k] == 0.0 {
            1.0
        } else {
            h[k * n + k] as f64
        }
    };
    let mean = (0..n).map(diag).sum::<f64>() / n as f64;
    let damp = (PERCDAMP * mean) as f32;
    for k in 0..n {
        out[k * n + k] = diag(k) as f32 + damp;
    }
    out
}

fn damping() -> Damping {
    Damping {
        percdamp: PERCDAMP,
        growth: 10.0,
        max_retries: 0,
    }
}

fn hessian_of(h: &[f32], n: usize) -> Stage<Hessian<f32>> {
    Hessian::from_row_major(n, h).map_err(msg)
}

/// The GPU factor (for GPTQ) after timing both inverse paths and comparing them.
fn inverse_stages(
    args: &Args,
    gpu: Option<&Gpu>,
    h: &[f32],
    n: usize,
    rows: &mut Vec<Row>,
) -> Option<MatrixView> {
    let flops = 2.0 * (n as f64).powi(3) / 3.0;
    let mut u_gpu = None;
    if let (Some(gpu), true) = (gpu, args.runs("inverse")) {
        rows.push(stage("inverse_cusolver", || {
            let solver = gpu.solver()?;
            let hd = gpu.upload(&damped(h, n), n, n)?;
            let (t, (u, phases)) = time_it(
                args.warmup,
                args.reps,
                &|| gpu.sync(),
                || Ok(()),
                |()| inverse_upper_cusolver_timed(&gpu.client, solver, &hd).map_err(msg),
            )?;
            u_gpu = Some(u);
            // The phases of the last run: where the time goes (potrf vs trtri vs copies).
            Ok(Row::timed("inverse_cusolver", &t)
                .flops(flops)
                .extra("potrf_s", Json::Num(phases.potrf_s))
                .extra("trtri_s", Json::Num(phases.trtri_s))
                .extra("other_s", Json::Num(phases.prepare_s + phases.finish_s)))
        }));
    }
    if args.runs("inverse_cpu") {
        let u_host = match (gpu, &u_gpu) {
            (Some(gpu), Some(u)) => u.download(&gpu.client).ok(),
            _ => None,
        };
        rows.push(stage("inverse_faer_cpu", || {
            let hessian = hessian_of(h, n)?;
            let (t, inverse) = time_it(
                0,
                args.cpu_reps,
                &|| Ok(()),
                || Ok(()),
                |()| CholeskyInverse::new(&hessian, &damping()).map_err(msg),
            )?;
            let mut row = Row::timed("inverse_faer_cpu", &t).flops(flops);
            if let Some(u) = &u_host {
                let upper = inverse.upper();
                let cpu = (0..n * n).map(|k| upper[(k / n, k % n)]);
                let rel = max_rel_diff(u.iter().copied(), cpu);
                row = row.extra("gpu_vs_cpu_max_rel", Json::Num(rel));
            }
            Ok(row)
        }));
    }
    u_gpu
}

// ---------------------------------------------------------------------------------------------
// (c) GPTQ
// ---------------------------------------------------------------------------------------------

/// The CPU solver's configuration, the one the GPU kernels implement.
fn gptq_config() -> GptqConfig {
    GptqConfig {
        grid: IntGrid {
            bits: 4,
            scheme: IntScheme::SymmetricIst,
            group_size: Some(GROUP),
            clip: None,
        },
        block_size: BLOCK,
        act_order: false,
        static_groups: false,
        group_aware_order: false,
        damping: damping(),
        on_failure: FailurePolicy::Error,
        proxy_error: false,
    }
}

#[allow(clippy::too_many_arguments)]
fn gptq_stages(
    args: &Args,
    gpu: Option<&Gpu>,
    w: &[f32],
    h: &[f32],
    u: Option<&MatrixView>,
    out: usize,
    inp: usize,
    rows: &mut Vec<Row>,
) {
    let crop = args.crop_rows.min(out);
    let mut cpu_codes = None;
    if args.runs("gptq_cpu") && crop > 0 {
        rows.push(stage("gptq_cpu_crop", || {
            let hessian = hessian_of(h, inp)?;
            let solver = Gptq::new(gptq_config()).map_err(msg)?;
            let (t, q) = time_it(
                0,
                1,
                &|| Ok(()),
                || Ok(()),
                |()| {
                    solver
                        .solve(&w[..crop * inp], crop, inp, &hessian)
                        .map_err(msg)
                },
            )?;
            let row = Row::timed("gptq_cpu_crop", &t)
                .loss(q.loss)
                .extra("rows", Json::Num(crop as f64));
            cpu_codes = Some(q.codes);
            Ok(row)
        }));
    }
    let Some(gpu) = gpu else {
        return;
    };
    let mut variants: Vec<(&'static str, &'static str, Stage<GpuGemm>)> = Vec::new();
    if args.runs("gptq_cublas") {
        let gemm = gpu
            .blas()
            .map(|b| GpuGemm::Cublas(CublasGemm::new(b.clone(), Fp32Math::Pedantic)));
        variants.push(("gptq_cublas", "gptq_cublas_total", gemm));
        if args.tf32 {
            let gemm = gpu
                .blas()
                .map(|b| GpuGemm::Cublas(CublasGemm::new(b.clone(), Fp32Math::Tf32)));
            variants.push(("gptq_cublas_tf32", "gptq_cublas_tf32_total", gemm));
        }
    }
    if args.runs("gptq_cubecl") {
        variants.push(("gptq_cubecl", "gptq_cubecl_total", Ok(GpuGemm::Cube)));
    }
    let flops = out as f64 * (inp * inp) as f64;
    let inv_flops = 2.0 * (inp as f64).powi(3) / 3.0;
    for (solve_name, total_name, gemm) in variants {
        let gemm = match gemm {
            Ok(g) => g,
            Err(e) => {
                rows.push(stage(solve_name, || Err(e.clone())));
                rows.push(stage(total_name, || Err(e)));
                continue;
            }
        };
        rows.push(stage(solve_name, || {
            let u = u.ok_or("no GPU inverse factor (inverse_cusolver failed or skipped)")?;
            let (t, result) = time_it(
                args.warmup,
                args.reps,
                &|| gpu.sync(),
                || gpu.upload(w, out, inp),
                |wd| gemm.solve(gpu, &wd, u),
            )?;
            let mut row = Row::timed(solve_name, &t).flops(flops).loss(result.loss);
            if let Some(cpu) = &cpu_codes {
                let gpu_codes = first_codes(gpu, &result, crop)?;
                let agree = gpu_codes.iter().zip(cpu).filter(|(a, b)| a == b).count();
                row = row.extra(
                    "cpu_code_agreement",
                    Json::Num(agree as f64 / cpu.len() as f64),
                );
            }
            Ok(row)
        }));
        rows.push(stage(total_name, || {
            let solver = gpu.solver()?;
            let hd = gpu.upload(&damped(h, inp), inp, inp)?;
            let (t, result) = time_it(
                0,
                args.reps,
                &|| gpu.sync(),
                || gpu.upload(w, out, inp),
                |wd| {
                    let u = inverse_upper_cusolver(&gpu.client, solver, &hd).map_err(msg)?;
                    gemm.solve(gpu, &wd, &u)
                },
            )?;
            Ok(Row::timed(total_name, &t)
                .flops(flops + inv_flops)
                .loss(result.loss))
        }));
    }
}

/// The two GEMMs GPTQ's trailing update runs on.
enum GpuGemm {
    Cublas(CublasGemm),
    Cube,
}

impl GpuGemm {
    /// One GPTQ solve of the device weight `w` (consumed: the solver updates it in place)
    /// with the factor `u`, synchronized.
    fn solve(&self, gpu: &Gpu, w: &MatrixView, u: &MatrixView) -> Stage<DeviceGptqResult> {
        let config = DeviceGptqConfig::from(&gptq_config());
        let result = match self {
            GpuGemm::Cublas(gemm) => gptq_solve(&gpu.client, gemm, w, u, &config, None),
            GpuGemm::Cube => gptq_solve(&gpu.client, &CubeGemm, w, u, &config, None),
        }
        .map_err(msg)?;
        gpu.sync()?;
        Ok(result)
    }
}

/// The codes of the first `rows` rows of a GPU solve.
fn first_codes(gpu: &Gpu, result: &DeviceGptqResult, rows: usize) -> Stage<Vec<u8>> {
    let codes = result.codes.download(&gpu.client).map_err(msg)?;
    Ok(codes[..rows * result.inp]
        .iter()
        .map(|&c| c as u8)
        .collect())
}

// ---------------------------------------------------------------------------------------------
// (d) NVFP4 block-scale search
// ---------------------------------------------------------------------------------------------

#[allow(clippy::too_many_arguments)]
fn nvfp4_stages(
    args: &Args,
    gpu: Option<&Gpu>,
    w: &[f32],
    h: &[f32],
    global_scale: f32,
    out: usize,
    inp: usize,
    rows: &mut Vec<Row>,
) {
    let search = Nvfp4BlockSearch::default();
    let diag: Vec<f32> = (0..inp).map(|k| h[k * inp + k]).collect();
    let crop = args.crop_rows.min(out);
    let mut cpu = None;
    if args.runs("nvfp4_cpu") && crop > 0 {
        rows.push(stage("nvfp4_cpu_crop", || {
            let (t, r) = time_it(
                0,
                1,
                &|| Ok(()),
                || Ok(()),
                |()| {
                    reference::nvfp4_block_search_naive(
                        &search,
                        &w[..crop * inp],
                        crop,
                        inp,
                        &diag,
                        global_scale,
                    )
                    .map_err(msg)
                },
            )?;
            let total: f64 = r.block_error.iter().map(|&e| e as f64).sum();
            cpu = Some(r);
            Ok(Row::timed("nvfp4_cpu_crop", &t)
                .loss(total)
                .extra("rows", Json::Num(crop as f64)))
        }));
    }
    let (Some(gpu), true) = (gpu, args.runs("nvfp4")) else {
        return;
    };
    rows.push(stage("nvfp4_search", || {
        let wd = gpu.upload(w, out, inp)?;
        let (t, result) = time_it(
            args.warmup,
            args.reps,
            &|| gpu.sync(),
            || Ok(()),
            |()| {
                let r = nvfp4_block_search(&gpu.client, &wd, &diag, global_scale, &search)
                    .map_err(msg)?;
                gpu.sync()?;
                Ok(r)
            },
        )?;
        let host = result.download(&gpu.client).map_err(msg)?;
        let total: f64 = host.block_error.iter().map(|&e| e as f64).sum();
        // Traffic the kernel cannot avoid: W read, u32 codes written, scale and error per block.
        let bytes = 8.0 * (out * inp) as f64 + 8.0 * (out * inp / 16) as f64;
        let mut row = Row::timed("nvfp4_search", &t).loss(total).bytes(bytes);
        if let Some(cpu) = &cpu {
            let blocks = cpu.block_scales.len();
            let same_scales = host.block_scales[..blocks] == cpu.block_scales[..];
            let same_codes = host.codes[..cpu.codes.len()] == cpu.codes[..];
            row = row
                .extra("cpu_scales_equal", Json::Bool(same_scales))
                .extra("cpu_codes_equal", Json::Bool(same_codes));
        }
        Ok(row)
    }));
}

/// GPTQ on the NVFP4 grid given the cuSOLVER factor (`nvfp4_gptq`): the column loop with each
/// 16-column block's scale searched when the loop reaches it, cuBLAS (pedantic f32) for the
/// trailing updates, lazy blocks of 128; loss `Σ(w−q)²/(2·U_cc²)`, TFLOP/s of its GEMMs.
fn nvfp4_gptq_stage(
    args: &Args,
    gpu: Option<&Gpu>,
    w: &[f32],
    h: &[f32],
    u: Option<&MatrixView>,
    global_scale: f32,
    rows: &mut Vec<Row>,
) {
    let (Some(gpu), true) = (gpu, args.runs("nvfp4_gptq")) else {
        return;
    };
    rows.push(stage("nvfp4_gptq", || {
        let u = u.ok_or("no GPU inverse factor (inverse_cusolver failed or skipped)")?;
        let inp = u.rows;
        let out = w.len() / inp;
        let search = Nvfp4BlockSearch::default();
        let diag: Vec<f32> = (0..inp).map(|k| h[k * inp + k].max(0.0)).collect();
        let channel_weights = search
            .channel_weights(inp, &diag, global_scale)
            .map_err(msg)?;
        let gemm = CublasGemm::new(gpu.blas()?.clone(), Fp32Math::Pedantic);
        let (t, result) = time_it(
            args.warmup,
            args.reps,
            &|| gpu.sync(),
            || gpu.upload(w, out, inp),
            |wd| {
                let r = nvfp4_gptq_solve(
                    &gpu.client,
                    &gemm,
                    &wd,
                    u,
                    &channel_weights,
                    global_scale,
                    &search,
                    BLOCK,
                )
                .map_err(msg)?;
                gpu.sync()?;
                Ok(r)
            },
        )?;
        let loss: f64 = result
            .column_loss
            .download(&gpu.client)
            .map_err(msg)?
            .iter()
            .map(|&l| l as f64)
            .sum();
        let flops = out as f64 * (inp * inp) as f64;
        Ok(Row::timed("nvfp4_gptq", &t).flops(flops).loss(loss))
    }));
}
