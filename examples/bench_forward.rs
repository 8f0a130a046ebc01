//! Times one layer of each kind of the released MiniCPM-SALA configuration (random weights) on
//! packs of short samples and on one long sample — weight upload per layer apart from the
//! capture and propagate passes per token — and projects the production calibration run's
//! forward passes (96 samples, 1.83M tokens) from them:
//!
//! ```sh
//! cargo run --release --example bench_forward -- --config fixtures/tiny-sala/config.json
//! cargo build --release --features cuda --example bench_forward
//! target/release/examples/bench_forward --device cuda --json forward.json --dump dump/
//! ```

use clap::Parser;
use sala_quant::forward_cli::{run, Args};
use std::process::ExitCode;

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
