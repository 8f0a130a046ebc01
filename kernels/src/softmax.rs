//! The causally masked row softmax of blocked attention: f32 scores in, probabilities out in
//! the attention's float type (bf16 on CUDA, f32 in the tests).
//!
//! Layout (dense row-major, offset 0): `scores` (f32) and `p` (`F`) are both
//! `[batch, rows, keys]`. Row `r` of every batch is the query at position
//! `first_query + r` of its sequence, and the keys are the sequence's positions `0..keys`; so
//! the keys `c ≤ first_query + r` are valid (causal) and the others get `P = 0` exactly. The
//! valid part of a row becomes `exp(s − max) / Σ exp(s − max)` (max and sum over the valid
//! keys only), computed in f32 and rounded to `F` once.
//!
//! This is step 2 of the cuBLAS route to long-sequence attention
//! (`cuda::blocked_causal_attention_bf16`): cuBLAS writes the scores of a query block, this
//! kernel turns them into probabilities, cuBLAS multiplies them by V.
//!
//! # Parallelism
//!
//! One cube of [`SOFTMAX_UNITS`] units per row: rows are up to ~10⁵ keys long at the model's
//! sequence lengths, so a row needs a whole cube's bandwidth, and a cube per row needs no
//! cross-cube communication. Each unit strides over the row (unit `u` reads keys
//! `u, u + units, …`: consecutive units read consecutive addresses) keeping an online
//! (max, sum) pair, so the scores are read twice in all (once for the statistics, once for the
//! output) rather than three times; the pairs are combined by a shared-memory tree reduction.

use cubecl::ir::{ElemType, FloatKind, StorageType};
use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::error::{flush, KernelError};
use crate::launch::{check_addressable, cube_count};

/// Units per cube (one cube per row); a power of two for the tree reduction, and within every
/// backend's minimum of 256 units per cube.
pub const SOFTMAX_UNITS: usize = 256;

/// The problem of [`causal_softmax_rows`]: `batch` matrices of `rows × keys` scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SoftmaxShape {
    /// Independent `[rows, keys]` matrices (the query heads of one KV group).
    pub batch: usize,
    /// Rows per matrix (the queries of a block).
    pub rows: usize,
    /// Columns per matrix (the keys, sequence positions `0..keys`); at least 1.
    pub keys: usize,
    /// Sequence position of row 0: row `r` sees the keys `c ≤ first_query + r`.
    pub first_query: usize,
}

impl SoftmaxShape {
    /// Elements of `scores` and of `p`, `batch · rows · keys` (`None` on overflow).
    pub fn len(&self) -> Option<usize> {
        self.batch.checked_mul(self.rows)?.checked_mul(self.keys)
    }

    /// Whether there is no row at all (`batch` or `rows` is 0).
    pub fn is_empty(&self) -> bool {
        self.batch == 0 || self.rows == 0
    }
}

/// `p[b, r, c] = exp(s − m) / Σ_{c' ≤ first_query + r} exp(s[b, r, c'] − m)` for
/// `c ≤ first_query + r` (`s = scores[b, r, c]`, `m` the max over the same keys), `0` for the
/// other keys; computed in f32, stored as `F`.
///
/// - `scores`: f32 `[batch, rows, keys]`, dense, at least that many elements;
/// - `p`: `F` `[batch, rows, keys]`, dense, at least that many elements; must not alias
///   `scores`.
///
/// An empty problem (`batch` or `rows` 0) does nothing. Errors: [`KernelError::Shape`] for
/// `keys == 0` (a row with no key has no softmax) or a buffer too small,
/// [`KernelError::Unsupported`] past 32-bit indexing or on a device with fewer than
/// [`SOFTMAX_UNITS`] units per cube. The work is queued and flushed, not awaited.
pub fn causal_softmax_rows<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    scores: &Handle,
    p: &Handle,
    shape: &SoftmaxShape,
) -> Result<(), KernelError> {
    let out = F::as_type_native_unchecked().storage_type();
    causal_softmax_rows_as(client, scores, p, shape, out)
}

/// [`causal_softmax_rows`] with the output type given at run time: `out` is the storage type
/// of `p`'s elements, a scalar float (`f16`, `bf16`, `f32` or `f64`). This is how code that
/// cannot name the type writes bf16 (the crate does not depend on `half`):
/// `StorageType::Scalar(ElemType::Float(FloatKind::BF16))`.
pub fn causal_softmax_rows_as<R: Runtime>(
    client: &ComputeClient<R>,
    scores: &Handle,
    p: &Handle,
    shape: &SoftmaxShape,
    out: StorageType,
) -> Result<(), KernelError> {
    if !matches!(
        out,
        StorageType::Scalar(ElemType::Float(
            FloatKind::F16 | FloatKind::BF16 | FloatKind::F32 | FloatKind::F64
        ))
    ) {
        return Err(KernelError::unsupported(
            "softmax output type",
            format!("{out:?} (supported: f16, bf16, f32, f64)"),
        ));
    }
    let SoftmaxShape {
        batch,
        rows,
        keys,
        first_query,
    } = *shape;
    if keys == 0 {
        return Err(KernelError::shape(
            "softmax keys",
            format!("{batch}×{rows} rows of 0 keys have no softmax"),
        ));
    }
    if shape.is_empty() {
        return Ok(());
    }
    let len = shape
        .len()
        .ok_or_else(|| KernelError::unsupported("softmax size", format!("{shape:?} overflows")))?;
    check_addressable("softmax scores", len)?;
    let out_bytes = out.size();
    for (handle, elem, what) in [
        (scores, size_of::<f32>(), "softmax scores"),
        (p, out_bytes, "softmax p"),
    ] {
        let bytes = handle.size_in_used() as usize;
        if bytes < len * elem {
            return Err(KernelError::shape(
                what,
                format!(
                    "a buffer of {bytes} bytes for {batch}×{rows}×{keys} elements of {elem} \
                     bytes"
                ),
            ));
        }
    }
    let max_units = client.properties().hardware.max_units_per_cube as usize;
    if max_units < SOFTMAX_UNITS {
        return Err(KernelError::unsupported(
            "softmax device",
            format!(
                "the kernel needs {SOFTMAX_UNITS} units per cube; the device allows {max_units}"
            ),
        ));
    }
    let total_rows = batch * rows;
    let count = cube_count(client, total_rows)?;
    // Every row has at least one valid key already at `first_query = keys − 1`: clamping keeps
    // `first_query + r + 1` within 32 bits in the kernel without changing the mask.
    let first_query = first_query.min(keys);
    causal_softmax_kernel::launch::<R>(
        client,
        count,
        CubeDim::new_1d(SOFTMAX_UNITS as u32),
        whole::<R>(scores, size_of::<f32>()),
        whole::<R>(p, out_bytes),
        rows,
        keys,
        first_query,
        total_rows,
        SOFTMAX_UNITS,
        out,
    );
    flush(client, "causal softmax")
}

/// A whole buffer as an array of elements of `elem` bytes.
fn whole<R: Runtime>(handle: &Handle, elem: usize) -> ArrayArg<R> {
    let len = handle.size_in_used() as usize / elem;
    // SAFETY: the length is the buffer's own length in elements of `elem` bytes, so every
    // in-bounds index is inside the allocation (and the launch is bounds-checked as well).
    unsafe { ArrayArg::from_raw_parts(handle.clone(), len) }
}

/// One cube per row `CUBE_POS < total_rows` (row `r = CUBE_POS % rows` of its batch);
/// `units` is the cube size (a power of two). Every unit of a cube reaches every barrier: the
/// only branch around them depends on the cube alone.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn causal_softmax_kernel<F: Float>(
    scores: &Array<f32>,
    p: &mut Array<F>,
    rows: usize,
    keys: usize,
    first_query: usize,
    total_rows: usize,
    #[comptime] units: usize,
    #[define(F)] _out: StorageType,
) {
    let row = CUBE_POS;
    if row < total_rows {
        let u = UNIT_POS as usize;
        let base = row * keys;
        let mut valid = first_query + row % rows + 1;
        if valid > keys {
            valid = keys;
        }

        // Online (max, sum) over this unit's keys: `sum` is relative to `max`. `f32::MIN`
        // stands for −∞ (WGSL has no infinity literal): `exp(MIN − s)` is 0 for any score.
        let mut m = f32::min_value();
        let mut l = 0.0f32;
        let mut c = u;
        while c < valid {
            let s = scores[base + c];
            if s > m {
                l = l * (m - s).exp() + 1.0f32;
                m = s;
            } else {
                l += (s - m).exp();
            }
            c += units;
        }

        // Tree reduction of the pairs; a unit without keys contributes (MIN, 0), neutral.
        let mut m_s = SharedMemory::<f32>::new(units);
        let mut l_s = SharedMemory::<f32>::new(units);
        m_s[u] = m;
        l_s[u] = l;
        sync_cube();
        // The cube size is `units`; read as a runtime value so that the loop is a loop.
        let mut half = (CUBE_DIM / 2) as usize;
        while half > 0 {
            if u < half {
                let m1 = m_s[u];
                let m2 = m_s[u + half];
                let mut mx = m1;
                if m2 > mx {
                    mx = m2;
                }
                l_s[u] = l_s[u] * (m1 - mx).exp() + l_s[u + half] * (m2 - mx).exp();
                m_s[u] = mx;
            }
            sync_cube();
            half /= 2;
        }
        let mx = m_s[0];
        // `l ≥ 1`: the maximum itself contributes exp(0).
        let inv = 1.0f32 / l_s[0];

        let mut c = u;
        while c < keys {
            let mut x = 0.0f32;
            if c < valid {
                x = (scores[base + c] - mx).exp() * inv;
            }
            p[base + c] = F::cast_from(x);
            c += units;
        }
    }
}
