//! The hidden states of every calibration sample between two layers: on the device (as tensors
//! of the runner's storage dtype) when they fit the device budget, else in bf16 (the model's own
//! precision) in host memory, or in a memory-mapped scratch file when they would exceed the
//! host-memory budget.

use crate::error::PipelineError;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use half::bf16;
use memmap2::MmapMut;
use rayon::prelude::*;
use sala_model::FastOps;
use serde::Serialize;
use std::fmt;
use std::path::Path;

/// Values copied per parallel task between host storage and a sample's buffer.
const COPY_CHUNK: usize = 1 << 16;

/// Where [`HiddenStates`] keep their values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HiddenLocation {
    /// Device tensors: no transfer between layers.
    Device,
    /// bf16 in host memory.
    Host,
    /// bf16 in a memory-mapped scratch file.
    Disk,
}

impl fmt::Display for HiddenLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HiddenLocation::Device => "on the device",
            HiddenLocation::Host => "in host memory",
            HiddenLocation::Disk => "in a memory-mapped file",
        })
    }
}

/// The memory the hidden states may take, bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HiddenBudget {
    /// Device memory; `None`: never on the device.
    pub device: Option<u64>,
    /// Host memory; beyond it a scratch file. `None`: no limit.
    pub host: Option<u64>,
}

/// Storage for `[tokens_i, hidden]` matrices, one per sample.
pub struct HiddenStates<B: Backend> {
    hidden: usize,
    offsets: Vec<usize>,
    device: B::Device,
    /// Dtype of the tensors [`HiddenStates::load`] returns (and of device storage).
    dtype: DType,
    storage: Storage<B>,
}

enum Storage<B: Backend> {
    /// One tensor per sample (`None` until set: zeros).
    Device(Vec<Option<Tensor<B, 2>>>),
    Memory(Vec<bf16>),
    /// A scratch file (deleted when closed) mapped into memory; the kernel pages it out.
    Disk(MmapMut),
}

/// Gives `file` `bytes` of allocated disk blocks (not a sparse hole): a full file system fails
/// here with an error instead of killing the process with SIGBUS when a page of the map is
/// first written.
fn reserve_disk(file: &std::fs::File, bytes: u64) -> std::io::Result<()> {
    file.set_len(bytes)?;
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::io::AsRawFd;
        let len = libc::off_t::try_from(bytes)
            .map_err(|_| std::io::Error::other("larger than the file system allows"))?;
        // SAFETY: fallocate on a descriptor `file` owns; it returns an error number.
        match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
            0 => {}
            // The file system cannot reserve: keep the sparse file, as before.
            libc::EOPNOTSUPP | libc::EINVAL => {}
            errno => return Err(std::io::Error::from_raw_os_error(errno)),
        }
    }
    Ok(())
}

impl<B: Backend> HiddenStates<B> {
    /// Space for samples of `lengths[i]` tokens of width `hidden`, loaded as `dtype` tensors on
    /// `device`. On the device when `Σ lengths · hidden · size(dtype)` bytes fit
    /// `budget.device`; else in host memory as bf16, or on disk (in `scratch_dir`) when
    /// `2 · Σ lengths · hidden` bytes exceed `budget.host`.
    pub fn new(
        lengths: &[usize],
        hidden: usize,
        device: &B::Device,
        dtype: DType,
        budget: HiddenBudget,
        scratch_dir: &Path,
    ) -> Result<Self, PipelineError> {
        let too_many = || {
            PipelineError::TooLarge(format!(
            "the hidden states of {} samples of width {hidden} overflow this machine's address \
             space; lower --max-samples or --max-len",
            lengths.len()
        ))
        };
        let mut offsets = Vec::new();
        offsets
            .try_reserve_exact(lengths.len() + 1)
            .map_err(|_| too_many())?;
        let mut total = 0usize;
        offsets.push(0);
        for &n in lengths {
            total = n
                .checked_mul(hidden)
                .and_then(|v| total.checked_add(v))
                .ok_or_else(too_many)?;
            offsets.push(total);
        }
        let device_bytes = (total as u64).saturating_mul(dtype.size() as u64);
        let host_bytes = (total as u64).checked_mul(2).ok_or_else(too_many)?;
        let storage = if budget.device.is_some_and(|b| device_bytes <= b) {
            Storage::Device(vec![None; lengths.len()])
        } else if budget.host.is_some_and(|b| host_bytes > b) {
            let io = |e: std::io::Error| PipelineError::Io {
                path: scratch_dir.to_path_buf(),
                message: format!(
                    "hidden-state scratch file of {:.1} MB: {e}",
                    host_bytes as f64 / 1e6
                ),
            };
            let file = tempfile::tempfile_in(scratch_dir).map_err(io)?;
            reserve_disk(&file, host_bytes).map_err(io)?;
            // SAFETY: the file is private to this process (unnamed temporary) and outlives the map.
            Storage::Disk(unsafe { MmapMut::map_mut(&file) }.map_err(io)?)
        } else {
            let mut values = Vec::new();
            values.try_reserve_exact(total).map_err(|_| {
                PipelineError::TooLarge(format!(
                    "cannot allocate {:.1} MB of host memory for the hidden states; lower \
                     --max-samples or --max-len, or set --max-host-memory to keep them in a file",
                    host_bytes as f64 / 1e6
                ))
            })?;
            values.resize(total, bf16::ZERO);
            Storage::Memory(values)
        };
        Ok(Self {
            hidden,
            offsets,
            device: device.clone(),
            dtype,
            storage,
        })
    }

    /// Where the states live.
    pub fn location(&self) -> HiddenLocation {
        match self.storage {
            Storage::Device(_) => HiddenLocation::Device,
            Storage::Memory(_) => HiddenLocation::Host,
            Storage::Disk(_) => HiddenLocation::Disk,
        }
    }

    /// Whether the states live in a memory-mapped file.
    pub fn on_disk(&self) -> bool {
        self.location() == HiddenLocation::Disk
    }

    /// Bytes held (on the device: in the storage dtype; on the host: bf16).
    pub fn bytes(&self) -> u64 {
        let values = *self.offsets.last().unwrap_or(&0) as u64;
        match self.storage {
            Storage::Device(_) => values * self.dtype.size() as u64,
            _ => values * 2,
        }
    }

    /// Tokens of sample `i`.
    pub fn tokens(&self, i: usize) -> usize {
        (self.offsets[i + 1] - self.offsets[i]) / self.hidden
    }

    /// Stores sample `i`, a `[tokens_i, hidden]` tensor: kept as it is (cast to the storage
    /// dtype) on the device, else downloaded and rounded to bf16. A bf16 tensor's bytes are
    /// copied as they are (no f32 round trip: at 131,072 tokens that was a 2 GB f32 buffer and
    /// a serial conversion per sample and layer), straight into the host storage through
    /// `fast`'s [`FastOps::download_bf16`] where it answers.
    pub fn store(
        &mut self,
        i: usize,
        tensor: Tensor<B, 2>,
        fast: Option<&dyn FastOps<B>>,
    ) -> Result<(), PipelineError> {
        if let (Some(fast), Some(dst)) = (fast, self.host_bf16_mut(i)) {
            if fast.download_bf16(&tensor, dst)? {
                return Ok(());
            }
        }
        match &mut self.storage {
            Storage::Device(v) => v[i] = Some(tensor.cast(self.dtype)),
            _ => {
                let data = tensor.into_data();
                match data.as_slice::<bf16>() {
                    Ok(values) => self.set_bf16(i, values),
                    Err(_) => {
                        let values = data.convert::<f32>().into_vec::<f32>().unwrap_or_default();
                        self.set(i, &values);
                    }
                }
            }
        }
        Ok(())
    }

    /// Sample `i`'s bf16 values in host storage as bytes in native order, where they are kept
    /// so (`None` on the device, and for a file on a big-endian host: the file is
    /// little-endian).
    fn host_bytes(&self, i: usize) -> Option<&[u8]> {
        let range = self.offsets[i]..self.offsets[i + 1];
        match &self.storage {
            Storage::Device(_) => None,
            Storage::Memory(v) => Some(bytemuck::cast_slice(&v[range])),
            Storage::Disk(map) if cfg!(target_endian = "little") => {
                Some(&map[range.start * 2..range.end * 2])
            }
            Storage::Disk(_) => None,
        }
    }

    /// Sample `i`'s bf16 values in host storage, writable (`None` on the device, and for a
    /// file on a big-endian host or a map not aligned to 2 bytes).
    pub(crate) fn host_bf16_mut(&mut self, i: usize) -> Option<&mut [bf16]> {
        let range = self.offsets[i]..self.offsets[i + 1];
        match &mut self.storage {
            Storage::Device(_) => None,
            Storage::Memory(v) => Some(&mut v[range]),
            Storage::Disk(map) if cfg!(target_endian = "little") => {
                bytemuck::try_cast_slice_mut(&mut map[range.start * 2..range.end * 2]).ok()
            }
            Storage::Disk(_) => None,
        }
    }

    /// Stores sample `i` from host bf16 values (`[tokens_i, hidden]`), copied in parallel (one
    /// upload on the device).
    fn set_bf16(&mut self, i: usize, values: &[bf16]) {
        let range = self.offsets[i]..self.offsets[i + 1];
        debug_assert_eq!(values.len(), range.len());
        match &mut self.storage {
            Storage::Memory(v) => v[range]
                .par_chunks_mut(COPY_CHUNK)
                .zip(values.par_chunks(COPY_CHUNK))
                .for_each(|(d, s)| d.copy_from_slice(s)),
            Storage::Disk(map) => map[range.start * 2..range.end * 2]
                .par_chunks_mut(2 * COPY_CHUNK)
                .zip(values.par_chunks(COPY_CHUNK))
                .for_each(|(d, s)| {
                    for (d, s) in d.chunks_exact_mut(2).zip(s) {
                        d.copy_from_slice(&s.to_le_bytes());
                    }
                }),
            Storage::Device(v) => {
                let data =
                    TensorData::new(values.to_vec(), [range.len() / self.hidden, self.hidden]);
                v[i] = Some(Tensor::from_data(data, (&self.device, self.dtype)));
            }
        }
    }

    /// Sample `i`'s host bf16 values (`None` on the device).
    fn host_bf16(&self, i: usize) -> Option<Vec<bf16>> {
        let range = self.offsets[i]..self.offsets[i + 1];
        match &self.storage {
            Storage::Device(_) => None,
            Storage::Memory(v) => Some(v[range].to_vec()),
            Storage::Disk(map) => {
                let mut out = vec![bf16::ZERO; range.len()];
                out.par_chunks_mut(COPY_CHUNK)
                    .zip(map[range.start * 2..range.end * 2].par_chunks(2 * COPY_CHUNK))
                    .for_each(|(d, s)| {
                        for (d, s) in d.iter_mut().zip(s.chunks_exact(2)) {
                            *d = bf16::from_le_bytes([s[0], s[1]]);
                        }
                    });
                Some(out)
            }
        }
    }

    /// Sample `i` as a `[tokens_i, hidden]` tensor of the storage dtype on the device. bf16
    /// values in host storage go up as they are, through `fast`'s [`FastOps::upload_host`]
    /// where it answers (straight from the storage: no host copy), else through the backend's
    /// own upload.
    pub fn load(
        &self,
        i: usize,
        fast: Option<&dyn FastOps<B>>,
    ) -> Result<Tensor<B, 2>, PipelineError> {
        let shape = [self.tokens(i), self.hidden];
        if let (Some(fast), DType::BF16) = (fast, self.dtype) {
            if let Some(bytes) = self.host_bytes(i) {
                if let Some(flat) = fast.upload_host(bytes, DType::BF16, &self.device)? {
                    return Ok(flat.reshape(shape));
                }
            }
        }
        Ok(self.load_plain(i))
    }

    /// [`load`](Self::load) through the backend's own upload.
    fn load_plain(&self, i: usize) -> Tensor<B, 2> {
        let shape = [self.tokens(i), self.hidden];
        match &self.storage {
            Storage::Device(v) => v[i]
                .clone()
                .unwrap_or_else(|| Tensor::zeros(shape, (&self.device, self.dtype))),
            // bf16 storage uploads the host's bf16 values as they are (half the bytes of f32).
            _ if self.dtype == DType::BF16 => Tensor::from_data(
                TensorData::new(self.host_bf16(i).unwrap_or_default(), shape),
                (&self.device, self.dtype),
            ),
            _ => Tensor::from_data(
                TensorData::new(self.get(i), shape),
                (&self.device, self.dtype),
            ),
        }
    }

    /// Stores sample `i` from host values (`[tokens_i, hidden]` f32; rounded to bf16 on the
    /// host, cast to the storage dtype on the device).
    pub fn set(&mut self, i: usize, values: &[f32]) {
        let range = self.offsets[i]..self.offsets[i + 1];
        debug_assert_eq!(values.len(), range.len());
        match &mut self.storage {
            Storage::Device(v) => {
                let data =
                    TensorData::new(values.to_vec(), [range.len() / self.hidden, self.hidden]);
                v[i] = Some(Tensor::from_data(data, (&self.device, self.dtype)));
            }
            _ => {
                let rounded: Vec<bf16> = values.par_iter().map(|&x| bf16::from_f32(x)).collect();
                self.set_bf16(i, &rounded);
            }
        }
    }

    /// Sample `i` as host f32 `[tokens_i, hidden]` (downloaded from the device when it lives
    /// there).
    pub fn get(&self, i: usize) -> Vec<f32> {
        match self.host_bf16(i) {
            Some(values) => values.par_iter().map(|x| x.to_f32()).collect(),
            None => self
                .load_plain(i)
                .into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .unwrap_or_default(),
        }
    }
}

/// Magic of a hidden-state file ([`HiddenStates::save`]).
const SAVE_MAGIC: &[u8; 8] = b"SALAHID1";

impl<B: Backend> HiddenStates<B> {
    /// Bytes per value in a saved file: bf16 for host storage and bf16 device tensors (exact),
    /// f32 otherwise (exact for every storage dtype).
    fn saved_width(&self) -> usize {
        match self.storage {
            Storage::Device(_) if self.dtype != DType::BF16 => 4,
            _ => 2,
        }
    }

    /// Writes every sample's values to `path` (created or truncated) and syncs the file: a
    /// small header, then the values in sample order, little-endian, exactly as stored.
    pub(crate) fn save(&self, path: &Path) -> Result<(), PipelineError> {
        use std::io::Write;
        let io = |e: std::io::Error| PipelineError::Io {
            path: path.to_path_buf(),
            message: format!("writing the hidden states: {e}"),
        };
        let width = self.saved_width();
        let values = *self.offsets.last().unwrap_or(&0) as u64;
        let file = std::fs::File::create(path).map_err(io)?;
        let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
        out.write_all(SAVE_MAGIC).map_err(io)?;
        out.write_all(&(width as u64).to_le_bytes()).map_err(io)?;
        out.write_all(&values.to_le_bytes()).map_err(io)?;
        match &self.storage {
            Storage::Disk(map) => out.write_all(&map[..]).map_err(io)?,
            Storage::Memory(v) => {
                for chunk in v.chunks(1 << 16) {
                    let bytes: Vec<u8> = chunk.iter().flat_map(|x| x.to_le_bytes()).collect();
                    out.write_all(&bytes).map_err(io)?;
                }
            }
            Storage::Device(_) => {
                for i in 0..self.offsets.len() - 1 {
                    let v = self.get(i);
                    let bytes: Vec<u8> = if width == 2 {
                        v.iter()
                            .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                            .collect()
                    } else {
                        v.iter().flat_map(|x| x.to_le_bytes()).collect()
                    };
                    out.write_all(&bytes).map_err(io)?;
                }
            }
        }
        let file = out.into_inner().map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)
    }

    /// Reads back what [`save`](Self::save) wrote for states of the same shape.
    pub(crate) fn restore(&mut self, path: &Path) -> Result<(), PipelineError> {
        use std::io::Read;
        let bad = |message: String| PipelineError::Io {
            path: path.to_path_buf(),
            message,
        };
        let io = |e: std::io::Error| bad(format!("reading the hidden states: {e}"));
        let width = self.saved_width();
        let values = *self.offsets.last().unwrap_or(&0) as u64;
        let file = std::fs::File::open(path).map_err(io)?;
        let mut input = std::io::BufReader::with_capacity(1 << 20, file);
        let mut header = [0u8; 24];
        input.read_exact(&mut header).map_err(io)?;
        let word = |i: usize| u64::from_le_bytes(header[i..i + 8].try_into().unwrap_or([0; 8]));
        if &header[..8] != SAVE_MAGIC || word(8) != width as u64 || word(16) != values {
            return Err(bad(format!(
                "not the hidden states of this run ({values} values of {width} bytes expected)"
            )));
        }
        let mut buf = Vec::new();
        for i in 0..self.offsets.len() - 1 {
            let n = self.offsets[i + 1] - self.offsets[i];
            buf.resize(n * width, 0);
            input.read_exact(&mut buf).map_err(io)?;
            let v: Vec<f32> = if width == 2 {
                buf.chunks_exact(2)
                    .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect()
            } else {
                buf.chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect()
            };
            self.set(i, &v);
        }
        if input.read(&mut [0u8; 1]).map_err(io)? != 0 {
            return Err(bad("longer than the hidden states of this run".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

    fn states(lengths: &[usize], budget: HiddenBudget, dir: &Path) -> HiddenStates<CpuBackend> {
        HiddenStates::new(lengths, 4, &Default::default(), DType::F32, budget, dir).unwrap()
    }

    #[test]
    fn hidden_states_too_large_for_the_machine_are_an_error() {
        let dir = tempfile::tempdir().unwrap();
        for lengths in [&[usize::MAX / 2, 10][..], &[1 << 59]] {
            let result = HiddenStates::<CpuBackend>::new(
                lengths,
                4,
                &Default::default(),
                DType::F32,
                HiddenBudget::default(),
                dir.path(),
            );
            let err = result.err().expect("refused").to_string();
            assert!(err.contains("--max-samples"), "{err}");
        }
    }

    #[test]
    fn memory_and_disk_storage_hold_the_same_bf16_values() {
        let dir = tempfile::tempdir().unwrap();
        let lengths = [3, 1, 2];
        let mut mem = states(&lengths, HiddenBudget::default(), dir.path());
        let disk_budget = HiddenBudget {
            device: None,
            host: Some(8),
        };
        let mut disk = states(&lengths, disk_budget, dir.path());
        assert_eq!(mem.location(), HiddenLocation::Host);
        assert_eq!(disk.location(), HiddenLocation::Disk);
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

    /// bf16 values (a bf16 tensor's download) go to host memory and to disk as they are and
    /// come back unchanged, in samples larger than one copy task. (burn-ndarray has no bf16
    /// tensors; the GPU path stores and loads through these two functions.)
    #[test]
    fn bf16_values_round_trip_through_host_storage() {
        let dir = tempfile::tempdir().unwrap();
        let (width, lengths) = (8, [COPY_CHUNK / 8 + 3, 5]);
        for host in [None, Some(8)] {
            let budget = HiddenBudget { device: None, host };
            let mut states = HiddenStates::<CpuBackend>::new(
                &lengths,
                width,
                &Default::default(),
                DType::F32,
                budget,
                dir.path(),
            )
            .unwrap();
            for (i, &n) in lengths.iter().enumerate() {
                let values: Vec<bf16> = (0..n * width)
                    .map(|k| bf16::from_f32(((k * 7 + i) % 1000) as f32 / 8.0 - 60.0))
                    .collect();
                states.set_bf16(i, &values);
                assert!(
                    states.host_bf16(i).unwrap() == values,
                    "sample {i}, {host:?}"
                );
                let as_f32: Vec<f32> = values.iter().map(|x| x.to_f32()).collect();
                assert_eq!(states.get(i), as_f32);
            }
        }
    }

    #[test]
    fn saved_states_come_back_exactly_in_every_storage() {
        let dir = tempfile::tempdir().unwrap();
        let lengths = [3, 1, 2];
        let budgets = [
            HiddenBudget::default(),
            HiddenBudget {
                device: None,
                host: Some(8),
            },
            HiddenBudget {
                device: Some(1 << 20),
                host: None,
            },
        ];
        for (b, budget) in budgets.into_iter().enumerate() {
            let mut a = states(&lengths, budget, dir.path());
            for (i, &n) in lengths.iter().enumerate() {
                let values: Vec<f32> = (0..n * 4)
                    .map(|k| (k as f32 - 2.7) / (i as f32 + 0.3))
                    .collect();
                a.set(i, &values);
            }
            let path = dir.path().join(format!("h{b}"));
            a.save(&path).unwrap();
            let mut back = states(&lengths, budget, dir.path());
            back.restore(&path).unwrap();
            for i in 0..lengths.len() {
                assert_eq!(a.get(i), back.get(i), "{:?}", a.location());
            }
            // Another shape is refused, naming the file.
            let mut other = states(&[3, 1, 3], budget, dir.path());
            let err = other.restore(&path).unwrap_err().to_string();
            assert!(err.contains(&format!("h{b}")), "{err}");
        }
    }

    #[test]
    fn device_storage_keeps_tensors_when_they_fit_the_budget() {
        let dir = tempfile::tempdir().unwrap();
        let lengths = [3, 2];
        // 5 tokens × 4 × 4 bytes = 80 bytes: fits 80, not 79.
        let fits = HiddenBudget {
            device: Some(80),
            host: None,
        };
        let too_small = HiddenBudget {
            device: Some(79),
            host: None,
        };
        assert_eq!(
            states(&lengths, too_small, dir.path()).location(),
            HiddenLocation::Host
        );
        let mut device = states(&lengths, fits, dir.path());
        assert_eq!(device.location(), HiddenLocation::Device);
        assert_eq!(device.bytes(), 80);
        // Unset samples load as zeros; set ones come back exactly (no bf16 rounding: f32 storage).
        assert_eq!(device.get(1), vec![0.0; 8]);
        let values: Vec<f32> = (0..12).map(|k| k as f32 / 3.0).collect();
        device.set(0, &values);
        assert_eq!(device.get(0), values);
        let doubled = device.load(0, None).unwrap().mul_scalar(2.0);
        device.store(1, doubled.slice([0..2, 0..4]), None).unwrap();
        let expected: Vec<f32> = values[..8].iter().map(|v| v * 2.0).collect();
        assert_eq!(device.get(1), expected);
    }

    /// Fast ops that answer the hidden states' transfers on the host, as `CudaFastOps` does
    /// through the driver: an upload decodes the bf16 bytes (an f32 tensor stands for the
    /// device's bf16 one: burn-ndarray has no bf16), a download rounds to bf16. They count the
    /// bytes handed over, and refuse every transfer when `fail`.
    #[derive(Debug, Default)]
    struct HostTransfers {
        up: AtomicUsize,
        down: AtomicUsize,
        fail: bool,
    }

    impl FastOps<CpuBackend> for HostTransfers {
        fn causal_attention(
            &self,
            _: Tensor<CpuBackend, 3>,
            _: Tensor<CpuBackend, 3>,
            _: Tensor<CpuBackend, 3>,
            _: &[usize],
            _: f32,
        ) -> sala_model::Result<Tensor<CpuBackend, 3>> {
            Err(sala_model::ModelError::InvalidInput("not a forward".into()))
        }

        fn upload_host(
            &self,
            bytes: &[u8],
            dtype: DType,
            device: &burn_ndarray::NdArrayDevice,
        ) -> sala_model::Result<Option<Tensor<CpuBackend, 1>>> {
            self.up.fetch_add(bytes.len(), Relaxed);
            if self.fail {
                return Err(sala_model::ModelError::InvalidInput(
                    "upload refused".into(),
                ));
            }
            assert_eq!(dtype, DType::BF16);
            let values: Vec<f32> = bytes
                .chunks_exact(2)
                .map(|b| bf16::from_ne_bytes([b[0], b[1]]).to_f32())
                .collect();
            let n = values.len();
            Ok(Some(Tensor::from_data(
                TensorData::new(values, [n]),
                device,
            )))
        }

        fn download_bf16(
            &self,
            x: &Tensor<CpuBackend, 2>,
            dst: &mut [bf16],
        ) -> sala_model::Result<bool> {
            self.down.fetch_add(2 * dst.len(), Relaxed);
            if self.fail {
                return Err(sala_model::ModelError::InvalidInput(
                    "download refused".into(),
                ));
            }
            let values = x.to_data().convert::<f32>().into_vec::<f32>().unwrap();
            assert_eq!(values.len(), dst.len());
            for (d, v) in dst.iter_mut().zip(values) {
                *d = bf16::from_f32(v);
            }
            Ok(true)
        }
    }

    /// With fast ops that answer them, host-kept states go down and up through the fast ops,
    /// every byte of a sample once and straight from and into the storage (in memory and in a
    /// file, samples larger than one copy task), and hold the same bf16 values as the backend's
    /// own path; a refused transfer is an error, not a panic.
    #[test]
    fn host_states_travel_through_the_fast_ops_when_they_answer() {
        let dir = tempfile::tempdir().unwrap();
        let (width, lengths) = (8, [COPY_CHUNK / 8 + 3, 5]);
        let device = Default::default();
        for host in [None, Some(8)] {
            let budget = HiddenBudget { device: None, host };
            let new = |dtype| {
                HiddenStates::<CpuBackend>::new(&lengths, width, &device, dtype, budget, dir.path())
                    .unwrap()
            };
            let (mut fast_states, mut plain) = (new(DType::BF16), new(DType::F32));
            let ops = HostTransfers::default();
            for (i, &n) in lengths.iter().enumerate() {
                let values: Vec<f32> = (0..n * width)
                    .map(|k| ((k * 13 + i) % 997) as f32 / 7.0 - 70.0)
                    .collect();
                let tensor = || {
                    Tensor::<CpuBackend, 2>::from_data(
                        TensorData::new(values.clone(), [n, width]),
                        &device,
                    )
                };
                let before = ops.down.load(Relaxed);
                fast_states.store(i, tensor(), Some(&ops)).unwrap();
                assert_eq!(ops.down.load(Relaxed) - before, 2 * n * width);
                plain.store(i, tensor(), None).unwrap();
                assert!(
                    fast_states.host_bf16(i) == plain.host_bf16(i),
                    "{host:?} {i}"
                );

                let before = ops.up.load(Relaxed);
                let loaded = fast_states.load(i, Some(&ops)).unwrap();
                assert_eq!(ops.up.load(Relaxed) - before, 2 * n * width);
                assert_eq!(loaded.dims(), [n, width]);
                let loaded = loaded
                    .into_data()
                    .convert::<f32>()
                    .into_vec::<f32>()
                    .unwrap();
                assert_eq!(loaded, plain.get(i), "{host:?} {i}");
            }
            let refusing = HostTransfers {
                fail: true,
                ..Default::default()
            };
            let err = fast_states
                .load(0, Some(&refusing))
                .unwrap_err()
                .to_string();
            assert!(err.contains("upload refused"), "{err}");
            let tensor = Tensor::<CpuBackend, 2>::zeros([5, width], &device);
            let err = fast_states
                .store(1, tensor, Some(&refusing))
                .unwrap_err()
                .to_string();
            assert!(err.contains("download refused"), "{err}");
        }
    }
}
