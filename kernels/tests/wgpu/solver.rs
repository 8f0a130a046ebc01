//! `DeviceSolver` (the pipeline's solver seam on the device) against `CpuSolver` on whole
//! GPTQ solves (preparation, act-order, static groups, un-permuting, proxy error) and NVFP4
//! searches.

use sala_formats::nvfp4::global_scale_from_amax;
use sala_formats::IntScheme;
use sala_hessian::faer::Mat;
use sala_hessian::reference::inverse_upper_textbook;
use sala_hessian::{
    CpuSolver, GptqConfig, Hessian, HessianError, IntGrid, LinearSolver, Nvfp4BlockSearch,
    UpperFactorizer,
};
use sala_kernels::{CubeGemm, DeviceSolver};
use std::cell::Cell;
use std::rc::Rc;

use crate::common::{client, Rng, TestRuntime};

fn solver() -> DeviceSolver<TestRuntime, CubeGemm> {
    DeviceSolver::new(client(), CubeGemm, "test device")
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
    let device = solver();
    assert_eq!(device.name(), "test device");
    let (out, inp) = (48, 192);
    let mut rng = Rng::new(21);
    let h = hessian(&mut rng, inp);
    let weights: Vec<f32> = (0..out * inp).map(|_| 0.1 * rng.normal()).collect();
    for (act_order, static_groups, group_size, block_size) in [
        (false, false, Some(32), 64),
        (true, false, Some(64), 128),
        (true, true, Some(32), 64),
        (false, false, None, 48),
    ] {
        let config = GptqConfig {
            grid: IntGrid {
                bits: 4,
                scheme: IntScheme::SymmetricIst,
                group_size,
            },
            block_size,
            act_order,
            static_groups,
            ..GptqConfig::default()
        };
        let label = format!("act_order {act_order} static {static_groups} group {group_size:?}");
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
struct CountingFactorizer(Rc<Cell<usize>>);

impl UpperFactorizer for CountingFactorizer {
    fn upper_factor(&self, a: &[f32], n: usize) -> Result<Option<Mat<f32>>, HessianError> {
        self.0.set(self.0.get() + 1);
        let a: Vec<f64> = a.iter().map(|&v| v as f64).collect();
        let u = inverse_upper_textbook(&Hessian::from_row_major(n, &a)?, 0.0)?;
        Ok(Some(Mat::from_fn(n, n, |i, j| u[(i, j)] as f32)))
    }
}

#[test]
fn the_damped_inverse_comes_from_the_given_factorizer() {
    let calls = Rc::new(Cell::new(0));
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
    assert_eq!(calls.get(), 1);
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
fn device_block_search_equals_the_host_search_and_reports_bad_weights() {
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

    weights[5 * cols + 40] = f32::NAN;
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
