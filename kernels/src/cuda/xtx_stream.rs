//! Hessian products on a stream of their own, so that they run beside the forward pass that
//! produces their inputs instead of after it.
//!
//! [`xtx_runs_bf16`](super::xtx_runs_bf16) waits for its products before it returns: the
//! forward's next kernels start only once the Hessian is done, and the tensor cores idle
//! through the forward's memory-bound steps (norms, gates, the GLA scan, host syncs). An
//! [`XtxStream`] queues the same products, in the same order, on its own cuBLAS stream and
//! returns at once, holding the input's buffer until they are done. Products into one
//! Hessian keep their order (one stream), so the sums are the same bit for bit.
//!
//! The products write the blocks on and below the diagonal only. The copies that fill the
//! blocks above (about 1 GB read and written for a 16384-wide Hessian) run once per Hessian,
//! when it is read ([`XtxStream::wait_for`], [`XtxStream::settle`]), instead of once per
//! product: a layer's Hessian sums a hundred packs or more.
//!
//! What the caller must keep: a Hessian queued here is read by CubeCL only after
//! [`XtxStream::wait_for`] on its buffer or [`XtxStream::settle`], and written only after
//! those or [`XtxStream::wait_for_products`]. The inputs need nothing: the stream holds their
//! buffers until its products are done, and a Hessian's buffer until it is mirrored.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use cubecl::server::{Binding, Handle};
use cudarc::driver::CudaEvent;

use super::blas::{queue_xtx_mirrors, queue_xtx_runs, XtxTarget};
use super::{driver_error, Bf16Matrix, Cublas, StreamOrdering, XtxRun};
use crate::device::MatrixView;
use crate::error::KernelError;
use crate::hessian::XtxBlocking;

/// Bytes of inputs the products in flight may hold beyond their use by the forward, by
/// default: a 16384-row chunk of a 16384-wide MLP input (512 MiB, the largest tap of a pack of
/// the full-size model) plus the next pack's 4096-wide attention input (128 MiB), so that the
/// largest product runs beside the next pack's attention block. A memory plan counts it.
pub const XTX_IN_FLIGHT_BYTES: u64 = 640 << 20;

/// Queued `h ← h + Σ_r w_r X_rᵀX_r` products ([`xtx_runs_bf16`](super::xtx_runs_bf16)'s) on a
/// cuBLAS stream of their own.
#[derive(Debug)]
pub struct XtxStream {
    blas: Cublas,
    limit: u64,
    /// The blocks the products write and the mirrors copy: one value serves both, so that the
    /// mirrors fill exactly the blocks the products leave.
    blocking: XtxBlocking,
    queued: Mutex<Queued>,
}

/// What the stream has queued and not yet seen done, and the Hessians still to mirror.
#[derive(Default)]
struct Queued {
    in_flight: VecDeque<InFlight>,
    unmirrored: Vec<Unmirrored>,
    /// The client of the last products queued: the one their mirrors are ordered with.
    client: Option<ComputeClient<CudaRuntime>>,
}

impl std::fmt::Debug for Queued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queued")
            .field("in_flight", &self.in_flight)
            .field("unmirrored", &self.unmirrored)
            .finish_non_exhaustive()
    }
}

/// One queued call (products or mirrors): done when `done` completes; holds the buffers it
/// reads and writes until then.
#[derive(Debug)]
struct InFlight {
    done: CudaEvent,
    /// The device addresses of the Hessians it writes.
    hessians: Vec<u64>,
    /// A product's input buffer and its Hessian's: neither may be freed (and reused by
    /// CubeCL), nor written in place by CubeCL, while the product reads or writes it.
    _buffers: Vec<Handle>,
    /// The Hessians a mirror writes (their buffers held).
    _mirrored: Vec<Unmirrored>,
    /// Bytes of the input's buffer (0 for mirrors).
    bytes: u64,
}

/// A Hessian whose products were queued and whose blocks above the diagonal are not yet
/// filled. The binding keeps its buffer allocated (a caller that drops the Hessian before
/// reading it must not see its memory written by the mirror) without counting as a handle,
/// so that the caller may still accumulate into it in place.
#[derive(Debug)]
struct Unmirrored {
    target: XtxTarget,
    _buffer: Binding,
}

impl XtxStream {
    /// Products on a new cuBLAS handle and stream of device `ordinal`, holding at most `limit`
    /// bytes of inputs in flight (a product whose input alone is larger is waited for).
    pub fn new(ordinal: usize, limit: u64) -> Result<Self, KernelError> {
        Ok(Self {
            blas: Cublas::new(ordinal)?,
            limit,
            blocking: XtxBlocking::default(),
            queued: Mutex::new(Queued::default()),
        })
    }

    /// The same stream, waiting for CubeCL's queued work before each product as `ordering`
    /// says: on the host ([`StreamOrdering::HostWaits`], unless set) or on the device. The
    /// Hessians are waited for on the host either way ([`XtxStream::wait_for`]).
    pub fn with_ordering(mut self, ordering: StreamOrdering) -> Self {
        self.blas.set_ordering(ordering);
        self
    }

    /// The bytes of inputs the products in flight may hold.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Queues `h ← h + Σ_r weight_r · X_rᵀX_r` over the `runs` of rows of `x` `[tokens, dim]`
    /// (bf16) into the f32 window `h` `[dim, dim]`, as
    /// [`xtx_runs_bf16`](super::xtx_runs_bf16) computes it, after CubeCL's queued work (which
    /// wrote `x`), less the blocks above the diagonal: those are filled from the blocks below
    /// once, by the [`XtxStream::wait_for`] or [`XtxStream::settle`] that precedes reading
    /// `h`. Waits first for the products writing `h`'s buffer and for the oldest until this
    /// one fits in the limit (and for this one where it alone does not).
    pub fn queue(
        &self,
        client: &ComputeClient<CudaRuntime>,
        x: &Bf16Matrix,
        runs: &[XtxRun],
        h: &MatrixView,
    ) -> Result<(), KernelError> {
        let target = XtxTarget::of(client, h)?;
        let bytes = x.handle.size_in_used();
        let mut queued = self.lock()?;
        retire(&mut queued.in_flight, |q, held| {
            q.hessians.contains(&target.ptr) || held + bytes > self.limit
        })?;
        queue_xtx_runs(client, &self.blas, x, runs, h, self.blocking, false)?;
        queued.client = Some(client.clone());
        if !queued.unmirrored.iter().any(|u| u.target == target) {
            queued.unmirrored.push(Unmirrored {
                target,
                _buffer: h.handle.clone().binding(),
            });
        }
        let done = self.record()?;
        queued.in_flight.push_back(InFlight {
            done,
            hessians: vec![target.ptr],
            _buffers: vec![x.handle.clone(), h.handle.clone()],
            _mirrored: Vec::new(),
            bytes,
        });
        // An input larger than the limit by itself is waited for at once: the stream never
        // holds more than the limit past the caller's use.
        retire(&mut queued.in_flight, |_, held| held > self.limit)
    }

    /// Fills the blocks above the diagonal of the Hessian `h` and waits for its queued
    /// products and that copy (and for those queued before them): afterwards CubeCL may read
    /// or write it.
    pub fn wait_for(
        &self,
        client: &ComputeClient<CudaRuntime>,
        h: &MatrixView,
    ) -> Result<(), KernelError> {
        let target = XtxTarget::of(client, h)?;
        let mut queued = self.lock()?;
        self.mirror(client, &mut queued, |u| u.target == target)?;
        retire(&mut queued.in_flight, |q, _| {
            q.hessians.contains(&target.ptr)
        })
    }

    /// Waits for the queued products that write the Hessian `h` (and those queued before
    /// them), leaving its blocks above the diagonal unfilled: afterwards CubeCL may write it
    /// in place, or copy it, and queue more products into it; it is read only after
    /// [`XtxStream::wait_for`] or [`XtxStream::settle`].
    pub fn wait_for_products(
        &self,
        client: &ComputeClient<CudaRuntime>,
        h: &MatrixView,
    ) -> Result<(), KernelError> {
        let hessian = XtxTarget::of(client, h)?.ptr;
        let mut queued = self.lock()?;
        retire(&mut queued.in_flight, |q, _| q.hessians.contains(&hessian))
    }

    /// Fills the blocks above the diagonal of every Hessian queued into and waits for every
    /// queued call.
    pub fn settle(&self) -> Result<(), KernelError> {
        let mut queued = self.lock()?;
        if let Some(client) = queued.client.clone() {
            self.mirror(&client, &mut queued, |_| true)?;
        }
        retire(&mut queued.in_flight, |_, _| true)
    }

    /// Calls (products or mirrors) queued and not yet known to be done.
    pub fn in_flight(&self) -> usize {
        self.queued.lock().map_or(0, |q| q.in_flight.len())
    }

    /// Hessians queued into whose blocks above the diagonal are not yet filled.
    pub fn unmirrored(&self) -> usize {
        self.queued.lock().map_or(0, |q| q.unmirrored.len())
    }

    /// Queues the mirrors of the unmirrored Hessians `which` picks, as one call.
    fn mirror(
        &self,
        client: &ComputeClient<CudaRuntime>,
        queued: &mut Queued,
        which: impl Fn(&Unmirrored) -> bool,
    ) -> Result<(), KernelError> {
        let (mirrored, kept) = std::mem::take(&mut queued.unmirrored)
            .into_iter()
            .partition::<Vec<_>, _>(which);
        queued.unmirrored = kept;
        if mirrored.is_empty() {
            return Ok(());
        }
        let targets: Vec<XtxTarget> = mirrored.iter().map(|u| u.target).collect();
        queue_xtx_mirrors(client, &self.blas, &targets, self.blocking)?;
        let done = self.record()?;
        queued.in_flight.push_back(InFlight {
            done,
            hessians: targets.iter().map(|t| t.ptr).collect(),
            _buffers: Vec::new(),
            _mirrored: mirrored,
            bytes: 0,
        });
        Ok(())
    }

    /// An event recorded on the stream after what is queued on it so far.
    fn record(&self) -> Result<CudaEvent, KernelError> {
        let lib = self.blas.lib();
        let done = lib
            .context()
            .new_event(None)
            .map_err(|e| driver_error("XᵀX event", e))?;
        done.record(lib.stream())
            .map_err(|e| driver_error("XᵀX event record", e))?;
        Ok(done)
    }

    fn lock(&self) -> Result<MutexGuard<'_, Queued>, KernelError> {
        self.queued.lock().map_err(|_| KernelError::Launch {
            what: "XᵀX stream",
            message: "a product panicked while queueing".into(),
        })
    }
}

/// Drops the products already done from the front of `in_flight`, then waits for the oldest
/// while `wait(oldest, bytes held by all)` holds.
fn retire(
    in_flight: &mut VecDeque<InFlight>,
    wait: impl Fn(&InFlight, u64) -> bool,
) -> Result<(), KernelError> {
    loop {
        let held: u64 = in_flight.iter().map(|q| q.bytes).sum();
        let Some(oldest) = in_flight.front() else {
            return Ok(());
        };
        let done = oldest
            .done
            .try_is_complete()
            .map_err(|e| driver_error("XᵀX event query", e))?;
        if !done && !in_flight.iter().any(|q| wait(q, held)) {
            return Ok(());
        }
        if !done {
            oldest
                .done
                .synchronize()
                .map_err(|e| driver_error("XᵀX products", e))?;
        }
        in_flight.pop_front();
    }
}

impl Drop for XtxStream {
    fn drop(&mut self) {
        // The buffers held go back to CubeCL only once nothing reads them.
        if let Ok(queued) = self.queued.get_mut() {
            for queued in queued.in_flight.iter() {
                let _ = queued.done.synchronize();
            }
        }
    }
}
