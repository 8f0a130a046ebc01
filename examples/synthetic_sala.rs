//! Times the quantization pipeline's stages on a full-size MiniCPM-SALA with random weights
//! (the released config, weights `N(0, 0.02)` generated on the device from `--seed`, random
//! token ids), processing the first `--layers` layers without writing a checkpoint, and projects
//! a full run (1.83M calibration tokens, all layers) from them:
//!
//! ```sh
//! cargo run --release --example synthetic_sala -- --layers 2 --samples 2 --seq-len 256
//! cargo build --release --features cuda --example synthetic_sala
//! target/release/examples/synthetic_sala --device cuda --layers 4 --samples 8 --seq-len 4096
//! ```

use clap::Parser;
use sala_quant::synthetic_cli::{run, Args};
use std::process::ExitCode;

fn main() -> ExitCode {
    sala_quant::allocator::reuse_freed_memory();
    match run(Args::parse()) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
