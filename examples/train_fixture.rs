//! Trains the tiny SALA fixture on the bundled public-domain text and writes
//! `fixtures/tiny-sala-trained/`: a small model that has learned something, so that
//! quantization has real language to lose (`docs/quality.md` measures what it does).
//!
//! ```text
//! cargo run --release --example train_fixture            # the committed fixture (seed 7)
//! cargo run --release --example train_fixture -- --steps 20 --out /tmp/trained   # a quick try
//! ```
//!
//! The model is the configuration, tokenizer and tensor layout of `fixtures/tiny-sala` (hidden
//! 256, 8 layers, minicpm4 at 0, 2, 5, 7, vocabulary 2048), every tensor a flattened `Param` on
//! `Autodiff<NdArray<f32>>`. The forward pass is `sala-model`'s own [`LayerRunner`] fed those
//! parameters through [`DeviceLayerWeights`] (f32 numerics, minicpm4 in dense mode, as
//! calibration runs it), so the trained weights mean the same thing when reloaded. Training:
//! AdamW with linear warm-up and cosine decay, batches of `BOS + (seq_len − 1)` token windows
//! drawn (seeded) from `fixtures/text/train.txt`, next-token cross-entropy. Initialisation and
//! data order come from one seed; burn-autodiff's order of summing gradient contributions varies
//! between runs, so a rerun reproduces the printed losses and perplexity but not every bf16 bit
//! (about 5 % of the weights differ, mostly by one unit in the last place).
//!
//! At the end the weights are written in bf16 to a temporary directory, reloaded through
//! `sala-eval` (the inference path of `eval_quant`), and the held-out perplexity on
//! `fixtures/text/heldout.txt` (the windows `eval_quant` uses by default) is printed next to
//! the uniform one (the vocabulary size); `training.json` records the run. Then the directory is
//! renamed into place.

#![recursion_limit = "256"]

use std::collections::BTreeMap;
use std::error::Error;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::{AutodiffModule, Module, Param};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_autodiff::Autodiff;
use burn_ndarray::NdArray;
use clap::Parser;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use sala_eval::model::{read_config, tokenize};
use sala_eval::{split_sequences, LoadedModel, MetricsAccumulator, Sequence};
use sala_gptq::model::{
    AttentionMode, DeviceLayerWeights, LayerRunner, Numerics, RunOptions, SalaConfig, TensorSpec,
    EMBED_TOKENS,
};
use serde_json::json;

type Inner = NdArray<f32>;
type Train = Autodiff<Inner>;
type AnyError = Box<dyn Error + Send + Sync>;

/// Files copied unchanged from the source fixture.
const COPIED_FILES: [&str; 5] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
];

#[derive(Parser, Debug, Clone)]
#[command(about = "Train the tiny SALA fixture on fixtures/text/train.txt")]
struct Args {
    /// Model whose config and tokenizer are trained. Default: fixtures/tiny-sala.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Output directory. Default: fixtures/tiny-sala-trained.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Directory with train.txt and heldout.txt. Default: fixtures/text.
    #[arg(long)]
    text: Option<PathBuf>,
    /// Seed of the initialisation and of the data order.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Optimizer steps.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Tokens per sequence, BOS included.
    #[arg(long, default_value_t = 256)]
    seq_len: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 2e-3)]
    lr: f64,
    /// Linear warm-up steps (then cosine decay to `lr / 10`).
    #[arg(long, default_value_t = 30)]
    warmup: usize,
    /// AdamW decoupled weight decay.
    #[arg(long, default_value_t = 0.1)]
    weight_decay: f64,
    /// Print the mean training loss every this many steps.
    #[arg(long, default_value_t = 10)]
    log_every: usize,
    /// Held-out loss on a few windows every this many steps (0: never).
    #[arg(long, default_value_t = 100)]
    eval_every: usize,
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// The resolved paths of a run.
struct Paths {
    model: PathBuf,
    out: PathBuf,
    train: PathBuf,
    heldout: PathBuf,
}

impl Paths {
    fn of(args: &Args) -> Self {
        let fixtures = sala_quant::fixtures_dir();
        let text = args.text.clone().unwrap_or_else(|| fixtures.join("text"));
        Self {
            model: args
                .model
                .clone()
                .unwrap_or_else(|| fixtures.join("tiny-sala")),
            out: args
                .out
                .clone()
                .unwrap_or_else(|| fixtures.join("tiny-sala-trained")),
            train: text.join("train.txt"),
            heldout: text.join("heldout.txt"),
        }
    }
}

fn run(args: Args) -> Result<(), AnyError> {
    check_args(&args)?;
    let paths = Paths::of(&args);
    let config = read_config(&paths.model)?;
    let bos = config
        .raw()
        .bos_token_id
        .ok_or_else(|| format!("{}: config has no bos_token_id", paths.model.display()))?;
    let train_tokens = tokenize(&paths.model, &read_text(&paths.train)?)?;
    let heldout_tokens = tokenize(&paths.model, &read_text(&paths.heldout)?)?;
    if train_tokens.len() < args.seq_len {
        return Err(format!(
            "{}: {} tokens, fewer than one sequence of {}",
            paths.train.display(),
            train_tokens.len(),
            args.seq_len
        )
        .into());
    }
    let parent = output_parent(&paths)?;
    let load_before = load_average();
    println!(
        "training {} ({} parameters) on {} ({} tokens); held-out {} tokens; load {load_before}",
        paths.model.display(),
        parameter_count(&config),
        paths.train.display(),
        train_tokens.len(),
        heldout_tokens.len()
    );

    let start = Instant::now();
    let train_len = train_tokens.len();
    let data = Batches::new(train_tokens, bos, args.seq_len, args.seed);
    let heldout_probe = split_sequences(&heldout_tokens, Some(bos), &[args.seq_len], 8);
    let (model, final_loss) = train(&args, &config, data, &heldout_probe)?;
    let train_seconds = start.elapsed().as_secs_f64();

    let staging = tempfile::Builder::new()
        .prefix(".tiny-sala-trained.")
        .tempdir_in(parent)?;
    write_checkpoint(&model.valid(), &config, &paths.model, staging.path())?;
    let sequences = split_sequences(&heldout_tokens, Some(bos), &[64, 256, 1024], 4);
    let perplexity = reloaded_perplexity(staging.path(), &config, &sequences)?;
    let positions: usize = sequences.iter().map(|s| s.ids.len() - 1).sum();
    let uniform = config.vocab_size();
    let load_after = load_average();
    println!(
        "held-out perplexity {perplexity:.2} (uniform {uniform}) on {positions} positions, \
         reloaded from bf16; training took {train_seconds:.0} s (load {load_before} → {load_after})"
    );
    let outcome = Outcome {
        train_tokens: train_len,
        final_loss,
        perplexity,
        positions,
        uniform,
        train_seconds,
        load: [load_before, load_after],
    };
    std::fs::write(
        staging.path().join("training.json"),
        serde_json::to_string_pretty(&training_record(&args, &outcome))? + "\n",
    )?;
    replace_dir(staging, &paths.out)?;
    println!("wrote {}", paths.out.display());
    Ok(())
}

/// What a run measured, for `training.json`.
struct Outcome {
    train_tokens: usize,
    final_loss: f64,
    perplexity: f64,
    positions: usize,
    uniform: usize,
    train_seconds: f64,
    /// 1-minute load averages before and after training.
    load: [String; 2],
}

/// The contents of `training.json`: the command, its settings and what it measured.
fn training_record(args: &Args, outcome: &Outcome) -> serde_json::Value {
    json!({
        "command": command_line(),
        "seed": args.seed,
        "steps": args.steps,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "train_tokens": outcome.train_tokens,
        "tokens_seen": args.steps * args.batch * (args.seq_len - 1),
        "final_train_loss": outcome.final_loss,
        "heldout_perplexity": outcome.perplexity,
        "heldout_positions": outcome.positions,
        "heldout_windows": "eval_quant defaults: lengths 64, 256, 1024, 4 consecutive windows each",
        "uniform_perplexity": outcome.uniform,
        "train_wall_seconds": outcome.train_seconds.round(),
        "load_average_before": outcome.load[0],
        "load_average_after": outcome.load[1],
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
    })
}

/// The directory the output is staged in (the output's parent), after checking that the
/// output would not replace the model being trained.
fn output_parent(paths: &Paths) -> Result<&Path, AnyError> {
    let parent = paths
        .out
        .parent()
        .filter(|p| p.is_dir())
        .ok_or_else(|| format!("{}: parent directory does not exist", paths.out.display()))?;
    if paths.out.canonicalize().ok() == paths.model.canonicalize().ok() {
        return Err(format!(
            "{}: the output would replace the model it trains",
            paths.out.display()
        )
        .into());
    }
    Ok(parent)
}

fn check_args(args: &Args) -> Result<(), AnyError> {
    if args.steps == 0 || args.batch == 0 || args.seq_len < 2 {
        return Err("--steps and --batch must be positive and --seq-len at least 2".into());
    }
    if !args.lr.is_finite() || args.lr <= 0.0 {
        return Err("--lr must be positive".into());
    }
    Ok(())
}

fn read_text(path: &Path) -> Result<String, AnyError> {
    std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()).into())
}

fn parameter_count(config: &SalaConfig) -> usize {
    all_specs(config)
        .iter()
        .map(|s| s.shape.iter().product::<usize>())
        .sum()
}

/// The 1-minute load average (`/proc/loadavg`), or "?" where there is none.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".to_owned())
}

fn command_line() -> String {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let tail = if args.is_empty() {
        String::new()
    } else {
        format!(" -- {}", args.join(" "))
    };
    format!("cargo run --release --example train_fixture{tail}")
}

/// The global tensors, then every layer's, in checkpoint-spec order.
fn all_specs(config: &SalaConfig) -> Vec<TensorSpec> {
    let mut specs = config.global_tensor_specs();
    for layer in 0..config.num_layers() {
        specs.extend(config.layer_tensor_specs(layer));
    }
    specs
}

// ---------------------------------------------------------------------------------------------
// Randomness: one seeded generator for the initialisation and the data order.

/// SplitMix64: a tiny, well-mixed, seedable generator (no dependency, same stream everywhere).
struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in `0..n` (`n > 0`; the modulo bias is negligible for small `n`).
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Standard normal (Box–Muller).
    fn normal(&mut self) -> f64 {
        let u = 1.0 - self.unit();
        let v = self.unit();
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

// ---------------------------------------------------------------------------------------------
// The model: every checkpoint tensor as one flattened parameter.

/// The tiny SALA's tensors as trainable parameters, flattened, in the order of
/// [`SalaConfig::global_tensor_specs`] and [`SalaConfig::layer_tensor_specs`].
#[derive(Module, Debug)]
struct TinySala<B: Backend> {
    /// Embedding, final norm, `lm_head`.
    global: Vec<Param<Tensor<B, 1>>>,
    /// Per decoder layer, its norms and linears.
    layers: Vec<Vec<Param<Tensor<B, 1>>>>,
}

/// Initial values of one tensor: norms 1; linears (and `lm_head`) `N(0, 1/in)`; the embedding
/// `N(0, 1/scale_emb²)`, so that the scaled embedding has unit RMS.
fn init_values(spec: &TensorSpec, config: &SalaConfig, rng: &mut SplitMix) -> Vec<f32> {
    let n: usize = spec.shape.iter().product();
    if spec.shape.len() == 1 {
        return vec![1.0; n];
    }
    let std = if spec.name == EMBED_TOKENS {
        1.0 / config.embedding_scale()
    } else {
        1.0 / (spec.shape[1] as f64).sqrt()
    };
    (0..n).map(|_| (rng.normal() * std) as f32).collect()
}

impl<B: Backend> TinySala<B> {
    /// Seeded initialisation on `device`.
    fn init(config: &SalaConfig, seed: u64, device: &B::Device) -> Self {
        let mut rng = SplitMix(seed);
        let mut param = |spec: &TensorSpec| {
            let values = init_values(spec, config, &mut rng);
            let n = values.len();
            Param::from_tensor(Tensor::from_data(TensorData::new(values, [n]), device))
        };
        let global = config
            .global_tensor_specs()
            .iter()
            .map(&mut param)
            .collect();
        let layers = (0..config.num_layers())
            .map(|l| {
                config
                    .layer_tensor_specs(l)
                    .iter()
                    .map(&mut param)
                    .collect()
            })
            .collect();
        Self { global, layers }
    }

    /// Logits `[ids.len(), vocab]` through `runner` (the inference graph of `sala-model`).
    fn logits(&self, runner: &LayerRunner<B>, ids: &[u32]) -> Result<Tensor<B, 2>, AnyError> {
        let config = runner.config();
        let (vocab, width) = (config.vocab_size(), config.hidden_size());
        let device = runner.device();
        let index: Vec<i64> = ids.iter().map(|&id| i64::from(id)).collect();
        let index = Tensor::<B, 1, Int>::from_data(TensorData::new(index, [ids.len()]), device);
        let table = self.global[0].val().reshape([vocab, width]);
        let mut hidden = runner.scale_embedding(table.select(0, index))?;
        for (layer, params) in self.layers.iter().enumerate() {
            let tensors = params.iter().map(Param::val).collect();
            let weights = DeviceLayerWeights::new(config, layer, tensors)?;
            hidden = runner.run_layer_from(&weights, hidden, |_, _, _| {})?;
        }
        let lm_head = self.global[2].val().reshape([vocab, width]);
        Ok(runner.logits_from(self.global[1].val(), lm_head, hidden)?)
    }

    /// Summed next-token negative log-likelihood of `ids` (a `[1]` tensor) and the number of
    /// predicted positions.
    fn nll(&self, runner: &LayerRunner<B>, ids: &[u32]) -> Result<(Tensor<B, 1>, usize), AnyError> {
        let n = ids.len() - 1;
        let logits = self.logits(runner, &ids[..n])?;
        let targets: Vec<i64> = ids[1..].iter().map(|&id| i64::from(id)).collect();
        let targets =
            Tensor::<B, 2, Int>::from_data(TensorData::new(targets, [n, 1]), runner.device());
        let picked = log_softmax(logits, 1).gather(1, targets);
        Ok((picked.sum().neg(), n))
    }
}

/// A runner in the mode calibration uses: f32 numerics, minicpm4 layers dense.
fn runner<B: Backend>(config: &SalaConfig) -> LayerRunner<B> {
    let options = RunOptions {
        numerics: Numerics::F32,
        attention: AttentionMode::Dense,
        ..RunOptions::default()
    };
    LayerRunner::new(config.clone(), Default::default(), options)
}

// ---------------------------------------------------------------------------------------------
// Data and the training loop.

/// Random training windows: `BOS` followed by `seq_len − 1` consecutive tokens of the text.
struct Batches {
    tokens: Vec<u32>,
    bos: u32,
    seq_len: usize,
    rng: SplitMix,
}

impl Batches {
    fn new(tokens: Vec<u32>, bos: u32, seq_len: usize, seed: u64) -> Self {
        // A stream of its own, so that the initialisation does not shift the data order.
        let rng = SplitMix(seed ^ 0xDA7A_0000_0000_0000);
        Self {
            tokens,
            bos,
            seq_len,
            rng,
        }
    }

    fn next_batch(&mut self, batch: usize) -> Vec<Vec<u32>> {
        let text_len = self.seq_len - 1;
        let starts = self.tokens.len() - text_len + 1;
        (0..batch)
            .map(|_| {
                let start = self.rng.below(starts);
                std::iter::once(self.bos)
                    .chain(self.tokens[start..start + text_len].iter().copied())
                    .collect()
            })
            .collect()
    }
}

/// Linear warm-up to `lr`, then cosine decay to `lr / 10` at the last step.
fn learning_rate(args: &Args, step: usize) -> f64 {
    if step < args.warmup {
        return args.lr * (step + 1) as f64 / args.warmup as f64;
    }
    let span = (args.steps - args.warmup).max(1) as f64;
    let progress = (step - args.warmup) as f64 / span;
    let floor = args.lr / 10.0;
    floor + (args.lr - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// Runs the optimisation; returns the model and the mean loss of the last logging window.
fn train(
    args: &Args,
    config: &SalaConfig,
    mut data: Batches,
    heldout_probe: &[Sequence],
) -> Result<(TinySala<Train>, f64), AnyError> {
    let device = Default::default();
    let runner = runner::<Train>(config);
    let mut model = TinySala::<Train>::init(config, args.seed, &device);
    let mut optim = AdamWConfig::new()
        .with_weight_decay(args.weight_decay as f32)
        .with_grad_clipping(Some(burn::grad_clipping::GradientClippingConfig::Norm(1.0)))
        .init();
    let (mut window_loss, mut window_steps, mut last_loss) = (0.0, 0, f64::NAN);
    let mut window_start = Instant::now();
    for step in 0..args.steps {
        let (loss, count) = batch_loss(&model, &runner, &data.next_batch(args.batch))?;
        let mean = loss.div_scalar(count as f64);
        window_loss += scalar(&mean);
        window_steps += 1;
        let grads = GradientsParams::from_grads(mean.backward(), &model);
        model = optim.step(learning_rate(args, step), model, grads);
        let done = step + 1;
        if done % args.log_every == 0 || done == args.steps {
            last_loss = window_loss / window_steps as f64;
            let tokens = window_steps * args.batch * (args.seq_len - 1);
            println!(
                "step {done:>5}  loss {last_loss:.4}  lr {:.2e}  {:.0} tokens/s",
                learning_rate(args, step),
                tokens as f64 / window_start.elapsed().as_secs_f64()
            );
            (window_loss, window_steps, window_start) = (0.0, 0, Instant::now());
        }
        if args.eval_every > 0 && (done % args.eval_every == 0 || done == args.steps) {
            let probe = probe_loss(&model.valid(), config, heldout_probe)?;
            println!(
                "step {done:>5}  held-out loss {probe:.4} (perplexity {:.1})",
                probe.exp()
            );
        }
    }
    Ok((model, last_loss))
}

/// Summed NLL over a batch and the number of predicted positions.
fn batch_loss<B: Backend>(
    model: &TinySala<B>,
    runner: &LayerRunner<B>,
    batch: &[Vec<u32>],
) -> Result<(Tensor<B, 1>, usize), AnyError> {
    let mut total: Option<Tensor<B, 1>> = None;
    let mut count = 0;
    for ids in batch {
        let (nll, n) = model.nll(runner, ids)?;
        total = Some(match total {
            Some(t) => t + nll,
            None => nll,
        });
        count += n;
    }
    Ok((total.ok_or("empty batch")?, count))
}

/// Mean held-out NLL of the current weights (f32, no gradients).
fn probe_loss(
    model: &TinySala<Inner>,
    config: &SalaConfig,
    probe: &[Sequence],
) -> Result<f64, AnyError> {
    let runner = runner::<Inner>(config);
    let ids: Vec<Vec<u32>> = probe.iter().map(|s| s.ids.clone()).collect();
    let (loss, count) = batch_loss(model, &runner, &ids)?;
    Ok(scalar(&loss) / count as f64)
}

fn scalar<B: Backend>(t: &Tensor<B, 1>) -> f64 {
    t.clone()
        .into_data()
        .convert::<f64>()
        .into_vec::<f64>()
        .map_or(f64::NAN, |v| v[0])
}

// ---------------------------------------------------------------------------------------------
// Export and the faithful-export check.

/// Writes `model.safetensors` (bf16, the fixture's names and shapes) and copies the config and
/// tokenizer files of `source` into `dir`.
fn write_checkpoint<B: Backend>(
    model: &TinySala<B>,
    config: &SalaConfig,
    source: &Path,
    dir: &Path,
) -> Result<(), AnyError> {
    let specs = all_specs(config);
    let params = model.global.iter().chain(model.layers.iter().flatten());
    let mut bytes = BTreeMap::new();
    for (spec, param) in specs.iter().zip(params) {
        let values = param
            .val()
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| format!("{}: reading values: {e:?}", spec.name))?;
        let raw: Vec<u8> = values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect();
        bytes.insert(spec.name.clone(), raw);
    }
    let views = specs
        .iter()
        .map(|spec| {
            let view = TensorView::new(Dtype::BF16, spec.shape.clone(), &bytes[&spec.name])?;
            Ok((spec.name.clone(), view))
        })
        .collect::<Result<BTreeMap<_, _>, safetensors::SafeTensorError>>()?;
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors"))?;
    for name in COPIED_FILES {
        let from = source.join(name);
        std::fs::copy(&from, dir.join(name)).map_err(|e| format!("{}: {e}", from.display()))?;
    }
    Ok(())
}

/// Perplexity of the checkpoint in `dir` on `sequences`, through `sala-eval`'s loader and
/// `LayerRunner` on `NdArray` (exactly what `eval_quant` runs).
fn reloaded_perplexity(
    dir: &Path,
    config: &SalaConfig,
    sequences: &[Sequence],
) -> Result<f64, AnyError> {
    let model = LoadedModel::open(dir, config)?;
    let runner = runner::<Inner>(config);
    let mut acc = MetricsAccumulator::default();
    for sequence in sequences {
        let logits = sala_eval::model::host_values(model.logits(&runner, &sequence.ids)?)?;
        acc.add_sequence(&logits, &logits, config.vocab_size(), &sequence.ids)?;
    }
    Ok(acc.finish().perplexity_original)
}

/// Renames the staging directory to `target`, replacing a previous one.
fn replace_dir(staging: tempfile::TempDir, target: &Path) -> Result<(), AnyError> {
    if target.exists() {
        std::fs::remove_dir_all(target).map_err(|e| format!("{}: {e}", target.display()))?;
    }
    std::fs::rename(staging.keep(), target).map_err(|e| format!("{}: {e}", target.display()))?;
    Ok(())
}
