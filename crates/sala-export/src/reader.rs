//! [`Checkpoint`]: opens an exported directory (sharded or single file, memory-mapped), detects
//! its format from the config files and returns tensors, packed linears, and dequantized f32
//! weights, so that an exported checkpoint can be evaluated like the original model.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorView};
use safetensors::{Dtype, SafeTensors};
use sala_formats::gptq_pack::codes_per_word;
use sala_formats::{GptqPacked, Nvfp4Matrix, ZeroConvention};
use serde_json::Value;

use crate::config::{
    read_json, GptqConfig, ModulePrecision, Nvfp4Config, CONFIG_FILE, HF_QUANT_CONFIG_FILE,
    QUANTIZE_CONFIG_FILE,
};
use crate::layout::{
    tensor_name, GPTQ_G_IDX, GPTQ_QWEIGHT, GPTQ_QZEROS, GPTQ_SCALES, NVFP4_INPUT_SCALE,
    NVFP4_WEIGHT, NVFP4_WEIGHT_SCALE, NVFP4_WEIGHT_SCALE_2,
};
use crate::shards::{ShardIndex, INDEX_FILE, SINGLE_FILE};
use crate::tensor::{decode_f32, decode_i32};
use crate::verify::{Rule, Violation};
use crate::writer::LinearFormat;
use crate::ExportError;

/// The quantization a checkpoint declares.
#[derive(Debug, Clone, PartialEq)]
pub enum CheckpointFormat {
    /// `quant_method: "gptq"`.
    Gptq(GptqConfig),
    /// `quant_method: "modelopt"`, `quant_algo: "NVFP4"`.
    Nvfp4(Nvfp4Config),
    /// No quantization config.
    Unquantized,
}

impl CheckpointFormat {
    /// `"gptq"`, `"nvfp4"` or `"unquantized"`.
    pub fn name(&self) -> &'static str {
        match self {
            CheckpointFormat::Gptq(_) => "gptq",
            CheckpointFormat::Nvfp4(_) => "nvfp4",
            CheckpointFormat::Unquantized => "unquantized",
        }
    }
}

/// A tensor decoded to f32.
#[derive(Debug, Clone, PartialEq)]
pub struct DenseTensor {
    /// Shape; a linear weight is `[out, in]`.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub values: Vec<f32>,
}

struct Shard {
    file: String,
    mmap: Mmap,
    header_len: usize,
    metadata: Metadata,
}

/// An opened checkpoint directory.
pub struct Checkpoint {
    dir: PathBuf,
    config: Value,
    format: CheckpointFormat,
    shards: Vec<Shard>,
    locations: BTreeMap<String, usize>,
    index: Option<ShardIndex>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("format", &self.format.name())
            .field("shards", &self.shards.len())
            .field("tensors", &self.locations.len())
            .finish()
    }
}

impl Checkpoint {
    /// Opens `dir`; fails on a missing or malformed config, an unsupported quantization
    /// method, or any disagreement between the index and the shards.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, ExportError> {
        let dir = dir.as_ref();
        let config = read_json(&dir.join(CONFIG_FILE))?;
        let format = detect_format(dir, &config).map_err(|message| ExportError::Json {
            path: dir.join(CONFIG_FILE),
            message,
        })?;
        let (checkpoint, problems) = Self::load(dir, config, format)?;
        if !problems.is_empty() {
            return Err(ExportError::Inconsistent {
                dir: dir.to_path_buf(),
                problems: problems.iter().map(ToString::to_string).collect(),
            });
        }
        Ok(checkpoint)
    }

    /// Opens `dir` for verification: every problem with the config, the index or the shards
    /// is returned as a violation instead of an error. Fails only if `dir` is not a directory.
    pub(crate) fn open_lenient(dir: &Path) -> Result<(Self, Vec<Violation>), ExportError> {
        if !dir.is_dir() {
            return Err(ExportError::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "not a directory"),
            });
        }
        let mut violations = Vec::new();
        let config = read_json(&dir.join(CONFIG_FILE)).unwrap_or_else(|e| {
            violations.push(Violation::new(Rule::Config, CONFIG_FILE, e.to_string()));
            Value::Null
        });
        let format = detect_format(dir, &config).unwrap_or_else(|message| {
            violations.push(Violation::new(Rule::Config, CONFIG_FILE, message));
            CheckpointFormat::Unquantized
        });
        let (checkpoint, problems) = Self::load(dir, config, format)?;
        violations.extend(problems);
        Ok((checkpoint, violations))
    }

    fn load(
        dir: &Path,
        config: Value,
        format: CheckpointFormat,
    ) -> Result<(Self, Vec<Violation>), ExportError> {
        let mut problems = Vec::new();
        let index = read_index(dir, &mut problems);
        let files = shard_files(dir, index.as_ref(), &mut problems)?;
        let mut checkpoint = Self {
            dir: dir.to_path_buf(),
            config,
            format,
            shards: Vec::new(),
            locations: BTreeMap::new(),
            index,
        };
        for file in files {
            match map_shard(dir, &file) {
                Ok(shard) => checkpoint.add_shard(shard, &mut problems),
                Err(message) => problems.push(Violation::new(Rule::Index, &file, message)),
            }
        }
        checkpoint.check_index(&mut problems);
        Ok((checkpoint, problems))
    }

    fn add_shard(&mut self, shard: Shard, problems: &mut Vec<Violation>) {
        let number = self.shards.len();
        for name in shard.metadata.offset_keys() {
            if let Some(&other) = self.locations.get(&name) {
                let first = &self.shards[other].file;
                let detail = format!("in both {first} and {}", shard.file);
                problems.push(Violation::new(Rule::Index, &name, detail));
                continue;
            }
            self.locations.insert(name, number);
        }
        self.shards.push(shard);
    }

    /// Every tensor of the index is in the file it names, every tensor of a shard is in the
    /// index, and `total_size` is the sum of the data.
    fn check_index(&self, problems: &mut Vec<Violation>) {
        let Some(index) = &self.index else { return };
        let loaded: Vec<&str> = self.shards.iter().map(|s| s.file.as_str()).collect();
        for (name, file) in &index.weight_map {
            match self.locations.get(name) {
                Some(&s) if self.shards[s].file == *file => {}
                Some(&s) => problems.push(Violation::new(
                    Rule::Index,
                    name,
                    format!("index says {file}, found in {}", self.shards[s].file),
                )),
                None if loaded.contains(&file.as_str()) => problems.push(Violation::new(
                    Rule::Index,
                    name,
                    format!("listed in the index but absent from {file}"),
                )),
                None => {}
            }
        }
        for name in self.locations.keys() {
            if !index.weight_map.contains_key(name) {
                problems.push(Violation::new(Rule::Index, name, "not listed in the index"));
            }
        }
        let total: u64 = self.tensor_bytes();
        let declared = index.metadata.total_size;
        if declared != 0 && declared != total {
            let detail = format!("metadata.total_size {declared} but the shards hold {total}");
            problems.push(Violation::new(Rule::Index, INDEX_FILE, detail));
        }
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `config.json` as read (`null` if it could not be read during verification).
    pub fn config(&self) -> &Value {
        &self.config
    }

    /// The declared quantization.
    pub fn format(&self) -> &CheckpointFormat {
        &self.format
    }

    /// The shard files, in order.
    pub fn shard_files(&self) -> Vec<&str> {
        self.shards.iter().map(|s| s.file.as_str()).collect()
    }

    /// The shard index, if the checkpoint has one.
    pub fn index(&self) -> Option<&ShardIndex> {
        self.index.as_ref()
    }

    /// All tensor names, sorted.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.locations.keys().map(String::as_str)
    }

    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> bool {
        self.locations.contains_key(name)
    }

    /// Dtype and shape of a tensor without reading its data.
    pub fn tensor_info(&self, name: &str) -> Option<(Dtype, &[usize])> {
        let shard = &self.shards[*self.locations.get(name)?];
        let info = shard.metadata.info(name)?;
        Some((info.dtype, &info.shape))
    }

    /// Bytes of tensor data in all shards.
    pub fn tensor_bytes(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.metadata.data_len() as u64)
            .sum()
    }

    /// A view of a tensor's stored bytes (memory-mapped, no copy).
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, ExportError> {
        let missing = || ExportError::Missing {
            dir: self.dir.clone(),
            name: name.to_string(),
        };
        let shard = &self.shards[*self.locations.get(name).ok_or_else(missing)?];
        let info = shard.metadata.info(name).ok_or_else(missing)?;
        let start = 8 + shard.header_len + info.data_offsets.0;
        let end = 8 + shard.header_len + info.data_offsets.1;
        TensorView::new(info.dtype, info.shape.clone(), &shard.mmap[start..end]).map_err(|e| {
            ExportError::Safetensors {
                path: self.dir.join(&shard.file),
                message: format!("{name}: {e}"),
            }
        })
    }

    /// Drops the resident pages of tensor `name`'s bytes from this process (a later read maps
    /// them in again from the page cache or the file): a pass over every tensor of a
    /// multi-GB checkpoint would otherwise keep all of it in the resident set. Best effort: an
    /// unknown name or a refusal of the kernel changes nothing.
    pub fn release(&self, name: &str) {
        #[cfg(unix)]
        if let Some(shard) = self.locations.get(name).map(|&s| &self.shards[s]) {
            if let Some(info) = shard.metadata.info(name) {
                let start = 8 + shard.header_len + info.data_offsets.0;
                let len = info.data_offsets.1 - info.data_offsets.0;
                // SAFETY: the mapping is read-only and backed by a file nobody may change while
                // the checkpoint is open: after MADV_DONTNEED a read maps the very same bytes
                // in again, so views borrowed from the map keep their values.
                let _ = unsafe {
                    shard.mmap.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        start,
                        len,
                    )
                };
            }
        }
    }

    /// A tensor decoded to f32 (floating-point, FP8 and integer dtypes); its mapped pages are
    /// released afterwards ([`Checkpoint::release`]).
    pub fn tensor_f32(&self, name: &str) -> Result<DenseTensor, ExportError> {
        let view = self.tensor(name)?;
        let values = decode_f32(name, view.dtype(), view.data())?;
        self.release(name);
        Ok(DenseTensor {
            shape: view.shape().to_vec(),
            values,
        })
    }

    fn tensor_i32(&self, name: &str) -> Result<(Vec<usize>, Vec<i32>), ExportError> {
        let view = self.tensor(name)?;
        Ok((
            view.shape().to_vec(),
            decode_i32(name, view.dtype(), view.data())?,
        ))
    }

    /// Quantized linears (module names, sorted) and their layout, found from the tensor names:
    /// a `qweight` makes a GPTQ linear, a `weight_scale` an NVFP4 one.
    pub fn quantized_linears(&self) -> Vec<(String, LinearFormat)> {
        self.tensor_names()
            .filter_map(|name| {
                let (module, suffix) = name.rsplit_once('.')?;
                match suffix {
                    GPTQ_QWEIGHT => Some((module.to_string(), LinearFormat::Gptq)),
                    NVFP4_WEIGHT_SCALE => Some((module.to_string(), LinearFormat::Nvfp4)),
                    _ => None,
                }
            })
            .collect()
    }

    /// The GPTQ tensors of `module` as a [`GptqPacked`] (scales as the fp16 values, in f32).
    ///
    /// Bits come from the `qweight` shape; the group size from the config (per-module
    /// `dynamic` overrides included) or, without one, from the number of groups.
    pub fn gptq_linear(&self, module: &str) -> Result<GptqPacked, ExportError> {
        let (qweight_shape, qweight) = self.tensor_i32(&tensor_name(module, GPTQ_QWEIGHT))?;
        let (_, qzeros) = self.tensor_i32(&tensor_name(module, GPTQ_QZEROS))?;
        let (_, g_idx) = self.tensor_i32(&tensor_name(module, GPTQ_G_IDX))?;
        let scales = self.tensor_f32(&tensor_name(module, GPTQ_SCALES))?;
        let layout_error = |message: String| ExportError::Layout {
            module: module.to_string(),
            message,
        };
        let [words, out] = qweight_shape[..] else {
            return Err(layout_error(format!(
                "qweight shape {qweight_shape:?} is not 2-D"
            )));
        };
        let inp = g_idx.len();
        let bits = gptq_bits(words, inp)
            .ok_or_else(|| layout_error(format!("qweight rows {words} do not fit {inp} inputs")))?;
        let groups = scales.shape.first().copied().unwrap_or(0);
        let (group_size, zero_convention) = self.gptq_group_size(module, inp, groups);
        let packed = GptqPacked {
            out_features: out,
            in_features: inp,
            bits,
            group_size,
            qweight,
            qzeros,
            scales: scales.values,
            g_idx,
            zero_convention,
        };
        // Checks every length and group index once, so later dequantization cannot fail.
        packed.unpack().map_err(ExportError::format(module))?;
        Ok(packed)
    }

    fn gptq_group_size(&self, module: &str, inp: usize, groups: usize) -> (usize, ZeroConvention) {
        let inferred = inp.div_ceil(groups.max(1));
        let CheckpointFormat::Gptq(config) = &self.format else {
            return (inferred, ZeroConvention::V1);
        };
        let zeros = match config.checkpoint_format.as_str() {
            "gptq_v2" => ZeroConvention::V2,
            _ => ZeroConvention::V1,
        };
        let configured = config.rules().ok().map(|r| r.precision(module));
        let group_size = match configured {
            Some(ModulePrecision::Quantized { group_size, .. }) if group_size > 0 => {
                group_size as usize
            }
            Some(ModulePrecision::Quantized { .. }) => inp,
            _ => inferred,
        };
        (group_size, zeros)
    }

    /// The NVFP4 tensors of `module` and its `input_scale` (`None` if absent).
    pub fn nvfp4_linear(&self, module: &str) -> Result<(Nvfp4Matrix, Option<f32>), ExportError> {
        let weight = self.tensor(&tensor_name(module, NVFP4_WEIGHT))?;
        let scales = self.tensor(&tensor_name(module, NVFP4_WEIGHT_SCALE))?;
        let layout_error = |message: String| ExportError::Layout {
            module: module.to_string(),
            message,
        };
        let [rows, half_cols] = weight.shape()[..] else {
            return Err(layout_error(format!(
                "weight shape {:?} is not 2-D",
                weight.shape()
            )));
        };
        let cols = 2 * half_cols;
        let expected = [rows, cols / 16];
        if weight.dtype() != Dtype::U8
            || scales.dtype() != Dtype::F8_E4M3
            || scales.shape() != expected
            || cols % 16 != 0
        {
            return Err(layout_error(format!(
                "expected weight U8 [{rows}, {half_cols}] with in % 16 == 0 and weight_scale \
                 F8_E4M3 {expected:?}; got {} {:?} and {} {:?}",
                weight.dtype(),
                weight.shape(),
                scales.dtype(),
                scales.shape()
            )));
        }
        let global_scale = self.scalar(&tensor_name(module, NVFP4_WEIGHT_SCALE_2))?;
        let input_name = tensor_name(module, NVFP4_INPUT_SCALE);
        let input_scale = match self.contains(&input_name) {
            true => Some(self.scalar(&input_name)?),
            false => None,
        };
        let matrix = Nvfp4Matrix {
            rows,
            cols,
            packed: weight.data().to_vec(),
            block_scales: scales.data().to_vec(),
            global_scale,
        };
        Ok((matrix, input_scale))
    }

    /// A one-element tensor (`[]` or `[1]`) as f32.
    pub fn scalar(&self, name: &str) -> Result<f32, ExportError> {
        let dense = self.tensor_f32(name)?;
        match dense.values[..] {
            [v] => Ok(v),
            _ => Err(ExportError::Layout {
                module: name.to_string(),
                message: format!("expected a scalar, got shape {:?}", dense.shape),
            }),
        }
    }

    /// The weight of linear `module` as f32 `[out, in]`: dequantized if it is quantized (GPTQ
    /// or NVFP4), decoded from `module.weight` otherwise.
    pub fn linear_weight(&self, module: &str) -> Result<DenseTensor, ExportError> {
        if self.contains(&tensor_name(module, GPTQ_QWEIGHT)) {
            let packed = self.gptq_linear(module)?;
            let values = packed.dequantize().map_err(ExportError::format(module))?;
            return Ok(DenseTensor {
                shape: vec![packed.out_features, packed.in_features],
                values,
            });
        }
        if self.contains(&tensor_name(module, NVFP4_WEIGHT_SCALE)) {
            let (matrix, _) = self.nvfp4_linear(module)?;
            return Ok(DenseTensor {
                shape: vec![matrix.rows, matrix.cols],
                values: matrix.dequantize(),
            });
        }
        self.tensor_f32(&tensor_name(module, NVFP4_WEIGHT))
    }
}

/// Bits per code from `qweight` rows and input features, when they fit a packable width.
pub(crate) fn gptq_bits(words: usize, inp: usize) -> Option<u32> {
    if inp == 0 || (words * 32) % inp != 0 {
        return None;
    }
    let bits = (words * 32 / inp) as u32;
    codes_per_word(bits).ok().map(|_| bits)
}

/// The format a config declares; `Err` names what is unreadable or unsupported.
fn detect_format(dir: &Path, config: &Value) -> Result<CheckpointFormat, String> {
    let section = config.get("quantization_config");
    let method = section
        .and_then(|q| q.get("quant_method"))
        .and_then(Value::as_str);
    match (section, method) {
        (Some(q), Some("gptq")) => parse_gptq(q),
        (Some(q), Some(m)) if m.starts_with("modelopt") => Nvfp4Config::from_json(q)
            .map(CheckpointFormat::Nvfp4)
            .ok_or_else(|| "quantization_config has neither `ignore` nor `exclude_modules`".into()),
        (Some(_), m) => Err(format!("unsupported quant_method {m:?}")),
        (None, _) => detect_from_side_files(dir),
    }
}

fn detect_from_side_files(dir: &Path) -> Result<CheckpointFormat, String> {
    let hf = dir.join(HF_QUANT_CONFIG_FILE);
    let gptq = dir.join(QUANTIZE_CONFIG_FILE);
    if hf.is_file() {
        let value = read_json(&hf).map_err(|e| e.to_string())?;
        return Nvfp4Config::from_json(&value)
            .map(CheckpointFormat::Nvfp4)
            .ok_or_else(|| format!("{HF_QUANT_CONFIG_FILE} lacks quantization.exclude_modules"));
    }
    if gptq.is_file() {
        return parse_gptq(&read_json(&gptq).map_err(|e| e.to_string())?);
    }
    Ok(CheckpointFormat::Unquantized)
}

fn parse_gptq(value: &Value) -> Result<CheckpointFormat, String> {
    serde_json::from_value(value.clone())
        .map(CheckpointFormat::Gptq)
        .map_err(|e| format!("GPTQ quantization_config: {e}"))
}

fn read_index(dir: &Path, problems: &mut Vec<Violation>) -> Option<ShardIndex> {
    let path = dir.join(INDEX_FILE);
    if !path.is_file() {
        return None;
    }
    let parsed = read_json(&path).and_then(|v| {
        serde_json::from_value(v).map_err(|e| ExportError::Json {
            path: path.clone(),
            message: e.to_string(),
        })
    });
    match parsed {
        Ok(index) => Some(index),
        Err(e) => {
            problems.push(Violation::new(Rule::Index, INDEX_FILE, e.to_string()));
            None
        }
    }
}

/// The shard files: those the index names (plain file names only), else `model.safetensors`.
fn shard_files(
    dir: &Path,
    index: Option<&ShardIndex>,
    problems: &mut Vec<Violation>,
) -> Result<Vec<String>, ExportError> {
    let Some(index) = index else {
        if !dir.join(SINGLE_FILE).is_file() {
            let detail = format!("neither {INDEX_FILE} nor {SINGLE_FILE} exists");
            problems.push(Violation::new(
                Rule::Index,
                dir.display().to_string(),
                detail,
            ));
            return Ok(Vec::new());
        }
        return Ok(vec![SINGLE_FILE.to_string()]);
    };
    let mut files: Vec<String> = index.weight_map.values().cloned().collect();
    files.sort();
    files.dedup();
    Ok(files
        .into_iter()
        .filter(|file| {
            let plain = Path::new(file)
                .file_name()
                .is_some_and(|n| n == file.as_str());
            let detail = match (plain, dir.join(file).is_file()) {
                (true, true) => return true,
                (false, _) => "not a plain file name inside the checkpoint directory",
                (true, false) => "listed in the index but missing",
            };
            problems.push(Violation::new(Rule::Index, file, detail));
            false
        })
        .collect())
}

fn map_shard(dir: &Path, file: &str) -> Result<Shard, String> {
    let path = dir.join(file);
    let handle = File::open(&path).map_err(|e| e.to_string())?;
    // SAFETY: the file is opened read-only; as for every mmap-based loader, the caller must not
    // truncate it while the checkpoint is open.
    let mmap = unsafe { Mmap::map(&handle) }.map_err(|e| e.to_string())?;
    let (header_len, metadata) =
        SafeTensors::read_metadata(&mmap).map_err(|e| format!("invalid safetensors: {e}"))?;
    Ok(Shard {
        file: file.to_string(),
        mmap,
        header_len,
        metadata,
    })
}
