//! Timing the calibration forward of single decoder layers, as a user's run would see it:
//! per-layer fixed cost (weights generated, uploaded) apart from per-token cost (the capture
//! pass with its Hessian products, the propagate pass), on packs of short samples and on one
//! long sample, and the projection of a full calibration run from those figures.
//!
//! Every pass is synchronised with the device before and after its timer, run once untimed
//! first (kernel compilation and autotuning), then timed `reps` times; the best time is kept
//! (the least disturbed run of identical work).

use crate::error::PipelineError;
use crate::stats::{InputStats, StatsKind};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, ElementConversion, Tensor};
use sala_model::{
    input_groups, to_f32, DeviceLayerWeights, LayerKind, LayerRunner, LayerWeights, OpTotal,
    SalaConfig,
};
use serde::Serialize;
use std::time::Instant;

/// The calibration set of the production runs as `(samples, tokens each)`: the length mix of
/// its buckets (60 samples under 1k tokens, 4 of 1k–10k, 17 of 10k–50k, 9 of 50k–100k and 6
/// of 100k–131k; 1.83 M tokens), each bucket represented by one length chosen so that the
/// total matches. The exact lengths are not public; this is the projection's assumption.
pub const PRODUCTION_LENGTH_MIX: [(usize, usize); 5] = [
    (60, 500),
    (4, 5_000),
    (17, 28_000),
    (9, 72_000),
    (6, 109_333),
];

/// One measured shape: sequences of `lengths` tokens run as one pack.
#[derive(Debug, Clone, Serialize)]
pub struct ForwardCase {
    /// Name in the report, e.g. `packed_1024` or `single_131072`.
    pub name: String,
    /// Tokens of each sequence of the pack.
    pub lengths: Vec<usize>,
}

impl ForwardCase {
    /// `count` sequences of `len` tokens in one pack, named `packed_<len>` (at least
    /// [`DEFAULT_PACK_TOKENS`](crate::options::DEFAULT_PACK_TOKENS) tokens),
    /// `packed_<len>_x<count>` (fewer) or `single_<len>` (one sequence).
    pub fn uniform(count: usize, len: usize) -> Self {
        let name = match count {
            1 => format!("single_{len}"),
            // The report's `packed_<len>` is a pack of at least the default pack size.
            _ if count * len >= crate::options::DEFAULT_PACK_TOKENS => format!("packed_{len}"),
            _ => format!("packed_{len}_x{count}"),
        };
        Self {
            name,
            lengths: vec![len; count],
        }
    }

    /// Tokens of the pack.
    pub fn tokens(&self) -> usize {
        self.lengths.iter().sum()
    }
}

/// The fixed cost of bringing one layer's weights to the device.
#[derive(Debug, Clone, Serialize)]
pub struct LayerFixedCost {
    /// `minicpm4`, `lightning` or `llama`.
    pub kind: String,
    /// Seconds to upload the layer's weights (f32 host → storage dtype on the device); the
    /// pipeline uploads twice per layer (capture, then the quantized weights to propagate).
    pub upload_s: f64,
}

/// The figures of one layer kind on one case.
#[derive(Debug, Clone, Serialize)]
pub struct ForwardMeasurement {
    /// `minicpm4`, `lightning` or `llama`.
    pub kind: String,
    /// The case's name.
    pub case: String,
    /// Sequences in the pack.
    pub sequences: usize,
    /// Tokens in the pack.
    pub tokens: usize,
    /// Best seconds of the propagate pass (the whole layer, no taps).
    pub propagate_s: f64,
    /// Best seconds of the capture pass (up to `down_proj`'s input, every input's Hessian
    /// `XᵀX` accumulated on the device).
    pub capture_s: f64,
    /// Propagate milliseconds per 1000 tokens.
    pub ms_per_1k_tokens: f64,
    /// Capture milliseconds per 1000 tokens.
    pub capture_ms_per_1k_tokens: f64,
    /// Floating-point operations of the propagate pass ([`layer_flop`]).
    pub flop: f64,
    /// `flop / propagate_s`, in TFLOP/s.
    pub tflops: f64,
}

/// The per-token cost of one layer kind as a function of the sample length `L`:
/// `a + b·L` seconds per token (attention grows with `L`; the rest does not), fitted through
/// two measured lengths.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PerTokenCost {
    /// Seconds per token independent of the length.
    pub base_s: f64,
    /// Seconds per token per token of sample length.
    pub per_length_s: f64,
}

impl PerTokenCost {
    /// The line through `(short_len, short_cost)` and `(long_len, long_cost)` (seconds per
    /// token); a flat line when the lengths are equal. The slope is kept at 0 or above: a
    /// longer sample never costs less per token.
    pub fn fit(short_len: usize, short_cost: f64, long_len: usize, long_cost: f64) -> Self {
        let slope = if long_len > short_len {
            ((long_cost - short_cost) / (long_len - short_len) as f64).max(0.0)
        } else {
            0.0
        };
        Self {
            base_s: short_cost - slope * short_len as f64,
            per_length_s: slope,
        }
    }

    /// Seconds for one sample of `len` tokens.
    pub fn sample_seconds(&self, len: usize) -> f64 {
        let len_f = len as f64;
        len_f * (self.base_s + self.per_length_s * len_f).max(0.0)
    }
}

/// The projected forward time of a full run.
#[derive(Debug, Clone, Serialize)]
pub struct ForwardProjection {
    /// Calibration tokens of the projected run.
    pub tokens: u64,
    /// Samples of the projected run.
    pub samples: usize,
    /// Seconds of per-layer fixed work (two uploads per layer, every layer).
    pub fixed_s: f64,
    /// Seconds of capture passes over every sample and layer.
    pub capture_s: f64,
    /// Seconds of propagate passes over every sample and layer.
    pub propagate_s: f64,
    /// `fixed_s + capture_s + propagate_s`.
    pub total_s: f64,
}

/// Projects the forward passes of a run over samples of `mix` (`(count, tokens)` pairs) on a
/// model of `config`, from each layer kind's fixed cost and per-token costs (capture,
/// propagate). Layer kinds without figures are an error.
pub fn project_forward(
    config: &SalaConfig,
    mix: &[(usize, usize)],
    fixed: &[LayerFixedCost],
    costs: &[(String, PerTokenCost, PerTokenCost)],
) -> Result<ForwardProjection, PipelineError> {
    let mut projection = ForwardProjection {
        tokens: mix.iter().map(|&(n, len)| (n * len) as u64).sum(),
        samples: mix.iter().map(|&(n, _)| n).sum(),
        fixed_s: 0.0,
        capture_s: 0.0,
        propagate_s: 0.0,
        total_s: 0.0,
    };
    for layer in 0..config.num_layers() {
        let kind = crate::plan::kind_name(config.layer_kind(layer));
        let missing = || PipelineError::Unsupported(format!("no {kind} layer was measured"));
        let upload = fixed.iter().find(|f| f.kind == kind).ok_or_else(missing)?;
        let (_, capture, propagate) = costs.iter().find(|c| c.0 == kind).ok_or_else(missing)?;
        projection.fixed_s += 2.0 * upload.upload_s;
        for &(count, len) in mix {
            projection.capture_s += count as f64 * capture.sample_seconds(len);
            projection.propagate_s += count as f64 * propagate.sample_seconds(len);
        }
    }
    projection.total_s = projection.fixed_s + projection.capture_s + projection.propagate_s;
    Ok(projection)
}

/// Floating-point operations of one propagate pass of a `kind` layer of `config` over
/// sequences of `lengths`: every linear (`2·tokens·out·in`), causal softmax attention
/// (`2·2·heads·d·L(L+1)/2` per sequence: scores and the weighted sum, the causal half) and
/// the Simple GLA at its recurrent cost (`4·heads·d²` per token: state update and readout).
/// Elementwise work is not counted.
pub fn layer_flop(config: &SalaConfig, layer: usize, lengths: &[usize]) -> f64 {
    let tokens: f64 = lengths.iter().sum::<usize>() as f64;
    let linears: f64 = config
        .linear_specs(layer)
        .iter()
        .map(|l| (l.out_features * l.in_features) as f64)
        .sum();
    let mixer = match config.layer_kind(layer) {
        LayerKind::Lightning => config.lightning_heads().map_or(0.0, |h| {
            4.0 * (h.heads * h.head_dim * h.head_dim) as f64 * tokens
        }),
        LayerKind::Minicpm4 | LayerKind::Llama => {
            let h = config.attention_heads();
            lengths
                .iter()
                .map(|&l| 2.0 * (h.heads * h.head_dim) as f64 * (l as f64) * (l as f64 + 1.0))
                .sum()
        }
    };
    2.0 * tokens * linears + mixer
}

/// Times one layer on one case: the capture pass (Hessians of every input on the device,
/// as `--device cuda` accumulates them) and the propagate pass, each once untimed, then best
/// of `reps`. `hidden` is the pack's input `[tokens, hidden]`.
pub fn measure_case<B: Backend>(
    runner: &LayerRunner<B>,
    weights: &LayerWeights,
    device_weights: &DeviceLayerWeights<B>,
    case: &ForwardCase,
    hidden: Tensor<B, 2>,
    reps: usize,
) -> Result<(ForwardMeasurement, Tensor<B, 2>), PipelineError> {
    let config = runner.config();
    let layer = weights.layer;
    let pass = CasePass {
        runner,
        weights,
        device_weights,
        case,
        hidden: &hidden,
    };
    let mut output = None;
    let best = |f: &mut dyn FnMut() -> Result<f64, PipelineError>| -> Result<f64, PipelineError> {
        f()?;
        let mut best = f64::INFINITY;
        for _ in 0..reps.max(1) {
            best = best.min(f()?);
        }
        Ok(best)
    };
    let capture_s = best(&mut || pass.capture())?;
    let propagate_s = best(&mut || {
        let (seconds, y) = pass.propagate()?;
        output = Some(y);
        Ok(seconds)
    })?;
    let output = output.ok_or_else(|| PipelineError::NoSamples("nothing was run".into()))?;
    let tokens = case.tokens();
    let flop = layer_flop(config, layer, &case.lengths);
    let per_1k = |s: f64| 1000.0 * s * 1000.0 / tokens as f64;
    Ok((
        ForwardMeasurement {
            kind: crate::plan::kind_name(config.layer_kind(layer)).to_owned(),
            case: case.name.clone(),
            sequences: case.lengths.len(),
            tokens,
            propagate_s,
            capture_s,
            ms_per_1k_tokens: per_1k(propagate_s),
            capture_ms_per_1k_tokens: per_1k(capture_s),
            flop,
            tflops: flop / propagate_s / 1e12,
        },
        output,
    ))
}

/// One layer's passes on one case, op by op ([`profile_case`]).
#[derive(Debug, Clone, Serialize)]
pub struct CaseProfile {
    /// `minicpm4`, `lightning` or `llama`.
    pub kind: String,
    /// The case's name.
    pub case: String,
    /// Seconds of the profiled capture pass (slower than the plain one: every op is
    /// synchronised).
    pub capture_s: f64,
    /// Its fast ops' totals; the rest of `capture_s` is the graph's own work.
    pub capture_ops: Vec<OpTotal>,
    /// Seconds of the profiled propagate pass.
    pub propagate_s: f64,
    /// Its fast ops' totals.
    pub propagate_ops: Vec<OpTotal>,
}

/// One profiled capture pass and one profiled propagate pass of a layer on a case, op by op,
/// when the runner's fast ops have a profile ([`sala_model::ProfiledOps`]); `None` otherwise.
/// Run it after [`measure_case`], whose untimed first passes compile the kernels.
pub fn profile_case<B: Backend>(
    runner: &LayerRunner<B>,
    weights: &LayerWeights,
    device_weights: &DeviceLayerWeights<B>,
    case: &ForwardCase,
    hidden: Tensor<B, 2>,
) -> Result<Option<CaseProfile>, PipelineError> {
    let Some(profile) = runner.fast_ops().and_then(|f| f.profile()) else {
        return Ok(None);
    };
    let pass = CasePass {
        runner,
        weights,
        device_weights,
        case,
        hidden: &hidden,
    };
    let profiled = |f: &dyn Fn() -> Result<f64, PipelineError>| {
        profile.take();
        profile.set_enabled(true);
        let seconds = f();
        profile.set_enabled(false);
        Ok::<_, PipelineError>((seconds?, profile.take()))
    };
    let (capture_s, capture_ops) = profiled(&|| pass.capture())?;
    let (propagate_s, propagate_ops) = profiled(&|| pass.propagate().map(|(s, _)| s))?;
    Ok(Some(CaseProfile {
        kind: crate::plan::kind_name(runner.config().layer_kind(weights.layer)).to_owned(),
        case: case.name.clone(),
        capture_s,
        capture_ops,
        propagate_s,
        propagate_ops,
    }))
}

/// The two passes of one layer on one case, each synchronised with the device before and
/// after its timer.
struct CasePass<'a, B: Backend> {
    runner: &'a LayerRunner<B>,
    weights: &'a LayerWeights,
    device_weights: &'a DeviceLayerWeights<B>,
    case: &'a ForwardCase,
    hidden: &'a Tensor<B, 2>,
}

impl<B: Backend> CasePass<'_, B> {
    fn sync(&self) -> Result<(), PipelineError> {
        B::sync(self.runner.device()).map_err(|e| PipelineError::Device {
            layer: self.weights.layer,
            message: e.to_string(),
        })
    }

    /// Seconds of the capture pass: up to `down_proj`'s input, every input group's full
    /// Hessian accumulated on the device.
    fn capture(&self) -> Result<f64, PipelineError> {
        let (runner, case, layer) = (self.runner, self.case, self.weights.layer);
        let device = runner.device();
        let groups = input_groups(runner.config(), layer);
        let mut stats = Vec::with_capacity(groups.len());
        for group in &groups {
            let dim = self
                .weights
                .get(&format!("{}.weight", group.readers[0]))?
                .shape[1];
            let s = InputStats::<B>::new(StatsKind::Full, dim, Some(device))
                .map_err(PipelineError::solve(&group.readers[0]))?;
            stats.push((group.readers[0].clone(), s));
        }
        self.sync()?;
        let t = Instant::now();
        let mut failure = None;
        runner.capture_pack_from(
            self.device_weights,
            self.hidden.clone(),
            &case.lengths,
            |name, x, rows| {
                if let Some((_, s)) = stats.iter_mut().find(|(first, _)| first == name) {
                    if let Err((_, message)) = s.add_pack(x, &case.lengths, rows, runner.fast_ops())
                    {
                        failure.get_or_insert(format!("{name}: {message}"));
                    }
                }
            },
        )?;
        self.sync()?;
        // Products left running beside the forward count until they are done.
        crate::engine::settle_grams(runner, layer)?;
        if let Some(message) = failure {
            return Err(PipelineError::Device { layer, message });
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// Seconds of the propagate pass (the whole layer, no taps) and its output.
    fn propagate(&self) -> Result<(f64, Tensor<B, 2>), PipelineError> {
        self.sync()?;
        let t = Instant::now();
        let y = self.runner.run_pack_from(
            self.device_weights,
            self.hidden.clone(),
            &self.case.lengths,
            |_, _, _| {},
        )?;
        self.sync()?;
        Ok((t.elapsed().as_secs_f64(), y))
    }
}

/// The mixer's core alone on one case: causal attention (minicpm4, Llama; only through the
/// runner's [`FastOps`](sala_model::FastOps)) or the chunked Simple GLA (lightning).
#[derive(Debug, Clone, Serialize)]
pub struct MixerMeasurement {
    /// `causal_attention`, `simple_gla` (the fast op) or `chunked_gla` (the graph's).
    pub op: String,
    /// The case's name.
    pub case: String,
    /// Best seconds of one call.
    pub seconds: f64,
    /// The op's share of [`layer_flop`] (attention or GLA) over `seconds`, in TFLOP/s.
    pub tflops: f64,
    /// Fast ops on packs of at most [`GRAPH_CHECK_TOKENS`] tokens (attention: of sequences of
    /// at most [`GRAPH_CHECK_LEN`]; GLA: of equal lengths): `max |fast − graph| / max |graph|`
    /// against the Burn graph (blocked attention, chunked GLA) on the same inputs (the
    /// reference the fast kernel must match; bf16 output rounding is ~4e-3).
    pub max_rel_diff_vs_graph: Option<f64>,
}

/// Largest pack whose fast attention [`measure_mixer`] checks against the Burn graph (the
/// graph's blocked attention is slow and memory-hungry beyond).
pub const GRAPH_CHECK_TOKENS: usize = 16_384;

/// Longest sequence of a checked pack: up to this length the graph's attention runs each
/// sequence as one query block, one matmul shape for all (longer ones make every query block
/// a new shape for the GPU backend to compile and autotune: minutes).
pub const GRAPH_CHECK_LEN: usize = 2048;

/// The Burn graph's causal attention of each sequence of a pack, f32 `[tokens, heads, d]`.
fn graph_attention<B: Backend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    lengths: &[usize],
    score_budget: usize,
) -> Tensor<B, 3> {
    let [_, heads, d] = q.dims();
    let kv_heads = k.dims()[1];
    let mut start = 0;
    let parts: Vec<Tensor<B, 3>> = lengths
        .iter()
        .map(|&len| {
            let rows = start..start + len;
            start += len;
            sala_model::ops::attention::causal_attention(
                q.clone().slice([rows.clone(), 0..heads, 0..d]),
                k.clone().slice([rows.clone(), 0..kv_heads, 0..d]),
                v.clone().slice([rows, 0..kv_heads, 0..d]),
                score_budget,
            )
        })
        .collect();
    Tensor::cat(parts, 0)
}

/// Times the mixer core of a `layer` layer on random inputs of `case`'s shape (once untimed,
/// then best of `reps`); `None` for attention without fast kernels (the graph's blocked
/// attention is the reference, not a candidate).
pub fn measure_mixer<B: Backend>(
    runner: &LayerRunner<B>,
    layer: usize,
    case: &ForwardCase,
    reps: usize,
) -> Result<Option<MixerMeasurement>, PipelineError> {
    let config = runner.config();
    let device = runner.device();
    let tokens = case.tokens();
    let dtype = runner.storage_dtype();
    let random = |shape: [usize; 3]| {
        Tensor::<B, 3>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(dtype)
    };
    let sync = || {
        B::sync(device).map_err(|e| PipelineError::Device {
            layer,
            message: e.to_string(),
        })
    };
    type Call<'a> = Box<dyn FnMut() -> Result<(), PipelineError> + 'a>;
    let mut check = None;
    let (op, mut call): (&str, Call<'_>) = match config.layer_kind(layer) {
        LayerKind::Lightning => {
            let Some(h) = config.lightning_heads() else {
                return Ok(None);
            };
            let len = case.lengths[0];
            let count = case.lengths.len();
            let decays = sala_model::ops::gla::log_decays(h.heads);
            let scale = 1.0 / (h.head_dim as f64).sqrt();
            let chunk = runner.options().gla_chunk;
            let q = random([tokens, h.heads, h.head_dim]);
            let k = random([tokens, h.heads, h.head_dim]);
            let v = random([tokens, h.heads, h.head_dim]);
            // [count·len, heads, d] → [count·heads, len, d], as the graph runs equal lengths.
            let by_head = move |x: Tensor<B, 3>| {
                x.reshape([count, len, h.heads, h.head_dim])
                    .swap_dims(1, 2)
                    .reshape([count * h.heads, len, h.head_dim])
            };
            let graph = {
                let (q, k, v, decays) = (q.clone(), k.clone(), v.clone(), decays.clone());
                move || {
                    sala_model::ops::gla::chunked(
                        by_head(to_f32(q.clone()).mul_scalar(scale)),
                        by_head(k.clone()),
                        by_head(v.clone()),
                        &decays,
                        chunk,
                    )
                    .reshape([count, h.heads, len, h.head_dim])
                    .swap_dims(1, 2)
                    .reshape([tokens, h.heads * h.head_dim])
                }
            };
            let uniform = case.lengths.iter().all(|&l| l == len);
            let fast = runner.fast_ops();
            let fast_out = match fast {
                Some(fast) => fast.simple_gla(&q, &k, &v, &case.lengths, &decays, scale as f32)?,
                None => None,
            };
            match (fast, fast_out) {
                (Some(fast), Some(fast_out)) => {
                    if tokens <= GRAPH_CHECK_TOKENS && uniform {
                        let want = graph();
                        let diff = (to_f32(fast_out) - want.clone())
                            .abs()
                            .max()
                            .into_scalar()
                            .elem::<f64>();
                        let top = want.abs().max().into_scalar().elem::<f64>();
                        check = Some(diff / top.max(f64::MIN_POSITIVE));
                    }
                    let lengths = case.lengths.clone();
                    (
                        "simple_gla",
                        Box::new(move || {
                            fast.simple_gla(&q, &k, &v, &lengths, &decays, scale as f32)?;
                            Ok(())
                        }),
                    )
                }
                _ => (
                    "chunked_gla",
                    Box::new(move || {
                        drop(graph());
                        Ok(())
                    }),
                ),
            }
        }
        LayerKind::Minicpm4 | LayerKind::Llama => {
            let Some(fast) = runner.fast_ops() else {
                return Ok(None);
            };
            let h = config.attention_heads();
            let q = random([tokens, h.heads, h.head_dim]);
            let k = random([tokens, h.kv_heads, h.head_dim]);
            let v = random([tokens, h.kv_heads, h.head_dim]);
            let scale = (1.0 / (h.head_dim as f64).sqrt()) as f32;
            let lengths = case.lengths.clone();
            let longest = lengths.iter().copied().max().unwrap_or(0);
            if tokens <= GRAPH_CHECK_TOKENS && longest <= GRAPH_CHECK_LEN {
                let fast_out =
                    fast.causal_attention(q.clone(), k.clone(), v.clone(), &lengths, scale)?;
                let graph = graph_attention(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    &lengths,
                    runner.options().score_budget,
                );
                let diff = (to_f32(fast_out) - graph.clone())
                    .abs()
                    .max()
                    .into_scalar()
                    .elem::<f64>();
                let top = graph.abs().max().into_scalar().elem::<f64>();
                check = Some(diff / top.max(f64::MIN_POSITIVE));
            }
            (
                "causal_attention",
                Box::new(move || {
                    fast.causal_attention(q.clone(), k.clone(), v.clone(), &lengths, scale)?;
                    Ok(())
                }),
            )
        }
    };
    let mut best = f64::INFINITY;
    for rep in 0..=reps.max(1) {
        sync()?;
        let t = Instant::now();
        call()?;
        sync()?;
        if rep > 0 {
            best = best.min(t.elapsed().as_secs_f64());
        }
    }
    let linears: f64 = config
        .linear_specs(layer)
        .iter()
        .map(|l| (l.out_features * l.in_features) as f64)
        .sum();
    let mixer_flop = layer_flop(config, layer, &case.lengths) - 2.0 * tokens as f64 * linears;
    Ok(Some(MixerMeasurement {
        op: op.to_owned(),
        case: case.name.clone(),
        seconds: best,
        tflops: mixer_flop / best / 1e12,
        max_rel_diff_vs_graph: check,
    }))
}

/// NVFP4's and SmoothQuant's per-channel statistics of one input, the fast op's one pass
/// against the chain of tensor ops it replaces.
#[derive(Debug, Clone, Serialize)]
pub struct ChannelSumsMeasurement {
    /// The case's name.
    pub case: String,
    /// Channels of the input (`[tokens, channels]`).
    pub channels: usize,
    /// Best seconds of the fast op ([`FastOps::channel_sums`](sala_model::FastOps)).
    pub fast_seconds: f64,
    /// Best seconds of the tensor-op chain (what runs without the fast op).
    pub graph_seconds: f64,
    /// `max |fast − graph| / max |graph|` over the three statistics, each compared alone.
    pub max_rel_diff_vs_graph: f64,
}

/// Times the per-channel statistics of a random input `[case tokens, channels]` in the
/// runner's storage dtype, weighted per sample as calibration weighs them (once untimed, then
/// best of `reps`), through the runner's fast op and through the tensor-op chain, and compares
/// the two; `None` without a fast op for them.
pub fn measure_channel_sums<B: Backend>(
    runner: &LayerRunner<B>,
    case: &ForwardCase,
    channels: usize,
    reps: usize,
) -> Result<Option<ChannelSumsMeasurement>, PipelineError> {
    let Some(fast) = runner.fast_ops() else {
        return Ok(None);
    };
    let device = runner.device();
    let tokens = case.tokens();
    let x = Tensor::<B, 2>::random([tokens, channels], Distribution::Normal(0.0, 1.0), device)
        .cast(runner.storage_dtype());
    let (runs, _) = sala_model::sample_runs(&case.lengths, 0..tokens);
    let failed = |e: sala_model::ModelError| PipelineError::Device {
        layer: 0,
        message: e.to_string(),
    };
    let Some(want_fast) = fast.channel_sums(&x, &runs).map_err(failed)? else {
        return Ok(None);
    };
    let graph = || crate::stats::channel_sums_reference(&x, &runs);
    let want_graph = graph();
    let mut worst = 0f64;
    for (got, want) in want_fast.into_iter().zip(want_graph) {
        let diff = (got - want.clone()).abs().max().into_scalar().elem::<f64>();
        let top = want.abs().max().into_scalar().elem::<f64>();
        worst = worst.max(diff / top.max(f64::MIN_POSITIVE));
    }
    let sync = || {
        B::sync(device).map_err(|e| PipelineError::Device {
            layer: 0,
            message: e.to_string(),
        })
    };
    let best = |call: &mut dyn FnMut() -> Result<(), PipelineError>| {
        let mut best = f64::INFINITY;
        for _ in 0..reps.max(1) {
            sync()?;
            let t = Instant::now();
            call()?;
            sync()?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok::<f64, PipelineError>(best)
    };
    let fast_seconds = best(&mut || fast.channel_sums(&x, &runs).map(drop).map_err(failed))?;
    let graph_seconds = best(&mut || {
        drop(graph());
        Ok(())
    })?;
    Ok(Some(ChannelSumsMeasurement {
        case: case.name.clone(),
        channels,
        fast_seconds,
        graph_seconds,
        max_rel_diff_vs_graph: worst,
    }))
}

/// Uploads `weights` for `runner`, timed (synchronised before and after).
pub fn timed_upload<B: Backend>(
    runner: &LayerRunner<B>,
    weights: &LayerWeights,
) -> Result<(DeviceLayerWeights<B>, LayerFixedCost), PipelineError> {
    let sync = || {
        B::sync(runner.device()).map_err(|e| PipelineError::Device {
            layer: weights.layer,
            message: e.to_string(),
        })
    };
    sync()?;
    let t = Instant::now();
    let device_weights = runner.upload(weights)?;
    sync()?;
    let fixed = LayerFixedCost {
        kind: crate::plan::kind_name(weights.kind).to_owned(),
        upload_s: t.elapsed().as_secs_f64(),
    };
    Ok((device_weights, fixed))
}

/// A random layer input `[tokens, hidden]`, `N(0, 1)`, in the runner's storage dtype.
pub fn random_hidden<B: Backend>(runner: &LayerRunner<B>, tokens: usize) -> Tensor<B, 2> {
    Tensor::<B, 2>::random(
        [tokens, runner.config().hidden_size()],
        Distribution::Normal(0.0, 1.0),
        runner.device(),
    )
    .cast(runner.storage_dtype())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fitted_line_passes_through_both_points_and_never_falls() {
        let cost = PerTokenCost::fit(1024, 2e-6, 131_072, 10e-6);
        assert!((cost.sample_seconds(1024) - 1024.0 * 2e-6).abs() < 1e-12);
        assert!((cost.sample_seconds(131_072) - 131_072.0 * 10e-6).abs() < 1e-9);
        let flat = PerTokenCost::fit(1024, 5e-6, 131_072, 4e-6);
        assert_eq!(flat.per_length_s, 0.0);
        assert!((flat.sample_seconds(50_000) - 50_000.0 * 5e-6).abs() < 1e-9);
    }

    #[test]
    fn the_production_mix_has_the_calibration_sets_size() {
        let samples: usize = PRODUCTION_LENGTH_MIX.iter().map(|m| m.0).sum();
        let tokens: usize = PRODUCTION_LENGTH_MIX.iter().map(|m| m.0 * m.1).sum();
        assert_eq!(samples, 96);
        assert!((1_825_000..1_835_000).contains(&tokens), "{tokens}");
    }
}
