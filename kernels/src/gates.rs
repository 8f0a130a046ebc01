//! Fused elementwise steps of a transformer layer, each one kernel over tensors stored in `S`
//! (bf16 on the GPU path, f32 where there is no rounding), with the arithmetic in f32 and a
//! rounding to `S` at exactly the points where an unfused chain of bf16 tensor ops rounds:
//!
//! - [`swiglu`]: `out = S(S(g · S(σ(g))) · u)` — SiLU of the gate times the up projection;
//! - [`sigmoid_gate`]: `out = S(x · S(σ(g)))` — an output gated by the sigmoid of a projection;
//! - [`rms_norm`]: `out = S(S(x / √(mean(x²) + ε)) · w)` per row;
//! - [`scaled_residual`]: `out = S(h + S(m · scale))` — a residual add of a scaled branch.
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

/// One unit per element.
#[cube(launch)]
fn swiglu_kernel<S: Float>(gate: &Array<S>, up: &Array<S>, out: &mut Array<S>, len: usize) {
    let i = ABSOLUTE_POS;
    if i < len {
        let g = f32::cast_from(gate[i]);
        let silu = round::<S>(g * round::<S>(sigmoid(g)));
        out[i] = S::cast_from(silu * f32::cast_from(up[i]));
    }
}

/// One unit per element.
#[cube(launch)]
fn sigmoid_gate_kernel<S: Float>(x: &Array<S>, gate: &Array<S>, out: &mut Array<S>, len: usize) {
    let i = ABSOLUTE_POS;
    if i < len {
        let s = round::<S>(sigmoid(f32::cast_from(gate[i])));
        out[i] = S::cast_from(f32::cast_from(x[i]) * s);
    }
}

/// Units per cube of [`rms_norm`] (one cube per row; a power of two).
const NORM_UNITS: usize = 256;

/// RMSNorm of each row of `x` `[rows, cols]`: `out = S(S(x / √(mean(x²) + eps)) · w)` with
/// `w` `[cols]`, the statistics and the division in f32 (the graph's `rms_norm` under bf16
/// storage; the sum of squares is a tree sum, so it may differ from the graph's in the last
/// f32 bits). Dense buffers of `S`; `out` must not alias `x`.
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
    let len = rows.checked_mul(cols).ok_or_else(|| {
        KernelError::unsupported("rms norm", format!("{rows} × {cols} overflows"))
    })?;
    check_buffers::<S>("rms norm", len, [x, out, out])?;
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
    rms_norm_kernel::launch::<S, R>(
        client,
        count,
        CubeDim::new_1d(units as u32),
        typed::<R>(x, len),
        typed::<R>(weight, cols),
        typed::<R>(out, len),
        rows,
        cols,
        eps,
        units,
    );
    flush(client, "rms norm")
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
    flush(client, "scaled residual")
}

/// One cube of `units` units per row: the sum of squares strided over the units, a tree sum
/// in shared memory, then each unit writes its columns.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_kernel<S: Float>(
    x: &Array<S>,
    weight: &Array<S>,
    out: &mut Array<S>,
    rows: usize,
    cols: usize,
    eps: f32,
    #[comptime] units: usize,
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
        let mut partial = SharedMemory::<f32>::new(units);
        partial[u] = acc;
        sync_cube();
        // `CUBE_DIM` (= `units`) at run time: the halving loop mutates it.
        let mut stride = CUBE_DIM as usize / 2;
        while stride > 0 {
            if u < stride {
                partial[u] += partial[u + stride];
            }
            sync_cube();
            stride /= 2;
        }
        let rms = (partial[0] / f32::cast_from(cols) + eps).sqrt();
        let mut c = u;
        while c < cols {
            let normed = round::<S>(f32::cast_from(x[base + c]) / rms);
            out[base + c] = S::cast_from(normed * f32::cast_from(weight[c]));
            c += units;
        }
    }
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
        let branch = round::<S>(f32::cast_from(m[i]) * scale);
        out[i] = S::cast_from(f32::cast_from(h[i]) + branch);
    }
}
