// The library stream's half of the device fence (`fence.rs`): one-thread kernels that wait
// for and write a 32-bit ticket in device memory. CubeCL's half is two CubeCL kernels on its
// own stream, over the same two counters.
//
// Compiled at run time by NVRTC for compute capability 8.0, as the other NVRTC kernels are
// (the instructions need 7.0: `ld.acquire`, `st.release`, `__nanosleep`; CUDA 13's NVRTC
// refuses compute_70); no headers. Kernels rather than the driver's stream memory operations
// (`cuStreamWaitValue32`, `cuStreamWriteValue32`): the first GPU run of the fence (an H100,
// driver 580) refused `cuStreamWaitValue32` on CubeCL's buffer with CUDA_ERROR_INVALID_VALUE,
// and a kernel reads any memory a kernel can.

typedef unsigned int u32;

// Returns once `*counter` has reached `ticket`, compared as the signed difference (tickets
// wrap). Polls with acquire loads (each reads the device's coherent copy), sleeping briefly
// between them to leave the multiprocessor's issue slots to the kernels it waits for.
extern "C" __global__ void sala_fence_wait(const u32* counter, u32 ticket) {
    for (;;) {
        u32 seen;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
        if ((int)(seen - ticket) >= 0) {
            return;
        }
        __nanosleep(128);
    }
}

// `*counter ← ticket`, released after every store of the stream's earlier kernels (complete
// before this one starts, in stream order) and of this thread.
extern "C" __global__ void sala_fence_write(u32* counter, u32 ticket) {
    __threadfence();
    asm volatile("st.release.gpu.global.u32 [%0], %1;" : : "l"(counter), "r"(ticket) : "memory");
}
