//! The hidden states of every calibration sample between two layers, kept in bf16 (the model's
//! own precision): in host memory, or in a memory-mapped scratch file when they would exceed the
//! host-memory budget.

use crate::error::PipelineError;
use half::bf16;
use memmap2::MmapMut;
use std::path::Path;

/// Storage for `[tokens_i, hidden]` bf16 matrices, one per sample.
pub struct HiddenStates {
    hidden: usize,
    offsets: Vec<usize>,
    storage: Storage,
}

enum Storage {
    Memory(Vec<bf16>),
    /// A scratch file (deleted when closed) mapped into memory; the kernel pages it out.
    Disk(MmapMut),
}

impl HiddenStates {
    /// Space for samples of `lengths[i]` tokens of width `hidden`; on disk (in `scratch_dir`) when
    /// `2 · Σ lengths · hidden` bytes exceed `budget`.
    pub fn new(
        lengths: &[usize],
        hidden: usize,
        budget: Option<u64>,
        scratch_dir: &Path,
    ) -> Result<Self, PipelineError> {
        let mut offsets = Vec::with_capacity(lengths.len() + 1);
        let mut total = 0usize;
        offsets.push(0);
        for &n in lengths {
            total += n * hidden;
            offsets.push(total);
        }
        let bytes = total as u64 * 2;
        let storage = if budget.is_some_and(|b| bytes > b) {
            let io = |e: std::io::Error| PipelineError::Io {
                path: scratch_dir.to_path_buf(),
                message: format!("hidden-state scratch file: {e}"),
            };
            let file = tempfile::tempfile_in(scratch_dir).map_err(io)?;
            file.set_len(bytes).map_err(io)?;
            // SAFETY: the file is private to this process (unnamed temporary) and outlives the map.
            Storage::Disk(unsafe { MmapMut::map_mut(&file) }.map_err(io)?)
        } else {
            Storage::Memory(vec![bf16::ZERO; total])
        };
        Ok(Self {
            hidden,
            offsets,
            storage,
        })
    }

    /// Whether the states live in a memory-mapped file.
    pub fn on_disk(&self) -> bool {
        matches!(self.storage, Storage::Disk(_))
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        *self.offsets.last().unwrap_or(&0) as u64 * 2
    }

    /// Tokens of sample `i`.
    pub fn tokens(&self, i: usize) -> usize {
        (self.offsets[i + 1] - self.offsets[i]) / self.hidden
    }

    /// Stores sample `i` (`[tokens_i, hidden]` f32, rounded to bf16).
    pub fn set(&mut self, i: usize, values: &[f32]) {
        let range = self.offsets[i]..self.offsets[i + 1];
        debug_assert_eq!(values.len(), range.len());
        match &mut self.storage {
            Storage::Memory(v) => {
                for (d, &s) in v[range].iter_mut().zip(values) {
                    *d = bf16::from_f32(s);
                }
            }
            Storage::Disk(map) => {
                let bytes = &mut map[range.start * 2..range.end * 2];
                for (d, &s) in bytes.chunks_exact_mut(2).zip(values) {
                    d.copy_from_slice(&bf16::from_f32(s).to_le_bytes());
                }
            }
        }
    }

    /// Sample `i` as f32 `[tokens_i, hidden]`.
    pub fn get(&self, i: usize) -> Vec<f32> {
        let range = self.offsets[i]..self.offsets[i + 1];
        match &self.storage {
            Storage::Memory(v) => v[range].iter().map(|x| x.to_f32()).collect(),
            Storage::Disk(map) => map[range.start * 2..range.end * 2]
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_and_disk_storage_hold_the_same_bf16_values() {
        let dir = tempfile::tempdir().unwrap();
        let lengths = [3, 1, 2];
        let mut mem = HiddenStates::new(&lengths, 4, None, dir.path()).unwrap();
        let mut disk = HiddenStates::new(&lengths, 4, Some(8), dir.path()).unwrap();
        assert!(!mem.on_disk() && disk.on_disk());
        for (i, &n) in lengths.iter().enumerate() {
            let values: Vec<f32> = (0..n * 4)
                .map(|k| (k as f32 + 0.3) * (i as f32 + 1.7))
                .collect();
            mem.set(i, &values);
            disk.set(i, &values);
        }
        for (i, &n) in lengths.iter().enumerate() {
            assert_eq!(mem.get(i), disk.get(i));
            assert_eq!(mem.tokens(i), n);
            let expected: Vec<f32> = (0..n * 4)
                .map(|k| bf16::from_f32((k as f32 + 0.3) * (i as f32 + 1.7)).to_f32())
                .collect();
            assert_eq!(mem.get(i), expected);
        }
    }
}
