//! Causal GQA flash attention on Hopper's warpgroup tensor-core instructions:
//! [`HopperAttention`].
//!
//! Same contract as [`causal_gqa_attention`](crate::attention::causal_gqa_attention) for bf16
//! buffers with a head dimension of [`HOPPER_HEAD_DIM`]. The kernel
//! (`flash_attention_sm90.cu`, beside this file, which describes its tiling) is CUDA C++
//! compiled at run time by NVRTC for `sm_90a`: CubeCL 0.10 emits `mma.sync` but not the
//! warpgroup products (`wgmma.mma_async`), which only exist for compute capability 9.0 with
//! the architecture-specific target. Both products run on `wgmma` (`HGMMA` in the SASS), S
//! and P stay in registers. FlashAttention-3's schedule: a producer warpgroup stages the K/V
//! tiles (the tensor memory accelerator, three deep, `mbarrier`s; K and V are passed as tensor
//! maps, `KvTensorMap`) while two consumer warpgroups take turns on the tensor cores, one's
//! softmax running while the other's products do (and while its own P·V product does). The
//! blocks are persistent, at most one per multiprocessor, and take their units of work (128
//! rows of one KV head, longest first) from a counter after the work list. The output accumulators are rescaled lazily (FlashAttention-4): a row
//! keeps its running maximum until a tile's exceeds it by more than a factor 2⁸, so most turns
//! of a long row skip the rescaling.
//!
//! The kernel runs on a stream of its own: [`HopperAttention::run`] waits for CubeCL's queued
//! work before the launch (its pointer lookups and work list go first, beside that work) and
//! for its stream after, like the cuBLAS wrappers.

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use cubecl::server::Handle;
use cudarc::driver::sys::{
    CUevent_flags, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill,
    CUtensorMapInterleave, CUtensorMapL2promotion, CUtensorMapSwizzle,
};
use cudarc::driver::{CudaFunction, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::CompileOptions;

use super::{
    compile_module, driver_error, guarded, handle_ptr, libs, load_function, require_shared_optin,
    LibStream, PtxOrigin, StreamOrdering,
};
use crate::attention::{check_inputs, AttentionShape};
use crate::error::KernelError;
use crate::flash_attention::work_list;

/// The kernel's source (CUDA C++, no headers).
const SOURCE: &str = include_str!("flash_attention_sm90.cu");

/// The kernel's entry point in [`SOURCE`].
const ENTRY: &str = "sala_flash_attention_sm90";

/// The head dimension the kernel is written for.
pub const HOPPER_HEAD_DIM: usize = 128;

/// Rows (token, query head pairs) per thread block: two consumer warpgroups of 64.
pub const HOPPER_ROWS_PER_BLOCK: usize = 128;

/// Threads per block: two consumer warpgroups and one producer warpgroup.
const THREADS: u32 = 384;

/// Dynamic shared memory per block: the Q tile, three K and three V tiles (128 × 128 bf16
/// each), 128 bytes of `mbarrier`s, and 1024 bytes to align the tiles to the swizzle pattern.
const SHARED_BYTES: u32 = 7 * 128 * 128 * 2 + 128 + 1024;

/// A CUDA tensor map of a K or V buffer, `[tokens, kv_heads, HOPPER_HEAD_DIM]` bf16: what the
/// kernel's tensor-memory-accelerator copies read, by value as a kernel parameter.
#[repr(transparent)]
struct KvTensorMap(CUtensorMap);

// SAFETY: `CUtensorMap` is plain data (128 bytes, 64-byte aligned) that the kernel takes by
// value (`const __grid_constant__ TensorMap`, the same size and alignment).
unsafe impl DeviceRepr for KvTensorMap {}

impl KvTensorMap {
    /// The map of the buffer at device address `address`: three dimensions (head dimension,
    /// KV head, token), boxes of 64 × 1 × 128 elements (a tile half: 128 keys of 128 bytes),
    /// the 128-byte swizzle of the kernel's tiles, zeros read past the end. `what` names the
    /// map in errors.
    fn new(
        address: u64,
        tokens: usize,
        kv_heads: usize,
        what: &'static str,
    ) -> Result<Self, KernelError> {
        let element = size_of::<half::bf16>() as u64;
        let dims = [HOPPER_HEAD_DIM as u64, kv_heads as u64, tokens as u64];
        let strides = [dims[0] * element, dims[0] * dims[1] * element];
        let boxes = [64u32, 1, 128];
        let steps = [1u32; 3];
        let mut map = std::mem::MaybeUninit::<CUtensorMap>::uninit();
        // SAFETY: every pointer is to a live local of the length the call reads (three
        // dimensions, two strides, three box sizes and steps) and `map` is written by it; the
        // driver checks the address's alignment, the sizes and the strides (`check_inputs`
        // checked the buffer against them) and returns an error for what it refuses.
        let result = unsafe {
            cudarc::driver::sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                3,
                address as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                steps.as_ptr(),
                CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        result.result().map_err(|e| driver_error(what, e))?;
        // SAFETY: the call succeeded, so it wrote the map.
        Ok(Self(unsafe { map.assume_init() }))
    }
}

/// The Hopper attention kernel, compiled and loaded on one device.
#[derive(Debug)]
pub struct HopperAttention {
    lib: LibStream,
    function: CudaFunction,
    /// The PTX NVRTC produced, kept to compare builds of the same source.
    ptx: String,
    ptx_origin: PtxOrigin,
    /// The device's multiprocessors: the persistent kernel's largest grid (one block fills one).
    multiprocessors: u32,
}

// SAFETY: the function handle belongs to the module held by the context, which CUDA lets any
// thread use once the context is bound (`run` binds it); launches go to one stream.
unsafe impl Send for HopperAttention {}
// SAFETY: as above; concurrent `run`s serialise on the stream.
unsafe impl Sync for HopperAttention {}

impl HopperAttention {
    /// Compiles the kernel for device `ordinal` (0 for CubeCL's default device) and loads it.
    ///
    /// [`KernelError::Unsupported`] unless the device has compute capability 9.0 (H100,
    /// H200) and the opt-in shared memory the kernel needs; [`KernelError::Launch`] when
    /// NVRTC is missing or the compile or load fails (its log in the message).
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        libs::require("nvrtc", "HopperAttention")?;
        guarded("Hopper attention", || {
            let lib = LibStream::new(ordinal)?;
            lib.bind()?;
            let ctx = lib.context();
            let capability = lib.compute_capability()?;
            if capability != (9, 0) {
                return Err(KernelError::unsupported(
                    "Hopper attention device",
                    format!(
                        "compute capability {}.{} (the kernel is built for sm_90a: 9.0 only)",
                        capability.0, capability.1
                    ),
                ));
            }
            require_shared_optin(ctx, "Hopper attention device", SHARED_BYTES)?;
            let multiprocessors = lib.multiprocessors()?;
            let options = CompileOptions {
                arch: Some("sm_90a"),
                options: vec!["-std=c++17".into()],
                use_fast_math: Some(true),
                name: Some("flash_attention_sm90.cu".into()),
                ..Default::default()
            };
            let loaded = compile_module(ctx, SOURCE, options, "Hopper attention")?;
            let function = load_function(&loaded.module, ENTRY, SHARED_BYTES, "Hopper attention")?;
            Ok(Self {
                lib,
                function,
                ptx: loaded.ptx,
                ptx_origin: loaded.origin,
                multiprocessors,
            })
        })
    }

    /// The same kernel with its stream ordered with CubeCL's by `ordering`
    /// ([`StreamOrdering::HostWaits`] unless set).
    pub fn with_ordering(mut self, ordering: StreamOrdering) -> Self {
        self.lib.set_ordering(ordering);
        self
    }

    /// Whether the kernel computes `shape`: head dimension [`HOPPER_HEAD_DIM`] and a positive
    /// finite scale (the online softmax takes maxima of unscaled scores).
    pub fn supports(shape: &AttentionShape) -> bool {
        shape.head_dim == HOPPER_HEAD_DIM && shape.scale.is_finite() && shape.scale > 0.0
    }

    /// The PTX that NVRTC produced for the kernel and the driver assembled: what another build
    /// of the same source (the harness `bench/flash_sm90.py`, another NVRTC) can be set beside.
    pub fn ptx(&self) -> &str {
        &self.ptx
    }

    /// Whether the kernel's PTX came from the cache or from NVRTC.
    pub fn ptx_origin(&self) -> PtxOrigin {
        self.ptx_origin
    }

    /// `out[t, h, :] = Σ_j softmax_j(scale · q[t, h, :]·k[j, h/group, :]) · v[j, h/group, :]`
    /// over the keys `j ≤ t` of `t`'s sequence, buffers `[q, k, v, out]` bf16 in the layouts and
    /// with the checks of [`causal_gqa_attention`](crate::attention::causal_gqa_attention).
    /// [`KernelError::Unsupported`] for a shape outside [`supports`](Self::supports). Returns
    /// once the output is written, or under [`StreamOrdering::DeviceWaits`] once the kernel is
    /// queued with CubeCL's next work ordered after it.
    ///
    /// K and V must be finite: the last key tile of a sequence also holds the next sequence's
    /// first keys, masked to a probability of exactly 0, which clears finite values only.
    pub fn run(
        &self,
        client: &ComputeClient<CudaRuntime>,
        shape: &AttentionShape,
        offsets: &[usize],
        buffers: [&Handle; 4],
    ) -> Result<(), KernelError> {
        self.launch(client, shape, offsets, buffers, None, false)
            .map(drop)
    }

    /// [`run`](Self::run) with the output gated in the kernel's epilogue, as the model's
    /// sigmoid output gate: `out = bf16(bf16(o) · bf16(σ(g)))` for `o` the attention output
    /// and `g` the element of `gate` (bf16, `[tokens, heads, head_dim]` like `out`), the
    /// roundings and the f32 formula of [`gates::sigmoid_gate`](crate::gates::sigmoid_gate):
    /// one pass over the output instead of two.
    pub fn run_gated(
        &self,
        client: &ComputeClient<CudaRuntime>,
        shape: &AttentionShape,
        offsets: &[usize],
        buffers: [&Handle; 4],
        gate: &Handle,
    ) -> Result<(), KernelError> {
        self.launch(client, shape, offsets, buffers, Some(gate), false)
            .map(drop)
    }

    /// [`run`](Self::run), and the kernel's own time in seconds, measured by CUDA events
    /// recorded on the kernel's stream just before and after the launch: without the wait for
    /// CubeCL's queue, the work list's upload and the host's synchronisation that `run`'s wall
    /// clock holds. `0.0` when there is no work.
    pub fn run_timed(
        &self,
        client: &ComputeClient<CudaRuntime>,
        shape: &AttentionShape,
        offsets: &[usize],
        buffers: [&Handle; 4],
    ) -> Result<f64, KernelError> {
        self.launch(client, shape, offsets, buffers, None, true)
            .map(|seconds| seconds.unwrap_or(0.0))
    }

    /// The launch behind [`run`](Self::run) and, with a `gate`, [`run_gated`](Self::run_gated);
    /// with `timed`, the kernel's seconds by events.
    fn launch(
        &self,
        client: &ComputeClient<CudaRuntime>,
        shape: &AttentionShape,
        offsets: &[usize],
        [q, k, v, out]: [&Handle; 4],
        gate: Option<&Handle>,
        timed: bool,
    ) -> Result<Option<f64>, KernelError> {
        check_inputs(shape, offsets, size_of::<half::bf16>(), [q, k, v, out])?;
        if let Some(gate) = gate {
            // As large as the output: `check_inputs` bounded the product.
            let tokens = offsets.last().copied().unwrap_or(0);
            let needed = tokens * shape.heads * shape.head_dim * size_of::<half::bf16>();
            if (gate.size_in_used() as usize) < needed {
                return Err(KernelError::shape(
                    "Hopper attention gate",
                    format!(
                        "{} bytes for {tokens} tokens × {} heads × {} bf16",
                        gate.size_in_used(),
                        shape.heads,
                        shape.head_dim
                    ),
                ));
            }
        }
        if !Self::supports(shape) {
            return Err(KernelError::unsupported(
                "Hopper attention shape",
                format!(
                    "head_dim {} and scale {} (needs head_dim {HOPPER_HEAD_DIM} and a positive scale)",
                    shape.head_dim, shape.scale
                ),
            ));
        }
        let mut work = work_list(offsets, shape.group(), HOPPER_ROWS_PER_BLOCK);
        let items = work.len() / 3;
        if items == 0 {
            return Ok(None);
        }
        // The kernel is persistent: block b takes unit (item, KV head) b, then the next one of
        // a counter, so one block per multiprocessor covers them all. The counter is the word
        // after the work list, zero at each launch.
        work.push(0);
        let units = items
            .checked_mul(shape.kv_heads)
            .and_then(|b| u32::try_from(b).ok())
            .filter(|&b| b <= i32::MAX as u32)
            .ok_or_else(|| {
                KernelError::unsupported(
                    "Hopper attention grid",
                    format!("{items} work items × {} KV heads", shape.kv_heads),
                )
            })?;
        // Persistent blocks, one per multiprocessor left to this kernel.
        let blocks = units.min(
            self.lib
                .ordering()
                .kernel_multiprocessors(self.multiprocessors),
        );
        // `check_inputs` bounded the token count by 32-bit indexing: these fit.
        let (items, heads, kv_heads) = (items as u32, shape.heads as u32, shape.kv_heads as u32);
        let scale_log2 = shape.scale * std::f32::consts::LOG2_E;
        // The pointer lookups (round trips to CubeCL's device thread) and the work list's
        // upload (on this stream) do not depend on CubeCL's queued work: done first, they
        // overlap it, and only the launch waits for it.
        self.lib.bind()?;
        let (q, out) = (handle_ptr(client, q)?, handle_ptr(client, out)?);
        let tokens = offsets.last().copied().unwrap_or(0);
        let k = KvTensorMap::new(
            handle_ptr(client, k)?,
            tokens,
            shape.kv_heads,
            "Hopper attention (K's tensor map)",
        )?;
        let v = KvTensorMap::new(
            handle_ptr(client, v)?,
            tokens,
            shape.kv_heads,
            "Hopper attention (V's tensor map)",
        )?;
        // A null pointer: no gate.
        let gate = gate
            .map(|g| handle_ptr(client, g))
            .transpose()?
            .unwrap_or(0);
        guarded("Hopper attention (launch)", || {
            let stream = self.lib.stream();
            let work = stream
                .clone_htod(&work)
                .map_err(|e| driver_error("Hopper attention (work list)", e))?;
            let next_unit = {
                let (list, _sync) = work.device_ptr(stream);
                list + 3 * u64::from(items) * size_of::<u32>() as u64
            };
            self.lib.after_cubecl(client)?;
            let config = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: SHARED_BYTES,
            };
            let mut launch = stream.launch_builder(&self.function);
            launch
                .arg(&q)
                .arg(&k)
                .arg(&v)
                .arg(&out)
                .arg(&gate)
                .arg(&work)
                .arg(&next_unit)
                .arg(&items)
                .arg(&heads)
                .arg(&kv_heads)
                .arg(&scale_log2);
            let event = |what| {
                timed
                    .then(|| stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)))
                    .transpose()
                    .map_err(|e| driver_error(what, e))
            };
            let start = event("Hopper attention (start event)")?;
            // SAFETY: the arguments match the kernel's signature (q's pointer, K's and V's tensor
            // maps, out's pointer, the gate's pointer or null, the work list, its counter word,
            // three u32 and an f32); every index it forms stays inside its buffer (the tensor
            // copies check theirs against the maps' sizes): `check_inputs` checked the buffers
            // against the shape and the offsets (and the gate was checked to be as large as
            // the output),
            // the work list was built from those offsets (rows past a sequence are clamped to
            // its last token and never stored, keys past it read its last key), and a block
            // only takes units below `items · kv_heads`.
            unsafe { launch.launch(config) }
                .map_err(|e| driver_error("Hopper attention (launch)", e))?;
            let end = event("Hopper attention (end event)")?;
            // The events are read on the host: a timed run waits for its kernel whatever the
            // ordering.
            if timed {
                self.lib.synchronize("Hopper attention")?;
            } else {
                self.lib.before_cubecl(client, "Hopper attention")?;
            }
            match (start, end) {
                (Some(start), Some(end)) => start
                    .elapsed_ms(&end)
                    .map(|ms| Some(f64::from(ms) / 1e3))
                    .map_err(|e| driver_error("Hopper attention (event time)", e)),
                _ => Ok(None),
            }
        })
    }
}
