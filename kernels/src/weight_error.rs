//! What a solve needs of a weight uploaded once: its columns in GPTQ's loop order
//! ([`gather_columns`]), and the weight error `D = W − Q` of a quantization where `W` already
//! is: of GPTQ's device result ([`gptq_weight_error`]) and of plain round-to-nearest
//! ([`rtn_weight_error`], the report's baseline), and of NVFP4 codes and block scales
//! ([`nvfp4_weight_error`]: GPTQ on the FP4 grid and max calibration). With the Hessian on
//! the device, the proxy
//! output error `tr(D·H·Dᵀ)` then needs no host difference and no second upload.
//!
//! Each `Q` is computed as the host computes it (`scale · (code − zero)`, codes and group
//! parameters by the same cube functions as [`gptq_solve`](crate::gptq_solve)'s), so `D`
//! equals the host's `W − Q` bit for bit.

use cubecl::prelude::*;
use sala_formats::IntQuantizer;

use sala_formats::NVFP4_BLOCK;

use crate::block_search::{e2m1_magnitude, e4m3_decode};
use crate::device::{array_arg, DeviceVec, MatrixView};
use crate::error::KernelError;
use crate::gptq::{group_params, quantize, scheme_code, widen, DeviceGptqResult};
use crate::hessian_ops::{cube_units, sum_over_units};
use crate::launch::{check_addressable, cube_count, elementwise};

/// A new dense `[rows, sources.len()]` matrix whose column `c` is column `sources[c]` of `w`,
/// or zeros where `sources[c]` is `None` (GPTQ's loop weights: act-order or group-aware
/// order, dead columns zeroed). `w` is left as it is.
pub fn gather_columns<R: Runtime>(
    client: &ComputeClient<R>,
    w: &MatrixView,
    sources: &[Option<usize>],
) -> Result<MatrixView, KernelError> {
    w.check("gather_columns weights")?;
    if let Some(bad) = sources.iter().flatten().find(|&&j| j >= w.cols) {
        return Err(KernelError::shape(
            "gather_columns",
            format!("source column {bad} of a {}×{} matrix", w.rows, w.cols),
        ));
    }
    let (rows, cols) = (w.rows, sources.len());
    check_addressable("gather_columns", rows * cols)?;
    let codes: Vec<u32> = sources
        .iter()
        .map(|s| s.map_or(ZERO_COLUMN, |j| j as u32))
        .collect();
    let sources = DeviceVec::upload(client, &codes);
    let out = dense(client, rows, cols);
    if rows * cols > 0 {
        let (count, dim) = elementwise(client, rows * cols)?;
        gather_columns_kernel::launch::<R>(
            client,
            count,
            dim,
            array_arg(&w.handle),
            array_arg(&sources.handle),
            array_arg(&out.handle),
            w.offset,
            w.row_stride,
            rows,
            cols,
            ZERO_COLUMN,
        );
    }
    Ok(out)
}

/// `D = W − Q` `[out, inp]` in the original column order, for GPTQ's device `result` (loop
/// order) of the loop `order` (loop position `c` is column `order[c]`) and the original
/// weights `w` `[out, inp]`: `Q[r, order[c]] = scale[r, c/gs] · (code[r, c] − zero[r, c/gs])`,
/// what the host's `Gptq::finish` dequantizes.
pub fn gptq_weight_error<R: Runtime>(
    client: &ComputeClient<R>,
    w: &MatrixView,
    result: &DeviceGptqResult,
    order: &[usize],
) -> Result<MatrixView, KernelError> {
    w.check("gptq_weight_error weights")?;
    let (out, inp) = (result.out, result.inp);
    if (w.rows, w.cols) != (out, inp) || order.len() != inp {
        return Err(KernelError::shape(
            "gptq_weight_error",
            format!(
                "a {}×{} weight and an order of {} for a {out}×{inp} result",
                w.rows,
                w.cols,
                order.len()
            ),
        ));
    }
    let mut seen = vec![false; inp];
    for &j in order {
        if j >= inp || std::mem::replace(&mut seen[j], true) {
            return Err(KernelError::shape(
                "gptq_weight_error",
                format!("the order is not a permutation of {inp} columns (column {j})"),
            ));
        }
    }
    check_addressable("gptq_weight_error", out * inp)?;
    let order: Vec<u32> = order.iter().map(|&j| j as u32).collect();
    let order = DeviceVec::upload(client, &order);
    let d = dense(client, out, inp);
    if out * inp > 0 {
        let (count, dim) = elementwise(client, out * inp)?;
        gptq_error_kernel::launch::<R>(
            client,
            count,
            dim,
            array_arg(&w.handle),
            array_arg(&result.codes.handle),
            array_arg(&result.scales.handle),
            array_arg(&result.zeros.handle),
            array_arg(&order.handle),
            array_arg(&d.handle),
            GptqErrorArgsLaunch::new(
                w.offset,
                w.row_stride,
                out,
                inp,
                result.group_size,
                result.groups(),
                1.0,
            ),
        );
    }
    Ok(d)
}

/// `D = W − Q` `[out, inp]` of round-to-nearest on `quantizer`'s grid, each group of
/// `group_size` columns on its plain `[min, max]` range (`sala_hessian::Rtn` without a
/// clipping search: the report's baseline).
pub fn rtn_weight_error<R: Runtime>(
    client: &ComputeClient<R>,
    w: &MatrixView,
    quantizer: IntQuantizer,
    group_size: usize,
) -> Result<MatrixView, KernelError> {
    w.check("rtn_weight_error weights")?;
    if group_size == 0 {
        return Err(sala_formats::FormatError::ZeroGroupSize.into());
    }
    let (rows, cols) = (w.rows, w.cols);
    let groups = cols.div_ceil(group_size);
    check_addressable("rtn_weight_error", rows * cols)?;
    let d = dense(client, rows, cols);
    if rows * groups > 0 {
        let (count, dim) = elementwise(client, rows * groups)?;
        rtn_error_kernel::launch::<R>(
            client,
            count,
            dim,
            array_arg(&w.handle),
            array_arg(&d.handle),
            RtnErrorArgsLaunch::new(
                w.offset,
                w.row_stride,
                rows,
                cols,
                group_size,
                groups,
                scheme_code(quantizer.scheme()),
                quantizer.maxq() as f32,
                quantizer.symmetric_zero() as f32,
                1.0,
                f32::INFINITY,
            ),
        );
    }
    Ok(d)
}

/// `D = W − Q` `[rows, cols]` of NVFP4 `codes` (E2M1 in the low 4 bits, `[rows, cols]`) and
/// `block_scales` (E4M3 bytes, `[rows, cols/16]`) under `global_scale`:
/// `Q = e2m1(code) · (e4m3(byte) · global_scale)`, what `sala_formats::nvfp4` dequantizes,
/// so `D` is the host's `W − Q` bit for bit.
pub fn nvfp4_weight_error<R: Runtime>(
    client: &ComputeClient<R>,
    w: &MatrixView,
    codes: &DeviceVec<u32>,
    block_scales: &DeviceVec<u32>,
    global_scale: f32,
) -> Result<MatrixView, KernelError> {
    check_nvfp4("nvfp4_weight_error", w, codes, block_scales)?;
    let (rows, cols) = (w.rows, w.cols);
    let d = dense(client, rows, cols);
    if rows * cols > 0 {
        let (count, dim) = elementwise(client, rows * cols)?;
        nvfp4_error_kernel::launch::<R>(
            client,
            count,
            dim,
            array_arg(&w.handle),
            array_arg(&codes.handle),
            array_arg(&block_scales.handle),
            array_arg(&d.handle),
            Nvfp4ErrorArgsLaunch::new(w.offset, w.row_stride, rows, cols, global_scale, 1.0),
        );
    }
    Ok(d)
}

/// `Σ_j diag_j · (W − Q)²_rj` of every row `r` (`[rows]`, f32 sums on the device, on the
/// host), `Q` the NVFP4 values of `codes` and `block_scales` as in [`nvfp4_weight_error`]:
/// the proxy output error under the diagonal Hessian `diag` `[cols]`, row by row, without
/// forming `W − Q`.
pub fn nvfp4_diagonal_error<R: Runtime>(
    client: &ComputeClient<R>,
    w: &MatrixView,
    codes: &DeviceVec<u32>,
    block_scales: &DeviceVec<u32>,
    diag: &DeviceVec<f32>,
    global_scale: f32,
) -> Result<Vec<f32>, KernelError> {
    check_nvfp4("nvfp4_diagonal_error", w, codes, block_scales)?;
    let (rows, cols) = (w.rows, w.cols);
    if diag.len != cols {
        return Err(KernelError::shape(
            "nvfp4_diagonal_error",
            format!("{} diagonal entries for {cols} columns", diag.len),
        ));
    }
    if rows == 0 {
        return Ok(Vec::new());
    }
    let out = DeviceVec::<f32>::zeros(client, rows)?;
    let units = cube_units(client);
    nvfp4_diagonal_error_kernel::launch::<R>(
        client,
        cube_count(client, rows)?,
        CubeDim::new_1d(units),
        array_arg(&w.handle),
        array_arg(&codes.handle),
        array_arg(&block_scales.handle),
        array_arg(&diag.handle),
        array_arg(&out.handle),
        Nvfp4ErrorArgsLaunch::new(w.offset, w.row_stride, rows, cols, global_scale, 1.0),
        units as usize,
    );
    out.download(client)
}

/// The shapes NVFP4's weight errors accept: `codes` `[rows, cols]` and `block_scales`
/// `[rows, cols/16]` for the weight `w` `[rows, cols]`, `cols` a multiple of 16.
fn check_nvfp4(
    what: &'static str,
    w: &MatrixView,
    codes: &DeviceVec<u32>,
    block_scales: &DeviceVec<u32>,
) -> Result<(), KernelError> {
    w.check(what)?;
    let (rows, cols) = (w.rows, w.cols);
    if cols % NVFP4_BLOCK != 0
        || codes.len != rows * cols
        || block_scales.len != rows * cols / NVFP4_BLOCK
    {
        return Err(KernelError::shape(
            what,
            format!(
                "a {rows}×{cols} weight with {} codes and {} block scales",
                codes.len, block_scales.len
            ),
        ));
    }
    check_addressable(what, rows * cols)
}

/// The source of a zeroed column in [`gather_columns_kernel`].
const ZERO_COLUMN: u32 = u32::MAX;

/// A new dense `[rows, cols]` matrix of unspecified contents (every element is written).
fn dense<R: Runtime>(client: &ComputeClient<R>, rows: usize, cols: usize) -> MatrixView {
    MatrixView::dense(
        client.empty((rows * cols).max(1) * size_of::<f32>()),
        rows,
        cols,
    )
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn gather_columns_kernel(
    w: &Array<f32>,
    sources: &Array<u32>,
    out: &mut Array<f32>,
    w_offset: usize,
    w_stride: usize,
    rows: usize,
    cols: usize,
    zero_column: u32,
) {
    let idx = ABSOLUTE_POS;
    if idx < rows * cols {
        let (r, c) = (idx / cols, idx % cols);
        let source = sources[c];
        let mut v = 0.0f32;
        if source != zero_column {
            v = w[w_offset + r * w_stride + source as usize];
        }
        out[idx] = v;
    }
}

/// The scalars of [`gptq_error_kernel`].
#[derive(CubeLaunch, CubeType)]
struct GptqErrorArgs {
    w_offset: usize,
    w_stride: usize,
    out: usize,
    inp: usize,
    group_size: usize,
    /// Groups per row (the parameters' row stride).
    groups: usize,
    /// A runtime 1.0: `w − (s·c)·one` rounds like the host's `w − s·c` even where the GPU
    /// compiler would contract it into an FMA.
    one: f32,
}

/// One unit per loop-order element `(r, c)`; writes `D[r, order[c]]`.
#[cube(launch)]
fn gptq_error_kernel(
    w: &Array<f32>,
    codes: &Array<u32>,
    scales: &Array<f32>,
    zeros: &Array<u32>,
    order: &Array<u32>,
    d: &mut Array<f32>,
    args: &GptqErrorArgs,
) {
    let idx = ABSOLUTE_POS;
    if idx < args.out * args.inp {
        let (r, c) = (idx / args.inp, idx % args.inp);
        let at = r * args.groups + c / args.group_size;
        let zero = f32::cast_from(zeros[at]);
        let q = (scales[at] * (f32::cast_from(codes[idx]) - zero)) * args.one;
        let j = order[c] as usize;
        d[r * args.inp + j] = w[args.w_offset + r * args.w_stride + j] - q;
    }
}

/// The scalars of [`rtn_error_kernel`].
#[derive(CubeLaunch, CubeType)]
struct RtnErrorArgs {
    w_offset: usize,
    w_stride: usize,
    rows: usize,
    cols: usize,
    group_size: usize,
    groups: usize,
    /// The grid (the GPTQ kernel's `SCHEME_*`, `2^bits − 1`, `2^(bits−1)`).
    scheme: u32,
    maxq: f32,
    sym_zero: f32,
    /// A runtime 1.0 (see [`GptqErrorArgs`]).
    one: f32,
    /// `f32::INFINITY`, the empty range's bound (WGSL has no infinity literal).
    infinity: f32,
}

/// One unit per `(row, group)`: the group's range, its parameters, and `w − q` of each of its
/// columns.
#[cube(launch)]
fn rtn_error_kernel(w: &Array<f32>, d: &mut Array<f32>, args: &RtnErrorArgs) {
    let idx = ABSOLUTE_POS;
    if idx < args.rows * args.groups {
        let (r, g) = (idx / args.groups, idx % args.groups);
        let c0 = g * args.group_size;
        let mut c1 = c0 + args.group_size;
        if c1 > args.cols {
            c1 = args.cols;
        }
        let row = args.w_offset + r * args.w_stride;
        let mut lo = args.infinity;
        let mut hi = -args.infinity;
        for c in c0..c1 {
            let range = widen(lo, hi, w[row + c]);
            lo = range.0;
            hi = range.1;
        }
        let (scale, zero) = group_params(lo, hi, args.scheme, args.maxq, args.sym_zero);
        for c in c0..c1 {
            let x = w[row + c];
            let code = quantize(x, scale, zero, args.maxq);
            d[r * args.cols + c] = x - (scale * (code - zero)) * args.one;
        }
    }
}

/// The scalars of [`nvfp4_error_kernel`] and [`nvfp4_diagonal_error_kernel`].
#[derive(CubeLaunch, CubeType)]
struct Nvfp4ErrorArgs {
    w_offset: usize,
    w_stride: usize,
    rows: usize,
    cols: usize,
    global: f32,
    /// A runtime 1.0 (see [`GptqErrorArgs`]).
    one: f32,
}

/// One unit per element: `w − q` ([`nvfp4_value`]).
#[cube(launch)]
fn nvfp4_error_kernel(
    w: &Array<f32>,
    codes: &Array<u32>,
    scales: &Array<u32>,
    d: &mut Array<f32>,
    args: &Nvfp4ErrorArgs,
) {
    let idx = ABSOLUTE_POS;
    if idx < args.rows * args.cols {
        let (r, c) = (idx / args.cols, idx % args.cols);
        let q = nvfp4_value(codes, scales, idx, args);
        d[idx] = w[args.w_offset + r * args.w_stride + c] - q;
    }
}

/// Cube `r` sums `diag_c · (w − q)²` over the columns `c` of row `r` (units stride, then the
/// partials in unit order).
#[cube(launch)]
fn nvfp4_diagonal_error_kernel(
    w: &Array<f32>,
    codes: &Array<u32>,
    scales: &Array<u32>,
    diag: &Array<f32>,
    out: &mut Array<f32>,
    args: &Nvfp4ErrorArgs,
    #[comptime] units: usize,
) {
    let row_index = CUBE_POS;
    let row = select(row_index < args.rows, row_index, 0);
    let mut sum = 0.0f32;
    let mut c = UNIT_POS as usize;
    while c < args.cols {
        let q = nvfp4_value(codes, scales, row * args.cols + c, args);
        let d = w[args.w_offset + row * args.w_stride + c] - q;
        sum += diag[c] * (d * d);
        c += units;
    }
    let total = sum_over_units(sum, units);
    if UNIT_POS == 0 && row_index < args.rows {
        out[row_index] = total;
    }
}

/// The NVFP4 value of element `idx` of a dense `[rows, cols]` code grid:
/// `±(|e2m1(code)| · (e4m3(byte) · global))`, the product kept apart from the caller's
/// subtraction (see [`GptqErrorArgs`]).
#[cube]
fn nvfp4_value(codes: &Array<u32>, scales: &Array<u32>, idx: usize, args: &Nvfp4ErrorArgs) -> f32 {
    let divisor = e4m3_decode(scales[idx / 16]) * args.global;
    let code = codes[idx];
    let mut q = (e2m1_magnitude(code) * divisor) * args.one;
    if code >= 8 {
        q = -q;
    }
    q
}
