//! Host ↔ device copies straight through the driver (`cuMemcpyHtoD` / `cuMemcpyDtoH` with
//! pageable memory): CubeCL 0.10's copies stage every buffer through its pinned-memory pool,
//! which measured 0.45 GB/s for a 268 MB f32 weight going up on an H200 (0.6 s per upload;
//! `probe` in docs/results.md) and about 0.9 GB/s for 268 MB of GPTQ codes coming back. The
//! driver's own staging is what every CUDA program gets by default.

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Handle;

use super::{driver_error, handle_ptr, sync_client, LibStream};
use crate::device::{DeviceVec, MatrixView};
use crate::error::KernelError;
use crate::solver::Transfer;

/// Copies between host and device through the driver, on the device's primary context
/// (CubeCL's).
#[derive(Debug)]
pub struct DriverTransfer {
    lib: LibStream,
}

impl DriverTransfer {
    /// Copies for device `ordinal`.
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        Ok(Self {
            lib: LibStream::new(ordinal)?,
        })
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
