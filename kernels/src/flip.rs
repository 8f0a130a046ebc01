//! `P·M·P` with `P` the reversal permutation: element `(i, j)` of a square matrix trades
//! places with `(n−1−i, n−1−j)`. The cuSOLVER route to GPTQ's factor computes
//! `U = P·inv(chol(P·H·P))·P`, which needs it on both sides (the second time keeping only the
//! upper triangle).

use cubecl::prelude::*;

use crate::device::{array_arg, MatrixView};
use crate::error::KernelError;
use crate::launch::elementwise;

/// `P·M·P` of the square window `m` (`out[i, j] = m[n−1−i, n−1−j]`) as a new dense matrix
/// (`m` is left as it is); with `upper_only`, the strict lower triangle of the result is zero
/// instead.
pub fn reversed<R: Runtime>(
    client: &ComputeClient<R>,
    m: &MatrixView,
    upper_only: bool,
) -> Result<MatrixView, KernelError> {
    m.check("reverse")?;
    if m.rows != m.cols {
        return Err(KernelError::shape(
            "reverse",
            format!("{}×{} is not square", m.rows, m.cols),
        ));
    }
    let n = m.rows;
    let out = client.empty((n * n).max(1) * size_of::<f32>());
    if n > 0 {
        let (count, dim) = elementwise(client, n * n)?;
        reverse_kernel::launch::<R>(
            client,
            count,
            dim,
            array_arg(&m.handle),
            array_arg(&out),
            m.offset,
            m.row_stride,
            n,
            upper_only,
        );
    }
    Ok(MatrixView {
        handle: out,
        offset: 0,
        rows: n,
        cols: n,
        row_stride: n,
    })
}

/// `dst[i·n + j] = src[offset + (n−1−i)·stride + (n−1−j)]` (0 below the diagonal when
/// `upper_only`), one unit per element.
#[cube(launch)]
fn reverse_kernel(
    src: &Array<f32>,
    dst: &mut Array<f32>,
    offset: usize,
    row_stride: usize,
    n: usize,
    #[comptime] upper_only: bool,
) {
    let idx = ABSOLUTE_POS;
    if idx < n * n {
        let (i, j) = (idx / n, idx % n);
        let value = src[offset + (n - 1 - i) * row_stride + (n - 1 - j)];
        if upper_only {
            if i > j {
                dst[idx] = 0.0;
            } else {
                dst[idx] = value;
            }
        } else {
            dst[idx] = value;
        }
    }
}
