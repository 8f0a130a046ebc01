//! Process-wide allocator settings of the long-running tools (`quantize_sala`,
//! `synthetic_sala`): a library must not change them, a binary may.

/// Keeps the memory of large freed buffers in the process for the next ones.
///
/// glibc's malloc serves every allocation above its mmap threshold (at most 32 MB) with a
/// fresh `mmap` and returns it with `munmap` on free. A full-size layer allocates and frees
/// dozens of 67–268 MB buffers (weights, codes, differences, packed tensors), so each one is
/// faulted in page by page again: the 32-layer run on the H200 took 105 million minor page
/// faults and 228 s of system time (docs/results.md). Serving them from the heap and never
/// trimming it turns those faults into reuse after the first layer. The price: memory freed
/// after a peak stays resident (the peak itself does not grow).
///
/// Does nothing outside Linux with glibc.
pub fn reuse_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    glibc_heap_only();
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn glibc_heap_only() {
    // SAFETY: `mallopt` only changes malloc's tuning parameters (glibc serialises it with its
    // own allocator locks); every allocation made before stays valid.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn large_buffers_still_allocate_and_free_after_the_switch() {
        super::reuse_freed_memory();
        for round in 0..3 {
            let buffer = vec![round as u8; 64 << 20];
            assert_eq!(buffer[buffer.len() - 1], round as u8);
        }
    }
}
