//! `MmaGla` (CUDA only: `mma.sync`, compiled by NVRTC) through the checks of the CubeCL GLA
//! kernel (`gla.rs`): varlen packs against the f64 recurrence at one bf16 ulp, a pack equal to
//! each sequence alone bit for bit, the refusals, and segment states across boundaries. On a
//! device below compute capability 8.0 the constructor refuses with `Unsupported` (any other
//! error fails) and the tests stop with a notice.

use cubecl::server::Handle;
use sala_kernels::cuda::MmaGla;
use sala_kernels::gla::{GlaShape, GlaTiling};
use sala_kernels::KernelError;

use crate::common::{client, TestRuntime};
use crate::gla::{check_packed_equals_alone, check_refusals, check_segments, check_varlen_packs};

type Client = cubecl::prelude::ComputeClient<TestRuntime>;

/// The kernel on device 0, or `None` (with a notice) where the device cannot run it.
fn kernel() -> Option<MmaGla> {
    match MmaGla::new(0) {
        Ok(kernel) => Some(kernel),
        Err(KernelError::Unsupported { what, detail }) => {
            eprintln!("NOTICE: mma GLA not tested: {what}: {detail}");
            None
        }
        Err(e) => panic!("mma GLA failed to build: {e}"),
    }
}

/// Runs `check` with the kernel as the implementation under test.
fn with_kernel(check: fn(&Client, crate::gla::Kernel<'_>)) {
    let (Some(client), Some(gla)) = (client(), kernel()) else {
        return;
    };
    let run = |client: &Client,
               shape: &GlaShape,
               offsets: &[usize],
               g: &[f64],
               segment: usize,
               buffers: [&Handle; 4]|
     -> Result<GlaTiling, KernelError> {
        gla.run_in_segments(client, shape, offsets, g, segment, buffers)
    };
    check(&client, &run);
}

#[test]
fn mma_gla_matches_the_recurrence_on_varlen_packs_and_head_dims() {
    with_kernel(check_varlen_packs);
}

#[test]
fn mma_gla_pack_equals_each_sequence_alone() {
    with_kernel(check_packed_equals_alone);
}

#[test]
fn mma_gla_refuses_growing_decays_and_short_buffers() {
    with_kernel(check_refusals);
}

#[test]
fn mma_gla_segments_carry_the_state_across_their_boundaries() {
    with_kernel(check_segments);
}
