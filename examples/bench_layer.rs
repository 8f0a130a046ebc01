//! Forward throughput of one full-width decoder layer on the CPU (burn-ndarray, f32), for
//! each layer type: hidden 4096 and the released model's heads (32 × 128; 2 KV heads in
//! minicpm4 layers), random weights, one sequence.
//!
//! ```text
//! cargo run --release --example bench_layer                  # 4096 tokens, intermediate 16384
//! cargo run --release --example bench_layer -- --tokens 1024
//! ```

use std::collections::BTreeMap;
use std::error::Error;
use std::path::Path;
use std::time::Instant;

use burn::tensor::{Distribution, Tensor};
use burn_ndarray::NdArray;
use clap::Parser;
use sala_model::{HostTensor, LayerKind, LayerRunner, LayerWeights, RunOptions, SalaConfig};

type B = NdArray<f32>;

#[derive(Parser)]
#[command(about = "Tokens/s of one full-width SALA layer forward on the CPU")]
struct Args {
    /// Sequence length.
    #[arg(long, default_value_t = 4096)]
    tokens: usize,
    /// MLP inner width (the released model: 16384).
    #[arg(long, default_value_t = 16384)]
    intermediate: usize,
    /// Timed repetitions per layer type (after one warm-up run).
    #[arg(long, default_value_t = 1)]
    repeats: usize,
}

fn config(intermediate: usize) -> Result<SalaConfig, Box<dyn Error>> {
    let text = serde_json::json!({
        "model_type": "minicpm_sala", "vocab_size": 73448, "hidden_size": 4096,
        "intermediate_size": intermediate, "num_hidden_layers": 2, "num_attention_heads": 32,
        "num_key_value_heads": 2, "head_dim": 128, "lightning_nh": 32, "lightning_nkv": 32,
        "lightning_head_dim": 128, "lightning_scale": "1/sqrt(d)", "lightning_use_rope": true,
        "attn_use_rope": false, "qk_norm": true, "use_output_norm": true, "use_output_gate": true,
        "attn_use_output_gate": true, "rms_norm_eps": 1e-6, "scale_emb": 12, "scale_depth": 1.4,
        "dim_model_base": 256,
        "sparse_config": {"block_size": 64, "dense_len": 8192, "init_blocks": 1, "kernel_size": 32,
                          "kernel_stride": 16, "topk": 64, "use_nope": false, "window_size": 2048},
        "mixer_types": ["minicpm4", "lightning-attn"]
    })
    .to_string();
    Ok(SalaConfig::from_json_str(&text, Path::new("bench config"))?)
}

fn random_weights(config: &SalaConfig, layer: usize) -> LayerWeights {
    let device = Default::default();
    let tensors: BTreeMap<String, HostTensor> = config
        .layer_tensor_specs(layer)
        .into_iter()
        .map(|spec| {
            let n: usize = spec.shape.iter().product();
            let std = if spec.shape.len() == 2 {
                1.0 / (spec.shape[1] as f64).sqrt()
            } else {
                0.1
            };
            let data = Tensor::<B, 1>::random([n], Distribution::Normal(0.0, std), &device)
                .add_scalar(if spec.shape.len() == 1 { 1.0 } else { 0.0 })
                .into_data()
                .into_vec::<f32>()
                .expect("f32 data");
            (spec.name, HostTensor::new(spec.shape, data))
        })
        .collect();
    LayerWeights {
        layer,
        kind: config.layer_kind(layer),
        tensors,
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let args = Args::parse();
    let config = config(args.intermediate)?;
    let runner = LayerRunner::<B>::new(config.clone(), Default::default(), RunOptions::default());
    let hidden = Tensor::<B, 2>::random(
        [args.tokens, 4096],
        Distribution::Normal(0.0, 1.0),
        &Default::default(),
    );
    println!(
        "layer forward, hidden 4096, intermediate {}, {} tokens, burn-ndarray f32, rayon pool of {} threads (matmul threading follows burn-ndarray's features)",
        args.intermediate,
        args.tokens,
        rayon_threads()
    );
    println!("{:<10} {:>10} {:>12}", "layer", "seconds", "tokens/s");
    for layer in 0..config.num_layers() {
        let weights = random_weights(&config, layer);
        let kind = match config.layer_kind(layer) {
            LayerKind::Minicpm4 => "minicpm4",
            LayerKind::Lightning => "lightning",
            LayerKind::Llama => "llama",
        };
        // Warm-up, then timed runs; into_data forces the lazy backend to finish.
        runner
            .run_layer(&weights, hidden.clone(), |_, _, _| {})?
            .into_data();
        let start = Instant::now();
        for _ in 0..args.repeats {
            runner
                .run_layer(&weights, hidden.clone(), |_, _, _| {})?
                .into_data();
        }
        let seconds = start.elapsed().as_secs_f64() / args.repeats as f64;
        println!(
            "{kind:<10} {seconds:>10.2} {:>12.0}",
            args.tokens as f64 / seconds
        );
    }
    Ok(())
}

fn rayon_threads() -> usize {
    rayon::current_num_threads()
}
