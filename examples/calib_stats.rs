//! Prints the coverage report of a calibration JSONL file as the quantizer would see it:
//! samples, tokens, length buckets, token uniqueness and the minicpm4 `dense_len` check.
//!
//! ```text
//! cargo run --release --example calib_stats -- fixtures/calib/calib.jsonl fixtures/tiny-sala
//! cargo run --release --example calib_stats -- calib.jsonl /models/MiniCPM-SALA --max-samples 96 --json
//! ```
//!
//! The model directory provides `tokenizer.json`, the chat template (for `messages` records) and
//! `config.json`'s `sparse_config.dense_len` (overridden by `--dense-len`).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use sala_calib::{model_dense_len, CalibOptions, CalibSet, CalibStats, CalibTokenizer};

#[derive(Parser)]
#[command(about = "Coverage report of a calibration JSONL file")]
struct Args {
    /// Calibration JSONL (`question`, `text` or `messages` per line).
    file: PathBuf,
    /// Model directory with `tokenizer.json` (and optionally a chat template and `config.json`).
    model_dir: PathBuf,
    /// Truncate samples to this many tokens (keeping the head).
    #[arg(long, default_value_t = 131_072)]
    max_len: usize,
    /// Use this many samples (the first ones, repeated cyclically if the file has fewer);
    /// default: every record once.
    #[arg(long)]
    max_samples: Option<usize>,
    /// Report samples with at least this many tokens (default: the model's
    /// `sparse_config.dense_len`, if any).
    #[arg(long)]
    dense_len: Option<usize>,
    /// Skip malformed lines (they are counted) instead of stopping at the first.
    #[arg(long)]
    skip_malformed: bool,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let tokenizer = CalibTokenizer::from_model_dir(&args.model_dir)?;
    let dense_len = match args.dense_len {
        Some(limit) => Some(limit),
        None => model_dense_len(&args.model_dir)?,
    };
    let options = CalibOptions {
        max_len: args.max_len,
        max_samples: args.max_samples,
        skip_malformed: args.skip_malformed,
    };
    let set = CalibSet::load(&args.file, &tokenizer, &options)?;
    let stats = CalibStats::of(&set, dense_len);
    // Written rather than printed so a closed pipe (`| head`) is an error, not a panic.
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &stats)?;
        writeln!(out)?;
    } else {
        write!(out, "{stats}")?;
    }
    Ok(())
}
