//! The layer-by-layer data path: embed, then for each decoder layer capture statistics, smooth,
//! solve every linear, write it, and re-run the quantized layer to produce the next layer's
//! inputs (the original scripts' quantized-input propagation).

use crate::error::PipelineError;
use crate::hidden::HiddenStates;
use crate::options::QuantizeOptions;
use crate::plan::{PlannedLinear, QuantPlan, Recipe, Treatment};
use crate::progress::{Progress, Stage};
use crate::report::{peak_rss_bytes, LayerReport, LinearReport, Report};
use crate::smoothing::{fold_group, reader_map, smooth_group_of};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use sala_export::{CheckpointWriter, GptqConfig, Nvfp4Config, QuantizationConfig, WriterOptions};
use sala_formats::nvfp4::global_scale_from_amax;
use sala_formats::{BlockScales, Nvfp4Matrix};
use sala_hessian::{
    ChannelStats, ChannelStatsAccumulator, Gptq, GptqConfig as SolverConfig, Hessian,
    HessianAccumulator, IntGrid, Method, Normalization, Rtn,
};
use sala_model::{input_groups, InputGroup, LayerRunner, LayerWeights, SalaConfig, TensorStore};
use sala_smooth::ScaleRecipe;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Instant;

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

/// Statistics of one layer input, shared by every linear that reads it.
enum InputStats {
    /// Full Hessian (GPTQ), f64.
    Full(HessianAccumulator<f64>),
    /// Diagonal + abs-max (NVFP4).
    Diagonal(ChannelStatsAccumulator),
}

/// The finalized statistics of one input, after smoothing transforms.
enum Finalized {
    Full(Hessian<f64>),
    Diagonal(ChannelStats),
}

impl Finalized {
    /// Per-channel RMS (`sqrt(E[x²])`), the original scripts' smoothing activation.
    fn rms(&self) -> Vec<f32> {
        match self {
            Finalized::Full(h) => h
                .diagonal()
                .iter()
                .map(|&d| d.max(0.0).sqrt() as f32)
                .collect(),
            Finalized::Diagonal(s) => s
                .mean_square
                .iter()
                .map(|&d| d.max(0.0).sqrt() as f32)
                .collect(),
        }
    }

    /// `x ← x / s` per channel: `H ← diag(1/s) H diag(1/s)`, `E[x²] /= s²`, `max|x| /= s`.
    fn rescale(&mut self, scales: &[f32], group: &str) -> Result<(), PipelineError> {
        let smooth_err = |source| PipelineError::Smooth {
            group: group.to_owned(),
            source,
        };
        match self {
            Finalized::Full(h) => {
                let n = h.dim();
                let mut m = h.to_row_major();
                sala_smooth::transform_hessian(&mut m, n, scales).map_err(smooth_err)?;
                *h = Hessian::from_row_major(n, &m).map_err(|source| PipelineError::Solve {
                    linear: group.to_owned(),
                    source,
                })?;
            }
            Finalized::Diagonal(s) => {
                sala_smooth::transform_hessian_diag(&mut s.mean_square, scales)
                    .map_err(smooth_err)?;
                for (a, &sc) in s.abs_max.iter_mut().zip(scales) {
                    *a /= sc;
                }
            }
        }
        Ok(())
    }
}

/// Runs a whole quantization: reads `input`, writes a verified checkpoint to `output`.
pub struct Pipeline<B: Backend> {
    device: B::Device,
    options: QuantizeOptions,
}

impl<B: Backend> Pipeline<B> {
    /// A pipeline on `device` with `options`.
    pub fn new(device: B::Device, options: QuantizeOptions) -> Self {
        Self { device, options }
    }

    /// The options.
    pub fn options(&self) -> &QuantizeOptions {
        &self.options
    }

    /// Quantizes the model in `input` with `samples` and writes the checkpoint to `output`.
    ///
    /// On any error the output directory is absent (or, with `overwrite`, the old one intact).
    pub fn run(
        &self,
        input: &Path,
        output: &Path,
        samples: &[Sample],
        progress: &mut dyn Progress,
    ) -> Result<Report, PipelineError> {
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
        if plan
            .get("lm_head")
            .is_some_and(|l| l.treatment.is_quantized())
        {
            return Err(PipelineError::Unsupported(
                "--quantize-lm-head: calibrating lm_head is not implemented yet".into(),
            ));
        }
        let mut writer = CheckpointWriter::create(
            output,
            WriterOptions {
                max_shard_bytes: self.options.max_shard_bytes,
                overwrite: self.options.overwrite,
                source_model: Some(input.to_path_buf()),
            },
        )?;
        let runner = LayerRunner::<B>::new(config.clone(), self.device.clone(), self.options.run);
        let scratch = writer.staging_dir().to_path_buf();
        let mut run = Run {
            options: &self.options,
            config: &config,
            store: &store,
            plan: &plan,
            runner: &runner,
            samples,
            active: (0..samples.len()).collect(),
            failed: Vec::new(),
            linears: Vec::new(),
        };
        progress.start(config.num_layers(), samples.len());
        let mut hidden = run.embed(&scratch)?;
        let mut layers = Vec::new();
        for layer in 0..config.num_layers() {
            progress.layer(layer);
            layers.push(run.layer(layer, &mut hidden, &mut writer, progress)?);
        }
        write_globals(&store, &config, &mut writer)?;
        let model_config = sala_export::config::read_json(&input.join("config.json"))?;
        let quantization = quantization_config(&plan, &self.options);
        let written = writer.finish(model_config, &quantization)?;
        let verdict = sala_export::verify(&written.dir)?;
        if !verdict.is_ok() {
            let text = verdict.to_string();
            let _ = std::fs::remove_dir_all(&written.dir);
            return Err(PipelineError::Verify(text));
        }
        progress.finish();
        let tokens = run
            .active
            .iter()
            .map(|&i| samples[i].ids.len() as u64)
            .sum();
        Ok(Report {
            recipe: match plan.recipe {
                Recipe::Gptq => "gptq".into(),
                Recipe::Nvfp4 => "nvfp4".into(),
            },
            input: input.display().to_string(),
            output: written.dir.display().to_string(),
            samples: run.active.len(),
            tokens,
            failed_samples: run.failed,
            layers,
            linears: run.linears,
            seconds: started.elapsed().as_secs_f64(),
            peak_rss_bytes: peak_rss_bytes(),
            hidden_state_bytes: hidden.bytes(),
            hidden_states_on_disk: hidden.on_disk(),
            output_bytes: written.tensor_bytes,
            verify_summary: format!(
                "verified ok: {} tensors, {} quantized linears, {:.1} MB, {:.3} bits per quantized weight",
                verdict.summary.tensors,
                verdict.summary.quantized_linears,
                verdict.summary.tensor_bytes as f64 / 1e6,
                verdict.summary.bits_per_quantized_weight()
            ),
        })
    }
}

/// The state of one run, shared by its steps.
struct Run<'a, B: Backend> {
    options: &'a QuantizeOptions,
    config: &'a SalaConfig,
    store: &'a TensorStore,
    plan: &'a QuantPlan,
    runner: &'a LayerRunner<B>,
    samples: &'a [Sample],
    /// Samples still in use (a failed one is dropped when skipping is allowed).
    active: Vec<usize>,
    failed: Vec<String>,
    linears: Vec<LinearReport>,
}

impl<B: Backend> Run<'_, B> {
    fn embed(&mut self, scratch: &Path) -> Result<HiddenStates, PipelineError> {
        let lengths: Vec<usize> = self.samples.iter().map(|s| s.ids.len()).collect();
        let budget = self.options.max_host_memory;
        let mut hidden = HiddenStates::new(&lengths, self.config.hidden_size(), budget, scratch)?;
        for i in 0..self.samples.len() {
            let x = self.runner.embed(self.store, &self.samples[i].ids)?;
            hidden.set(i, &to_vec(x));
        }
        Ok(hidden)
    }

    fn device_hidden(&self, hidden: &HiddenStates, i: usize) -> Tensor<B, 2> {
        let data = TensorData::new(hidden.get(i), [hidden.tokens(i), self.config.hidden_size()]);
        Tensor::from_data(data, self.runner.device())
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

    fn layer(
        &mut self,
        layer: usize,
        hidden: &mut HiddenStates,
        writer: &mut CheckpointWriter,
        progress: &mut dyn Progress,
    ) -> Result<LayerReport, PipelineError> {
        let mut report = LayerReport {
            layer,
            kind: crate::plan::kind_name(self.config.layer_kind(layer)).to_owned(),
            ..LayerReport::default()
        };
        let mut weights = LayerWeights::load(self.store, self.config, layer)?;
        let groups = input_groups(self.config, layer);
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

        let t = Instant::now();
        progress.stage(Stage::Capture, self.active.len());
        let stats = self.capture(layer, &weights, &groups, &needed, hidden, progress)?;
        report.capture = t.elapsed().as_secs_f64();

        let t = Instant::now();
        progress.stage(Stage::Solve, quantized.len());
        let mut modified = BTreeSet::new();
        let mut stats = stats;
        let scale_ranges =
            self.smooth(&groups, &needed, &mut weights, &mut stats, &mut modified)?;
        let solved = self.solve_layer(
            layer,
            &groups,
            &mut weights,
            &stats,
            &scale_ranges,
            progress,
        )?;
        report.solve = t.elapsed().as_secs_f64();

        let t = Instant::now();
        for (name, linear) in &solved {
            match linear {
                SolvedLinear::Gptq(packed) => writer.add_gptq_linear(name, packed)?,
                SolvedLinear::Nvfp4(matrix, input_scale) => {
                    writer.add_nvfp4_linear(name, matrix, *input_scale)?
                }
            }
        }
        self.write_kept(&weights, &quantized, &modified, writer)?;
        report.write = t.elapsed().as_secs_f64();

        let t = Instant::now();
        progress.stage(Stage::Propagate, self.active.len());
        self.propagate(layer, &weights, hidden, progress)?;
        report.propagate = t.elapsed().as_secs_f64();
        Ok(report)
    }

    /// Runs the layer on every active sample, feeding each needed input to its statistics.
    fn capture(
        &mut self,
        layer: usize,
        weights: &LayerWeights,
        groups: &[InputGroup],
        needed: &[bool],
        hidden: &HiddenStates,
        progress: &mut dyn Progress,
    ) -> Result<Vec<Option<Finalized>>, PipelineError> {
        let first_reader: BTreeMap<&str, usize> = groups
            .iter()
            .enumerate()
            .filter(|(g, _)| needed[*g])
            .map(|(g, group)| (group.readers[0].as_str(), g))
            .collect();
        let mut stats: Vec<Option<InputStats>> = groups
            .iter()
            .zip(needed)
            .map(|(group, &need)| need.then(|| self.new_stats(weights, group)).transpose())
            .collect::<Result<_, _>>()?;
        for i in self.active.clone() {
            let x = self.device_hidden(hidden, i);
            let mut tap_error: Option<String> = None;
            let result = self.runner.run_layer(weights, x, |name, input| {
                let Some(&g) = first_reader.get(name) else {
                    return;
                };
                if tap_error.is_some() {
                    return;
                }
                let [tokens, _] = input.dims();
                let values = to_vec(input.clone());
                let added = match stats[g].as_mut() {
                    Some(InputStats::Full(acc)) => acc.add_sample(&values, tokens),
                    Some(InputStats::Diagonal(acc)) => acc.add_sample(&values, tokens),
                    None => Ok(()),
                };
                if let Err(e) = added {
                    tap_error = Some(format!("{name}: {e}"));
                }
            });
            match (result, tap_error) {
                (Ok(_), None) => {}
                (Err(e), _) => self.sample_failed(i, layer, e.to_string())?,
                (Ok(_), Some(message)) => self.sample_failed(i, layer, message)?,
            }
            progress.step();
        }
        stats
            .into_iter()
            .zip(groups)
            .map(|(s, group)| s.map(|s| finalize(s, &group.readers[0])).transpose())
            .collect()
    }

    fn new_stats(
        &self,
        weights: &LayerWeights,
        group: &InputGroup,
    ) -> Result<InputStats, PipelineError> {
        let dim = weights.get(&format!("{}.weight", group.readers[0]))?.shape[1];
        let err = |source| PipelineError::Solve {
            linear: group.readers[0].clone(),
            source,
        };
        Ok(match self.plan.recipe {
            Recipe::Gptq => InputStats::Full(
                HessianAccumulator::new(dim, Normalization::PerSample).map_err(err)?,
            ),
            Recipe::Nvfp4 => InputStats::Diagonal(
                ChannelStatsAccumulator::new(dim, Normalization::PerSample).map_err(err)?,
            ),
        })
    }

    /// SmoothQuant on every group the plan marks ([`PlannedLinear::smooth_group`]) with a
    /// quantized reader. Returns each smoothed linear's scale range.
    fn smooth(
        &self,
        groups: &[InputGroup],
        needed: &[bool],
        weights: &mut LayerWeights,
        stats: &mut [Option<Finalized>],
        modified: &mut BTreeSet<String>,
    ) -> Result<BTreeMap<String, (f32, f32)>, PipelineError> {
        let mut ranges = BTreeMap::new();
        let Some(alpha) = self.options.smooth_alpha else {
            return Ok(ranges);
        };
        let recipe = ScaleRecipe::original(alpha);
        let readers = reader_map(groups);
        for (g, group) in groups.iter().enumerate() {
            // The plan says which inputs the recipe smooths (NVFP4: not up→down).
            let planned = self
                .plan
                .get(&group.readers[0])
                .and_then(|l| l.smooth_group.as_ref())
                .is_some();
            let Some(smooth_group) = smooth_group_of(group) else {
                continue;
            };
            if !needed[g] || !planned {
                continue;
            }
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
            let scales = fold_group(weights, &smooth_group, &recipe, &act)?;
            finalized.rescale(&scales, &name)?;
            let range = scales
                .iter()
                .fold((f32::INFINITY, 0f32), |(lo, hi), &s| (lo.min(s), hi.max(s)));
            modified.insert(format!("{}.weight", smooth_group.source.name()));
            for t in &smooth_group.targets {
                modified.insert(format!("{t}.weight"));
                ranges.insert(t.clone(), range);
            }
        }
        Ok(ranges)
    }

    /// Solves every quantized linear of the layer and replaces its weight by the dequantized one.
    fn solve_layer(
        &mut self,
        layer: usize,
        groups: &[InputGroup],
        weights: &mut LayerWeights,
        stats: &[Option<Finalized>],
        scale_ranges: &BTreeMap<String, (f32, f32)>,
        progress: &mut dyn Progress,
    ) -> Result<Vec<(String, SolvedLinear)>, PipelineError> {
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
            .cloned()
            .collect();
        for linear in planned {
            let t = Instant::now();
            let g = group_of[linear.name.as_str()];
            let input = stats[g].as_ref().ok_or_else(|| {
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
                smooth_scale_range: scale_ranges.get(&linear.name).copied(),
                damping_retries: 0,
                rtn_fallback: false,
                seconds: 0.0,
            };
            let result = match (&linear.treatment, input) {
                (Treatment::Int { bits, group_size }, Finalized::Full(h)) => {
                    self.solve_gptq(&linear, *bits, *group_size, &mut w.data, h, &mut report)?
                }
                (Treatment::Nvfp4, Finalized::Diagonal(s)) => {
                    let global = fused_scales[&linear.name];
                    let act_amax = s.abs_max.iter().fold(0f32, |m, &v| m.max(v));
                    self.solve_nvfp4(&linear, &mut w.data, s, global, act_amax, &mut report)?
                }
                _ => {
                    return Err(PipelineError::Unsupported(format!(
                        "{}: treatment and statistics disagree",
                        linear.name
                    )))
                }
            };
            report.seconds = t.elapsed().as_secs_f64();
            self.linears.push(report);
            solved.push((linear.name.clone(), result));
            progress.step();
        }
        Ok(solved)
    }

    fn solve_gptq(
        &self,
        linear: &PlannedLinear,
        bits: u32,
        group_size: usize,
        w: &mut [f32],
        h: &Hessian<f64>,
        report: &mut LinearReport,
    ) -> Result<SolvedLinear, PipelineError> {
        let (out, inp) = (linear.out_features, linear.in_features);
        let opts = &self.options.gptq;
        let grid = IntGrid {
            bits,
            scheme: opts.scheme,
            group_size: Some(group_size),
        };
        let solve_err = |source| PipelineError::Solve {
            linear: linear.name.clone(),
            source,
        };
        let solver = Gptq::new(SolverConfig {
            grid,
            block_size: opts.block_size,
            act_order: opts.act_order,
            static_groups: opts.static_groups,
            damping: opts.damping,
            on_failure: opts.failure_policy(),
            proxy_error: true,
        })
        .map_err(solve_err)?;
        let q = if opts.rtn {
            let rtn = Rtn::new(grid).map_err(solve_err)?;
            rtn.quantize(w, out, inp, Some(h)).map_err(solve_err)?
        } else {
            solver.solve(w, out, inp, h).map_err(solve_err)?
        };
        if self.options.compare_rtn {
            let rtn = Rtn::new(grid)
                .map_err(solve_err)?
                .quantize(w, out, inp, Some(h))
                .map_err(solve_err)?;
            report.baseline_output_error = rtn.proxy_error;
        }
        report.gptq_loss = Some(q.loss);
        report.output_error = q.proxy_error;
        report.damping_retries = q.damping_retries;
        report.rtn_fallback = q.method == Method::RtnFallback;
        let packed = q.pack().map_err(solve_err)?;
        w.copy_from_slice(&q.dequantized);
        Ok(SolvedLinear::Gptq(packed))
    }

    fn solve_nvfp4(
        &self,
        linear: &PlannedLinear,
        w: &mut [f32],
        stats: &ChannelStats,
        global: f32,
        act_amax: f32,
        report: &mut LinearReport,
    ) -> Result<SolvedLinear, PipelineError> {
        let (out, inp) = (linear.out_features, linear.in_features);
        let format_err = |source| PipelineError::Format {
            linear: linear.name.clone(),
            source,
        };
        let diag: Vec<f32> = stats.mean_square.iter().map(|&d| d as f32).collect();
        let search = self
            .options
            .nvfp4_search
            .search(w, out, inp, &diag, global)
            .map_err(|source| PipelineError::Solve {
                linear: linear.name.clone(),
                source,
            })?;
        let matrix = Nvfp4Matrix::quantize(
            w,
            out,
            inp,
            global,
            BlockScales::Given(&search.block_scales),
        )
        .map_err(format_err)?;
        if self.options.compare_rtn {
            let max =
                Nvfp4Matrix::quantize(w, out, inp, global, BlockScales::Max).map_err(format_err)?;
            report.baseline_output_error = Some(diagonal_error(w, &max.dequantize(), &diag));
        }
        let dequantized = matrix.dequantize();
        report.output_error = Some(diagonal_error(w, &dequantized, &diag));
        w.copy_from_slice(&dequantized);
        let input_scale = global_scale_from_amax(act_amax).map_err(format_err)?;
        Ok(SolvedLinear::Nvfp4(matrix, input_scale))
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
            let amax = w.data.iter().fold(0f32, |m, v| m.max(v.abs()));
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

    /// Writes the layer's tensors that are not quantized: untouched ones byte for byte, smoothed
    /// ones (norms, kept linears) re-encoded in their original dtype.
    fn write_kept(
        &self,
        weights: &LayerWeights,
        quantized: &BTreeSet<String>,
        modified: &BTreeSet<String>,
        writer: &mut CheckpointWriter,
    ) -> Result<(), PipelineError> {
        for (name, tensor) in &weights.tensors {
            let module = name.strip_suffix(".weight").unwrap_or(name);
            if quantized.contains(module) {
                continue;
            }
            let info = self.store.info(name)?;
            if modified.contains(name) {
                writer.add_f32(name, info.dtype, &tensor.shape, &tensor.data)?;
            } else {
                writer.add_tensor(name, info.dtype, &info.shape, self.store.raw_bytes(name)?)?;
            }
        }
        Ok(())
    }

    /// Re-runs the (now quantized) layer on every active sample: the next layer's inputs.
    fn propagate(
        &mut self,
        layer: usize,
        weights: &LayerWeights,
        hidden: &mut HiddenStates,
        progress: &mut dyn Progress,
    ) -> Result<(), PipelineError> {
        for i in self.active.clone() {
            let x = self.device_hidden(hidden, i);
            match self.runner.run_layer(weights, x, |_, _| {}) {
                Ok(y) => hidden.set(i, &to_vec(y)),
                Err(e) => self.sample_failed(i, layer, e.to_string())?,
            }
            progress.step();
        }
        Ok(())
    }
}

/// A solved linear, ready for the writer.
enum SolvedLinear {
    Gptq(sala_formats::GptqPacked),
    Nvfp4(Nvfp4Matrix, f32),
}

fn finalize(stats: InputStats, name: &str) -> Result<Finalized, PipelineError> {
    let err = |source| PipelineError::Solve {
        linear: name.to_owned(),
        source,
    };
    Ok(match stats {
        InputStats::Full(acc) => Finalized::Full(acc.finalize().map_err(err)?),
        InputStats::Diagonal(acc) => Finalized::Diagonal(acc.finalize().map_err(err)?),
    })
}

/// `Σ_rows Σ_j d_j (w − q)²`: the output error under a diagonal Hessian.
fn diagonal_error(w: &[f32], q: &[f32], diag: &[f32]) -> f64 {
    let cols = diag.len();
    w.chunks_exact(cols)
        .zip(q.chunks_exact(cols))
        .map(|(wr, qr)| {
            wr.iter()
                .zip(qr)
                .zip(diag)
                .map(|((&a, &b), &d)| d as f64 * ((a - b) as f64).powi(2))
                .sum::<f64>()
        })
        .sum()
}

fn treatment_label(t: &Treatment) -> String {
    match t {
        Treatment::Int { bits, group_size } => format!("INT{bits} g{group_size}"),
        Treatment::Nvfp4 => "FP4".into(),
        Treatment::Keep { .. } => "bf16".into(),
    }
}

fn to_vec<B: Backend>(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .unwrap_or_default()
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
            cfg.true_sequential = false;
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
