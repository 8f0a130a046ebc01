//! Times the calibration mathematics on the MiniCPM-SALA linear shapes (CPU, all rayon threads):
//! Hessian accumulation of 8192 tokens, the damped Cholesky inverse, the GPTQ solve, the proxy
//! error, the NVFP4 block-scale search (120 candidates), and the GPTQ "floor" (one in×in
//! Cholesky plus one out×in×in product on faer) next to the solve.
//!
//! `cargo run --release --example bench_hessian [-- --quick] [-- --f64 [--f32-products]]`

use std::time::Instant;

use clap::Parser;
use rayon::prelude::*;
use sala_formats::nvfp4::global_scale_from_amax;
use sala_hessian::faer::dyn_stack::{MemBuffer, MemStack};
use sala_hessian::faer::linalg::cholesky::llt::factor::{
    cholesky_in_place, cholesky_in_place_scratch,
};
use sala_hessian::faer::linalg::matmul::matmul;
use sala_hessian::faer::{Accum, Mat, MatRef, Par};
use sala_hessian::{
    CholeskyInverse, Damping, Gptq, GptqConfig, Hessian, HessianAccumulator, HessianScalar,
    Normalization, Nvfp4BlockSearch, Rtn,
};
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// Quarter-size shapes and 2048 tokens (a quick smoke run).
    #[arg(long)]
    quick: bool,
    /// Keep the Hessian and its factorization in f64 (default f32).
    #[arg(long)]
    f64: bool,
    /// With --f64: multiply each 512-token chunk in f32 and sum the chunks in f64 (the
    /// pipeline's host statistics).
    #[arg(long, requires = "f64")]
    f32_products: bool,
}

/// (name, out_features, in_features) of the SALA linears.
const SHAPES: [(&str, usize, usize); 3] = [
    ("q/k/v/o 4096x4096", 4096, 4096),
    ("gate/up 16384x4096", 16384, 4096),
    ("down 4096x16384", 4096, 16384),
];

/// Deterministic filler data in [-1, 1): a multiplicative hash of the index (timing only).
fn filler(seed: u64, i: usize) -> f32 {
    let h = (i as u64 ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ((h >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn matrix(seed: u64, len: usize, scale: f32) -> Vec<f32> {
    (0..len)
        .into_par_iter()
        .map(|i| filler(seed, i) * scale)
        .collect()
}

fn seconds<R>(f: impl FnOnce() -> R) -> (R, f64) {
    let start = Instant::now();
    let r = f();
    (r, start.elapsed().as_secs_f64())
}

fn plain_cholesky<T: HessianScalar>(h: &Hessian<T>) -> f64 {
    let n = h.dim();
    let mut a = h.as_mat().to_owned();
    for i in 0..n {
        a[(i, i)] += T::from_f64(1e-2);
    }
    let par = Par::rayon(0);
    let mut mem = MemBuffer::new(cholesky_in_place_scratch::<T>(n, par, Default::default()));
    let start = Instant::now();
    cholesky_in_place(
        a.as_mut(),
        Default::default(),
        par,
        MemStack::new(&mut mem),
        Default::default(),
    )
    .expect("damped Hessian factors");
    start.elapsed().as_secs_f64()
}

fn floor_matmul(w: &[f32], out: usize, inp: usize, rhs: MatRef<'_, f32>) -> f64 {
    let mut dst = Mat::<f32>::zeros(out, inp);
    let start = Instant::now();
    matmul(
        dst.as_mut(),
        Accum::Replace,
        MatRef::from_row_major_slice(w, out, inp),
        rhs,
        1.0,
        Par::rayon(0),
    );
    start.elapsed().as_secs_f64()
}

fn bench_shape<T: HessianScalar>(
    name: &str,
    out: usize,
    inp: usize,
    tokens: usize,
    f32_products: bool,
) -> serde_json::Value {
    let x = matrix(1, tokens * inp, 1.0);
    let mut acc = HessianAccumulator::<T>::new(inp, Normalization::PerSample).expect("dim > 0");
    if f32_products {
        acc = acc.with_f32_products();
    }
    let ((), accumulate_s) = seconds(|| acc.add_sample(&x, tokens).expect("finite batch"));
    drop(x);
    let h = acc.finalize().expect("one sample");
    drop(acc);
    let accumulate_gflops = (tokens * inp * (inp + 1)) as f64 / accumulate_s / 1e9;

    let cholesky_s = plain_cholesky(&h);
    let (inverse, inverse_s) =
        seconds(|| CholeskyInverse::new(&h, &Damping::default()).expect("damped"));

    let w = matrix(2, out * inp, 0.02);
    let no_proxy = GptqConfig {
        proxy_error: false,
        ..GptqConfig::default()
    };
    let (gptq, gptq_s) = seconds(|| {
        Gptq::new(no_proxy)
            .unwrap()
            .solve(&w, out, inp, &h)
            .expect("solve")
    });
    let rtn = Rtn::new(no_proxy.grid).unwrap();
    let (_, rtn_s) = seconds(|| rtn.quantize::<T>(&w, out, inp, None).unwrap());
    let (rtn_h, rtn_proxy_s) = seconds(|| rtn.quantize(&w, out, inp, Some(&h)).unwrap());
    let proxy_s = rtn_proxy_s - rtn_s;

    let matmul_s = floor_matmul(&w, out, inp, inverse.upper());
    let floor_s = cholesky_s + matmul_s;

    let diag: Vec<f32> = h.diagonal().into_iter().map(|v| v.into() as f32).collect();
    let amax = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let global = global_scale_from_amax(amax).unwrap();
    let (_, nvfp4_s) = seconds(|| {
        Nvfp4BlockSearch::default()
            .search(&w, out, inp, &diag, global)
            .expect("valid block search input")
    });
    println!(
        "| {name} | {tokens} | {accumulate_s:.2} | {accumulate_gflops:.1} | {cholesky_s:.2} | {inverse_s:.2} | \
         {gptq_s:.2} | {proxy_s:.2} | {floor_s:.2} ({cholesky_s:.2} + {matmul_s:.2}) | {:.2} | {nvfp4_s:.2} |",
        gptq_s / floor_s
    );
    json!({
        "shape": name, "out": out, "in": inp, "tokens": tokens,
        "accumulate_s": accumulate_s, "accumulate_gflops": accumulate_gflops,
        "cholesky_s": cholesky_s, "damped_inverse_s": inverse_s,
        "gptq_solve_s": gptq_s, "proxy_error_s": proxy_s,
        "floor_s": floor_s, "floor_matmul_s": matmul_s, "gptq_over_floor": gptq_s / floor_s,
        "nvfp4_search_s": nvfp4_s,
        "gptq_ist_loss": gptq.loss, "rtn_proxy_error": rtn_h.proxy_error,
    })
}

fn main() {
    let args = Args::parse();
    let (div, tokens) = if args.quick { (4, 2048) } else { (1, 8192) };
    println!(
        "threads: {}, hessian precision: {}",
        rayon::current_num_threads(),
        match (args.f64, args.f32_products) {
            (true, true) => "f64 (f32 chunk products)",
            (true, false) => "f64",
            _ => "f32",
        }
    );
    println!(
        "| shape | tokens | H accumulate s | GFLOP/s (t·n(n+1)) | Cholesky s | damped inverse s | GPTQ solve s | \
         proxy error s | floor s (chol + matmul) | solve / floor | NVFP4 search s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let rows: Vec<_> = SHAPES
        .iter()
        .map(|&(name, out, inp)| {
            let (out, inp) = (out / div, inp / div);
            if args.f64 {
                bench_shape::<f64>(name, out, inp, tokens, args.f32_products)
            } else {
                bench_shape::<f32>(name, out, inp, tokens, false)
            }
        })
        .collect();
    println!(
        "{}",
        serde_json::to_string_pretty(
            &json!({ "threads": rayon::current_num_threads(), "results": rows })
        )
        .unwrap()
    );
}
