//! Checks an exported checkpoint against the rules SGLang and vLLM enforce.
//!
//! ```text
//! cargo run --example verify_checkpoint -- DIR
//! cargo run --example verify_checkpoint -- DIR --target gptq      # torch kernels' shape rules
//! cargo run --example verify_checkpoint -- DIR --dump-dequantized deq.safetensors
//! ```
//!
//! Prints `ok` and a summary (tensors, quantized linears, bytes, bits per weight), or every
//! violation as `[rule] tensor: detail` and exits with status 1; for GPTQ, then one line per
//! known loader saying whether it accepts the checkpoint and why not. `--dump-dequantized` also
//! writes every quantized linear's dequantized weight (`<module>.weight`, F32 `[out, in]`) as
//! our reader computes it, for `scripts/interop` to compare with the Python libraries.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use sala_export::loaders::LoaderTarget;
use sala_export::{Checkpoint, Dtype, ExportError, Tensor};

#[derive(Parser)]
#[command(
    about = "Verify a GPTQ (gptq_marlin or torch kernels) or ModelOpt NVFP4 checkpoint directory"
)]
struct Args {
    /// The checkpoint directory.
    dir: PathBuf,
    /// GPTQ: the loaders whose shape rules apply: marlin (gptq_marlin) or gptq (the torch
    /// kernels, a partial last group allowed).
    #[arg(long, default_value = "marlin", value_parser = parse_target)]
    target: LoaderTarget,
    /// Also write the dequantized weights of every quantized linear to this safetensors file.
    #[arg(long)]
    dump_dequantized: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let report = match sala_export::verify_for(&args.dir, args.target) {
        Ok(report) => report,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    println!("{} ({})", report.dir.display(), report.format);
    println!("{report}");
    for verdict in &report.loaders {
        println!("loads in {verdict}");
    }
    if let Some(out) = &args.dump_dequantized {
        if let Err(e) = dump_dequantized(&args.dir, out) {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
        println!("dequantized weights written to {}", out.display());
    }
    match report.is_ok() {
        true => ExitCode::SUCCESS,
        false => ExitCode::from(1),
    }
}

fn parse_target(text: &str) -> Result<LoaderTarget, String> {
    text.parse()
}

fn dump_dequantized(dir: &Path, out: &Path) -> Result<(), ExportError> {
    let checkpoint = Checkpoint::open(dir)?;
    let mut tensors = Vec::new();
    for (module, _) in checkpoint.quantized_linears() {
        let name = format!("{module}.weight");
        let weight = checkpoint.linear_weight(&module)?;
        tensors.push((
            name.clone(),
            Tensor::from_f32(&name, Dtype::F32, &weight.shape, &weight.values)?,
        ));
    }
    safetensors::serialize_to_file(tensors.iter().map(|(n, t)| (n.as_str(), t)), None, out).map_err(
        |e| ExportError::Safetensors {
            path: out.to_path_buf(),
            message: e.to_string(),
        },
    )
}
