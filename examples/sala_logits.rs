//! Runs a model directory end to end on a text (or token ids), writes the logits to a
//! safetensors file and prints the top-5 next tokens. A quantized checkpoint (its config has a
//! `quantization_config`) runs with its linears dequantized by our reader, so that its logits
//! can be compared with another runtime's (`bench/real_model/logits_check.py`).
//!
//! ```text
//! cargo run --release --example sala_logits -- fixtures/tiny-sala "The school was"
//! cargo run --release --example sala_logits -- fixtures/tiny-sala --ids 1,400,12 --bf16 --out logits.safetensors
//! ```

use std::error::Error;
use std::path::PathBuf;

use burn::tensor::Tensor;
use burn_ndarray::NdArray;
use clap::Parser;
use safetensors::tensor::TensorView;
use sala_gptq::evaluate::checkpoint_logits;
use sala_gptq::export::Checkpoint;
use sala_model::{AttentionMode, LayerRunner, Numerics, RunOptions, SalaConfig, TensorStore};
use tokenizers::Tokenizer;

type B = NdArray<f32>;

#[derive(Parser)]
#[command(about = "Logits and top-5 next tokens of a SALA or Llama model on the CPU")]
struct Args {
    /// Model directory (config.json, model.safetensors or a shard index, tokenizer.json).
    model: PathBuf,
    /// Text to tokenize (the tokenizer adds BOS).
    text: Option<String>,
    /// Comma-separated token ids instead of a text.
    #[arg(long, value_delimiter = ',')]
    ids: Option<Vec<u32>>,
    /// Round to bf16 where the bf16 reference does.
    #[arg(long)]
    bf16: bool,
    /// Plain causal attention at every length (the calibration override of dense_len).
    #[arg(long)]
    dense: bool,
    /// Write all logits `[tokens, vocab]` (F32) to this safetensors file.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> Result<(), Box<dyn Error + Send + Sync>> {
    let args = Args::parse();
    let config_path = args.model.join("config.json");
    let config = SalaConfig::from_file(&config_path)?;
    let raw: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config_path)?)?;
    let quantized = raw.get("quantization_config").is_some();
    let tokenizer_path = args.model.join("tokenizer.json");
    let tokenizer = Tokenizer::from_file(&tokenizer_path)
        .map_err(|e| format!("{}: {e}", tokenizer_path.display()))?;
    let ids = match (&args.ids, &args.text) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) => tokenizer.encode(text.as_str(), true)?.get_ids().to_vec(),
        (None, None) => return Err("give a text or --ids".into()),
    };
    let options = RunOptions {
        numerics: if args.bf16 {
            Numerics::Bf16Rounding
        } else {
            Numerics::F32
        },
        attention: if args.dense {
            AttentionMode::Dense
        } else {
            AttentionMode::FollowConfig
        },
        ..RunOptions::default()
    };
    let runner = LayerRunner::<B>::new(config, Default::default(), options);
    let logits = if quantized {
        let checkpoint = Checkpoint::open(&args.model)?;
        checkpoint_logits(&runner, &checkpoint, &ids)?
    } else {
        let store = TensorStore::open(&args.model)?;
        store.check_config(runner.config())?;
        runner.forward_logits(&store, &ids)?
    };
    let [tokens, vocab] = logits.dims();
    if let Some(out) = &args.out {
        write_logits(out, logits.clone())?;
        println!("wrote {} ([{tokens}, {vocab}] f32)", out.display());
    }
    let last: Vec<f32> = logits
        .slice([tokens - 1..tokens, 0..vocab])
        .into_data()
        .into_vec()?;
    println!("{tokens} tokens: {ids:?}");
    println!("top-5 next tokens:");
    for (id, logit) in top_k(&last, 5) {
        let piece = tokenizer.decode(&[id as u32], false).unwrap_or_default();
        println!("  {id:>6}  {logit:>9.4}  {piece:?}");
    }
    Ok(())
}

fn top_k(values: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut indexed: Vec<(usize, f32)> = values.iter().copied().enumerate().collect();
    indexed.sort_by(|a, b| b.1.total_cmp(&a.1));
    indexed.truncate(k);
    indexed
}

/// Writes `logits` under the name "logits" to a temporary file next to `out`, then renames it.
fn write_logits(
    out: &std::path::Path,
    logits: Tensor<B, 2>,
) -> Result<(), Box<dyn Error + Send + Sync>> {
    let shape = logits.dims().to_vec();
    let values: Vec<f32> = logits.into_data().into_vec()?;
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = TensorView::new(safetensors::Dtype::F32, shape, &bytes)?;
    let dir = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let tmp = tempfile::NamedTempFile::new_in(dir)?;
    safetensors::serialize_to_file([("logits", view)], None, tmp.path())?;
    tmp.persist(out)?;
    Ok(())
}
