//! Keeps the CPU's vector unit in the state ordinary code expects after faer's products.
//!
//! faer 0.24 multiplies f32 and f64 matrices on x86-64 with the `private-gemm-x86` kernels:
//! hand-written AVX-512 assembly that returns without `vzeroupper`. The upper halves of the
//! vector registers stay *dirty* on the thread that ran the kernel, and on Intel cores every
//! legacy-SSE instruction executed afterwards on that thread (the x86-64 baseline that Rust
//! code and most of libm's callers are compiled to) pays a state transition or a false
//! dependency on the whole register. Measured on the 2-core Xeon (AVX-512) this project's CI
//! runs on: a pass of `exp`/`ln` (SwiGLU over 11,463 × 512 values) took 1.7 s after a faer
//! GEMM and 0.1 s after `vzeroupper` — the reason the CPU fast ops ran 4× slower than the
//! Burn graph they replaced, and why two machines disagreed by 7× on the same job (an AVX2
//! machine never runs those kernels). The fix is what a compiler does at the end of every AVX
//! function: `vzeroupper`, on each thread that ran a kernel.
//!
//! - [`clear_upper_state`]: this thread, after a sequential product ([`faer::Par::Seq`]);
//! - [`clear_upper_state_everywhere`]: every thread of the current rayon pool and this one,
//!   after a parallel product (`Par::rayon`), whose kernels ran on the pool's threads;
//! - [`upper_state_in_use`]: what the processor reports (`XGETBV` with `ECX = 1`), for tests
//!   and diagnostics.
//!
//! [`faer::Par::Seq`]: https://docs.rs/faer/0.24/faer/enum.Par.html

/// `XINUSE` bits of the AVX upper halves (`YMM_Hi128`, bit 2) and of the AVX-512 upper halves of
/// registers 0–15 (`ZMM_Hi256`, bit 6): the state `vzeroupper` returns to its initial value.
const UPPER_STATE_BITS: u64 = (1 << 2) | (1 << 6);

/// Zeroes bits 128 and up of vector registers 0–15 on the calling thread (`vzeroupper`), so the
/// legacy-SSE code that runs next does not pay for a dirty upper state. A no-op where the
/// processor has no AVX (nothing can be dirty there) or on other architectures.
#[inline]
pub fn clear_upper_state() {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: AVX is present (checked above). `vzeroupper` changes only the upper halves of
        // ymm0–15, which hold no live value across this call: the System V ABI preserves no
        // vector register across calls, and the intrinsic is a call boundary to the compiler.
        unsafe { std::arch::x86_64::_mm256_zeroupper() }
    }
}

/// [`clear_upper_state`] on every worker thread of the current rayon pool (through
/// [`rayon::broadcast`]) and on the calling thread. Call it after a faer product run with
/// `Par::rayon`: its kernels ran on the pool's threads and left them dirty. Costs one wake-up of
/// each worker (microseconds).
pub fn clear_upper_state_everywhere() {
    rayon::broadcast(|_| clear_upper_state());
    clear_upper_state();
}

/// Whether the calling thread's upper vector state (`YMM_Hi128` or `ZMM_Hi256`) is in use, as
/// `XGETBV` with `ECX = 1` reports it; `None` where the processor cannot report it (no
/// `XGETBV` with `ECX = 1`, or not x86-64).
pub fn upper_state_in_use() -> Option<bool> {
    in_use_bits().map(|bits| bits & UPPER_STATE_BITS != 0)
}

/// The `XINUSE` bitmap of the calling thread, where the processor reports it.
#[cfg(target_arch = "x86_64")]
fn in_use_bits() -> Option<u64> {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // SAFETY: `cpuid` is always available on x86-64; leaf 0xD is read only when leaf 0 says it
    // exists, and `XGETBV` only when CPUID.(EAX=0xD, ECX=1):EAX[2] and OSXSAVE say it may run.
    unsafe {
        if __cpuid(0).eax < 0xD || __cpuid(1).ecx & (1 << 27) == 0 {
            return None;
        }
        if __cpuid_count(0xD, 1).eax & (1 << 2) == 0 {
            return None;
        }
        let (low, high): (u32, u32);
        std::arch::asm!(
            "xgetbv",
            in("ecx") 1u32,
            out("eax") low,
            out("edx") high,
            options(nomem, nostack, preserves_flags),
        );
        Some(u64::from(high) << 32 | u64::from(low))
    }
}

/// Other architectures have no such state to report.
#[cfg(not(target_arch = "x86_64"))]
fn in_use_bits() -> Option<u64> {
    None
}
