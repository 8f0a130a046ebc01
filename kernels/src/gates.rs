//! Fused elementwise gates of a transformer layer, each one kernel over tensors stored in `S`
//! (bf16 on the GPU path, f32 where there is no rounding), with the arithmetic in f32 and a
//! rounding to `S` at exactly the points where an unfused chain of bf16 tensor ops rounds:
//!
//! - [`swiglu`]: `out = S(S(g · S(σ(g))) · u)` — SiLU of the gate times the up projection;
//! - [`sigmoid_gate`]: `out = S(x · S(σ(g)))` — an output gated by the sigmoid of a projection.
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
