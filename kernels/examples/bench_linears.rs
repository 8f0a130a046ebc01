//! Benchmark of a layer's linear products on cuBLAS at the MiniCPM-SALA shapes (hidden 4096,
//! 32 query heads and 2 KV heads of 128, MLP 16384), bf16, on random inputs of a fixed seed:
//! what the host's waits between products cost, and what concatenating the weights would save.
//!
//! ```text
//! bench_linears [--tokens 16384] [--reps 5] [--json FILE]
//! ```
//!
//! Per group of weights that read one input (`qkvz`: q, k, v and the output gate; `gate_up`;
//! `o`; `down`), three routes, each the best of `--reps` calls after one untimed call, the
//! device synchronised around each:
//! - `separate`: one `linear_bf16` per weight, each waiting for CubeCL's queue before and for
//!   its product after (what the forward did);
//! - `grouped`: one `linears_bf16`, the products queued back to back between one pair of waits;
//! - `concat`: one `linear_bf16` on the weights stacked into one `[Σ out, in]` matrix.
//!
//! `grouped` must write the same bytes as `separate` (checked: the run fails otherwise);
//! `concat` may pick another cuBLAS algorithm, so its difference is printed, not checked.

use std::process::ExitCode;

use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::*;
use cubecl::server::Handle;
use half::bf16;
use sala_kernels::cuda::{linear_bf16, linears_bf16, Cublas, LinearOutput, LinearShape};
use sala_kernels::KernelError;

#[path = "common/mod.rs"]
mod common;

use common::{download, rel_diff, time, Client};

const USAGE: &str = "usage: bench_linears [--tokens N] [--reps N] [--json FILE]";

/// The groups: name, input features, output features of each weight.
const GROUPS: [(&str, usize, &[usize]); 4] = [
    ("qkvz", 4096, &[4096, 256, 256, 4096]),
    ("gate_up", 4096, &[16384, 16384]),
    ("o", 4096, &[4096]),
    ("down", 16384, &[4096]),
];

struct Args {
    tokens: usize,
    reps: usize,
    json: Option<std::path::PathBuf>,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        tokens: 16384,
        reps: 5,
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--tokens" => args.tokens = value()?.parse().map_err(|_| "bad --tokens")?,
            "--reps" => args.reps = value()?.parse().map_err(|_| "bad --reps")?,
            "--json" => args.json = Some(value()?.into()),
            _ => return Err(USAGE.to_string()),
        }
    }
    if args.tokens == 0 {
        return Err("--tokens must be positive".into());
    }
    Ok(args)
}

/// Deterministic values in [-scale, scale) (SplitMix64), as bf16.
fn random_values(n: usize, seed: u64, scale: f32) -> Vec<bf16> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            let u = ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32;
            bf16::from_f32((2.0 * u - 1.0) * scale)
        })
        .collect()
}

fn upload(client: &Client, values: &[bf16]) -> Handle {
    client.create_from_slice(bytemuck::cast_slice(values))
}

/// One group's three routes: `(route, seconds, max rel. diff to separate)`.
fn bench_group(
    client: &Client,
    blas: &Cublas,
    args: &Args,
    x: &Handle,
    in_features: usize,
    outs: &[usize],
    seed: u64,
) -> Result<Vec<(&'static str, f64, f64)>, String> {
    let tokens = args.tokens;
    let scale = 1.0 / (in_features as f32).sqrt();
    let weights: Vec<Vec<bf16>> = outs
        .iter()
        .enumerate()
        .map(|(i, &o)| random_values(o * in_features, seed + i as u64, scale))
        .collect();
    let w: Vec<Handle> = weights.iter().map(|v| upload(client, v)).collect();
    let stacked = upload(client, &weights.concat());
    let total: usize = outs.iter().sum();
    let y_separate: Vec<Handle> = outs.iter().map(|&o| client.empty(tokens * o * 2)).collect();
    let y_grouped: Vec<Handle> = outs.iter().map(|&o| client.empty(tokens * o * 2)).collect();
    let y_concat = client.empty(tokens * total * 2);
    let err = |e: KernelError| e.to_string();

    let separate = time(client, args.reps, || {
        outs.iter()
            .zip(&w)
            .zip(&y_separate)
            .try_for_each(|((&o, w), y)| {
                let shape = LinearShape {
                    tokens,
                    in_features,
                    out_features: o,
                };
                linear_bf16(client, blas, shape, x, w, y)
            })
    })
    .map_err(err)?;
    let outputs: Vec<LinearOutput> = outs
        .iter()
        .zip(&w)
        .zip(&y_grouped)
        .map(|((&out_features, w), y)| LinearOutput { out_features, w, y })
        .collect();
    let grouped = time(client, args.reps, || {
        linears_bf16(client, blas, tokens, in_features, x, &outputs)
    })
    .map_err(err)?;
    let shape = LinearShape {
        tokens,
        in_features,
        out_features: total,
    };
    let concat = time(client, args.reps, || {
        linear_bf16(client, blas, shape, x, &stacked, &y_concat)
    })
    .map_err(err)?;

    let want: Vec<Vec<f32>> = y_separate.iter().map(|y| download(client, y)).collect();
    for (i, y) in y_grouped.iter().enumerate() {
        if download(client, y) != want[i] {
            return Err(format!("grouped product {i} differs from the separate one"));
        }
    }
    // The stacked product's columns, put back per weight, row by row.
    let got = download(client, &y_concat);
    let mut concat_diff = 0.0f64;
    let mut first = 0;
    for (i, &o) in outs.iter().enumerate() {
        let part: Vec<f32> = (0..tokens)
            .flat_map(|t| {
                got[t * total + first..t * total + first + o]
                    .iter()
                    .copied()
            })
            .collect();
        concat_diff = concat_diff.max(rel_diff(&part, &want[i]));
        first += o;
    }
    Ok(vec![
        ("separate", separate, 0.0),
        ("grouped", grouped, 0.0),
        ("concat", concat, concat_diff),
    ])
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
    let mut rows = Vec::new();
    let mut failed = false;
    for (g, &(name, in_features, outs)) in GROUPS.iter().enumerate() {
        let x = upload(
            &client,
            &random_values(args.tokens * in_features, 100 + g as u64, 1.0),
        );
        let flop =
            2.0 * args.tokens as f64 * in_features as f64 * outs.iter().sum::<usize>() as f64;
        match bench_group(&client, &blas, &args, &x, in_features, outs, 10 * g as u64) {
            Ok(routes) => {
                for (route, s, diff) in routes {
                    println!(
                        "{name:>8} {route:<9} {:>8.3} ms {:>6.1} TFLOP/s  diff vs separate {diff:.1e}",
                        s * 1e3,
                        flop / s / 1e12
                    );
                    rows.push(format!(
                        "{{\"group\":\"{name}\",\"route\":\"{route}\",\"seconds\":{s},\"tflops\":{},\"max_rel_diff_vs_separate\":{diff}}}",
                        flop / s / 1e12
                    ));
                }
            }
            Err(e) => {
                println!("{name:>8} FAILED: {e}");
                failed = true;
            }
        }
    }
    if let Some(path) = &args.json {
        let json = format!(
            "{{\"tokens\":{},\"reps\":{},\"rows\":[{}]}}\n",
            args.tokens,
            args.reps,
            rows.join(",")
        );
        if let Err(e) = std::fs::write(path, json) {
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
