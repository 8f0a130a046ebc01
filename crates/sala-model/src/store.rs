//! Memory-mapped safetensors checkpoints: one `model.safetensors` or shards listed in
//! `model.safetensors.index.json`. Nothing is read until a tensor is asked for, so a 18 GB
//! model costs only its page-cache footprint.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Component, Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use crate::config::{SalaConfig, TensorSpec};
use crate::error::{ModelError, Result};
use crate::host::HostTensor;

/// Single-file checkpoint name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Shard index name.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Where a tensor lives and how it is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Storage dtype as safetensors names it.
    pub dtype: Dtype,
    /// Shape, row-major.
    pub shape: Vec<usize>,
    /// The shard file that holds it.
    pub file: PathBuf,
}

struct Shard {
    path: PathBuf,
    mmap: Mmap,
    /// Byte offset of the data section (8-byte length + JSON header).
    data_start: usize,
}

struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range inside the shard's data section.
    range: (usize, usize),
}

/// Read-only view of all tensors of a model directory.
pub struct TensorStore {
    dir: PathBuf,
    shards: Vec<Shard>,
    entries: BTreeMap<String, Entry>,
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: HashMap<String, String>,
}

impl TensorStore {
    /// Opens `dir/model.safetensors.index.json` if present, else `dir/model.safetensors`.
    ///
    /// The index and every shard must resolve (through symbolic links, canonically) inside the
    /// model directory, or inside the repository directory of a Hugging Face hub snapshot
    /// (see [`containment_root`]).
    pub fn open(dir: &Path) -> Result<Self> {
        // A directory that does not resolve fails below, naming the file that was looked for.
        let root = containment_root(dir).unwrap_or_else(|_| dir.to_owned());
        let index_path = dir.join(INDEX_FILE);
        let shard_names = if index_path.is_file() {
            check_contained(&index_path, &root)?;
            read_index(&index_path)?
        } else {
            vec![(SINGLE_FILE.to_owned(), None)]
        };
        let mut store = Self {
            dir: dir.to_owned(),
            shards: Vec::new(),
            entries: BTreeMap::new(),
        };
        let mut shard_of_file: HashMap<String, usize> = HashMap::new();
        for (file, _) in &shard_names {
            if !shard_of_file.contains_key(file) {
                shard_of_file.insert(file.clone(), store.shards.len());
                let path = dir.join(file);
                if path.exists() {
                    check_contained(&path, &root)?;
                }
                store.add_shard(&path)?;
            }
        }
        // With an index, the index is authoritative: each listed tensor must be in its shard.
        for (file, tensor) in &shard_names {
            if let Some(tensor) = tensor {
                let shard = shard_of_file[file];
                match store.entries.get(tensor) {
                    Some(e) if e.shard == shard => {}
                    _ => {
                        return Err(ModelError::MissingTensor {
                            path: dir.join(file),
                            tensor: tensor.clone(),
                        })
                    }
                }
            }
        }
        Ok(store)
    }

    fn add_shard(&mut self, path: &Path) -> Result<()> {
        let file = File::open(path).map_err(|source| ModelError::Io {
            path: path.to_owned(),
            source,
        })?;
        if !file.metadata().is_ok_and(|m| m.is_file()) {
            return Err(ModelError::Io {
                path: path.to_owned(),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "not a regular file (a directory where the safetensors file belongs?)",
                ),
            });
        }
        // SAFETY: the map is read-only; the usual caveat of memory maps applies (another process
        // truncating the file while we read it is undefined behaviour), as for every mmap loader.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|source| ModelError::Io {
            path: path.to_owned(),
            source,
        })?;
        let (header_len, metadata) =
            SafeTensors::read_metadata(&mmap).map_err(|e| ModelError::Safetensors {
                path: path.to_owned(),
                message: e.to_string(),
            })?;
        let shard = self.shards.len();
        for (name, info) in metadata.tensors() {
            if self.entries.contains_key(&name) {
                return Err(ModelError::Safetensors {
                    path: path.to_owned(),
                    message: format!("tensor {name} appears in more than one shard"),
                });
            }
            self.entries.insert(
                name,
                Entry {
                    shard,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    range: info.data_offsets,
                },
            );
        }
        self.shards.push(Shard {
            path: path.to_owned(),
            mmap,
            data_start: 8 + header_len,
        });
        Ok(())
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// Whether the checkpoint has tensor `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.entries
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                path: self.dir.clone(),
                tensor: name.to_owned(),
            })
    }

    /// Dtype, shape and shard file of tensor `name`.
    pub fn info(&self, name: &str) -> Result<TensorInfo> {
        let e = self.entry(name)?;
        Ok(TensorInfo {
            dtype: e.dtype,
            shape: e.shape.clone(),
            file: self.shards[e.shard].path.clone(),
        })
    }

    /// The stored bytes of tensor `name` in their original dtype (little-endian, row-major),
    /// for copying a tensor unchanged into another checkpoint.
    pub fn raw_bytes(&self, name: &str) -> Result<&[u8]> {
        let e = self.entry(name)?;
        let shard = &self.shards[e.shard];
        let start = shard.data_start + e.range.0;
        let end = shard.data_start + e.range.1;
        Ok(&shard.mmap[start..end])
    }

    /// Tensor `name` converted to f32 (from BF16, F16 or F32). The mapped pages it was read
    /// from are released afterwards ([`TensorStore::release`]).
    pub fn to_f32(&self, name: &str) -> Result<HostTensor> {
        let e = self.entry(name)?;
        let data = decode_f32(self.raw_bytes(name)?, e.dtype)
            .ok_or_else(|| self.unsupported_dtype(name, e))?;
        self.release(name);
        Ok(HostTensor::new(e.shape.clone(), data))
    }

    /// Drops the resident pages of tensor `name`'s bytes from this process (a later read maps
    /// them in again from the page cache or the file): a layer-by-layer pass over a 19 GB
    /// checkpoint would otherwise keep every layer it read in its resident set. Best effort:
    /// an unknown name or a refusal of the kernel changes nothing.
    pub fn release(&self, name: &str) {
        #[cfg(unix)]
        if let Ok(e) = self.entry(name) {
            let shard = &self.shards[e.shard];
            let start = shard.data_start + e.range.0;
            // SAFETY: the mapping is read-only and backed by a file nobody may change while the
            // store reads it (as `open` requires): after MADV_DONTNEED a read maps the very same
            // bytes in again, so slices borrowed from the map keep their values.
            let _ = unsafe {
                shard.mmap.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    start,
                    e.range.1 - e.range.0,
                )
            };
        }
    }

    /// Rows `ids` of the 2-D tensor `name`, as f32 `[ids.len(), cols]`; reads only those rows
    /// (used for the embedding lookup, which must not load a 73448 × 4096 matrix).
    pub fn rows_f32(&self, name: &str, ids: &[u32]) -> Result<HostTensor> {
        let e = self.entry(name)?;
        let (rows, cols) = match e.shape[..] {
            [rows, cols] => (rows, cols),
            _ => {
                return Err(ModelError::InvalidInput(format!(
                    "tensor {name} has shape {:?}, rows_f32 needs a matrix",
                    e.shape
                )))
            }
        };
        let elem = e.dtype.bitsize() / 8;
        let bytes = self.raw_bytes(name)?;
        let mut data = Vec::with_capacity(ids.len() * cols);
        for &id in ids {
            let row = id as usize;
            if row >= rows {
                return Err(ModelError::InvalidInput(format!(
                    "token id {id} is out of range for {name} with {rows} rows"
                )));
            }
            let slice = &bytes[row * cols * elem..(row + 1) * cols * elem];
            data.extend(decode_f32(slice, e.dtype).ok_or_else(|| self.unsupported_dtype(name, e))?);
        }
        Ok(HostTensor::new(vec![ids.len(), cols], data))
    }

    fn unsupported_dtype(&self, name: &str, e: &Entry) -> ModelError {
        ModelError::UnsupportedDtype {
            path: self.shards[e.shard].path.clone(),
            tensor: name.to_owned(),
            dtype: format!("{:?}", e.dtype),
        }
    }

    /// Refuses tensor `name` if it holds a NaN or an infinity (naming the tensor, its shard and
    /// the first such element). Scans the stored bits without decoding, then releases the pages
    /// it read; dtypes other than BF16, F16, F32 and F64 pass.
    pub fn check_finite(&self, name: &str) -> Result<()> {
        let e = self.entry(name)?;
        let found = first_non_finite(self.raw_bytes(name)?, e.dtype);
        self.release(name);
        match found {
            None => Ok(()),
            Some(index) => Err(ModelError::NonFinite {
                path: self.shards[e.shard].path.clone(),
                tensor: name.to_owned(),
                index,
            }),
        }
    }

    /// Checks that every tensor in `specs` exists with the expected shape and a float dtype.
    pub fn check_specs(&self, specs: &[TensorSpec]) -> Result<()> {
        for spec in specs {
            let e = self.entry(&spec.name)?;
            if !matches!(e.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
                return Err(self.unsupported_dtype(&spec.name, e));
            }
            if e.shape != spec.shape {
                return Err(ModelError::ShapeMismatch {
                    path: self.shards[e.shard].path.clone(),
                    tensor: spec.name.clone(),
                    found: e.shape.clone(),
                    expected: spec.shape.clone(),
                });
            }
        }
        Ok(())
    }

    /// Checks every tensor the configuration requires (all layers and the global tensors).
    /// Reads only headers, so it is cheap even for the full model.
    pub fn check_config(&self, config: &SalaConfig) -> Result<()> {
        self.check_specs(&config.global_tensor_specs())?;
        for layer in 0..config.num_layers() {
            self.check_specs(&config.layer_tensor_specs(layer))?;
        }
        Ok(())
    }
}

/// The directory a model directory's files may resolve into: the directory itself
/// (canonical), or for a Hugging Face hub snapshot (`…/snapshots/<revision>`, whose files are
/// links to `../../blobs/`) the repository's cache directory above `snapshots`.
pub fn containment_root(dir: &Path) -> Result<PathBuf> {
    let canonical = std::fs::canonicalize(dir).map_err(|source| ModelError::Io {
        path: dir.to_owned(),
        source,
    })?;
    Ok(match canonical.parent() {
        Some(parent) if parent.file_name().is_some_and(|n| n == "snapshots") => {
            parent.parent().unwrap_or(parent).to_path_buf()
        }
        _ => canonical,
    })
}

/// Refuses `path` if it resolves (canonically, through every link) outside `root`.
fn check_contained(path: &Path, root: &Path) -> Result<()> {
    let resolved = std::fs::canonicalize(path).map_err(|source| ModelError::Io {
        path: path.to_owned(),
        source,
    })?;
    if resolved.starts_with(root) {
        Ok(())
    } else {
        Err(ModelError::OutsideModelDirectory {
            path: path.to_owned(),
            resolved,
            root: root.to_owned(),
        })
    }
}

/// Reads the shard index and returns `(file, Some(tensor))` pairs; every file name must be a
/// plain relative name so that a crafted index cannot make us map files elsewhere.
fn read_index(index_path: &Path) -> Result<Vec<(String, Option<String>)>> {
    let text = std::fs::read_to_string(index_path).map_err(|source| ModelError::Io {
        path: index_path.to_owned(),
        source,
    })?;
    let index: ShardIndex = serde_json::from_str(&text).map_err(|e| ModelError::Json {
        path: index_path.to_owned(),
        message: e.to_string(),
    })?;
    let mut pairs: Vec<(String, Option<String>)> = index
        .weight_map
        .into_iter()
        .map(|(tensor, file)| (file, Some(tensor)))
        .collect();
    pairs.sort();
    for (file, tensor) in &pairs {
        if !is_plain_relative(file) {
            return Err(ModelError::ShardOutsideDirectory {
                index: index_path.to_owned(),
                tensor: tensor.clone().unwrap_or_default(),
                shard: file.clone(),
            });
        }
    }
    Ok(pairs)
}

/// True for `a.safetensors` or `sub/a.safetensors`; false for absolute paths and any `..`.
fn is_plain_relative(file: &str) -> bool {
    let path = Path::new(file);
    !file.is_empty()
        && path
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
}

/// Index of the first NaN or infinity among the little-endian values of `dtype` in `bytes`
/// (an all-ones exponent); `None` if there is none or the dtype is not a float.
pub fn first_non_finite(bytes: &[u8], dtype: Dtype) -> Option<usize> {
    match dtype {
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7f80 == 0x7f80),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7c00 == 0x7c00),
        Dtype::F32 => bytes.chunks_exact(4).position(|b| {
            u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7f80_0000 == 0x7f80_0000
        }),
        Dtype::F64 => bytes.chunks_exact(8).position(|b| {
            let bits = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
            bits & 0x7ff0_0000_0000_0000 == 0x7ff0_0000_0000_0000
        }),
        _ => None,
    }
}

/// Little-endian BF16 / F16 / F32 bytes to f32; `None` for other dtypes.
pub(crate) fn decode_f32(bytes: &[u8], dtype: Dtype) -> Option<Vec<f32>> {
    let pairs = || {
        bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    match dtype {
        Dtype::BF16 => Some(pairs().map(|b| half::bf16::from_bits(b).to_f32()).collect()),
        Dtype::F16 => Some(pairs().map(|b| half::f16::from_bits(b).to_f32()).collect()),
        Dtype::F32 => Some(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_values_are_found_in_every_float_dtype() {
        let bf = |v: f32| half::bf16::from_f32(v).to_bits().to_le_bytes();
        let bytes: Vec<u8> = [1.0, -2.0, f32::NAN, 3.0]
            .iter()
            .flat_map(|&v| bf(v))
            .collect();
        assert_eq!(first_non_finite(&bytes, Dtype::BF16), Some(2));
        let h = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
        let bytes: Vec<u8> = [1.0, f32::INFINITY].iter().flat_map(|&v| h(v)).collect();
        assert_eq!(first_non_finite(&bytes, Dtype::F16), Some(1));
        let bytes: Vec<u8> = [f32::NEG_INFINITY, 0.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(first_non_finite(&bytes, Dtype::F32), Some(0));
        let bytes: Vec<u8> = [0.5f64, f64::NAN]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(first_non_finite(&bytes, Dtype::F64), Some(1));
        // The largest finite values are not flagged.
        let bytes: Vec<u8> = [f32::MAX, -f32::MAX]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(first_non_finite(&bytes, Dtype::F32), None);
        assert_eq!(first_non_finite(&[0xff; 4], Dtype::I32), None);
    }
}
