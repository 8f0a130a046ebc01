//! The loop-order gather and the weight errors `W − Q` on the device against the host's
//! permutation, dequantization and round-to-nearest, bit for bit.

use sala_formats::nvfp4::global_scale_from_amax;
use sala_formats::{BlockScales, IntQuantizer, IntScheme, Nvfp4Matrix};
use sala_hessian::{IntGrid, Rtn};
use sala_kernels::{
    gather_columns, gptq_weight_error, nvfp4_diagonal_error, nvfp4_weight_error, rtn_weight_error,
    DeviceGptqResult, DeviceVec, KernelError, MatrixView,
};

use crate::common::{client, Rng};

/// `w` `[rows, cols]` as a window at (1, 2) of a wider buffer of NaNs: offsets and strides
/// all the way through, and any read outside the window shows.
fn windowed(
    client: &sala_kernels::cubecl::prelude::ComputeClient<crate::common::TestRuntime>,
    w: &[f32],
    rows: usize,
    cols: usize,
) -> MatrixView {
    let wide = cols + 3;
    let mut buffer = vec![f32::NAN; (rows + 1) * wide];
    for r in 0..rows {
        buffer[(r + 1) * wide + 2..(r + 1) * wide + 2 + cols]
            .copy_from_slice(&w[r * cols..(r + 1) * cols]);
    }
    MatrixView::upload(client, &buffer, rows + 1, wide)
        .unwrap()
        .window(1, 2, rows, cols)
        .unwrap()
}

/// A random permutation of `0..n`.
fn permutation(rng: &mut Rng, n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

#[test]
fn gathered_columns_are_the_host_permutation_with_dead_columns_zeroed() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(61);
    let (rows, cols) = (7, 45);
    let w = rng.vec(rows * cols);
    let view = windowed(&client, &w, rows, cols);
    let order = permutation(&mut rng, cols);
    let sources: Vec<Option<usize>> = order.iter().map(|&j| (j % 11 != 4).then_some(j)).collect();
    let got = gather_columns(&client, &view, &sources)
        .unwrap()
        .download(&client)
        .unwrap();
    let expected: Vec<f32> = (0..rows)
        .flat_map(|r| sources.iter().map(move |s| (r, *s)))
        .map(|(r, s)| s.map_or(0.0, |j| w[r * cols + j]))
        .collect();
    assert_eq!(got, expected);
    assert!(matches!(
        gather_columns(&client, &view, &[Some(cols)]),
        Err(KernelError::Shape { .. })
    ));
}

#[test]
fn gptq_weight_error_is_the_host_dequantization_in_original_order() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(62);
    let (out, inp, gs) = (9usize, 70usize, 16usize);
    let groups = inp.div_ceil(gs);
    let w = rng.vec(out * inp);
    let codes: Vec<u32> = (0..out * inp)
        .map(|_| (rng.next_u64() % 16) as u32)
        .collect();
    let scales: Vec<f32> = (0..out * groups).map(|_| 0.01 + rng.uniform()).collect();
    let zeros: Vec<u32> = (0..out * groups)
        .map(|_| (rng.next_u64() % 16) as u32)
        .collect();
    let result = DeviceGptqResult {
        out,
        inp,
        group_size: gs,
        codes: DeviceVec::upload(&client, &codes),
        scales: DeviceVec::upload(&client, &scales),
        zeros: DeviceVec::upload(&client, &zeros),
        row_loss: DeviceVec::zeros(&client, out).unwrap(),
        column_loss: DeviceVec::zeros(&client, inp).unwrap(),
        loss: 0.0,
    };
    let view = windowed(&client, &w, out, inp);
    for order in [(0..inp).collect::<Vec<_>>(), permutation(&mut rng, inp)] {
        let got = gptq_weight_error(&client, &view, &result, &order)
            .unwrap()
            .download(&client)
            .unwrap();
        let mut expected = vec![f32::NAN; out * inp];
        for r in 0..out {
            for (c, &j) in order.iter().enumerate() {
                let at = r * groups + c / gs;
                let params = sala_formats::QuantParams {
                    scale: scales[at],
                    zero: zeros[at] as u8,
                };
                let q = IntQuantizer::dequantize(codes[r * inp + c] as u8, params);
                expected[r * inp + j] = w[r * inp + j] - q;
            }
        }
        assert_eq!(got, expected);
    }
    let mut repeated: Vec<usize> = (0..inp).collect();
    repeated[1] = 0;
    assert!(matches!(
        gptq_weight_error(&client, &view, &result, &repeated),
        Err(KernelError::Shape { .. })
    ));
}

#[test]
fn rtn_weight_error_is_the_host_round_to_nearest() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(63);
    let (out, inp) = (11, 100);
    let mut w: Vec<f32> = (0..out * inp).map(|_| 0.1 * rng.normal()).collect();
    // A zero group, a one-signed group and a group of equal values.
    w[..32].iter_mut().for_each(|v| *v = 0.0);
    w[inp..inp + 32].iter_mut().for_each(|v| *v = v.abs());
    w[2 * inp + 32..2 * inp + 64]
        .iter_mut()
        .for_each(|v| *v = -0.25);
    let view = windowed(&client, &w, out, inp);
    for scheme in [
        IntScheme::SymmetricIst,
        IntScheme::SymmetricAbsMax,
        IntScheme::Asymmetric,
    ] {
        for (bits, group_size) in [(4, Some(32)), (3, Some(48)), (8, None)] {
            let grid = IntGrid {
                bits,
                scheme,
                group_size,
                clip: None,
            };
            let host = Rtn::new(grid)
                .unwrap()
                .quantize::<f64>(&w, out, inp, None)
                .unwrap();
            let expected: Vec<f32> = w
                .iter()
                .zip(&host.dequantized)
                .map(|(a, b)| a - b)
                .collect();
            let quantizer = IntQuantizer::new(bits, scheme).unwrap();
            let got = rtn_weight_error(&client, &view, quantizer, group_size.unwrap_or(inp))
                .unwrap()
                .download(&client)
                .unwrap();
            assert_eq!(got, expected, "{grid:?}");
        }
    }
}

/// NVFP4 codes and block scales of every kind (both signs of each E2M1 code, subnormal and
/// normal E4M3 bytes, byte 0): `W − Q` on the device is the host's `W − dequantize` bit for
/// bit, and a wrong shape is an error.
#[test]
fn nvfp4_weight_error_is_the_host_dequantization() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(64);
    let (rows, cols) = (9, 64);
    let w: Vec<f32> = (0..rows * cols).map(|_| 0.1 * rng.normal()).collect();
    let codes: Vec<u8> = (0..rows * cols).map(|k| (k * 7 % 16) as u8).collect();
    let scales: Vec<u8> = (0..rows * cols / 16)
        .map(|b| [0u8, 1, 7, 8, 0x38, 0x5A, 0x7E][b % 7])
        .collect();
    let global = global_scale_from_amax(3.0).unwrap();
    let host = Nvfp4Matrix::from_codes(&codes, rows, cols, global, scales.clone())
        .unwrap()
        .dequantize();
    let expected: Vec<f32> = w.iter().zip(&host).map(|(a, b)| a - b).collect();
    let as_words = |bytes: &[u8]| bytes.iter().map(|&b| u32::from(b)).collect::<Vec<u32>>();
    let codes = DeviceVec::upload(&client, &as_words(&codes));
    let scales = DeviceVec::upload(&client, &as_words(&scales));
    let view = windowed(&client, &w, rows, cols);
    let got = nvfp4_weight_error(&client, &view, &codes, &scales, global)
        .unwrap()
        .download(&client)
        .unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    assert_eq!(bits(&got), bits(&expected));

    // Max calibration's codes, as the host quantizes them.
    let max = Nvfp4Matrix::quantize(&w, rows, cols, global, BlockScales::Max).unwrap();
    let expected: Vec<f32> = w.iter().zip(max.dequantize()).map(|(a, b)| a - b).collect();
    let codes = DeviceVec::upload(&client, &as_words(&max.codes()));
    let scales = DeviceVec::upload(&client, &as_words(&max.block_scales));
    let got = nvfp4_weight_error(&client, &view, &codes, &scales, global)
        .unwrap()
        .download(&client)
        .unwrap();
    assert_eq!(got, expected);

    // The diagonal error row by row, without `W − Q`: the host's sums up to f32 rounding.
    let diag: Vec<f32> = (0..cols).map(|j| (j % 5) as f32 * 0.3).collect();
    let rows_error = nvfp4_diagonal_error(
        &client,
        &view,
        &codes,
        &scales,
        &DeviceVec::upload(&client, &diag),
        global,
    )
    .unwrap();
    assert_eq!(rows_error.len(), rows);
    for (r, &got) in rows_error.iter().enumerate() {
        let span = r * cols..(r + 1) * cols;
        let expected: f64 = expected[span]
            .iter()
            .zip(&diag)
            .map(|(&d, &h)| f64::from(h) * f64::from(d) * f64::from(d))
            .sum();
        let tol = 1e-5 * expected.abs().max(1e-12);
        assert!(
            (f64::from(got) - expected).abs() <= tol,
            "row {r}: {got} vs {expected}"
        );
    }
    assert!(matches!(
        nvfp4_diagonal_error(
            &client,
            &view,
            &codes,
            &scales,
            &DeviceVec::upload(&client, &diag[1..]),
            global
        ),
        Err(KernelError::Shape { .. })
    ));

    let short = view.window(0, 0, rows, cols - 16).unwrap();
    assert!(matches!(
        nvfp4_weight_error(&client, &short, &codes, &scales, global),
        Err(KernelError::Shape { .. })
    ));
}
