//! Where a forward pass's time goes, op by op: [`ProfiledOps`] wraps a backend's [`FastOps`]
//! and, while its [`OpProfile`] is switched on, synchronises the device before and after every
//! call it passes on and adds the seconds to that op's total. Switched off it only passes the
//! calls on, so one runner can be timed plainly and then profiled.
//!
//! The synchronisations remove the overlap of host and device work, so a profiled pass is
//! slower than a plain one: its totals say how the work divides, the plain pass how long it
//! takes. What the graph computes itself (an op the fast ops decline, casts, copies, the
//! caller's own work) is in no total: it is the pass's time less their sum.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use serde::Serialize;

use crate::error::{ModelError, Result};
use crate::fast::{FastOps, RowRun};

/// The calls and seconds of one op since its profile was last taken.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OpTotal {
    /// The [`FastOps`] method: `linear`, `causal_attention`, `simple_gla`, ….
    pub op: String,
    /// Calls the wrapped ops answered (a call they declined, `Ok(None)`, is not counted).
    pub calls: u64,
    /// Seconds between the synchronisations around those calls.
    pub seconds: f64,
}

/// The switch and the running totals of a [`ProfiledOps`].
#[derive(Debug, Default)]
pub struct OpProfile {
    on: AtomicBool,
    totals: Mutex<BTreeMap<&'static str, (u64, f64)>>,
}

impl OpProfile {
    /// Starts (`true`) or stops timing the calls that follow.
    pub fn set_enabled(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    /// Whether calls are timed.
    pub fn enabled(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// The totals since the last call, by op name, and a fresh start.
    pub fn take(&self) -> Vec<OpTotal> {
        let totals = std::mem::take(&mut *self.lock());
        totals
            .into_iter()
            .map(|(op, (calls, seconds))| OpTotal {
                op: op.to_owned(),
                calls,
                seconds,
            })
            .collect()
    }

    fn add(&self, op: &'static str, seconds: f64) {
        let mut totals = self.lock();
        let entry = totals.entry(op).or_insert((0, 0.0));
        entry.0 += 1;
        entry.1 += seconds;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<&'static str, (u64, f64)>> {
        // A poisoned lock only means a caller panicked while adding; the map stays whole.
        self.totals.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A [`FastOps`] that passes every call on to `inner` and, while [`ProfiledOps::profile`] is
/// on, times each one between two device synchronisations (module docs).
#[derive(Debug)]
pub struct ProfiledOps<B: Backend> {
    inner: Arc<dyn FastOps<B>>,
    profile: OpProfile,
}

impl<B: Backend> ProfiledOps<B> {
    /// `inner`, profiled; the profile starts switched off.
    pub fn new(inner: Arc<dyn FastOps<B>>) -> Self {
        Self {
            inner,
            profile: OpProfile::default(),
        }
    }

    /// This wrapper with its profile switched on from the start.
    pub fn switched_on(self) -> Self {
        self.profile.set_enabled(true);
        self
    }

    /// `f` (an op on `device`), timed when the profile is on and `f` answered
    /// (`answered(&output)`).
    fn timed<T>(
        &self,
        op: &'static str,
        device: &B::Device,
        answered: impl Fn(&T) -> bool,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        if !self.profile.enabled() {
            return f();
        }
        sync::<B>(op, device)?;
        let start = Instant::now();
        let out = f()?;
        sync::<B>(op, device)?;
        if answered(&out) {
            self.profile.add(op, start.elapsed().as_secs_f64());
        }
        Ok(out)
    }
}

fn sync<B: Backend>(op: &'static str, device: &B::Device) -> Result<()> {
    B::sync(device).map_err(|e| ModelError::Kernel {
        op,
        message: format!("synchronising the device: {e:?}"),
    })
}

fn is_some<T>(x: &Option<T>) -> bool {
    x.is_some()
}

impl<B: Backend> FastOps<B> for ProfiledOps<B> {
    fn causal_attention(
        &self,
        q: Tensor<B, 3>,
        k: Tensor<B, 3>,
        v: Tensor<B, 3>,
        lengths: &[usize],
        scale: f32,
    ) -> Result<Tensor<B, 3>> {
        let device = q.device();
        self.timed(
            "causal_attention",
            &device,
            |_| true,
            || self.inner.causal_attention(q, k, v, lengths, scale),
        )
    }

    fn gated_causal_attention(
        &self,
        q: &Tensor<B, 3>,
        k: &Tensor<B, 3>,
        v: &Tensor<B, 3>,
        lengths: &[usize],
        scale: f32,
        gate: &Tensor<B, 2>,
    ) -> Result<Option<Tensor<B, 2>>> {
        self.timed("gated_causal_attention", &q.device(), is_some, || {
            self.inner
                .gated_causal_attention(q, k, v, lengths, scale, gate)
        })
    }

    fn linear(&self, x: &Tensor<B, 2>, w: &Tensor<B, 2>) -> Result<Option<Tensor<B, 2>>> {
        self.timed("linear", &x.device(), is_some, || self.inner.linear(x, w))
    }

    fn linears(&self, x: &Tensor<B, 2>, ws: &[&Tensor<B, 2>]) -> Result<Option<Vec<Tensor<B, 2>>>> {
        self.timed("linears", &x.device(), is_some, || {
            self.inner.linears(x, ws)
        })
    }

    fn swiglu(&self, gate: &Tensor<B, 2>, up: &Tensor<B, 2>) -> Result<Option<Tensor<B, 2>>> {
        self.timed("swiglu", &gate.device(), is_some, || {
            self.inner.swiglu(gate, up)
        })
    }

    fn sigmoid_gate(&self, x: &Tensor<B, 2>, gate: &Tensor<B, 2>) -> Result<Option<Tensor<B, 2>>> {
        self.timed("sigmoid_gate", &x.device(), is_some, || {
            self.inner.sigmoid_gate(x, gate)
        })
    }

    fn rms_norm(
        &self,
        x: &Tensor<B, 2>,
        weight: &Tensor<B, 1>,
        eps: f64,
    ) -> Result<Option<Tensor<B, 2>>> {
        self.timed("rms_norm", &x.device(), is_some, || {
            self.inner.rms_norm(x, weight, eps)
        })
    }

    fn rms_norm_gate(
        &self,
        x: &Tensor<B, 2>,
        weight: &Tensor<B, 1>,
        eps: f64,
        gate: &Tensor<B, 2>,
    ) -> Result<Option<Tensor<B, 2>>> {
        self.timed("rms_norm_gate", &x.device(), is_some, || {
            self.inner.rms_norm_gate(x, weight, eps, gate)
        })
    }

    fn scaled_residual(
        &self,
        hidden: &Tensor<B, 2>,
        branch: &Tensor<B, 2>,
        scale: f64,
    ) -> Result<Option<Tensor<B, 2>>> {
        self.timed("scaled_residual", &hidden.device(), is_some, || {
            self.inner.scaled_residual(hidden, branch, scale)
        })
    }

    fn linear_residual(
        &self,
        hidden: &Tensor<B, 2>,
        x: &Tensor<B, 2>,
        w: &Tensor<B, 2>,
        scale: f64,
    ) -> Result<Option<Tensor<B, 2>>> {
        self.timed("linear_residual", &x.device(), is_some, || {
            self.inner.linear_residual(hidden, x, w, scale)
        })
    }

    fn rope(
        &self,
        x: &Tensor<B, 3>,
        cos: &Tensor<B, 2>,
        sin: &Tensor<B, 2>,
        lengths: &[usize],
    ) -> Result<Option<Tensor<B, 3>>> {
        self.timed("rope", &x.device(), is_some, || {
            self.inner.rope(x, cos, sin, lengths)
        })
    }

    fn rms_norm_rope(
        &self,
        x: &Tensor<B, 3>,
        weight: &Tensor<B, 1>,
        eps: f64,
        cos: &Tensor<B, 2>,
        sin: &Tensor<B, 2>,
        lengths: &[usize],
    ) -> Result<Option<Tensor<B, 3>>> {
        self.timed("rms_norm_rope", &x.device(), is_some, || {
            self.inner.rms_norm_rope(x, weight, eps, cos, sin, lengths)
        })
    }

    fn simple_gla(
        &self,
        q: &Tensor<B, 3>,
        k: &Tensor<B, 3>,
        v: &Tensor<B, 3>,
        lengths: &[usize],
        log_decays: &[f64],
        scale: f32,
    ) -> Result<Option<Tensor<B, 2>>> {
        self.timed("simple_gla", &q.device(), is_some, || {
            self.inner.simple_gla(q, k, v, lengths, log_decays, scale)
        })
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn to_host(&self, x: &Tensor<B, 2>) -> Option<Vec<f32>> {
        // Downloads synchronise by themselves; timed only as part of the caller's stage.
        self.inner.to_host(x)
    }

    fn upload_host(
        &self,
        bytes: &[u8],
        dtype: DType,
        device: &B::Device,
    ) -> Result<Option<Tensor<B, 1>>> {
        // The copy alone (the caller's conversion before it is not in the total): what a
        // layer's weights and host-kept hidden states cost on the bus per pass.
        self.timed("upload_host", device, Option::is_some, || {
            self.inner.upload_host(bytes, dtype, device)
        })
    }

    fn download_bf16(&self, x: &Tensor<B, 2>, dst: &mut [half::bf16]) -> Result<bool> {
        self.timed(
            "download_bf16",
            &x.device(),
            |answered| *answered,
            || self.inner.download_bf16(x, dst),
        )
    }

    fn accumulate_gram(
        &self,
        h: Tensor<B, 2>,
        x: &Tensor<B, 2>,
        runs: &[RowRun],
    ) -> Result<Tensor<B, 2>> {
        self.timed(
            "accumulate_gram",
            &x.device(),
            |_| true,
            // Settled inside the timing: a profile says what each product costs alone.
            || {
                let h = self.inner.accumulate_gram(h, x, runs)?;
                self.inner.settle_grams().map(|()| h)
            },
        )
    }

    fn channel_sums(&self, x: &Tensor<B, 2>, runs: &[RowRun]) -> Result<Option<[Tensor<B, 2>; 3]>> {
        self.timed("channel_sums", &x.device(), is_some, || {
            self.inner.channel_sums(x, runs)
        })
    }

    fn settle_grams(&self) -> Result<()> {
        self.inner.settle_grams()
    }

    fn profile(&self) -> Option<&OpProfile> {
        Some(&self.profile)
    }
}
