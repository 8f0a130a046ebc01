//! H200 benchmark of causal GQA attention at the MiniCPM-SALA shape (32 query heads over 2 KV
//! heads, head_dim 128, bf16): the tensor-core flash kernel (`flash_attention_bf16`, at each
//! plane count), the Hopper kernel (`cuda::HopperAttention`, where the device is compute
//! capability 9.0), the cuBLAS-blocked route (`blocked_causal_attention_bf16`) and the portable
//! FMA kernel (`causal_gqa_attention`, short packs only), on random inputs of a fixed seed.
//!
//! ```text
//! bench_attention [--cases 16x1024,1x16384,1x131072] [--reps 3] [--planes 4,8] [--json FILE]
//!                 [--dump-ptx FILE]
//! ```
//!
//! The Hopper route is timed twice: `hopper` by the wall clock around the synchronised call
//! like the others, `hopper_events` by CUDA events around the kernel alone, and the call's
//! host steps are timed one by one (`hopper call parts`). `--dump-ptx` writes the PTX the
//! Hopper kernel was loaded from (for `bench/flash_sm90.py --module`).
//!
//! Per case and route: best seconds of `--reps` calls after one untimed call (device
//! synchronised around each), TFLOP/s of the causal work (`4·d·heads·Σ T(T+1)/2`), and
//! `max |route − blocked| / max |blocked|` against the cuBLAS route, which computes the same
//! function with f32 scores and a bf16 `P` (the f64 reference of the kernel tests is too slow
//! at these lengths).

use std::process::ExitCode;
use std::time::Instant;

use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::*;
use cubecl::server::Handle;
use half::bf16;
use sala_kernels::attention::{causal_gqa_attention, AttentionShape};
use sala_kernels::cuda::{
    blocked_causal_attention_bf16, handle_ptr, sync_client, Cublas, HopperAttention,
};
use sala_kernels::flash_attention::flash_attention_bf16_with;
use sala_kernels::KernelError;

#[path = "common/mod.rs"]
mod common;

use common::{download, rel_diff, sync, time, Client};

const USAGE: &str =
    "usage: bench_attention [--cases COUNTxLEN,...] [--reps N] [--planes P,...] [--json FILE] [--dump-ptx FILE]";

struct Args {
    cases: Vec<(usize, usize)>,
    reps: usize,
    planes: Vec<usize>,
    json: Option<std::path::PathBuf>,
    dump_ptx: Option<std::path::PathBuf>,
}

fn parse_list<T: std::str::FromStr>(s: &str, what: &str) -> Result<Vec<T>, String> {
    s.split(',')
        .map(|x| x.trim().parse().map_err(|_| format!("bad {what} '{x}'")))
        .collect()
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        cases: vec![(16, 1024), (1, 16384), (1, 131072)],
        reps: 3,
        planes: vec![4, 8],
        json: None,
        dump_ptx: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--cases" => {
                args.cases = value()?
                    .split(',')
                    .map(|c| {
                        let (n, t) = c.split_once('x').ok_or(format!("bad case '{c}'"))?;
                        Ok((
                            n.parse().map_err(|_| format!("bad case '{c}'"))?,
                            t.parse().map_err(|_| format!("bad case '{c}'"))?,
                        ))
                    })
                    .collect::<Result<_, String>>()?
            }
            "--reps" => args.reps = value()?.parse().map_err(|_| "bad --reps".to_string())?,
            "--planes" => {
                let list = value()?;
                // `none` leaves the CubeCL flash kernel out (slow at 131072).
                args.planes = match list.as_str() {
                    "none" => Vec::new(),
                    _ => parse_list(&list, "plane count")?,
                }
            }
            "--json" => args.json = Some(value()?.into()),
            "--dump-ptx" => args.dump_ptx = Some(value()?.into()),
            _ => return Err(USAGE.to_string()),
        }
    }
    Ok(args)
}

/// A deterministic N(0, 1)-ish bf16 buffer (sum of uniforms from SplitMix64).
fn random_bf16(client: &Client, n: usize, seed: u64) -> Handle {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    };
    let values: Vec<bf16> = (0..n)
        .map(|_| bf16::from_f32(((0..4).map(|_| next()).sum::<f32>() - 2.0) * 1.732))
        .collect();
    client.create_from_slice(bytemuck::cast_slice(&values))
}

/// Best microseconds of `reps` runs of `step` after one untimed run.
fn best_micros(
    reps: usize,
    mut step: impl FnMut() -> Result<(), KernelError>,
) -> Result<f64, KernelError> {
    step()?;
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        step()?;
        best = best.min(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(best)
}

/// A CUDA driver error as the kernels crate reports one.
fn driver(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> KernelError {
    move |e| KernelError::Launch {
        what,
        message: e.to_string(),
    }
}

/// Each host step of a Hopper call besides the kernel, best of `reps`: CubeCL's sync with
/// nothing queued, the four device-pointer lookups, and the upload of a work list of this
/// case's size (allocation, pageable copy and free on a stream of its own, as the call makes
/// them), so that `hopper` − `hopper_events` can be split.
fn call_parts(
    client: &Client,
    offsets: &[usize],
    group: usize,
    buffers: [&Handle; 4],
    reps: usize,
) -> Result<String, KernelError> {
    let items: usize = offsets
        .windows(2)
        .map(|w| ((w[1] - w[0]) * group).div_ceil(sala_kernels::cuda::HOPPER_ROWS_PER_BLOCK))
        .sum();
    let work = vec![0u32; 3 * items];
    let stream = cudarc::driver::CudaContext::new(0)
        .map_err(driver("CUDA context"))?
        .new_stream()
        .map_err(driver("CUDA stream"))?;
    sync(client);
    let sync_us = best_micros(reps, || sync_client(client))?;
    let lookups_us = best_micros(reps, || {
        buffers
            .iter()
            .try_for_each(|h| handle_ptr(client, h).map(drop))
    })?;
    let upload_us = best_micros(reps, || {
        drop(
            stream
                .clone_htod(&work)
                .map_err(driver("work list upload"))?,
        );
        stream.synchronize().map_err(driver("stream sync"))
    })?;
    Ok(format!(
        "CubeCL sync {sync_us:.0} µs, 4 pointer lookups {lookups_us:.0} µs, work list of {} KiB uploaded and freed {upload_us:.0} µs",
        work.len() * 4 / 1024
    ))
}

/// The NVRTC library's version as it reports it, or why it could not.
fn nvrtc_version() -> String {
    match sala_kernels::cuda::nvrtc_version() {
        Ok((major, minor)) => format!("{major}.{minor}"),
        Err(why) => why,
    }
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let client = CudaRuntime::client(&CudaDevice::new(0));
    let blas = match Cublas::new(0) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("cuBLAS: {e}");
            return ExitCode::FAILURE;
        }
    };
    let hopper = match HopperAttention::new(0) {
        Ok(kernel) => Some(kernel),
        Err(e) => {
            println!("hopper route not run: {e}");
            None
        }
    };
    println!("NVRTC {}", nvrtc_version());
    if let (Some(path), Some(kernel)) = (&args.dump_ptx, &hopper) {
        if let Err(e) = std::fs::write(path, kernel.ptx()) {
            eprintln!("{}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    let shape = AttentionShape {
        heads: 32,
        kv_heads: 2,
        head_dim: 128,
        scale: 1.0 / (128f32).sqrt(),
    };
    let mut rows = Vec::new();
    let mut failed = false;
    for &(count, len) in &args.cases {
        let tokens = count * len;
        let offsets: Vec<usize> = (0..=count).map(|i| i * len).collect();
        let flop = 4.0 * 128.0 * 32.0 * count as f64 * (len * (len + 1) / 2) as f64;
        let q = random_bf16(&client, tokens * 32 * 128, 1);
        let k = random_bf16(&client, tokens * 2 * 128, 2);
        let v = random_bf16(&client, tokens * 2 * 128, 3);
        let reference = client.empty(tokens * 32 * 128 * 2);
        let case = format!("{count}x{len}");
        let blocked = time(&client, args.reps, || {
            blocked_causal_attention_bf16(&client, &blas, &shape, &offsets, &q, &k, &v, &reference)
        });
        let want = download(&client, &reference);
        let mut report = |route: String,
                          seconds: Result<f64, KernelError>,
                          got: Option<Vec<f32>>| {
            match seconds {
                Ok(s) => {
                    let diff = got.map(|g| rel_diff(&g, &want));
                    println!(
                        "{case:>10} {route:<12} {:>9.3} ms {:>7.1} TFLOP/s  diff vs blocked {}",
                        s * 1e3,
                        flop / s / 1e12,
                        diff.map_or("-".into(), |d| format!("{d:.2e}"))
                    );
                    rows.push(format!(
                        "{{\"case\":\"{case}\",\"route\":\"{route}\",\"seconds\":{s},\"tflops\":{},\"max_rel_diff_vs_blocked\":{}}}",
                        flop / s / 1e12,
                        diff.map_or("null".into(), |d| d.to_string())
                    ));
                }
                Err(e) => {
                    println!("{case:>10} {route:<12} FAILED: {e}");
                    failed = true;
                }
            }
        };
        report("blocked".into(), blocked, None);
        for &planes in &args.planes {
            let out = client.empty(tokens * 32 * 128 * 2);
            let t = time(&client, args.reps, || {
                flash_attention_bf16_with(&client, &shape, &offsets, planes, [&q, &k, &v, &out])
                    .map(|_| ())
            });
            let got = t.as_ref().ok().map(|_| download(&client, &out));
            report(format!("flash_p{planes}"), t, got);
        }
        if let Some(hopper) = &hopper {
            let out = client.empty(tokens * 32 * 128 * 2);
            let t = time(&client, args.reps, || {
                hopper.run(&client, &shape, &offsets, [&q, &k, &v, &out])
            });
            let got = t.as_ref().ok().map(|_| download(&client, &out));
            report("hopper".into(), t, got);
            let mut best = f64::INFINITY;
            let events = (0..args.reps.max(1))
                .map(|_| hopper.run_timed(&client, &shape, &offsets, [&q, &k, &v, &out]))
                .try_for_each(|s| s.map(|s| best = best.min(s)))
                .map(|()| best);
            report("hopper_events".into(), events, None);
            match call_parts(
                &client,
                &offsets,
                shape.group(),
                [&q, &k, &v, &out],
                args.reps,
            ) {
                Ok(parts) => println!("{case:>10} hopper call parts: {parts}"),
                Err(e) => println!("{case:>10} hopper call parts FAILED: {e}"),
            }
        }
        if tokens <= 16384 {
            let out = client.empty(tokens * 32 * 128 * 2);
            let t = time(&client, args.reps, || {
                causal_gqa_attention::<CudaRuntime, bf16>(
                    &client, &shape, &offsets, &q, &k, &v, &out,
                )
            });
            let got = t.as_ref().ok().map(|_| download(&client, &out));
            report("portable".into(), t, got);
        }
    }
    if let Some(path) = &args.json {
        let text = format!("[\n{}\n]\n", rows.join(",\n"));
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("{}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
