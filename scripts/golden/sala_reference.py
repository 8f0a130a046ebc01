#!/usr/bin/env python3
"""Independent reference forward pass of the tiny SALA / Llama fixtures (pure Python + numpy).

Reads `config.json` and `model.safetensors` of a model directory itself (no torch, no
transformers, no Rust code), runs the HF forward pass in float64 with the plain GLA recurrence
and naive causal attention, and writes golden logits as JSON:

    pip install numpy
    python3 scripts/golden/sala_reference.py fixtures/tiny-sala  fixtures/golden/tiny-sala.json
    python3 scripts/golden/sala_reference.py fixtures/tiny-llama fixtures/golden/tiny-llama.json

The math follows the design note on the model (sections 3 and 3.2): RMSNorm with eps, mu-P
scales (scale_emb, scale_depth/sqrt(L), logits / (hidden/dim_model_base)), minicpm4 layers
with GQA causal softmax and a sigmoid o_gate on the normed input, lightning layers with
per-head q/k RMSNorm, then RoPE (rotate-half; inv_freq, angles and cos/sin in float32 as HF
computes them), Simple GLA with decay exp(-slope_h), o_norm over all heads and a sigmoid
z_proj gate. No bf16 rounding: the Rust side compares with `Numerics::F32`.
CI never runs this script; its output is committed.
"""
import json
import math
import struct
import sys

import numpy as np


def load_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    data = raw[8 + header_len :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        buf = data[start:end]
        if info["dtype"] == "BF16":
            bits = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
            values = bits.view(np.float32)
        elif info["dtype"] == "F32":
            values = np.frombuffer(buf, dtype="<f4")
        else:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        tensors[name] = values.astype(np.float64).reshape(info["shape"])
    return tensors


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def rope_tables(tokens, d, theta):
    inv_freq = np.float32(1.0) / (
        np.float32(theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
    )
    angles = np.outer(np.arange(tokens, dtype=np.float32), inv_freq).astype(np.float32)
    emb = np.concatenate([angles, angles], axis=-1)
    return np.cos(emb).astype(np.float64), np.sin(emb).astype(np.float64)


def rope(x, cos, sin):
    """x [T, H, d]; rotate_half(x) = concat(-x2, x1)."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def causal_attention(q, k, v):
    """Naive GQA softmax attention; q [T, H, d], k/v [T, Hkv, d]."""
    tokens, heads, d = q.shape
    group = heads // k.shape[1]
    out = np.zeros_like(q)
    for h in range(heads):
        kh, vh = k[:, h // group, :], v[:, h // group, :]
        for t in range(tokens):
            scores = kh[: t + 1] @ q[t, h] / math.sqrt(d)
            p = np.exp(scores - scores.max())
            out[t, h] = (p / p.sum()) @ vh[: t + 1]
    return out


def alibi_log_decays(heads):
    # HF _get_slopes for a power of two: start = 2^(-(2^-(log2(n)-3))), slopes start*start**i,
    # computed in Python floats, then stored as float32; the GLA uses g = -slope.
    start = 2 ** (-(2 ** -(math.log2(heads) - 3)))
    return [-float(np.float32(start * start**i)) for i in range(heads)]


def simple_gla(q, k, v, log_decays):
    """Plain recurrence S_t = exp(g) S_{t-1} + k_t^T v_t, o_t = q_t S_t (q already scaled)."""
    tokens, heads, d = q.shape
    out = np.zeros_like(q)
    for h in range(heads):
        gamma = math.exp(log_decays[h])
        state = np.zeros((d, d))
        for t in range(tokens):
            state = gamma * state + np.outer(k[t, h], v[t, h])
            out[t, h] = q[t, h] @ state
    return out


class Model:
    def __init__(self, model_dir):
        with open(f"{model_dir}/config.json") as f:
            self.cfg = json.load(f)
        self.w = load_safetensors(f"{model_dir}/model.safetensors")
        c = self.cfg
        self.sala = c["model_type"] == "minicpm_sala"
        self.eps = c["rms_norm_eps"]
        self.layers = c["num_hidden_layers"]
        self.heads = c["num_attention_heads"]
        self.kv_heads = c.get("num_key_value_heads", self.heads)
        self.d = c.get("head_dim", c["hidden_size"] // self.heads)
        if self.sala:
            self.scale_emb = c["scale_emb"]
            self.residual = c["scale_depth"] / math.sqrt(self.layers)
            self.logit_div = c["hidden_size"] / c["dim_model_base"]
            self.kinds = c["mixer_types"]
        else:
            self.scale_emb, self.residual, self.logit_div = 1.0, 1.0, 1.0
            self.kinds = ["llama"] * self.layers

    def lin(self, x, name):
        return x @ self.w[name + ".weight"].T

    def minicpm4(self, p, a):
        t = a.shape[0]
        q = self.lin(a, p + "q_proj").reshape(t, self.heads, self.d)
        k = self.lin(a, p + "k_proj").reshape(t, self.kv_heads, self.d)
        v = self.lin(a, p + "v_proj").reshape(t, self.kv_heads, self.d)
        att = causal_attention(q, k, v).reshape(t, -1)
        att = att * sigmoid(self.lin(a, p + "o_gate"))
        return self.lin(att, p + "o_proj")

    def lightning(self, p, a):
        t = a.shape[0]
        h, d = self.cfg["lightning_nh"], self.cfg["lightning_head_dim"]
        q = self.lin(a, p + "q_proj").reshape(t, h, d)
        k = self.lin(a, p + "k_proj").reshape(t, h, d)
        v = self.lin(a, p + "v_proj").reshape(t, h, d)
        q = rms_norm(q, self.w[p + "q_norm.weight"], self.eps)
        k = rms_norm(k, self.w[p + "k_norm.weight"], self.eps)
        cos, sin = rope_tables(t, d, self.cfg["rope_theta"])
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = simple_gla(q / math.sqrt(d), k, v, alibi_log_decays(h)).reshape(t, h * d)
        o = rms_norm(o, self.w[p + "o_norm.weight"], self.eps)
        o = o * sigmoid(self.lin(a, p + "z_proj"))
        return self.lin(o, p + "o_proj")

    def llama(self, p, a):
        t = a.shape[0]
        q = self.lin(a, p + "q_proj").reshape(t, self.heads, self.d)
        k = self.lin(a, p + "k_proj").reshape(t, self.kv_heads, self.d)
        v = self.lin(a, p + "v_proj").reshape(t, self.kv_heads, self.d)
        cos, sin = rope_tables(t, self.d, self.cfg.get("rope_theta", 10000.0))
        att = causal_attention(rope(q, cos, sin), rope(k, cos, sin), v).reshape(t, -1)
        return self.lin(att, p + "o_proj")

    def logits(self, ids):
        h = self.w["model.embed_tokens.weight"][ids] * self.scale_emb
        for i, kind in enumerate(self.kinds):
            p = f"model.layers.{i}."
            a = rms_norm(h, self.w[p + "input_layernorm.weight"], self.eps)
            mixer = {"minicpm4": self.minicpm4, "lightning-attn": self.lightning, "llama": self.llama}[kind]
            h = h + mixer(p + "self_attn.", a) * self.residual
            m = rms_norm(h, self.w[p + "post_attention_layernorm.weight"], self.eps)
            g, u = self.lin(m, p + "mlp.gate_proj"), self.lin(m, p + "mlp.up_proj")
            h = h + self.lin(g * sigmoid(g) * u, p + "mlp.down_proj") * self.residual
        h = rms_norm(h, self.w["model.norm.weight"], self.eps) / self.logit_div
        head = "model.embed_tokens.weight" if self.cfg.get("tie_word_embeddings") else "lm_head.weight"
        return h @ self.w[head].T


def fixed_ids(length, stride, vocab):
    """Deterministic token ids: BOS then a stride walk over the non-special ids."""
    return [1] + [3 + (i * stride + 11) % (vocab - 3) for i in range(length - 1)]


def main():
    model_dir, out_path = sys.argv[1], sys.argv[2]
    model = Model(model_dir)
    vocab = model.cfg["vocab_size"]
    sequences = []
    for length, stride in [(48, 37), (200, 101)]:
        ids = fixed_ids(length, stride, vocab)
        logits = model.logits(np.array(ids))
        rows = [0, length // 2, length - 1]
        sequences.append({
            "ids": ids,
            "positions": rows,
            "logits": [[float(f"{x:.9g}") for x in logits[r]] for r in rows],
            "row_mean": [float(f"{x:.9g}") for x in logits.mean(axis=1)],
            "row_rms": [float(f"{x:.9g}") for x in np.sqrt((logits**2).mean(axis=1))],
        })
    doc = {
        "model": model_dir,
        "generator": "scripts/golden/sala_reference.py (numpy float64, no bf16 rounding)",
        "sequences": sequences,
    }
    with open(out_path, "w") as f:
        json.dump(doc, f)
        f.write("\n")


if __name__ == "__main__":
    main()
