//! The per-layer engine shared by the checkpoint [`Pipeline`](crate::Pipeline) and the
//! synthetic benchmark ([`crate::synthetic`]): for each decoder layer, capture the inputs of
//! every linear and accumulate their statistics, smooth, solve every linear (through the
//! [`LinearSolver`] seam), hand the layer to a [`LayerSink`], and re-run the quantized layer to
//! produce the next layer's inputs (the original scripts' quantized-input propagation).

use crate::alpha_search::round_to_nearest_error;
use crate::error::PipelineError;
use crate::hidden::{HiddenBudget, HiddenLocation, HiddenStates};
use crate::io::{LayerSink, SolvedLinear, WeightSource};
use crate::options::{QuantizeOptions, Smoothing};
use crate::packing::pack_samples;
use crate::plan::{PlannedLinear, QuantPlan, Treatment};
use crate::progress::{Progress, Stage};
use crate::report::{peak_rss_bytes, ErrorHessian, LayerOps, LayerReport, LinearReport};
use crate::resident::{ResidentHessian, ResidentSolver};
use crate::smoothing::{fixed_scales, fold_group, reader_map, smooth_group_of};
use crate::stats::{Finalized, InputStats, StatsKind};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use rayon::prelude::*;
use sala_formats::nvfp4::global_scale_from_amax;
use sala_formats::{BlockScales, GptqPacked, Nvfp4Matrix};
use sala_hessian::solver::LinearSolver;
use sala_hessian::{
    proxy_error, Gptq, Hessian, HessianError, IntGrid, Method, QuantizedLinear, UnfinishedGptq,
};
use sala_model::{
    input_groups, DeviceLayerWeights, DeviceMemory, InputGroup, LayerRunner, LayerWeights,
    SalaConfig,
};
use sala_smooth::{AlphaChoice, AlphaGrid, ScaleRecipe, WeightMatrix};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// Reads the device allocator's memory (e.g. `sala_model::cuda_memory` for the CUDA
/// backend); `None` when the device cannot say.
pub type MemoryProbe<B> = fn(&burn::tensor::Device<B>) -> Option<DeviceMemory>;

/// One calibration sample: token ids and where it came from (for error messages).
#[derive(Debug, Clone)]
pub struct Sample {
    /// Token ids (BOS included as the tokenizer adds it).
    pub ids: Vec<u32>,
    /// Line of the calibration file (1-based), 0 if not from a file.
    pub line: usize,
}

impl From<&sala_calib::CalibSample> for Sample {
    fn from(s: &sala_calib::CalibSample) -> Self {
        Self {
            ids: s.ids.clone(),
            line: s.line,
        }
    }
}

/// What a run through the engine used and produced, for the final report.
#[derive(Debug, Clone)]
pub struct EngineTotals {
    /// Samples still in use at the end.
    pub samples: usize,
    /// Their tokens.
    pub tokens: u64,
    /// Samples whose forward pass failed and were skipped.
    pub failed_samples: Vec<String>,
    /// Per linear, in solve order.
    pub linears: Vec<LinearReport>,
    /// Peak of the device allocator's memory (with a memory probe).
    pub peak_device_memory: Option<DeviceMemory>,
}

/// The layer-by-layer data path over any [`WeightSource`] into any [`LayerSink`].
///
/// Call [`LayerEngine::embed`] once, then [`LayerEngine::layer`] for layers `0, 1, …` in order
/// (each consumes the hidden states the previous one produced), then
/// [`LayerEngine::totals`].
pub struct LayerEngine<'a, B: Backend> {
    options: &'a QuantizeOptions,
    plan: &'a QuantPlan,
    runner: &'a LayerRunner<B>,
    solver: &'a dyn LinearSolver,
    resident: Option<Arc<dyn ResidentSolver<B>>>,
    memory: Option<MemoryProbe<B>>,
    samples: &'a [Sample],
    /// Samples still in use (a failed one is dropped when skipping is allowed).
    active: Vec<usize>,
    failed: Vec<String>,
    linears: Vec<LinearReport>,
    /// Peak device memory of the current layer.
    layer_peak: Option<DeviceMemory>,
    /// Peak device memory of the run.
    peak_device: Option<DeviceMemory>,
    /// Rayon threads of their own for GPTQ's host finishing ([`finish_and_pack`]), which runs
    /// beside the next linear's solve: the solve's parallel steps on the global pool (checks,
    /// uploads) must not queue behind it. Built at first use; `None` inside when the threads
    /// could not be made (the global pool serves then).
    finishing_pool: std::cell::OnceCell<Option<Arc<rayon::ThreadPool>>>,
}

/// What a layer's capture leaves: the finalized statistics per input group (`None` where no
/// quantized linear reads the input), the seconds spent accumulating and finalizing them.
type Captured<B> = (Vec<Option<Finalized<B>>>, f64, f64);

/// The running maximum of `peak` and `now`.
fn max_memory(peak: Option<DeviceMemory>, now: Option<DeviceMemory>) -> Option<DeviceMemory> {
    match (peak, now) {
        (Some(p), Some(n)) => Some(p.max(n)),
        (p, n) => p.or(n),
    }
}

/// Waits for the device's queued work, so that a timer charges it to the stage that queued it
/// (a no-op on the CPU backend).
fn sync<B: Backend>(device: &B::Device) -> Result<(), String> {
    B::sync(device).map_err(|e| format!("device error: {e}"))
}

/// `runner`'s op profile when its fast ops are profiled and the profile is on.
fn op_profile<B: Backend>(runner: &LayerRunner<B>) -> Option<&sala_model::OpProfile> {
    let profile = runner.fast_ops()?.profile()?;
    profile.enabled().then_some(profile)
}

/// Waits for the Hessian products `runner`'s fast ops left running beside the forward
/// ([`FastOps::settle_grams`](sala_model::FastOps::settle_grams)); a failure of theirs is layer
/// `layer`'s device error.
pub(crate) fn settle_grams<B: Backend>(
    runner: &LayerRunner<B>,
    layer: usize,
) -> Result<(), PipelineError> {
    match runner.fast_ops() {
        Some(fast) => fast.settle_grams().map_err(|e| PipelineError::Device {
            layer,
            message: e.to_string(),
        }),
        None => Ok(()),
    }
}

fn seconds_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64()
}

impl<'a, B: Backend> LayerEngine<'a, B> {
    /// An engine running `plan` with `options` on `runner`'s device, solving with `solver`,
    /// over `samples` (at least one).
    pub fn new(
        options: &'a QuantizeOptions,
        plan: &'a QuantPlan,
        runner: &'a LayerRunner<B>,
        solver: &'a dyn LinearSolver,
        samples: &'a [Sample],
    ) -> Result<Self, PipelineError> {
        if samples.is_empty() {
            return Err(PipelineError::NoSamples(
                "the calibration set is empty".into(),
            ));
        }
        Ok(Self {
            options,
            plan,
            runner,
            solver,
            resident: None,
            memory: None,
            samples,
            active: (0..samples.len()).collect(),
            failed: Vec::new(),
            linears: Vec::new(),
            layer_peak: None,
            peak_device: None,
            finishing_pool: std::cell::OnceCell::new(),
        })
    }

    /// Solves GPTQ on device Hessians with `resident` where the statistics are on the device
    /// (`None`: they are downloaded for the `LinearSolver`).
    pub fn with_resident_solver(mut self, resident: Option<Arc<dyn ResidentSolver<B>>>) -> Self {
        self.resident = resident;
        self
    }

    /// Samples the device memory with `probe` during every layer (reported per layer).
    pub fn with_memory_probe(mut self, probe: Option<MemoryProbe<B>>) -> Self {
        self.memory = probe;
        self
    }

    fn config(&self) -> &SalaConfig {
        self.runner.config()
    }

    /// Reads the device memory into the layer's peak (with a probe).
    fn sample_memory(&mut self) {
        let now = self.memory.and_then(|probe| probe(self.runner.device()));
        self.layer_peak = max_memory(self.layer_peak, now);
    }

    /// Hands the device allocator's free buffers back (a no-op on the CPU), after every pack,
    /// linear and stage: CubeCL's pools keep every page they ever allocated otherwise, and its
    /// exact-size pool on CUDA reuses a freed buffer only for one of the same size, so one
    /// pack's buffers would stay reserved through the next.
    fn release_free_pages(&mut self) {
        self.sample_memory();
        B::memory_cleanup(self.runner.device());
    }

    /// Tokens of the samples still in use.
    pub fn active_tokens(&self) -> u64 {
        self.active
            .iter()
            .map(|&i| self.samples[i].ids.len() as u64)
            .sum()
    }

    /// The layer-0 inputs of every sample, kept on the device when they fit
    /// `options.max_device_memory`, else on the host (or in a scratch file in `scratch`, per
    /// `options.max_host_memory`). Tells `progress` where they live and how long embedding
    /// took.
    ///
    /// When the states live on the device and `source` has an embedding table, the table is
    /// uploaded once and each sample's rows are gathered there: the host never holds a
    /// sample's `[tokens, hidden]` matrix, only its token ids.
    pub fn embed(
        &mut self,
        source: &dyn WeightSource<B>,
        scratch: &Path,
        progress: &mut dyn Progress,
    ) -> Result<HiddenStates<B>, PipelineError> {
        let t = Instant::now();
        let mut hidden = self.allocate_hidden(scratch)?;
        let table = match hidden.location() {
            HiddenLocation::Device => source.embedding_table(self.runner)?,
            _ => None,
        };
        for (i, sample) in self.samples.iter().enumerate() {
            // Hidden states kept on the host are embedded there: a round trip through the
            // device took 53 s of a 32 GB-capped run for the production mix.
            if let Some(dst) = hidden.host_bf16_mut(i) {
                if source.embed_host(self.runner, &sample.ids, dst)? {
                    continue;
                }
            }
            let rows = match &table {
                Some(table) => self.runner.embed_on_device(table, &sample.ids)?,
                None => source.embed(self.runner, &sample.ids)?,
            };
            hidden.store(i, rows, self.runner.fast_ops())?;
            // Each sample's temporaries (on the host path its f32 rows, their scaled copy and
            // the bf16 cast) have sizes of their own, which CubeCL's exact-size pool on CUDA
            // never reuses for the next sample's: kept, they filled a 27 GB budget before the
            // first layer.
            self.release_free_pages();
        }
        let table_used = table.is_some();
        drop(table);
        let device = self.runner.device();
        sync::<B>(device).map_err(|message| PipelineError::Device { layer: 0, message })?;
        self.release_free_pages();
        self.tell_hidden(&hidden, progress);
        progress.message(&format!(
            "layer-0 inputs: {} tokens embedded {} in {:.1} s",
            self.active_tokens(),
            if table_used {
                "on the device"
            } else {
                "on the host"
            },
            seconds_since(t)
        ));
        Ok(hidden)
    }

    /// Storage for every sample's hidden states (zeros), where [`embed`](Self::embed) puts
    /// them.
    pub(crate) fn allocate_hidden(&self, scratch: &Path) -> Result<HiddenStates<B>, PipelineError> {
        let lengths: Vec<usize> = self.samples.iter().map(|s| s.ids.len()).collect();
        let budget = HiddenBudget {
            device: self.options.max_device_memory,
            host: self.options.max_host_memory,
        };
        HiddenStates::new(
            &lengths,
            self.config().hidden_size(),
            self.runner.device(),
            self.runner.storage_dtype(),
            budget,
            scratch,
        )
    }

    /// What a resumable run saves of the engine after a layer: the samples still in use, the
    /// failed ones, the peak device memory.
    pub(crate) fn saved_state(&self) -> (Vec<usize>, Vec<String>, Option<DeviceMemory>) {
        (self.active.clone(), self.failed.clone(), self.peak_device)
    }

    /// Linear reports so far (in solve order).
    pub(crate) fn linear_count(&self) -> usize {
        self.linears.len()
    }

    /// The linear reports from `from` on.
    pub(crate) fn linears_from(&self, from: usize) -> &[LinearReport] {
        &self.linears[from.min(self.linears.len())..]
    }

    /// Puts the engine back where a resumable run saved it ([`saved_state`](Self::saved_state)
    /// and the linear reports of the completed layers).
    pub(crate) fn restore(
        &mut self,
        active: Vec<usize>,
        failed: Vec<String>,
        peak_device: Option<DeviceMemory>,
        linears: Vec<LinearReport>,
    ) -> Result<(), PipelineError> {
        if active.is_empty() || active.iter().any(|&i| i >= self.samples.len()) {
            return Err(PipelineError::NoSamples(
                "the resume manifest names samples this run does not have".into(),
            ));
        }
        self.active = active;
        self.failed = failed;
        self.peak_device = peak_device;
        self.linears = linears;
        Ok(())
    }

    /// Tells `progress` where the hidden states live.
    pub(crate) fn tell_hidden(&self, hidden: &HiddenStates<B>, progress: &mut dyn Progress) {
        progress.message(&format!(
            "hidden states: {:.1} MB {}; statistics on the {}; solver {}; forward: {}",
            hidden.bytes() as f64 / 1e6,
            hidden.location(),
            if self.options.device_statistics {
                "device"
            } else {
                "host"
            },
            self.solver.name(),
            self.runner
                .fast_ops()
                .map_or_else(|| "the graph's ops".to_owned(), |fast| fast.describe()),
        ));
    }

    /// Quantizes decoder layer `layer` of `source`: capture and accumulate, smooth, solve, hand
    /// the layer to `sink`, propagate `hidden` through the quantized layer (not through the
    /// model's last layer when nothing calibrated reads its outputs: `hidden` then stays its
    /// input).
    pub fn layer(
        &mut self,
        layer: usize,
        source: &dyn WeightSource<B>,
        hidden: &mut HiddenStates<B>,
        sink: &mut dyn LayerSink,
        progress: &mut dyn Progress,
    ) -> Result<LayerReport, PipelineError> {
        let t = Instant::now();
        let weights = source.layer(layer)?;
        self.layer_loaded(layer, weights, seconds_since(t), hidden, sink, progress)
    }

    /// [`layer`](Self::layer) with the layer's weights already read (for instance on a thread
    /// beside the previous layer's work); `load` is the seconds the caller waited for them,
    /// reported as the layer's load stage. Errors when `weights` are another layer's.
    pub fn layer_loaded(
        &mut self,
        layer: usize,
        mut weights: LayerWeights,
        load: f64,
        hidden: &mut HiddenStates<B>,
        sink: &mut dyn LayerSink,
        progress: &mut dyn Progress,
    ) -> Result<LayerReport, PipelineError> {
        if weights.layer != layer {
            return Err(sala_model::ModelError::InvalidInput(format!(
                "weights of layer {} given for layer {layer}",
                weights.layer
            ))
            .into());
        }
        let runner = self.runner;
        let config = runner.config();
        let mut report = LayerReport {
            layer,
            kind: crate::plan::kind_name(config.layer_kind(layer)).to_owned(),
            samples: self.active.len(),
            tokens: self.active_tokens(),
            ..LayerReport::default()
        };
        report.stages.load = load;
        self.layer_peak = None;
        let profile = op_profile(runner);
        if let Some(profile) = profile {
            // What ran before this layer's capture is not this layer's.
            profile.take();
        }
        let t = Instant::now();
        let groups = input_groups(config, layer);
        let quantized: BTreeSet<String> = self
            .plan
            .layer(layer)
            .filter(|l| l.treatment.is_quantized())
            .map(|l| l.name.clone())
            .collect();
        let needed: Vec<bool> = groups
            .iter()
            .map(|g| g.readers.iter().any(|r| quantized.contains(r)))
            .collect();
        let stages = capture_stages(&needed, self.options.true_sequential);
        progress.stage(Stage::Capture, self.active.len());
        let solver_kinds = self.solver_kinds(layer);
        let first_kinds = self.first_capture_kinds(&groups, &needed, &stages, &solver_kinds);
        let (mut stats, accumulate, finalize) =
            self.capture(layer, &weights, &groups, &first_kinds, hidden, progress)?;
        self.release_free_pages();
        report.stages.accumulate = accumulate;
        report.stages.finalize = finalize;
        report.stages.capture = seconds_since(t) - accumulate - finalize;

        let t = Instant::now();
        progress.stage(Stage::Solve, quantized.len());
        let mut modified = BTreeSet::new();
        let smoothed = self.smooth(&groups, &needed, &mut weights, &mut stats, &mut modified)?;
        report.stages.smooth = seconds_since(t);

        let mut solved = Vec::new();
        for (s, stage) in stages.iter().enumerate() {
            if s > 0 {
                // True-sequential: this stage's inputs come from the layer whose earlier
                // linears are already replaced by their dequantized weights.
                let t = Instant::now();
                progress.stage(Stage::Capture, self.active.len());
                let kinds: Vec<Option<StatsKind>> = (0..groups.len())
                    .map(|g| stage.contains(&g).then_some(solver_kinds[g]))
                    .collect();
                let (mut again, accumulate, finalize) =
                    self.capture(layer, &weights, &groups, &kinds, hidden, progress)?;
                for &g in stage {
                    stats[g] = again[g].take();
                }
                report.stages.accumulate += accumulate;
                report.stages.finalize += finalize;
                report.stages.capture += seconds_since(t) - accumulate - finalize;
                progress.stage(Stage::Solve, quantized.len());
            }
            let t = Instant::now();
            solved.extend(self.solve_layer(
                layer,
                &groups,
                stage,
                &mut weights,
                &stats,
                &smoothed,
                progress,
            )?);
            report.stages.solve += seconds_since(t);
        }

        let capture_ops = profile.map(|p| p.take());
        // The statistics (a GB of Hessians at full size) are not needed to propagate: their
        // pages go back to the driver before the next stage's buffers are asked for.
        drop(stats);
        self.release_free_pages();

        // The layer goes to the sink on a thread of its own while the hidden states go through
        // it: writing (encoding, copying into the shard) needs only the host and the solved
        // layer, so it costs the wall clock nothing while the forward keeps the device busy.
        let (written, propagated) = std::thread::scope(|scope| {
            let writer = scope.spawn(|| {
                let t = Instant::now();
                hand_over(sink, &solved, &weights, &quantized, &modified).map(|()| seconds_since(t))
            });
            let propagated = match self.outputs_read(layer) {
                true => {
                    let t = Instant::now();
                    progress.stage(Stage::Propagate, self.active.len());
                    let propagated = self.propagate(layer, &weights, hidden, progress);
                    self.release_free_pages();
                    propagated.map(|()| seconds_since(t))
                }
                // The last layer's outputs feed nothing that is calibrated (`lm_head` is
                // kept in 16 bits): a forward through it would be thrown away.
                false => Ok(0.0),
            };
            let written = writer
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (written, propagated)
        });
        report.stages.propagate = propagated?;
        report.stages.write = written?;
        report.ops = capture_ops.map(|capture| LayerOps {
            capture,
            propagate: profile.map(|p| p.take()).unwrap_or_default(),
        });
        report.peak_device_memory = self.layer_peak;
        report.peak_rss_bytes = peak_rss_bytes();
        self.peak_device = max_memory(self.peak_device, self.layer_peak);
        Ok(report)
    }

    /// Whether anything calibrated reads layer `layer`'s outputs: the next layer, or after the
    /// last one a quantized `lm_head`.
    fn outputs_read(&self, layer: usize) -> bool {
        layer + 1 < self.runner.config().num_layers()
            || self.plan.quantized().any(|l| l.layer.is_none())
    }

    /// What the run used and produced so far.
    pub fn totals(&self) -> EngineTotals {
        EngineTotals {
            samples: self.active.len(),
            tokens: self.active_tokens(),
            failed_samples: self.failed.clone(),
            linears: self.linears.clone(),
            peak_device_memory: self.peak_device,
        }
    }

    /// A failed forward pass: an error, or (when allowed) the sample is dropped and counted.
    fn sample_failed(
        &mut self,
        i: usize,
        layer: usize,
        message: String,
    ) -> Result<(), PipelineError> {
        let line = self.samples[i].line;
        if !self.options.skip_failed_samples {
            return Err(PipelineError::Sample {
                sample: i,
                line,
                layer,
                message,
            });
        }
        self.failed.push(format!(
            "sample {i} (line {line}) in layer {layer}: {message}"
        ));
        self.active.retain(|&k| k != i);
        if self.active.is_empty() {
            return Err(PipelineError::NoSamples("every sample failed".into()));
        }
        Ok(())
    }

    /// The active samples grouped into packs ([`pack_samples`] with `options.pack_tokens`).
    fn packs(&self) -> Vec<Vec<usize>> {
        let samples: Vec<(usize, usize)> = self
            .active
            .iter()
            .map(|&i| (i, self.samples[i].ids.len()))
            .collect();
        pack_samples(&samples, self.options.pack_tokens)
    }

    /// Token counts of a pack's samples.
    fn lengths(&self, pack: &[usize]) -> Vec<usize> {
        pack.iter().map(|&i| self.samples[i].ids.len()).collect()
    }

    /// A pack's forward pass failed as a whole: every sample of it failed with `message`.
    fn pack_failed(
        &mut self,
        pack: &[usize],
        layer: usize,
        message: &str,
    ) -> Result<(), PipelineError> {
        pack.iter()
            .try_for_each(|&i| self.sample_failed(i, layer, message.to_owned()))
    }

    /// Runs the layer on every active sample, feeding each input group with a kind in `kinds`
    /// to statistics of that kind. Returns the finalized statistics per input group and the
    /// seconds spent accumulating and finalizing them.
    fn capture(
        &mut self,
        layer: usize,
        weights: &LayerWeights,
        groups: &[InputGroup],
        kinds: &[Option<StatsKind>],
        hidden: &HiddenStates<B>,
        progress: &mut dyn Progress,
    ) -> Result<Captured<B>, PipelineError> {
        let first_reader: BTreeMap<&str, usize> = groups
            .iter()
            .enumerate()
            .filter(|(g, _)| kinds[*g].is_some())
            .map(|(g, group)| (group.readers[0].as_str(), g))
            .collect();
        let mut stats: Vec<Option<InputStats<B>>> = groups
            .iter()
            .zip(kinds)
            .map(|(group, kind)| kind.map(|k| self.new_stats(weights, group, k)).transpose())
            .collect::<Result<_, _>>()?;
        let runner = self.runner;
        let device_weights = runner.upload(weights)?;
        let device = runner.device();
        let mut accumulate = 0.0;
        for pack in self.packs() {
            let lengths = self.lengths(&pack);
            let input = concat_rows(
                pack.iter()
                    .map(|&i| hidden.load(i, runner.fast_ops()))
                    .collect::<Result<_, _>>()?,
            );
            // The first failure in the taps: the sample (index in the pack) it names, if any.
            let mut tap_error: Option<(Option<usize>, String)> = None;
            // Read at the taps, while the pack's intermediates are alive (after the pack they
            // are freed, and a reading then understates the layer's peak).
            let (probe, mut tap_peak) = (self.memory, None);
            let result =
                runner.capture_pack_from(&device_weights, input, &lengths, |name, x, rows| {
                    tap_peak = max_memory(tap_peak, probe.and_then(|probe| probe(device)));
                    let Some(&g) = first_reader.get(name) else {
                        return;
                    };
                    if tap_error.is_some() {
                        return;
                    }
                    if let Err(e) = sync::<B>(device) {
                        tap_error = Some((None, e));
                        return;
                    }
                    let t = Instant::now();
                    let added = match stats[g].as_mut() {
                        Some(s) => s
                            .add_pack(x, &lengths, rows, runner.fast_ops())
                            .map_err(|(s, e)| (s, format!("{name}: {e}"))),
                        None => Ok(()),
                    };
                    let synced = sync::<B>(device).map_err(|e| (None, e));
                    accumulate += seconds_since(t);
                    if let Err(e) = added.and(synced) {
                        tap_error = Some(e);
                    }
                });
            self.layer_peak = max_memory(self.layer_peak, tap_peak);
            match (result, tap_error) {
                (Ok(()), None) => {}
                (Ok(()), Some((Some(s), message))) => {
                    self.sample_failed(pack[s], layer, message)?
                }
                (Err(e), _) => self.pack_failed(&pack, layer, &e.to_string())?,
                (Ok(()), Some((None, message))) => self.pack_failed(&pack, layer, &message)?,
            }
            self.release_free_pages();
            for _ in &pack {
                progress.step();
            }
        }
        // Hessian products the fast ops left running beside the forward end before their
        // sums are read; the wait is the part of them the forward did not hide.
        sync::<B>(device).map_err(|message| PipelineError::Device { layer, message })?;
        let t = Instant::now();
        settle_grams(runner, layer)?;
        accumulate += seconds_since(t);
        let t = Instant::now();
        let finalized = stats
            .into_iter()
            .zip(groups)
            .map(|(s, group)| s.map(|s| s.finalize(&group.readers[0])).transpose())
            .collect::<Result<_, _>>()?;
        Ok((finalized, accumulate, seconds_since(t)))
    }

    /// The statistics the solver of each of layer `layer`'s input groups needs (in
    /// [`input_groups`] order): `XᵀX` for GPTQ, per-channel for NVFP4's search, both for GPTQ
    /// on the FP4 grid ([`QuantizeOptions::statistics`]).
    fn solver_kinds(&self, layer: usize) -> Vec<StatsKind> {
        let statistics = self.options.statistics();
        let widths = crate::budget::input_group_widths(self.runner.config(), layer);
        let widest = widths.iter().copied().max().unwrap_or(0);
        widths
            .iter()
            .map(
                |&w| match (statistics.full_hessian(w, widest), statistics.channels()) {
                    (true, false) => StatsKind::Full,
                    (true, true) => StatsKind::FullAndChannels,
                    (false, _) => StatsKind::Diagonal,
                },
            )
            .collect()
    }

    /// What the first capture of a layer accumulates per input group: the solver's statistics
    /// (`solver_kinds`) for the groups of the first stage; for the later stages of a
    /// true-sequential run only what smoothing reads (per-channel statistics of the original
    /// layer), since their solver statistics are captured again once the earlier stages are
    /// quantized.
    fn first_capture_kinds(
        &self,
        groups: &[InputGroup],
        needed: &[bool],
        stages: &[Vec<usize>],
        solver_kinds: &[StatsKind],
    ) -> Vec<Option<StatsKind>> {
        let first = stages.first().map(Vec::as_slice).unwrap_or_default();
        groups
            .iter()
            .enumerate()
            .map(|(g, group)| {
                if first.contains(&g) {
                    Some(solver_kinds[g])
                } else if needed[g] && self.smooths(group) {
                    Some(StatsKind::Diagonal)
                } else {
                    None
                }
            })
            .collect()
    }

    /// Whether SmoothQuant runs on `group`: smoothing is on, the plan marks the group
    /// ([`PlannedLinear::smooth_group`]; NVFP4: not up→down) and its source can absorb a scale.
    fn smooths(&self, group: &InputGroup) -> bool {
        let planned = self
            .plan
            .get(&group.readers[0])
            .and_then(|l| l.smooth_group.as_ref())
            .is_some();
        self.options.smoothing.is_some() && planned && smooth_group_of(group).is_some()
    }

    fn new_stats(
        &self,
        weights: &LayerWeights,
        group: &InputGroup,
        kind: StatsKind,
    ) -> Result<InputStats<B>, PipelineError> {
        let dim = weights.get(&format!("{}.weight", group.readers[0]))?.shape[1];
        let on_device = self.options.device_statistics.then(|| self.runner.device());
        InputStats::new(kind, dim, on_device).map_err(PipelineError::solve(&group.readers[0]))
    }

    /// SmoothQuant on every group the plan marks ([`PlannedLinear::smooth_group`]) with a
    /// quantized reader, α fixed or searched per group ([`Smoothing`]). Returns what each
    /// smoothed linear got.
    fn smooth(
        &self,
        groups: &[InputGroup],
        needed: &[bool],
        weights: &mut LayerWeights,
        stats: &mut [Option<Finalized<B>>],
        modified: &mut BTreeSet<String>,
    ) -> Result<BTreeMap<String, Smoothed>, PipelineError> {
        let mut smoothed = BTreeMap::new();
        let Some(smoothing) = self.options.smoothing else {
            return Ok(smoothed);
        };
        let readers = reader_map(groups);
        for (g, group) in groups.iter().enumerate() {
            if !needed[g] || !self.smooths(group) {
                continue;
            }
            let Some(smooth_group) = smooth_group_of(group) else {
                continue;
            };
            let name = group.source.name().to_owned();
            let smooth_err = |source| PipelineError::Smooth {
                group: name.clone(),
                source,
            };
            smooth_group.validate(&readers).map_err(smooth_err)?;
            let Some(finalized) = stats[g].as_mut() else {
                continue;
            };
            let act = finalized.rms();
            // The folded scales and their α; `None` when the search keeps the group as it is.
            let folded = match smoothing {
                Smoothing::Fixed(alpha) => {
                    let recipe = ScaleRecipe::original(alpha);
                    fold_group(weights, &smooth_group, fixed_scales(&recipe, &act))?
                        .map(|scales| (scales, alpha))
                }
                Smoothing::Searched(grid) => {
                    let mut chosen = None;
                    let scales = fold_group(weights, &smooth_group, |targets| {
                        let choice = self.search_alpha(grid, &act, targets)?;
                        chosen = choice.alpha;
                        Ok(choice.alpha.map(|_| choice.scales))
                    })?;
                    scales.zip(chosen)
                }
            };
            let Some((scales, alpha)) = folded else {
                continue;
            };
            finalized.rescale(&scales, &name)?;
            let range = scales
                .iter()
                .fold((f32::INFINITY, 0f32), |(lo, hi), &s| (lo.min(s), hi.max(s)));
            modified.insert(format!("{}.weight", smooth_group.source.name()));
            for t in &smooth_group.targets {
                modified.insert(format!("{t}.weight"));
                smoothed.insert(t.clone(), Smoothed { range, alpha });
            }
        }
        Ok(smoothed)
    }

    /// AWQ's α search on one group: every target scored by round to nearest in its planned
    /// format, channels weighted by `E[x²]` = `act²`.
    fn search_alpha(
        &self,
        grid: AlphaGrid,
        act: &[f32],
        targets: &[WeightMatrix<'_>],
    ) -> sala_smooth::Result<AlphaChoice> {
        let channel_weights: Vec<f32> = act.iter().map(|a| a * a).collect();
        let scheme = self.options.gptq.scheme;
        let treatments: BTreeMap<&str, &Treatment> = targets
            .iter()
            .filter_map(|t| {
                let linear = t.name().strip_suffix(".weight").unwrap_or(t.name());
                Some((t.name(), &self.plan.get(linear)?.treatment))
            })
            .collect();
        sala_smooth::search_alpha(
            &ScaleRecipe::original(0.5),
            grid,
            act,
            &channel_weights,
            targets,
            |name, x, _, cols, c| match treatments.get(name) {
                Some(treatment) => round_to_nearest_error(treatment, scheme, x, cols, c),
                None => 0.0,
            },
        )
    }

    /// Solves every quantized linear that reads an input group of `stage` and replaces its
    /// weight by the dequantized one.
    #[allow(clippy::too_many_arguments)]
    fn solve_layer(
        &mut self,
        layer: usize,
        groups: &[InputGroup],
        stage: &[usize],
        weights: &mut LayerWeights,
        stats: &[Option<Finalized<B>>],
        smoothed: &BTreeMap<String, Smoothed>,
        progress: &mut dyn Progress,
    ) -> Result<Vec<(String, Solved)>, PipelineError> {
        let group_of: BTreeMap<&str, usize> = groups
            .iter()
            .enumerate()
            .flat_map(|(g, group)| group.readers.iter().map(move |r| (r.as_str(), g)))
            .collect();
        let fused_scales = self.fused_global_scales(layer, weights)?;
        let mut solved = Vec::new();
        let planned: Vec<PlannedLinear> = self
            .plan
            .layer(layer)
            .filter(|l| l.treatment.is_quantized())
            .filter(|l| stage.contains(&group_of[l.name.as_str()]))
            .cloned()
            .collect();
        // A GPTQ linear's host finishing runs on a thread of its own while the next linear is
        // solved (a device would wait for it otherwise); one at a time, and settled in the
        // plan's order, which the reports and the checkpoint keep. It packs there too, but for
        // the last linear, which has no next solve to hide behind: that one's packing waits for
        // the writer ([`Solved::packed`]), which runs beside the forward.
        let pool = self.finishing_pool().clone();
        std::thread::scope(|scope| {
            let mut finishing: Option<Finishing<'_>> = None;
            let read_next = next_reads_same_hessian(&planned, &group_of, stats);
            let count = planned.len();
            for (i, (linear, read_next)) in planned.into_iter().zip(read_next).enumerate() {
                let pack_now = i + 1 < count;
                let solve = LinearSolve {
                    linear: &linear,
                    group: group_of[linear.name.as_str()],
                    read_next,
                };
                let (report, outcome) =
                    self.solve_linear(solve, weights, stats, smoothed, &fused_scales)?;
                if let Some(previous) = finishing.take() {
                    solved.push(self.settle(previous, weights)?);
                }
                match outcome {
                    SolveOutcome::Done(result) => {
                        self.linears.push(report);
                        solved.push((linear.name, Solved::Packed(result)));
                    }
                    SolveOutcome::Finishing(unfinished) => {
                        finishing = Some(Finishing {
                            name: linear.name,
                            report,
                            handle: {
                                let pool = pool.clone();
                                scope.spawn(move || match pool {
                                    Some(pool) => pool.install(|| finish(unfinished, pack_now)),
                                    None => finish(unfinished, pack_now),
                                })
                            },
                        })
                    }
                }
                self.release_free_pages();
                progress.step();
            }
            if let Some(last) = finishing {
                solved.push(self.settle(last, weights)?);
            }
            Ok(solved)
        })
    }

    /// Solves one planned linear, its report so far with it.
    fn solve_linear(
        &mut self,
        solve: LinearSolve<'_>,
        weights: &mut LayerWeights,
        stats: &[Option<Finalized<B>>],
        smoothed: &BTreeMap<String, Smoothed>,
        fused_scales: &BTreeMap<String, f32>,
    ) -> Result<(LinearReport, SolveOutcome), PipelineError> {
        let t = Instant::now();
        let LinearSolve { linear, group, .. } = solve;
        let input = stats[group].as_ref().ok_or_else(|| {
            PipelineError::NoSamples(format!("no statistics for {}", linear.name))
        })?;
        let weight_name = format!("{}.weight", linear.name);
        let w = weights.get_mut(&weight_name)?;
        let mut report = LinearReport {
            name: linear.name.clone(),
            treatment: treatment_label(&linear.treatment),
            out_features: linear.out_features,
            in_features: linear.in_features,
            gptq_loss: None,
            output_error: None,
            baseline_output_error: None,
            error_hessian: None,
            smooth_scale_range: smoothed.get(&linear.name).map(|s| s.range),
            smooth_alpha: smoothed.get(&linear.name).map(|s| s.alpha),
            damping_retries: 0,
            rtn_fallback: false,
            seconds: 0.0,
            solve_steps: BTreeMap::new(),
        };
        if input.dim() != linear.in_features {
            return Err(PipelineError::Unsupported(format!(
                "{}: statistics of dimension {} for {} input features",
                linear.name,
                input.dim(),
                linear.in_features
            )));
        }
        let result = match (&linear.treatment, input) {
            (Treatment::Int { bits, group_size }, h @ Finalized::Full(_))
            | (Treatment::Int { bits, group_size }, h @ Finalized::DeviceFull(_)) => {
                SolveOutcome::Finishing(self.solve_gptq(
                    solve,
                    *bits,
                    *group_size,
                    &w.data,
                    h,
                    &mut report,
                )?)
            }
            (Treatment::Nvfp4, stats @ Finalized::Diagonal(_))
            | (Treatment::Nvfp4, stats @ Finalized::FullAndChannels(..)) => {
                let global = fused_scales[&linear.name];
                SolveOutcome::Done(self.solve_nvfp4(
                    solve,
                    &mut w.data,
                    stats,
                    global,
                    &mut report,
                )?)
            }
            _ => {
                return Err(PipelineError::Unsupported(format!(
                    "{}: treatment and statistics disagree",
                    linear.name
                )))
            }
        };
        report.seconds = seconds_since(t);
        self.add_solver_steps(&mut report.solve_steps);
        Ok((report, result))
    }

    /// The threads for GPTQ's host finishing, built at first use: half as many as the global
    /// pool's.
    fn finishing_pool(&self) -> &Option<Arc<rayon::ThreadPool>> {
        self.finishing_pool.get_or_init(|| {
            rayon::ThreadPoolBuilder::new()
                .num_threads((rayon::current_num_threads() / 2).max(1))
                .thread_name(|i| format!("sala-finish-{i}"))
                .build()
                .ok()
                .map(Arc::new)
        })
    }

    /// Waits for a GPTQ linear's host finishing, records it in its report and replaces its
    /// weight by the dequantized one (a move: no 268 MB copy).
    fn settle(
        &mut self,
        finishing: Finishing<'_>,
        weights: &mut LayerWeights,
    ) -> Result<(String, Solved), PipelineError> {
        let Finishing {
            name,
            mut report,
            handle,
        } = finishing;
        let finished = handle
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            .map_err(PipelineError::solve(&name))?;
        let mut q = finished.quantized;
        report.gptq_loss = Some(q.loss);
        report.output_error = q.proxy_error;
        report.error_hessian = Some(ErrorHessian::Full);
        report.damping_retries = q.damping_retries;
        report.rtn_fallback = q.method == Method::RtnFallback;
        if let Some(seconds) = finished.finish_seconds {
            report.add_step("solver: finish (host)", seconds);
        }
        report.seconds += finished.finish_seconds.unwrap_or(0.0);
        if let Some(seconds) = finished.pack_seconds {
            report.add_step("pack", seconds);
            report.seconds += seconds;
        }
        weights.get_mut(&format!("{name}.weight"))?.data = std::mem::take(&mut q.dequantized);
        self.linears.push(report);
        let solved = match finished.packed {
            Some(packed) => Solved::Packed(SolvedLinear::Gptq(packed)),
            None => Solved::Unpacked(q),
        };
        Ok((name, solved))
    }

    /// Adds the solvers' own step times since the last call to `steps`, as `solver: STEP`.
    fn add_solver_steps(&self, steps: &mut BTreeMap<String, f64>) {
        let resident = self.resident.as_ref().map(|r| r.take_step_seconds());
        let host = self.solver.take_step_seconds();
        for (step, seconds) in resident.into_iter().flatten().chain(host) {
            *steps.entry(format!("solver: {step}")).or_default() += seconds;
        }
    }

    /// GPTQ of one linear up to the host's finishing ([`finish`]), which the caller
    /// runs beside the next linear's solve.
    fn solve_gptq(
        &self,
        solve: LinearSolve<'_>,
        bits: u32,
        group_size: usize,
        w: &[f32],
        h: &Finalized<B>,
        report: &mut LinearReport,
    ) -> Result<UnfinishedGptq, PipelineError> {
        let linear = solve.linear;
        let (out, inp) = (linear.out_features, linear.in_features);
        let opts = &self.options.gptq;
        let config = opts.solver_config(bits, group_size);
        let grid = config.grid;
        let solve_err = PipelineError::solve(&linear.name);
        // The options are checked here whatever the solver (and even under --rtn).
        Gptq::new(config).map_err(solve_err)?;
        // A device Hessian comes to the host only for a solver that needs it there.
        let host = std::cell::OnceCell::<std::borrow::Cow<'_, Hessian<f64>>>::new();
        let host_hessian = || -> Result<&Hessian<f64>, PipelineError> {
            if let Some(hessian) = host.get() {
                return Ok(hessian);
            }
            let hessian = h.host_hessian(&linear.name)?.ok_or_else(|| {
                PipelineError::Unsupported(format!("{}: no full Hessian", linear.name))
            })?;
            Ok(host.get_or_init(|| hessian))
        };
        let resident = match (h, &self.resident) {
            (Finalized::DeviceFull(tensor), Some(resident)) => Some((
                resident,
                ResidentHessian {
                    tensor,
                    read_next: solve.read_next,
                },
            )),
            _ => None,
        };
        let rtn = |grid: IntGrid| match resident {
            Some((solver, device_h)) => solver
                .quantize_rtn(grid, w, out, inp, device_h.tensor)
                .map_err(solve_err),
            None => self
                .solver
                .quantize_rtn(grid, w, out, inp, host_hessian()?)
                .map_err(solve_err),
        };
        // The baseline is plain round-to-nearest on the group's min/max range: the clipping
        // search (on the host, the whole matrix at once) would cost as much as the solver's
        // own and measure the search rather than the solver.
        let plain = IntGrid { clip: None, ..grid };
        let t = Instant::now();
        let (q, baseline) = match resident {
            _ if opts.rtn => (UnfinishedGptq::finished(rtn(grid)?), None),
            // One upload of the weights serves the solve and the baseline.
            Some((solver, device_h)) if self.options.compare_rtn => {
                let both = solver
                    .solve_gptq_with_baseline(&config, plain, w, out, inp, device_h)
                    .map_err(solve_err)?;
                let baseline = (both.baseline_proxy_error, both.baseline_seconds);
                (both.quantized, Some(baseline))
            }
            Some((solver, device_h)) => (
                solver
                    .solve_gptq(&config, w, out, inp, device_h)
                    .map_err(solve_err)?,
                None,
            ),
            None => (
                UnfinishedGptq::finished(
                    self.solver
                        .solve_gptq(&config, w, out, inp, host_hessian()?)
                        .map_err(solve_err)?,
                ),
                None,
            ),
        };
        let baseline_seconds = baseline.map_or(0.0, |(_, seconds)| seconds);
        report.add_step("solve", seconds_since(t) - baseline_seconds);
        if self.options.compare_rtn {
            let (error, seconds) = match baseline {
                Some(both) => both,
                None => {
                    let t = Instant::now();
                    (rtn(plain)?.proxy_error, seconds_since(t))
                }
            };
            report.baseline_output_error = error;
            report.add_step("baseline", seconds);
        }
        Ok(q)
    }

    fn solve_nvfp4(
        &self,
        solve: LinearSolve<'_>,
        w: &mut Vec<f32>,
        stats: &Finalized<B>,
        global: f32,
        report: &mut LinearReport,
    ) -> Result<SolvedLinear, PipelineError> {
        let linear = solve.linear;
        let (out, inp) = (linear.out_features, linear.in_features);
        let format_err = |source| PipelineError::Format {
            linear: linear.name.clone(),
            source,
        };
        let s = stats.channels().ok_or_else(|| {
            PipelineError::Unsupported(format!("{}: no channel statistics", linear.name))
        })?;
        let diag: Vec<f32> = s.mean_square.iter().map(|&d| d as f32).collect();
        let act_amax = s.abs_max.iter().fold(0f32, |m, &v| m.max(v));
        // A device Hessian stays there with a resident solver, else comes to the host.
        let resident = match (stats.device_hessian(), &self.resident) {
            (Some(tensor), Some(solver)) => Some((
                solver,
                ResidentHessian {
                    tensor,
                    read_next: solve.read_next,
                },
            )),
            _ => None,
        };
        let hessian = match resident {
            Some(_) => None,
            None => stats.host_hessian(&linear.name)?,
        };
        // GPTQ minimizes the full proxy `tr(ΔW H ΔWᵀ)` and the search the diagonal one: each
        // run reports (and compares with max calibration) the error its solver minimizes. The
        // solvers compute both figures beside their solve, but for GPTQ on a host Hessian:
        // there max calibration runs on a thread of its own while the solver works, and its
        // full proxy error after.
        let compare = self.options.compare_rtn;
        let host_baseline = compare && resident.is_none() && hessian.is_some();
        let weights: &[f32] = w;
        let (solved, host_max) = std::thread::scope(|scope| {
            let host_max = host_baseline.then(|| {
                scope.spawn(|| {
                    Nvfp4Matrix::quantize(weights, out, inp, global, BlockScales::Max)
                        .map(|max| max.dequantize())
                })
            });
            let t = Instant::now();
            let solved = self.nvfp4_solution(
                weights,
                compare,
                out,
                inp,
                global,
                resident,
                hessian.as_deref(),
                &diag,
                report,
            );
            let baseline_seconds = solved.as_ref().map_or(0.0, |s| s.baseline_seconds);
            report.add_step("solve", seconds_since(t) - baseline_seconds);
            let t = Instant::now();
            let host_max = host_max.map(|handle| {
                handle
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            });
            (solved, host_max.map(|max| (max, t)))
        });
        let Nvfp4Solution {
            matrix,
            dequantized,
            error,
            error_hessian,
            baseline,
            baseline_seconds,
        } = solved?;
        if baseline.is_some() {
            report.baseline_output_error = baseline;
            if baseline_seconds > 0.0 {
                report.add_step("baseline", baseline_seconds);
            }
        }
        if let (Some((max, t)), Some(h)) = (host_max, hessian.as_deref()) {
            let max = max.map_err(format_err)?;
            report.baseline_output_error = Some(proxy_error(w, &max, inp, h));
            report.add_step("baseline", seconds_since(t));
        }
        report.output_error = Some(error);
        report.error_hessian = Some(error_hessian);
        // A move, not a copy of up to 268 MB (a 16384 × 4096 linear).
        *w = dequantized;
        let input_scale = global_scale_from_amax(act_amax).map_err(format_err)?;
        Ok(SolvedLinear::Nvfp4(matrix, input_scale))
    }

    /// NVFP4's solver on one linear: GPTQ on the FP4 grid where there is a full Hessian
    /// (`resident` on the device, else `hessian` on the host), else the block search on the
    /// diagonal `diag`; with `compare`, the report's max-calibration baseline where the solver
    /// computes it (all but GPTQ on a host Hessian).
    #[allow(clippy::too_many_arguments)]
    fn nvfp4_solution(
        &self,
        w: &[f32],
        compare: bool,
        out: usize,
        inp: usize,
        global: f32,
        resident: Option<ResidentProblem<'_, B>>,
        hessian: Option<&Hessian<f64>>,
        diag: &[f32],
        report: &mut LinearReport,
    ) -> Result<Nvfp4Solution, PipelineError> {
        let name = report.name.clone();
        let format_err = |source| PipelineError::Format {
            linear: name.clone(),
            source,
        };
        let solve_err = PipelineError::solve(&name);
        let options = self.options.nvfp4_gptq();
        let gptq = match (resident, hessian) {
            (Some((solver, h)), _) if compare => Some(
                solver
                    .solve_nvfp4_gptq_with_baseline(&options, w, out, inp, h, global)
                    .map(|q| {
                        let baseline = (q.baseline_proxy_error, q.baseline_seconds);
                        (q.quantized, Some(baseline))
                    }),
            ),
            (Some((solver, h)), _) => Some(
                solver
                    .solve_nvfp4_gptq(&options, w, out, inp, h, global)
                    .map(|q| (q, None)),
            ),
            (None, Some(h)) => Some(
                self.solver
                    .solve_nvfp4_gptq(&options, w, out, inp, h, global)
                    .map(|q| (q, None)),
            ),
            (None, None) => None,
        };
        // The matrix from the solver's codes and scales, with its dequantized values and the
        // errors the solver computed.
        match gptq {
            Some(q) => {
                let (q, baseline) = q.map_err(solve_err)?;
                report.gptq_loss = Some(q.loss);
                report.damping_retries = q.damping_retries;
                report.rtn_fallback = q.method == Method::RtnFallback;
                let matrix = Nvfp4Matrix::from_codes(&q.codes, out, inp, global, q.block_scales)
                    .map_err(format_err)?;
                Ok(Nvfp4Solution {
                    matrix,
                    dequantized: q.dequantized,
                    error: q.proxy_error,
                    error_hessian: ErrorHessian::Full,
                    baseline: baseline.map(|(error, _)| error),
                    baseline_seconds: baseline.map_or(0.0, |(_, seconds)| seconds),
                })
            }
            None => {
                let search = &self.options.nvfp4_search;
                let (found, errors) = self
                    .solver
                    .search_nvfp4_with_errors(search, compare, w, out, inp, diag, global)
                    .map_err(solve_err)?;
                let matrix =
                    Nvfp4Matrix::from_codes(&found.codes, out, inp, global, found.block_scales)
                        .map_err(format_err)?;
                Ok(Nvfp4Solution {
                    matrix,
                    dequantized: found.dequantized,
                    error: errors.error,
                    error_hessian: ErrorHessian::Diagonal,
                    baseline: errors.max_calibration,
                    baseline_seconds: 0.0,
                })
            }
        }
    }

    /// NVFP4 global scales: one per fused group (q/k/v, gate/up: the max of the members'
    /// amax, since SGLang reduces the shards' scales with `max()`), one per other linear.
    fn fused_global_scales(
        &self,
        layer: usize,
        weights: &LayerWeights,
    ) -> Result<BTreeMap<String, f32>, PipelineError> {
        let mut amax_of_group: BTreeMap<String, f32> = BTreeMap::new();
        let mut key_of = BTreeMap::new();
        for l in self
            .plan
            .layer(layer)
            .filter(|l| l.treatment == Treatment::Nvfp4)
        {
            let w = weights.get(&format!("{}.weight", l.name))?;
            let amax = w.data.par_iter().map(|v| v.abs()).reduce(|| 0f32, f32::max);
            let key = l.fused_group.clone().unwrap_or_else(|| l.name.clone());
            let entry = amax_of_group.entry(key.clone()).or_insert(0.0);
            *entry = entry.max(amax);
            key_of.insert(l.name.clone(), key);
        }
        key_of
            .into_iter()
            .map(|(name, key)| {
                global_scale_from_amax(amax_of_group[&key])
                    .map(|g| (name.clone(), g))
                    .map_err(|source| PipelineError::Format {
                        linear: name,
                        source,
                    })
            })
            .collect()
    }

    /// Re-runs the (now quantized) layer on every active sample: the next layer's inputs.
    fn propagate(
        &mut self,
        layer: usize,
        weights: &LayerWeights,
        hidden: &mut HiddenStates<B>,
        progress: &mut dyn Progress,
    ) -> Result<(), PipelineError> {
        let runner = self.runner;
        let device_weights: DeviceLayerWeights<B> = runner.upload(weights)?;
        let width = self.config().hidden_size();
        for pack in self.packs() {
            let lengths = self.lengths(&pack);
            let input = concat_rows(
                pack.iter()
                    .map(|&i| hidden.load(i, runner.fast_ops()))
                    .collect::<Result<_, _>>()?,
            );
            // Read at the taps, while the pack's intermediates are alive.
            let (probe, device, mut tap_peak) = (self.memory, runner.device(), None);
            let result = runner.run_pack_from(&device_weights, input, &lengths, |_, _, _| {
                tap_peak = max_memory(tap_peak, probe.and_then(|probe| probe(device)));
            });
            self.layer_peak = max_memory(self.layer_peak, tap_peak);
            match result {
                Ok(y) => {
                    let mut start = 0;
                    for (&i, &len) in pack.iter().zip(&lengths) {
                        let rows = y.clone().slice([start..start + len, 0..width]);
                        hidden.store(i, rows, runner.fast_ops())?;
                        start += len;
                    }
                }
                Err(e) => self.pack_failed(&pack, layer, &e.to_string())?,
            }
            self.release_free_pages();
            for _ in &pack {
                progress.step();
            }
        }
        sync::<B>(runner.device()).map_err(|message| PipelineError::Device { layer, message })
    }
}

/// The input groups each capture of a layer serves, in forward order: one capture for every
/// needed group (`needed[g]`), or with `true_sequential` one per group, each captured after the
/// groups before it are quantized (GPTQModel's default order: attention inputs, `o_proj`,
/// gate/up, down).
fn capture_stages(needed: &[bool], true_sequential: bool) -> Vec<Vec<usize>> {
    let groups = needed
        .iter()
        .enumerate()
        .filter(|(_, &n)| n)
        .map(|(g, _)| g);
    if true_sequential {
        groups.map(|g| vec![g]).collect()
    } else {
        vec![groups.collect()]
    }
}

/// The samples of a pack back to back (the sample itself for a pack of one).
fn concat_rows<B: Backend>(parts: Vec<Tensor<B, 2>>) -> Tensor<B, 2> {
    match <[Tensor<B, 2>; 1]>::try_from(parts) {
        Ok([one]) => one,
        Err(parts) => Tensor::cat(parts, 0),
    }
}

/// One linear to solve: its plan, the input group whose statistics it reads, and whether the
/// linear solved after it is GPTQ on the same group's Hessian.
#[derive(Clone, Copy)]
struct LinearSolve<'a> {
    linear: &'a PlannedLinear,
    group: usize,
    read_next: bool,
}

/// For each of `planned` (in solve order), whether it and the next one are both GPTQ on the
/// same input group's Hessian (a linear is GPTQ when its group has a full Hessian: integer
/// linears always, NVFP4 ones per [`QuantizeOptions::statistics`]): the solver may then keep
/// the Hessian's damped factor for the next one.
fn next_reads_same_hessian<B: Backend>(
    planned: &[PlannedLinear],
    group_of: &BTreeMap<&str, usize>,
    stats: &[Option<Finalized<B>>],
) -> Vec<bool> {
    let gptq_group = |l: &PlannedLinear| {
        group_of.get(l.name.as_str()).copied().filter(|&g| {
            stats
                .get(g)
                .and_then(Option::as_ref)
                .is_some_and(Finalized::has_hessian)
        })
    };
    let groups: Vec<Option<usize>> = planned.iter().map(gptq_group).collect();
    (0..groups.len())
        .map(
            |i| match (groups[i], groups.get(i + 1).copied().flatten()) {
                (Some(this), Some(next)) => this == next,
                _ => false,
            },
        )
        .collect()
}

/// A resident solver and the device Hessian it solves with.
type ResidentProblem<'a, B> = (&'a Arc<dyn ResidentSolver<B>>, ResidentHessian<'a, B>);

/// One NVFP4 linear's solution ([`Engine::solve_linear`]'s NVFP4 solvers).
struct Nvfp4Solution {
    /// The packed codes and scales.
    matrix: Nvfp4Matrix,
    /// Their dequantized values, `[out, in]`.
    dequantized: Vec<f32>,
    /// The proxy error the solver minimizes (GPTQ's full one, the search's diagonal one).
    error: f64,
    /// Which Hessian `error` and `baseline` are measured with.
    error_hessian: ErrorHessian,
    /// The same error of max calibration (the report's baseline), where the solver
    /// computed it.
    baseline: Option<f64>,
    /// Seconds the solver spent on the baseline apart from its solve (0 when they overlap or
    /// are in its own step times).
    baseline_seconds: f64,
}

/// One linear's result from [`Engine::solve_linear`].
enum SolveOutcome {
    /// Solved, packed, its weight replaced by the dequantized one.
    Done(SolvedLinear),
    /// GPTQ whose host finishing is still to run ([`finish`], then `settle`).
    Finishing(UnfinishedGptq),
}

/// A settled linear on its way to the sink.
enum Solved {
    /// In the checkpoint's form already (NVFP4's packing is part of its solve).
    Packed(SolvedLinear),
    /// GPTQ's codes and parameters (the dequantized weight moved out), packed by the writer:
    /// the stage's last linear, whose packing would otherwise hold up the forward that needs
    /// only the dequantized weights.
    Unpacked(QuantizedLinear),
}

impl Solved {
    /// The checkpoint's form: GPTQ is packed here (AutoGPTQ, v1 zeros).
    fn packed(&self, name: &str) -> Result<std::borrow::Cow<'_, SolvedLinear>, PipelineError> {
        match self {
            Solved::Packed(linear) => Ok(std::borrow::Cow::Borrowed(linear)),
            Solved::Unpacked(q) => Ok(std::borrow::Cow::Owned(SolvedLinear::Gptq(
                q.pack().map_err(PipelineError::solve(name))?,
            ))),
        }
    }
}

/// A GPTQ linear whose host finishing runs on a thread of the solve loop's scope.
struct Finishing<'scope> {
    name: String,
    report: LinearReport,
    handle: std::thread::ScopedJoinHandle<'scope, Result<FinishedGptq, HessianError>>,
}

/// [`finish`]'s result.
struct FinishedGptq {
    quantized: QuantizedLinear,
    /// The AutoGPTQ packing, when it was asked for.
    packed: Option<GptqPacked>,
    /// Seconds of the finishing, when there was any to do.
    finish_seconds: Option<f64>,
    /// Seconds of the packing, when it was done.
    pack_seconds: Option<f64>,
}

/// The host's part of a GPTQ linear after the solver's: the codes back in the original order,
/// the dequantized weight and, with `pack`, the AutoGPTQ packing (which then holds half a byte
/// per weight where the codes hold one).
fn finish(unfinished: UnfinishedGptq, pack: bool) -> Result<FinishedGptq, HessianError> {
    let t = Instant::now();
    let finishing = unfinished.needs_finishing();
    let quantized = unfinished.finish()?;
    let finish_seconds = finishing.then(|| seconds_since(t));
    let t = Instant::now();
    let packed = pack.then(|| quantized.pack()).transpose()?;
    Ok(FinishedGptq {
        pack_seconds: packed.as_ref().map(|_| seconds_since(t)),
        quantized,
        packed,
        finish_seconds,
    })
}

fn hand_over(
    sink: &mut dyn LayerSink,
    solved: &[(String, Solved)],
    weights: &LayerWeights,
    quantized: &BTreeSet<String>,
    modified: &BTreeSet<String>,
) -> Result<(), PipelineError> {
    for (name, linear) in solved {
        sink.quantized(name, &*linear.packed(name)?)?;
    }
    for (name, tensor) in &weights.tensors {
        let module = name.strip_suffix(".weight").unwrap_or(name);
        if !quantized.contains(module) {
            sink.kept(name, tensor, modified.contains(name))?;
        }
    }
    Ok(())
}

/// What smoothing did to one linear's input.
#[derive(Debug, Clone, Copy)]
struct Smoothed {
    /// The range of the scales folded into the input columns.
    range: (f32, f32),
    /// The group's migration strength α (fixed or searched).
    alpha: f32,
}

fn treatment_label(t: &Treatment) -> String {
    match t {
        Treatment::Int { bits, group_size } => format!("INT{bits} g{group_size}"),
        Treatment::Nvfp4 => "FP4".into(),
        Treatment::Keep { .. } => "bf16".into(),
    }
}
