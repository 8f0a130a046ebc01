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
//! What the caller must keep: a Hessian queued here is read or written by CubeCL only after
//! [`XtxStream::wait_for`] on its buffer or [`XtxStream::settle`]. The inputs need nothing:
//! the stream holds their buffers until its products are done.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use cubecl::server::Handle;
use cudarc::driver::CudaEvent;

use super::blas::queue_xtx_runs;
use super::{device_ptr, driver_error, Bf16Matrix, Cublas, StreamOrdering, XtxRun};
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
    in_flight: Mutex<VecDeque<InFlight>>,
}

/// One queued product: done when `done` completes; holds its input and Hessian until then.
#[derive(Debug)]
struct InFlight {
    done: CudaEvent,
    /// The device address of the Hessian it writes.
    hessian: u64,
    /// The input's buffer and the Hessian's: neither may be freed (and reused by CubeCL) while
    /// the product reads or writes it.
    _keep: [Handle; 2],
    /// Bytes of the input's buffer.
    bytes: u64,
}

impl XtxStream {
    /// Products on a new cuBLAS handle and stream of device `ordinal`, holding at most `limit`
    /// bytes of inputs in flight (a product whose input alone is larger is waited for).
    pub fn new(ordinal: usize, limit: u64) -> Result<Self, KernelError> {
        Ok(Self {
            blas: Cublas::new(ordinal)?,
            limit,
            in_flight: Mutex::new(VecDeque::new()),
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
    /// wrote `x`). Waits first for the products writing `h`'s buffer and for the oldest until
    /// this one fits in the limit (and for this one where it alone does not).
    pub fn queue(
        &self,
        client: &ComputeClient<CudaRuntime>,
        x: &Bf16Matrix,
        runs: &[XtxRun],
        h: &MatrixView,
    ) -> Result<(), KernelError> {
        let hessian = device_ptr(client, h)?;
        let bytes = x.handle.size_in_used();
        let mut in_flight = self.lock()?;
        retire(&mut in_flight, |queued, held| {
            queued.hessian == hessian || held + bytes > self.limit
        })?;
        queue_xtx_runs(client, &self.blas, x, runs, h, XtxBlocking::default())?;
        let lib = self.blas.lib();
        let done = lib
            .context()
            .new_event(None)
            .map_err(|e| driver_error("XᵀX event", e))?;
        done.record(lib.stream())
            .map_err(|e| driver_error("XᵀX event record", e))?;
        in_flight.push_back(InFlight {
            done,
            hessian,
            _keep: [x.handle.clone(), h.handle.clone()],
            bytes,
        });
        // An input larger than the limit by itself is waited for at once: the stream never
        // holds more than the limit past the caller's use.
        retire(&mut in_flight, |_, held| held > self.limit)
    }

    /// Waits for the queued products that write the Hessian `h` (and those queued before
    /// them): afterwards CubeCL may read or write it.
    pub fn wait_for(
        &self,
        client: &ComputeClient<CudaRuntime>,
        h: &MatrixView,
    ) -> Result<(), KernelError> {
        let hessian = device_ptr(client, h)?;
        let mut in_flight = self.lock()?;
        retire(&mut in_flight, |queued, _| queued.hessian == hessian)
    }

    /// Waits for every queued product.
    pub fn settle(&self) -> Result<(), KernelError> {
        let mut in_flight = self.lock()?;
        retire(&mut in_flight, |_, _| true)
    }

    /// Products queued and not yet known to be done.
    pub fn in_flight(&self) -> usize {
        self.in_flight.lock().map_or(0, |q| q.len())
    }

    fn lock(&self) -> Result<MutexGuard<'_, VecDeque<InFlight>>, KernelError> {
        self.in_flight.lock().map_err(|_| KernelError::Launch {
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
        if let Ok(in_flight) = self.in_flight.get_mut() {
            for queued in in_flight.iter() {
                let _ = queued.done.synchronize();
            }
        }
    }
}
