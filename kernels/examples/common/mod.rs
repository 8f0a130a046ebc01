//! What the CUDA benchmarks of this crate share: reading a bf16 buffer back, synchronising the
//! device, timing a call, and comparing two outputs.

use std::time::Instant;

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Handle;
use half::bf16;
use sala_kernels::KernelError;

/// CubeCL's client of the CUDA device.
pub type Client = ComputeClient<CudaRuntime>;

/// A bf16 buffer read back as f32.
pub fn download(client: &Client, h: &Handle) -> Vec<f32> {
    let bytes = client.read_one(h.clone()).expect("read back");
    bytemuck::cast_slice::<u8, bf16>(&bytes)
        .iter()
        .map(|x| x.to_f32())
        .collect()
}

/// Waits for CubeCL's queued work.
pub fn sync(client: &Client) {
    cubecl::future::block_on(client.sync()).expect("sync");
}

/// Best seconds of `reps` calls after one untimed call, the device synchronised around each.
pub fn time(
    client: &Client,
    reps: usize,
    mut call: impl FnMut() -> Result<(), KernelError>,
) -> Result<f64, KernelError> {
    let mut best = f64::INFINITY;
    for rep in 0..=reps.max(1) {
        sync(client);
        let t = Instant::now();
        call()?;
        sync(client);
        if rep > 0 {
            best = best.min(t.elapsed().as_secs_f64());
        }
    }
    Ok(best)
}

/// `max |a − b| / max |b|`, infinite where `a` is not finite.
pub fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let top = b.iter().fold(0.0f64, |m, &x| m.max((x as f64).abs()));
    let diff = a.iter().zip(b).fold(0.0f64, |m, (&x, &y)| {
        if x.is_finite() {
            m.max((x as f64 - y as f64).abs())
        } else {
            f64::INFINITY
        }
    });
    diff / top.max(f64::MIN_POSITIVE)
}
