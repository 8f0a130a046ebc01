//! Quantizes a MiniCPM-SALA (or Llama) model directory with the GPTQ W4A16 or the NVFP4 recipe.
//!
//! With no arguments it quantizes the bundled `fixtures/tiny-sala` with the bundled calibration
//! set into `target/quantized/tiny-sala-<recipe>`, prints the report and verifies the output:
//!
//! ```sh
//! cargo run --release --example quantize_sala
//! cargo run --release --example quantize_sala -- --recipe nvfp4
//! cargo run --release --example quantize_sala -- --plan-only
//! ```

use clap::Parser;
use sala_quant::quantize_cli::{run, Args};
use std::process::ExitCode;

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
