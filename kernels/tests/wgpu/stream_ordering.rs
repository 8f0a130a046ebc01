//! Library calls ordered with CubeCL's kernels on the device (`StreamOrdering::DeviceWaits`,
//! CUDA only) against the host's waits: a chain in which every step reads what the step
//! before it wrote on the other stream gives the same bits both ways, also from a second host
//! thread (which gets a fence of its own: CubeCL gives it a stream of its own).

use cubecl::server::Handle;
use half::bf16;
use sala_kernels::cuda::{
    linear_bf16, linear_residual_bf16, Cublas, LinearShape, ResidualLinear, StreamOrdering,
};
use sala_kernels::gates::scaled_residual;

use crate::common::{client, Rng, TestRuntime};
use crate::flash_attention::upload_bf16;

type Client = cubecl::prelude::ComputeClient<TestRuntime>;

/// Large enough that the GPU, not the host, sets the pace: the host queues the whole chain
/// while its first steps run, so a missing wait would read a buffer before it is written.
const TOKENS: usize = 4096;
const WIDTH: usize = 2048;
const STEPS: usize = 24;
const SCALE: f32 = 0.25;

fn bits(client: &Client, handle: &Handle) -> Vec<u16> {
    let bytes = client.read_one(handle.clone()).unwrap();
    bytemuck::pod_collect_to_vec(&bytes[..TOKENS * WIDTH * 2])
}

/// `h ← h + s·h·wᵀ` `STEPS` times, alternating the two routes: cuBLAS's product then CubeCL's
/// residual add (into a new buffer), and cuBLASLt's product with the add in its epilogue.
/// Every step reads the previous step's output, written on the other stream half the time.
fn chain(client: &Client, blas: &Cublas, h0: &Handle, w: &Handle) -> Vec<u16> {
    let shape = LinearShape {
        tokens: TOKENS,
        in_features: WIDTH,
        out_features: WIDTH,
    };
    let bytes = TOKENS * WIDTH * 2;
    let mut h = h0.clone();
    for step in 0..STEPS {
        let next = client.empty(bytes);
        if step % 2 == 0 {
            let product = client.empty(bytes);
            linear_bf16(client, blas, shape, &h, w, &product).unwrap();
            scaled_residual::<TestRuntime, bf16>(
                client,
                &h,
                &product,
                &next,
                TOKENS * WIDTH,
                SCALE,
            )
            .unwrap();
        } else {
            let buffers = ResidualLinear {
                x: &h,
                w,
                hidden: &h,
                out: &next,
            };
            linear_residual_bf16(client, blas, shape, buffers, SCALE).unwrap();
        }
        h = next;
    }
    bits(client, &h)
}

fn inputs(client: &Client) -> (Handle, Handle) {
    let mut rng = Rng::new(17);
    let h: Vec<f32> = (0..TOKENS * WIDTH).map(|_| rng.normal()).collect();
    let sigma = 1.0 / (WIDTH as f32).sqrt();
    let w: Vec<f32> = (0..WIDTH * WIDTH).map(|_| sigma * rng.normal()).collect();
    (upload_bf16(client, &h), upload_bf16(client, &w))
}

/// The chain gives the same bits with the device's waits as with the host's, and it did work
/// (the state moved and stayed finite).
#[test]
fn device_waits_give_the_host_waits_bits() {
    let Some(client) = client() else {
        return;
    };
    let (h0, w) = inputs(&client);
    let host = Cublas::new(0).unwrap();
    assert_eq!(host.ordering(), StreamOrdering::HostWaits);
    let want = chain(&client, &host, &h0, &w);
    let device = Cublas::new(0)
        .unwrap()
        .with_ordering(StreamOrdering::DeviceWaits);
    assert_eq!(device.ordering(), StreamOrdering::DeviceWaits);
    for round in 0..3 {
        let got = chain(&client, &device, &h0, &w);
        let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(differ, 0, "round {round}: {differ} elements differ");
    }
    let start = bits(&client, &h0);
    assert_ne!(want, start, "the chain changed nothing");
    assert!(want
        .iter()
        .all(|&b| bf16::from_bits(b).to_f32().is_finite()));
}

/// A second thread using the same handle (its own CubeCL stream, its own fence) gets the same
/// bits, and so does the first thread after it.
#[test]
fn another_thread_gets_a_fence_of_its_own() {
    let Some(client) = client() else {
        return;
    };
    let (h0, w) = inputs(&client);
    let want = chain(&client, &Cublas::new(0).unwrap(), &h0, &w);
    let device = Cublas::new(0)
        .unwrap()
        .with_ordering(StreamOrdering::DeviceWaits);
    assert_eq!(chain(&client, &device, &h0, &w), want, "the fence's thread");
    std::thread::scope(|scope| {
        let got = scope
            .spawn(|| chain(&client.clone(), &device, &h0, &w))
            .join()
            .unwrap();
        assert_eq!(got, want, "another thread");
    });
    assert_eq!(
        chain(&client, &device, &h0, &w),
        want,
        "the first thread again"
    );
}
