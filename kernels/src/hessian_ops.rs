//! What GPTQ needs of a Hessian that stays in device memory, besides its factor: the
//! diagonal ([`diagonal`]), the first non-finite element ([`first_non_finite`]), the damped
//! copy in loop order that gets factored ([`damped_permuted`]) and the row dots of the proxy
//! error `tr(D·H·Dᵀ) = Σᵢ ⟨Dᵢ, (D·H)ᵢ⟩` ([`row_dots`]). Only vectors cross the bus.

use cubecl::prelude::*;

use crate::device::{array_arg, DeviceVec, MatrixView};
use crate::error::KernelError;
use crate::launch::{cube_count, elementwise, UNITS_PER_CUBE};

/// The diagonal of the square window `m`, `[n]` on the device.
pub fn diagonal<R: Runtime>(
    client: &ComputeClient<R>,
    m: &MatrixView,
) -> Result<DeviceVec<f32>, KernelError> {
    let n = square("diagonal", m)?;
    let out = client.empty(n.max(1) * size_of::<f32>());
    if n > 0 {
        let (count, dim) = elementwise(client, n)?;
        diagonal_kernel::launch::<R>(
            client,
            count,
            dim,
            array_arg(&m.handle),
            array_arg(&out),
            m.offset,
            m.row_stride,
            n,
        );
    }
    Ok(DeviceVec::from_handle(out, n))
}

/// `(row, col)` of the first NaN or infinite element of `m` in row-major order, `None` when
/// every element is finite. One cube per row; `rows` integers come back.
pub fn first_non_finite<R: Runtime>(
    client: &ComputeClient<R>,
    m: &MatrixView,
) -> Result<Option<(usize, usize)>, KernelError> {
    m.check("first_non_finite")?;
    if m.is_empty() {
        return Ok(None);
    }
    let out = client.empty(m.rows * size_of::<u32>());
    let units = cube_units(client);
    first_non_finite_kernel::launch::<R>(
        client,
        cube_count(client, m.rows)?,
        CubeDim::new_1d(units),
        array_arg(&m.handle),
        array_arg(&out),
        m.offset,
        m.row_stride,
        m.rows,
        m.cols,
        units as usize,
    );
    let first: Vec<u32> = DeviceVec::from_handle(out, m.rows).download(client)?;
    Ok(first
        .iter()
        .enumerate()
        .find(|(_, &c)| (c as usize) < m.cols)
        .map(|(r, &c)| (r, c as usize)))
}

/// `A = P·(H + λI)·Pᵀ` in f32 as a new dense matrix, the matrix GPTQ factors: element
/// `(i, j)` off the diagonal is `H[max(oᵢ, oⱼ), min(oᵢ, oⱼ)]` (the lower triangle of `h`
/// mirrored, `o = order`), the diagonal is `damped_diag` (`diag(H)` in loop order with dead
/// columns set to 1, plus `λ`, rounded to f32 by the caller). `h` is left as it is.
pub fn damped_permuted<R: Runtime>(
    client: &ComputeClient<R>,
    h: &MatrixView,
    order: &[usize],
    damped_diag: &[f32],
) -> Result<MatrixView, KernelError> {
    let n = square("damped_permuted", h)?;
    if order.len() != n || damped_diag.len() != n {
        return Err(KernelError::shape(
            "damped_permuted",
            format!(
                "order of {} and diagonal of {} for an {n}×{n} Hessian",
                order.len(),
                damped_diag.len()
            ),
        ));
    }
    if let Some(&bad) = order.iter().find(|&&o| o >= n) {
        return Err(KernelError::shape(
            "damped_permuted",
            format!("order names column {bad} of an {n}×{n} Hessian"),
        ));
    }
    let order: Vec<u32> = order.iter().map(|&o| o as u32).collect();
    let order = DeviceVec::upload(client, &order);
    let diag = DeviceVec::upload(client, damped_diag);
    let out = client.empty((n * n).max(1) * size_of::<f32>());
    if n > 0 {
        let (count, dim) = elementwise(client, n * n)?;
        damped_permuted_kernel::launch::<R>(
            client,
            count,
            dim,
            array_arg(&h.handle),
            array_arg(&order.handle),
            array_arg(&diag.handle),
            array_arg(&out),
            h.offset,
            h.row_stride,
            n,
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

/// `⟨a_i, b_i⟩` of every row `i` of two windows of one shape, summed in f32 on the device
/// (one cube per row), `[rows]` on the host.
pub fn row_dots<R: Runtime>(
    client: &ComputeClient<R>,
    a: &MatrixView,
    b: &MatrixView,
) -> Result<Vec<f32>, KernelError> {
    a.check("row_dots a")?;
    b.check("row_dots b")?;
    if (a.rows, a.cols) != (b.rows, b.cols) {
        return Err(KernelError::shape(
            "row_dots",
            format!("{}×{} against {}×{}", a.rows, a.cols, b.rows, b.cols),
        ));
    }
    if a.rows == 0 {
        return Ok(Vec::new());
    }
    let out = client.empty(a.rows * size_of::<f32>());
    let units = cube_units(client);
    row_dots_kernel::launch::<R>(
        client,
        cube_count(client, a.rows)?,
        CubeDim::new_1d(units),
        array_arg(&a.handle),
        array_arg(&b.handle),
        array_arg(&out),
        a.offset,
        a.row_stride,
        b.offset,
        b.row_stride,
        a.rows,
        a.cols,
        units as usize,
    );
    DeviceVec::<f32>::from_handle(out, a.rows).download(client)
}

/// Units per cube of the one-cube-per-row reductions.
pub(crate) fn cube_units<R: Runtime>(client: &ComputeClient<R>) -> u32 {
    UNITS_PER_CUBE.min(client.properties().hardware.max_units_per_cube)
}

/// `n` of a well-formed square window.
fn square(what: &'static str, m: &MatrixView) -> Result<usize, KernelError> {
    m.check(what)?;
    if m.rows != m.cols {
        return Err(KernelError::shape(
            what,
            format!("{}×{} is not square", m.rows, m.cols),
        ));
    }
    Ok(m.rows)
}

#[cube(launch)]
fn diagonal_kernel(m: &Array<f32>, out: &mut Array<f32>, offset: usize, stride: usize, n: usize) {
    let i = ABSOLUTE_POS;
    if i < n {
        out[i] = m[offset + i * stride + i];
    }
}

/// Cube `r` scans row `r` (its units stride over the columns) and writes the first
/// non-finite column, `cols` when there is none. Rows past the end (idle cubes of the grid)
/// compute on row 0 and write nothing, so every unit reaches the barriers.
#[cube(launch)]
fn first_non_finite_kernel(
    m: &Array<f32>,
    out: &mut Array<u32>,
    offset: usize,
    stride: usize,
    rows: usize,
    cols: usize,
    #[comptime] units: usize,
) {
    let mut first = SharedMemory::<u32>::new(units);
    let row_index = CUBE_POS;
    let row = select(row_index < rows, row_index, 0);
    let mut found = cols as u32;
    let mut c = UNIT_POS as usize;
    while c < cols {
        let v = m[offset + row * stride + c];
        if (v.is_nan() || v.is_inf()) && (c as u32) < found {
            found = c as u32;
        }
        c += units;
    }
    first[UNIT_POS as usize] = found;
    sync_cube();
    if UNIT_POS == 0 {
        let mut best = cols as u32;
        for u in 0..units {
            best = min(best, first[u]);
        }
        if row_index < rows {
            out[row_index] = best;
        }
    }
}

#[cube(launch)]
fn damped_permuted_kernel(
    h: &Array<f32>,
    order: &Array<u32>,
    damped_diag: &Array<f32>,
    out: &mut Array<f32>,
    offset: usize,
    stride: usize,
    n: usize,
) {
    let idx = ABSOLUTE_POS;
    if idx < n * n {
        let (i, j) = (idx / n, idx % n);
        if i == j {
            out[idx] = damped_diag[i];
        } else {
            let (oi, oj) = (order[i] as usize, order[j] as usize);
            let row = max(oi, oj);
            let col = min(oi, oj);
            out[idx] = h[offset + row * stride + col];
        }
    }
}

/// Cube `r` sums `a[r, c]·b[r, c]` over `c` (units stride, then unit 0 adds the partials in
/// unit order).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn row_dots_kernel(
    a: &Array<f32>,
    b: &Array<f32>,
    out: &mut Array<f32>,
    a_offset: usize,
    a_stride: usize,
    b_offset: usize,
    b_stride: usize,
    rows: usize,
    cols: usize,
    #[comptime] units: usize,
) {
    let row_index = CUBE_POS;
    let row = select(row_index < rows, row_index, 0);
    let mut sum = 0.0f32;
    let mut c = UNIT_POS as usize;
    while c < cols {
        sum += a[a_offset + row * a_stride + c] * b[b_offset + row * b_stride + c];
        c += units;
    }
    let total = sum_over_units(sum, units);
    if UNIT_POS == 0 && row_index < rows {
        out[row_index] = total;
    }
}

/// The cube's `units` partial sums added in unit order (the total is unit 0's; every unit
/// must call it, once per kernel, since it holds a barrier).
#[cube]
pub(crate) fn sum_over_units(partial_sum: f32, #[comptime] units: usize) -> f32 {
    let mut partial = SharedMemory::<f32>::new(units);
    partial[UNIT_POS as usize] = partial_sum;
    sync_cube();
    let mut total = 0.0f32;
    if UNIT_POS == 0 {
        for u in 0..units {
            total += partial[u];
        }
    }
    total
}
