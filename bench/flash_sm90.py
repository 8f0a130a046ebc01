"""Checks and times the Hopper flash-attention kernel (kernels/src/cuda/flash_attention_sm90.cu)
on the GPU machine, outside the Rust build: NVRTC (ctypes) compiles it for sm_90a, CuPy launches
it on PyTorch tensors, PyTorch in f32 is the reference and PyTorch's bf16 SDPA the peer.

    python3 bench/flash_sm90.py [OUT.json] [--source FILE.cu] [--module FILE.ptx]
                                [--smem BYTES] [--threads N] [--ptxas-info]
                                [--no-checks]
                                [--speed 1024x16 16384x1 ...]

Prints a table; with OUT.json writes every figure there. `--source` checks another version of
the kernel (same entry point and arguments), `--smem` its dynamic shared memory and `--threads`
its block size (the kernel's arguments are those of the persistent TMA kernel: K and V as tensor
maps, then the work list's counter). `--module` loads a kernel already compiled (PTX or CUBIN, such as the PTX the Rust
build loads: `bench_attention --dump-ptx FILE`) instead of compiling the source. Each check and timing runs under a time limit (`--limit` seconds): a kernel
that hangs is reported, not waited for."""
import argparse, ctypes, glob, json, math, os, sys, time

import cupy
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "..", "kernels", "src", "cuda", "flash_attention_sm90.cu")
SMEM = 7 * 128 * 128 * 2 + 128 + 1024
ROWS = 128
D = 128


def nvrtc():
    names = ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
    for pattern in ["/usr/local/cuda*/lib64/libnvrtc.so*", "/usr/local/cuda*/targets/*/lib/libnvrtc.so*",
                    os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libnvrtc.so*")]:
        names += sorted(glob.glob(pattern))
    for n in names:
        try:
            return ctypes.CDLL(n), n
        except OSError:
            pass
    raise SystemExit("no libnvrtc")


def compile_cubin():
    lib, name = nvrtc()
    prog = ctypes.c_void_p()
    src = open(ARGS.source).read().encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"flash_attention_sm90.cu", 0, None, None) == 0
    opts = [b"--gpu-architecture=sm_90a", b"-std=c++17", b"--use_fast_math"]
    if ARGS.ptxas_info:
        opts.append(b"--ptxas-options=-v")
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        raise SystemExit(f"nvrtc {name} failed ({rc}):\n{log.value.decode()}")
    if ARGS.ptxas_info:
        print(log.value.decode(), flush=True)
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    path = "/tmp/flash_sm90.cubin"
    open(path, "wb").write(cubin.raw)
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return path, f"{name} ({major.value}.{minor.value})"


def work_list(lengths, group):
    items, start = [], 0
    for n in lengths:
        rows = n * group
        for f0 in range(0, rows, ROWS):
            last = (min(f0 + ROWS, rows) - 1) // group
            items.append(((start, n, f0), last))
        start += n
    items.sort(key=lambda x: -x[1])
    return [x for item, _ in items for x in item]


def libcuda():
    return ctypes.CDLL("libcuda.so.1")


def tensor_map(t):
    """The kernel's tensor map of a K or V tensor [tokens, kv_heads, 128] bf16 (the encoding
    `hopper_attention.rs` makes): boxes of 64 × 1 × 128, 128-byte swizzle, zeros past the end.
    Returned as a 64-byte aligned 128-byte buffer (and the object that owns it)."""
    raw = ctypes.create_string_buffer(128 + 64)
    address = (ctypes.addressof(raw) + 63) & ~63
    dims = (ctypes.c_uint64 * 3)(D, t.shape[1], t.shape[0])
    strides = (ctypes.c_uint64 * 2)(D * 2, t.shape[1] * D * 2)
    box = (ctypes.c_uint32 * 3)(64, 1, 128)
    steps = (ctypes.c_uint32 * 3)(1, 1, 1)
    # bf16 = 9, no interleave, 128-byte swizzle = 3, L2 promotion 256 B = 3, zeros = 0.
    rc = LIBCUDA.cuTensorMapEncodeTiled(ctypes.c_void_p(address), 9, 3, ctypes.c_void_p(t.data_ptr()), dims,
                                        strides, box, steps, 0, 3, 3, 0)
    if rc != 0:
        raise SystemExit(f"cuTensorMapEncodeTiled failed: {rc}")
    return ctypes.c_void_p(address), raw


class Kernel:
    def __init__(self):
        path, self.nvrtc = (ARGS.module, "none: " + ARGS.module) if ARGS.module else compile_cubin()
        self.fn = cupy.RawModule(path=path).get_function("sala_flash_attention_sm90")
        self.fn.max_dynamic_shared_size_bytes = ARGS.smem
        # Tensor maps by (address, shape): encoded once, not inside the timed launches.
        self.maps = {}

    def tensor_map(self, t):
        key = (t.data_ptr(), tuple(t.shape))
        if key not in self.maps:
            self.maps[key] = tensor_map(t)
        return self.maps[key][0]

    def __call__(self, q, k, v, out, lengths, work=None):
        heads, kv_heads = q.shape[1], k.shape[1]
        if work is None:
            # The work list, then the unit counter (zero; the kernel sets it back to zero).
            work = torch.tensor(work_list(lengths, heads // kv_heads) + [0], dtype=torch.int32, device="cuda")
        items = (work.numel() - 1) // 3
        # The kernel is persistent: at most one block per multiprocessor, each taking units
        # (item × KV head) from the counter.
        units = items * kv_heads
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        grid = min(units, sms)
        values = [ctypes.c_uint64(q.data_ptr()), self.tensor_map(k), self.tensor_map(v), ctypes.c_uint64(out.data_ptr()),
                  ctypes.c_uint64(0),  # no output gate
                  ctypes.c_uint64(work.data_ptr()), ctypes.c_uint64(work.data_ptr() + 4 * 3 * items),
                  ctypes.c_uint32(items), ctypes.c_uint32(heads), ctypes.c_uint32(kv_heads),
                  ctypes.c_float(D ** -0.5 * math.log2(math.e))]
        params = (ctypes.c_void_p * len(values))(
            *[v if isinstance(v, ctypes.c_void_p) else ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        rc = LIBCUDA.cuLaunchKernel(ctypes.c_void_p(self.fn.kernel.ptr), grid, 1, 1, ARGS.threads, 1, 1, ARGS.smem,
                                    stream, params, None)
        if rc != 0:
            raise SystemExit(f"cuLaunchKernel failed: {rc}")
        return work


def reference(q, k, v, lengths):
    heads, kv_heads = q.shape[1], k.shape[1]
    g = heads // kv_heads
    outs, s = [], 0
    for n in lengths:
        qs = q[s:s + n].float().transpose(0, 1)
        ks = k[s:s + n].float().repeat_interleave(g, dim=1).transpose(0, 1)
        vs = v[s:s + n].float().repeat_interleave(g, dim=1).transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        s += n
    return torch.cat(outs)


def inputs(lengths, heads, kv_heads, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = sum(lengths)
    mk = lambda h: torch.randn(t, h, D, device="cuda", generator=g).to(torch.bfloat16)
    return mk(heads), mk(kv_heads), mk(kv_heads)


def wait(what):
    """Waits for the device's queued work, at most `--limit` seconds: a hung kernel ends the
    run with a message (the process's exit tears the context down) instead of waiting forever."""
    event = torch.cuda.Event()
    event.record()
    deadline = time.time() + ARGS.limit
    while not event.query():
        if time.time() > deadline:
            print(f"HUNG: {what} did not finish in {ARGS.limit:.0f} s", flush=True)
            os._exit(3)
        time.sleep(0.01)


def check(kernel, lengths, heads, kv_heads, seed):
    q, k, v = inputs(lengths, heads, kv_heads, seed)
    out = torch.full_like(q, float("nan"))
    kernel(q, k, v, out, lengths)
    wait(f"check {lengths} h={heads} kv={kv_heads}")
    ref = reference(q, k, v, lengths)
    o = out.float()
    rel = ((o - ref).norm() / ref.norm()).item()
    return {"lengths": lengths, "heads": heads, "kv_heads": kv_heads, "rel_err": rel,
            "max_abs": (o - ref).abs().max().item(), "nan": bool(torch.isnan(o).any().item())}


def timed(fn, reps=5):
    fn(); torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def speed(kernel, lengths, heads, kv_heads):
    q, k, v = inputs(lengths, heads, kv_heads, 7)
    out = torch.empty_like(q)
    work = kernel(q, k, v, out, lengths)
    wait(f"speed {lengths[0]}x{len(lengths)}")
    ours = timed(lambda: kernel(q, k, v, out, lengths, work))
    def torch_sdpa():
        s = 0
        for n in lengths:
            F.scaled_dot_product_attention(q[s:s + n].transpose(0, 1)[None], k[s:s + n].transpose(0, 1)[None],
                                           v[s:s + n].transpose(0, 1)[None], is_causal=True, enable_gqa=True)
            s += n
    peer = timed(torch_sdpa)
    ref = torch.cat([F.scaled_dot_product_attention(q[s:s + n].transpose(0, 1)[None], k[s:s + n].transpose(0, 1)[None],
                     v[s:s + n].transpose(0, 1)[None], is_causal=True, enable_gqa=True)[0].transpose(0, 1)
                     for s, n in zip([sum(lengths[:i]) for i in range(len(lengths))], lengths)])
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    flop = sum(2.0 * n * (n + 1) * D * heads for n in lengths)
    return {"lengths": f"{lengths[0]}x{len(lengths)}", "heads": heads, "kv_heads": kv_heads, "ours_s": ours,
            "torch_s": peer, "ours_tflops": flop / ours / 1e12, "torch_tflops": flop / peer / 1e12,
            "rel_vs_torch": rel}


def main():
    kernel = Kernel()
    result = {"device": torch.cuda.get_device_name(), "nvrtc": kernel.nvrtc, "torch": torch.__version__,
              "flop": "2·L·(L+1)·128·heads per sequence (causal QKᵀ and PV)", "checks": [], "speed": []}
    cases = [([1], 32, 2), ([7, 1, 130], 32, 2), ([129, 300, 1000, 5], 32, 2), ([257, 64], 4, 2),
             ([333, 1], 8, 8), ([2048], 32, 2), ([100, 700], 16, 1)]
    for seed, (lengths, h, kv) in enumerate([] if ARGS.no_checks else cases):
        r = check(kernel, lengths, h, kv, seed)
        result["checks"].append(r)
        print(f"check {lengths} h={h} kv={kv}: rel {r['rel_err']:.2e} max {r['max_abs']:.2e} nan {r['nan']}", flush=True)
    for lengths, h, kv in [([int(n)] * int(c), 32, 2) for n, c in (x.split("x") for x in ARGS.speed)]:
        r = speed(kernel, lengths, h, kv)
        result["speed"].append(r)
        print(f"speed {r['lengths']}: ours {r['ours_s']*1e3:.2f} ms {r['ours_tflops']:.0f} TFLOP/s, torch "
              f"{r['torch_s']*1e3:.2f} ms {r['torch_tflops']:.0f} TFLOP/s, rel vs torch {r['rel_vs_torch']:.2e}", flush=True)
    if ARGS.out:
        json.dump(result, open(ARGS.out, "w"), indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?")
    parser.add_argument("--source", default=SOURCE)
    parser.add_argument("--module", help="a compiled PTX or CUBIN file to load instead of --source")
    parser.add_argument("--smem", type=int, default=SMEM)
    parser.add_argument("--threads", type=int, default=384)
    parser.add_argument("--limit", type=float, default=60.0)
    parser.add_argument("--ptxas-info", action="store_true", help="print ptxas' register and spill report")
    parser.add_argument("--no-checks", action="store_true", help="skip the correctness checks")
    parser.add_argument("--speed", nargs="*", default=["1024x16", "16384x1", "131072x1"],
                        help="timed cases, LENGTHxCOUNT (32 query and 2 KV heads)")
    ARGS = parser.parse_args()
    LIBCUDA = libcuda()
    # Checked before any compile or check runs: `--speed` takes every word after it, so an
    # OUT.json written last would otherwise fail only after the checks.
    for case in ARGS.speed:
        n, _, c = case.partition("x")
        if not (n.isdigit() and c.isdigit() and int(n) > 0 and int(c) > 0):
            parser.error(f"--speed {case!r}: expected LENGTHxCOUNT such as 131072x1 "
                         "(OUT.json goes before the options)")
    main()
