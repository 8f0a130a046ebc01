//! `HopperAttention` (CUDA only: `wgmma`, compiled by NVRTC for sm_90a) against the f64
//! reference of the attention tests, on bf16-rounded inputs: varlen packs whose sequences end
//! inside a 128-key tile and inside a block, several tiles, GQA groups that do and do not
//! divide a block's 128 rows, scores growing along the sequence (the online rescaling), and a
//! pack equal to each sequence alone; the gated run against the gate kernel. On a CUDA device
//! other than compute capability 9.0 the constructor refuses with `Unsupported` (any other
//! error fails) and the tests stop with a notice.

use half::bf16;
use sala_kernels::cuda::HopperAttention;
use sala_kernels::gates::sigmoid_gate;
use sala_kernels::{AttentionShape, KernelError};

use crate::attention::{offsets_of, reference, rel_error, shape, Inputs};
use crate::common::{client, Rng, TestRuntime};
use crate::flash_attention::{
    bf16_inputs, check_growing_scores, check_packed_equals_alone, run_with, upload_bf16, TOLERANCE,
};

type Client = cubecl::prelude::ComputeClient<TestRuntime>;

/// The kernel on device 0, or `None` (with a notice) where the device is not a Hopper.
fn kernel() -> Option<HopperAttention> {
    match HopperAttention::new(0) {
        Ok(kernel) => Some(kernel),
        Err(KernelError::Unsupported { what, detail }) => {
            eprintln!("NOTICE: Hopper attention not tested: {what}: {detail}");
            None
        }
        Err(e) => panic!("Hopper attention failed to build: {e}"),
    }
}

fn run(
    client: &Client,
    kernel: &HopperAttention,
    shape: &AttentionShape,
    offsets: &[usize],
    x: &Inputs,
) -> Vec<f32> {
    run_with(client, x, |q, k, v, out| {
        kernel.run(client, shape, offsets, [q, k, v, out])
    })
    .unwrap()
}

#[test]
fn matches_the_reference_on_varlen_packs_and_head_configs() {
    let (Some(client), Some(kernel)) = (client(), kernel()) else {
        return;
    };
    let mut rng = Rng::new(81);
    // Ends inside a key tile (128) and inside a block, several tiles, one token, equal lengths.
    let packs: [&[usize]; 5] = [&[1, 37, 130, 64], &[300], &[5, 5, 5], &[1], &[129, 700]];
    // (heads, kv_heads): the model's group of 16, MHA, a group of 3 (blocks cut tokens in
    // the middle of their heads), a group of 8, a group of 32 (4 tokens per block).
    let configs = [(32, 2), (4, 4), (6, 2), (8, 1), (32, 1)];
    for (heads, kv_heads) in configs {
        for lengths in packs {
            let shape = shape(heads, kv_heads, 128);
            let offsets = offsets_of(lengths);
            let x = bf16_inputs(Inputs::random(&mut rng, &shape, *offsets.last().unwrap()));
            let got = run(&client, &kernel, &shape, &offsets, &x);
            let (want, _) = reference(&shape, &offsets, &x);
            let err = rel_error(&got, &want);
            assert!(
                err < TOLERANCE,
                "heads {heads} kv {kv_heads} lengths {lengths:?}: error {err:e}"
            );
        }
    }
}

#[test]
fn every_unit_is_computed_when_each_block_takes_several() {
    // 2,400 tokens of 16 query heads per KV head: 600 units of 128 rows for at most one block
    // per multiprocessor, so every block takes several from the counter; run twice, since
    // the second launch relies on the first having set the counter back.
    let (Some(client), Some(kernel)) = (client(), kernel()) else {
        return;
    };
    let mut rng = Rng::new(85);
    let shape = shape(32, 2, 128);
    let offsets = offsets_of(&[1500, 900]);
    let x = bf16_inputs(Inputs::random(&mut rng, &shape, *offsets.last().unwrap()));
    let (want, _) = reference(&shape, &offsets, &x);
    let first = run(&client, &kernel, &shape, &offsets, &x);
    let second = run(&client, &kernel, &shape, &offsets, &x);
    let err = rel_error(&first, &want);
    assert!(err < TOLERANCE, "error {err:e}");
    assert_eq!(first, second, "a second launch computes the same outputs");
}

#[test]
fn growing_scores_rescale_the_output_exactly_enough() {
    // 600 tokens: five key tiles, each row's maximum rising in every one.
    let (Some(client), Some(kernel)) = (client(), kernel()) else {
        return;
    };
    let launch = |shape: &AttentionShape, offsets: &[usize], x: &Inputs| {
        run(&client, &kernel, shape, offsets, x)
    };
    check_growing_scores(&launch, 82, 600, 1.0 / 25.0, 100.0);
}

#[test]
fn slowly_growing_scores_keep_and_then_move_the_maxima() {
    // Scores rising by a few units (base 2, scaled) per 128-key tile: every row's maximum
    // moves by small steps, tile after tile, over one sequence of nine tiles. Under the
    // kernel's lazy rescaling (threshold 2^8, `RESCALE_THRESHOLD`) a row keeps a stale
    // maximum for a tile or so (probabilities up to 2^8) and then moves it.
    let (Some(client), Some(kernel)) = (client(), kernel()) else {
        return;
    };
    let launch = |shape: &AttentionShape, offsets: &[usize], x: &Inputs| {
        run(&client, &kernel, shape, offsets, x)
    };
    check_growing_scores(&launch, 84, 1100, 1.0 / 400.0, 30.0);
}

#[test]
fn a_packed_run_equals_each_sequence_alone_bit_for_bit() {
    let (Some(client), Some(kernel)) = (client(), kernel()) else {
        return;
    };
    let launch = |shape: &AttentionShape, offsets: &[usize], x: &Inputs| {
        run(&client, &kernel, shape, offsets, x)
    };
    check_packed_equals_alone(&launch, 83, &[3, 190, 17]);
}

#[test]
fn refuses_other_head_dims_and_scales() {
    let (Some(client), Some(kernel)) = (client(), kernel()) else {
        return;
    };
    let mut rng = Rng::new(84);
    for (d, scale) in [(64, 0.125), (128, -0.1)] {
        let mut shape = shape(4, 2, d);
        shape.scale = scale;
        let x = bf16_inputs(Inputs::random(&mut rng, &shape, 8));
        let refused = run_with(&client, &x, |q, k, v, out| {
            kernel.run(&client, &shape, &[0, 8], [q, k, v, out])
        });
        assert!(
            matches!(refused, Err(KernelError::Unsupported { .. })),
            "d {d} scale {scale}: {refused:?}"
        );
    }
}

#[test]
fn a_timed_run_writes_the_same_output_and_a_positive_kernel_time() {
    let (Some(client), Some(kernel)) = (client(), kernel()) else {
        return;
    };
    let mut rng = Rng::new(85);
    let shape = shape(32, 2, 128);
    let offsets = offsets_of(&[200, 57]);
    let x = bf16_inputs(Inputs::random(&mut rng, &shape, 257));
    let plain = run(&client, &kernel, &shape, &offsets, &x);
    let mut seconds = 0.0;
    let timed = run_with(&client, &x, |q, k, v, out| {
        seconds = kernel.run_timed(&client, &shape, &offsets, [q, k, v, out])?;
        Ok(())
    })
    .unwrap();
    assert_eq!(
        plain, timed,
        "the timed launch computes what the plain one does"
    );
    assert!(
        seconds > 0.0 && seconds < 10.0,
        "kernel time by events: {seconds} s"
    );
    assert!(
        !kernel.ptx().is_empty() && kernel.ptx().contains("wgmma"),
        "the kept PTX is the kernel's"
    );
}

#[test]
fn a_gated_run_equals_the_output_gated_by_the_gate_kernel() {
    let (Some(client), Some(kernel)) = (client(), kernel()) else {
        return;
    };
    let mut rng = Rng::new(83);
    let shape = shape(32, 2, 128);
    let offsets = offsets_of(&[1, 200, 77]);
    let x = bf16_inputs(Inputs::random(&mut rng, &shape, *offsets.last().unwrap()));
    let len = x.q.len();
    // Gates of both signs, up to σ's flat ends.
    let gate: Vec<f32> = (0..len).map(|_| 4.0 * rng.normal()).collect();
    let plain = run(&client, &kernel, &shape, &offsets, &x);
    let want = {
        let (a, g) = (upload_bf16(&client, &plain), upload_bf16(&client, &gate));
        let out = client.empty(len * 2);
        sigmoid_gate::<TestRuntime, bf16>(&client, &a, &g, &out, len).unwrap();
        let bytes = client.read_one(out).unwrap();
        bytemuck::cast_slice::<u8, bf16>(&bytes)
            .iter()
            .map(|x| x.to_f32())
            .collect::<Vec<f32>>()
    };
    let got = run_with(&client, &x, |q, k, v, out| {
        let g = upload_bf16(&client, &gate);
        kernel.run_gated(&client, &shape, &offsets, [q, k, v, out], &g)
    })
    .unwrap();
    // The same bf16 values, but where the two exp/ln implementations round σ(g) to
    // neighbouring bf16 values: then one ulp of the product apart, and rare.
    let mut differing = 0;
    for (i, (&a, &b)) in got.iter().zip(&want).enumerate() {
        if a != b {
            differing += 1;
            assert!(
                (a - b).abs() <= b.abs() * 2f32.powi(-7) * 1.01,
                "element {i}: gated {a}, gate kernel {b}"
            );
        }
    }
    assert!(
        differing * 100 <= len,
        "{differing} of {len} elements differ"
    );
    // The gate was applied: most outputs moved.
    let unchanged = got.iter().zip(&plain).filter(|(a, b)| a == b).count();
    assert!(unchanged * 2 < len, "{unchanged} of {len} outputs ungated");
}
