//! Device memory: dense row-major f32 matrix windows ([`MatrixView`]) and flat device vectors
//! ([`DeviceVec`]), with checked uploads, downloads and sub-windows.
//!
//! Kernels always bind the *whole* buffer and receive the window's offset and row stride as
//! scalars: wgpu binds buffers only at offsets aligned to 256 bytes, so a window such as
//! `U[c0.., c1..]` could not be bound on its own.

use std::marker::PhantomData;

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::error::KernelError;
use crate::launch::elementwise;

/// A window of a dense row-major f32 matrix in device memory.
#[derive(Clone, Debug)]
pub struct MatrixView {
    /// The whole buffer.
    pub handle: Handle,
    /// Elements from the start of the buffer to element `(0, 0)`.
    pub offset: usize,
    /// Rows of the window.
    pub rows: usize,
    /// Columns of the window.
    pub cols: usize,
    /// Elements between `(i, 0)` and `(i + 1, 0)`; `>= cols`.
    pub row_stride: usize,
}

/// Elements of 4 bytes the kernels read and write (`f32` values, `u32` codes).
///
/// Transfers reinterpret host slices as bytes (`bytemuck`): device buffers are little-endian on
/// every backend CubeCL supports, and so is every host this crate builds for (checked below).
pub trait Element: bytemuck::Pod + Default + Send + Sync {}

impl Element for f32 {}

impl Element for u32 {}

#[cfg(target_endian = "big")]
compile_error!("sala-kernels copies host memory to little-endian device buffers as it is");

/// Bytes of one [`Element`].
const ELEM_BYTES: usize = 4;

/// Uploads `data` (one host copy, no per-element work); an empty slice gets a one-element
/// buffer (zero-sized bindings are invalid on wgpu).
pub(crate) fn upload_slice<R: Runtime, T: Element>(
    client: &ComputeClient<R>,
    data: &[T],
) -> Handle {
    if data.is_empty() {
        return client.create_from_slice(&[0u8; ELEM_BYTES]);
    }
    client.create_from_slice(bytemuck::cast_slice(data))
}

/// A new buffer of `len` zero elements (at least one), filled on the device: nothing crosses
/// the bus, which matters for outputs the size of a weight matrix.
pub(crate) fn zeroed<R: Runtime>(
    client: &ComputeClient<R>,
    len: usize,
) -> Result<Handle, KernelError> {
    let len = len.max(1);
    let handle = client.empty(len * ELEM_BYTES);
    let (count, dim) = elementwise(client, len)?;
    fill_zero_kernel::launch::<R>(client, count, dim, array_arg(&handle), len);
    Ok(handle)
}

/// `out[i] = 0` for `i < len` (the bit pattern of `0u32` and `0.0f32` alike).
#[cube(launch)]
fn fill_zero_kernel(out: &mut Array<u32>, len: usize) {
    if ABSOLUTE_POS < len {
        out[ABSOLUTE_POS] = 0u32;
    }
}

/// Reads elements `[start, start + len)` of `handle` back to the host.
pub(crate) fn read_range<R: Runtime, T: Element>(
    client: &ComputeClient<R>,
    handle: &Handle,
    start: usize,
    len: usize,
    what: &'static str,
) -> Result<Vec<T>, KernelError> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let total = buffer_len(handle);
    if start + len > total {
        return Err(KernelError::shape(
            what,
            format!(
                "reading elements {start}..{} of a buffer of {total}",
                start + len
            ),
        ));
    }
    let trimmed = handle
        .clone()
        .offset_start((start * ELEM_BYTES) as u64)
        .offset_end(((total - start - len) * ELEM_BYTES) as u64);
    let bytes = client.read_one(trimmed).map_err(|e| KernelError::Read {
        what,
        message: format!("{e:?}"),
    })?;
    if bytes.len() < len * ELEM_BYTES {
        return Err(KernelError::Read {
            what,
            message: format!("got {} bytes, expected {}", bytes.len(), len * ELEM_BYTES),
        });
    }
    // `pod_collect_to_vec` copies, so the host bytes need not be aligned for `T`.
    Ok(bytemuck::pod_collect_to_vec(&bytes[..len * ELEM_BYTES]))
}

/// Elements of 4 bytes in the handle (after its own offsets, if any).
pub(crate) fn buffer_len(handle: &Handle) -> usize {
    handle.size_in_used() as usize / ELEM_BYTES
}

/// The whole buffer as a kernel array argument.
pub(crate) fn array_arg<R: Runtime>(handle: &Handle) -> ArrayArg<R> {
    // SAFETY: the length is the buffer's own length in 4-byte elements, so every in-bounds
    // index of the kernel is inside the allocation (kernels are launched checked as well).
    unsafe { ArrayArg::from_raw_parts(handle.clone(), buffer_len(handle)) }
}

impl MatrixView {
    /// Uploads a row-major `[rows, cols]` matrix into a new buffer (offset 0, stride `cols`).
    pub fn upload<R: Runtime>(
        client: &ComputeClient<R>,
        data: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<Self, KernelError> {
        if data.len() != rows * cols {
            return Err(KernelError::shape(
                "upload",
                format!("{} values for a {rows}×{cols} matrix", data.len()),
            ));
        }
        Ok(Self::dense(upload_slice(client, data), rows, cols))
    }

    /// A new zero-filled `[rows, cols]` matrix (filled on the device).
    pub fn zeros<R: Runtime>(
        client: &ComputeClient<R>,
        rows: usize,
        cols: usize,
    ) -> Result<Self, KernelError> {
        Ok(Self::dense(zeroed(client, rows * cols)?, rows, cols))
    }

    /// A dense view of a whole buffer.
    pub(crate) fn dense(handle: Handle, rows: usize, cols: usize) -> Self {
        Self {
            handle,
            offset: 0,
            rows,
            cols,
            row_stride: cols,
        }
    }

    /// Elements of the window, `rows · cols`.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// Whether the window has no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements from `(0, 0)` to one past `(rows−1, cols−1)` (0 for an empty window).
    pub fn span(&self) -> usize {
        if self.is_empty() {
            0
        } else {
            (self.rows - 1) * self.row_stride + self.cols
        }
    }

    /// Whether the rows follow each other without gaps (`row_stride == cols`).
    pub fn is_contiguous(&self) -> bool {
        self.row_stride == self.cols || self.rows <= 1
    }

    /// Checks that the window is well formed and lies inside its buffer.
    pub fn check(&self, what: &'static str) -> Result<(), KernelError> {
        if self.row_stride < self.cols {
            return Err(KernelError::shape(
                what,
                format!("row stride {} < cols {}", self.row_stride, self.cols),
            ));
        }
        let total = buffer_len(&self.handle);
        if self.offset + self.span() > total {
            return Err(KernelError::shape(
                what,
                format!(
                    "a {}×{} window at offset {} with stride {} leaves a buffer of {total} elements",
                    self.rows, self.cols, self.offset, self.row_stride
                ),
            ));
        }
        Ok(())
    }

    /// The sub-window of `rows × cols` elements starting at `(row0, col0)` (same buffer).
    pub fn window(
        &self,
        row0: usize,
        col0: usize,
        rows: usize,
        cols: usize,
    ) -> Result<MatrixView, KernelError> {
        if row0 + rows > self.rows || col0 + cols > self.cols {
            return Err(KernelError::shape(
                "window",
                format!(
                    "{rows}×{cols} at ({row0}, {col0}) does not fit a {}×{} view",
                    self.rows, self.cols
                ),
            ));
        }
        Ok(Self {
            handle: self.handle.clone(),
            offset: self.offset + row0 * self.row_stride + col0,
            rows,
            cols,
            row_stride: self.row_stride,
        })
    }

    /// Downloads the window as a row-major `[rows, cols]` vector (gaps between rows skipped).
    pub fn download<R: Runtime>(&self, client: &ComputeClient<R>) -> Result<Vec<f32>, KernelError> {
        self.check("download")?;
        let span: Vec<f32> = read_range(client, &self.handle, self.offset, self.span(), "matrix")?;
        if self.is_contiguous() {
            return Ok(span);
        }
        Ok((0..self.rows)
            .flat_map(|r| &span[r * self.row_stride..r * self.row_stride + self.cols])
            .copied()
            .collect())
    }
}

/// A flat vector of `len` elements of `T` (`f32` or `u32`) in device memory.
#[derive(Clone, Debug)]
pub struct DeviceVec<T: Element> {
    /// The buffer (at least `len` elements; one element when `len == 0`).
    pub handle: Handle,
    /// Elements.
    pub len: usize,
    element: PhantomData<T>,
}

impl<T: Element> DeviceVec<T> {
    /// Uploads a slice.
    pub fn upload<R: Runtime>(client: &ComputeClient<R>, data: &[T]) -> Self {
        Self::from_handle(upload_slice(client, data), data.len())
    }

    /// A new vector of `len` zeros (filled on the device).
    pub fn zeros<R: Runtime>(client: &ComputeClient<R>, len: usize) -> Result<Self, KernelError> {
        Ok(Self::from_handle(zeroed(client, len)?, len))
    }

    pub(crate) fn from_handle(handle: Handle, len: usize) -> Self {
        Self {
            handle,
            len,
            element: PhantomData,
        }
    }

    /// Downloads the vector.
    pub fn download<R: Runtime>(&self, client: &ComputeClient<R>) -> Result<Vec<T>, KernelError> {
        read_range(client, &self.handle, 0, self.len, "vector")
    }
}

/// Codes the kernels store as `u32` (always < 256) as bytes, in parallel (a layer of the 9B
/// model has 280 M of them).
pub(crate) fn to_bytes(values: Vec<u32>) -> Vec<u8> {
    use rayon::prelude::*;
    values.par_iter().map(|&v| v as u8).collect()
}

impl DeviceVec<u32> {
    /// The low byte of every element (the kernels' codes are `u32` below 256), packed four to a
    /// word on the device before the copy, so that a quarter of the bytes cross the bus. A
    /// layer of the 9B model has 280 M codes: 1.1 GB as `u32`, 280 MB as bytes.
    pub fn download_low_bytes<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
    ) -> Result<Vec<u8>, KernelError> {
        self.download_low_bytes_with(client, &crate::solver::CubeTransfer)
    }

    /// [`DeviceVec::download_low_bytes`] with the packed words copied by `transfer` (the
    /// driver's pinned copies on CUDA).
    pub fn download_low_bytes_with<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        transfer: &dyn crate::solver::Transfer<R>,
    ) -> Result<Vec<u8>, KernelError> {
        use rayon::prelude::*;
        let n = self.len;
        let words_len = n.div_ceil(4);
        let words = DeviceVec::<u32>::from_handle(
            client.empty(words_len.max(1) * size_of::<u32>()),
            words_len,
        );
        if n > 0 {
            let (count, dim) = elementwise(client, words_len)?;
            pack_low_bytes_kernel::launch::<R>(
                client,
                count,
                dim,
                array_arg(&self.handle),
                array_arg(&words.handle),
                n,
            );
        }
        let packed = transfer.download_u32(client, &words)?;
        let mut bytes = vec![0u8; words_len * 4];
        bytes
            .par_chunks_mut(4)
            .zip(packed.par_iter())
            .for_each(|(b, w)| b.copy_from_slice(&w.to_le_bytes()));
        bytes.truncate(n);
        Ok(bytes)
    }
}

/// Word `w` holds the low bytes of elements `4w … 4w + 3` of `values` (`n` of them),
/// little-endian, zeros past the end.
#[cube(launch)]
fn pack_low_bytes_kernel(values: &Array<u32>, words: &mut Array<u32>, n: usize) {
    let w = ABSOLUTE_POS;
    let first = w * 4;
    if first < n {
        let mut word = values[first] & 255u32;
        if first + 1 < n {
            word |= (values[first + 1] & 255u32) << 8u32;
        }
        if first + 2 < n {
            word |= (values[first + 2] & 255u32) << 16u32;
        }
        if first + 3 < n {
            word |= (values[first + 3] & 255u32) << 24u32;
        }
        words[w] = word;
    }
}
