//! Fused elementwise steps of a transformer layer, each one kernel over tensors stored in `S`
//! (bf16 on the GPU path, f32 where there is no rounding), with the arithmetic in f32 and a
//! rounding to `S` at exactly the points where an unfused chain of bf16 tensor ops rounds:
//!
//! - [`swiglu`]: `out = S(S(g · S(σ(g))) · u)` — SiLU of the gate times the up projection;
//! - [`sigmoid_gate`]: `out = S(x · S(σ(g)))` — an output gated by the sigmoid of a projection;
//! - [`rms_norm`]: `out = S(S(x / √(mean(x²) + ε)) · w)` per row;
//! - [`rms_norm_gate`]: that norm then [`sigmoid_gate`], in one pass;
//! - [`scaled_residual`]: `out = S(h + S(m · scale))` — a residual add of a scaled branch;
//! - [`rms_norm_rope`]: the per-head RMSNorm of [`rms_norm`], then the rotary embedding
//!   (NeoX rotate-half) `S(y·cos + rotate_half(y)·sin)` at each token's position.
//!
//! Over a 2-byte storage type (bf16, f16) with rows of whole 16-byte vectors, every kernel
//! moves 16-byte vectors: a unit loading 2 bytes at a time keeps too few bytes in flight to
//! reach the memory's bandwidth. The norms then sum their squares in another order than the
//! scalar kernels (whole vectors per unit), which can move `rms` by the last f32 bit.
//!
//! `σ(g)` is computed as `exp(−ln(1 + exp(−g)))`, the sequence of f32 operations of the Burn
//! graph's sigmoid (a log-sigmoid then an exponential), so that the fused result matches it
//! operation for operation. Unfused, each gate costs six to nine passes over memory (the
//! SwiGLU of a 16384-token pack at intermediate size 16384 took 4.3 ms on an H200); fused, it
//! reads its inputs and writes its output once.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::error::{flush, KernelError};
use crate::launch::{check_addressable, elementwise};

/// `out[i] = S(S(gate[i] · S(σ(gate[i]))) · up[i])` for `i < len`: the SwiGLU activation of
/// a gated MLP, rounded where the unfused bf16 chain rounds (module docs). `gate`, `up` and
/// `out` are dense buffers of at least `len` elements of `S` (`out` must not alias them).
/// Queued and flushed, not awaited.
pub fn swiglu<R: Runtime, S: Float + CubeElement>(
    client: &ComputeClient<R>,
    gate: &Handle,
    up: &Handle,
    out: &Handle,
    len: usize,
) -> Result<(), KernelError> {
    check_buffers::<S>("swiglu", len, [gate, up, out])?;
    if len == 0 {
        return Ok(());
    }
    if let Some(vectors) = vector_count::<S>(len, [gate, up, out]) {
        let (count, dim) = elementwise(client, vectors)?;
        // SAFETY: `check_buffers` made sure every buffer holds `len = 8 · vectors` elements
        // and the kernel reads and writes vector `i < vectors` only.
        unsafe {
            swiglu_v8_kernel::launch_unchecked::<S, R>(
                client,
                count,
                dim,
                vectors_of::<R>(gate, vectors),
                vectors_of::<R>(up, vectors),
                vectors_of::<R>(out, vectors),
                vectors,
            )
        };
    } else {
        let (count, dim) = elementwise(client, len)?;
        swiglu_kernel::launch::<S, R>(
            client,
            count,
            dim,
            typed::<R>(gate, len),
            typed::<R>(up, len),
            typed::<R>(out, len),
            len,
        );
    }
    flush(client, "swiglu")
}

/// `out[i] = S(x[i] · S(σ(gate[i])))` for `i < len`: `x` gated by the sigmoid of `gate`,
/// rounded where the unfused bf16 chain rounds (module docs). Buffers as in [`swiglu`].
pub fn sigmoid_gate<R: Runtime, S: Float + CubeElement>(
    client: &ComputeClient<R>,
    x: &Handle,
    gate: &Handle,
    out: &Handle,
    len: usize,
) -> Result<(), KernelError> {
    check_buffers::<S>("sigmoid gate", len, [x, gate, out])?;
    if len == 0 {
        return Ok(());
    }
    if let Some(vectors) = vector_count::<S>(len, [x, gate, out]) {
        let (count, dim) = elementwise(client, vectors)?;
        // SAFETY: as in `swiglu`.
        unsafe {
            sigmoid_gate_v8_kernel::launch_unchecked::<S, R>(
                client,
                count,
                dim,
                vectors_of::<R>(x, vectors),
                vectors_of::<R>(gate, vectors),
                vectors_of::<R>(out, vectors),
                vectors,
            )
        };
    } else {
        let (count, dim) = elementwise(client, len)?;
        sigmoid_gate_kernel::launch::<S, R>(
            client,
            count,
            dim,
            typed::<R>(x, len),
            typed::<R>(gate, len),
            typed::<R>(out, len),
            len,
        );
    }
    flush(client, "sigmoid gate")
}

/// Errors unless every buffer holds `len` elements of `S` and `len` fits 32-bit indexing.
fn check_buffers<S>(
    what: &'static str,
    len: usize,
    buffers: [&Handle; 3],
) -> Result<(), KernelError> {
    check_addressable(what, len)?;
    for handle in buffers {
        let bytes = handle.size_in_used() as usize;
        if bytes < len * size_of::<S>() {
            return Err(KernelError::shape(
                what,
                format!(
                    "a buffer of {bytes} bytes for {len} elements of {} bytes",
                    size_of::<S>()
                ),
            ));
        }
    }
    Ok(())
}

/// The first `len` elements of a buffer of `S` as a kernel argument (checked by the caller).
fn typed<R: Runtime>(handle: &Handle, len: usize) -> ArrayArg<R> {
    // SAFETY: `check_buffers` made sure the buffer holds `len` elements.
    unsafe { ArrayArg::from_raw_parts(handle.clone(), len) }
}

/// Elements per unit of the vectorized elementwise kernels: one 16-byte vector of a 2-byte
/// storage type. A unit moving 2 bytes per load keeps too few bytes in flight to reach the
/// memory's bandwidth (the scalar SwiGLU ran at 1.5 TB/s on an H200).
const VECTOR: usize = 8;

/// One vector of [`VECTOR`] elements of `S`.
type Vec8<S> = Vector<S, Const<8>>;

/// The number of 16-byte vectors covering `len` elements of `S`, when the vectorized kernels
/// apply: a 2-byte `S`, `len` a multiple of [`VECTOR`] and every buffer starting on a
/// 16-byte boundary. `None` selects the scalar kernels.
fn vector_count<S>(len: usize, buffers: [&Handle; 3]) -> Option<usize> {
    let aligned = buffers
        .iter()
        .all(|h| h.offset_start.unwrap_or(0) % (VECTOR * 2) as u64 == 0);
    (size_of::<S>() == 2 && len % VECTOR == 0 && aligned).then_some(len / VECTOR)
}

/// The first `vectors` 16-byte vectors of a buffer as a kernel argument (checked by the
/// caller through [`check_buffers`] and [`vector_count`]).
fn vectors_of<R: Runtime>(handle: &Handle, vectors: usize) -> ArrayArg<R> {
    // SAFETY: the buffer holds `VECTOR · vectors` elements of its 2-byte type.
    unsafe { ArrayArg::from_raw_parts(handle.clone(), vectors) }
}

/// `σ(g)` in f32 as the graph computes it: `exp(−ln(1 + exp(−g)))`.
#[cube]
fn sigmoid(g: f32) -> f32 {
    let log_sigmoid = -(1.0f32 + (-g).exp()).ln();
    log_sigmoid.exp()
}

/// `x` rounded to `S` and back to f32 (the identity when `S` is f32).
#[cube]
fn round<S: Float>(x: f32) -> f32 {
    f32::cast_from(S::cast_from(x))
}

/// One SwiGLU element: `S(S(g · S(σ(g))) · u)`.
#[cube]
fn swiglu_element<S: Float>(gate: S, up: S) -> S {
    let g = f32::cast_from(gate);
    let silu = round::<S>(g * round::<S>(sigmoid(g)));
    S::cast_from(silu * f32::cast_from(up))
}

/// One gated element: `S(x · S(σ(g)))`.
#[cube]
fn sigmoid_gate_element<S: Float>(x: S, gate: S) -> S {
    let s = round::<S>(sigmoid(f32::cast_from(gate)));
    S::cast_from(f32::cast_from(x) * s)
}

/// One residual element: `S(h + S(m · scale))`.
#[cube]
fn scaled_residual_element<S: Float>(h: S, m: S, scale: f32) -> S {
    let branch = round::<S>(f32::cast_from(m) * scale);
    S::cast_from(f32::cast_from(h) + branch)
}

/// One unit per element.
#[cube(launch)]
fn swiglu_kernel<S: Float>(gate: &Array<S>, up: &Array<S>, out: &mut Array<S>, len: usize) {
    let i = ABSOLUTE_POS;
    if i < len {
        out[i] = swiglu_element::<S>(gate[i], up[i]);
    }
}

/// One unit per 16-byte vector.
#[cube(launch_unchecked)]
fn swiglu_v8_kernel<S: Float>(
    gate: &Array<Vec8<S>>,
    up: &Array<Vec8<S>>,
    out: &mut Array<Vec8<S>>,
    vectors: usize,
) {
    let i = ABSOLUTE_POS;
    if i < vectors {
        let (g, u) = (gate[i], up[i]);
        let mut o = Vec8::<S>::empty();
        #[unroll]
        for e in 0..VECTOR {
            o[e] = swiglu_element::<S>(g[e], u[e]);
        }
        out[i] = o;
    }
}

/// One unit per element.
#[cube(launch)]
fn sigmoid_gate_kernel<S: Float>(x: &Array<S>, gate: &Array<S>, out: &mut Array<S>, len: usize) {
    let i = ABSOLUTE_POS;
    if i < len {
        out[i] = sigmoid_gate_element::<S>(x[i], gate[i]);
    }
}

/// One unit per 16-byte vector.
#[cube(launch_unchecked)]
fn sigmoid_gate_v8_kernel<S: Float>(
    x: &Array<Vec8<S>>,
    gate: &Array<Vec8<S>>,
    out: &mut Array<Vec8<S>>,
    vectors: usize,
) {
    let i = ABSOLUTE_POS;
    if i < vectors {
        let (xv, g) = (x[i], gate[i]);
        let mut o = Vec8::<S>::empty();
        #[unroll]
        for e in 0..VECTOR {
            o[e] = sigmoid_gate_element::<S>(xv[e], g[e]);
        }
        out[i] = o;
    }
}

/// Units per cube of [`rms_norm`] (one cube per row; a power of two).
const NORM_UNITS: usize = 256;

/// RMSNorm of each row of `x` `[rows, cols]`: `out = S(S(x / √(mean(x²) + eps)) · w)` with
/// `w` `[cols]`, the statistics and the division in f32 (the graph's `rms_norm` under bf16
/// storage; the sum of squares is a tree sum, so it may differ from the graph's in the last
/// f32 bits). Dense buffers of `S`; `out` must not alias `x`. A 2-byte `S` with `cols` a
/// multiple of 8 and 16-byte aligned buffers takes the 16-byte-vector kernel.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm<R: Runtime, S: Float + CubeElement>(
    client: &ComputeClient<R>,
    x: &Handle,
    weight: &Handle,
    out: &Handle,
    rows: usize,
    cols: usize,
    eps: f32,
) -> Result<(), KernelError> {
    norm_launch::<R, S>(client, [x, weight, out], None, rows, cols, eps)
}

/// [`rms_norm`] then [`sigmoid_gate`] in one pass: `out = S(n · S(σ(g)))` with `n` the
/// RMSNorm of `x`'s row (rounded to `S` as [`rms_norm`] writes it) and `g` the element of
/// `gate` `[rows, cols]` (the lightning layers' `o_norm` times `sigmoid(z_proj)`). Buffers as
/// in [`rms_norm`]; `out` must not alias `x` or `gate`.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_gate<R: Runtime, S: Float + CubeElement>(
    client: &ComputeClient<R>,
    x: &Handle,
    weight: &Handle,
    gate: &Handle,
    out: &Handle,
    rows: usize,
    cols: usize,
    eps: f32,
) -> Result<(), KernelError> {
    norm_launch::<R, S>(client, [x, weight, out], Some(gate), rows, cols, eps)
}

/// The launch behind [`rms_norm`] and, with a `gate`, [`rms_norm_gate`].
fn norm_launch<R: Runtime, S: Float + CubeElement>(
    client: &ComputeClient<R>,
    [x, weight, out]: [&Handle; 3],
    gate: Option<&Handle>,
    rows: usize,
    cols: usize,
    eps: f32,
) -> Result<(), KernelError> {
    let what = if gate.is_some() {
        "rms norm gate"
    } else {
        "rms norm"
    };
    let len = rows
        .checked_mul(cols)
        .ok_or_else(|| KernelError::unsupported(what, format!("{rows} × {cols} overflows")))?;
    // Without a gate the kernels take `x` in its place and never read it as one.
    let gated = gate.is_some();
    let gate = gate.unwrap_or(x);
    check_buffers::<S>(what, len, [x, gate, out])?;
    check_buffers::<S>("rms norm weight", cols, [weight, weight, weight])?;
    if !eps.is_finite() || eps < 0.0 {
        return Err(KernelError::unsupported("rms norm eps", format!("{eps}")));
    }
    if len == 0 {
        return Ok(());
    }
    let units = NORM_UNITS.min(client.properties().hardware.max_units_per_cube as usize);
    let units = 1 << units.ilog2();
    let count = crate::launch::cube_count(client, rows)?;
    let row_vectors = cols / VECTOR;
    if cols % VECTOR == 0
        && vector_count::<S>(len, [x, weight, out]).is_some()
        && vector_count::<S>(len, [gate, gate, gate]).is_some()
    {
        // Fewer units than vectors in a row, so that each unit keeps two or more 16-byte
        // loads in flight.
        let units = units.min((row_vectors / 2).max(1).next_power_of_two());
        // SAFETY: `check_buffers` made sure `x` and `out` hold `rows · cols` elements and
        // `weight` `cols`, all multiples of 8 starting on 16-byte boundaries; the kernel
        // reads and writes vectors of row `r < rows` (and of `weight`) only.
        unsafe {
            rms_norm_v8_kernel::launch_unchecked::<S, R>(
                client,
                count,
                CubeDim::new_1d(units as u32),
                vectors_of::<R>(x, rows * row_vectors),
                vectors_of::<R>(weight, row_vectors),
                vectors_of::<R>(gate, rows * row_vectors),
                vectors_of::<R>(out, rows * row_vectors),
                rows,
                row_vectors,
                cols,
                eps,
                gated,
            )
        };
        return flush(client, what);
    }
    rms_norm_kernel::launch::<S, R>(
        client,
        count,
        CubeDim::new_1d(units as u32),
        typed::<R>(x, len),
        typed::<R>(weight, cols),
        typed::<R>(gate, len),
        typed::<R>(out, len),
        rows,
        cols,
        eps,
        units,
        gated,
    );
    flush(client, what)
}

/// `out[i] = S(h[i] + S(m[i] · scale))` for `i < len`: a residual add of a scaled branch
/// output, rounded where the graph rounds (`round(h + round(f32(m) · scale))`). Buffers as in
/// [`swiglu`].
pub fn scaled_residual<R: Runtime, S: Float + CubeElement>(
    client: &ComputeClient<R>,
    h: &Handle,
    m: &Handle,
    out: &Handle,
    len: usize,
    scale: f32,
) -> Result<(), KernelError> {
    check_buffers::<S>("scaled residual", len, [h, m, out])?;
    if len == 0 {
        return Ok(());
    }
    if let Some(vectors) = vector_count::<S>(len, [h, m, out]) {
        let (count, dim) = elementwise(client, vectors)?;
        // SAFETY: as in `swiglu`.
        unsafe {
            scaled_residual_v8_kernel::launch_unchecked::<S, R>(
                client,
                count,
                dim,
                vectors_of::<R>(h, vectors),
                vectors_of::<R>(m, vectors),
                vectors_of::<R>(out, vectors),
                vectors,
                scale,
            )
        };
    } else {
        let (count, dim) = elementwise(client, len)?;
        scaled_residual_kernel::launch::<S, R>(
            client,
            count,
            dim,
            typed::<R>(h, len),
            typed::<R>(m, len),
            typed::<R>(out, len),
            len,
            scale,
        );
    }
    flush(client, "scaled residual")
}

/// Rows (heads) per cube of [`rms_norm_rope`]'s scalar kernel, and units per row.
const ROPE_ROWS_PER_CUBE: usize = 8;
const ROPE_UNITS_PER_ROW: usize = 32;

/// Units per cube of [`rms_norm_rope`]'s 16-byte-vector kernel: `head_dim / 16` per row (one
/// vector of each half of the head), so 32 rows per cube at a head dimension of 128.
const ROPE_V8_UNITS: usize = 256;

/// The problem of [`rms_norm_rope`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormRopeShape {
    /// Tokens of the pack.
    pub tokens: usize,
    /// Heads per token.
    pub heads: usize,
    /// Elements per head: a multiple of 64 up to 256 (each unit holds whole rotate-half pairs).
    pub head_dim: usize,
    /// Rows of the `cos` and `sin` tables (positions they cover).
    pub positions: usize,
    /// The RMSNorm's ε (finite, `≥ 0`).
    pub eps: f32,
}

/// Per-head RMSNorm then rotary embedding, one kernel: for each token `t` and head `h` of `x`
/// `[tokens, heads, head_dim]`, `y = S(S(x / √(mean(x²) + eps)) · w)` as [`rms_norm`] with `w`
/// `[head_dim]`, then `out = S(y·cos[p] + rotate_half(y)·sin[p])` in f32 with
/// `rotate_half(y) = [−y[d/2..], y[..d/2]]` and `p = positions[t]` (the token's position in
/// its sequence) indexing the f32 tables `cos`, `sin` `[positions, head_dim]`. `x`, `w`, `out`
/// are dense buffers of `S` (`out` must not alias `x`), `positions` of `u32`. A 2-byte `S`
/// with `head_dim` 64, 128 or 256 and 16-byte aligned buffers takes the 16-byte-vector
/// kernel.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_rope<R: Runtime, S: Float + CubeElement>(
    client: &ComputeClient<R>,
    shape: &NormRopeShape,
    x: &Handle,
    weight: &Handle,
    cos: &Handle,
    sin: &Handle,
    positions: &Handle,
    out: &Handle,
) -> Result<(), KernelError> {
    let d = shape.head_dim;
    if d == 0 || d % 64 != 0 || d > 256 {
        return Err(KernelError::unsupported(
            "rms norm rope head_dim",
            format!("{d} (a multiple of 64 up to 256)"),
        ));
    }
    if !shape.eps.is_finite() || shape.eps < 0.0 {
        return Err(KernelError::unsupported(
            "rms norm rope eps",
            format!("{}", shape.eps),
        ));
    }
    let rows = shape.tokens.checked_mul(shape.heads).ok_or_else(|| {
        KernelError::unsupported("rms norm rope", "tokens × heads overflows".to_string())
    })?;
    let len = rows.checked_mul(d).ok_or_else(|| {
        KernelError::unsupported(
            "rms norm rope",
            "tokens × heads × head_dim overflows".to_string(),
        )
    })?;
    let table = shape.positions.checked_mul(d).ok_or_else(|| {
        KernelError::unsupported(
            "rms norm rope",
            "positions × head_dim overflows".to_string(),
        )
    })?;
    check_buffers::<S>("rms norm rope", len, [x, out, out])?;
    check_buffers::<S>("rms norm rope weight", d, [weight, weight, weight])?;
    check_buffers::<f32>("rms norm rope tables", table, [cos, sin, sin])?;
    check_buffers::<u32>(
        "rms norm rope positions",
        shape.tokens,
        [positions, positions, positions],
    )?;
    if len == 0 {
        return Ok(());
    }
    if shape.positions == 0 {
        return Err(KernelError::shape("rms norm rope tables", "no positions"));
    }
    let row_units = d / (2 * VECTOR);
    if row_units.is_power_of_two() && vector_count::<S>(len, [x, weight, out]).is_some() {
        let count = crate::launch::cube_count(client, rows.div_ceil(ROPE_V8_UNITS / row_units))?;
        // SAFETY: `check_buffers` made sure `x` and `out` hold `rows · d` elements, `weight`
        // `d`, all multiples of 8 starting on 16-byte boundaries, the tables `positions · d`
        // f32 and `positions` a `u32` per token; the kernel reads and writes the vectors of
        // row `r < rows` only (an idle unit reads the last row) and clamps table rows.
        unsafe {
            rms_norm_rope_v8_kernel::launch_unchecked::<S, R>(
                client,
                count,
                CubeDim::new_1d(ROPE_V8_UNITS as u32),
                vectors_of::<R>(x, len / VECTOR),
                vectors_of::<R>(weight, d / VECTOR),
                typed::<R>(cos, table),
                typed::<R>(sin, table),
                typed::<R>(positions, shape.tokens),
                vectors_of::<R>(out, len / VECTOR),
                rows,
                shape.heads,
                shape.positions,
                shape.eps,
                d,
            )
        };
        return flush(client, "rms norm rope");
    }
    let count = crate::launch::cube_count(client, rows.div_ceil(ROPE_ROWS_PER_CUBE))?;
    rms_norm_rope_kernel::launch::<S, R>(
        client,
        count,
        CubeDim::new_1d((ROPE_ROWS_PER_CUBE * ROPE_UNITS_PER_ROW) as u32),
        typed::<R>(x, len),
        typed::<R>(weight, d),
        typed::<R>(cos, table),
        typed::<R>(sin, table),
        typed::<R>(positions, shape.tokens),
        typed::<R>(out, len),
        rows,
        shape.heads,
        shape.positions,
        shape.eps,
        d,
    );
    flush(client, "rms norm rope")
}

/// One normed element `S(S(x / rms) · w)`, gated by `g` (`S(n · S(σ(g)))`) when `gated`.
#[cube]
fn normed_element<S: Float>(x: S, rms: f32, w: S, g: S, #[comptime] gated: bool) -> S {
    let normed = round::<S>(f32::cast_from(x) / rms);
    let n = S::cast_from(normed * f32::cast_from(w));
    if gated {
        sigmoid_gate_element::<S>(n, g)
    } else {
        n
    }
}

/// One cube of `units` units per row: the sum of squares strided over the units, a tree sum
/// in shared memory, then each unit writes its columns (gated by `gate` when `gated`).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_kernel<S: Float>(
    x: &Array<S>,
    weight: &Array<S>,
    gate: &Array<S>,
    out: &mut Array<S>,
    rows: usize,
    cols: usize,
    eps: f32,
    #[comptime] units: usize,
    #[comptime] gated: bool,
) {
    let row = CUBE_POS;
    if row < rows {
        let u = UNIT_POS as usize;
        let base = row * cols;
        let mut acc = 0.0f32;
        let mut c = u;
        while c < cols {
            let v = f32::cast_from(x[base + c]);
            acc += v * v;
            c += units;
        }
        let rms = (cube_sum(acc) / f32::cast_from(cols) + eps).sqrt();
        let mut c = u;
        while c < cols {
            let at = base + c;
            out[at] = normed_element::<S>(x[at], rms, weight[c], gate[at], gated);
            c += units;
        }
    }
}

/// [`rms_norm_kernel`] on 16-byte vectors: the same statistics, each unit summing the squares
/// of whole vectors (so the f32 sum is added in another order).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_v8_kernel<S: Float>(
    x: &Array<Vec8<S>>,
    weight: &Array<Vec8<S>>,
    gate: &Array<Vec8<S>>,
    out: &mut Array<Vec8<S>>,
    rows: usize,
    row_vectors: usize,
    cols: usize,
    eps: f32,
    #[comptime] gated: bool,
) {
    let row = CUBE_POS;
    if row < rows {
        let u = UNIT_POS as usize;
        let units = CUBE_DIM as usize;
        let base = row * row_vectors;
        let mut acc = 0.0f32;
        let mut c = u;
        while c < row_vectors {
            let v = x[base + c];
            #[unroll]
            for e in 0..VECTOR {
                let f = f32::cast_from(v[e]);
                acc += f * f;
            }
            c += units;
        }
        let rms = (cube_sum(acc) / f32::cast_from(cols) + eps).sqrt();
        let mut c = u;
        while c < row_vectors {
            let (v, w) = (x[base + c], weight[c]);
            // Without a gate, `gate` is `x` and this load is never used.
            let g = if gated { gate[base + c] } else { v };
            let mut o = Vec8::<S>::empty();
            #[unroll]
            for e in 0..VECTOR {
                o[e] = normed_element::<S>(v[e], rms, w[e], g[e], gated);
            }
            out[base + c] = o;
            c += units;
        }
    }
}

/// The sum of `value` over the cube's units (a power of two of them, at most 1024), the
/// same in every unit: a tree in shared memory.
#[cube]
fn cube_sum(value: f32) -> f32 {
    let u = UNIT_POS as usize;
    let mut partial = SharedMemory::<f32>::new(1024usize);
    partial[u] = value;
    sync_cube();
    // `CUBE_DIM` at run time: the halving loop mutates it.
    let mut stride = CUBE_DIM as usize / 2;
    while stride > 0 {
        if u < stride {
            partial[u] += partial[u + stride];
        }
        sync_cube();
        stride /= 2;
    }
    partial[0]
}

/// One unit per element.
#[cube(launch)]
fn scaled_residual_kernel<S: Float>(
    h: &Array<S>,
    m: &Array<S>,
    out: &mut Array<S>,
    len: usize,
    scale: f32,
) {
    let i = ABSOLUTE_POS;
    if i < len {
        out[i] = scaled_residual_element::<S>(h[i], m[i], scale);
    }
}

/// One unit per 16-byte vector.
#[cube(launch_unchecked)]
fn scaled_residual_v8_kernel<S: Float>(
    h: &Array<Vec8<S>>,
    m: &Array<Vec8<S>>,
    out: &mut Array<Vec8<S>>,
    vectors: usize,
    scale: f32,
) {
    let i = ABSOLUTE_POS;
    if i < vectors {
        let (hv, mv) = (h[i], m[i]);
        let mut o = Vec8::<S>::empty();
        #[unroll]
        for e in 0..VECTOR {
            o[e] = scaled_residual_element::<S>(hv[e], mv[e], scale);
        }
        out[i] = o;
    }
}

/// 32 units per row (head), 8 rows per cube: unit `l` of a row holds elements `l + 32k`, so
/// it owns whole rotate-half pairs (`e`, `e + d/2`); the sum of squares is a tree over the
/// row's 32 units in shared memory. Positions past the tables are clamped to the last row
/// (the caller's tables cover every position; the clamp only keeps reads in bounds).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_rope_kernel<S: Float>(
    x: &Array<S>,
    weight: &Array<S>,
    cos: &Array<f32>,
    sin: &Array<f32>,
    positions: &Array<u32>,
    out: &mut Array<S>,
    rows: usize,
    heads: usize,
    table_rows: usize,
    eps: f32,
    #[comptime] d: usize,
) {
    let u = UNIT_POS as usize;
    let lane = u % ROPE_UNITS_PER_ROW;
    let local = u / ROPE_UNITS_PER_ROW;
    let mut row = CUBE_POS * ROPE_ROWS_PER_CUBE + local;
    let valid = row < rows;
    if !valid {
        row = rows - 1;
    }
    let base = row * d;
    let mut acc = 0.0f32;
    #[unroll]
    for k in 0..comptime!(d / ROPE_UNITS_PER_ROW) {
        let v = f32::cast_from(x[base + lane + k * ROPE_UNITS_PER_ROW]);
        acc += v * v;
    }
    let mut partial = SharedMemory::<f32>::new(comptime!(ROPE_ROWS_PER_CUBE * ROPE_UNITS_PER_ROW));
    partial[u] = acc;
    sync_cube();
    #[unroll]
    for step in 0..5u32 {
        let stride = comptime!(16usize >> step);
        if lane < stride {
            partial[u] += partial[u + stride];
        }
        sync_cube();
    }
    let rms = (partial[local * ROPE_UNITS_PER_ROW] / f32::cast_from(d) + eps).sqrt();
    let mut p = positions[row / heads] as usize;
    if p >= table_rows {
        p = table_rows - 1;
    }
    let t = p * d;
    if valid {
        #[unroll]
        for k in 0..comptime!(d / ROPE_UNITS_PER_ROW / 2) {
            let e1 = lane + k * ROPE_UNITS_PER_ROW;
            let e2 = e1 + comptime!(d / 2);
            let y1 = round::<S>(
                round::<S>(f32::cast_from(x[base + e1]) / rms) * f32::cast_from(weight[e1]),
            );
            let y2 = round::<S>(
                round::<S>(f32::cast_from(x[base + e2]) / rms) * f32::cast_from(weight[e2]),
            );
            out[base + e1] = S::cast_from(y1 * cos[t + e1] + (-y2) * sin[t + e1]);
            out[base + e2] = S::cast_from(y2 * cos[t + e2] + y1 * sin[t + e2]);
        }
    }
}

/// [`rms_norm_rope_kernel`] on 16-byte vectors, for a 2-byte `S` and `d / 16` a power of two:
/// `d / 16` units per row, unit `j` holding vector `j` of the head's first half and vector `j`
/// of its second (the rotate-half pairs), the sum of squares a tree over the row's units.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_rope_v8_kernel<S: Float>(
    x: &Array<Vec8<S>>,
    weight: &Array<Vec8<S>>,
    cos: &Array<f32>,
    sin: &Array<f32>,
    positions: &Array<u32>,
    out: &mut Array<Vec8<S>>,
    rows: usize,
    heads: usize,
    table_rows: usize,
    eps: f32,
    #[comptime] d: usize,
) {
    let row_units = comptime!(d / (2 * VECTOR));
    let u = UNIT_POS as usize;
    let lane = u % row_units;
    let local = u / row_units;
    let mut row = CUBE_POS * comptime!(ROPE_V8_UNITS / row_units) + local;
    let valid = row < rows;
    if !valid {
        row = rows - 1;
    }
    let first = row * comptime!(d / VECTOR) + lane;
    let second = first + row_units;
    let (a, b) = (x[first], x[second]);
    let mut acc = 0.0f32;
    #[unroll]
    for e in 0..VECTOR {
        let (fa, fb) = (f32::cast_from(a[e]), f32::cast_from(b[e]));
        acc += fa * fa + fb * fb;
    }
    let mut partial = SharedMemory::<f32>::new(ROPE_V8_UNITS);
    partial[u] = acc;
    sync_cube();
    #[unroll]
    for step in 0..comptime!(row_units.trailing_zeros()) {
        let stride = comptime!((row_units >> 1) >> step);
        if lane < stride {
            partial[u] += partial[u + stride];
        }
        sync_cube();
    }
    let rms = (partial[local * row_units] / f32::cast_from(d) + eps).sqrt();
    let mut p = positions[row / heads] as usize;
    if p >= table_rows {
        p = table_rows - 1;
    }
    if valid {
        let (wa, wb) = (weight[lane], weight[lane + row_units]);
        let mut oa = Vec8::<S>::empty();
        let mut ob = Vec8::<S>::empty();
        #[unroll]
        for e in 0..VECTOR {
            let e1 = p * d + lane * VECTOR + e;
            let e2 = e1 + comptime!(d / 2);
            let y1 = round::<S>(round::<S>(f32::cast_from(a[e]) / rms) * f32::cast_from(wa[e]));
            let y2 = round::<S>(round::<S>(f32::cast_from(b[e]) / rms) * f32::cast_from(wb[e]));
            oa[e] = S::cast_from(y1 * cos[e1] + (-y2) * sin[e1]);
            ob[e] = S::cast_from(y2 * cos[e2] + y1 * sin[e2]);
        }
        out[first] = oa;
        out[second] = ob;
    }
}
