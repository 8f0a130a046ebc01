//! Ordering between CubeCL's stream and a library's stream kept on the device, so that the
//! host does not wait at every library call.
//!
//! A library call ([`Cublas`](super::Cublas)'s products, [`HopperAttention`](super::HopperAttention),
//! [`MmaGla`](super::MmaGla)) reads what CubeCL's kernels wrote and writes what CubeCL's next
//! kernels read. By default ([`StreamOrdering::HostWaits`]) the host waits twice per call: for
//! CubeCL's queued work before it, for the library's stream after it. The GPU idles through
//! both round trips, and the host cannot queue ahead.
//!
//! With [`StreamOrdering::DeviceWaits`] a [`DeviceFence`] keeps the same order on the device,
//! through two 32-bit counters in one CubeCL buffer:
//!
//! - *library after CubeCL*: CubeCL queues a one-thread kernel that stores ticket `a` into the
//!   first counter, and the library's stream runs a one-thread kernel (`sala_fence_wait`,
//!   `stream_fence.cu`) that polls it until it reads at least `a` before its work;
//! - *CubeCL after library*: the library's stream runs a one-thread kernel
//!   (`sala_fence_write`) that writes ticket `b` into the second counter after its work (a
//!   release store: the work's stores are visible first), and CubeCL queues a one-thread
//!   kernel that polls it until it reads at least `b` (an atomic load, which reads past the
//!   caches) before its next kernels.
//!
//! The library's half is NVRTC kernels, not the driver's stream memory operations
//! (`cuStreamWaitValue32`, `cuStreamWriteValue32`): on the first GPU that ran this fence (an
//! H100, driver 580) the driver refused to wait on CubeCL's buffer (CUDA_ERROR_INVALID_VALUE).
//!
//! Tickets only grow, and each counter has one writer in stream order (each host thread has a
//! fence of its own, as CubeCL gives it a stream of its own), so a wait never passes early.
//! Each wait is submitted after the work it waits for (the signal kernel is flushed to the GPU
//! before the library's waiting kernel is launched), so two streams that share a hardware
//! queue, where the later submission runs after the earlier, cannot hold each other up.
//! Buffers need nothing more: CubeCL reuses a freed buffer only for work queued on its
//! stream, which now runs after the library's.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::Mutex;
use std::thread::ThreadId;

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Handle;
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::CompileOptions;

use super::{
    compile_module, driver_error, guarded, handle_ptr, libs, load_function, sync_client, LibStream,
};
use crate::device::array_arg;
use crate::error::{flush, KernelError};

/// CUDA C++ of the library stream's half of the fence.
const SOURCE: &str = include_str!("stream_fence.cu");

/// How a library's stream is ordered with CubeCL's around each call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StreamOrdering {
    /// The host waits for CubeCL's queued work before the call and for the library's stream
    /// after it (the call's results are complete when it returns).
    #[default]
    HostWaits,
    /// The streams wait for each other on the device (a counter each way, polled by a
    /// one-thread kernel on the waiting stream) and the call returns once its work is queued:
    /// CubeCL's next kernels still run after it, but a reader outside CubeCL's stream must
    /// wait for CubeCL first. The library's kernels leave one multiprocessor to the polling
    /// kernel.
    DeviceWaits,
}

impl StreamOrdering {
    /// The multiprocessors a library kernel may fill out of the device's `all`: every one, less
    /// the one CubeCL's polling kernel takes while the device waits (a kernel sized to every
    /// multiprocessor, with a block that cannot sit beside the polling kernel, would run that
    /// block after the others). At least one.
    pub(crate) fn kernel_multiprocessors(self, all: u32) -> u32 {
        let reserved = match self {
            StreamOrdering::DeviceWaits => 1,
            StreamOrdering::HostWaits => 0,
        };
        all.saturating_sub(reserved).max(1)
    }
}

/// The library stream's two fence kernels (`stream_fence.cu`), loaded on its context.
#[derive(Debug)]
struct LibraryKernels {
    /// `sala_fence_wait(counter, ticket)`: returns once the counter reaches the ticket.
    wait: CudaFunction,
    /// `sala_fence_write(counter, ticket)`: stores the ticket after the stream's earlier work.
    write: CudaFunction,
}

impl LibraryKernels {
    /// Compiles the kernels (or reads their PTX from the cache beside CubeCL's) and loads them
    /// on `lib`'s context. [`KernelError::Launch`] where NVRTC is missing or the compile or
    /// load fails.
    fn load(lib: &LibStream) -> Result<Self, KernelError> {
        libs::require("nvrtc", "device fence")?;
        guarded("device fence", || {
            lib.bind()?;
            let options = CompileOptions {
                arch: Some("compute_80"),
                name: Some("stream_fence.cu".into()),
                ..Default::default()
            };
            let loaded = compile_module(lib.context(), SOURCE, options, "device fence")?;
            let function = |name| load_function(&loaded.module, name, 0, "device fence");
            Ok(Self {
                wait: function("sala_fence_wait")?,
                write: function("sala_fence_write")?,
            })
        })
    }

    /// Queues `function(counter, ticket)` on one thread of `lib`'s stream.
    fn launch(
        lib: &LibStream,
        function: &CudaFunction,
        counter: u64,
        ticket: u32,
        what: &'static str,
    ) -> Result<(), KernelError> {
        lib.bind()?;
        let mut launch = lib.stream().launch_builder(function);
        launch.arg(&counter).arg(&ticket);
        let one_thread = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: both kernels take (u32 pointer, u32) and touch only that word, a live word
        // of the fence's `counters`, which the fence holds for as long as the stream may use it.
        unsafe { launch.launch(one_thread) }
            .map(|_| ())
            .map_err(|e| driver_error(what, e))
    }
}

/// The two counters of a library stream's device-side ordering with CubeCL, and the tickets
/// last handed out. See the module's documentation.
#[derive(Debug)]
pub(crate) struct DeviceFence {
    /// `[CubeCL's ticket, the library's ticket]`, u32 each (4 words: room for the element
    /// size CubeCL's arrays are checked with).
    counters: Handle,
    /// Device address of the first counter (CubeCL writes, the library's stream waits).
    cubecl_counter: u64,
    /// Device address of the second counter (the library's stream writes, CubeCL waits).
    library_counter: u64,
    /// The last tickets queued: `(CubeCL's, the library's)`.
    tickets: (u32, u32),
}

impl DeviceFence {
    /// Two zeroed counters on CubeCL's device, settled before the first wait reads them.
    /// Every kernel runs once first (ticket 0, which every wait passes) and the host waits
    /// for both streams, so that one that cannot compile or launch fails here instead of
    /// leaving a stream waiting for it.
    fn new(
        client: &ComputeClient<CudaRuntime>,
        lib: &LibStream,
        kernels: &LibraryKernels,
    ) -> Result<Self, KernelError> {
        let counters = client.create_from_slice(bytemuck::cast_slice(&[0u32; 4]));
        launch_signal(client, &counters, 0);
        launch_await(client, &counters, 0);
        sync_client(client)?;
        let base = handle_ptr(client, &counters)?;
        let (cubecl_counter, library_counter) = (base, base + 4);
        LibraryKernels::launch(lib, &kernels.wait, cubecl_counter, 0, "device fence (wait)")?;
        LibraryKernels::launch(
            lib,
            &kernels.write,
            library_counter,
            0,
            "device fence (write)",
        )?;
        lib.synchronize("device fence (first run)")?;
        Ok(Self {
            counters,
            cubecl_counter,
            library_counter,
            tickets: (0, 0),
        })
    }

    /// Queues CubeCL's next ticket and makes `lib`'s stream wait for it: `lib`'s next work
    /// runs after CubeCL's work queued so far.
    fn library_after_cubecl(
        &mut self,
        client: &ComputeClient<CudaRuntime>,
        lib: &LibStream,
        kernels: &LibraryKernels,
    ) -> Result<(), KernelError> {
        let ticket = self.tickets.0.wrapping_add(1);
        launch_signal(client, &self.counters, ticket);
        // CubeCL launches from its own thread: the flush returns once the signal is submitted
        // (and reports a launch that failed). Submitted before the waiting kernel, it cannot
        // queue behind it where the two streams share a hardware queue; every wait here is
        // submitted after what it waits for.
        flush(client, "the device fence's signal")?;
        self.tickets.0 = ticket;
        LibraryKernels::launch(
            lib,
            &kernels.wait,
            self.cubecl_counter,
            ticket,
            "device fence (library after CubeCL)",
        )
    }

    /// Writes the library's next ticket after `lib`'s queued work and makes CubeCL's next
    /// kernels wait for it. Where the write cannot be queued, the host waits for `lib`'s
    /// stream instead and the error is returned.
    fn cubecl_after_library(
        &mut self,
        client: &ComputeClient<CudaRuntime>,
        lib: &LibStream,
        kernels: &LibraryKernels,
        what: &'static str,
    ) -> Result<(), KernelError> {
        let ticket = self.tickets.1.wrapping_add(1);
        let written = LibraryKernels::launch(
            lib,
            &kernels.write,
            self.library_counter,
            ticket,
            "device fence (CubeCL after library)",
        );
        if let Err(e) = written {
            // Nothing was queued that CubeCL could wait for: the host orders this call.
            lib.synchronize(what)?;
            return Err(e);
        }
        self.tickets.1 = ticket;
        launch_await(client, &self.counters, ticket);
        Ok(())
    }
}

/// The fences of one library stream, and its fence kernels once loaded.
#[derive(Debug, Default)]
struct Fences {
    /// Loaded with the first fence.
    kernels: Option<LibraryKernels>,
    /// One fence per host thread: CubeCL queues each thread's work on a stream of its own,
    /// and a counter must have one writer in stream order.
    by_thread: HashMap<ThreadId, DeviceFence>,
}

/// A library stream's ordering with CubeCL: the mode and, under
/// [`StreamOrdering::DeviceWaits`], the fences made at their first use.
#[derive(Debug, Default)]
pub(crate) struct Ordering {
    mode: StreamOrdering,
    fences: Mutex<Fences>,
}

impl Ordering {
    /// Host waits ([`StreamOrdering::HostWaits`]) or device waits.
    pub(crate) fn new(mode: StreamOrdering) -> Self {
        Self {
            mode,
            fences: Mutex::new(Fences::default()),
        }
    }

    /// The mode this ordering was made with.
    pub(crate) fn mode(&self) -> StreamOrdering {
        self.mode
    }

    /// Orders `lib`'s next work after CubeCL's queued work on the calling thread.
    pub(crate) fn library_after_cubecl(
        &self,
        client: &ComputeClient<CudaRuntime>,
        lib: &LibStream,
    ) -> Result<(), KernelError> {
        let on_device = self.on_device(client, lib, |fence, kernels| {
            fence.library_after_cubecl(client, lib, kernels)
        })?;
        if !on_device {
            sync_client(client)?;
        }
        Ok(())
    }

    /// Orders CubeCL's next work on the calling thread after `lib`'s queued work; `what`
    /// names the call in an error.
    pub(crate) fn cubecl_after_library(
        &self,
        client: &ComputeClient<CudaRuntime>,
        lib: &LibStream,
        what: &'static str,
    ) -> Result<(), KernelError> {
        let on_device = self.on_device(client, lib, |fence, kernels| {
            fence.cubecl_after_library(client, lib, kernels, what)
        })?;
        if !on_device {
            lib.synchronize(what)?;
        }
        Ok(())
    }

    /// Runs `order` on the calling thread's fence (made at its first call, the kernels at the
    /// first fence's) where the device waits, and says whether it did; `false` where the host
    /// waits.
    fn on_device(
        &self,
        client: &ComputeClient<CudaRuntime>,
        lib: &LibStream,
        order: impl FnOnce(&mut DeviceFence, &LibraryKernels) -> Result<(), KernelError>,
    ) -> Result<bool, KernelError> {
        if self.mode == StreamOrdering::HostWaits {
            return Ok(false);
        }
        let mut fences = self
            .fences
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let Fences { kernels, by_thread } = &mut *fences;
        let kernels = match kernels {
            Some(kernels) => kernels,
            None => kernels.insert(LibraryKernels::load(lib)?),
        };
        let fence = match by_thread.entry(std::thread::current().id()) {
            Entry::Occupied(entry) => entry.into_mut(),
            Entry::Vacant(entry) => entry.insert(DeviceFence::new(client, lib, kernels)?),
        };
        order(fence, kernels)?;
        Ok(true)
    }
}

/// A counter kernel's launch function (`signal_kernel::launch` or `await_kernel::launch`).
type CounterLaunch =
    fn(&ComputeClient<CudaRuntime>, CubeCount, CubeDim, ArrayArg<CudaRuntime>, u32);

/// Queues a counter kernel on one unit with `ticket` on the calling thread's CubeCL stream.
fn launch_one_unit(
    launch: CounterLaunch,
    client: &ComputeClient<CudaRuntime>,
    counters: &Handle,
    ticket: u32,
) {
    launch(
        client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(1),
        array_arg(counters),
        ticket,
    );
}

/// Queues [`signal_kernel`] with `ticket`.
fn launch_signal(client: &ComputeClient<CudaRuntime>, counters: &Handle, ticket: u32) {
    launch_one_unit(
        signal_kernel::launch::<CudaRuntime>,
        client,
        counters,
        ticket,
    );
}

/// Queues [`await_kernel`] with `ticket`.
fn launch_await(client: &ComputeClient<CudaRuntime>, counters: &Handle, ticket: u32) {
    launch_one_unit(
        await_kernel::launch::<CudaRuntime>,
        client,
        counters,
        ticket,
    );
}

/// `counters[0] ← ticket` (one unit).
#[cube(launch)]
fn signal_kernel(counters: &mut Array<Atomic<u32>>, ticket: u32) {
    if ABSOLUTE_POS == 0 {
        counters[0].store(ticket);
    }
}

/// Returns once `counters[1]` holds at least `ticket` (one unit, polling with atomic loads;
/// the difference is read as signed, as `sala_fence_wait` reads it, so tickets may wrap).
#[cube(launch)]
fn await_kernel(counters: &mut Array<Atomic<u32>>, ticket: u32) {
    if ABSOLUTE_POS == 0 {
        loop {
            // u32 arithmetic wraps on the device.
            let ahead = counters[1].load() - ticket;
            if ahead < 0x8000_0000u32 {
                break;
            }
        }
    }
}
