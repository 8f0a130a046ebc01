//! Renders `quantization_report.html` again from a checkpoint's `quantization_report.json`,
//! with the results of `eval_quant --json` and `drift --json` when given (their tables and
//! plots are added to the page):
//!
//! ```sh
//! cargo run --release --example eval_quant -- fixtures/tiny-sala-trained OUT --json eval.json
//! cargo run --release --example drift -- fixtures/tiny-sala-trained OUT --max-len 2048 --json drift.json
//! cargo run --release --example render_report -- --report OUT/quantization_report.json \
//!     --eval eval.json --drift drift.json --out OUT/quantization_report.html
//! ```
//!
//! Every input is read and checked before anything is written; an error names the file.

use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(about = "Render the HTML quantization report from quantization_report.json")]
struct Args {
    /// quantization_report.json of a run.
    #[arg(long)]
    report: PathBuf,
    /// JSON of `eval_quant --json` (perplexity, KL, top-1 per length).
    #[arg(long)]
    eval: Option<PathBuf>,
    /// JSON of `drift --json` (GLA state drift).
    #[arg(long)]
    drift: Option<PathBuf>,
    /// Where to write the page. Default: quantization_report.html next to --report.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match sala_quant::render_report(
        &args.report,
        args.eval.as_deref(),
        args.drift.as_deref(),
        args.out.as_deref(),
    ) {
        Ok(path) => {
            println!("report: {}", path.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
