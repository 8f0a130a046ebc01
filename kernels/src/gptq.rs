//! GPTQ on the device: the lazy-block column loop as a CubeCL kernel, the trailing update as
//! one [`Gemm`] per block.
//!
//! The inputs are the prepared column problem of `sala_hessian`'s solver: `W [out, inp]` in
//! loop order (dead columns zeroed, act-order permutation applied) and `U [inp, inp]`, the
//! upper Cholesky factor of the damped `H⁻¹` in the same order. For each block `[c0, c1)`:
//!
//! 1. the block kernel: one unit per output row runs the sequential column loop of the
//!    block (group parameters at each group start from the row's *current* values, exactly
//!    `IntQuantizer::params_for`; code; `e = (w − q)/U[c,c]`; `w[j] −= e·U[c,j]` for the rest
//!    of the block) on a shared-memory tile of `rows_per_cube × block` weights, and writes the
//!    codes, the group parameters and `E [out, c1−c0]`;
//! 2. `W[:, c1:] −= E · U[c0:c1, c1:]` through the caller's [`Gemm`], on windows.
//!
//! Blocks are shortened like the CPU solver's (a group never starts inside a block and ends
//! beyond it), so the parameters see the same updated weights as the textbook loop; the only
//! differences are f32 rounding orders (the GEMM sums a block's updates before subtracting),
//! which flip a rare code at a rounding boundary.

use cubecl::prelude::*;
use sala_formats::int::MIN_SCALE;
use sala_formats::{IntQuantizer, IntScheme, QuantParams};
use sala_hessian::GptqConfig;

use crate::device::{array_arg, DeviceVec, MatrixView};
use crate::error::{flush, KernelError};
use crate::gemm::Gemm;
use crate::launch::{check_addressable, cube_count};

/// Largest lazy block (columns per kernel launch) accepted.
pub const MAX_BLOCK: usize = 1024;

/// Output rows per cube when shared memory allows (one plane on most GPUs).
const ROWS_PER_CUBE: usize = 32;

/// The quantization grid and blocking of [`gptq_solve`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceGptqConfig {
    /// Bits per weight, 2..=8.
    pub bits: u32,
    /// Input columns per group; `None` is one group per row (per-channel).
    pub group_size: Option<usize>,
    /// How a group's scale and zero point are derived.
    pub scheme: IntScheme,
    /// Columns per lazy block (default 128), shortened like the CPU solver's so that groups
    /// start at block starts or lie inside one block.
    pub block: usize,
}

impl Default for DeviceGptqConfig {
    fn default() -> Self {
        Self::from(&GptqConfig::default())
    }
}

impl From<&GptqConfig> for DeviceGptqConfig {
    /// The grid and block size of a CPU configuration (act-order, damping and static groups are
    /// the caller's preparation: [`gptq_solve`] takes prepared inputs).
    fn from(config: &GptqConfig) -> Self {
        Self {
            bits: config.grid.bits,
            group_size: config.grid.group_size,
            scheme: config.grid.scheme,
            block: config.block_size,
        }
    }
}

/// The solve's output, on the device, in loop (column) order.
#[derive(Clone, Debug)]
pub struct DeviceGptqResult {
    /// Output rows.
    pub out: usize,
    /// Input columns.
    pub inp: usize,
    /// Columns per group (`inp` when per-channel).
    pub group_size: usize,
    /// Codes in `0..2^bits`, `[out, inp]`.
    pub codes: DeviceVec<u32>,
    /// Group scales, `[out, groups]` (row-major: all groups of row 0 first).
    pub scales: DeviceVec<f32>,
    /// Group zero points, `[out, groups]`.
    pub zeros: DeviceVec<u32>,
    /// `Σ_c (w − q)²/(2·U[c,c]²)` of each row (f32 sums of `e²/2`), `[out]`.
    pub row_loss: DeviceVec<f32>,
    /// The total loss `Σ (w − q)²/(2·U[c,c]²)` (the rows' sums added in f64 on the host).
    pub loss: f64,
}

/// A [`DeviceGptqResult`] read back.
#[derive(Debug, Clone, PartialEq)]
pub struct HostGptqResult {
    /// Codes, `[out, inp]`.
    pub codes: Vec<u8>,
    /// Group parameters, `[out, groups]` (row-major).
    pub params: Vec<QuantParams>,
    /// The total loss.
    pub loss: f64,
}

impl DeviceGptqResult {
    /// Groups per row.
    pub fn groups(&self) -> usize {
        self.inp.div_ceil(self.group_size)
    }

    /// Reads codes and parameters back.
    pub fn download<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
    ) -> Result<HostGptqResult, KernelError> {
        let codes = self.codes.download(client)?;
        let scales = self.scales.download(client)?;
        let zeros = self.zeros.download(client)?;
        Ok(HostGptqResult {
            codes: codes.into_iter().map(|c| c as u8).collect(),
            params: scales
                .into_iter()
                .zip(zeros)
                .map(|(scale, zero)| QuantParams {
                    scale,
                    zero: zero as u8,
                })
                .collect(),
            loss: self.loss,
        })
    }
}

/// Quantizes the prepared `w [out, inp]` with `u [inp, inp]` by GPTQ's lazy-block loop.
///
/// `w` is the solver's workspace: on return its columns hold error-updated weights (as the
/// CPU solver's loop-order copy does). `u`'s strict lower triangle is not read. The result is
/// in loop order; un-permuting (act-order) is the caller's. Inputs must be finite (the CPU
/// solver's checks run before its preparation); shapes, bit widths, group and block sizes are
/// checked here.
pub fn gptq_solve<R: Runtime, G: Gemm<R>>(
    client: &ComputeClient<R>,
    gemm: &G,
    w: &MatrixView,
    u: &MatrixView,
    config: &DeviceGptqConfig,
) -> Result<DeviceGptqResult, KernelError> {
    let plan = Plan::new(client, w, u, config)?;
    let (out, inp, gs) = (plan.out, plan.inp, plan.group_size);
    let groups = inp.div_ceil(gs);
    let result = DeviceGptqResult {
        out,
        inp,
        group_size: gs,
        codes: DeviceVec::zeros(client, out * inp),
        scales: DeviceVec::zeros(client, out * groups),
        zeros: DeviceVec::zeros(client, out * groups),
        row_loss: DeviceVec::zeros(client, out),
        loss: 0.0,
    };
    let errors = MatrixView::zeros(client, out, plan.block);
    let mut c0 = 0;
    while c0 < inp {
        let c1 = (c0 + plan.block).min(inp);
        let e = errors.window(0, 0, out, c1 - c0)?;
        plan.launch_block(client, w, u, &e, &result, c0, c1)?;
        if c1 < inp {
            let u_rest = u.window(c0, c1, c1 - c0, inp - c1)?;
            let w_rest = w.window(0, c1, out, inp - c1)?;
            gemm.gemm(client, -1.0, &e, false, &u_rest, false, 1.0, &w_rest)?;
        }
        c0 = c1;
    }
    flush(client, "gptq")?;
    let loss = result
        .row_loss
        .download(client)?
        .iter()
        .map(|&l| l as f64)
        .sum();
    Ok(DeviceGptqResult { loss, ..result })
}

/// The checked shapes and the launch choices of one solve.
struct Plan {
    out: usize,
    inp: usize,
    group_size: usize,
    quantizer: IntQuantizer,
    /// Effective block length.
    block: usize,
    /// Rows per cube (units per cube), a power of two.
    rows_per_cube: usize,
    /// Whether the block's `U` is staged in shared memory.
    stage_u: bool,
}

/// Which tile layout [`gptq_solve`] chose for a device and block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptqLaunchChoice {
    /// Effective block length.
    pub block: usize,
    /// Output rows (units) per cube.
    pub rows_per_cube: usize,
    /// Whether `U[c0:c1, c0:c1]` is staged in shared memory (else read from global memory,
    /// where the units of a cube read the same element at the same time).
    pub stage_u: bool,
}

/// The launch layout [`gptq_solve`] uses on this device for `inp` columns.
pub fn gptq_launch_choice<R: Runtime>(
    client: &ComputeClient<R>,
    inp: usize,
    config: &DeviceGptqConfig,
) -> Result<GptqLaunchChoice, KernelError> {
    let gs = group_size(config, inp)?;
    layout(client, effective_block(config.block, gs, inp))
}

fn group_size(config: &DeviceGptqConfig, inp: usize) -> Result<usize, KernelError> {
    match config.group_size {
        None => Ok(inp),
        Some(0) => Err(sala_formats::FormatError::ZeroGroupSize.into()),
        Some(g) => Ok(g.min(inp)),
    }
}

/// Rows per cube and `U` staging for a block: the weight and code tiles
/// (`2 · block · rows · 4` bytes) must fit in shared memory; `U` (`block² · 4` bytes) is
/// staged when it fits beside them.
fn layout<R: Runtime>(
    client: &ComputeClient<R>,
    block: usize,
) -> Result<GptqLaunchChoice, KernelError> {
    let hw = &client.properties().hardware;
    let shared = hw.max_shared_memory_size;
    let tiles = |rows: usize| 2 * block * rows * size_of::<f32>();
    let mut rows = ROWS_PER_CUBE.min(hw.max_units_per_cube as usize);
    while rows > 1 && tiles(rows) > shared {
        rows /= 2;
    }
    if tiles(rows) > shared {
        return Err(KernelError::unsupported(
            "gptq block",
            format!("a block of {block} columns needs more than {shared} bytes of shared memory"),
        ));
    }
    let stage_u = tiles(rows) + block * block * size_of::<f32>() <= shared;
    Ok(GptqLaunchChoice {
        block,
        rows_per_cube: rows,
        stage_u,
    })
}

impl Plan {
    fn new<R: Runtime>(
        client: &ComputeClient<R>,
        w: &MatrixView,
        u: &MatrixView,
        config: &DeviceGptqConfig,
    ) -> Result<Self, KernelError> {
        w.check("gptq weights")?;
        u.check("gptq upper factor")?;
        let (out, inp) = (w.rows, w.cols);
        if out == 0 || inp == 0 {
            return Err(KernelError::shape(
                "gptq",
                format!("empty weight {out}×{inp}"),
            ));
        }
        if u.rows != inp || u.cols != inp {
            return Err(KernelError::shape(
                "gptq",
                format!("w is {out}×{inp} but u is {}×{}", u.rows, u.cols),
            ));
        }
        check_addressable("gptq codes", out * inp)?;
        let quantizer = IntQuantizer::new(config.bits, config.scheme)?;
        let gs = group_size(config, inp)?;
        if config.block == 0 || config.block > MAX_BLOCK {
            return Err(KernelError::unsupported(
                "gptq block",
                format!("{} columns (must be in 1..={MAX_BLOCK})", config.block),
            ));
        }
        let choice = layout(client, effective_block(config.block, gs, inp))?;
        Ok(Self {
            out,
            inp,
            group_size: gs,
            quantizer,
            block: choice.block,
            rows_per_cube: choice.rows_per_cube,
            stage_u: choice.stage_u,
        })
    }

    /// Launches the column loop of the block `[c0, c1)`.
    #[allow(clippy::too_many_arguments)]
    fn launch_block<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        w: &MatrixView,
        u: &MatrixView,
        e: &MatrixView,
        result: &DeviceGptqResult,
        c0: usize,
        c1: usize,
    ) -> Result<(), KernelError> {
        let count = cube_count(client, self.out.div_ceil(self.rows_per_cube))?;
        let scheme = match self.quantizer.scheme() {
            IntScheme::SymmetricIst => SCHEME_IST,
            IntScheme::SymmetricAbsMax => SCHEME_ABSMAX,
            IntScheme::Asymmetric => SCHEME_ASYM,
        };
        gptq_block_kernel::launch::<R>(
            client,
            count,
            CubeDim::new_1d(self.rows_per_cube as u32),
            array_arg(&w.handle),
            array_arg(&u.handle),
            array_arg(&e.handle),
            array_arg(&result.codes.handle),
            array_arg(&result.scales.handle),
            array_arg(&result.zeros.handle),
            array_arg(&result.row_loss.handle),
            GptqBlockArgsLaunch::new(
                w.offset,
                w.row_stride,
                u.offset,
                u.row_stride,
                e.row_stride,
                self.out,
                self.inp,
                c0,
                c1 - c0,
                self.group_size,
                self.inp.div_ceil(self.group_size),
                scheme,
                self.quantizer.maxq() as f32,
                self.quantizer.symmetric_zero() as f32,
                1.0,
            ),
            self.rows_per_cube,
            self.block,
            self.stage_u,
            if self.stage_u {
                self.block * self.block
            } else {
                1
            },
        );
        Ok(())
    }
}

/// The block length actually used (the CPU solver's rule): shortened so that a group never
/// starts inside a block and ends beyond it, where its parameters would miss the block's
/// pending updates.
pub fn effective_block(block: usize, group_size: usize, inp: usize) -> usize {
    if group_size >= inp || block % group_size == 0 {
        block
    } else if group_size < block {
        block - block % group_size
    } else {
        gcd(block, group_size)
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// `IntScheme` as the kernel's runtime code.
const SCHEME_IST: u32 = 0;
const SCHEME_ABSMAX: u32 = 1;
const SCHEME_ASYM: u32 = 2;

/// The scalars of the block kernel.
#[derive(CubeLaunch, CubeType)]
struct GptqBlockArgs {
    /// Windows of `W`, `U` and `E` in their buffers (offsets, row strides).
    w_offset: usize,
    w_stride: usize,
    u_offset: usize,
    u_stride: usize,
    e_stride: usize,
    out: usize,
    inp: usize,
    /// The block `[c0, c0 + width)`.
    c0: usize,
    width: usize,
    group_size: usize,
    groups: usize,
    /// `SCHEME_*`.
    scheme: u32,
    /// `2^bits − 1` and `2^(bits−1)` as f32.
    maxq: f32,
    sym_zero: f32,
    /// A runtime 1.0: `x − (a·b)·one` rounds like the CPU's `x − a·b` even when the GPU
    /// compiler contracts it into an FMA (CUDA does by default).
    one: f32,
}

/// One unit per output row: the sequential column loop of one block on a shared tile.
///
/// Tiles are column-major in the cube (`tile[i·rows + t]` is column `i` of the cube's row
/// `t`), so the units' accesses to one column are consecutive (no bank conflicts) and the
/// cooperative loads and stores are coalesced along rows.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn gptq_block_kernel(
    w: &Array<f32>,
    u: &Array<f32>,
    e: &mut Array<f32>,
    codes: &mut Array<u32>,
    scales: &mut Array<f32>,
    zeros: &mut Array<u32>,
    row_loss: &mut Array<f32>,
    args: &GptqBlockArgs,
    #[comptime] rows: usize,
    #[comptime] block: usize,
    #[comptime] stage_u: bool,
    #[comptime] u_len: usize,
) {
    let t = UNIT_POS as usize;
    let row0 = CUBE_POS * rows;
    let width = args.width;
    let mut tile = SharedMemory::<f32>::new(rows * block);
    let mut code_tile = SharedMemory::<u32>::new(rows * block);
    let mut u_tile = SharedMemory::<f32>::new(u_len);

    // Cooperative, coalesced load of the cube's rows of W[:, c0..c0+width].
    let mut idx = t;
    while idx < rows * width {
        let rr = idx / width;
        let cc = idx % width;
        let row = row0 + rr;
        if row < args.out {
            tile[cc * rows + rr] = w[args.w_offset + row * args.w_stride + args.c0 + cc];
        }
        idx += rows;
    }
    if stage_u {
        let mut k = t;
        while k < width * width {
            let i = k / width;
            let j = k % width;
            u_tile[k] = u[args.u_offset + (args.c0 + i) * args.u_stride + args.c0 + j];
            k += rows;
        }
    }
    sync_cube();

    let r = row0 + t;
    if r < args.out {
        let gs = args.group_size;
        let param_row = r * args.groups;
        // A block may start inside a group (groups longer than blocks): its parameters were
        // written by the block where the group started.
        let mut scale = scales[param_row + args.c0 / gs];
        let mut zero = f32::cast_from(zeros[param_row + args.c0 / gs]);
        let mut loss = 0.0f32;
        for i in 0..width {
            let c = args.c0 + i;
            if c % gs == 0 {
                let (lo, hi) = group_range(w, &tile, args, r, t, c, rows);
                let params = group_params(lo, hi, args);
                scale = params.0;
                zero = params.1;
                scales[param_row + c / gs] = scale;
                zeros[param_row + c / gs] = u32::cast_from(zero);
            }
            let x = tile[i * rows + t];
            let code = quantize(x, scale, zero, args.maxq);
            let q = (scale * (code - zero)) * args.one;
            let d = u_at(u, &u_tile, args, i, i, width, stage_u);
            let err = (x - q) / d;
            loss += err * err;
            code_tile[i * rows + t] = u32::cast_from(code);
            for j in i + 1..width {
                let uij = u_at(u, &u_tile, args, i, j, width, stage_u);
                tile[j * rows + t] = tile[j * rows + t] - (err * uij) * args.one;
            }
            // Column i is final: the tile keeps its scaled error for the store below.
            tile[i * rows + t] = err;
        }
        row_loss[r] = row_loss[r] + 0.5 * loss;
    }
    sync_cube();

    // Cooperative, coalesced store of the codes and of E.
    let mut idx = t;
    while idx < rows * width {
        let rr = idx / width;
        let cc = idx % width;
        let row = row0 + rr;
        if row < args.out {
            codes[row * args.inp + args.c0 + cc] = code_tile[cc * rows + rr];
            e[row * args.e_stride + cc] = tile[cc * rows + rr];
        }
        idx += rows;
    }
}

/// `U[c0+i, c0+j]`, from the staged tile or from global memory.
#[cube]
fn u_at(
    u: &Array<f32>,
    u_tile: &SharedMemory<f32>,
    args: &GptqBlockArgs,
    i: usize,
    j: usize,
    width: usize,
    #[comptime] stage_u: bool,
) -> f32 {
    if stage_u {
        u_tile[i * width + j]
    } else {
        u[args.u_offset + (args.c0 + i) * args.u_stride + args.c0 + j]
    }
}

/// `(min, max)` of the row's current values over the group starting at column `c`: from the
/// tile inside the block, from `W` beyond it (those columns are up to date: groups that
/// extend past a block start at its first column).
#[cube]
#[allow(clippy::too_many_arguments)]
fn group_range(
    w: &Array<f32>,
    tile: &SharedMemory<f32>,
    args: &GptqBlockArgs,
    r: usize,
    t: usize,
    c: usize,
    #[comptime] rows: usize,
) -> (f32, f32) {
    let mut end = c + args.group_size;
    if end > args.inp {
        end = args.inp;
    }
    // Start from the first value (WGSL has no infinity literal); a group is never empty.
    let first = row_value(w, tile, args, r, t, c, rows);
    let mut lo = first;
    let mut hi = first;
    for col in c + 1..end {
        let v = row_value(w, tile, args, r, t, col, rows);
        if v < lo {
            lo = v;
        }
        if v > hi {
            hi = v;
        }
    }
    (lo, hi)
}

/// The current value of column `col` of row `r` (unit `t`): the tile inside the block,
/// `W` after it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn row_value(
    w: &Array<f32>,
    tile: &SharedMemory<f32>,
    args: &GptqBlockArgs,
    r: usize,
    t: usize,
    col: usize,
    #[comptime] rows: usize,
) -> f32 {
    if col < args.c0 + args.width {
        tile[(col - args.c0) * rows + t]
    } else {
        w[args.w_offset + r * args.w_stride + col]
    }
}

/// `IntQuantizer::params_from_range`: `(scale, zero)` of a group of range `[lo, hi]`.
#[cube]
fn group_params(lo_in: f32, hi_in: f32, args: &GptqBlockArgs) -> (f32, f32) {
    let mut lo = lo_in;
    let mut hi = hi_in;
    if lo > 0.0 {
        lo = 0.0;
    }
    if hi < 0.0 {
        hi = 0.0;
    }
    if args.scheme == SCHEME_ASYM {
        if lo == 0.0 && hi == 0.0 {
            lo = -1.0;
            hi = 1.0;
        }
        let scale = at_least_min_scale((hi - lo) / args.maxq);
        (scale, clamp_f32((-lo / scale).round(), 0.0, args.maxq))
    } else {
        if -lo > hi {
            hi = -lo;
        }
        if hi == 0.0 {
            hi = 1.0;
        }
        let scale = if args.scheme == SCHEME_IST {
            2.0 * hi / args.maxq
        } else {
            hi / (args.sym_zero - 1.0)
        };
        (at_least_min_scale(scale), args.sym_zero)
    }
}

/// `scale.max(MIN_SCALE)`.
#[cube]
fn at_least_min_scale(scale: f32) -> f32 {
    let mut out = scale;
    if scale < MIN_SCALE {
        out = MIN_SCALE;
    }
    out
}

/// `IntQuantizer::quantize` as f32: `clamp(round_ties_even(x/scale) + zero, 0, maxq)`
/// (`round` is ties-to-even on every CubeCL backend: WGSL `round`, CUDA `rint`).
#[cube]
fn quantize(x: f32, scale: f32, zero: f32, maxq: f32) -> f32 {
    let v = clamp_f32(x / scale, -1024.0, 1024.0);
    clamp_f32(v.round() + zero, 0.0, maxq)
}

#[cube]
fn clamp_f32(x: f32, lo: f32, hi: f32) -> f32 {
    let mut out = x;
    if x < lo {
        out = lo;
    }
    if x > hi {
        out = hi;
    }
    out
}
