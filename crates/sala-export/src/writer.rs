//! [`CheckpointWriter`]: streams passthrough tensors and quantized linears into shards inside a
//! staging directory, then writes the index, the config files and the tokenizer files
//! ([`StagedCheckpoint`], which can be verified and given more files), and renames the
//! directory into place. One writer serves both formats; the format is fixed by the
//! first quantized linear and by the config given to [`CheckpointWriter::finish`].

use std::fs;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use sala_formats::{GptqPacked, Nvfp4Matrix};
use serde_json::Value;

use crate::config::{
    write_json, QuantizationConfig, CONFIG_FILE, HF_QUANT_CONFIG_FILE, QUANTIZE_CONFIG_FILE,
};
use crate::layout::{gptq_tensors, nvfp4_tensors};
use crate::shards::{FlushedShard, ShardWriter, DEFAULT_MAX_SHARD_BYTES};
use crate::staging::StagedDir;
use crate::tensor::Tensor;
use crate::ExportError;

/// Files copied from the source model directory besides `*.py` and `*.jinja`: the tokenizer
/// (including `tokenizer.model`, which the original GPTQ script forgot), chat template and
/// generation config.
pub const SIDE_FILES: [&str; 10] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
];

/// How a [`CheckpointWriter`] writes.
#[derive(Debug, Clone)]
pub struct WriterOptions {
    /// Maximum bytes of tensor data per shard (default 4 GB); a larger single tensor gets a
    /// shard of its own. Bounds the writer's memory.
    pub max_shard_bytes: u64,
    /// Replace an existing output directory, only once the new one is complete and only if
    /// it is a checkpoint or empty (see [`StagedDir`]).
    pub overwrite: bool,
    /// The source model directory: never written into, and where the tokenizer, chat
    /// template, generation config and `*.py` files are copied from.
    pub source_model: Option<PathBuf>,
}

impl Default for WriterOptions {
    fn default() -> Self {
        Self {
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            overwrite: false,
            source_model: None,
        }
    }
}

/// The quantized layout of the linears written so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum LinearFormat {
    /// AutoGPTQ `qweight` / `qzeros` / `scales` / `g_idx`.
    Gptq,
    /// ModelOpt `weight` / `weight_scale` / `weight_scale_2` / `input_scale`.
    Nvfp4,
}

/// What [`CheckpointWriter::finish`] produced.
#[derive(Debug, Clone, PartialEq)]
pub struct WrittenCheckpoint {
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// Shard file names, in order.
    pub shards: Vec<String>,
    /// Number of tensors.
    pub tensors: usize,
    /// Bytes of tensor data (headers excluded).
    pub tensor_bytes: u64,
    /// Number of quantized linears.
    pub quantized_linears: usize,
    /// Files copied from the source model directory.
    pub copied_files: Vec<String>,
}

/// Writes one checkpoint, one tensor or one linear at a time.
///
/// Dropping the writer without [`finish`](Self::finish) (for example after an error) removes
/// everything it wrote; the target directory is never touched before the final rename.
pub struct CheckpointWriter {
    staged: StagedDir,
    shards: ShardWriter,
    /// The source model's side files (name, path), checked at creation.
    side_files: Vec<(String, PathBuf)>,
    format: Option<LinearFormat>,
    quantized_linears: usize,
    /// With [`record`](Self::record): the tensors added since the last
    /// [`take_recorded`](Self::take_recorded), in order.
    journal: Option<Vec<(String, Tensor)>>,
}

/// Where a [`CheckpointWriter`] stands, for a resumable run: the shards it has written (and
/// synced) and the linears' format and count. Together with the tensors added after the last
/// shard (which the caller keeps, see [`CheckpointWriter::take_recorded`]) it is enough to
/// continue exactly where it stood ([`CheckpointWriter::resume`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct WriterState {
    /// Shards written, in order.
    pub shards: Vec<FlushedShard>,
    /// The quantized layout, once a quantized linear was added.
    pub format: Option<LinearFormat>,
    /// Quantized linears added.
    pub quantized_linears: usize,
}

impl WriterState {
    /// Every tensor in the written shards.
    pub fn flushed_tensors(&self) -> impl Iterator<Item = &str> {
        self.shards
            .iter()
            .flat_map(|s| s.tensors.iter().map(String::as_str))
    }
}

impl CheckpointWriter {
    /// Starts a checkpoint that will appear at `target`.
    ///
    /// Fails if another run is writing `target`, if `target` exists (unless `overwrite`, and then
    /// unless it is a checkpoint or empty), or if it is, holds or lies inside the source model
    /// directory.
    pub fn create(target: impl AsRef<Path>, options: WriterOptions) -> Result<Self, ExportError> {
        // Checked before anything is created: a side file that cannot be copied fails now, not
        // after the run.
        let side_files = match &options.source_model {
            Some(source) => side_files(source)?,
            None => Vec::new(),
        };
        let staged = StagedDir::create(
            target.as_ref(),
            options.overwrite,
            options.source_model.as_deref(),
        )?;
        let shards = ShardWriter::new(staged.path(), options.max_shard_bytes);
        Ok(Self {
            staged,
            shards,
            side_files,
            format: None,
            quantized_linears: 0,
            journal: None,
        })
    }

    /// Continues a checkpoint whose staging directory `adopt` a dead run left (see
    /// [`crate::find_resumable`]): takes it over under the lock
    /// ([`StagedDir::create_adopting`]), checks the shards `state` lists (present, of their
    /// recorded size), removes what the dead run wrote after `state` (later shards, files
    /// outside [`crate::RESUME_DIR`]), then adds `pending` (the tensors added after the last
    /// written shard, in their order) as [`add_tensor`](Self::add_tensor) would have.
    pub fn resume(
        target: impl AsRef<Path>,
        options: WriterOptions,
        adopt: &Path,
        state: &WriterState,
        pending: Vec<(String, Tensor)>,
    ) -> Result<Self, ExportError> {
        let side_files = match &options.source_model {
            Some(source) => side_files(source)?,
            None => Vec::new(),
        };
        let staged = StagedDir::create_adopting(
            target.as_ref(),
            options.overwrite,
            options.source_model.as_deref(),
            Some(adopt),
        )?;
        let dir = staged.path().to_path_buf();
        let listed: std::collections::HashSet<&str> =
            state.shards.iter().map(|s| s.file.as_str()).collect();
        for entry in fs::read_dir(&dir).map_err(ExportError::io(&dir))? {
            let entry = entry.map_err(ExportError::io(&dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name == crate::RESUME_DIR || listed.contains(name.as_str()) {
                continue;
            }
            let path = entry.path();
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                fs::remove_dir_all(&path).map_err(ExportError::io(&path))?;
            } else {
                fs::remove_file(&path).map_err(ExportError::io(&path))?;
            }
        }
        if let Some(shard) = state
            .shards
            .iter()
            .find(|s| !ShardWriter::is_provisional_name(&s.file))
        {
            return Err(ExportError::Io {
                path: dir.join(&shard.file),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "not a staged shard name in the resume manifest",
                ),
            });
        }
        let shards = ShardWriter::restore(&dir, options.max_shard_bytes, &state.shards)?;
        let mut writer = Self {
            staged,
            shards,
            side_files,
            format: state.format,
            quantized_linears: state.quantized_linears,
            journal: None,
        };
        for (name, tensor) in pending {
            writer.shards.push(&name, tensor)?;
        }
        Ok(writer)
    }

    /// Starts (or stops) recording every tensor added, for
    /// [`take_recorded`](Self::take_recorded): a resumable run keeps each layer's tensors.
    pub fn record(&mut self, on: bool) {
        self.journal = on.then(Vec::new);
    }

    /// The tensors added since recording started or since the last call, in order (empty
    /// when not recording).
    pub fn take_recorded(&mut self) -> Vec<(String, Tensor)> {
        self.journal
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Where the writer stands: shards written so far, format, quantized linears.
    pub fn state(&self) -> Result<WriterState, ExportError> {
        Ok(WriterState {
            shards: self.shards.flushed()?,
            format: self.format,
            quantized_linears: self.quantized_linears,
        })
    }

    /// The staging directory's resume marking (see [`StagedDir::set_resumable`]).
    pub fn set_resumable(&mut self, keep: bool) {
        self.staged.set_resumable(keep);
    }

    /// The staging directory of a dead run this writer adopted, by its old name.
    pub fn adopted(&self) -> Option<&Path> {
        self.staged.adopted()
    }
    /// The staging directory (files appear here until `finish`).
    pub fn staging_dir(&self) -> &Path {
        self.staged.path()
    }

    /// Adds a tensor as stored bytes (little-endian, `dtype`, row-major `shape`): embeddings,
    /// norms, `lm_head`, linears kept in 16 bits, biases.
    pub fn add_tensor(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        bytes: &[u8],
    ) -> Result<(), ExportError> {
        let tensor = Tensor::from_bytes(name, dtype, shape, bytes.to_vec())?;
        self.push(name, tensor)
    }

    fn push(&mut self, name: &str, tensor: Tensor) -> Result<(), ExportError> {
        if let Some(journal) = &mut self.journal {
            if !self.shards.contains(name) {
                journal.push((name.to_string(), tensor.clone()));
            }
        }
        self.shards.push(name, tensor)
    }

    /// Adds f32 values encoded as `dtype` (BF16, F16 or F32), e.g. a smoothed norm weight.
    pub fn add_f32(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        values: &[f32],
    ) -> Result<(), ExportError> {
        let tensor = Tensor::from_f32(name, dtype, shape, values)?;
        self.push(name, tensor)
    }

    /// Adds a GPTQ linear as `module.{qweight,qzeros,scales,g_idx}` (scales cast to fp16).
    pub fn add_gptq_linear(
        &mut self,
        module: &str,
        packed: &GptqPacked,
    ) -> Result<(), ExportError> {
        self.claim_format(module, LinearFormat::Gptq)?;
        let tensors = gptq_tensors(module, packed)?;
        self.push_linear(tensors)
    }

    /// Adds an NVFP4 linear as `module.{weight,weight_scale,weight_scale_2,input_scale}`;
    /// `input_scale` is the activation amax / 2688.
    pub fn add_nvfp4_linear(
        &mut self,
        module: &str,
        matrix: &Nvfp4Matrix,
        input_scale: f32,
    ) -> Result<(), ExportError> {
        self.claim_format(module, LinearFormat::Nvfp4)?;
        let tensors = nvfp4_tensors(module, matrix, input_scale)?;
        self.push_linear(tensors)
    }

    fn claim_format(&mut self, module: &str, format: LinearFormat) -> Result<(), ExportError> {
        match self.format {
            Some(existing) if existing != format => Err(ExportError::Layout {
                module: module.to_string(),
                message: format!(
                    "a {format:?} linear in a checkpoint that already holds {existing:?} linears"
                ),
            }),
            _ => {
                self.format = Some(format);
                Ok(())
            }
        }
    }

    fn push_linear(&mut self, tensors: Vec<(String, Tensor)>) -> Result<(), ExportError> {
        // Check every name first, so a duplicate linear adds none of its tensors.
        if let Some((name, _)) = tensors.iter().find(|(n, _)| self.shards.contains(n)) {
            return Err(ExportError::DuplicateTensor {
                tensor: name.clone(),
            });
        }
        for (name, tensor) in tensors {
            self.push(&name, tensor)?;
        }
        self.quantized_linears += 1;
        Ok(())
    }

    /// Completes the checkpoint and renames it into place: [`finish_staged`](Self::finish_staged)
    /// then [`StagedCheckpoint::commit`].
    pub fn finish(
        self,
        model_config: Value,
        quantization: &QuantizationConfig,
    ) -> Result<WrittenCheckpoint, ExportError> {
        self.finish_staged(model_config, quantization)?.commit()
    }

    /// Completes the checkpoint inside the staging directory: last shard, index, `config.json`
    /// (`model_config` with `quantization_config` added), `quantize_config.json` (GPTQ) or
    /// `hf_quant_config.json` (NVFP4), the source model's tokenizer files. Nothing is renamed
    /// yet: the result can be verified and given more files before the commit, and dropping it
    /// removes everything.
    ///
    /// A staging directory marked resumable ([`set_resumable`](Self::set_resumable)) stays
    /// so until the last shard is written and is unmarked before the shards are renamed (a
    /// resume manifest names them by their provisional names): from then on it is removed
    /// when dropped or interrupted.
    pub fn finish_staged(
        mut self,
        model_config: Value,
        quantization: &QuantizationConfig,
    ) -> Result<StagedCheckpoint, ExportError> {
        let dir = self.staged.path().to_path_buf();
        self.check_config_matches(quantization)?;
        self.shards.flush_last()?;
        self.staged.set_resumable(false);
        let layout = self.shards.finish()?;
        write_configs(&dir, model_config, quantization)?;
        let copied_files = copy_side_files(&self.side_files, &dir)?;
        Ok(StagedCheckpoint {
            written: WrittenCheckpoint {
                dir: self.staged.target().to_path_buf(),
                shards: layout.files,
                tensors: layout.tensors,
                tensor_bytes: layout.total_bytes,
                quantized_linears: self.quantized_linears,
                copied_files,
            },
            staged: self.staged,
        })
    }

    /// What was cleaned up when the writer started (see [`StagedDir::recovered`]).
    pub fn recovered(&self) -> &[String] {
        self.staged.recovered()
    }

    fn check_config_matches(&self, quantization: &QuantizationConfig) -> Result<(), ExportError> {
        let config_format = match quantization {
            QuantizationConfig::Gptq(_) => LinearFormat::Gptq,
            QuantizationConfig::Nvfp4(_) => LinearFormat::Nvfp4,
        };
        match self.format {
            Some(format) if format != config_format => Err(ExportError::Layout {
                module: CONFIG_FILE.to_string(),
                message: format!("a {config_format:?} config for {format:?} linears"),
            }),
            _ => Ok(()),
        }
    }
}

/// A complete checkpoint still in its staging directory: [`verify`](Self::verify) it, add
/// files ([`write_file`](Self::write_file)), then [`commit`](Self::commit). Dropped without a
/// commit, it is removed and the target is untouched.
#[derive(Debug)]
pub struct StagedCheckpoint {
    staged: StagedDir,
    written: WrittenCheckpoint,
}

impl StagedCheckpoint {
    /// The staging directory that holds the checkpoint until the commit.
    pub fn path(&self) -> &Path {
        self.staged.path()
    }

    /// What was written; `dir` is where the checkpoint will be after the commit.
    pub fn written(&self) -> &WrittenCheckpoint {
        &self.written
    }

    /// Runs the verifier on the staged files (GPTQ: for `gptq_marlin`).
    pub fn verify(&self) -> Result<crate::VerifyReport, ExportError> {
        crate::verify(self.staged.path())
    }

    /// Runs the verifier on the staged files with the shape rules of `target`'s loaders.
    pub fn verify_for(
        &self,
        target: crate::loaders::LoaderTarget,
    ) -> Result<crate::VerifyReport, ExportError> {
        crate::verify_for(self.staged.path(), target)
    }

    /// Writes one more file (e.g. a run report) into the checkpoint; `name` must be a plain file
    /// name that the checkpoint does not hold yet. The file is synced to disk, so a full disk
    /// fails here, naming the file, and not after the commit.
    pub fn write_file(&mut self, name: &str, bytes: &[u8]) -> Result<(), ExportError> {
        use std::io::Write;
        let plain = Path::new(name).file_name().is_some_and(|n| n == name);
        let path = self.staged.path().join(name);
        if !plain || path.exists() {
            return Err(ExportError::Io {
                path,
                source: std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "not a new plain file name in the checkpoint",
                ),
            });
        }
        let mut file = fs::File::create(&path).map_err(ExportError::io(&path))?;
        file.write_all(bytes)
            .and_then(|()| file.sync_all())
            .map_err(ExportError::io(&path))
    }

    /// Renames the checkpoint into place (see [`StagedDir::commit`]).
    pub fn commit(self) -> Result<WrittenCheckpoint, ExportError> {
        let dir = self.staged.commit()?;
        Ok(WrittenCheckpoint {
            dir,
            ..self.written
        })
    }
}

fn write_configs(
    dir: &Path,
    mut model_config: Value,
    quantization: &QuantizationConfig,
) -> Result<(), ExportError> {
    let config_path = dir.join(CONFIG_FILE);
    let section = match quantization {
        QuantizationConfig::Gptq(gptq) => {
            write_json(&dir.join(QUANTIZE_CONFIG_FILE), gptq)?;
            serde_json::to_value(gptq)
        }
        QuantizationConfig::Nvfp4(nvfp4) => {
            write_json(&dir.join(HF_QUANT_CONFIG_FILE), &nvfp4.hf_quant_config())?;
            serde_json::to_value(nvfp4.flat_config())
        }
    }
    .map_err(|e| ExportError::Json {
        path: config_path.clone(),
        message: e.to_string(),
    })?;
    let Some(object) = model_config.as_object_mut() else {
        return Err(ExportError::Json {
            path: config_path,
            message: "the model config is not a JSON object".to_string(),
        });
    };
    object.insert("quantization_config".to_string(), section);
    write_json(&config_path, &model_config)
}

/// The source model's tokenizer, chat template, generation config and `*.py` files (sorted
/// by name). Each must be a regular file that resolves, through every symbolic link, inside the
/// model directory (or the repository directory of a Hugging Face hub snapshot): a link to a
/// file elsewhere is refused rather than copied into the checkpoint.
fn side_files(source: &Path) -> Result<Vec<(String, PathBuf)>, ExportError> {
    let root = containment_root(source)?;
    let mut files = Vec::new();
    for entry in fs::read_dir(source).map_err(ExportError::io(source))? {
        let entry = entry.map_err(ExportError::io(source))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !is_side_file(&name) {
            continue;
        }
        let path = entry.path();
        let meta = fs::metadata(&path).map_err(ExportError::io(&path))?;
        if !meta.is_file() {
            return Err(ExportError::Io {
                path,
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "not a regular file (a directory or a device where a file belongs)",
                ),
            });
        }
        let resolved = fs::canonicalize(&path).map_err(ExportError::io(&path))?;
        if !resolved.starts_with(&root) {
            return Err(ExportError::OutsideSource {
                path,
                resolved,
                root,
            });
        }
        files.push((name, path));
    }
    files.sort();
    Ok(files)
}

/// The directory a model directory's files may resolve into: the directory itself, or for a
/// Hugging Face hub snapshot (`…/snapshots/<revision>`, whose files link to `../../blobs/`)
/// the repository's cache directory. (`sala_model::containment_root` does the same for the
/// tensors.)
fn containment_root(source: &Path) -> Result<PathBuf, ExportError> {
    let canonical = fs::canonicalize(source).map_err(ExportError::io(source))?;
    Ok(match canonical.parent() {
        Some(parent) if parent.file_name().is_some_and(|n| n == "snapshots") => {
            parent.parent().unwrap_or(parent).to_path_buf()
        }
        _ => canonical,
    })
}

/// Copies `files` into `dir` (a name the checkpoint already has is kept); their names.
fn copy_side_files(files: &[(String, PathBuf)], dir: &Path) -> Result<Vec<String>, ExportError> {
    let mut copied = Vec::new();
    for (name, path) in files {
        if dir.join(name).exists() {
            continue;
        }
        let to = dir.join(name);
        fs::copy(path, &to).map_err(|e| ExportError::Io {
            path: to.clone(),
            source: std::io::Error::new(e.kind(), format!("copying {} here: {e}", path.display())),
        })?;
        copied.push(name.clone());
    }
    Ok(copied)
}

fn is_side_file(name: &str) -> bool {
    SIDE_FILES.contains(&name)
        || Path::new(name)
            .extension()
            .is_some_and(|e| e == "py" || e == "jinja")
}
