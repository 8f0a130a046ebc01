//! The long-context drift test: per lightning layer, the error of the GLA state and of the
//! layer output between an original and a quantized checkpoint as the input grows, on diverse
//! text (the held-out text) and on repeated text (a short phrase of it, repeated), with the
//! growth exponent `p` of `error ∝ N^p` (≈ 1: linear bias, ≈ 0.5: noise, ≈ 0: bounded).
//!
//! ```text
//! cargo run --release --example drift -- fixtures/tiny-sala-trained target/quantized/tiny-sala-trained-gptq
//! cargo run --release --example drift -- <orig> <quant> --max-len 4096 --period 8 --isolated
//! ```

use clap::Parser;
use sala_eval::drift::{drift, drift_table, DriftInput, DriftOptions};
use sala_eval::model::{read_config, tokenize};
use sala_eval::LoadedModel;
use sala_gptq::model::{AttentionMode, LayerRunner, Numerics, RunOptions};
use sala_gptq::CpuBackend;
use std::error::Error;
use std::path::PathBuf;

#[derive(Parser)]
#[command(about = "GLA state drift of a quantized SALA checkpoint vs its original")]
struct Args {
    /// Original model directory.
    original: PathBuf,
    /// Quantized checkpoint directory.
    quantized: PathBuf,
    /// Diverse text. Default: the bundled fixtures/text/heldout.txt.
    #[arg(long)]
    text: Option<PathBuf>,
    /// Longest input (tokens, BOS included); checkpoints at 64, 128, … up to it.
    #[arg(long, default_value_t = 4096)]
    max_len: usize,
    /// Tokens of the phrase repeated for the repetitive input (its first tokens of the text).
    #[arg(long, default_value_t = 8)]
    period: usize,
    /// Feed each quantized layer the original model's input (its own error only).
    #[arg(long)]
    isolated: bool,
    /// Round to bf16 where the bf16 reference does.
    #[arg(long)]
    bf16: bool,
    /// Also write both results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn checkpoints(max_len: usize) -> Vec<usize> {
    let mut out: Vec<usize> = (6..).map(|e| 1 << e).take_while(|&n| n < max_len).collect();
    out.push(max_len);
    out
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
    let body = args.max_len.saturating_sub(usize::from(bos.is_some()));
    if tokens.len() < body || args.period == 0 || args.max_len < 2 {
        return Err(format!(
            "{} has {} tokens; --max-len {} and --period {} need at least {body} and a period > 0",
            text_path.display(),
            tokens.len(),
            args.max_len,
            args.period
        )
        .into());
    }
    let with_bos = |body: Vec<u32>| bos.into_iter().chain(body).collect::<Vec<u32>>();
    let diverse = with_bos(tokens[..body].to_vec());
    let repeated = with_bos(
        tokens[..args.period]
            .iter()
            .copied()
            .cycle()
            .take(body)
            .collect(),
    );

    let numerics = if args.bf16 {
        Numerics::Bf16Rounding
    } else {
        Numerics::F32
    };
    let run = RunOptions {
        numerics,
        attention: AttentionMode::Dense,
        ..RunOptions::default()
    };
    let original = LoadedModel::open(&args.original, &config)?;
    let quantized = LoadedModel::open(&args.quantized, &config)?;
    let runner = LayerRunner::<CpuBackend>::new(config, Default::default(), run);
    let options = DriftOptions {
        checkpoints: checkpoints(args.max_len),
        input: if args.isolated {
            DriftInput::Original
        } else {
            DriftInput::Propagated
        },
    };
    let mut results = serde_json::Map::new();
    for (name, ids) in [("diverse", diverse), ("repeated", repeated)] {
        let layers = drift(&runner, &original, &quantized, &ids, &options)?;
        println!("## {name} text ({:?} inputs)\n", options.input);
        println!("{}", drift_table(&layers));
        results.insert(name.to_owned(), serde_json::to_value(&layers)?);
    }
    if let Some(path) = args.json {
        std::fs::write(&path, serde_json::to_string_pretty(&results)? + "\n")?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
