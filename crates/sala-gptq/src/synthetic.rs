//! A synthetic full-size run: the real configuration with random weights generated on the
//! device from a seed (no files), random token ids, and the same per-layer stages as the
//! checkpoint pipeline ([`LayerEngine`]) without writing anything. It measures seconds per
//! stage, memory and throughput on the first few layers, and projects a full run from them
//! ([`Projection`]).

use crate::engine::{LayerEngine, MemoryProbe, Sample};
use crate::error::PipelineError;
use crate::hidden::HiddenLocation;
use crate::io::{Discard, WeightSource};
use crate::options::QuantizeOptions;
use crate::plan::{kind_name, QuantPlan, Recipe};
use crate::progress::Progress;
use crate::report::{peak_rss_bytes, total_errors, LayerReport, LinearReport};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Int, Tensor, TensorData};
use sala_hessian::solver::LinearSolver;
use sala_model::{DeviceMemory, HostTensor, LayerRunner, LayerWeights, ModelError, SalaConfig};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

/// Standard deviation of the random weights, as a freshly initialised transformer's
/// (`N(0, 0.02)`); RMSNorm weights are 1.
pub const WEIGHT_STD: f64 = 0.02;

/// The calibration set of the production runs, in tokens (what [`Projection`] scales to).
pub const PRODUCTION_TOKENS: u64 = 1_830_000;

/// A model of `config`'s shapes with random weights, generated on the device by the backend's
/// seeded generator: the embedding once, each decoder layer when it is asked for (from a seed
/// derived from the model's seed and the layer index, so layers do not depend on the order in
/// which they are generated).
///
/// The backend's generator is process-wide (burn seeds it with `Backend::seed`): the weights
/// repeat from the seed only while no other thread draws random tensors on the same backend
/// between a layer's seeding and its draws.
pub struct SyntheticModel<B: Backend> {
    config: SalaConfig,
    seed: u64,
    device: B::Device,
    /// `[vocab, hidden]` f32.
    embedding: Tensor<B, 2>,
}

impl<B: Backend> SyntheticModel<B> {
    /// The model of `config` from `seed`, on `device` (generates the embedding,
    /// `vocab × hidden` f32 values).
    pub fn new(config: SalaConfig, seed: u64, device: &B::Device) -> Self {
        B::seed(device, seed);
        let embedding = normal([config.vocab_size(), config.hidden_size()], device);
        Self {
            config,
            seed,
            device: device.clone(),
            embedding,
        }
    }

    /// The device the weights are generated on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    fn check_ids(&self, ids: &[u32]) -> Result<(), ModelError> {
        let vocab = self.config.vocab_size();
        if ids.is_empty() {
            return Err(ModelError::InvalidInput("empty token sequence".to_owned()));
        }
        match ids.iter().find(|&&id| id as usize >= vocab) {
            Some(id) => Err(ModelError::InvalidInput(format!(
                "token id {id} is out of range for a vocabulary of {vocab}"
            ))),
            None => Ok(()),
        }
    }
}

/// `N(0, WEIGHT_STD)` f32 values of `shape` on `device`.
fn normal<B: Backend>(shape: [usize; 2], device: &B::Device) -> Tensor<B, 2> {
    Tensor::random(
        shape,
        Distribution::Normal(0.0, WEIGHT_STD),
        (device, DType::F32),
    )
}

/// The generator seed of layer `layer` (SplitMix64 of the model seed and the index).
fn layer_seed(seed: u64, layer: usize) -> u64 {
    splitmix64(seed ^ splitmix64(layer as u64 + 1))
}

/// One SplitMix64 step: a well-mixed 64-bit function of `x`.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl<B: Backend> WeightSource<B> for SyntheticModel<B> {
    fn config(&self) -> &SalaConfig {
        &self.config
    }

    fn embed(&self, runner: &LayerRunner<B>, ids: &[u32]) -> Result<Tensor<B, 2>, ModelError> {
        self.check_ids(ids)?;
        let ids: Vec<i64> = ids.iter().map(|&id| id as i64).collect();
        let n = ids.len();
        let index = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [n]), &self.device);
        runner.scale_embedding(self.embedding.clone().select(0, index))
    }

    fn layer(&self, layer: usize) -> Result<LayerWeights, ModelError> {
        if layer >= self.config.num_layers() {
            return Err(ModelError::InvalidInput(format!(
                "layer {layer} does not exist (the model has {})",
                self.config.num_layers()
            )));
        }
        B::seed(&self.device, layer_seed(self.seed, layer));
        let mut tensors = BTreeMap::new();
        for spec in self.config.layer_tensor_specs(layer) {
            let data = match spec.shape[..] {
                [rows, cols] => normal::<B>([rows, cols], &self.device)
                    .into_data()
                    .convert::<f32>()
                    .into_vec::<f32>()
                    .map_err(|e| ModelError::InvalidInput(format!("{}: {e:?}", spec.name)))?,
                _ => vec![1.0; spec.shape.iter().product()],
            };
            tensors.insert(spec.name, HostTensor::new(spec.shape, data));
        }
        Ok(LayerWeights {
            layer,
            kind: self.config.layer_kind(layer),
            tensors,
        })
    }
}

/// `count` samples of `len` token ids drawn uniformly from `0..vocab` (SplitMix64 from `seed`).
pub fn random_samples(count: usize, len: usize, vocab: usize, seed: u64) -> Vec<Sample> {
    let mut state = seed;
    (0..count)
        .map(|_| Sample {
            ids: (0..len)
                .map(|_| {
                    state = splitmix64(state);
                    (state % vocab.max(1) as u64) as u32
                })
                .collect(),
            line: 0,
        })
        .collect()
}

/// What a synthetic run measured.
#[derive(Debug, Clone, Serialize)]
pub struct SyntheticReport {
    /// `gptq` or `nvfp4`.
    pub recipe: String,
    /// Decoder layers of the model.
    pub model_layers: usize,
    /// Calibration samples.
    pub samples: usize,
    /// Their tokens.
    pub tokens: u64,
    /// Seconds to embed every sample (and place the hidden states).
    pub embed_seconds: f64,
    /// Per layer run.
    pub layers: Vec<LayerReport>,
    /// Per linear.
    pub linears: Vec<LinearReport>,
    /// Total wall time, seconds.
    pub seconds: f64,
    /// Bytes of hidden states held between layers.
    pub hidden_state_bytes: u64,
    /// Where they were kept.
    pub hidden_states_location: HiddenLocation,
    /// Whether the statistics were accumulated on the device.
    pub statistics_on_device: bool,
    /// The solver's name.
    pub solver: String,
    /// Peak of the device allocator's memory (with a memory probe).
    pub peak_device_memory: Option<DeviceMemory>,
    /// Peak resident memory of the process, bytes (Linux `VmHWM`).
    pub peak_rss_bytes: Option<u64>,
    /// The projection of a full run.
    pub projection: Option<Projection>,
}

impl SyntheticReport {
    /// Sum of the solver's output errors over quantized linears.
    pub fn total_output_error(&self) -> f64 {
        total_errors(&self.linears).0
    }

    /// Sum of the baseline's output errors over quantized linears.
    pub fn total_baseline_error(&self) -> f64 {
        total_errors(&self.linears).1
    }
}

/// A synthetic run's setup.
pub struct SyntheticRun<'a, B: Backend> {
    /// The model.
    pub model: &'a SyntheticModel<B>,
    /// Recipe, numerics, budgets, statistics location.
    pub options: &'a QuantizeOptions,
    /// The solver.
    pub solver: &'a dyn LinearSolver,
    /// Device memory probe (GPU runs).
    pub memory: Option<MemoryProbe<B>>,
    /// Faster implementations of the model's heaviest steps on this backend, if any.
    pub fast: Option<std::sync::Arc<dyn sala_model::FastOps<B>>>,
    /// GPTQ on device Hessians, if any (see [`crate::ResidentSolver`]).
    pub resident: Option<std::sync::Arc<dyn crate::ResidentSolver<B>>>,
    /// Run the first `layers` decoder layers (at least 1, at most the model's).
    pub layers: usize,
    /// Tokens of the full calibration set the projection scales to.
    pub target_tokens: u64,
    /// Directory for a hidden-state scratch file (when over the host budget).
    pub scratch: &'a Path,
}

impl<B: Backend> SyntheticRun<'_, B> {
    /// Embeds `samples`, runs the first `layers` layers through the per-layer engine (nothing
    /// written), and projects the full run.
    pub fn run(
        &self,
        samples: &[Sample],
        progress: &mut dyn Progress,
    ) -> Result<SyntheticReport, PipelineError> {
        let started = Instant::now();
        let config = &self.model.config;
        if self.layers == 0 || self.layers > config.num_layers() {
            return Err(PipelineError::Unsupported(format!(
                "{} layers asked for; the model has {} (ask for 1 to {})",
                self.layers,
                config.num_layers(),
                config.num_layers()
            )));
        }
        let plan = QuantPlan::build(config, &self.options.plan)?;
        let runner = crate::pipeline::with_fast(
            LayerRunner::<B>::new(config.clone(), self.model.device.clone(), self.options.run),
            self.fast.clone(),
        );
        let mut engine = LayerEngine::new(self.options, &plan, &runner, self.solver, samples)?
            .with_memory_probe(self.memory)
            .with_resident_solver(self.resident.clone());
        progress.start(self.layers, samples.len());
        let t = Instant::now();
        let mut hidden = engine.embed(self.model, self.scratch, progress)?;
        let embed_seconds = t.elapsed().as_secs_f64();
        let mut layers = Vec::with_capacity(self.layers);
        for layer in 0..self.layers {
            progress.layer(layer);
            let report = engine.layer(layer, self.model, &mut hidden, &mut Discard, progress)?;
            progress.layer_done(&report);
            layers.push(report);
        }
        progress.finish();
        let totals = engine.totals();
        Ok(SyntheticReport {
            recipe: match plan.recipe {
                Recipe::Gptq => "gptq".into(),
                Recipe::Nvfp4 => "nvfp4".into(),
            },
            model_layers: config.num_layers(),
            samples: totals.samples,
            tokens: totals.tokens,
            embed_seconds,
            projection: Projection::new(config, &layers, self.target_tokens),
            layers,
            linears: totals.linears,
            seconds: started.elapsed().as_secs_f64(),
            hidden_state_bytes: hidden.bytes(),
            hidden_states_location: hidden.location(),
            statistics_on_device: self.options.device_statistics,
            solver: self.solver.name().to_owned(),
            peak_device_memory: totals.peak_device_memory,
            peak_rss_bytes: peak_rss_bytes(),
        })
    }
}

/// The cost of one layer kind, from the measured layers of that kind.
#[derive(Debug, Clone, Serialize)]
pub struct KindCost {
    /// `minicpm4`, `lightning` or `llama`.
    pub kind: String,
    /// Layers of this kind in the model.
    pub layers_in_model: usize,
    /// The measured layers the averages come from.
    pub from_layers: Vec<usize>,
    /// Seconds per calibration token of the token-proportional stages (capture, accumulate,
    /// propagate), averaged.
    pub seconds_per_token: f64,
    /// Seconds of the token-independent stages (solve, write), averaged.
    pub fixed_seconds: f64,
}

/// A full run's time from a few measured layers: linear in the calibration tokens for the
/// forward passes and the statistics, constant for the solve.
///
/// `T = Σ_kind n_kind · (s_kind · N + f_kind)` with `n_kind` the layers of each kind in the
/// model, `N` the target tokens, `s_kind` the measured seconds per token of capture +
/// accumulate + propagate and `f_kind` the measured seconds of finalize + smooth + solve +
/// write (once per layer whatever the tokens), each averaged
/// over the measured layers of that kind, leaving out the first of a kind when there are more
/// (it pays the kernels' autotuning). A kind that was not measured borrows the average of all
/// measured layers. Valid at the measured sequence length (attention is quadratic in it).
#[derive(Debug, Clone, Serialize)]
pub struct Projection {
    /// `N`.
    pub target_tokens: u64,
    /// Decoder layers of the model.
    pub model_layers: usize,
    /// Per layer kind.
    pub kinds: Vec<KindCost>,
    /// `T`, seconds.
    pub seconds: f64,
    /// The formula with its numbers, for the terminal.
    pub formula: String,
}

impl Projection {
    /// The projection of `config`'s full run on `target_tokens` tokens from `measured`
    /// layers; `None` when nothing was measured.
    pub fn new(config: &SalaConfig, measured: &[LayerReport], target_tokens: u64) -> Option<Self> {
        let all = representative(measured.iter().collect());
        if all.is_empty() {
            return None;
        }
        let mut counts: BTreeMap<&'static str, usize> = BTreeMap::new();
        for layer in 0..config.num_layers() {
            *counts
                .entry(kind_name(config.layer_kind(layer)))
                .or_default() += 1;
        }
        let kinds: Vec<KindCost> = counts
            .into_iter()
            .map(|(kind, n)| {
                let own = representative(measured.iter().filter(|l| l.kind == kind).collect());
                let used = if own.is_empty() { all.clone() } else { own };
                let mean = |f: &dyn Fn(&LayerReport) -> f64| {
                    used.iter().map(|l| f(l)).sum::<f64>() / used.len() as f64
                };
                KindCost {
                    kind: kind.to_owned(),
                    layers_in_model: n,
                    from_layers: used.iter().map(|l| l.layer).collect(),
                    seconds_per_token: mean(&|l| l.token_seconds() / l.tokens.max(1) as f64),
                    fixed_seconds: mean(&|l| l.fixed_seconds()),
                }
            })
            .collect();
        let n = target_tokens as f64;
        let seconds = kinds
            .iter()
            .map(|k| k.layers_in_model as f64 * (k.seconds_per_token * n + k.fixed_seconds))
            .sum();
        let terms: Vec<String> = kinds
            .iter()
            .map(|k| {
                format!(
                    "{}: {} × ({:.3e} s/token × N + {:.2} s) [layers {:?}]",
                    k.kind, k.layers_in_model, k.seconds_per_token, k.fixed_seconds, k.from_layers
                )
            })
            .collect();
        let formula = format!(
            "T = Σ_kind n_kind · (s_kind · N + f_kind), N = {target_tokens} tokens, \
             s = (capture + accumulate + propagate) / tokens, f = finalize + smooth + solve + write:\n  {}\n  \
             T = {seconds:.0} s = {:.2} h (at the measured sequence length)",
            terms.join("\n  "),
            seconds / 3600.0
        );
        Some(Self {
            target_tokens,
            model_layers: config.num_layers(),
            kinds,
            seconds,
            formula,
        })
    }
}

/// The layers to average: all of them but the first when there are several (warm-up).
fn representative(layers: Vec<&LayerReport>) -> Vec<&LayerReport> {
    match layers.len() {
        0 | 1 => layers,
        _ => layers[1..].to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::StageSeconds;

    fn layer(layer: usize, kind: &str, tokens: u64, capture: f64, solve: f64) -> LayerReport {
        LayerReport {
            layer,
            kind: kind.to_owned(),
            tokens,
            stages: StageSeconds {
                capture,
                solve,
                ..StageSeconds::default()
            },
            ..LayerReport::default()
        }
    }

    #[test]
    fn the_projection_scales_token_stages_and_keeps_the_solve() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-sala/config.json");
        let config = SalaConfig::from_file(&path).unwrap();
        // tiny-sala: 4 minicpm4 and 4 lightning layers. The first minicpm4 layer (warm-up)
        // is left out since a second one was measured; lightning has one measurement.
        let measured = [
            layer(0, "minicpm4", 100, 99.0, 9.0),
            layer(1, "lightning", 100, 2.0, 3.0),
            layer(2, "minicpm4", 100, 1.0, 5.0),
        ];
        let p = Projection::new(&config, &measured, 1000).unwrap();
        // minicpm4: 4 × (0.01 × 1000 + 5); lightning: 4 × (0.02 × 1000 + 3).
        let expected = 4.0 * (10.0 + 5.0) + 4.0 * (20.0 + 3.0);
        assert!((p.seconds - expected).abs() < 1e-9, "{}", p.formula);
        let minicpm4 = p.kinds.iter().find(|k| k.kind == "minicpm4").unwrap();
        assert_eq!(minicpm4.from_layers, vec![2]);
        assert!(Projection::new(&config, &[], 1000).is_none());
    }

    #[test]
    fn random_samples_are_in_range_and_reproducible() {
        let a = random_samples(3, 7, 50, 9);
        assert_eq!(a.len(), 3);
        assert!(a
            .iter()
            .all(|s| s.ids.len() == 7 && s.ids.iter().all(|&i| i < 50)));
        assert_eq!(a[1].ids, random_samples(3, 7, 50, 9)[1].ids);
        assert_ne!(a[0].ids, a[1].ids);
    }
}
