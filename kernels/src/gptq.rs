//! GPTQ on the device: the lazy-block column loop as a CubeCL kernel, the trailing update as
//! one [`Gemm`] per block.
//!
//! The inputs are the prepared column problem of `sala_hessian`'s solver: `W [out, inp]` in
//! loop order (dead columns zeroed, act-order permutation applied) and `U [inp, inp]`, the
//! upper Cholesky factor of the damped `H⁻¹` in the same order. For each block `[c0, c1)`:
//!
//! 1. the block kernel: a team of [`TEAM`] units per output row runs the sequential column
//!    loop of the block (group parameters at each group start from the row's *current*
//!    values, exactly `IntQuantizer::params_for`; code; `e = (w − q)/U[c,c]`;
//!    `w[j] −= e·U[c,j]` for the rest of the block). Each unit holds `block / TEAM` of the
//!    row's block columns in registers; at column `c` its owner publishes the value through
//!    shared memory, every unit computes the same code and error, and each updates its own
//!    later columns (one barrier per column, the group ranges reduced over the team at the
//!    same barrier). The kernel writes the codes, the group parameters and `E [out, c1−c0]`;
//! 2. `W[:, c1:] −= E · U[c0:c1, c1:]` through the caller's [`Gemm`], on windows.
//!
//! With a clipping search (`DeviceGptqConfig::clip`) blocks are at most one group long and a
//! search kernel writes each group's parameters before the block that starts it (a team per
//! row, one unit per candidate range, on the row's current values), which the block kernel
//! then reads instead of computing them.
//!
//! Blocks are shortened like the CPU solver's (a group never starts inside a block and ends
//! beyond it), so the parameters see the same updated weights as the textbook loop; the only
//! differences are f32 rounding orders (the GEMM sums a block's updates before subtracting),
//! which flip a rare code at a rounding boundary.

use cubecl::prelude::*;
use sala_formats::int::MIN_SCALE;
use sala_formats::{ClipSearch, IntQuantizer, IntScheme, QuantParams};
use sala_hessian::GptqConfig;

use crate::device::{array_arg, DeviceVec, MatrixView};
use crate::error::{flush, KernelError};
use crate::gemm::Gemm;
use crate::launch::{check_addressable, cube_count};

/// Largest lazy block (columns per kernel launch) accepted.
pub const MAX_BLOCK: usize = 1024;

/// Units that share one output row in the block kernel (a team; the block's columns are dealt
/// to them round-robin). A constant rather than the device's plane size, so that the kernel
/// is the same on every runtime: the team talks through shared memory.
pub const TEAM: usize = 32;

/// Output rows per cube (teams per cube) when the device allows `TEAM · 4` units.
const ROWS_PER_CUBE: usize = 4;

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
    /// start at block starts or lie inside one block (at most one group with a clipping
    /// search, so that every group starts at a block start).
    pub block: usize,
    /// A clipping search for each group's range (GPTQModel's `mse`), run by its own kernel at
    /// each group start on the row's current values; `None`: the plain min/max range.
    pub clip: Option<ClipSearch>,
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
            clip: config.grid.clip,
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
    /// `Σ_r (w − q)²/(2·U[c,c]²)` of each column (f32 sums of `e²/2`), `[inp]`.
    pub column_loss: DeviceVec<f32>,
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
    /// Each column's loss, `[inp]`.
    pub column_loss: Vec<f32>,
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
        let codes = self.codes.download_low_bytes(client)?;
        self.download_with_codes(client, codes)
    }

    /// Reads the parameters back, with the codes already read by the caller as bytes
    /// (`[out, inp]`, e.g. [`DeviceVec::download_low_bytes`] through a faster copy than
    /// CubeCL's: 67 MB of them for a 16384 × 4096 weight).
    pub fn download_with_codes<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        codes: Vec<u8>,
    ) -> Result<HostGptqResult, KernelError> {
        if codes.len() != self.codes.len {
            return Err(KernelError::shape(
                "gptq codes",
                format!("{} codes read for {}", codes.len(), self.codes.len),
            ));
        }
        let column_loss = self.column_loss.download(client)?;
        let scales = self.scales.download(client)?;
        let zeros = self.zeros.download(client)?;
        Ok(HostGptqResult {
            codes,
            params: scales
                .into_iter()
                .zip(zeros)
                .map(|(scale, zero)| QuantParams {
                    scale,
                    zero: zero as u8,
                })
                .collect(),
            column_loss,
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
///
/// `column_weights` `[inp]` (loop order; GPTQ passes `diag(H)`) weigh each column's error in
/// the clipping search of `config.clip`; without them every column weighs 1. They are not
/// read without a search.
pub fn gptq_solve<R: Runtime, G: Gemm<R>>(
    client: &ComputeClient<R>,
    gemm: &G,
    w: &MatrixView,
    u: &MatrixView,
    config: &DeviceGptqConfig,
    column_weights: Option<&DeviceVec<f32>>,
) -> Result<DeviceGptqResult, KernelError> {
    let plan = Plan::new(client, w, u, config)?;
    let clip = match config.clip {
        Some(search) => Some(ClipLaunch::new(client, search, column_weights, plan.inp)?),
        None => None,
    };
    let (out, inp, gs) = (plan.out, plan.inp, plan.group_size);
    let groups = inp.div_ceil(gs);
    let result = DeviceGptqResult {
        out,
        inp,
        group_size: gs,
        codes: DeviceVec::zeros(client, out * inp)?,
        scales: DeviceVec::zeros(client, out * groups)?,
        zeros: DeviceVec::zeros(client, out * groups)?,
        row_loss: DeviceVec::zeros(client, out)?,
        column_loss: DeviceVec::zeros(client, inp)?,
        loss: 0.0,
    };
    // The scaled errors of every column (each block's window is the GEMM's left operand);
    // kept whole so that the column losses are one reduction at the end, not one per block.
    let errors = MatrixView::zeros(client, out, inp)?;
    let mut c0 = 0;
    while c0 < inp {
        let c1 = (c0 + plan.choice.block).min(inp);
        let e = errors.window(0, c0, out, c1 - c0)?;
        if let Some(clip) = &clip {
            // Every group starts at a block start (the plan's block): its parameters come
            // from the search, on the row's current values.
            if c0 % gs == 0 {
                plan.launch_clip_search(client, w, clip, &result, c0)?;
            }
        }
        plan.launch_block(client, w, u, &e, &result, c0, c1)?;
        if c1 < inp {
            let u_rest = u.window(c0, c1, c1 - c0, inp - c1)?;
            let w_rest = w.window(0, c1, out, inp - c1)?;
            gemm.gemm(client, -1.0, &e, false, &u_rest, false, 1.0, &w_rest)?;
        }
        c0 = c1;
    }
    launch_column_loss(client, &errors, &result.column_loss)?;
    flush(client, "gptq")?;
    let loss = result
        .row_loss
        .download(client)?
        .iter()
        .map(|&l| l as f64)
        .sum();
    Ok(DeviceGptqResult { loss, ..result })
}

/// Row stripes per cube of the column-loss kernel (the cube is `TEAM × STRIPES` units).
const STRIPES: usize = 8;

/// `column_loss[j] = ½ Σ_r E[r, j]²` for the scaled errors `e [out, inp]`.
pub(crate) fn launch_column_loss<R: Runtime>(
    client: &ComputeClient<R>,
    e: &MatrixView,
    column_loss: &DeviceVec<f32>,
) -> Result<(), KernelError> {
    let count = cube_count(client, e.cols.div_ceil(TEAM))?;
    column_loss_kernel::launch::<R>(
        client,
        count,
        CubeDim::new_2d(TEAM as u32, STRIPES as u32),
        array_arg(&e.handle),
        array_arg(&column_loss.handle),
        ColumnLossArgsLaunch::new(e.offset, e.row_stride, e.rows, e.cols),
        STRIPES,
    );
    Ok(())
}

/// The scalars of the column-loss kernel.
#[derive(CubeLaunch, CubeType)]
struct ColumnLossArgs {
    e_offset: usize,
    e_stride: usize,
    rows: usize,
    cols: usize,
}

/// A cube per [`TEAM`] columns: unit `(x, y)` sums column `x`'s squares over the rows
/// `y, y + stripes, …` (each stripe of the cube reads consecutive columns of one row:
/// coalesced), then the stripes' sums are added in a fixed order.
#[cube(launch)]
fn column_loss_kernel(
    e: &Array<f32>,
    column_loss: &mut Array<f32>,
    args: &ColumnLossArgs,
    #[comptime] stripes: usize,
) {
    let lane = UNIT_POS_X as usize;
    let stripe = UNIT_POS_Y as usize;
    let j = CUBE_POS * TEAM + lane;
    let mut partial = SharedMemory::<f32>::new(TEAM * stripes);
    let mut sum = 0.0f32;
    if j < args.cols {
        let mut r = stripe;
        while r < args.rows {
            let v = e[args.e_offset + r * args.e_stride + j];
            sum += v * v;
            r += stripes;
        }
    }
    partial[stripe * TEAM + lane] = sum;
    sync_cube();
    if stripe == 0 && j < args.cols {
        let mut total = 0.0f32;
        #[unroll]
        for k in 0..stripes {
            total += partial[k * TEAM + lane];
        }
        column_loss[j] = 0.5 * total;
    }
}

/// The checked shapes and the launch choices of one solve.
struct Plan {
    out: usize,
    inp: usize,
    group_size: usize,
    quantizer: IntQuantizer,
    /// The launch layout.
    choice: GptqLaunchChoice,
    /// Whether a clipping search writes the group parameters.
    clip: bool,
}

/// The block kernel's layout on a device for a block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptqLaunchChoice {
    /// Effective block length.
    pub block: usize,
    /// Output rows (teams of [`TEAM`] units) per cube.
    pub rows_per_cube: usize,
    /// Block columns each unit holds in registers (`block / TEAM`, rounded up).
    pub columns_per_unit: usize,
}

/// The launch layout [`gptq_solve`] uses on this device for `inp` columns.
pub fn gptq_launch_choice<R: Runtime>(
    client: &ComputeClient<R>,
    inp: usize,
    config: &DeviceGptqConfig,
) -> Result<GptqLaunchChoice, KernelError> {
    let gs = group_size(config, inp)?;
    if config.block == 0 || config.block > MAX_BLOCK {
        return Err(KernelError::unsupported(
            "gptq block",
            format!("{} columns (must be in 1..={MAX_BLOCK})", config.block),
        ));
    }
    let mut block = effective_block(config.block, gs, inp);
    if config.clip.is_some() {
        // The search runs between blocks: a group may not start inside one.
        block = block.min(gs);
    }
    layout(client, block)
}

fn group_size(config: &DeviceGptqConfig, inp: usize) -> Result<usize, KernelError> {
    match config.group_size {
        None => Ok(inp),
        Some(0) => Err(sala_formats::FormatError::ZeroGroupSize.into()),
        Some(g) => Ok(g.min(inp)),
    }
}

/// Teams per cube within the device's units per cube.
fn layout<R: Runtime>(
    client: &ComputeClient<R>,
    block: usize,
) -> Result<GptqLaunchChoice, KernelError> {
    let units = client.properties().hardware.max_units_per_cube as usize;
    if units < TEAM {
        return Err(KernelError::unsupported(
            "gptq block",
            format!("the device allows {units} units per cube, the kernel needs {TEAM}"),
        ));
    }
    Ok(GptqLaunchChoice {
        block,
        rows_per_cube: ROWS_PER_CUBE.min(units / TEAM),
        columns_per_unit: block.div_ceil(TEAM),
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
        let choice = gptq_launch_choice(client, inp, config)?;
        Ok(Self {
            out,
            inp,
            group_size: group_size(config, inp)?,
            quantizer,
            choice,
            clip: config.clip.is_some(),
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
        let rows = self.choice.rows_per_cube;
        let count = cube_count(client, self.out.div_ceil(rows))?;
        let scheme = scheme_code(self.quantizer.scheme());
        gptq_block_kernel::launch::<R>(
            client,
            count,
            CubeDim::new_2d(TEAM as u32, rows as u32),
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
                e.offset,
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
                f32::INFINITY,
                u32::from(self.clip),
            ),
            rows,
            self.choice.columns_per_unit,
        );
        Ok(())
    }

    /// Launches the clipping search of the group starting at column `c0`: writes its
    /// parameters for every row.
    fn launch_clip_search<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        w: &MatrixView,
        clip: &ClipLaunch,
        result: &DeviceGptqResult,
        c0: usize,
    ) -> Result<(), KernelError> {
        let rows = self.choice.rows_per_cube;
        let count = cube_count(client, self.out.div_ceil(rows))?;
        clip_search_kernel::launch::<R>(
            client,
            count,
            CubeDim::new_2d(TEAM as u32, rows as u32),
            array_arg(&w.handle),
            array_arg(&clip.weights.handle),
            array_arg(&clip.shrinks.handle),
            array_arg(&result.scales.handle),
            array_arg(&result.zeros.handle),
            ClipArgsLaunch::new(
                w.offset,
                w.row_stride,
                self.out,
                c0,
                self.group_size.min(self.inp - c0),
                c0 / self.group_size,
                self.inp.div_ceil(self.group_size),
                scheme_code(self.quantizer.scheme()),
                self.quantizer.maxq() as f32,
                self.quantizer.symmetric_zero() as f32,
                clip.shrinks.len as u32,
                clip.norm,
                u32::from(clip.weighted),
                1.0,
                f32::INFINITY,
            ),
            rows,
        );
        Ok(())
    }
}

/// A clipping search's device inputs.
struct ClipLaunch {
    /// Each candidate's range factor, `[candidates]` (the host's f32 values: the kernel
    /// shrinks ranges exactly as `ClipSearch::params` does).
    shrinks: DeviceVec<f32>,
    /// The column weights, or one unread value.
    weights: DeviceVec<f32>,
    weighted: bool,
    norm: f32,
}

impl ClipLaunch {
    fn new<R: Runtime>(
        client: &ComputeClient<R>,
        search: ClipSearch,
        column_weights: Option<&DeviceVec<f32>>,
        inp: usize,
    ) -> Result<Self, KernelError> {
        let shrinks: Vec<f32> = (0..search.candidates()).map(|i| search.shrink(i)).collect();
        let weights = match column_weights {
            Some(c) if c.len != inp => {
                return Err(KernelError::shape(
                    "gptq clipping search weights",
                    format!("{} column weights for {inp} columns", c.len),
                ))
            }
            Some(c) => c.clone(),
            None => DeviceVec::upload(client, &[1.0f32]),
        };
        Ok(Self {
            shrinks: DeviceVec::upload(client, &shrinks),
            weights,
            weighted: column_weights.is_some(),
            norm: search.norm(),
        })
    }
}

/// `IntScheme` as the kernels' runtime code.
pub(crate) fn scheme_code(scheme: IntScheme) -> u32 {
    match scheme {
        IntScheme::SymmetricIst => SCHEME_IST,
        IntScheme::SymmetricAbsMax => SCHEME_ABSMAX,
        IntScheme::Asymmetric => SCHEME_ASYM,
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
    e_offset: usize,
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
    /// `f32::INFINITY`, the empty range's bound (WGSL has no infinity literal).
    infinity: f32,
    /// 1 when the group parameters were written before the launch (the clipping search):
    /// they are read at the block start instead of computed at group starts.
    params_given: u32,
}

/// A team of [`TEAM`] units per output row (`UNIT_POS_X` the unit, `UNIT_POS_Y` the row in
/// the cube): the sequential column loop of one block, the row's block columns in
/// registers (unit `l` holds columns `l, l + TEAM, …`).
///
/// Every barrier is reached by every unit of the cube (rows past `out` included: their
/// memory accesses are skipped, not their steps). Shared values are double-buffered by the
/// column's parity: a unit writes column `i + 1`'s while slower units may still read
/// column `i`'s, never column `i − 1`'s (the barrier of column `i` separates them).
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
    #[comptime] slots: usize,
) {
    let lane = UNIT_POS_X as usize;
    let local = UNIT_POS_Y as usize;
    let r = CUBE_POS * rows + local;
    let valid = r < args.out;
    let width = args.width;
    let gs = args.group_size;
    // [parity][row] values of the current column, [parity][row][unit] partial group ranges.
    let mut shared_x = SharedMemory::<f32>::new(2 * rows);
    let mut shared_lo = SharedMemory::<f32>::new(2 * rows * TEAM);
    let mut shared_hi = SharedMemory::<f32>::new(2 * rows * TEAM);
    let mut shared_loss = SharedMemory::<f32>::new(rows * TEAM);

    let mut values = Array::<f32>::new(slots);
    let mut row_codes = Array::<u32>::new(slots);
    #[unroll]
    for s in 0..slots {
        let j = s * TEAM + lane;
        let mut v = 0.0f32;
        if valid && j < width {
            v = w[args.w_offset + r * args.w_stride + args.c0 + j];
        }
        values[s] = v;
        row_codes[s] = 0u32;
    }

    // A block may start inside a group (groups longer than blocks): its parameters were
    // written by the block where the group started.
    let param_row = r * args.groups;
    let mut scale = 1.0f32;
    let mut zero = 0.0f32;
    if valid {
        scale = scales[param_row + args.c0 / gs];
        zero = f32::cast_from(zeros[param_row + args.c0 / gs]);
    }
    let u_row0 = args.u_offset + args.c0 * args.u_stride + args.c0;
    let mut loss = 0.0f32;

    #[unroll]
    for s in 0..slots {
        for l in 0..TEAM {
            let i = s * TEAM + l;
            let parity = i % 2;
            let c = args.c0 + i;
            let starts_group = i < width && c % gs == 0 && args.params_given == 0;
            if starts_group {
                let range = team_partial_range(w, &values, args, r, valid, lane, i, slots);
                let at = (parity * rows + local) * TEAM + lane;
                shared_lo[at] = range.0;
                shared_hi[at] = range.1;
            }
            if lane == l {
                shared_x[parity * rows + local] = values[s];
            }
            sync_cube();
            if i < width {
                if starts_group {
                    let first = (parity * rows + local) * TEAM;
                    let mut lo = shared_lo[first];
                    let mut hi = shared_hi[first];
                    for k in 1..TEAM {
                        let range = widen(lo, hi, shared_lo[first + k]);
                        lo = range.0;
                        let range = widen(lo, hi, shared_hi[first + k]);
                        hi = range.1;
                    }
                    let params = group_params(lo, hi, args.scheme, args.maxq, args.sym_zero);
                    scale = params.0;
                    zero = params.1;
                    if valid && lane == 0 {
                        scales[param_row + c / gs] = scale;
                        zeros[param_row + c / gs] = u32::cast_from(zero);
                    }
                }
                let x = shared_x[parity * rows + local];
                let code = quantize(x, scale, zero, args.maxq);
                let q = (scale * (code - zero)) * args.one;
                let u_row = u_row0 + i * args.u_stride;
                let err = (x - q) / u[u_row + i];
                #[unroll]
                for s2 in 0..slots {
                    let j = s2 * TEAM + lane;
                    if j > i && j < width {
                        values[s2] = values[s2] - (err * u[u_row + j]) * args.one;
                    }
                }
                if lane == l {
                    // Column i is final: its slot keeps the scaled error for the store below.
                    values[s] = err;
                    row_codes[s] = u32::cast_from(code);
                    loss += err * err;
                }
            }
        }
    }

    shared_loss[local * TEAM + lane] = loss;
    sync_cube();
    if valid && lane == 0 {
        let mut total = 0.0f32;
        for k in 0..TEAM {
            total += shared_loss[local * TEAM + k];
        }
        row_loss[r] = row_loss[r] + 0.5 * total;
    }
    #[unroll]
    for s in 0..slots {
        let j = s * TEAM + lane;
        if valid && j < width {
            codes[r * args.inp + args.c0 + j] = row_codes[s];
            e[args.e_offset + r * args.e_stride + j] = values[s];
        }
    }
}

/// This unit's `(min, max)` over the group starting at block column `i`: its own columns of
/// the group inside the block, and every `TEAM`-th column of the group past the block's end
/// (from `W`: those are up to date, since a group that extends past a block starts at its
/// first column). `(+∞, −∞)` when the unit holds none.
#[cube]
#[allow(clippy::too_many_arguments)]
fn team_partial_range(
    w: &Array<f32>,
    values: &Array<f32>,
    args: &GptqBlockArgs,
    r: usize,
    valid: bool,
    lane: usize,
    i: usize,
    #[comptime] slots: usize,
) -> (f32, f32) {
    let mut lo = args.infinity;
    let mut hi = -args.infinity;
    let end = i + args.group_size;
    #[unroll]
    for s in 0..slots {
        let j = s * TEAM + lane;
        if j >= i && j < end && j < args.width {
            let range = widen(lo, hi, values[s]);
            lo = range.0;
            hi = range.1;
        }
    }
    let mut group_end = args.c0 + end;
    if group_end > args.inp {
        group_end = args.inp;
    }
    let mut col = args.c0 + args.width + lane;
    while valid && col < group_end {
        let range = widen(lo, hi, w[args.w_offset + r * args.w_stride + col]);
        lo = range.0;
        hi = range.1;
        col += TEAM;
    }
    (lo, hi)
}

/// `[lo, hi]` widened to contain `v`.
#[cube]
pub(crate) fn widen(lo: f32, hi: f32, v: f32) -> (f32, f32) {
    let mut out_lo = lo;
    let mut out_hi = hi;
    if v < lo {
        out_lo = v;
    }
    if v > hi {
        out_hi = v;
    }
    (out_lo, out_hi)
}

/// The scalars of the clipping-search kernel.
#[derive(CubeLaunch, CubeType)]
struct ClipArgs {
    /// `W`'s window in its buffer.
    w_offset: usize,
    w_stride: usize,
    out: usize,
    /// The group: its first column, its columns and its index.
    c0: usize,
    width: usize,
    group: usize,
    /// Groups per row (the parameters' row stride).
    groups: usize,
    /// The grid (`SCHEME_*`, `2^bits − 1`, `2^(bits−1)`).
    scheme: u32,
    maxq: f32,
    sym_zero: f32,
    candidates: u32,
    /// The error exponent.
    norm: f32,
    /// 1 when `weights` holds column weights.
    weighted: u32,
    /// A runtime 1.0 (see [`GptqBlockArgs`]).
    one: f32,
    infinity: f32,
}

/// `ClipSearch::params` of one group for every row: a team of [`TEAM`] units per row, unit
/// `l` trying the candidates `l, l + TEAM, …` (each a pass over the group's columns, summed
/// in column order), then the team's best: the least error, the first candidate among equal
/// ones (the host keeps the earliest, widest range on ties).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn clip_search_kernel(
    w: &Array<f32>,
    weights: &Array<f32>,
    shrinks: &Array<f32>,
    scales: &mut Array<f32>,
    zeros: &mut Array<u32>,
    args: &ClipArgs,
    #[comptime] rows: usize,
) {
    let lane = UNIT_POS_X as usize;
    let local = UNIT_POS_Y as usize;
    let r = CUBE_POS * rows + local;
    let valid = r < args.out;
    let mut shared_error = SharedMemory::<f32>::new(rows * TEAM);
    let mut shared_index = SharedMemory::<u32>::new(rows * TEAM);
    let row = args.w_offset + r * args.w_stride + args.c0;
    let mut lo = args.infinity;
    let mut hi = -args.infinity;
    if valid {
        for k in 0..args.width {
            let range = widen(lo, hi, w[row + k]);
            lo = range.0;
            hi = range.1;
        }
    }
    let mut best_error = args.infinity;
    let mut best = args.candidates;
    let mut candidate = lane as u32;
    while valid && candidate < args.candidates {
        let shrink = shrinks[candidate as usize];
        let (scale, zero) = group_params(
            lo * shrink,
            hi * shrink,
            args.scheme,
            args.maxq,
            args.sym_zero,
        );
        let mut error = 0.0f32;
        for k in 0..args.width {
            let x = w[row + k];
            let code = quantize(x, scale, zero, args.maxq);
            let diff = (x - (scale * (code - zero)) * args.one).abs();
            let mut term = diff * diff;
            if args.norm != 2.0 {
                term = 0.0;
                if diff > 0.0 {
                    term = diff.powf(args.norm);
                }
            }
            if args.weighted == 1 {
                term = (weights[args.c0 + k] * term) * args.one;
            }
            error += term;
        }
        if error < best_error {
            best_error = error;
            best = candidate;
        }
        candidate += TEAM as u32;
    }
    shared_error[local * TEAM + lane] = best_error;
    shared_index[local * TEAM + lane] = best;
    sync_cube();
    if valid && lane == 0 {
        let (_, mut index) = team_least_error(&shared_error, &shared_index, local * TEAM, TEAM);
        if index >= args.candidates {
            // Every error NaN (the inputs are checked finite before a solve): the plain range.
            index = 0;
        }
        let shrink = shrinks[index as usize];
        let (scale, zero) = group_params(
            lo * shrink,
            hi * shrink,
            args.scheme,
            args.maxq,
            args.sym_zero,
        );
        let at = r * args.groups + args.group;
        scales[at] = scale;
        zeros[at] = u32::cast_from(zero);
    }
}

/// The least of a team's `team` errors in shared memory from `first` on, and its index: the
/// lowest index among equal errors, so that a search whose candidates were dealt to the team
/// round-robin keeps the candidate a sequential loop would (a NaN error never wins).
#[cube]
pub(crate) fn team_least_error(
    errors: &SharedMemory<f32>,
    indices: &SharedMemory<u32>,
    first: usize,
    #[comptime] team: usize,
) -> (f32, u32) {
    let mut error = errors[first];
    let mut index = indices[first];
    for k in 1..team {
        let e = errors[first + k];
        let i = indices[first + k];
        if e < error || (e == error && i < index) {
            error = e;
            index = i;
        }
    }
    (error, index)
}

/// `IntQuantizer::params_from_range`: `(scale, zero)` of a group of range `[lo, hi]` on the
/// grid `scheme` (`SCHEME_*`) with largest code `maxq` and symmetric zero `sym_zero`.
#[cube]
pub(crate) fn group_params(
    lo_in: f32,
    hi_in: f32,
    scheme: u32,
    maxq: f32,
    sym_zero: f32,
) -> (f32, f32) {
    let mut lo = lo_in;
    let mut hi = hi_in;
    if lo > 0.0 {
        lo = 0.0;
    }
    if hi < 0.0 {
        hi = 0.0;
    }
    if scheme == SCHEME_ASYM {
        if lo == 0.0 && hi == 0.0 {
            lo = -1.0;
            hi = 1.0;
        }
        let scale = at_least_min_scale((hi - lo) / maxq);
        (scale, clamp_f32((-lo / scale).round(), 0.0, maxq))
    } else {
        if -lo > hi {
            hi = -lo;
        }
        if hi == 0.0 {
            hi = 1.0;
        }
        let scale = if scheme == SCHEME_IST {
            2.0 * hi / maxq
        } else {
            hi / (sym_zero - 1.0)
        };
        (at_least_min_scale(scale), sym_zero)
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
pub(crate) fn quantize(x: f32, scale: f32, zero: f32, maxq: f32) -> f32 {
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
