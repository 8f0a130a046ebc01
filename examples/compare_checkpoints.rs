//! Compares the quantized linears of two checkpoints of one model (e.g. a GPU-solved run
//! against a `--host-solver` run), reading both with the project's own reader.
//!
//! ```text
//! cargo run --release --example compare_checkpoints -- A B
//! cargo run --release --example compare_checkpoints -- A B --modules 'model\.layers\.[01]\.' \
//!     --min-equal 0.95 --json comparison.json
//! ```
//!
//! Prints one row per linear quantized in both (codes equal, largest code difference, largest
//! relative scale difference, relative Frobenius difference of the dequantized weights), the
//! totals, and the linears quantized in only one of them. Exits 1 when the selected linears
//! differ between the two, or when `--min-equal` is given and a linear's fraction of equal
//! codes is below it; 2 on an error.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use regex::Regex;
use sala_export::compare::{compare_checkpoints, Comparison};
use sala_export::Checkpoint;

#[derive(Parser)]
#[command(about = "Compare the quantized linears of two checkpoints of one model")]
struct Args {
    /// The first checkpoint directory.
    first: PathBuf,
    /// The second checkpoint directory (the reference of the relative differences).
    second: PathBuf,
    /// Only modules whose name matches this regular expression (searched, not anchored).
    #[arg(long)]
    modules: Option<String>,
    /// Fail (exit 1) when a linear's fraction of equal codes is below this (0..=1).
    #[arg(long)]
    min_equal: Option<f64>,
    /// Also write the comparison as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(args: Args) -> Result<bool, Box<dyn std::error::Error>> {
    if let Some(min) = args.min_equal {
        if !(0.0..=1.0).contains(&min) {
            return Err(format!("--min-equal {min}: must lie in 0..=1").into());
        }
    }
    let pattern = match &args.modules {
        Some(p) => Some(Regex::new(p).map_err(|e| format!("--modules {p:?}: {e}"))?),
        None => None,
    };
    let first = Checkpoint::open(&args.first)?;
    let second = Checkpoint::open(&args.second)?;
    let comparison = compare_checkpoints(&first, &second, |module| {
        pattern.as_ref().is_none_or(|p| p.is_match(module))
    })?;
    print_comparison(&comparison);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&comparison)? + "\n")
            .map_err(|e| format!("{}: {e}", path.display()))?;
        println!("comparison written to {}", path.display());
    }
    let below: Vec<&str> = match args.min_equal {
        Some(min) => comparison
            .linears
            .iter()
            .filter(|l| l.equal_fraction() < min)
            .map(|l| l.module.as_str())
            .collect(),
        None => Vec::new(),
    };
    for module in &below {
        println!("below --min-equal: {module}");
    }
    Ok(comparison.same_linears() && below.is_empty() && !comparison.linears.is_empty())
}

fn print_comparison(c: &Comparison) {
    println!(
        "{:<48} {:>6} {:>11} {:>9} {:>10} {:>10}",
        "linear", "format", "equal", "max Δcode", "max Δscale", "rel Δ W"
    );
    for l in &c.linears {
        let code = l
            .max_code_difference
            .map_or("-".to_string(), |d| d.to_string());
        let scale = l
            .max_scale_relative_difference
            .map_or("-".to_string(), |d| format!("{d:.2e}"));
        println!(
            "{:<48} {:>6} {:>10.4}% {:>9} {:>10} {:>10.2e}",
            l.module,
            l.format,
            100.0 * l.equal_fraction(),
            code,
            scale,
            l.relative_weight_difference
        );
    }
    let (equal, total) = c.equal_total();
    println!(
        "{} linears, {equal} of {total} codes equal ({:.4}%)",
        c.linears.len(),
        100.0 * equal as f64 / total.max(1) as f64
    );
    for (what, modules) in [
        ("quantized only in the first", &c.only_in_first),
        ("quantized only in the second", &c.only_in_second),
        ("GPTQ in one, NVFP4 in the other", &c.format_mismatch),
    ] {
        if !modules.is_empty() {
            println!("{what}: {}", modules.join(", "));
        }
    }
}
