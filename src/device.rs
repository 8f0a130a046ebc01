//! `--device cpu|cuda` for the command-line tools: which backend a job runs on, and what the GPU
//! path changes in the options (bf16 storage, hidden states and statistics on the device).

use burn::tensor::backend::Backend;
use clap::ValueEnum;
use sala_gptq::model::{CpuFastOps, FastOps, Numerics};
use sala_gptq::{
    CpuBackend, CpuSolver, LinearSolver, MemoryProbe, QuantizeOptions, ResidentSolver,
};
use std::error::Error;
use std::sync::Arc;

/// `--device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    /// Burn's ndarray backend in f32 (bf16 rounding emulated): the reference path.
    Cpu,
    /// burn-cuda in bf16 on GPU 0 (needs a binary built with `--features cuda`).
    Cuda,
}

/// Whether this binary was built with the `cuda` feature.
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// The refusal of `--device cuda` in a binary built without the feature.
pub fn cuda_missing(example: &str) -> String {
    format!(
        "--device cuda: this binary was built without the `cuda` feature; rebuild it with \
         `cargo build --release --features cuda --example {example}`"
    )
}

impl DeviceArg {
    /// An error unless this binary can run on the device (checked before any work).
    pub fn check_available(self, example: &str) -> Result<(), String> {
        match self {
            DeviceArg::Cuda if !CUDA_BUILT => Err(cuda_missing(example)),
            _ => Ok(()),
        }
    }

    /// The GPU path's options: bf16 storage (or plain f32 with `f32`), statistics on the
    /// device unless `host_statistics` (and then the MLP in chunks of
    /// [`sala_gptq::DEFAULT_MLP_ROWS`] rows). The CPU path keeps `options` as they are. Where the
    /// hidden states live and the pack size come from the memory plan
    /// ([`sala_gptq::MemoryPlan`]).
    pub fn configure(self, options: &mut QuantizeOptions, f32: bool, host_statistics: bool) {
        if self == DeviceArg::Cuda {
            options.run.numerics = if f32 {
                Numerics::F32
            } else {
                Numerics::Bf16Storage
            };
            options.device_statistics = !host_statistics;
            options.run.mlp_rows = options
                .device_statistics
                .then_some(sala_gptq::DEFAULT_MLP_ROWS);
        }
    }

    /// Lets the GPU's memory pool keep up to `bytes` of freed memory between packs instead of
    /// giving it back to the driver at every synchronization (a warning if the driver
    /// refuses; the run goes on, slower). Nothing on the CPU.
    pub fn keep_freed_memory(self, bytes: u64) {
        if self == DeviceArg::Cuda {
            if let Err(e) = cuda_keep_freed_memory(bytes) {
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "warning: {e}");
            }
        }
    }

    /// The device's free and total memory now, bytes; `None` on the CPU (the budget is then
    /// only what the user gives).
    pub fn memory_info(self) -> Result<Option<(u64, u64)>, Box<dyn Error>> {
        match self {
            DeviceArg::Cpu => Ok(None),
            DeviceArg::Cuda => cuda_memory_info(),
        }
    }
}

/// A job that runs on any backend (the two command-line tools' bodies).
pub trait DeviceJob {
    /// What the job returns.
    type Output;
    /// Runs on `device` of backend `B`, with a device-memory probe on GPUs, solving each
    /// linear with `solver` (GPTQ on device Hessians with `resident` where given), the model's
    /// heaviest steps with `fast` where the backend has them.
    fn run<B: Backend>(
        self,
        device: B::Device,
        memory: Option<MemoryProbe<B>>,
        solver: Box<dyn LinearSolver>,
        resident: Option<Arc<dyn ResidentSolver<B>>>,
        fast: Option<Arc<dyn FastOps<B>>>,
    ) -> Result<Self::Output, Box<dyn Error>>;
}

/// Choices of the GPU path; the default is the fastest measured. Only `unfused_residual`
/// changes numbers of the result, by rounding.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuPath {
    /// Solve GPTQ and the NVFP4 search on the host (faer) instead of the device kernels.
    pub host_solver: bool,
    /// Run each tap's Hessian products before the forward goes on, instead of on a stream of
    /// their own beside it (which holds up to [`hessian_in_flight_bytes`] of inputs longer).
    pub serial_hessians: bool,
    /// Add the scaled residual of `o_proj` and `down_proj` in a pass of its own after the
    /// product instead of in its epilogue (cuBLASLt): the sum is rounded twice instead of
    /// once, so hidden states may move by a rounding step.
    pub unfused_residual: bool,
    /// Order the forward's library calls (cuBLAS, the NVRTC kernels, the Hessians' stream)
    /// with CubeCL's kernels by the host waiting around each
    /// (`sala_kernels::cuda::StreamOrdering::HostWaits`) instead of on the device (the
    /// default, `DeviceWaits`). The same work in the same order: the result is the same bit
    /// for bit.
    pub host_waits: bool,
}

/// Device bytes the GPU path's Hessian products in flight may hold beyond the forward's own
/// (`sala_kernels::cuda::XTX_IN_FLIGHT_BYTES` on CUDA unless `serial_hessians`; 0 elsewhere):
/// what a memory plan adds to a layer's fixed bytes.
pub fn hessian_in_flight_bytes(device: DeviceArg, path: GpuPath) -> u64 {
    match device {
        DeviceArg::Cuda if !path.serial_hessians => cuda_in_flight_bytes(),
        _ => 0,
    }
}

#[cfg(feature = "cuda")]
fn cuda_in_flight_bytes() -> u64 {
    sala_kernels::cuda::XTX_IN_FLIGHT_BYTES
}

#[cfg(not(feature = "cuda"))]
fn cuda_in_flight_bytes() -> u64 {
    0
}

/// Runs `job` on `device`'s backend; `example` names the binary in the refusal of
/// `--device cuda` without the `cuda` feature. On the GPU the linears are solved there too
/// (`sala_kernels::DeviceSolver`: cuBLAS trailing updates, CubeCL column loop and block
/// search) unless `gpu.host_solver`, and the Hessian products run beside the forward unless
/// `gpu.serial_hessians`.
///
/// On the CPU, `cpu_fast_ops` (the run's numerics) runs the layers' products and fused steps
/// with [`CpuFastOps`] on every core; `None` keeps burn-ndarray's graph ops (the reference).
pub fn dispatch<J: DeviceJob>(
    device: DeviceArg,
    example: &str,
    gpu: GpuPath,
    cpu_fast_ops: Option<Numerics>,
    job: J,
) -> Result<J::Output, Box<dyn Error>> {
    match device {
        DeviceArg::Cpu => {
            let fast = cpu_fast_ops.map(|numerics| {
                Arc::new(CpuFastOps::new(numerics)) as Arc<dyn FastOps<CpuBackend>>
            });
            job.run::<CpuBackend>(Default::default(), None, Box::new(CpuSolver), None, fast)
        }
        DeviceArg::Cuda => run_cuda(example, gpu, job),
    }
}

#[cfg(feature = "cuda")]
fn run_cuda<J: DeviceJob>(
    _example: &str,
    gpu: GpuPath,
    job: J,
) -> Result<J::Output, Box<dyn Error>> {
    use sala_gptq::{configure_cuda_runtime, cuda_memory, CudaBackend, CudaDevice};
    configure_cuda_runtime();
    // Every buffer has its own allocation now (see `configure_cuda_runtime`): unless the job
    // planned how much freed memory the CUDA pool keeps, it keeps up to the default budget
    // (CUDA's default, 0, would give it all back at every synchronization).
    if sala_kernels::cuda::pool_release_threshold(0).is_ok_and(|t| t == 0) {
        if let Ok(Some((free, total))) = cuda_memory_info() {
            let _ = cuda_keep_freed_memory(free.saturating_sub(total / 20));
        }
    }
    // One set of page-locked staging buffers for the solvers' copies and the weights' uploads.
    let transfer = Arc::new(
        sala_kernels::cuda::DriverTransfer::new(0)
            .map_err(|e| format!("the GPU's host copies: {e}"))?,
    );
    let (solver, resident): (Box<dyn LinearSolver>, Option<Arc<dyn ResidentSolver<_>>>) =
        if gpu.host_solver {
            (Box::new(CpuSolver), None)
        } else {
            let resident: Arc<dyn ResidentSolver<CudaBackend>> =
                Arc::new(CudaResident(cuda_solver(transfer.clone())?));
            (Box::new(cuda_solver(transfer.clone())?), Some(resident))
        };
    let ordering = if gpu.host_waits {
        sala_kernels::cuda::StreamOrdering::HostWaits
    } else {
        sala_kernels::cuda::StreamOrdering::DeviceWaits
    };
    let mut fast = cuda_fast_ops(ordering).with_transfer(transfer);
    if !gpu.unfused_residual {
        fast = fast.with_fused_residual();
    }
    if !gpu.serial_hessians {
        let stream =
            sala_kernels::cuda::XtxStream::new(0, hessian_in_flight_bytes(DeviceArg::Cuda, gpu))
                .map_err(|e| format!("the Hessians' own stream: {e}"))?
                .with_ordering(ordering);
        fast = fast.with_hessian_stream(Arc::new(stream));
    }
    let fast: Arc<dyn FastOps<CudaBackend>> = Arc::new(fast);
    job.run::<CudaBackend>(
        CudaDevice::default(),
        Some(cuda_memory),
        solver,
        resident,
        Some(fast),
    )
}

/// The device solver on CUDA for GPTQ on the statistics' own device Hessians.
#[cfg(feature = "cuda")]
struct CudaResident(CudaSolver);

#[cfg(feature = "cuda")]
impl ResidentSolver<sala_gptq::CudaBackend> for CudaResident {
    fn name(&self) -> &str {
        "cuda (device Hessians)"
    }

    fn solve_gptq(
        &self,
        config: &sala_gptq::hessian::GptqConfig,
        weights: &[f32],
        out: usize,
        inp: usize,
        h: sala_gptq::ResidentHessian<'_, sala_gptq::CudaBackend>,
    ) -> Result<sala_gptq::hessian::UnfinishedGptq, sala_gptq::hessian::HessianError> {
        let matrix = device_view(h.tensor)?;
        let h = resident_hessian(&matrix, h);
        let (unfinished, _) = self
            .0
            .solve_gptq_resident_unfinished(config, None, weights, out, inp, h)?;
        Ok(unfinished)
    }

    fn solve_gptq_with_baseline(
        &self,
        config: &sala_gptq::hessian::GptqConfig,
        baseline: sala_gptq::hessian::IntGrid,
        weights: &[f32],
        out: usize,
        inp: usize,
        h: sala_gptq::ResidentHessian<'_, sala_gptq::CudaBackend>,
    ) -> Result<sala_gptq::WithBaseline, sala_gptq::hessian::HessianError> {
        let matrix = device_view(h.tensor)?;
        let (quantized, baseline) = self.0.solve_gptq_resident_unfinished(
            config,
            Some(baseline),
            weights,
            out,
            inp,
            resident_hessian(&matrix, h),
        )?;
        Ok(sala_gptq::WithBaseline {
            quantized,
            baseline_proxy_error: baseline.map(|b| b.proxy_error),
            baseline_seconds: baseline.map_or(0.0, |b| b.seconds),
        })
    }

    fn quantize_rtn(
        &self,
        grid: sala_gptq::hessian::IntGrid,
        weights: &[f32],
        out: usize,
        inp: usize,
        h: &burn::tensor::Tensor<sala_gptq::CudaBackend, 2>,
    ) -> Result<sala_gptq::hessian::QuantizedLinear, sala_gptq::hessian::HessianError> {
        self.0
            .quantize_rtn_resident(grid, weights, out, inp, &device_view(h)?)
    }

    fn solve_nvfp4_gptq(
        &self,
        solver: &sala_gptq::hessian::Nvfp4Gptq,
        weights: &[f32],
        rows: usize,
        cols: usize,
        h: sala_gptq::ResidentHessian<'_, sala_gptq::CudaBackend>,
        global_scale: f32,
    ) -> Result<sala_gptq::hessian::Nvfp4GptqResult, sala_gptq::hessian::HessianError> {
        let matrix = device_view(h.tensor)?;
        let h = resident_hessian(&matrix, h);
        self.0
            .solve_nvfp4_gptq_resident(solver, weights, rows, cols, h, global_scale)
    }

    fn solve_nvfp4_gptq_with_baseline(
        &self,
        solver: &sala_gptq::hessian::Nvfp4Gptq,
        weights: &[f32],
        rows: usize,
        cols: usize,
        h: sala_gptq::ResidentHessian<'_, sala_gptq::CudaBackend>,
        global_scale: f32,
    ) -> Result<sala_gptq::Nvfp4WithBaseline, sala_gptq::hessian::HessianError> {
        let matrix = device_view(h.tensor)?;
        let (quantized, baseline) = self.0.solve_nvfp4_gptq_resident_with_baseline(
            solver,
            true,
            weights,
            rows,
            cols,
            resident_hessian(&matrix, h),
            global_scale,
        )?;
        let baseline = baseline.ok_or_else(|| {
            sala_gptq::hessian::HessianError::Device("no max-calibration baseline".into())
        })?;
        Ok(sala_gptq::Nvfp4WithBaseline {
            quantized,
            baseline_proxy_error: baseline.proxy_error,
            baseline_seconds: baseline.seconds,
        })
    }

    fn proxy_error(
        &self,
        weights: &[f32],
        dequantized: &[f32],
        h: &burn::tensor::Tensor<sala_gptq::CudaBackend, 2>,
    ) -> Result<f64, sala_gptq::hessian::HessianError> {
        self.0
            .proxy_error_resident(weights, dequantized, &device_view(h)?)
    }

    fn take_step_seconds(&self) -> Vec<(&'static str, f64)> {
        self.0.take_step_seconds()
    }
}

/// The kernel solver's view of a device Hessian: `matrix`, the window on `h`'s buffer, with
/// `h`'s promise about the next solve.
#[cfg(feature = "cuda")]
fn resident_hessian<'a>(
    matrix: &'a sala_kernels::MatrixView,
    h: sala_gptq::ResidentHessian<'_, sala_gptq::CudaBackend>,
) -> sala_kernels::ResidentHessian<'a> {
    sala_kernels::ResidentHessian {
        matrix,
        read_next: h.read_next,
    }
}

/// The statistics tensor as a kernel window on its own buffer.
#[cfg(feature = "cuda")]
fn device_view(
    h: &burn::tensor::Tensor<sala_gptq::CudaBackend, 2>,
) -> Result<sala_kernels::MatrixView, sala_gptq::hessian::HessianError> {
    sala_gptq::model::f32_matrix_view(h)
        .map_err(|e| sala_gptq::hessian::HessianError::Device(e.to_string()))
}

/// The device solver of the CUDA path.
#[cfg(feature = "cuda")]
type CudaSolver = sala_kernels::DeviceSolver<
    sala_kernels::cubecl::cuda::CudaRuntime,
    sala_kernels::cuda::CublasGemm,
>;

/// The model's fast path on device 0: the attention kernel, and cuBLAS linears when cuBLAS
/// loads (else the linears stay on burn's matmul, with a warning); each library's stream
/// ordered with CubeCL's by `ordering`.
#[cfg(feature = "cuda")]
fn cuda_fast_ops(ordering: sala_kernels::cuda::StreamOrdering) -> sala_gptq::model::CudaFastOps {
    use sala_gptq::model::CudaFastOps;
    use sala_kernels::cuda::Cublas;
    use sala_kernels::cuda::{HopperAttention, MmaGla};
    use std::io::Write;
    let ops = match Cublas::new(0) {
        Ok(blas) => CudaFastOps::with_cublas(Arc::new(blas.with_ordering(ordering))),
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "warning: linears on burn's matmul: {e}");
            CudaFastOps::attention_only()
        }
    };
    // Hopper's own attention kernel where the device is one (compute capability 9.0); any
    // other device keeps the CubeCL flash kernel, silently: that is the portable path, not a
    // fault.
    let ops = match HopperAttention::new(0) {
        Ok(hopper) => ops.with_hopper_attention(Arc::new(hopper.with_ordering(ordering))),
        Err(sala_kernels::KernelError::Unsupported { .. }) => ops,
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "warning: attention on the CubeCL flash kernel: {e}"
            );
            ops
        }
    };
    // The GLA on mma.sync from compute capability 8.0; older devices keep the CubeCL kernel
    // (which needs the same tensor cores), silently.
    match MmaGla::new(0) {
        Ok(gla) => ops.with_mma_gla(Arc::new(gla.with_ordering(ordering))),
        Err(sala_kernels::KernelError::Unsupported { .. }) => ops,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "warning: GLA on the CubeCL kernel: {e}");
            ops
        }
    }
}

/// The GPU solver on device 0: CubeCL kernels on burn's CUDA context, cuBLAS (FP32,
/// pedantic) for GPTQ's trailing updates and proxy errors, cuSOLVER for its damped inverse,
/// `transfer` for its copies (shared between the solvers: one set of staging buffers).
#[cfg(feature = "cuda")]
fn cuda_solver(
    transfer: Arc<sala_kernels::cuda::DriverTransfer>,
) -> Result<CudaSolver, Box<dyn Error>> {
    use sala_kernels::cubecl::cuda::{CudaDevice, CudaRuntime};
    use sala_kernels::cubecl::Runtime;
    use sala_kernels::cuda::{Cublas, CublasGemm, Cusolver, CusolverFactorizer, Fp32Math};
    use sala_kernels::DeviceSolver;
    let client = CudaRuntime::client(&CudaDevice::default());
    let blas = Cublas::new(0).map_err(|e| format!("the GPU solver needs cuBLAS: {e}"))?;
    let lapack = Cusolver::new(0).map_err(|e| format!("the GPU solver needs cuSOLVER: {e}"))?;
    let blas = Arc::new(blas);
    // GPTQ's error propagation in full f32; the report's proxy errors on the tensor cores.
    let gemm = CublasGemm::new(blas.clone(), Fp32Math::Pedantic);
    let proxy_gemm = CublasGemm::new(blas, Fp32Math::Tf32);
    let factorizer = Arc::new(CusolverFactorizer::new(Arc::new(lapack)));
    Ok(DeviceSolver::new(client, gemm, "cuda")
        .with_proxy_gemm(proxy_gemm)
        .with_device_factorizer(factorizer)
        .with_transfer(transfer))
}

#[cfg(feature = "cuda")]
fn cuda_memory_info() -> Result<Option<(u64, u64)>, Box<dyn Error>> {
    let info = sala_kernels::cuda::device_memory_info(0)
        .map_err(|e| format!("--device cuda: cannot read the GPU's free memory: {e}"))?;
    Ok(Some(info))
}

#[cfg(feature = "cuda")]
fn cuda_keep_freed_memory(bytes: u64) -> Result<(), String> {
    sala_kernels::cuda::set_pool_release_threshold(0, bytes)
        .map_err(|e| format!("the GPU's memory pool gives freed memory back at once: {e}"))
}

#[cfg(not(feature = "cuda"))]
fn cuda_keep_freed_memory(_bytes: u64) -> Result<(), String> {
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn cuda_memory_info() -> Result<Option<(u64, u64)>, Box<dyn Error>> {
    Err(cuda_missing("quantize_sala").into())
}

#[cfg(not(feature = "cuda"))]
fn run_cuda<J: DeviceJob>(
    example: &str,
    _gpu: GpuPath,
    _job: J,
) -> Result<J::Output, Box<dyn Error>> {
    Err(cuda_missing(example).into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_cuda_hessians_beside_the_forward_hold_memory() {
        let serial = GpuPath {
            serial_hessians: true,
            ..GpuPath::default()
        };
        assert_eq!(
            hessian_in_flight_bytes(DeviceArg::Cpu, GpuPath::default()),
            0
        );
        assert_eq!(hessian_in_flight_bytes(DeviceArg::Cuda, serial), 0);
        let beside = hessian_in_flight_bytes(DeviceArg::Cuda, GpuPath::default());
        assert_eq!(beside > 0, CUDA_BUILT, "{beside}");
    }

    #[test]
    fn cuda_is_refused_exactly_when_the_feature_is_off() {
        assert!(DeviceArg::Cpu.check_available("x").is_ok());
        let cuda = DeviceArg::Cuda.check_available("quantize_sala");
        assert_eq!(cuda.is_ok(), CUDA_BUILT);
        if let Err(e) = cuda {
            assert!(e.contains("--features cuda --example quantize_sala"), "{e}");
        }
    }

    #[test]
    fn the_gpu_path_moves_storage_and_statistics_to_the_device() {
        let mut cpu = QuantizeOptions::new(sala_gptq::Recipe::Gptq);
        let before = format!("{cpu:?}");
        DeviceArg::Cpu.configure(&mut cpu, false, false);
        assert_eq!(format!("{cpu:?}"), before);
        assert_eq!(DeviceArg::Cpu.memory_info().unwrap(), None);
        let mut gpu = cpu.clone();
        DeviceArg::Cuda.configure(&mut gpu, false, false);
        assert_eq!(gpu.run.numerics, Numerics::Bf16Storage);
        assert!(gpu.device_statistics);
        assert_eq!(gpu.run.mlp_rows, Some(sala_gptq::DEFAULT_MLP_ROWS));
        let mut host_stats = cpu.clone();
        DeviceArg::Cuda.configure(&mut host_stats, false, true);
        assert_eq!(
            host_stats.run.mlp_rows, None,
            "host statistics take whole packs"
        );
    }
}
