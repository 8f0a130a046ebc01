//! Host ↔ device copies straight through the driver: CubeCL 0.10's copies stage every buffer
//! through its pinned-memory pool, which measured 0.45 GB/s for a 268 MB f32 weight going up
//! on an H200 (0.6 s per upload; `probe` in docs/results.md) and about 0.9 GB/s for 268 MB of
//! GPTQ codes coming back.
//!
//! The copies go through two page-locked staging buffers of [`STAGING_BYTES`] that alternate:
//! while the DMA engine moves one chunk, the host threads fill (or empty) the other. On the
//! H200 (`bench/h2d.py`'s figures in docs/results.md) the driver's pageable copies moved 5.8
//! GB/s up and 11 GB/s down, page-locked ones 54 GB/s both ways. Where page-locked memory
//! cannot be had, the copies fall back to the driver's pageable ones.

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Handle;

use std::sync::{Mutex, MutexGuard};

use cudarc::driver::{CudaEvent, PinnedHostSlice};
use rayon::prelude::*;

use super::{driver_error, handle_ptr, sync_client, LibStream};
use crate::device::{DeviceVec, MatrixView};
use crate::error::KernelError;
use crate::solver::Transfer;

/// Copies between host and device through the driver, on the device's primary context
/// (CubeCL's).
#[derive(Debug)]
pub struct DriverTransfer {
    lib: LibStream,
    /// The staging buffers, allocated at the first copy; `Err` once page-locked memory was
    /// refused (the copies are then pageable).
    staging: Mutex<Option<Result<Staging, String>>>,
}

/// Bytes per staging buffer (two of them: 128 MiB of page-locked host memory in all).
pub const STAGING_BYTES: usize = 64 << 20;

/// Two page-locked buffers and, for each, an event recorded after the last copy that used it.
#[derive(Debug)]
struct Staging {
    buffers: [PinnedHostSlice<u8>; 2],
    done: [CudaEvent; 2],
}

impl DriverTransfer {
    /// Copies for device `ordinal`.
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        Ok(Self {
            lib: LibStream::new(ordinal)?,
            staging: Mutex::new(None),
        })
    }

    /// The staging buffers (allocated on first use), or `None` where page-locked memory is
    /// refused.
    fn staging(&self) -> Result<MutexGuard<'_, Option<Result<Staging, String>>>, KernelError> {
        let mut guard = self.staging.lock().map_err(|_| KernelError::Launch {
            what: "staging buffers",
            message: "a copy panicked while holding them".into(),
        })?;
        if guard.is_none() {
            *guard = Some(self.allocate_staging());
        }
        Ok(guard)
    }

    fn allocate_staging(&self) -> Result<Staging, String> {
        let ctx = self.lib.context();
        let buffer = || {
            // SAFETY: the bytes are written by a copy before they are read. Plain page-locked
            // memory (flags 0): write-combined memory would be slow for the host to read.
            unsafe { ctx.alloc_pinned_with_flags::<u8>(STAGING_BYTES, 0) }
        };
        let event = || ctx.new_event(None);
        let allocate = || -> Result<Staging, cudarc::driver::DriverError> {
            Ok(Staging {
                buffers: [buffer()?, buffer()?],
                done: [event()?, event()?],
            })
        };
        allocate().map_err(|e| format!("{e:?}"))
    }

    /// Copies `bytes` to the device address `ptr` through the staging buffers: chunk `k`
    /// waits for the copy out of its buffer two chunks before, is written into it by the host
    /// threads, and its copy is queued on the stream.
    fn staged_upload(
        &self,
        staging: &mut Staging,
        ptr: u64,
        bytes: &[u8],
    ) -> Result<(), KernelError> {
        let stream = self.lib.stream();
        for (k, chunk) in bytes.chunks(STAGING_BYTES).enumerate() {
            let b = k % 2;
            staging.done[b]
                .synchronize()
                .map_err(|e| driver_error("staging wait", e))?;
            // SAFETY: no copy uses buffer `b` any more (its event has completed); the slice
            // lies inside its STAGING_BYTES.
            let host = unsafe { staged_slice(&mut staging.buffers[b], chunk.len()) };
            parallel_copy(host, chunk);
            // SAFETY: the destination holds `bytes.len()` bytes from `ptr` (the caller's
            // buffer); the page-locked source stays untouched until `done[b]` completes.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    ptr + (k * STAGING_BYTES) as u64,
                    &*host,
                    stream.cu_stream(),
                )
            }
            .map_err(|e| driver_error("cuMemcpyHtoDAsync", e))?;
            staging.done[b]
                .record(stream)
                .map_err(|e| driver_error("staging record", e))?;
        }
        self.lib.synchronize("cuMemcpyHtoDAsync")
    }

    /// Copies the `dst.len()` bytes at the device address `ptr` into `dst` through the
    /// staging buffers: the copy of chunk `k + 1` is queued before the host threads empty
    /// chunk `k`.
    fn staged_download(
        &self,
        staging: &mut Staging,
        ptr: u64,
        dst: &mut [u8],
    ) -> Result<(), KernelError> {
        let stream = self.lib.stream();
        let total = dst.len();
        let chunks = total.div_ceil(STAGING_BYTES);
        let len_of = |k: usize| (total - k * STAGING_BYTES).min(STAGING_BYTES);
        let queue = |staging: &mut Staging, k: usize| -> Result<(), KernelError> {
            let b = k % 2;
            // SAFETY: buffer `b`'s previous chunk was emptied before this is queued; the slice
            // lies inside its STAGING_BYTES.
            let host = unsafe { staged_slice(&mut staging.buffers[b], len_of(k)) };
            // SAFETY: the source holds the chunk's bytes (the caller checked the buffer's
            // size); the page-locked destination is read only after `done[b]` completes.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    host,
                    ptr + (k * STAGING_BYTES) as u64,
                    stream.cu_stream(),
                )
            }
            .map_err(|e| driver_error("cuMemcpyDtoHAsync", e))?;
            staging.done[b]
                .record(stream)
                .map_err(|e| driver_error("staging record", e))
        };
        queue(staging, 0)?;
        for (k, out) in dst.chunks_mut(STAGING_BYTES).enumerate() {
            if k + 1 < chunks {
                queue(staging, k + 1)?;
            }
            let b = k % 2;
            staging.done[b]
                .synchronize()
                .map_err(|e| driver_error("staging wait", e))?;
            // SAFETY: the copy into buffer `b` has completed.
            let host = unsafe { staged_slice(&mut staging.buffers[b], out.len()) };
            parallel_copy(out, host);
        }
        Ok(())
    }

    /// A new device buffer holding `bytes` (at least 4 bytes long, as CubeCL's buffers).
    pub fn upload_bytes(
        &self,
        client: &ComputeClient<CudaRuntime>,
        bytes: &[u8],
    ) -> Result<Handle, KernelError> {
        let handle = client.empty(bytes.len().max(4));
        if bytes.is_empty() {
            return Ok(handle);
        }
        let ptr = handle_ptr(client, &handle)?;
        // The buffer may be memory CubeCL's queued kernels still use: wait for them first. The
        // copy is synchronous, so whatever CubeCL queues next sees the data.
        sync_client(client)?;
        self.lib.bind()?;
        if let Some(Ok(staging)) = self.staging()?.as_mut() {
            self.staged_upload(staging, ptr, bytes)?;
            return Ok(handle);
        }
        // SAFETY: `ptr` addresses `bytes.len()` (or more) bytes of a live device buffer that
        // `handle` keeps alive; the source slice outlives the synchronous copy.
        unsafe { cudarc::driver::result::memcpy_htod_sync(ptr, bytes) }
            .map_err(|e| driver_error("cuMemcpyHtoD", e))?;
        Ok(handle)
    }

    /// Copies the first `dst.len()` elements of the device buffer `handle` into `dst`, after
    /// the work queued on `client` (which may write the buffer) is done.
    pub fn download_into<T: bytemuck::Pod>(
        &self,
        client: &ComputeClient<CudaRuntime>,
        handle: &Handle,
        dst: &mut [T],
    ) -> Result<(), KernelError> {
        if dst.is_empty() {
            return Ok(());
        }
        let bytes = std::mem::size_of_val(dst) as u64;
        if handle.size_in_used() < bytes {
            return Err(KernelError::shape(
                "download",
                format!(
                    "{bytes} bytes asked of a {}-byte buffer",
                    handle.size_in_used()
                ),
            ));
        }
        let ptr = handle_ptr(client, handle)?;
        sync_client(client)?;
        self.lib.bind()?;
        if let Some(Ok(staging)) = self.staging()?.as_mut() {
            return self.staged_download(staging, ptr, bytemuck::cast_slice_mut(dst));
        }
        // SAFETY: `ptr` addresses at least `bytes` bytes of a live device buffer (checked
        // above) that `handle` keeps alive; the copy is synchronous.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(dst, ptr) }
            .map_err(|e| driver_error("cuMemcpyDtoH", e))
    }
}

impl Transfer<CudaRuntime> for DriverTransfer {
    fn upload(
        &self,
        client: &ComputeClient<CudaRuntime>,
        data: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<MatrixView, KernelError> {
        if data.len() != rows * cols {
            return Err(KernelError::shape(
                "upload",
                format!("{} values for a {rows}×{cols} matrix", data.len()),
            ));
        }
        let handle = self.upload_bytes(client, bytemuck::cast_slice(data))?;
        Ok(MatrixView {
            handle,
            offset: 0,
            rows,
            cols,
            row_stride: cols,
        })
    }

    fn download_u32(
        &self,
        client: &ComputeClient<CudaRuntime>,
        v: &DeviceVec<u32>,
    ) -> Result<Vec<u32>, KernelError> {
        let mut host = vec![0u32; v.len];
        self.download_into(client, &v.handle, &mut host)?;
        Ok(host)
    }

    fn download_f32(
        &self,
        client: &ComputeClient<CudaRuntime>,
        v: &DeviceVec<f32>,
    ) -> Result<Vec<f32>, KernelError> {
        let mut host = vec![0f32; v.len];
        self.download_into(client, &v.handle, &mut host)?;
        Ok(host)
    }
}

/// The first `len` bytes of a staging buffer.
///
/// # Safety
/// No copy may be using the buffer, and `len` may not exceed its length.
unsafe fn staged_slice(buffer: &mut PinnedHostSlice<u8>, len: usize) -> &mut [u8] {
    debug_assert!(len <= buffer.len());
    // The buffer's own event is never recorded (the copies record `Staging::done`), so its
    // wait returns at once; the caller has waited for the buffer's copies.
    let ptr = buffer
        .as_mut_ptr()
        .expect("an unrecorded event cannot fail");
    std::slice::from_raw_parts_mut(ptr, len)
}

/// Bytes per task of [`parallel_copy`].
const COPY_TASK_BYTES: usize = 4 << 20;

/// `dst.copy_from_slice(src)` by the host threads, in pieces of [`COPY_TASK_BYTES`]: one
/// thread's `memcpy` does not keep up with the DMA engine.
fn parallel_copy(dst: &mut [u8], src: &[u8]) {
    dst.par_chunks_mut(COPY_TASK_BYTES)
        .zip(src.par_chunks(COPY_TASK_BYTES))
        .for_each(|(d, s)| d.copy_from_slice(s));
}
