//! GPTQ on the NVFP4 grid on the device: `sala_hessian::Nvfp4Gptq`'s column loop, with each
//! 16-column block's E4M3 scale searched on the error-updated weights when the loop reaches
//! it (the block search's candidate loop), each weight rounded to E2M1 on that scale, and its
//! scaled error spread over the later columns.
//!
//! The inputs are the host's prepared problem: `W [rows, cols]` in natural column order
//! (an NVFP4 block is 16 consecutive stored columns) with dead columns zeroed, and `U
//! [cols, cols]`, the upper Cholesky factor of the damped `H⁻¹`. For each lazy block
//! `[b0, b1)` (a multiple of 16 columns), one launch of the lazy-block kernel goes through
//! each 16-column block `[c0, c0 + 16)` of it in order. A team of [`LANES`] units serves
//! each row, unit `l` owning the columns `c0 + l` of every block:
//!
//! 1. the team's units publish the block's current values through shared memory, and each
//!    tries the search's candidates `l, l + 16, …` (the block search's own candidate loop,
//!    [`crate::block_search`]); the team keeps the least error, the first among equal ones,
//!    which is the host's choice;
//! 2. every unit quantizes the block's 16 columns in order on that scale (`e = (w − q)/U[c,c]`,
//!    `w[j] −= e·U[c,j]` for the block's later columns: the same arithmetic in each unit, so
//!    the same errors, and no barrier per column); unit `l` writes column `c0 + l`'s code and
//!    error, and subtracts the block's errors from its columns in the rest of the lazy block,
//!    `W[:, c0+16:b1] −= E_block · U[c0:c0+16, c0+16:b1]`;
//!
//! then `W[:, b1:] −= E · U[b0:b1, b1:]` through the caller's [`Gemm`]. (On the H200 two
//! launches per 16 columns took 84.6 ms per 4096² linear, five times GPTQ's integer loop;
//! one launch per lazy block with one unit per row filled 16 of its 132 SMs.)
//!
//! The differences from the host loop are f32 summation orders (the host's lazy blocks are
//! the same, its outer blocks are not), which flip a rare code at a rounding boundary or a
//! rare scale at a tie of the search.

use cubecl::prelude::*;
use sala_formats::NVFP4_BLOCK;
use sala_hessian::{ColumnSolution, HessianError, Nvfp4BlockSearch};

use crate::block_search::{
    chosen_byte, download_block_scales, e2m1_round, e4m3_decode, max_scale, search_candidates,
    SearchLaunch, SearchScalars,
};
use crate::device::{array_arg, DeviceVec, MatrixView};
use crate::error::{flush, KernelError};
use crate::gemm::Gemm;
use crate::gptq::{launch_column_loss, team_least_error};
use crate::launch::cube_count;
use crate::solver::Transfer;

/// Units that share one row in the lazy-block kernel: one per column of a 16-column block.
pub const LANES: usize = NVFP4_BLOCK;

/// Rows (teams of [`LANES`] units) per cube when the device allows `LANES · 8` units.
const ROWS_PER_CUBE: usize = 8;

/// [`nvfp4_gptq_solve`]'s output, on the device.
#[derive(Clone, Debug)]
pub struct DeviceNvfp4Gptq {
    /// Output rows.
    pub rows: usize,
    /// Input columns (a multiple of 16).
    pub cols: usize,
    /// E4M3 block-scale bytes as `u32`, `[rows, cols/16]`.
    pub block_scales: DeviceVec<u32>,
    /// E2M1 codes (low 4 bits) as `u32`, `[rows, cols]`.
    pub codes: DeviceVec<u32>,
    /// `Σ_r (w − q)²/(2·U[c,c]²)` of each column (f32 sums of `e²/2`), `[cols]`.
    pub column_loss: DeviceVec<f32>,
}

impl DeviceNvfp4Gptq {
    /// The codes, scale bytes and column losses on the host through `transfer`'s copies.
    ///
    /// Errors: a read failure, or [`HessianError::NonFinite`] for a block whose weights were
    /// not finite when its scale was searched (reported at the block's first column).
    pub fn download_with<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        transfer: &dyn Transfer<R>,
    ) -> Result<ColumnSolution<u8>, KernelError> {
        let scales = download_block_scales(client, transfer, &self.block_scales, self.cols)?;
        let codes = self.codes.download_low_bytes_with(client, transfer)?;
        let column_loss = transfer.download_f32(client, &self.column_loss)?;
        Ok(ColumnSolution {
            codes,
            params_rows: scales,
            column_loss: column_loss.into_iter().map(f64::from).collect(),
        })
    }
}

/// GPTQ of the prepared `w [rows, cols]` (natural order, dead columns zeroed; overwritten
/// with error-updated values) against `u [cols, cols]` on the NVFP4 grid, in lazy blocks of
/// `block` columns (a positive multiple of 16).
///
/// `channel_weights [cols]` are the search's normalized column weights
/// (`Nvfp4BlockSearch::channel_weights`), `global_scale` the tensor's `weight_scale_2`.
/// Inputs must be finite (the host's checks run before); shapes and the block are checked
/// here. `u`'s strict lower triangle is not read.
#[allow(clippy::too_many_arguments)]
pub fn nvfp4_gptq_solve<R: Runtime, G: Gemm<R>>(
    client: &ComputeClient<R>,
    gemm: &G,
    w: &MatrixView,
    u: &MatrixView,
    channel_weights: &[f32],
    global_scale: f32,
    search: &Nvfp4BlockSearch,
    block: usize,
) -> Result<DeviceNvfp4Gptq, KernelError> {
    check_problem(w, u, channel_weights, block)?;
    search.validate()?;
    let (rows, cols) = (w.rows, w.cols);
    let blocks_per_row = cols / NVFP4_BLOCK;
    let result = DeviceNvfp4Gptq {
        rows,
        cols,
        block_scales: DeviceVec::zeros(client, rows * blocks_per_row)?,
        codes: DeviceVec::zeros(client, rows * cols)?,
        column_loss: DeviceVec::zeros(client, cols)?,
    };
    let errors = MatrixView::zeros(client, rows, cols)?;
    let channel_weights = DeviceVec::upload(client, channel_weights);
    let searching = SearchLaunch::new(client, search, global_scale);
    let rows_per_cube = rows_per_cube(client)?;
    let count = cube_count(client, rows.div_ceil(rows_per_cube))?;
    let dim = CubeDim::new_2d(LANES as u32, rows_per_cube as u32);
    let mut b0 = 0;
    while b0 < cols {
        let b1 = (b0 + block).min(cols);
        nvfp4_gptq_lazy_block_kernel::launch::<R>(
            client,
            count.clone(),
            dim,
            array_arg(&w.handle),
            array_arg(&u.handle),
            array_arg(&errors.handle),
            array_arg(&channel_weights.handle),
            array_arg(&searching.shrink().handle),
            array_arg(&result.block_scales.handle),
            array_arg(&result.codes.handle),
            Fp4BlockArgsLaunch::new(
                w.offset,
                w.row_stride,
                u.offset,
                u.row_stride,
                errors.offset,
                errors.row_stride,
                rows,
                cols,
                b0,
                b1,
                blocks_per_row,
                global_scale,
            ),
            searching.scalars(),
            rows_per_cube,
        );
        if b1 < cols {
            let e = errors.window(0, b0, rows, b1 - b0)?;
            let u_rest = u.window(b0, b1, b1 - b0, cols - b1)?;
            let w_rest = w.window(0, b1, rows, cols - b1)?;
            gemm.gemm(client, -1.0, &e, false, &u_rest, false, 1.0, &w_rest)?;
        }
        b0 = b1;
    }
    launch_column_loss(client, &errors, &result.column_loss)?;
    flush(client, "nvfp4 gptq")?;
    Ok(result)
}

/// Teams per cube within the device's units per cube.
fn rows_per_cube<R: Runtime>(client: &ComputeClient<R>) -> Result<usize, KernelError> {
    let units = client.properties().hardware.max_units_per_cube as usize;
    if units < LANES {
        return Err(KernelError::unsupported(
            "nvfp4 gptq",
            format!("the device allows {units} units per cube, the kernel needs {LANES}"),
        ));
    }
    Ok(ROWS_PER_CUBE.min(units / LANES))
}

/// The shapes [`nvfp4_gptq_solve`] accepts.
fn check_problem(
    w: &MatrixView,
    u: &MatrixView,
    channel_weights: &[f32],
    block: usize,
) -> Result<(), KernelError> {
    w.check("nvfp4 gptq weights")?;
    u.check("nvfp4 gptq upper factor")?;
    let (rows, cols) = (w.rows, w.cols);
    if rows == 0 || cols == 0 {
        return Err(HessianError::Empty { what: "weights" }.into());
    }
    let problem = if cols % NVFP4_BLOCK != 0 {
        Some(format!("{cols} columns, not a multiple of {NVFP4_BLOCK}"))
    } else if (u.rows, u.cols) != (cols, cols) {
        Some(format!("w is {rows}×{cols} but u is {}×{}", u.rows, u.cols))
    } else if channel_weights.len() != cols {
        Some(format!(
            "{} channel weights for {cols} columns",
            channel_weights.len()
        ))
    } else if block == 0 || block % NVFP4_BLOCK != 0 {
        Some(format!("lazy block {block}, not a positive multiple of 16"))
    } else {
        None
    };
    match problem {
        Some(message) => Err(KernelError::shape("nvfp4 gptq", message)),
        None => Ok(()),
    }
}

/// The scalars of the lazy-block kernel.
#[derive(CubeLaunch, CubeType)]
struct Fp4BlockArgs {
    w_offset: usize,
    w_stride: usize,
    u_offset: usize,
    u_stride: usize,
    e_offset: usize,
    e_stride: usize,
    rows: usize,
    cols: usize,
    /// The lazy block's first column.
    b0: usize,
    /// The end of the lazy block.
    lazy_end: usize,
    blocks_per_row: usize,
    global: f32,
}

/// A team of [`LANES`] units per row (`UNIT_POS_X` the unit, `UNIT_POS_Y` the row in the
/// cube), through the lazy block `[b0, lazy_end)` 16 columns at a time: the block's scale
/// searched on the row's current values (the candidates dealt round-robin to the team), its 16
/// columns quantized in order on that scale by every unit, then each unit's columns of the
/// rest of the lazy block updated. A row's blocks depend on each other only through that
/// row's values, and unit `l` owns column `l` of every block, so the only barriers are the
/// two of the search per block.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn nvfp4_gptq_lazy_block_kernel(
    w: &mut Array<f32>,
    u: &Array<f32>,
    e: &mut Array<f32>,
    h: &Array<f32>,
    shrink: &Array<f32>,
    scales: &mut Array<u32>,
    codes: &mut Array<u32>,
    args: &Fp4BlockArgs,
    search: &SearchScalars,
    #[comptime] rows: usize,
) {
    let lane = UNIT_POS_X as usize;
    let local = UNIT_POS_Y as usize;
    let r = CUBE_POS * rows + local;
    // Rows past the end still reach every barrier.
    let valid = r < args.rows;
    let team = local * 16;
    let mut shared_values = SharedMemory::<f32>::new(rows * 16);
    let mut shared_error = SharedMemory::<f32>::new(rows * 16);
    let mut shared_index = SharedMemory::<u32>::new(rows * 16);
    let w_row = args.w_offset + r * args.w_stride;
    let e_row = args.e_offset + r * args.e_stride;
    let blocks = (args.lazy_end - args.b0) / 16;
    let mut values = Array::<f32>::new(16usize);
    let mut channel = Array::<f32>::new(16usize);
    let mut errs = Array::<f32>::new(16usize);
    for block in 0..blocks {
        let c0 = args.b0 + block * 16;
        let mut own = 0.0f32;
        if valid {
            own = w[w_row + c0 + lane];
        }
        shared_values[team + lane] = own;
        sync_cube();
        #[unroll]
        for j in 0..16usize {
            values[j] = shared_values[team + j];
            channel[j] = h[c0 + j];
        }
        let (init, finite) = max_scale(&values, search);
        let (index, err) = search_candidates(&values, &channel, shrink, search, init, lane, LANES);
        shared_error[team + lane] = err;
        shared_index[team + lane] = index as u32;
        // Also orders this block's reads of `shared_values` before the next block's writes.
        sync_cube();
        let (_, best) = team_least_error(&shared_error, &shared_index, team, LANES);
        let byte = chosen_byte(init, shrink, search, best as usize, finite);
        let divisor = e4m3_decode(byte) * args.global;
        #[unroll]
        for c in 0..16usize {
            let x = values[c];
            let (code, magnitude) = e2m1_round(x / divisor);
            let mut q = magnitude * divisor;
            if code >= 8 {
                q = -q;
            }
            let u_row = args.u_offset + (c0 + c) * args.u_stride;
            let err = (x - q) / u[u_row + c0 + c];
            errs[c] = err;
            if valid && lane == c {
                codes[r * args.cols + c0 + c] = code;
                e[e_row + c0 + c] = err;
            }
            #[unroll]
            for j in 0..16usize {
                if j > c {
                    values[j] -= err * u[u_row + c0 + j];
                }
            }
        }
        if valid && lane == 0 {
            scales[r * args.blocks_per_row + c0 / 16] = byte;
        }
        let mut j = c0 + 16 + lane;
        while valid && j < args.lazy_end {
            let mut update = 0.0f32;
            #[unroll]
            for c in 0..16usize {
                update += errs[c] * u[args.u_offset + (c0 + c) * args.u_stride + j];
            }
            w[w_row + j] -= update;
            j += LANES;
        }
    }
}
