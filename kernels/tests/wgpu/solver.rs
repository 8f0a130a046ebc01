//! `DeviceSolver` (the pipeline's solver seam on the device) against `CpuSolver` on whole
//! GPTQ solves (preparation, act-order, static groups, un-permuting, proxy error) and NVFP4
//! searches.

use sala_formats::nvfp4::global_scale_from_amax;
use sala_formats::{BlockScales, ClipSearch, IntScheme, Nvfp4Matrix};
use sala_hessian::faer::Mat;
use sala_hessian::layout::square_to_row_major;
use sala_hessian::reference::inverse_upper_textbook;
use sala_hessian::{
    CpuSolver, FaerFactorizer, FailurePolicy, GptqConfig, Hessian, HessianError, IntGrid,
    LinearSolver, Method, Nvfp4BlockSearch, Nvfp4Gptq, Nvfp4GptqResult, UpperFactorizer,
};
use sala_kernels::cubecl::prelude::ComputeClient;
use sala_kernels::{
    CubeGemm, DeviceFactorizer, DeviceSolver, Gemm, KernelError, MatrixView, ResidentHessian,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::common::{client, device_client, Rng, TestRuntime};

fn solver() -> DeviceSolver<TestRuntime, CubeGemm> {
    DeviceSolver::new(device_client(), CubeGemm, "test device")
}

/// `XᵀX / tokens` of random activations with uneven channel scales and one dead channel.
fn hessian(rng: &mut Rng, inp: usize) -> Hessian<f64> {
    let tokens = 2 * inp;
    let scale: Vec<f64> = (0..inp)
        .map(|j| {
            if j == 3 {
                0.0
            } else {
                0.2 + 2.0 * rng.uniform() as f64
            }
        })
        .collect();
    let x: Vec<f64> = (0..tokens * inp)
        .map(|k| rng.normal() as f64 * scale[k % inp])
        .collect();
    let mut h = vec![0.0f64; inp * inp];
    for row in x.chunks_exact(inp) {
        for i in 0..inp {
            for j in 0..inp {
                h[i * inp + j] += row[i] * row[j] / tokens as f64;
            }
        }
    }
    Hessian::from_row_major(inp, &h).unwrap()
}

fn relative(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

#[test]
fn device_gptq_matches_the_host_solver() {
    if client().is_none() {
        return;
    }
    let device = solver();
    assert_eq!(device.name(), "test device");
    let (out, inp) = (48, 192);
    let mut rng = Rng::new(21);
    let h = hessian(&mut rng, inp);
    let weights: Vec<f32> = (0..out * inp).map(|_| 0.1 * rng.normal()).collect();
    for (act_order, static_groups, group_size, block_size, group_aware_order, clip) in [
        (false, false, Some(32), 64, false, false),
        (true, false, Some(64), 128, false, false),
        (true, true, Some(32), 64, false, false),
        (false, false, None, 48, false, false),
        (false, false, Some(32), 64, true, false),
        (false, true, Some(64), 128, true, false),
        (false, false, Some(32), 64, true, true),
        (false, false, None, 48, false, true),
    ] {
        let config = GptqConfig {
            grid: IntGrid {
                bits: 4,
                scheme: IntScheme::SymmetricIst,
                group_size,
                clip: clip.then_some(ClipSearch::GPTQMODEL),
            },
            block_size,
            act_order,
            static_groups,
            group_aware_order,
            ..GptqConfig::default()
        };
        let label = format!(
            "act_order {act_order} static {static_groups} group {group_size:?} gar {group_aware_order} clip {clip}"
        );
        let cpu = CpuSolver
            .solve_gptq(&config, &weights, out, inp, &h)
            .unwrap();
        let gpu = device.solve_gptq(&config, &weights, out, inp, &h).unwrap();
        if static_groups {
            // Static groups keep the host loop: the very same result.
            assert_eq!(gpu, cpu, "{label}");
            continue;
        }
        assert_eq!(gpu.g_idx, cpu.g_idx, "{label}");
        assert_eq!(gpu.method, cpu.method, "{label}");
        // Summation orders differ (the device sums a block's updates in its GEMM): a code
        // at a rounding tie may flip, and its row then takes another path.
        let differing = gpu
            .codes
            .iter()
            .zip(&cpu.codes)
            .filter(|(a, b)| a != b)
            .count();
        assert!(
            differing * 50 <= gpu.codes.len(),
            "{label}: {differing} codes differ"
        );
        assert!(
            relative(gpu.loss, cpu.loss) < 1e-2,
            "{label}: loss {} vs {}",
            gpu.loss,
            cpu.loss
        );
        let column_total: f64 = gpu.column_loss.iter().sum();
        assert!(relative(column_total, gpu.loss) < 1e-9, "{label}");
        let (a, b) = (gpu.proxy_error.unwrap(), cpu.proxy_error.unwrap());
        assert!(relative(a, b) < 2e-2, "{label}: proxy {a} vs {b}");
    }
}

/// The textbook inverse in f64 on the host, counting its calls: stands in for cuSOLVER
/// (which needs CUDA) behind `DeviceSolver::with_factorizer`.
struct CountingFactorizer(Arc<AtomicUsize>);

impl UpperFactorizer for CountingFactorizer {
    fn upper_factor(&self, a: &[f32], n: usize) -> Result<Option<Mat<f32>>, HessianError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        let a: Vec<f64> = a.iter().map(|&v| v as f64).collect();
        let u = inverse_upper_textbook(&Hessian::from_row_major(n, &a)?, 0.0)?;
        Ok(Some(Mat::from_fn(n, n, |i, j| u[(i, j)] as f32)))
    }
}

#[test]
fn the_damped_inverse_comes_from_the_given_factorizer() {
    if client().is_none() {
        return;
    }
    let calls = Arc::new(AtomicUsize::new(0));
    let device = solver().with_factorizer(Box::new(CountingFactorizer(calls.clone())));
    let (out, inp) = (24, 128);
    let mut rng = Rng::new(23);
    let h = hessian(&mut rng, inp);
    let weights: Vec<f32> = (0..out * inp).map(|_| 0.1 * rng.normal()).collect();
    let config = GptqConfig {
        act_order: true,
        ..GptqConfig::default()
    };
    let cpu = CpuSolver
        .solve_gptq(&config, &weights, out, inp, &h)
        .unwrap();
    let gpu = device.solve_gptq(&config, &weights, out, inp, &h).unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        (gpu.damping_retries, gpu.g_idx.clone()),
        (0, cpu.g_idx.clone())
    );
    assert!(
        relative(gpu.loss, cpu.loss) < 1e-2,
        "loss {} vs {}",
        gpu.loss,
        cpu.loss
    );
}

#[test]
fn nvfp4_gptq_factors_through_the_given_factorizer_and_matches_the_host() {
    if client().is_none() {
        return;
    }
    // The factor comes from the solver's factorizer (cuSOLVER on CUDA, the counting textbook
    // inverse here), the column loop runs on the device.
    let calls = Arc::new(AtomicUsize::new(0));
    let device = solver().with_factorizer(Box::new(CountingFactorizer(calls.clone())));
    let (rows, cols) = (12, 64);
    let mut rng = Rng::new(29);
    let h = hessian(&mut rng, cols);
    let weights: Vec<f32> = (0..rows * cols).map(|_| 0.1 * rng.normal()).collect();
    let amax = weights.iter().fold(0f32, |m, v| m.max(v.abs()));
    let global = global_scale_from_amax(amax).unwrap();
    let solver = Nvfp4Gptq::default();
    let cpu = CpuSolver
        .solve_nvfp4_gptq(&solver, &weights, rows, cols, &h, global)
        .unwrap();
    let gpu = device
        .solve_nvfp4_gptq(&solver, &weights, rows, cols, &h, global)
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(gpu.method, Method::Gptq);
    // f64 textbook factor against faer's f32 one: a rare code may flip at a rounding boundary.
    assert!(
        relative(gpu.proxy_error, cpu.proxy_error) < 5e-2,
        "proxy {} vs {}",
        gpu.proxy_error,
        cpu.proxy_error
    );
}

/// GPTQ on the NVFP4 grid with its column loop and proxy error on the device, against the
/// host loop on the same factor (faer's, on the host for both): lazy blocks of one, two and
/// eight 16-column blocks, a last lazy block cut short, a dead column.
#[test]
fn device_nvfp4_gptq_matches_the_host_loop() {
    if client().is_none() {
        return;
    }
    let device = solver();
    let mut rng = Rng::new(30);
    for (rows, cols, block_size) in [(16, 48, 16), (40, 320, 32), (40, 320, 128)] {
        let h = hessian(&mut rng, cols);
        let weights: Vec<f32> = (0..rows * cols).map(|_| 0.1 * rng.normal()).collect();
        let amax = weights.iter().fold(0f32, |m, v| m.max(v.abs()));
        let global = global_scale_from_amax(amax).unwrap();
        let solver = Nvfp4Gptq {
            block_size,
            ..Nvfp4Gptq::default()
        };
        let label = format!("{rows}×{cols}, block {block_size}");
        let cpu = CpuSolver
            .solve_nvfp4_gptq(&solver, &weights, rows, cols, &h, global)
            .unwrap();
        let gpu = device
            .solve_nvfp4_gptq(&solver, &weights, rows, cols, &h, global)
            .unwrap();
        let steps = device.take_step_seconds();
        assert!(
            steps.iter().any(|(step, _)| *step == "column loop"),
            "{label}: the loop ran on the device ({steps:?})"
        );
        assert_nvfp4_gptq_close(&gpu, &cpu, &weights, &h, &label);
    }
}

/// A device GPTQ on the NVFP4 grid against the host's on the same problem (`weights` under
/// `h`, whose column 3 is dead): summation orders differ, so a code at a rounding boundary or
/// a scale at a tie of the search may flip and its row take another path; the proxy error is
/// the host's formula on the device's weights.
fn assert_nvfp4_gptq_close(
    gpu: &Nvfp4GptqResult,
    cpu: &Nvfp4GptqResult,
    weights: &[f32],
    h: &Hessian<f64>,
    label: &str,
) {
    let (rows, cols) = (gpu.rows, gpu.cols);
    assert_eq!(
        (gpu.method, cpu.method),
        (Method::Gptq, Method::Gptq),
        "{label}"
    );
    assert_eq!(gpu.damping_retries, cpu.damping_retries, "{label}");
    assert_eq!(gpu.global_scale, cpu.global_scale, "{label}");
    let differing = |a: &[u8], b: &[u8]| a.iter().zip(b).filter(|(x, y)| x != y).count();
    let codes = differing(&gpu.codes, &cpu.codes);
    let scales = differing(&gpu.block_scales, &cpu.block_scales);
    assert!(
        codes * 50 <= gpu.codes.len(),
        "{label}: {codes} codes differ"
    );
    assert!(
        scales * 50 <= gpu.block_scales.len(),
        "{label}: {scales} scales differ"
    );
    assert!(
        (0..rows).all(|r| gpu.dequantized[r * cols + 3] == 0.0),
        "{label}: the dead column is zero"
    );
    let (a, b) = (gpu.loss, cpu.loss);
    assert!(relative(a, b) < 1e-2, "{label}: loss {a} vs {b}");
    let (a, b) = (gpu.proxy_error, cpu.proxy_error);
    assert!(relative(a, b) < 2e-2, "{label}: proxy {a} vs {b}");
    let host = sala_hessian::proxy_error(weights, &gpu.dequantized, cols, h);
    assert!(
        relative(a, host) < 1e-4,
        "{label}: device proxy {a} vs host {host}"
    );
}

/// GPTQ on the NVFP4 grid against a Hessian in device memory: the host solver's result up to
/// f32 summation orders; the linears of one Hessian share its factor; the fallback when no
/// damping factors it is the block search; the proxy error of any weight where `H` is.
#[test]
fn resident_nvfp4_gptq_matches_the_host_and_shares_the_factor() {
    if client().is_none() {
        return;
    }
    let calls = Arc::new(AtomicUsize::new(0));
    let device = solver().with_device_factorizer(Arc::new(CountingDeviceFactorizer {
        calls: calls.clone(),
        refuse: 0,
    }));
    let (rows, cols) = (24, 160);
    let mut rng = Rng::new(31);
    let h = hessian(&mut rng, cols);
    let h_device = on_device(&h);
    let linears: Vec<Vec<f32>> = (0..2)
        .map(|_| (0..rows * cols).map(|_| 0.1 * rng.normal()).collect())
        .collect();
    let amax = linears[0].iter().fold(0f32, |m, v| m.max(v.abs()));
    let global = global_scale_from_amax(amax).unwrap();
    let options = Nvfp4Gptq {
        block_size: 64,
        ..Nvfp4Gptq::default()
    };
    let resident = |w: &[f32], read_next: bool| {
        let h = ResidentHessian {
            matrix: &h_device,
            read_next,
        };
        device
            .solve_nvfp4_gptq_resident(&options, w, rows, cols, h, global)
            .unwrap()
    };
    let alone: Vec<_> = linears.iter().map(|w| resident(w, false)).collect();
    assert_eq!(calls.swap(0, Ordering::SeqCst), 2);
    for (w, gpu) in linears.iter().zip(&alone) {
        let cpu = CpuSolver
            .solve_nvfp4_gptq(&options, w, rows, cols, &h, global)
            .unwrap();
        assert_nvfp4_gptq_close(gpu, &cpu, w, &h, "resident");
    }

    // With the report's baseline: the same result, and max calibration's proxy error as the
    // host computes it.
    let h_alone = ResidentHessian {
        matrix: &h_device,
        read_next: false,
    };
    let (with_baseline, baseline) = device
        .solve_nvfp4_gptq_resident_with_baseline(
            &options,
            true,
            &linears[0],
            rows,
            cols,
            h_alone,
            global,
        )
        .unwrap();
    assert_eq!(with_baseline, alone[0]);
    let max = Nvfp4Matrix::quantize(&linears[0], rows, cols, global, BlockScales::Max)
        .unwrap()
        .dequantize();
    let host = sala_hessian::proxy_error(&linears[0], &max, cols, &h);
    let baseline = baseline.expect("a baseline").proxy_error;
    assert!(relative(baseline, host) < 1e-4, "{baseline} vs {host}");
    calls.swap(0, Ordering::SeqCst);

    // One factor for both linears, and the same results as alone.
    let shared = [resident(&linears[0], true), resident(&linears[1], false)];
    assert_eq!(calls.swap(0, Ordering::SeqCst), 1);
    assert_eq!(shared[..], alone[..]);

    // The proxy error of any weight under the device Hessian, and its shape checks.
    let proxy = device
        .proxy_error_resident(&linears[0], &linears[1], &h_device)
        .unwrap();
    let host = sala_hessian::proxy_error(&linears[0], &linears[1], cols, &h);
    assert!(relative(proxy, host) < 1e-4, "{proxy} vs {host}");
    assert!(matches!(
        device.proxy_error_resident(&linears[0][1..], &linears[1][1..], &h_device),
        Err(HessianError::DimensionMismatch { .. })
    ));
    assert!(matches!(
        device.proxy_error_resident(&linears[0], &linears[1][1..], &h_device),
        Err(HessianError::DimensionMismatch { .. })
    ));

    // No damping factors the Hessian: the error, or the block search alone on request.
    let refusing = solver().with_device_factorizer(Arc::new(CountingDeviceFactorizer {
        calls: Arc::new(AtomicUsize::new(0)),
        refuse: usize::MAX,
    }));
    let on_refusing = |options: &Nvfp4Gptq| {
        let h = ResidentHessian::from(&h_device);
        refusing.solve_nvfp4_gptq_resident(options, &linears[0], rows, cols, h, global)
    };
    assert!(matches!(
        on_refusing(&options),
        Err(HessianError::NotPositiveDefinite { attempts: 6, .. })
    ));
    let fallback = on_refusing(&Nvfp4Gptq {
        on_failure: FailurePolicy::Rtn,
        ..options
    })
    .unwrap();
    let diag: Vec<f32> = (0..cols).map(|j| h.get(j, j).max(0.0) as f32).collect();
    let search = CpuSolver
        .search_nvfp4(&options.search, &linears[0], rows, cols, &diag, global)
        .unwrap();
    assert_eq!(fallback.method, Method::RtnFallback);
    assert_eq!(fallback.codes, search.codes);
    assert_eq!(fallback.block_scales, search.block_scales);
}

#[test]
fn device_block_search_equals_the_host_search_and_reports_bad_weights() {
    if client().is_none() {
        return;
    }
    let device = solver();
    let (rows, cols) = (24, 96);
    let mut rng = Rng::new(22);
    let mut weights: Vec<f32> = (0..rows * cols).map(|_| rng.normal()).collect();
    let diag: Vec<f32> = (0..cols).map(|_| rng.uniform()).collect();
    let amax = weights.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let global = global_scale_from_amax(amax).unwrap();
    let search = Nvfp4BlockSearch::default();
    let cpu = CpuSolver
        .search_nvfp4(&search, &weights, rows, cols, &diag, global)
        .unwrap();
    let gpu = device
        .search_nvfp4(&search, &weights, rows, cols, &diag, global)
        .unwrap();
    assert_eq!(gpu.block_scales, cpu.block_scales);
    assert_eq!(gpu.codes, cpu.codes);
    assert_eq!(gpu.dequantized, cpu.dequantized);
    for (a, b) in gpu.block_error.iter().zip(&cpu.block_error) {
        assert!((a - b).abs() <= 1e-5 * b.abs().max(1e-12), "{a} vs {b}");
    }

    // With the diagonal errors (on the device here, on the host for CpuSolver): the same
    // result, and the same figures up to f32 sums.
    for baseline in [true, false] {
        let with = |s: &dyn LinearSolver| {
            s.search_nvfp4_with_errors(&search, baseline, &weights, rows, cols, &diag, global)
                .unwrap()
        };
        let ((gpu, gpu_errors), (cpu, cpu_errors)) = (with(&device), with(&CpuSolver));
        assert_eq!(
            (&gpu.codes, &gpu.block_scales, &gpu.dequantized),
            (&cpu.codes, &cpu.block_scales, &cpu.dequantized)
        );
        let host = sala_hessian::diagonal_error(&weights, &cpu.dequantized, &diag);
        assert_eq!(cpu_errors.error, host);
        assert!(
            relative(gpu_errors.error, host) < 1e-5,
            "{gpu_errors:?} vs {host}"
        );
        match (gpu_errors.max_calibration, cpu_errors.max_calibration) {
            (Some(a), Some(b)) => {
                let max = Nvfp4Matrix::quantize(&weights, rows, cols, global, BlockScales::Max)
                    .unwrap()
                    .dequantize();
                assert_eq!(b, sala_hessian::diagonal_error(&weights, &max, &diag));
                assert!(relative(a, b) < 1e-5, "baseline {a} vs {b}");
                assert!(a > gpu_errors.error, "the search beats max calibration");
            }
            (None, None) => assert!(!baseline),
            other => panic!("baselines {other:?} asked {baseline}"),
        }
    }

    weights[5 * cols + 40] = f32::NAN;
    match device.search_nvfp4_with_errors(&search, true, &weights, rows, cols, &diag, global) {
        Err(HessianError::NonFinite {
            row: 5, col: 32, ..
        }) => {}
        other => panic!("expected the NaN block at row 5, column 32: {other:?}"),
    }
    match device.search_nvfp4(&search, &weights, rows, cols, &diag, global) {
        Err(HessianError::NonFinite {
            row: 5, col: 32, ..
        }) => {}
        other => panic!("expected the NaN block at row 5, column 32: {other:?}"),
    }
    assert!(matches!(
        device.search_nvfp4(&search, &weights[1..], rows, cols, &diag, global),
        Err(HessianError::Device(_))
    ));
}

/// The host Hessian as the device's f32 row-major matrix.
fn on_device(h: &Hessian<f64>) -> MatrixView {
    let values: Vec<f32> = h.to_row_major().iter().map(|&v| v as f32).collect();
    MatrixView::upload(&device_client(), &values, h.dim(), h.dim()).unwrap()
}

/// GPTQ on a Hessian in device memory (diagonal, damped copy, factor, loop and proxy error
/// on the device) against the host solver on the same Hessian in f64.
#[test]
fn resident_gptq_matches_the_host_solver() {
    if client().is_none() {
        return;
    }
    let device = solver();
    let (out, inp) = (40, 160);
    let mut rng = Rng::new(24);
    let h = hessian(&mut rng, inp);
    let h_device = on_device(&h);
    let weights: Vec<f32> = (0..out * inp).map(|_| 0.1 * rng.normal()).collect();
    for (act_order, static_groups, group_size, group_aware_order, clip) in [
        (false, false, Some(32), false, false),
        (true, false, Some(32), false, false),
        (true, true, Some(32), false, false),
        (false, false, None, false, false),
        (false, false, Some(32), true, false),
        (false, false, Some(32), true, true),
        (true, false, Some(64), false, true),
    ] {
        let config = GptqConfig {
            grid: IntGrid {
                bits: 4,
                scheme: IntScheme::SymmetricIst,
                group_size,
                clip: clip.then_some(ClipSearch::GPTQMODEL),
            },
            block_size: 64,
            act_order,
            static_groups,
            group_aware_order,
            ..GptqConfig::default()
        };
        let label = format!(
            "act_order {act_order} static {static_groups} group {group_size:?} gar {group_aware_order} clip {clip}"
        );
        let cpu = CpuSolver
            .solve_gptq(&config, &weights, out, inp, &h)
            .unwrap();
        let gpu = device
            .solve_gptq_resident(&config, &weights, out, inp, &h_device)
            .unwrap();
        assert_eq!(gpu.g_idx, cpu.g_idx, "{label}");
        assert_eq!(
            (gpu.method, gpu.damping_retries, gpu.percdamp),
            (cpu.method, cpu.damping_retries, cpu.percdamp),
            "{label}"
        );
        let differing = gpu
            .codes
            .iter()
            .zip(&cpu.codes)
            .filter(|(a, b)| a != b)
            .count();
        assert!(
            differing * 50 <= gpu.codes.len(),
            "{label}: {differing} codes differ"
        );
        assert!(
            relative(gpu.loss, cpu.loss) < 1e-2,
            "{label}: loss {} vs {}",
            gpu.loss,
            cpu.loss
        );
        // Dead column 3 quantizes to zero on both.
        assert!(
            (0..out).all(|r| gpu.dequantized[r * inp + 3] == 0.0),
            "{label}"
        );
        let (a, b) = (gpu.proxy_error.unwrap(), cpu.proxy_error.unwrap());
        assert!(relative(a, b) < 2e-2, "{label}: proxy {a} vs {b}");
    }
    assert_eq!(
        h_device.download(&device_client()).unwrap(),
        on_device(&h).download(&device_client()).unwrap(),
        "the device Hessian is left as it is"
    );
}

/// The host's faer Cholesky behind the device interface, counting its calls and refusing the
/// first `refuse` matrices (as a Cholesky refuses a matrix that is not positive definite).
struct CountingDeviceFactorizer {
    calls: Arc<AtomicUsize>,
    refuse: usize,
}

impl DeviceFactorizer<TestRuntime> for CountingDeviceFactorizer {
    fn upper_factor_on_device(
        &self,
        client: &ComputeClient<TestRuntime>,
        a: &MatrixView,
    ) -> Result<Option<MatrixView>, KernelError> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if call <= self.refuse {
            return Ok(None);
        }
        let n = a.rows;
        let u = FaerFactorizer
            .upper_factor(&a.download(client)?, n)
            .unwrap()
            .unwrap();
        MatrixView::upload(client, &square_to_row_major(u.as_ref()), n, n).map(Some)
    }
}

#[test]
fn resident_damping_retries_go_through_the_device_factorizer() {
    if client().is_none() {
        return;
    }
    let calls = Arc::new(AtomicUsize::new(0));
    let device = solver().with_device_factorizer(Arc::new(CountingDeviceFactorizer {
        calls: calls.clone(),
        refuse: 2,
    }));
    let (out, inp) = (16, 64);
    let mut rng = Rng::new(25);
    let h = hessian(&mut rng, inp);
    let weights: Vec<f32> = (0..out * inp).map(|_| 0.1 * rng.normal()).collect();
    let config = GptqConfig::default();
    let q = device
        .solve_gptq_resident(&config, &weights, out, inp, &on_device(&h))
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(q.damping_retries, 2);
    assert!(relative(q.percdamp, config.damping.percdamp * 100.0) < 1e-12);

    // Every attempt refused: the schedule's error, or RTN with its proxy error on request.
    let refusing = solver().with_device_factorizer(Arc::new(CountingDeviceFactorizer {
        calls: Arc::new(AtomicUsize::new(0)),
        refuse: usize::MAX,
    }));
    let err = refusing
        .solve_gptq_resident(&config, &weights, out, inp, &on_device(&h))
        .unwrap_err();
    assert!(
        matches!(err, HessianError::NotPositiveDefinite { attempts: 6, .. }),
        "{err:?}"
    );
    let rtn_config = GptqConfig {
        on_failure: FailurePolicy::Rtn,
        ..config
    };
    let rtn = refusing
        .solve_gptq_resident(&rtn_config, &weights, out, inp, &on_device(&h))
        .unwrap();
    let host_rtn = CpuSolver
        .quantize_rtn(config.grid, &weights, out, inp, &h)
        .unwrap();
    assert_eq!(rtn.method, Method::RtnFallback);
    assert_eq!(rtn.codes, host_rtn.codes);
    let (a, b) = (rtn.proxy_error.unwrap(), host_rtn.proxy_error.unwrap());
    assert!(relative(a, b) < 1e-3, "proxy {a} vs {b}");
}

/// GPTQ of `weights` on the device Hessian `h`, finished, telling the solver whether the
/// next solve reads `h` too.
fn solve_sharing(
    device: &DeviceSolver<TestRuntime, CubeGemm>,
    config: &GptqConfig,
    weights: &[f32],
    inp: usize,
    h: &MatrixView,
    read_next: bool,
) -> sala_hessian::QuantizedLinear {
    let h = ResidentHessian {
        matrix: h,
        read_next,
    };
    let out = weights.len() / inp;
    let (unfinished, _) = device
        .solve_gptq_resident_unfinished(config, None, weights, out, inp, h)
        .unwrap();
    unfinished.finish().unwrap()
}

/// Linears that read one Hessian share its damped factor when the caller says the next solve
/// reads it: one factorization for q/k/v, and each result exactly what a solve alone gives.
/// A kept factor serves no other Hessian, loop order or damping.
#[test]
fn linears_of_one_hessian_share_the_damped_factor() {
    if client().is_none() {
        return;
    }
    let calls = Arc::new(AtomicUsize::new(0));
    let device = solver().with_device_factorizer(Arc::new(CountingDeviceFactorizer {
        calls: calls.clone(),
        refuse: 0,
    }));
    let (out, inp) = (16, 64);
    let mut rng = Rng::new(28);
    let (h, other_h) = (hessian(&mut rng, inp), hessian(&mut rng, inp));
    let (h_device, other_device) = (on_device(&h), on_device(&other_h));
    let linears: Vec<Vec<f32>> = (0..3)
        .map(|_| (0..out * inp).map(|_| 0.1 * rng.normal()).collect())
        .collect();
    let config = GptqConfig {
        group_aware_order: true,
        ..GptqConfig::default()
    };
    let alone: Vec<_> = linears
        .iter()
        .map(|w| solve_sharing(&device, &config, w, inp, &h_device, false))
        .collect();
    assert_eq!(calls.swap(0, Ordering::SeqCst), 3);

    for (i, w) in linears.iter().enumerate() {
        let shared = solve_sharing(&device, &config, w, inp, &h_device, i + 1 < linears.len());
        assert_eq!(shared.codes, alone[i].codes, "linear {i}");
        assert_eq!(shared.dequantized, alone[i].dequantized, "linear {i}");
        assert_eq!(shared.proxy_error, alone[i].proxy_error, "linear {i}");
        assert_eq!(shared.percdamp, alone[i].percdamp, "linear {i}");
    }
    assert_eq!(
        calls.swap(0, Ordering::SeqCst),
        1,
        "one factor for three linears"
    );

    // The last solve freed the factor: the next one factors again.
    solve_sharing(&device, &config, &linears[0], inp, &h_device, false);
    assert_eq!(calls.swap(0, Ordering::SeqCst), 1);

    // A kept factor does not serve another Hessian, another loop order or another damping.
    let natural = GptqConfig {
        group_aware_order: false,
        ..config
    };
    let mut damped = config;
    damped.damping.percdamp *= 2.0;
    for (label, next_config, next_h, host_h) in [
        ("another hessian", config, &other_device, &other_h),
        ("another order", natural, &h_device, &h),
        ("another damping", damped, &h_device, &h),
    ] {
        solve_sharing(&device, &config, &linears[0], inp, &h_device, true);
        let next = solve_sharing(&device, &next_config, &linears[1], inp, next_h, false);
        assert_eq!(calls.swap(0, Ordering::SeqCst), 2, "{label}");
        let fresh = solve_sharing(&device, &next_config, &linears[1], inp, next_h, false);
        calls.store(0, Ordering::SeqCst);
        assert_eq!(next.codes, fresh.codes, "{label}");
        assert_eq!(next.proxy_error, fresh.proxy_error, "{label}");
        let host = CpuSolver
            .solve_gptq(&next_config, &linears[1], out, inp, host_h)
            .unwrap();
        assert_eq!(next.percdamp, host.percdamp, "{label}");
    }
}

/// The portable GEMM, counting its calls.
struct CountedGemm(Arc<AtomicUsize>);

impl Gemm<TestRuntime> for CountedGemm {
    fn gemm(
        &self,
        client: &ComputeClient<TestRuntime>,
        alpha: f32,
        a: &MatrixView,
        trans_a: bool,
        b: &MatrixView,
        trans_b: bool,
        beta: f32,
        c: &MatrixView,
    ) -> Result<(), KernelError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        CubeGemm.gemm(client, alpha, a, trans_a, b, trans_b, beta, c)
    }
}

/// The proxy errors (GPTQ's and the baseline's) go through the proxy GEMM when one is given,
/// and nothing else does: the column loop keeps the solver's own.
#[test]
fn proxy_errors_use_the_proxy_gemm() {
    if client().is_none() {
        return;
    }
    // Two lazy blocks of 128: one trailing update in the loop.
    let (out, inp) = (16, 256);
    let mut rng = Rng::new(32);
    let h = on_device(&hessian(&mut rng, inp));
    let weights: Vec<f32> = (0..out * inp).map(|_| 0.1 * rng.normal()).collect();
    let config = GptqConfig::default();
    let grid = Some(IntGrid {
        clip: None,
        ..config.grid
    });
    let counters = || Arc::new(AtomicUsize::new(0));
    let (alone_calls, loop_calls, proxy_calls) = (counters(), counters(), counters());
    let alone = DeviceSolver::new(device_client(), CountedGemm(alone_calls.clone()), "one");
    let split = DeviceSolver::new(device_client(), CountedGemm(loop_calls.clone()), "two")
        .with_proxy_gemm(CountedGemm(proxy_calls.clone()));
    let solve = |solver: &DeviceSolver<TestRuntime, CountedGemm>| {
        solver
            .solve_gptq_resident_with_baseline(&config, grid, &weights, out, inp, &h)
            .unwrap()
    };
    let (q_alone, base_alone) = solve(&alone);
    let (q_split, base_split) = solve(&split);
    assert_eq!(q_alone, q_split);
    assert_eq!(
        base_alone.unwrap().proxy_error,
        base_split.unwrap().proxy_error
    );
    assert_eq!(
        proxy_calls.load(Ordering::SeqCst),
        2,
        "GPTQ's and the baseline's"
    );
    let (all, looped) = (
        alone_calls.load(Ordering::SeqCst),
        loop_calls.load(Ordering::SeqCst),
    );
    assert!(looped > 0);
    assert_eq!(looped + 2, all);
}

#[test]
fn resident_gptq_refuses_bad_hessians_by_position() {
    if client().is_none() {
        return;
    }
    let device = solver();
    let (out, inp) = (8, 32);
    let mut rng = Rng::new(26);
    let h = hessian(&mut rng, inp);
    let weights: Vec<f32> = (0..out * inp).map(|_| 0.1 * rng.normal()).collect();
    let mut values: Vec<f32> = h.to_row_major().iter().map(|&v| v as f32).collect();
    values[5 * inp + 9] = f32::NAN;
    let bad = MatrixView::upload(&device_client(), &values, inp, inp).unwrap();
    match device.solve_gptq_resident(&GptqConfig::default(), &weights, out, inp, &bad) {
        Err(HessianError::NonFinite {
            what: "hessian",
            row: 5,
            col: 9,
            ..
        }) => {}
        other => panic!("expected the NaN at (5, 9): {other:?}"),
    }
    let small = on_device(&hessian(&mut rng, inp / 2));
    assert!(matches!(
        device.solve_gptq_resident(&GptqConfig::default(), &weights, out, inp, &small),
        Err(HessianError::DimensionMismatch { .. })
    ));
}

/// The report's baseline from the resident solve's one upload: round-to-nearest's proxy error
/// on the device (plain grid) or through the host (clipping search) against the host solver's,
/// and the GPTQ result unchanged by asking for it.
#[test]
fn resident_baseline_matches_the_host_round_to_nearest() {
    if client().is_none() {
        return;
    }
    let device = solver();
    let (out, inp) = (24, 96);
    let mut rng = Rng::new(27);
    let h = hessian(&mut rng, inp);
    let h_device = on_device(&h);
    let weights: Vec<f32> = (0..out * inp).map(|_| 0.1 * rng.normal()).collect();
    let config = GptqConfig {
        group_aware_order: true,
        ..GptqConfig::default()
    };
    let alone = device
        .solve_gptq_resident(&config, &weights, out, inp, &h_device)
        .unwrap();
    for clip in [None, Some(ClipSearch::DEFAULT)] {
        let grid = IntGrid {
            clip,
            ..config.grid
        };
        let (q, baseline) = device
            .solve_gptq_resident_with_baseline(&config, Some(grid), &weights, out, inp, &h_device)
            .unwrap();
        assert_eq!(q.codes, alone.codes);
        assert_eq!(q.proxy_error, alone.proxy_error);
        let host = CpuSolver
            .quantize_rtn(grid, &weights, out, inp, &h)
            .unwrap()
            .proxy_error
            .unwrap();
        let baseline = baseline.unwrap().proxy_error;
        assert!(
            relative(baseline, host) < 1e-3,
            "clip {clip:?}: baseline {baseline} vs {host}"
        );
        assert!(
            baseline > q.proxy_error.unwrap(),
            "GPTQ beats round-to-nearest"
        );
    }
}

/// On CUDA: the proxy errors on TF32 tensor cores (the production solver's) against the host's
/// f64 proxy error, GPTQ's and the baseline's, at a size where the products are large.
#[cfg(feature = "cuda")]
mod tf32_proxy {
    use super::*;
    use sala_kernels::cuda::{Cublas, CublasGemm, Fp32Math};

    #[test]
    fn tf32_proxy_errors_match_the_host_f64_ones() {
        if client().is_none() {
            return;
        }
        let blas = Arc::new(Cublas::new(0).unwrap());
        let solver = DeviceSolver::new(
            device_client(),
            CublasGemm::new(blas.clone(), Fp32Math::Pedantic),
            "cuda",
        )
        .with_proxy_gemm(CublasGemm::new(blas, Fp32Math::Tf32));
        let (out, inp) = (256, 1024);
        let mut rng = Rng::new(33);
        let h = hessian(&mut rng, inp);
        let weights: Vec<f32> = (0..out * inp).map(|_| 0.1 * rng.normal()).collect();
        let config = GptqConfig::default();
        let grid = IntGrid {
            clip: None,
            ..config.grid
        };
        let (q, baseline) = solver
            .solve_gptq_resident_with_baseline(
                &config,
                Some(grid),
                &weights,
                out,
                inp,
                &on_device(&h),
            )
            .unwrap();
        let host = sala_hessian::proxy_error(&weights, &q.dequantized, inp, &h);
        let device = q.proxy_error.unwrap();
        assert!(relative(device, host) < 1e-3, "GPTQ: {device} vs {host}");
        let rtn = CpuSolver
            .quantize_rtn(grid, &weights, out, inp, &h)
            .unwrap();
        let (device, host) = (baseline.unwrap().proxy_error, rtn.proxy_error.unwrap());
        assert!(
            relative(device, host) < 1e-3,
            "baseline: {device} vs {host}"
        );
    }
}
