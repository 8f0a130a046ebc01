//! After faer's products the upper vector state is dirty where the processor runs its AVX-512
//! kernels, and the clears return it to clean: on the calling thread and on the pool's.

use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, Par};
use sala_cpu::{clear_upper_state, clear_upper_state_everywhere, upper_state_in_use};

/// A product large enough for faer to run its packed kernels (and, with `par`, spread them).
fn product(par: Par) -> f32 {
    let n = 256;
    let a = Mat::<f32>::from_fn(n, n, |i, j| ((i * 7 + j * 3) % 11) as f32 - 5.0);
    let b = Mat::<f32>::from_fn(n, n, |i, j| ((i * 5 + j) % 13) as f32 - 6.0);
    let mut c = Mat::<f32>::zeros(n, n);
    matmul(c.as_mut(), Accum::Replace, a.as_ref(), b.as_ref(), 1.0, par);
    c[(3, 4)]
}

/// Upper state of every pool thread, as each reports it.
fn pool_states() -> Vec<Option<bool>> {
    rayon::broadcast(|_| upper_state_in_use())
}

#[test]
fn a_sequential_product_is_cleared_on_this_thread() {
    let value = product(Par::Seq);
    clear_upper_state();
    // Reading the state is itself SSE/VEX-free code: it must report clean now, wherever the
    // processor reports at all.
    if let Some(in_use) = upper_state_in_use() {
        assert!(
            !in_use,
            "upper state still in use after the clear (product {value})"
        );
    } else {
        eprintln!("NOTICE: this processor does not report XINUSE; nothing to check");
    }
}

#[test]
fn a_parallel_product_is_cleared_on_every_pool_thread() {
    let value = product(Par::rayon(0));
    clear_upper_state_everywhere();
    let states = pool_states();
    assert_eq!(states.len(), rayon::current_num_threads());
    for (thread, state) in states.iter().enumerate() {
        assert_ne!(
            *state,
            Some(true),
            "pool thread {thread} still dirty after the clear (product {value})"
        );
    }
}

#[test]
fn the_kernels_leave_the_state_dirty_where_they_use_avx512() {
    // The reason for this crate: without a clear, faer's f32 product leaves the upper state in
    // use where it runs its AVX-512 assembly kernels (seen on the Xeons this project's CI runs
    // on). Where the processor cannot report the state, or faer picked other kernels, there is
    // nothing to show; the clear must still leave it clean.
    clear_upper_state();
    product(Par::Seq);
    match upper_state_in_use() {
        Some(true) => {
            clear_upper_state();
            assert_eq!(upper_state_in_use(), Some(false));
        }
        Some(false) => eprintln!("NOTICE: faer's product left the upper state clean here"),
        None => eprintln!("NOTICE: this processor does not report XINUSE; nothing to show"),
    }
}
