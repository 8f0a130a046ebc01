//! Safetensors shards of bounded size and the `model.safetensors.index.json` that maps every
//! tensor to its shard (the Hugging Face layout every loader reads).
//!
//! A shard's header lists all its tensors with their offsets, so a shard is kept in memory until
//! it is full (at most `max_shard_bytes`, or one tensor if a single tensor is larger) and then
//! written in one go. Shards are first written under provisional names, because the final names
//! `model-0000i-of-0000N.safetensors` need the shard count; a checkpoint that fits in one shard
//! is written as `model.safetensors` without an index, as `save_pretrained` does.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

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
}

/// Accumulates tensors and writes a shard whenever the next tensor would overflow the limit.
pub(crate) struct ShardWriter {
    dir: PathBuf,
    max_bytes: u64,
    pending: Vec<(String, Tensor)>,
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
            pending: Vec::new(),
            pending_bytes: 0,
            written: Vec::new(),
            names: HashSet::new(),
            total_bytes: 0,
        }
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
        if !self.pending.is_empty() && self.pending_bytes + bytes > self.max_bytes {
            self.flush()?;
        }
        self.pending_bytes += bytes;
        self.total_bytes += bytes;
        self.pending.push((name.to_string(), tensor));
        Ok(())
    }

    fn flush(&mut self) -> Result<(), ExportError> {
        let provisional = self
            .dir
            .join(format!("shard-{:05}.partial", self.written.len() + 1));
        let pending = std::mem::take(&mut self.pending);
        self.pending_bytes = 0;
        // `format: pt` is what transformers checks before it accepts a safetensors file.
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(
            pending.iter().map(|(name, t)| (name.as_str(), t)),
            Some(metadata),
            &provisional,
        )
        .map_err(|e| ExportError::Safetensors {
            path: provisional.clone(),
            message: e.to_string(),
        })?;
        self.written.push(WrittenShard {
            provisional,
            tensors: pending.into_iter().map(|(name, _)| name).collect(),
        });
        Ok(())
    }

    /// Writes the last shard, gives every shard its final name and writes the index.
    pub(crate) fn finish(mut self) -> Result<ShardLayout, ExportError> {
        if !self.pending.is_empty() || self.written.is_empty() {
            self.flush()?;
        }
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
