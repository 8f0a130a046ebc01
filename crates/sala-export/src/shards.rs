//! Safetensors shards of bounded size and the `model.safetensors.index.json` that maps every
//! tensor to its shard (the Hugging Face layout every loader reads).
//!
//! A shard's header lists all its tensors with their offsets, so a shard is written only when it
//! is full (at most `max_shard_bytes`, or one tensor if a single tensor is larger). Until then
//! its tensors' bytes wait in a data file next to it (`shard-NNNNN.partial.data`), not in
//! memory: a 4 GB shard held in memory was a third of the real job's host memory. The shard is
//! then written from that file, one tensor at a time. Shards are first written under
//! provisional names, because the final names `model-0000i-of-0000N.safetensors` need the shard
//! count; a checkpoint that fits in one shard is written as `model.safetensors` without an
//! index, as `save_pretrained` does.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use safetensors::tensor::View;
use safetensors::Dtype;

use serde::{Deserialize, Serialize};

use crate::tensor::Tensor;
use crate::ExportError;

/// The single-file checkpoint name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The shard index name.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Default maximum shard size: 4 GB (decimal, as `save_pretrained`'s `max_shard_size`).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 4_000_000_000;

/// `model.safetensors.index.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ShardIndex {
    /// `{"total_size": bytes of tensor data}`.
    #[serde(default)]
    pub metadata: IndexMetadata,
    /// Tensor name → shard file name (inside the checkpoint directory).
    pub weight_map: BTreeMap<String, String>,
}

/// The index's `metadata` object.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct IndexMetadata {
    /// Sum of all tensors' data bytes (headers excluded).
    #[serde(default)]
    pub total_size: u64,
}

/// Where the tensors ended up.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardLayout {
    /// Shard file names, in order.
    pub files: Vec<String>,
    /// Number of tensors.
    pub tensors: usize,
    /// Bytes of tensor data.
    pub total_bytes: u64,
}

struct WrittenShard {
    provisional: PathBuf,
    tensors: Vec<String>,
    bytes: u64,
}

/// A shard a [`crate::CheckpointWriter`] has written (and synced, once listed) so far, under its
/// provisional name: part of a resumable run's state ([`crate::WriterState`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlushedShard {
    /// File name inside the staging directory.
    pub file: String,
    /// Its tensors, in the order they were added.
    pub tensors: Vec<String>,
    /// Bytes of tensor data in it.
    pub bytes: u64,
    /// Size of the file, bytes (checked when resuming).
    pub file_size: u64,
}

/// A tensor of the shard being filled: its bytes lie in the data file at `offset`.
struct PendingTensor {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    offset: u64,
    len: usize,
}

/// The data file of the shard being filled, and the tensors in it.
struct Spill {
    path: PathBuf,
    file: fs::File,
    tensors: Vec<PendingTensor>,
}

/// A pending tensor read back from the data file while its shard is written; the first read
/// error is kept for the writer to report (a `View` cannot fail).
struct SpilledView<'a> {
    tensor: &'a PendingTensor,
    file: &'a RefCell<fs::File>,
    error: &'a RefCell<Option<std::io::Error>>,
}

impl View for SpilledView<'_> {
    fn dtype(&self) -> Dtype {
        self.tensor.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.tensor.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let mut bytes = vec![0u8; self.tensor.len];
        let mut file = self.file.borrow_mut();
        let read = file
            .seek(SeekFrom::Start(self.tensor.offset))
            .and_then(|_| file.read_exact(&mut bytes));
        if let Err(e) = read {
            self.error.borrow_mut().get_or_insert(e);
        }
        Cow::Owned(bytes)
    }

    fn data_len(&self) -> usize {
        self.tensor.len
    }
}

/// Accumulates tensors and writes a shard whenever the next tensor would overflow the limit.
pub(crate) struct ShardWriter {
    dir: PathBuf,
    max_bytes: u64,
    /// The shard being filled (`None` until its first tensor).
    pending: Option<Spill>,
    pending_bytes: u64,
    written: Vec<WrittenShard>,
    names: HashSet<String>,
    total_bytes: u64,
}

impl ShardWriter {
    pub(crate) fn new(dir: &Path, max_bytes: u64) -> Self {
        Self {
            dir: dir.to_path_buf(),
            max_bytes: max_bytes.max(1),
            pending: None,
            pending_bytes: 0,
            written: Vec::new(),
            names: HashSet::new(),
            total_bytes: 0,
        }
    }

    /// A writer that has already written `flushed` (files in `dir`, each checked to exist with
    /// its recorded size); tensors pushed next continue the sequence.
    pub(crate) fn restore(
        dir: &Path,
        max_bytes: u64,
        flushed: &[FlushedShard],
    ) -> Result<Self, ExportError> {
        let mut writer = Self::new(dir, max_bytes);
        for shard in flushed {
            let path = dir.join(&shard.file);
            let size = fs::metadata(&path).map_err(ExportError::io(&path))?.len();
            if size != shard.file_size || Path::new(&shard.file).file_name().is_none() {
                return Err(ExportError::Io {
                    path,
                    source: std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!(
                            "a staged shard of {size} bytes where the resume manifest recorded {}",
                            shard.file_size
                        ),
                    ),
                });
            }
            for name in &shard.tensors {
                if !writer.names.insert(name.clone()) {
                    return Err(ExportError::DuplicateTensor {
                        tensor: name.clone(),
                    });
                }
            }
            writer.total_bytes += shard.bytes;
            writer.written.push(WrittenShard {
                provisional: path,
                tensors: shard.tensors.clone(),
                bytes: shard.bytes,
            });
        }
        Ok(writer)
    }

    /// Syncs every shard written so far to disk (cheap for one already written back).
    fn sync_written(&self) -> Result<(), ExportError> {
        for shard in &self.written {
            fs::File::open(&shard.provisional)
                .and_then(|f| f.sync_all())
                .map_err(ExportError::io(&shard.provisional))?;
        }
        Ok(())
    }

    /// The shards written so far, synced to disk (a resume manifest counts on them).
    pub(crate) fn flushed(&self) -> Result<Vec<FlushedShard>, ExportError> {
        self.sync_written()?;
        self.written
            .iter()
            .map(|shard| {
                let file_size = fs::metadata(&shard.provisional)
                    .map_err(ExportError::io(&shard.provisional))?
                    .len();
                Ok(FlushedShard {
                    file: shard
                        .provisional
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                    tensors: shard.tensors.clone(),
                    bytes: shard.bytes,
                    file_size,
                })
            })
            .collect()
    }

    /// Whether `file` (a name in the directory) is a provisional shard name of this writer's
    /// scheme (`shard-NNNNN.partial`).
    pub(crate) fn is_provisional_name(file: &str) -> bool {
        file.strip_prefix("shard-")
            .and_then(|rest| rest.strip_suffix(".partial"))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    }

    pub(crate) fn contains(&self, name: &str) -> bool {
        self.names.contains(name)
    }

    pub(crate) fn push(&mut self, name: &str, tensor: Tensor) -> Result<(), ExportError> {
        if !self.names.insert(name.to_string()) {
            return Err(ExportError::DuplicateTensor {
                tensor: name.to_string(),
            });
        }
        let bytes = tensor.byte_len() as u64;
        if self.pending.is_some() && self.pending_bytes + bytes > self.max_bytes {
            self.flush()?;
        }
        let spill = match &mut self.pending {
            Some(spill) => spill,
            None => {
                let path = self.provisional().with_extension("partial.data");
                let file = fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(&path)
                    .map_err(ExportError::io(&path))?;
                self.pending.insert(Spill {
                    path,
                    file,
                    tensors: Vec::new(),
                })
            }
        };
        spill
            .file
            .write_all(&tensor.data)
            .map_err(ExportError::io(&spill.path))?;
        spill.tensors.push(PendingTensor {
            name: name.to_string(),
            dtype: tensor.dtype,
            shape: tensor.shape,
            offset: self.pending_bytes,
            len: tensor.data.len(),
        });
        self.pending_bytes += bytes;
        self.total_bytes += bytes;
        Ok(())
    }

    /// The provisional name of the next shard.
    fn provisional(&self) -> PathBuf {
        self.dir
            .join(format!("shard-{:05}.partial", self.written.len() + 1))
    }

    fn flush(&mut self) -> Result<(), ExportError> {
        let provisional = self.provisional();
        let bytes = std::mem::take(&mut self.pending_bytes);
        let (tensors, spill_path) = match self.pending.take() {
            Some(Spill {
                path,
                file,
                tensors,
            }) => {
                let file = RefCell::new(file);
                let error = RefCell::new(None);
                // `format: pt` is what transformers checks before it accepts a safetensors file.
                let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
                let views = tensors.iter().map(|tensor| {
                    let view = SpilledView {
                        tensor,
                        file: &file,
                        error: &error,
                    };
                    (tensor.name.as_str(), view)
                });
                safetensors::serialize_to_file(views, Some(metadata), &provisional).map_err(
                    |e| ExportError::Safetensors {
                        path: provisional.clone(),
                        message: e.to_string(),
                    },
                )?;
                if let Some(e) = error.into_inner() {
                    return Err(ExportError::io(&path)(e));
                }
                (tensors, Some(path))
            }
            // No tensor at all: an empty shard, so that a checkpoint has one.
            None => {
                let empty: [(&str, &Tensor); 0] = [];
                let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
                safetensors::serialize_to_file(empty, Some(metadata), &provisional).map_err(
                    |e| ExportError::Safetensors {
                        path: provisional.clone(),
                        message: e.to_string(),
                    },
                )?;
                (Vec::new(), None)
            }
        };
        // Not synced here: the kernel writes the pages back while the run goes on, and a
        // shard is synced before anything counts on it being on disk (`flushed`, for a resume
        // manifest; the staging directory's commit syncs every file), by then mostly a
        // formality.
        if let Some(path) = spill_path {
            fs::remove_file(&path).map_err(ExportError::io(&path))?;
        }
        self.written.push(WrittenShard {
            provisional,
            tensors: tensors.into_iter().map(|t| t.name).collect(),
            bytes,
        });
        Ok(())
    }

    /// Writes the last shard (nothing if every tensor is written, unless no shard is).
    pub(crate) fn flush_last(&mut self) -> Result<(), ExportError> {
        if self.pending.is_some() || self.written.is_empty() {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes the last shard, gives every shard its final name and writes the index.
    pub(crate) fn finish(mut self) -> Result<ShardLayout, ExportError> {
        self.flush_last()?;
        let count = self.written.len();
        let mut index = ShardIndex {
            metadata: IndexMetadata {
                total_size: self.total_bytes,
            },
            weight_map: BTreeMap::new(),
        };
        let mut files = Vec::with_capacity(count);
        for (i, shard) in self.written.iter().enumerate() {
            let file = match count {
                1 => SINGLE_FILE.to_string(),
                _ => format!("model-{:05}-of-{count:05}.safetensors", i + 1),
            };
            let path = self.dir.join(&file);
            fs::rename(&shard.provisional, &path).map_err(ExportError::io(&path))?;
            for name in &shard.tensors {
                index.weight_map.insert(name.clone(), file.clone());
            }
            files.push(file);
        }
        if count > 1 {
            crate::config::write_json(&self.dir.join(INDEX_FILE), &index)?;
        }
        Ok(ShardLayout {
            files,
            tensors: self.names.len(),
            total_bytes: self.total_bytes,
        })
    }
}
