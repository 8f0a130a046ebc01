//! Resumable runs ([`QuantizeOptions::resume`]): what a completed layer leaves in the staging
//! directory, under [`sala_export::RESUME_DIR`]:
//!
//! - `layer-NNNNN.safetensors`: the tensors the layer added to the checkpoint, as written
//!   (removed once every one of them is in a shard the checkpoint writer has written);
//! - `hidden-NNNNN.bin`: the hidden states after the layer (the next layer's inputs), exactly
//!   as stored (only the last layer's is kept);
//! - [`sala_export::RESUME_MANIFEST`]: the completed layers with their report entries, the
//!   checkpoint writer's state (shards written), the engine's (samples in use, failed ones),
//!   and the fingerprint of everything that determines the result.
//!
//! Every file is synced before the manifest names it; the manifest is written to a temporary
//! file, synced and renamed over the old one, and the directory synced. A run resumed from the
//! manifest re-adds the recorded tensors that are not in a written shard, in their order, so
//! the checkpoint writer stands exactly where it stood, and continues with the next layer on
//! the saved hidden states: the result is byte for byte that of an uninterrupted run.

use crate::engine::Sample;
use crate::error::PipelineError;
use crate::options::QuantizeOptions;
use crate::report::{ErrorHessian, LayerReport, LinearReport, StageSeconds};
use sala_export::{CheckpointWriter, Tensor, WriterState, RESUME_DIR, RESUME_MANIFEST};
use sala_model::DeviceMemory;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Version of the manifest's layout (part of the fingerprint).
const FORMAT: u32 = 1;

/// Model files up to this size are hashed whole; larger ones (weights) by size, modification
/// time and a hash of their first [`HEAD_BYTES`] (a safetensors header lists every tensor).
const HASH_WHOLE_BYTES: u64 = 64 << 20;
const HEAD_BYTES: u64 = 1 << 20;

/// Named entries that determine a run's result; two runs may share a staging directory only
/// if all are equal.
pub(crate) type Fingerprint = BTreeMap<String, String>;

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of a file's contents (all of it, or its first `limit` bytes), hex.
pub fn file_hash(path: &Path, limit: Option<u64>) -> std::io::Result<String> {
    use std::io::Read;
    let file = fs::File::open(path)?;
    let mut reader: Box<dyn Read> = match limit {
        Some(n) => Box::new(file.take(n)),
        None => Box::new(file),
    };
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

/// The fingerprint of a run of `options` over the model in `input` with `samples`, solved by
/// `solver`: the tool's version, every file of the model directory (small ones hashed, large
/// ones by size, modification time and the hash of their head), the calibration samples' ids,
/// every option that changes the numbers or the layout, and `options.resume_identity`.
pub(crate) fn fingerprint(
    input: &Path,
    options: &QuantizeOptions,
    samples: &[Sample],
    solver: &str,
) -> Result<Fingerprint, PipelineError> {
    let mut fp = Fingerprint::new();
    fp.insert(
        "tool version".into(),
        format!(
            "sala-gptq {} (resume format {FORMAT})",
            env!("CARGO_PKG_VERSION")
        ),
    );
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |e: std::io::Error| PipelineError::Io {
            path,
            message: e.to_string(),
        }
    };
    let mut files: Vec<PathBuf> = fs::read_dir(input)
        .map_err(io(input))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()
        .map_err(io(input))?;
    files.sort();
    for path in files {
        let meta = fs::metadata(&path).map_err(io(&path))?;
        if !meta.is_file() {
            continue;
        }
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let identity = if meta.len() <= HASH_WHOLE_BYTES {
            format!(
                "{} bytes, sha256 {}",
                meta.len(),
                file_hash(&path, None).map_err(io(&path))?
            )
        } else {
            let modified = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            format!(
                "{} bytes, modified {modified} ns, head sha256 {}",
                meta.len(),
                file_hash(&path, Some(HEAD_BYTES)).map_err(io(&path))?
            )
        };
        fp.insert(format!("model file {name}"), identity);
    }
    let mut hasher = Sha256::new();
    hasher.update((samples.len() as u64).to_le_bytes());
    for s in samples {
        hasher.update((s.ids.len() as u64).to_le_bytes());
        for id in &s.ids {
            hasher.update(id.to_le_bytes());
        }
    }
    fp.insert(
        "calibration samples (token ids)".into(),
        format!(
            "{} samples, sha256 {}",
            samples.len(),
            hex(&hasher.finalize())
        ),
    );
    let o = options;
    // Not the pack size nor where the hidden states live: the device's free memory sets them
    // by default (a resumed run may see another), and they change only the f32 summation
    // order of the layers' products.
    for (name, value) in [
        ("options: plan", format!("{:?}", o.plan)),
        ("options: GPTQ", format!("{:?}", o.gptq)),
        (
            "options: NVFP4 search",
            // The block search alone reads as it did before GPTQ on FP4 existed.
            match o.nvfp4_solver {
                crate::Nvfp4Solver::BlockSearch => format!("{:?}", o.nvfp4_search),
                crate::Nvfp4Solver::Gptq => format!("{:?} in GPTQ", o.nvfp4_search),
                crate::Nvfp4Solver::Hybrid => {
                    format!("{:?} in GPTQ below the widest input", o.nvfp4_search)
                }
            },
        ),
        (
            "options: smoothing alpha",
            // A fixed α reads as it did before the search existed, so those runs still resume.
            match o.smoothing {
                Some(crate::Smoothing::Fixed(alpha)) => format!("{:?}", Some(alpha)),
                other => format!("{other:?}"),
            },
        ),
        ("options: numerics", format!("{:?}", o.run)),
        (
            "options: statistics on the device",
            format!("{:?}", o.device_statistics),
        ),
        (
            "options: skip failed samples",
            format!("{:?}", o.skip_failed_samples),
        ),
        ("options: compare with RTN", format!("{:?}", o.compare_rtn)),
        (
            "options: max shard bytes",
            format!("{:?}", o.max_shard_bytes),
        ),
        ("solver", solver.to_owned()),
    ] {
        fp.insert(name.into(), value);
    }
    for (name, value) in &o.resume_identity {
        fp.insert(name.clone(), value.clone());
    }
    Ok(fp)
}

/// The differences between a staged run's fingerprint and this run's, one item each.
fn differences(staged: &Fingerprint, now: &Fingerprint) -> Vec<String> {
    let keys: std::collections::BTreeSet<&String> = staged.keys().chain(now.keys()).collect();
    let short = |v: Option<&String>| match v {
        None => "absent".to_owned(),
        Some(v) if v.chars().count() > 120 => {
            format!("{}…", v.chars().take(120).collect::<String>())
        }
        Some(v) => v.clone(),
    };
    keys.into_iter()
        .filter(|k| staged.get(*k) != now.get(*k))
        .map(|k| {
            format!(
                "{k} (staged: {}; now: {})",
                short(staged.get(k)),
                short(now.get(k))
            )
        })
        .collect()
}

/// A bit-exact float in the manifest (JSON numbers may lose the last bit on the way back).
type Bits64 = u64;

/// A [`LinearReport`], its floats bit-exact.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SavedLinear {
    name: String,
    treatment: String,
    out_features: usize,
    in_features: usize,
    gptq_loss: Option<Bits64>,
    output_error: Option<Bits64>,
    baseline_output_error: Option<Bits64>,
    #[serde(default)]
    error_hessian: Option<ErrorHessian>,
    smooth_scale_range: Option<(u32, u32)>,
    #[serde(default)]
    smooth_alpha: Option<u32>,
    damping_retries: usize,
    rtn_fallback: bool,
    seconds: f64,
}

impl From<&LinearReport> for SavedLinear {
    fn from(l: &LinearReport) -> Self {
        Self {
            name: l.name.clone(),
            treatment: l.treatment.clone(),
            out_features: l.out_features,
            in_features: l.in_features,
            gptq_loss: l.gptq_loss.map(f64::to_bits),
            output_error: l.output_error.map(f64::to_bits),
            baseline_output_error: l.baseline_output_error.map(f64::to_bits),
            error_hessian: l.error_hessian,
            smooth_scale_range: l
                .smooth_scale_range
                .map(|(a, b)| (a.to_bits(), b.to_bits())),
            smooth_alpha: l.smooth_alpha.map(f32::to_bits),
            damping_retries: l.damping_retries,
            rtn_fallback: l.rtn_fallback,
            seconds: l.seconds,
        }
    }
}

impl From<&SavedLinear> for LinearReport {
    fn from(l: &SavedLinear) -> Self {
        Self {
            name: l.name.clone(),
            treatment: l.treatment.clone(),
            out_features: l.out_features,
            in_features: l.in_features,
            gptq_loss: l.gptq_loss.map(f64::from_bits),
            output_error: l.output_error.map(f64::from_bits),
            baseline_output_error: l.baseline_output_error.map(f64::from_bits),
            error_hessian: l.error_hessian,
            smooth_scale_range: l
                .smooth_scale_range
                .map(|(a, b)| (f32::from_bits(a), f32::from_bits(b))),
            smooth_alpha: l.smooth_alpha.map(f32::from_bits),
            damping_retries: l.damping_retries,
            rtn_fallback: l.rtn_fallback,
            seconds: l.seconds,
            // A resumed layer's step times are not kept: its total is.
            solve_steps: Default::default(),
        }
    }
}

fn memory_pair(m: Option<DeviceMemory>) -> Option<(u64, u64)> {
    m.map(|m| (m.in_use, m.reserved))
}

fn memory_of(p: Option<(u64, u64)>) -> Option<DeviceMemory> {
    p.map(|(in_use, reserved)| DeviceMemory { in_use, reserved })
}

/// A [`LayerReport`].
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SavedLayerReport {
    layer: usize,
    kind: String,
    samples: usize,
    tokens: u64,
    stages: StageSeconds,
    peak_device_memory: Option<(u64, u64)>,
    peak_rss_bytes: Option<u64>,
}

/// One completed layer.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SavedLayer {
    report: SavedLayerReport,
    linears: Vec<SavedLinear>,
    /// The tensors the layer added, in order.
    tensors: Vec<String>,
    /// The file that holds them; `None` once all are in written shards.
    tensors_file: Option<String>,
}

/// The engine after the last completed layer.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct SavedEngine {
    active: Vec<usize>,
    failed: Vec<String>,
    peak_device_memory: Option<(u64, u64)>,
}

/// The manifest of a resumable run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Manifest {
    format: u32,
    fingerprint: Fingerprint,
    /// Completed layers, `0..layers.len()`.
    layers: Vec<SavedLayer>,
    writer: WriterState,
    engine: SavedEngine,
    /// The hidden states after the last completed layer (file in the resume directory).
    hidden: String,
}

/// What a resumed run starts from.
pub(crate) struct Resumed {
    /// The staging directory found (its old name).
    pub dir: PathBuf,
    pub manifest: Manifest,
}

impl Manifest {
    /// Reads the manifest of the staging directory `dir` and checks it against this run's
    /// fingerprint: an error naming every difference, and nothing changed, if it does not
    /// match.
    pub(crate) fn read_matching(dir: &Path, now: &Fingerprint) -> Result<Self, PipelineError> {
        let path = dir.join(RESUME_DIR).join(RESUME_MANIFEST);
        let text = fs::read(&path).map_err(|e| PipelineError::Io {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let manifest: Manifest =
            serde_json::from_slice(&text).map_err(|e| PipelineError::Resume {
                dir: dir.to_path_buf(),
                message: format!(
                    "its manifest {} does not parse ({e}); remove the directory or run \
                     without --resume",
                    path.display()
                ),
            })?;
        let diff = differences(&manifest.fingerprint, now);
        if manifest.format != FORMAT || !diff.is_empty() {
            return Err(PipelineError::Resume {
                dir: dir.to_path_buf(),
                message: format!(
                    "the staged run was made with different inputs or options, refusing to \
                     resume it; it differs in: {}. Run with the staged run's inputs and \
                     options, or without --resume to start over (which removes it)",
                    diff.join("; ")
                ),
            });
        }
        if manifest.layers.is_empty() {
            return Err(PipelineError::Resume {
                dir: dir.to_path_buf(),
                message: "its manifest records no completed layer".into(),
            });
        }
        Ok(manifest)
    }

    /// Completed layers.
    pub(crate) fn completed(&self) -> usize {
        self.layers.len()
    }

    /// The checkpoint writer's state.
    pub(crate) fn writer(&self) -> &WriterState {
        &self.writer
    }

    /// The tensors added after the last written shard, in order, read from the layer files
    /// in `resume_dir`.
    pub(crate) fn pending_tensors(
        &self,
        resume_dir: &Path,
    ) -> Result<Vec<(String, Tensor)>, PipelineError> {
        let flushed: HashSet<&str> = self.writer.flushed_tensors().collect();
        let mut pending = Vec::new();
        for layer in &self.layers {
            let missing: Vec<&String> = layer
                .tensors
                .iter()
                .filter(|t| !flushed.contains(t.as_str()))
                .collect();
            if missing.is_empty() {
                continue;
            }
            let damaged = |message: String| PipelineError::Resume {
                dir: resume_dir.to_path_buf(),
                message,
            };
            let Some(file) = &layer.tensors_file else {
                return Err(damaged(format!(
                    "layer {}: {} is in no staged file",
                    layer.report.layer, missing[0]
                )));
            };
            let path = resume_dir.join(file);
            let bytes = fs::read(&path).map_err(|e| PipelineError::Io {
                path: path.clone(),
                message: e.to_string(),
            })?;
            let st = safetensors::SafeTensors::deserialize(&bytes)
                .map_err(|e| damaged(format!("{}: {e}", path.display())))?;
            for name in missing {
                let view = st
                    .tensor(name)
                    .map_err(|e| damaged(format!("{}: {name}: {e}", path.display())))?;
                let tensor =
                    Tensor::from_bytes(name, view.dtype(), view.shape(), view.data().to_vec())?;
                pending.push((name.clone(), tensor));
            }
        }
        Ok(pending)
    }

    /// The completed layers' reports and, in solve order, their linears' reports.
    pub(crate) fn reports(&self) -> (Vec<LayerReport>, Vec<LinearReport>) {
        let layers = self
            .layers
            .iter()
            .map(|l| LayerReport {
                layer: l.report.layer,
                kind: l.report.kind.clone(),
                samples: l.report.samples,
                tokens: l.report.tokens,
                stages: l.report.stages,
                peak_device_memory: memory_of(l.report.peak_device_memory),
                peak_rss_bytes: l.report.peak_rss_bytes,
                // A resumed run's earlier layers were not profiled in this process.
                ops: None,
            })
            .collect();
        let linears = self
            .layers
            .iter()
            .flat_map(|l| l.linears.iter().map(LinearReport::from))
            .collect();
        (layers, linears)
    }

    /// The engine's saved state: samples in use, failed ones, peak device memory.
    pub(crate) fn engine(&self) -> (Vec<usize>, Vec<String>, Option<DeviceMemory>) {
        (
            self.engine.active.clone(),
            self.engine.failed.clone(),
            memory_of(self.engine.peak_device_memory),
        )
    }

    /// The hidden-state file.
    pub(crate) fn hidden_file(&self) -> &str {
        &self.hidden
    }
}

/// Writes a resumable run's state after every layer.
pub(crate) struct ResumeLog {
    dir: PathBuf,
    staging: PathBuf,
    manifest: Manifest,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> PipelineError + '_ {
    move |e| PipelineError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

fn sync_dir(dir: &Path) -> Result<(), PipelineError> {
    fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io_err(dir))
}

impl ResumeLog {
    /// The log in `staging` (the writer's staging directory): a fresh one, or continuing
    /// `previous` (whose files not named by its manifest, left by the run that stopped, are
    /// removed).
    pub(crate) fn open(
        staging: &Path,
        fingerprint: Fingerprint,
        previous: Option<Manifest>,
    ) -> Result<Self, PipelineError> {
        let dir = staging.join(RESUME_DIR);
        fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let manifest = match previous {
            Some(manifest) => {
                let keep: HashSet<&str> = manifest
                    .layers
                    .iter()
                    .filter_map(|l| l.tensors_file.as_deref())
                    .chain([manifest.hidden.as_str(), RESUME_MANIFEST])
                    .collect();
                for entry in fs::read_dir(&dir).map_err(io_err(&dir))? {
                    let entry = entry.map_err(io_err(&dir))?;
                    let name = entry.file_name().to_string_lossy().into_owned();
                    if !keep.contains(name.as_str()) {
                        let path = entry.path();
                        fs::remove_file(&path).map_err(io_err(&path))?;
                    }
                }
                manifest
            }
            None => Manifest {
                format: FORMAT,
                fingerprint,
                layers: Vec::new(),
                writer: WriterState {
                    shards: Vec::new(),
                    format: None,
                    quantized_linears: 0,
                },
                engine: SavedEngine::default(),
                hidden: String::new(),
            },
        };
        Ok(Self {
            dir,
            staging: staging.to_path_buf(),
            manifest,
        })
    }

    /// The resume directory.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// The manifest as it stands (a resumed run's, until the next layer is done).
    pub(crate) fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Records a completed layer: its tensors (what `writer` recorded since the last layer),
    /// the hidden states after it, its reports and the engine's state; synced, then the
    /// manifest replaced atomically; then files no longer needed are removed.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layer_done<B: burn::tensor::backend::Backend>(
        &mut self,
        writer: &mut CheckpointWriter,
        hidden: &crate::hidden::HiddenStates<B>,
        report: &LayerReport,
        linears: &[LinearReport],
        engine: (Vec<usize>, Vec<String>, Option<DeviceMemory>),
    ) -> Result<(), PipelineError> {
        let layer = report.layer;
        let tensors = writer.take_recorded();
        let file = format!("layer-{layer:05}.safetensors");
        let path = self.dir.join(&file);
        safetensors::serialize_to_file(tensors.iter().map(|(n, t)| (n.as_str(), t)), None, &path)
            .map_err(|e| PipelineError::Io {
            path: path.clone(),
            message: format!("writing the layer's resume state: {e}"),
        })?;
        fs::File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(io_err(&path))?;
        let hidden_file = format!("hidden-{layer:05}.bin");
        hidden.save(&self.dir.join(&hidden_file))?;

        let m = &mut self.manifest;
        m.layers.push(SavedLayer {
            report: SavedLayerReport {
                layer,
                kind: report.kind.clone(),
                samples: report.samples,
                tokens: report.tokens,
                stages: report.stages,
                peak_device_memory: memory_pair(report.peak_device_memory),
                peak_rss_bytes: report.peak_rss_bytes,
            },
            linears: linears.iter().map(SavedLinear::from).collect(),
            tensors: tensors.into_iter().map(|(n, _)| n).collect(),
            tensors_file: Some(file),
        });
        m.writer = writer.state()?;
        let flushed: HashSet<&str> = m.writer.flushed_tensors().collect();
        let mut obsolete = Vec::new();
        for saved in &mut m.layers {
            if saved.tensors.iter().all(|t| flushed.contains(t.as_str())) {
                obsolete.extend(saved.tensors_file.take());
            }
        }
        let old_hidden = std::mem::replace(&mut m.hidden, hidden_file);
        if !old_hidden.is_empty() {
            obsolete.push(old_hidden);
        }
        m.engine = SavedEngine {
            active: engine.0,
            failed: engine.1,
            peak_device_memory: memory_pair(engine.2),
        };
        // The new files' names (and the shards') on disk before the manifest names them.
        sync_dir(&self.dir)?;
        sync_dir(&self.staging)?;
        self.write_manifest(writer)?;
        for name in obsolete {
            let _ = fs::remove_file(self.dir.join(name));
        }
        Ok(())
    }

    /// Replaces the manifest (temporary file, sync, rename, directory sync); the staging
    /// directory is marked resumable as soon as the manifest is in place.
    fn write_manifest(&self, writer: &mut CheckpointWriter) -> Result<(), PipelineError> {
        use std::io::Write;
        let path = self.dir.join(RESUME_MANIFEST);
        let tmp = self.dir.join(format!("{RESUME_MANIFEST}.tmp"));
        let json = serde_json::to_vec_pretty(&self.manifest).map_err(|e| PipelineError::Io {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let mut file = fs::File::create(&tmp).map_err(io_err(&tmp))?;
        file.write_all(&json)
            .and_then(|()| file.sync_all())
            .map_err(io_err(&tmp))?;
        fs::rename(&tmp, &path).map_err(io_err(&path))?;
        writer.set_resumable(true);
        sync_dir(&self.dir)
    }

    /// The checkpoint is staged (and its staging directory no longer marked resumable, see
    /// [`CheckpointWriter::finish_staged`]): the resume state is removed, the manifest first.
    pub(crate) fn finish(self) -> Result<(), PipelineError> {
        let manifest = self.dir.join(RESUME_MANIFEST);
        fs::remove_file(&manifest).map_err(io_err(&manifest))?;
        fs::remove_dir_all(&self.dir).map_err(io_err(&self.dir))
    }
}
