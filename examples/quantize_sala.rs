//! Quantizes a MiniCPM-SALA (or Llama) model directory with the GPTQ W4A16 or the NVFP4 recipe.
//!
//! With no arguments it quantizes the bundled `fixtures/tiny-sala-trained` with the bundled
//! calibration set into `target/quantized/tiny-sala-trained-<recipe>`, prints the report and
//! verifies the output:
//!
//! ```sh
//! cargo run --release --example quantize_sala
//! cargo run --release --example quantize_sala -- --recipe nvfp4
//! cargo run --release --example quantize_sala -- --plan-only
//! ```
//!
//! On an NVIDIA GPU (bf16 on burn-cuda; GPTQ solves there, `--host-solver` on the host). The
//! run plans its device memory before any compute: the budget is the GPU's free memory at
//! start less 5 % (or `--max-device-memory MB`), packs shrink to fit it, the hidden states stay
//! on the device when they fit beside the largest pack, and a sample too long for it is
//! refused, naming its line; the plan is printed (also with `--plan-only`):
//!
//! ```sh
//! cargo build --release --features cuda --example quantize_sala
//! target/release/examples/quantize_sala --device cuda --input MODEL_DIR --output OUT_DIR
//! ```

use std::process::ExitCode;

fn main() -> ExitCode {
    sala_quant::quantize_cli::main(std::env::args_os())
}
