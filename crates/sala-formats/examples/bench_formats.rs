//! Throughput of the format codecs on a 4096×16384 f32 matrix (a SALA `down_proj`), single- and
//! multi-threaded: NVFP4 quantize + pack (max calibration), and INT4 group-128 RTN quantize +
//! AutoGPTQ `qweight` packing. Figures are GB/s of f32 input (4 bytes per weight).
//!
//! `cargo run --release -p sala-formats --example bench_formats [-- --rows 4096 --cols 16384 --repeats 3]`

use clap::Parser;
use rayon::prelude::*;
use sala_formats::gptq_pack::pack_qweight_rows_into;
use sala_formats::nvfp4::{global_scale_from_amax, quantize_rows_into};
use sala_formats::{quantize_groupwise, IntQuantizer, IntScheme, QuantParams, NVFP4_BLOCK};
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Output features (rows).
    #[arg(long, default_value_t = 4096)]
    rows: usize,
    /// Input features (columns).
    #[arg(long, default_value_t = 16384)]
    cols: usize,
    /// Timed repetitions (the best is reported).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
}

/// One task's rows: index, weights, block scales, packed codes.
type RowChunk<'a> = (usize, ((&'a [f32], &'a mut [u8]), &'a mut [u8]));

/// Rows handed to one rayon task.
const ROWS_PER_TASK: usize = 64;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let (rows, cols) = (args.rows, args.cols);
    let weights = random_matrix(rows * cols);
    let gbytes = (rows * cols * 4) as f64 / 1e9;
    let amax = weights.iter().fold(0f32, |m, v| m.max(v.abs()));
    let global = global_scale_from_amax(amax)?;
    let quantizer = IntQuantizer::new(4, IntScheme::SymmetricIst)?;
    let threads = rayon::current_num_threads();

    let mut table = Vec::new();
    for parallel in [false, true] {
        let nvfp4 = best_of(args.repeats, || {
            nvfp4_quantize(&weights, cols, global, parallel)
        })?;
        let gptq = best_of(args.repeats, || {
            int4_quantize_and_pack(&weights, rows, cols, quantizer, parallel)
        })?;
        let label = if parallel {
            format!("{threads} threads")
        } else {
            "1 thread".into()
        };
        table.push((label.clone(), "NVFP4 quantize+pack", nvfp4, gbytes / nvfp4));
        table.push((label, "INT4 g128 RTN + qweight pack", gptq, gbytes / gptq));
    }
    println!(
        "matrix {rows}x{cols} f32 ({gbytes:.3} GB), best of {}",
        args.repeats
    );
    println!("| threads | operation | seconds | GB/s of f32 input |");
    println!("|---|---|---|---|");
    for (t, op, s, gbs) in table {
        println!("| {t} | {op} | {s:.3} | {gbs:.2} |");
    }
    Ok(())
}

fn nvfp4_quantize(
    w: &[f32],
    cols: usize,
    global: f32,
    parallel: bool,
) -> Result<(), sala_formats::FormatError> {
    let mut scales = vec![0u8; w.len() / NVFP4_BLOCK];
    let mut packed = vec![0u8; w.len() / 2];
    let chunk = ROWS_PER_TASK * cols;
    let job = |(i, ((wc, sc), pc)): RowChunk<'_>| {
        quantize_rows_into(wc, cols, global, i * ROWS_PER_TASK, true, sc, pc)
    };
    if parallel {
        w.par_chunks(chunk)
            .zip(scales.par_chunks_mut(chunk / NVFP4_BLOCK))
            .zip(packed.par_chunks_mut(chunk / 2))
            .enumerate()
            .try_for_each(job)?;
    } else {
        w.chunks(chunk)
            .zip(scales.chunks_mut(chunk / NVFP4_BLOCK))
            .zip(packed.chunks_mut(chunk / 2))
            .enumerate()
            .try_for_each(job)?;
    }
    std::hint::black_box((&scales, &packed));
    Ok(())
}

fn int4_quantize_and_pack(
    w: &[f32],
    rows: usize,
    cols: usize,
    quantizer: IntQuantizer,
    parallel: bool,
) -> Result<(), sala_formats::FormatError> {
    let quantize_chunk =
        |wc: &[f32]| -> Result<(Vec<u8>, Vec<QuantParams>), sala_formats::FormatError> {
            let q = quantize_groupwise(wc, wc.len() / cols, cols, 128, quantizer)?;
            Ok((q.codes, q.params))
        };
    let parts: Vec<_> = if parallel {
        w.par_chunks(ROWS_PER_TASK * cols)
            .map(quantize_chunk)
            .collect::<Result<_, _>>()?
    } else {
        w.chunks(ROWS_PER_TASK * cols)
            .map(quantize_chunk)
            .collect::<Result<_, _>>()?
    };
    let codes: Vec<u8> = parts.into_iter().flat_map(|(c, _)| c).collect();
    let mut qweight = vec![0i32; cols / 8 * rows];
    let words_per_task = 16;
    if parallel {
        qweight
            .par_chunks_mut(words_per_task * rows)
            .enumerate()
            .try_for_each(|(i, dst)| {
                pack_qweight_rows_into(&codes, rows, cols, 4, i * words_per_task, dst)
            })?;
    } else {
        pack_qweight_rows_into(&codes, rows, cols, 4, 0, &mut qweight)?;
    }
    std::hint::black_box(&qweight);
    Ok(())
}

fn best_of<E>(repeats: usize, mut f: impl FnMut() -> Result<(), E>) -> Result<f64, E> {
    let mut best = f64::INFINITY;
    for _ in 0..repeats.max(1) {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Deterministic pseudo-random weights in [-1, 1) with a few larger outliers.
fn random_matrix(n: usize) -> Vec<f32> {
    let mut s = 0x5EED_u64;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            if i % 997 == 0 {
                8.0 * u
            } else {
                u
            }
        })
        .collect()
}
