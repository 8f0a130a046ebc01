//! Compares a quantized checkpoint with its original on held-out text: perplexity of each,
//! mean and max per-token KL(original ‖ quantized), top-1 agreement, per sequence length.
//!
//! ```text
//! cargo run --release --example eval_quant -- fixtures/tiny-sala-trained target/quantized/tiny-sala-trained-gptq
//! cargo run --release --example eval_quant -- <orig> <quant> --text fixtures/text/heldout.txt \
//!     --lengths 64,256,1024 --per-bucket 4 --json eval.json
//! ```

use clap::Parser;
use sala_eval::model::{read_config, tokenize};
use sala_eval::{evaluate, split_sequences, LoadedModel};
use sala_gptq::model::{AttentionMode, LayerRunner, Numerics, RunOptions};
use sala_gptq::CpuBackend;
use std::error::Error;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    about = "Perplexity, KL and top-1 agreement of a quantized SALA checkpoint vs its original"
)]
struct Args {
    /// Original model directory.
    original: PathBuf,
    /// Quantized checkpoint directory (GPTQ or NVFP4; an unquantized one works too).
    quantized: PathBuf,
    /// Held-out text. Default: the bundled fixtures/text/heldout.txt.
    #[arg(long)]
    text: Option<PathBuf>,
    /// Sequence lengths (tokens, BOS included), one bucket each.
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024")]
    lengths: Vec<usize>,
    /// Sequences per bucket (consecutive windows of the text).
    #[arg(long, default_value_t = 4)]
    per_bucket: usize,
    /// Round to bf16 where the bf16 reference does (default: f32 throughout).
    #[arg(long)]
    bf16: bool,
    /// Also write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn main() -> Result<(), Box<dyn Error>> {
    let args = Args::parse();
    let text_path = args
        .text
        .unwrap_or_else(|| sala_quant::fixtures_dir().join("text/heldout.txt"));
    let text =
        std::fs::read_to_string(&text_path).map_err(|e| format!("{}: {e}", text_path.display()))?;
    let config = read_config(&args.original)?;
    let bos = config.raw().bos_token_id;
    let tokens = tokenize(&args.original, &text)?;
    let sequences = split_sequences(&tokens, bos, &args.lengths, args.per_bucket);
    let numerics = if args.bf16 {
        Numerics::Bf16Rounding
    } else {
        Numerics::F32
    };
    let options = RunOptions {
        numerics,
        attention: AttentionMode::Dense,
        ..RunOptions::default()
    };
    let original = LoadedModel::open(&args.original, &config)?;
    let quantized = LoadedModel::open(&args.quantized, &config)?;
    let runner = LayerRunner::<CpuBackend>::new(config, Default::default(), options);
    let report = evaluate(&runner, &original, &quantized, &sequences)?;
    println!(
        "{} ({}) vs {} ({}) on {} ({} tokens, uniform perplexity {})\n",
        report.original,
        report.original_format,
        report.quantized,
        report.quantized_format,
        text_path.display(),
        tokens.len(),
        runner.config().vocab_size()
    );
    print!("{}", report.table());
    if let Some(path) = args.json {
        std::fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")?;
        println!("\nwrote {}", path.display());
    }
    Ok(())
}
