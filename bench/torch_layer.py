"""The PyTorch baseline of one MiniCPM-SALA layer on the inputs `bench_forward --dump` wrote.

For every dumped case it runs the same layer in eager PyTorch bf16 (cuBLAS linears, SDPA with
GQA for the minicpm4 attention, a chunk-loop Simple GLA in f32 for the lightning mixer), with the
same weights and inputs, compares the output with ours, times it (one untimed run, then the best
of `--reps`), measures the bf16 matmul peak of the GPU, and writes our report merged with these
figures:

    python3 bench/torch_layer.py --dump DIR --ours forward.json --out bench/results/forward-h200.json

Needs PyTorch with CUDA and `safetensors`; not part of CI.
"""

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def rms_norm(x, weight, eps):
    """HF MiniCPM RMSNorm in bf16: statistics in f32, rounded before the weight multiply."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16)
    return normed * weight


def rope_tables(length, head_dim, theta, device):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.arange(length, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    """x [batch, L, heads, d] bf16; NeoX rotate-half in f32, rounded back to bf16."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[None, :, None, :] + rotated * sin[None, :, None, :]).to(torch.bfloat16)


def chunked_gla(q, k, v, log_decays, chunk=64):
    """Simple GLA, chunked, f32: q (scaled), k, v [batch, heads, L, d]; a loop over chunks."""
    b, h, length, d = q.shape
    g = torch.tensor(log_decays, device=q.device, dtype=torch.float64)[:, None]
    state = torch.zeros(b, h, d, d, device=q.device, dtype=torch.float32)

    def decays(c):
        i = torch.arange(c, device=q.device, dtype=torch.float64)
        into_q = torch.exp(g * (i + 1)).float()[None, :, :, None]
        into_s = torch.exp(g * (c - 1 - i)).float()[None, :, :, None]
        diff = i[:, None] - i[None, :]
        zero = torch.zeros((), device=q.device, dtype=torch.float64)
        intra = torch.where(diff >= 0, torch.exp(g[:, :, None] * diff.clamp(min=0)), zero).float()[None]
        whole = torch.exp(g * c).float()[None, :, :, None]
        return into_q, into_s, intra, whole

    full = decays(min(chunk, length))
    outs = []
    for start in range(0, length, chunk):
        c = min(chunk, length - start)
        into_q, into_s, intra, whole = full if c == min(chunk, length) else decays(c)
        qc, kc, vc = q[:, :, start:start + c], k[:, :, start:start + c], v[:, :, start:start + c]
        outs.append((qc * into_q) @ state + ((qc @ kc.transpose(-1, -2)) * intra) @ vc)
        state = state * whole + (kc * into_s).transpose(-1, -2) @ vc
    return torch.cat(outs, dim=2)


class Layer:
    def __init__(self, kind, weights, meta, device):
        self.kind = kind
        self.w = {name: t.to(device) for name, t in weights.items()}
        self.meta = meta
        self.eps = meta["rms_norm_eps"]
        self.rs = meta["residual_scale"]
        self.device = device

    def lin(self, x, name):
        return x @ self.w[f"{name}.weight"].t()

    def residual(self, h, branch):
        return h + (branch.float() * self.rs).to(torch.bfloat16)

    def mlp(self, h):
        m = rms_norm(h, self.w["post_attention_layernorm.weight"], self.eps)
        act = F.silu(self.lin(m, "mlp.gate_proj")) * self.lin(m, "mlp.up_proj")
        return self.residual(h, self.lin(act, "mlp.down_proj"))

    def runs(self, lengths):
        """Runs of equal lengths: (first row, length, count)."""
        runs, row = [], 0
        for n in lengths:
            if runs and runs[-1][1] == n:
                runs[-1][2] += 1
            else:
                runs.append([row, n, 1])
            row += n
        return runs

    def minicpm4(self, a, lengths):
        heads, kv, d = (self.meta["attention"][k] for k in ("heads", "kv_heads", "head_dim"))
        q, k, v = (self.lin(a, f"self_attn.{p}_proj") for p in "qkv")
        gate = self.lin(a, "self_attn.o_gate")
        outs = []
        for row, n, count in self.runs(lengths):
            rows = slice(row, row + n * count)
            qs = q[rows].view(count, n, heads, d).transpose(1, 2)
            ks = k[rows].view(count, n, kv, d).transpose(1, 2)
            vs = v[rows].view(count, n, kv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            outs.append(o.transpose(1, 2).reshape(count * n, heads * d))
        att = torch.cat(outs, dim=0)
        return self.lin(att * torch.sigmoid(gate), "self_attn.o_proj")

    def lightning(self, a, lengths):
        heads, d = self.meta["lightning"]["heads"], self.meta["lightning"]["head_dim"]
        tokens = a.shape[0]
        q, k, v = (self.lin(a, f"self_attn.{p}_proj").view(tokens, heads, d) for p in "qkv")
        q = rms_norm(q, self.w["self_attn.q_norm.weight"], self.eps)
        k = rms_norm(k, self.w["self_attn.k_norm.weight"], self.eps)
        outs = []
        for row, n, count in self.runs(lengths):
            rows = slice(row, row + n * count)
            cos, sin = rope_tables(n, d, self.meta["rope_theta"], self.device)
            qs = apply_rope(q[rows].view(count, n, heads, d), cos, sin)
            ks = apply_rope(k[rows].view(count, n, heads, d), cos, sin)
            vs = v[rows].view(count, n, heads, d)
            qf = qs.float().transpose(1, 2) * (1.0 / math.sqrt(d))
            o = chunked_gla(qf, ks.float().transpose(1, 2), vs.float().transpose(1, 2), self.meta["gla_log_decays"])
            outs.append(o.transpose(1, 2).reshape(count * n, heads * d).to(torch.bfloat16))
        out = rms_norm(torch.cat(outs, dim=0), self.w["self_attn.o_norm.weight"], self.eps)
        gate = torch.sigmoid(self.lin(a, "self_attn.z_proj"))
        return self.lin(out * gate, "self_attn.o_proj")

    @torch.no_grad()
    def forward(self, h, lengths):
        a = rms_norm(h, self.w["input_layernorm.weight"], self.eps)
        mixer = self.minicpm4 if self.kind == "minicpm4" else self.lightning
        return self.mlp(self.residual(h, mixer(a, lengths)))


def best_time(fn, reps):
    fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def bf16_peak(device):
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    seconds = best_time(lambda: a @ b, 10)
    return 2 * 8192**3 / seconds / 1e12


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", required=True, help="the directory bench_forward --dump wrote")
    parser.add_argument("--ours", required=True, help="bench_forward's --json report")
    parser.add_argument("--out", required=True, help="the merged report to write")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    meta = json.load(open(f"{args.dump}/meta.json"))
    report = json.load(open(args.ours))
    peak = bf16_peak(device)
    print(f"bf16 matmul peak: {peak:.0f} TFLOP/s (8192^3, best of 10)")
    layers = {}
    for m in report["measurements"]:
        kind, case = m["kind"], m["case"]
        key = f"{kind}_{case}"
        if key not in meta["cases"]:
            continue
        if kind not in layers:
            layers[kind] = Layer(kind, load_file(f"{args.dump}/{kind}_weights.safetensors"), meta, device)
        layer = layers[kind]
        tensors = load_file(f"{args.dump}/{key}.safetensors")
        h, ours = tensors["input"].to(device), tensors["output"].to(device)
        lengths = meta["cases"][key]
        theirs = layer.forward(h, lengths)
        diff = (ours.float() - theirs.float()).abs().max().item()
        scale = theirs.float().abs().max().item()
        seconds = best_time(lambda: layer.forward(h, lengths), args.reps)
        m["torch_ms_per_1k_tokens"] = 1e6 * seconds / m["tokens"]
        m["max_rel_diff_vs_torch"] = diff / scale
        m["fraction_of_peak"] = m["tflops"] / peak
        m["speedup_vs_torch"] = m["torch_ms_per_1k_tokens"] / m["ms_per_1k_tokens"]
        print(
            f"{kind:>10} {case:>14}: ours {m['ms_per_1k_tokens']:.3f} ms/1k, torch {m['torch_ms_per_1k_tokens']:.3f} ms/1k "
            f"({m['speedup_vs_torch']:.2f}x), max |diff| / max |out| = {m['max_rel_diff_vs_torch']:.2e}"
        )
        del h, ours, theirs, tensors
        torch.cuda.empty_cache()
    report["torch"] = {"version": torch.__version__, "peak_bf16_tflops": peak, "gpu": torch.cuda.get_device_name()}
    json.dump(report, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
