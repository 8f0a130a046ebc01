//! A whole quantization into a checkpoint: open the model, plan, then the per-layer
//! [`LayerEngine`] over the checkpoint's weights into a [`CheckpointWriter`], then the global
//! tensors, the quantization config and the verifier, all inside the staging directory; the
//! commit (a rename) comes last.

pub use crate::engine::Sample;
use crate::engine::{LayerEngine, MemoryProbe};
use crate::error::PipelineError;
use crate::io::{CheckpointSink, CheckpointSource};
use crate::options::QuantizeOptions;
use crate::plan::{QuantPlan, Recipe, Treatment};
use crate::progress::Progress;
use crate::report::{peak_rss_bytes, Report};
use crate::resident::ResidentSolver;
use crate::resume;
use burn::tensor::backend::Backend;
use sala_export::{
    CheckpointWriter, GptqConfig, Nvfp4Config, QuantizationConfig, StagedCheckpoint, WriterOptions,
};
use sala_hessian::solver::{CpuSolver, LinearSolver};
use sala_model::{FastOps, LayerRunner, LayerWeights, ModelError, SalaConfig, TensorStore};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// Runs a whole quantization: reads `input`, writes a verified checkpoint to `output`.
pub struct Pipeline<B: Backend> {
    device: B::Device,
    options: QuantizeOptions,
    solver: Box<dyn LinearSolver>,
    memory: Option<MemoryProbe<B>>,
    fast: Option<Arc<dyn FastOps<B>>>,
    resident: Option<Arc<dyn ResidentSolver<B>>>,
}

impl<B: Backend> Pipeline<B> {
    /// A pipeline on `device` with `options`, solving on the host ([`CpuSolver`]).
    pub fn new(device: B::Device, options: QuantizeOptions) -> Self {
        Self {
            device,
            options,
            solver: Box::new(CpuSolver),
            memory: None,
            fast: None,
            resident: None,
        }
    }

    /// Solves GPTQ on the device Hessians of device statistics with `resident` (only
    /// weights, codes and figures cross the bus) instead of downloading them for the solver.
    pub fn with_resident_solver(mut self, resident: Arc<dyn ResidentSolver<B>>) -> Self {
        self.resident = Some(resident);
        self
    }

    /// Runs the model's heaviest steps with `fast` (e.g. `CubeFastOps` on CUDA) instead of
    /// the Burn graph.
    pub fn with_fast_ops(mut self, fast: Arc<dyn FastOps<B>>) -> Self {
        self.fast = Some(fast);
        self
    }

    /// Solves every linear with `solver` instead (e.g. a GPU implementation).
    pub fn with_solver(mut self, solver: Box<dyn LinearSolver>) -> Self {
        self.solver = solver;
        self
    }

    /// Samples the device memory with `probe` (reported per layer and for the run).
    pub fn with_memory_probe(mut self, probe: MemoryProbe<B>) -> Self {
        self.memory = Some(probe);
        self
    }

    /// The options.
    pub fn options(&self) -> &QuantizeOptions {
        &self.options
    }

    /// The device.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// The solver's name.
    pub fn solver_name(&self) -> &str {
        self.solver.name()
    }

    /// Quantizes the model in `input` with `samples` and writes the checkpoint to `output`,
    /// with the run report as [`sala_export::REPORT_FILE`]: [`run_staged`](Self::run_staged),
    /// the report written into the staging directory, then the commit.
    ///
    /// On any error the output directory is absent (or, with `overwrite`, the old one intact).
    pub fn run(
        &self,
        input: &Path,
        output: &Path,
        samples: &[Sample],
        progress: &mut dyn Progress,
    ) -> Result<Report, PipelineError> {
        let StagedRun {
            report,
            mut checkpoint,
        } = self.run_staged(input, output, samples, progress)?;
        let json =
            serde_json::to_vec_pretty(&serde_json::json!({ "report": &report })).map_err(|e| {
                PipelineError::Io {
                    path: checkpoint.path().join(sala_export::REPORT_FILE),
                    message: e.to_string(),
                }
            })?;
        checkpoint.write_file(sala_export::REPORT_FILE, &json)?;
        checkpoint.commit()?;
        Ok(report)
    }

    /// Quantizes the model in `input` with `samples` into a verified checkpoint that is still
    /// in its staging directory next to `output`: the caller adds files (a report) and commits
    /// it ([`StagedCheckpoint::commit`]), or drops it and nothing is left.
    ///
    /// The verifier runs on the staged files: a checkpoint that fails it is removed and the
    /// output (absent, or with `overwrite` the old one) is untouched.
    pub fn run_staged(
        &self,
        input: &Path,
        output: &Path,
        samples: &[Sample],
        progress: &mut dyn Progress,
    ) -> Result<StagedRun, PipelineError> {
        let started = Instant::now();
        if samples.is_empty() {
            return Err(PipelineError::NoSamples(
                "the calibration set is empty".into(),
            ));
        }
        let config = SalaConfig::from_file(&input.join("config.json"))?;
        let store = TensorStore::open(input)?;
        store.check_config(&config)?;
        let plan = QuantPlan::build(&config, &self.options.plan)?;
        self.options.check(&plan)?;
        check_copied_finite(&store, &config, &plan)?;
        check_token_ids(samples, &config)?;
        for dropped in unused_tensors(&store, &config)? {
            progress.message(&format!(
                "warning: {dropped} is not written to the checkpoint (a buffer the loaders \
                 rebuild)"
            ));
        }
        if plan
            .get("lm_head")
            .is_some_and(|l| l.treatment.is_quantized())
        {
            return Err(PipelineError::Unsupported(
                "--quantize-lm-head: calibrating lm_head is not implemented yet".into(),
            ));
        }
        // A resumable run: the fingerprint, and a staged run to continue if there is one,
        // checked before anything is created or computed.
        let fingerprint = match self.options.resume {
            true => Some(resume::fingerprint(
                input,
                &self.options,
                samples,
                self.solver.name(),
            )?),
            false => None,
        };
        let resumed = match &fingerprint {
            None => None,
            Some(now) => match sala_export::find_resumable(output)? {
                Some(dir) => {
                    let manifest = resume::Manifest::read_matching(&dir, now)?;
                    Some(resume::Resumed { dir, manifest })
                }
                None => {
                    progress.message(&format!(
                        "--resume: no staged run to resume for {}; starting a fresh run",
                        output.display()
                    ));
                    None
                }
            },
        };
        let writer_options = WriterOptions {
            max_shard_bytes: self.options.max_shard_bytes,
            overwrite: self.options.overwrite,
            source_model: Some(input.to_path_buf()),
        };
        let mut writer = match &resumed {
            Some(r) => {
                let pending = r
                    .manifest
                    .pending_tensors(&r.dir.join(sala_export::RESUME_DIR))?;
                CheckpointWriter::resume(
                    output,
                    writer_options,
                    &r.dir,
                    r.manifest.writer(),
                    pending,
                )?
            }
            None => CheckpointWriter::create(output, writer_options)?,
        };
        for line in writer.recovered() {
            progress.message(line);
        }
        let mut log = match fingerprint {
            Some(fingerprint) => {
                let previous = resumed.map(|r| r.manifest);
                if previous.is_some() {
                    // It holds completed layers: kept if this run stops too.
                    writer.set_resumable(true);
                }
                let log = resume::ResumeLog::open(writer.staging_dir(), fingerprint, previous)?;
                writer.record(true);
                Some(log)
            }
            None => None,
        };
        let runner = with_fast(
            LayerRunner::<B>::new(config.clone(), self.device.clone(), self.options.run),
            self.fast.clone(),
        );
        let source = CheckpointSource {
            store: &store,
            config: &config,
        };
        let mut engine =
            LayerEngine::new(&self.options, &plan, &runner, self.solver.as_ref(), samples)?
                .with_memory_probe(self.memory)
                .with_resident_solver(self.resident.clone());
        let scratch = writer.staging_dir().to_path_buf();
        progress.start(config.num_layers(), samples.len());
        let mut layers = Vec::new();
        let mut first = 0;
        let resumed = log.as_ref().filter(|l| l.manifest().completed() > 0);
        let mut hidden = match resumed {
            Some(log) => {
                let manifest = log.manifest();
                let (active, failed, peak) = manifest.engine();
                let (saved_layers, linears) = manifest.reports();
                engine.restore(active, failed, peak, linears)?;
                let mut hidden = engine.allocate_hidden(&scratch)?;
                hidden.restore(&log.dir().join(manifest.hidden_file()))?;
                engine.tell_hidden(&hidden, progress);
                first = manifest.completed();
                layers = saved_layers;
                progress.message(&format!(
                    "--resume: continuing the staged run {} at layer {first}: layers 0 to {} \
                     are complete",
                    writer.adopted().unwrap_or(&scratch).display(),
                    first - 1
                ));
                hidden
            }
            _ => engine.embed(&source, &scratch, progress)?,
        };
        let layer_count = config.num_layers();
        let read = |layer: usize| LayerWeights::load(&store, &config, layer);
        std::thread::scope(|scope| -> Result<(), PipelineError> {
            // The next layer's weights, read beside this layer's work.
            let mut next = None;
            for layer in first..layer_count {
                progress.layer(layer);
                let t = Instant::now();
                let weights = match next.take() {
                    Some(reading) => joined(reading)?,
                    None => read(layer)?,
                };
                let load = t.elapsed().as_secs_f64();
                if self.options.prefetch_weights && layer + 1 < layer_count {
                    next = Some(scope.spawn(move || read(layer + 1)));
                }
                let linears_before = engine.linear_count();
                let mut sink = CheckpointSink {
                    writer: &mut writer,
                    store: &store,
                };
                let report =
                    engine.layer_loaded(layer, weights, load, &mut hidden, &mut sink, progress)?;
                if let Some(log) = &mut log {
                    log.layer_done(
                        &mut writer,
                        &hidden,
                        &report,
                        engine.linears_from(linears_before),
                        engine.saved_state(),
                    )?;
                }
                progress.layer_done(&report);
                if log.is_some() {
                    progress.layer_saved(layer);
                }
                layers.push(report);
            }
            Ok(())
        })?;
        writer.record(false);
        write_globals(&store, &config, &mut writer)?;
        let model_config = sala_export::config::read_json(&input.join("config.json"))?;
        let quantization = quantization_config(&plan, &self.options);
        // A resumable run stays resumable until the last shard is on disk (a full disk here
        // can be resumed after every layer); then the staging directory is unmarked and the
        // resume state removed.
        let checkpoint = writer.finish_staged(model_config, &quantization)?;
        if let Some(log) = log {
            log.finish()?;
        }
        let verdict = checkpoint.verify_for(plan.target)?;
        if !verdict.is_ok() {
            // Dropping the staged checkpoint removes it; the output was never touched.
            return Err(PipelineError::Verify(verdict.to_string()));
        }
        let written = checkpoint.written().clone();
        progress.finish();
        let totals = engine.totals();
        let report = Report {
            recipe: match plan.recipe {
                Recipe::Gptq => "gptq".into(),
                Recipe::Nvfp4 => "nvfp4".into(),
            },
            input: input.display().to_string(),
            output: written.dir.display().to_string(),
            samples: totals.samples,
            tokens: totals.tokens,
            failed_samples: totals.failed_samples,
            layers,
            linears: totals.linears,
            seconds: started.elapsed().as_secs_f64(),
            peak_rss_bytes: peak_rss_bytes(),
            hidden_state_bytes: hidden.bytes(),
            hidden_states_on_disk: hidden.on_disk(),
            hidden_states_location: hidden.location(),
            statistics_on_device: self.options.device_statistics,
            solver: self.solver.name().to_owned(),
            peak_device_memory: totals.peak_device_memory,
            output_bytes: written.tensor_bytes,
            verify_summary: format!(
                "verified ok: {} tensors, {} quantized linears, {:.1} MB, {:.3} bits per quantized weight",
                verdict.summary.tensors,
                verdict.summary.quantized_linears,
                verdict.summary.tensor_bytes as f64 / 1e6,
                verdict.summary.bits_per_quantized_weight()
            ),
        };
        Ok(StagedRun { report, checkpoint })
    }
}

/// What [`Pipeline::run_staged`] produced: the report, and the verified checkpoint still in its
/// staging directory.
#[derive(Debug)]
pub struct StagedRun {
    /// The run report (its `output` is where the checkpoint will be after the commit).
    pub report: Report,
    /// The checkpoint, to be committed (or dropped, which removes it).
    pub checkpoint: StagedCheckpoint,
}

/// Refuses, before any compute, a NaN or an infinity in a tensor the checkpoint copies rather
/// than quantizes (the quantized linears are refused when their layer loads them): the
/// embedding, the final norm, `lm_head`, every norm weight and every linear kept in 16 bits.
fn check_copied_finite(
    store: &TensorStore,
    config: &SalaConfig,
    plan: &QuantPlan,
) -> Result<(), PipelineError> {
    let quantized: std::collections::HashSet<String> = plan
        .quantized()
        .map(|l| format!("{}.weight", l.name))
        .collect();
    let layer_specs = (0..config.num_layers()).flat_map(|l| config.layer_tensor_specs(l));
    for spec in config.global_tensor_specs().into_iter().chain(layer_specs) {
        if !quantized.contains(&spec.name) {
            store.check_finite(&spec.name)?;
        }
    }
    Ok(())
}

/// Refuses a token id the embedding has no row for, naming the calibration line, before any
/// compute (the embedding lookup would name only the tensor).
fn check_token_ids(samples: &[Sample], config: &SalaConfig) -> Result<(), PipelineError> {
    let vocab = config.vocab_size();
    for sample in samples {
        if let Some(&id) = sample.ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(PipelineError::TokenOutOfRange {
                line: sample.line,
                id,
                vocab,
            });
        }
    }
    Ok(())
}

/// Tensors of the checkpoint that config.json has no place for. Buffers the loaders rebuild
/// (`rotary_emb.inv_freq`, a tied `lm_head.weight`) are returned, to be dropped with a warning;
/// anything else (a `q_proj.bias` when `attention_bias` is false, a layer beyond
/// `num_hidden_layers`) would change the model if dropped, and is refused.
fn unused_tensors(store: &TensorStore, config: &SalaConfig) -> Result<Vec<String>, PipelineError> {
    let expected: std::collections::HashSet<String> = config
        .global_tensor_specs()
        .into_iter()
        .chain((0..config.num_layers()).flat_map(|l| config.layer_tensor_specs(l)))
        .map(|spec| spec.name)
        .collect();
    let (harmless, refused): (Vec<String>, Vec<String>) = store
        .names()
        .filter(|name| !expected.contains(*name))
        .map(str::to_owned)
        .partition(|name| {
            name.ends_with(".rotary_emb.inv_freq")
                || (config.tie_word_embeddings() && name == sala_model::LM_HEAD)
        });
    if refused.is_empty() {
        Ok(harmless)
    } else {
        Err(PipelineError::UnusedTensors {
            dir: store.dir().to_path_buf(),
            names: refused,
        })
    }
}

/// Embedding, final norm and `lm_head`, byte for byte.
fn write_globals(
    store: &TensorStore,
    config: &SalaConfig,
    writer: &mut CheckpointWriter,
) -> Result<(), PipelineError> {
    for spec in config.global_tensor_specs() {
        let info = store.info(&spec.name)?;
        writer.add_tensor(
            &spec.name,
            info.dtype,
            &info.shape,
            store.raw_bytes(&spec.name)?,
        )?;
    }
    Ok(())
}

/// The checkpoint's quantization config from the plan: GPTQ with `dynamic` rules for kept
/// modules and other bit widths; NVFP4 with the kept modules excluded.
pub fn quantization_config(plan: &QuantPlan, options: &QuantizeOptions) -> QuantizationConfig {
    match plan.recipe {
        Recipe::Gptq => {
            let mut counts: BTreeMap<u32, usize> = BTreeMap::new();
            for l in plan.quantized() {
                if let Treatment::Int { bits, .. } = l.treatment {
                    *counts.entry(bits).or_default() += 1;
                }
            }
            let main_bits = counts
                .iter()
                .max_by_key(|(_, &c)| c)
                .map_or(options.plan.bits, |(&b, _)| b);
            let mut cfg = GptqConfig::new(main_bits, options.plan.group_size as i64);
            cfg.sym = options.gptq.scheme.is_symmetric();
            cfg.desc_act = options.gptq.act_order;
            cfg.static_groups = options.gptq.static_groups;
            cfg.damp_percent = options.gptq.damping.percdamp;
            cfg.true_sequential = options.true_sequential;
            for l in plan.linears.iter().filter(|l| l.layer.is_some()) {
                match l.treatment {
                    Treatment::Keep { .. } => cfg.skip_module(&l.name),
                    Treatment::Int { bits, .. } if bits != main_bits => cfg.override_module(
                        &l.name,
                        sala_export::DynamicOverride {
                            bits: Some(bits),
                            ..Default::default()
                        },
                    ),
                    _ => {}
                }
            }
            QuantizationConfig::Gptq(cfg)
        }
        Recipe::Nvfp4 => {
            let excluded = plan
                .linears
                .iter()
                .filter(|l| !l.treatment.is_quantized())
                .map(|l| l.name.clone())
                .collect();
            QuantizationConfig::Nvfp4(Nvfp4Config::new(excluded))
        }
    }
}

/// `runner` with `fast` installed, if any.
pub(crate) fn with_fast<B: Backend>(
    runner: LayerRunner<B>,
    fast: Option<Arc<dyn FastOps<B>>>,
) -> LayerRunner<B> {
    match fast {
        Some(fast) => runner.with_fast_ops(fast),
        None => runner,
    }
}

/// The weights a reading thread returned (its panic, if it panicked, goes on in this thread).
fn joined(
    reading: std::thread::ScopedJoinHandle<'_, Result<LayerWeights, ModelError>>,
) -> Result<LayerWeights, ModelError> {
    reading
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}
