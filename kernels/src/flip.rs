//! `A ← P·A·P` with `P` the reversal permutation: element `(i, j)` trades places with
//! `(m−1−i, n−1−j)`. The cuSOLVER route to GPTQ's factor computes
//! `U = P·inv(chol(P·H·P))·P`, which needs this on both sides.

use cubecl::prelude::*;

use crate::device::{array_arg, MatrixView};
use crate::error::KernelError;
use crate::launch::elementwise;

/// Reverses the rows and the columns of the window `a` in place (any shape; a symmetric
/// matrix stays symmetric).
pub fn reverse_in_place<R: Runtime>(
    client: &ComputeClient<R>,
    a: &MatrixView,
) -> Result<(), KernelError> {
    a.check("reverse")?;
    // One unit per pair; the middle element of an odd count stays.
    let pairs = a.len() / 2;
    if pairs == 0 {
        return Ok(());
    }
    let (count, dim) = elementwise(client, pairs)?;
    reverse_kernel::launch::<R>(
        client,
        count,
        dim,
        array_arg(&a.handle),
        a.offset,
        a.row_stride,
        a.cols,
        a.len(),
    );
    Ok(())
}

/// Swaps window element `k` (row-major index) with element `len−1−k`, for `k < len/2`.
#[cube(launch)]
fn reverse_kernel(a: &mut Array<f32>, offset: usize, row_stride: usize, cols: usize, len: usize) {
    let k = ABSOLUTE_POS;
    if k < len / 2 {
        let mirror = len - 1 - k;
        let at = offset + (k / cols) * row_stride + k % cols;
        let mirror_at = offset + (mirror / cols) * row_stride + mirror % cols;
        let v = a[at];
        a[at] = a[mirror_at];
        a[mirror_at] = v;
    }
}
