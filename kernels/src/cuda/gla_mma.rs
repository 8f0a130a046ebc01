//! Chunked Simple GLA on `mma.sync` with its fragments in registers: [`MmaGla`].
//!
//! Same contract, work lists, segment states and decay tables as
//! [`simple_gla_bf16`](crate::gla::simple_gla_bf16), the CubeCL kernel. That kernel is written
//! on CubeCL's cooperative matrices, whose fragments are opaque: its scores, `P`, products
//! and state go through shared memory between four barriers per chunk, 255 registers and
//! 187 KiB of shared memory hold one cube per multiprocessor, and it runs latency-bound at
//! 12.5 % occupancy (`bench/results/gla-ncu-h100.json`). This kernel (`gla_mma.cu`, beside
//! this file, which describes its tiling) is CUDA C++ compiled at run time by NVRTC: each
//! warp keeps its slice of the f32 state, its scores, `P` and its output in registers
//! (`ldmatrix` and `mma.m16n8k16` with known layouts), two barriers per chunk, two blocks per
//! multiprocessor.
//!
//! It runs on a stream of its own: [`MmaGla::run`] waits for CubeCL's queued work before its
//! launches and for its stream after, like the cuBLAS wrappers.

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use cubecl::server::Handle;
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::CompileOptions;

use super::{
    compile_module, driver_error, guarded, handle_ptr, libs, load_function, require_shared_optin,
    LibStream, PtxOrigin, StreamOrdering,
};
use crate::error::KernelError;
use crate::gla::{GlaPlan, GlaShape, GlaTiling, GLA_CHUNK, GLA_HEAD_DIMS, GLA_SEGMENT};

/// The kernels' source (CUDA C++, no headers).
const SOURCE: &str = include_str!("gla_mma.cu");

/// Threads per block: four warps.
const THREADS: u32 = 128;

/// Value columns per block (`VBLOCK` in the source).
const VALUE_BLOCK: usize = 64;

/// Dynamic shared memory of a block for head dimension `d`: the chunk's `q` and `k` rows
/// (`d + 8` bf16 each), its value block (72 bf16 per row), the state's bf16 halves
/// (`[d, 72]` each) and the chunk's decay powers (f32).
fn shared_bytes(d: usize) -> u32 {
    let ldv = VALUE_BLOCK + 8;
    let bf16s = 2 * GLA_CHUNK * (d + 8) + GLA_CHUNK * ldv + 2 * d * ldv;
    (2 * bf16s + 4 * (GLA_CHUNK + 1)) as u32
}

/// The launches of one head dimension: the segment states', then the outputs'.
#[derive(Debug)]
struct Entries {
    head_dim: usize,
    states: CudaFunction,
    outputs: CudaFunction,
}

/// The kernel, compiled and loaded on one device.
#[derive(Debug)]
pub struct MmaGla {
    lib: LibStream,
    entries: Vec<Entries>,
    ptx_origin: PtxOrigin,
}

// SAFETY: the function handles belong to the module held by the context, which CUDA lets any
// thread use once the context is bound (`run` binds it); launches go to one stream.
unsafe impl Send for MmaGla {}
// SAFETY: as above; concurrent `run`s serialise on the stream.
unsafe impl Sync for MmaGla {}

impl MmaGla {
    /// Compiles the kernel (PTX for compute capability 8.0, which the driver assembles for the
    /// device) and loads it on device `ordinal` (0 for CubeCL's default device).
    ///
    /// [`KernelError::Unsupported`] below compute capability 8.0 (no bf16 `mma.sync`) or where
    /// a block cannot have the shared memory it needs; [`KernelError::Launch`] when NVRTC is
    /// missing or the compile or load fails (its log in the message).
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        libs::require("nvrtc", "MmaGla")?;
        guarded("mma GLA", || {
            let lib = LibStream::new(ordinal)?;
            lib.bind()?;
            let ctx = lib.context();
            let capability = lib.compute_capability()?;
            if capability < (8, 0) {
                return Err(KernelError::unsupported(
                    "mma GLA device",
                    format!(
                        "compute capability {}.{} (bf16 mma.sync needs 8.0)",
                        capability.0, capability.1
                    ),
                ));
            }
            let needed = GLA_HEAD_DIMS.iter().map(|&d| shared_bytes(d)).max();
            require_shared_optin(ctx, "mma GLA device", needed.unwrap_or(0))?;
            let options = CompileOptions {
                arch: Some("compute_80"),
                options: vec!["-std=c++17".into()],
                name: Some("gla_mma.cu".into()),
                ..Default::default()
            };
            let loaded = compile_module(ctx, SOURCE, options, "mma GLA")?;
            let function = |name: &str, d: usize| {
                load_function(&loaded.module, name, shared_bytes(d), "mma GLA")
            };
            let entries = GLA_HEAD_DIMS
                .iter()
                .map(|&d| {
                    Ok(Entries {
                        head_dim: d,
                        states: function(&format!("sala_gla_states_d{d}"), d)?,
                        outputs: function(&format!("sala_gla_outputs_d{d}"), d)?,
                    })
                })
                .collect::<Result<_, KernelError>>()?;
            Ok(Self {
                lib,
                entries,
                ptx_origin: loaded.origin,
            })
        })
    }

    /// The same kernels with their stream ordered with CubeCL's by `ordering`
    /// ([`StreamOrdering::HostWaits`] unless set).
    pub fn with_ordering(mut self, ordering: StreamOrdering) -> Self {
        self.lib.set_ordering(ordering);
        self
    }

    /// Whether the kernel's PTX came from the cache or from NVRTC.
    pub fn ptx_origin(&self) -> PtxOrigin {
        self.ptx_origin
    }

    /// Whether the kernel computes `shape`'s head dimension ([`GLA_HEAD_DIMS`]).
    pub fn supports(shape: &GlaShape) -> bool {
        GLA_HEAD_DIMS.contains(&shape.head_dim)
    }

    /// [`simple_gla_bf16`](crate::gla::simple_gla_bf16) on this kernel: `out[t, h, :] =
    /// scale · q[t, h, :] S_t` over the sequences of `offsets`, buffers `[q, k, v, out]` bf16
    /// `[tokens, heads, head_dim]`, with the same checks and errors. Returns once the output is
    /// written, or under [`StreamOrdering::DeviceWaits`] once the kernels are queued with
    /// CubeCL's next work ordered after them.
    pub fn run(
        &self,
        client: &ComputeClient<CudaRuntime>,
        shape: &GlaShape,
        offsets: &[usize],
        log_decays: &[f64],
        buffers: [&Handle; 4],
    ) -> Result<GlaTiling, KernelError> {
        self.run_in_segments(client, shape, offsets, log_decays, GLA_SEGMENT, buffers)
    }

    /// [`run`](Self::run) with sequences cut into segments of `segment` tokens (a positive
    /// multiple of [`GLA_CHUNK`]), as
    /// [`simple_gla_bf16_in_segments`](crate::gla::simple_gla_bf16_in_segments).
    pub fn run_in_segments(
        &self,
        client: &ComputeClient<CudaRuntime>,
        shape: &GlaShape,
        offsets: &[usize],
        log_decays: &[f64],
        segment: usize,
        [q, k, v, out]: [&Handle; 4],
    ) -> Result<GlaTiling, KernelError> {
        let plan = GlaPlan::new(shape, offsets, log_decays, segment, [q, k, v, out])?;
        let entries = self
            .entries
            .iter()
            .find(|e| e.head_dim == shape.head_dim)
            .ok_or_else(|| {
                KernelError::unsupported(
                    "mma GLA head_dim",
                    format!("{} (supported: {GLA_HEAD_DIMS:?})", shape.head_dim),
                )
            })?;
        let grid = |cubes: usize| {
            u32::try_from(cubes)
                .ok()
                .filter(|&c| c <= i32::MAX as u32)
                .ok_or_else(|| KernelError::unsupported("mma GLA grid", format!("{cubes} blocks")))
        };
        let (state_blocks, output_blocks) =
            (grid(plan.tiling.state_cubes)?, grid(plan.tiling.cubes)?);
        // `GlaPlan` bounded the heads by 32-bit indexing (tokens · heads · d).
        let heads = shape.heads as u32;
        // The pointer lookups and the tables' uploads do not depend on CubeCL's queued work:
        // done first, they overlap it, and only the launches wait for it.
        self.lib.bind()?;
        let (q, k) = (handle_ptr(client, q)?, handle_ptr(client, k)?);
        let (v, out) = (handle_ptr(client, v)?, handle_ptr(client, out)?);
        guarded("mma GLA (launch)", || {
            let stream = self.lib.stream();
            let upload = |values: &[f32]| {
                stream
                    .clone_htod(values)
                    .map_err(|e| driver_error("mma GLA (tables)", e))
            };
            let (powers, segment_decays) = (upload(&plan.powers)?, upload(&plan.segment_decays)?);
            // Each state slot is written whole by the first launch before the second reads it.
            // SAFETY: plain f32 storage, fully written before it is read (above).
            let states = unsafe { stream.alloc::<f32>(plan.state_values) }
                .map_err(|e| driver_error("mma GLA (segment states)", e))?;
            let launches = [
                (&plan.segments.states, state_blocks, &entries.states),
                (&plan.segments.outputs, output_blocks, &entries.outputs),
            ];
            self.lib.after_cubecl(client)?;
            for (work, blocks, function) in launches {
                if blocks == 0 {
                    continue;
                }
                let work = stream
                    .clone_htod(work)
                    .map_err(|e| driver_error("mma GLA (work list)", e))?;
                let config = LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: shared_bytes(shape.head_dim),
                };
                let mut launch = stream.launch_builder(function);
                launch
                    .arg(&q)
                    .arg(&k)
                    .arg(&v)
                    .arg(&out)
                    .arg(&states)
                    .arg(&powers)
                    .arg(&segment_decays)
                    .arg(&work)
                    .arg(&heads)
                    .arg(&blocks)
                    .arg(&shape.scale);
                // SAFETY: the arguments match the kernel's signature (four bf16 pointers, the
                // f32 states and tables, the work list, two u32 and an f32); `GlaPlan` checked
                // the buffers against the shape and the offsets, the work lists were built from
                // those offsets (rows past a sequence are zero-filled, never read from memory,
                // and never stored), the state slots number the state launch's items, and the
                // grid is the launch's block count.
                unsafe { launch.launch(config) }
                    .map_err(|e| driver_error("mma GLA (launch)", e))?;
            }
            self.lib.before_cubecl(client, "mma GLA")?;
            Ok(GlaTiling {
                shared_bytes: shared_bytes(shape.head_dim) as usize,
                ..plan.tiling
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_blocks_fit_a_hopper_multiprocessor() {
        // 228 KiB per multiprocessor on Hopper (227 KiB per block), 164 KiB on the A100.
        assert_eq!(shared_bytes(128), 81_156);
        assert!(2 * shared_bytes(128) <= 164 * 1024);
        assert!(shared_bytes(64) < shared_bytes(128));
    }
}
