#!/usr/bin/env python3
"""demo_train.py — trains Strata's demo model and writes its reference figures.

Owns: the demo model's definition in PyTorch (the llama architecture exactly
as GGUF `llama` computes it), its training, the GGUF export (F16 and Q8_0,
tokenizer metadata copied from the vocabulary file) and demo/reference.json,
the figures the tests hold Strata to. It never tokenises text itself: every
token id it trains or measures on comes from `strata tokenize`.

Subcommands (defaults fit the repository root; see demo/README.md):
  tokens    (no PyTorch) `./strata tokenize` over the corpus demo_corpus.py
            wrote, the test excerpt and the prompt -> carry/demo-tokens/*.u16
            (little-endian uint16 ids), plus a copy of the vocabulary file.
  train     (a GPU) a short sweep of runs; keeps the weights with the best
            validation perplexity, writes them (float32, in parts) with
            weights.json, then reference.json and train.log.
  reference recomputes reference.json from saved weights (any device).
  export    writes demo/strata-demo-Q8_0.gguf and (not committed) an F16 file
            from saved weights; the output is a pure function of the weights.
  selftest  checks the GGUF writer and Q8_0 packing against the reader here.

The model (T tokens, D width, H query heads, K kv heads, E head dim, F
feed-forward width, V vocabulary): pre-norm blocks with RMSNorm, GQA attention
with RoPE on ADJACENT pairs (x[2i], x[2i+1]) -- GGUF `llama`'s NORM rope, so
no Q/K row permutation is needed at export -- SwiGLU, and the output head tied
to the token embedding. Weights live in a dict keyed by GGUF tensor names; a
torch (out, in) matrix is GGUF's {in, out}, so tensors export unchanged.
"""
import argparse
import contextlib
import glob
import json
import math
import os
import struct
import subprocess
import sys
import time

try:  # `tokens` needs neither; `export` needs numpy alone
    import numpy as np
except ImportError:
    np = None
try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = F = None

BOS = 1  # tokenizer.ggml.bos_token_id of the llama SPM vocabulary
PROMPT = "It was a cold morning in November, and"
N_GREEDY = 64          # greedy steps recorded for the parity test
N_TOP = 10             # log-probabilities recorded per step
PPL_CTX = 256          # the perplexity window of the tests (strata perplexity -c)
PART_BYTES = 15 << 20  # weight files come back from the GPU machine in parts

CONFIG = dict(
    n_vocab=32000, n_embd=256, n_layer=6, n_head=4, n_head_kv=2, n_ff=768,
    n_ctx=512, rope_base=10000.0, rms_eps=1e-5,
)

# One short sweep: the corpus is small (about 4 M tokens), so the runs differ
# in length and dropout and the best validation perplexity decides.
SWEEP = [
    dict(name="short", steps=1200, lr=2e-3, wd=0.1, dropout=0.1, batch=64, warmup=100, seed=1, eval_every=100),
    dict(name="mid", steps=2500, lr=2e-3, wd=0.1, dropout=0.1, batch=64, warmup=100, seed=2, eval_every=100),
    dict(name="long", steps=5000, lr=2e-3, wd=0.1, dropout=0.15, batch=64, warmup=100, seed=3, eval_every=200),
]

# ---- GGUF (ARCH.md §1): a reader for metadata, a writer for models ----

GGUF_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f",
            7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
GGUF_STR, GGUF_ARR, GGUF_U32, GGUF_F32 = 8, 9, 4, 6
QT_F32, QT_F16, QT_Q8_0 = 0, 1, 8
FTYPE = {QT_F16: 1, QT_Q8_0: 7}  # general.file_type (llama_ftype) of each export
ALIGN = 32


def gguf_value(buf, p, vtype):
    """Returns (value, end) for one value of vtype at byte p."""
    if vtype == GGUF_STR:
        n = struct.unpack_from("<Q", buf, p)[0]
        if p + 8 + n > len(buf):
            raise ValueError("string past the end at byte %d" % p)
        return buf[p + 8:p + 8 + n].decode("utf-8", "replace"), p + 8 + n
    if vtype == GGUF_ARR:
        etype, n = struct.unpack_from("<IQ", buf, p)
        p += 12
        if etype in GGUF_FMT:
            size = struct.calcsize(GGUF_FMT[etype])
            if p + n * size > len(buf):
                raise ValueError("array past the end at byte %d" % p)
            return list(struct.unpack_from("<%d%s" % (n, GGUF_FMT[etype][1]), buf, p)), p + n * size
        out = []
        for _ in range(n):
            v, p = gguf_value(buf, p, etype)
            out.append(v)
        return out, p
    if vtype not in GGUF_FMT:
        raise ValueError("bad value type %d at byte %d" % (vtype, p))
    return struct.unpack_from(GGUF_FMT[vtype], buf, p)[0], p + struct.calcsize(GGUF_FMT[vtype])


def gguf_read(path):
    """Returns (kv, raw, tensors): kv maps key -> value; raw maps key -> the
    pair's exact bytes (to copy it as is); tensors maps name -> (type, ne, data bytes)."""
    with open(path, "rb") as f:
        buf = f.read()
    if buf[:4] != b"GGUF":
        raise ValueError("%s: bad magic" % path)
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version != 3:
        raise ValueError("%s: GGUF version %d" % (path, version))
    p = 24
    kv, raw = {}, {}
    for _ in range(n_kv):
        start = p
        key, p = gguf_value(buf, p, GGUF_STR)
        vtype = struct.unpack_from("<I", buf, p)[0]
        kv[key], p = gguf_value(buf, p + 4, vtype)
        raw[key] = buf[start:p]
    infos = []
    for _ in range(n_tensors):
        name, p = gguf_value(buf, p, GGUF_STR)
        nd = struct.unpack_from("<I", buf, p)[0]
        ne = list(struct.unpack_from("<%dq" % nd, buf, p + 4))
        qtype, off = struct.unpack_from("<IQ", buf, p + 4 + 8 * nd)
        p += 4 + 8 * nd + 12
        infos.append((name, qtype, ne, off))
    align = kv.get("general.alignment", ALIGN)
    base = (p + align - 1) // align * align
    tensors = {}
    for name, qtype, ne, off in infos:
        n = 1
        for d in ne:
            n *= d
        size = {QT_F32: 4 * n, QT_F16: 2 * n, QT_Q8_0: n // 32 * 34}[qtype]
        tensors[name] = (qtype, ne, buf[base + off:base + off + size])
    return kv, raw, tensors


def gguf_str(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def gguf_kv_u32(key, v):
    return gguf_str(key) + struct.pack("<II", GGUF_U32, v)


def gguf_kv_f32(key, v):
    return gguf_str(key) + struct.pack("<If", GGUF_F32, v)


def gguf_kv_str(key, v):
    return gguf_str(key) + struct.pack("<I", GGUF_STR) + gguf_str(v)


def gguf_write(path, kvs, tensors):
    """kvs: list of encoded pairs; tensors: list of (name, qtype, ne, bytes),
    ne in GGUF order (ne[0] contiguous). Each tensor is padded to ALIGN."""
    out = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(kvs))] + kvs
    off = 0
    for name, qtype, ne, data in tensors:
        out.append(gguf_str(name) + struct.pack("<I", len(ne)) +
                   struct.pack("<%dq" % len(ne), *ne) + struct.pack("<IQ", qtype, off))
        off += (len(data) + ALIGN - 1) // ALIGN * ALIGN
    head = b"".join(out)
    parts = [head, b"\0" * (-len(head) % ALIGN)]
    for _, _, _, data in tensors:
        parts += [data, b"\0" * (-len(data) % ALIGN)]
    with open(path, "wb") as f:
        f.write(b"".join(parts))


def q8_0_pack(x):
    """Q8_0 blocks of a float32 numpy array (size a multiple of 32), as the
    reference quantiser does: d = amax/127, q = round-half-away(x * (1/d)),
    d stored as f16 (rounded after q is computed from the f32 d)."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 32)
    amax = np.abs(x).max(axis=1)
    d = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    v = x * inv[:, None]
    q = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.int8)
    blocks = np.zeros(len(x), dtype=[("d", "<f2"), ("q", "i1", 32)])
    blocks["d"] = d.astype(np.float16)
    blocks["q"] = q
    return blocks.tobytes()


def q8_0_unpack(data, n):
    blocks = np.frombuffer(data, dtype=[("d", "<f2"), ("q", "i1", 32)], count=n // 32)
    return (blocks["d"].astype(np.float32)[:, None] * blocks["q"].astype(np.float32)).reshape(-1)


def tensor_names(cfg):
    names = ["token_embd.weight"]
    for l in range(cfg["n_layer"]):
        names += ["blk.%d.%s.weight" % (l, t) for t in
                  ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                   "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")]
    return names + ["output_norm.weight"]


def tensor_shape(cfg, name):
    """The torch shape (rows, cols) of a weight; GGUF's ne is its reverse."""
    D, E, F = cfg["n_embd"], cfg["n_embd"] // cfg["n_head"], cfg["n_ff"]
    kind = name.split(".")[-2]
    return {"token_embd": (cfg["n_vocab"], D), "attn_norm": (D,), "ffn_norm": (D,),
            "output_norm": (D,), "attn_q": (cfg["n_head"] * E, D),
            "attn_k": (cfg["n_head_kv"] * E, D), "attn_v": (cfg["n_head_kv"] * E, D),
            "attn_output": (D, cfg["n_head"] * E), "ffn_gate": (F, D), "ffn_up": (F, D),
            "ffn_down": (D, F)}[kind]


def export_gguf(path, cfg, weights, qtype, vocab_raw, name):
    """weights: name -> float32 numpy array. Norms stay F32; matrices get qtype."""
    E = cfg["n_embd"] // cfg["n_head"]
    kvs = [gguf_kv_str("general.architecture", "llama"),
           gguf_kv_str("general.name", name),
           gguf_kv_u32("general.alignment", ALIGN),
           gguf_kv_u32("general.file_type", FTYPE[qtype]),
           gguf_kv_u32("general.quantization_version", 2),
           gguf_kv_u32("llama.vocab_size", cfg["n_vocab"]),
           gguf_kv_u32("llama.context_length", cfg["n_ctx"]),
           gguf_kv_u32("llama.embedding_length", cfg["n_embd"]),
           gguf_kv_u32("llama.block_count", cfg["n_layer"]),
           gguf_kv_u32("llama.feed_forward_length", cfg["n_ff"]),
           gguf_kv_u32("llama.attention.head_count", cfg["n_head"]),
           gguf_kv_u32("llama.attention.head_count_kv", cfg["n_head_kv"]),
           gguf_kv_f32("llama.attention.layer_norm_rms_epsilon", cfg["rms_eps"]),
           gguf_kv_f32("llama.rope.freq_base", cfg["rope_base"]),
           gguf_kv_u32("llama.rope.dimension_count", E)]
    kvs += [vocab_raw[k] for k in vocab_raw if k.startswith("tokenizer.")]
    tensors = []
    for t in tensor_names(cfg):
        w = np.ascontiguousarray(weights[t], dtype=np.float32)
        ne = list(reversed(w.shape))
        if w.ndim == 1:
            tensors.append((t, QT_F32, ne, w.tobytes()))
        elif qtype == QT_F16:
            tensors.append((t, QT_F16, ne, w.astype(np.float16).tobytes()))
        else:
            tensors.append((t, QT_Q8_0, ne, q8_0_pack(w)))
    gguf_write(path, kvs, tensors)



# ---- token and weight files ----

def strata_tokenize(strata, vocab, path):
    out = subprocess.run([strata, "tokenize", "-m", vocab, "-f", path, "--json"],
                         check=True, capture_output=True)
    ids = json.loads(out.stdout)
    if not ids or ids[0] != BOS or max(ids) >= 65536 or min(ids) < 0:
        raise SystemExit("%s: unexpected ids from strata tokenize" % path)
    return ids


def write_u16(path, ids):
    with open(path, "wb") as f:
        f.write(struct.pack("<%dH" % len(ids), *ids))


def read_u16(path):
    return np.fromfile(path, dtype="<u2").astype(np.int64)


def save_weights(wdir, cfg, weights, info):
    """Float32 tensors in tensor_names order, one stream cut into parts."""
    blob = b"".join(np.ascontiguousarray(weights[t], np.float32).tobytes() for t in tensor_names(cfg))
    for old in glob.glob(os.path.join(wdir, "weights.f32.*")):
        os.remove(old)
    for k in range(0, len(blob), PART_BYTES):
        with open(os.path.join(wdir, "weights.f32.%02d" % (k // PART_BYTES)), "wb") as f:
            f.write(blob[k:k + PART_BYTES])
    with open(os.path.join(wdir, "weights.json"), "w") as f:
        json.dump(dict(info, config=cfg), f, indent=1)


def load_weights(wdir):
    with open(os.path.join(wdir, "weights.json")) as f:
        info = json.load(f)
    cfg = info["config"]
    blob = b"".join(open(p, "rb").read() for p in sorted(glob.glob(os.path.join(wdir, "weights.f32.*"))))
    weights, off = {}, 0
    for t in tensor_names(cfg):
        shape = tensor_shape(cfg, t)
        n = int(np.prod(shape))
        weights[t] = np.frombuffer(blob, np.float32, n, off).reshape(shape).copy()
        off += 4 * n
    if off != len(blob):
        raise SystemExit("%s: %d bytes of weights, expected %d" % (wdir, len(blob), off))
    return cfg, weights, info


# ---- the model ----

def autocast(on):
    """bf16 autocast on the GPU; nothing elsewhere (and float32 throughout)."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if on else contextlib.nullcontext()


def rope_tables(T, E, base, device):
    """cos, sin (T, E/2) of the angle p * base^(-2i/E) for pair (x[2i], x[2i+1])."""
    i = torch.arange(E // 2, dtype=torch.float64, device=device)
    p = torch.arange(T, dtype=torch.float64, device=device)
    ang = p[:, None] * base ** (-2.0 * i / E)[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def rope(x, cos, sin):
    """x (B, T, n, E) rotated by adjacent pairs."""
    B, T, n, E = x.shape
    x2 = x.float().reshape(B, T, n, E // 2, 2)
    a, b = x2[..., 0], x2[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).reshape(B, T, n, E).to(x.dtype)


def rmsnorm(x, w, eps):
    xf = x.float()
    return (xf * (xf.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w.float()).to(x.dtype)


def q8_act(x):
    """The reference engine's activation rounding before a Q8_0 product:
    blocks of 32, q = round-half-even(x * 127/amax), scale amax/127 in f16."""
    b = x.float().reshape(-1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax.clamp_min(1e-30), torch.zeros_like(amax))
    return (torch.round(b * inv) * (amax / 127).half().float()).reshape(x.shape)


def forward(W, cfg, idx, dropout=0.0, fast=False, sim=False, last=False):
    """Logits (B, T, V) of token ids idx (B, T) at positions 0..T-1, or
    (B, 1, V) of the last position only when last is set.
    fast: fused attention (training under autocast). sim: round as the
    reference engine's CPU path does with Q8_0 weights (W must hold the
    Q8_0-dequantised matrices): activations to Q8_0 before each product,
    Q, K, V and the attention probabilities to F16."""
    B, T = idx.shape
    D, H, K = cfg["n_embd"], cfg["n_head"], cfg["n_head_kv"]
    E = D // H
    eps = cfg["rms_eps"]
    cos, sin = rope_tables(T, E, cfg["rope_base"], idx.device)

    def mm(h, w):
        return (q8_act(h) if sim else h) @ w.t()

    def drop(h):
        return F.dropout(h, dropout) if dropout > 0 else h

    x = W["token_embd.weight"][idx]                                       # (B, T, D)
    mask = torch.full((T, T), float("-inf"), device=idx.device).triu(1)   # (T, T)
    for l in range(cfg["n_layer"]):
        p = "blk.%d." % l
        h = rmsnorm(x, W[p + "attn_norm.weight"], eps)
        q = rope(mm(h, W[p + "attn_q.weight"]).reshape(B, T, H, E), cos, sin)  # (B, T, H, E)
        k = rope(mm(h, W[p + "attn_k.weight"]).reshape(B, T, K, E), cos, sin)  # (B, T, K, E)
        v = mm(h, W[p + "attn_v.weight"]).reshape(B, T, K, E)                  # (B, T, K, E)
        # Query head h reads kv head h // (H/K): consecutive query heads share one.
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))                      # (B, n, T, E)
        k = k.repeat_interleave(H // K, dim=1)
        v = v.repeat_interleave(H // K, dim=1)
        if fast:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:
            if sim:
                q, k, v = q.half().float(), k.half().float(), v.half().float()
            pr = torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(E) + mask, dim=-1)
            if sim:
                pr = pr.half().float()
            o = drop(pr) @ v
        o = o.transpose(1, 2).reshape(B, T, H * E)
        x = x + drop(mm(o, W[p + "attn_output.weight"]))
        h = rmsnorm(x, W[p + "ffn_norm.weight"], eps)
        g = F.silu(mm(h, W[p + "ffn_gate.weight"])) * mm(h, W[p + "ffn_up.weight"])
        x = x + drop(mm(g, W[p + "ffn_down.weight"]))
    if last:
        x = x[:, -1:]
    x = rmsnorm(x, W["output_norm.weight"], eps)
    return mm(x, W["token_embd.weight"])                                   # (B, T, V)


def init_weights(cfg, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    resid = 0.02 / math.sqrt(2 * cfg["n_layer"])  # residual-branch outputs start small
    W = {}
    for t in tensor_names(cfg):
        shape = tensor_shape(cfg, t)
        if len(shape) == 1:
            w = torch.ones(shape)
        else:
            std = resid if t.endswith(("attn_output.weight", "ffn_down.weight")) else 0.02
            w = torch.randn(shape, generator=g) * std
        W[t] = w.to(device).requires_grad_(True)
    return W


# ---- measurements: the perplexity tool's method, greedy decoding, parity ----

def perplexity(W, cfg, tokens, n_ctx, device, sim=False, fast=False, batch=32):
    """ARCH.md 5b: floor(N/n_ctx) chunks (tail dropped), each chunk's first
    token overwritten with BOS; positions n_ctx/2 .. n_ctx-2 predict the next
    token; log-sum-exp in float64. Returns (ppl, mean_nll, scored, chunks)."""
    C = len(tokens) // n_ctx
    if C < 2:
        raise ValueError("perplexity needs at least 2*n_ctx tokens")
    x = torch.as_tensor(tokens[:C * n_ctx]).reshape(C, n_ctx).clone().to(device)
    x[:, 0] = BOS
    first = n_ctx // 2
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, C, batch):
            xb = x[i:i + batch]
            with autocast(fast):
                logits = forward(W, cfg, xb, fast=fast, sim=sim)
            lg = logits[:, first:n_ctx - 1].double()
            nll = torch.logsumexp(lg, -1) - lg.gather(-1, xb[:, first + 1:, None])[..., 0]
            total += nll.sum().item()
            count += nll.numel()
    return math.exp(total / count), total / count, count, C


def greedy(W, cfg, prompt, n, device, sim=False):
    """n greedy steps after prompt (ties to the lowest id). Returns the steps
    (id, logprob, margin = top-1 minus top-2 logit, top N_TOP log-probabilities)
    and each step's full float64 log-softmax (on the CPU)."""
    ids, steps, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = forward(W, cfg, torch.as_tensor([ids], device=device), sim=sim, last=True)[0, -1].double()
            lp = torch.log_softmax(logits, -1)
            top = torch.topk(logits, N_TOP + 1)
            tid = int(torch.nonzero(logits == top.values[0])[0].item())
            steps.append({"id": tid, "logprob": lp[tid].item(),
                          "margin": (top.values[0] - top.values[1]).item(),
                          "top": [{"id": int(j), "logprob": lp[j].item()}
                                  for j in top.indices[:N_TOP].tolist()]})
            lps.append(lp.cpu())
            ids.append(tid)
    return steps, lps


def parity(ref, cand, cand_lps):
    """The parity rule of the engine-core issue (what test_demo.c applies):
    tokens equal until the first difference, where the reference's margin
    must be <= 0.05 (comparison stops there); returns (ok, compared steps,
    mean |delta logprob| over the reference's top-10 ids, divergence step)."""
    diffs, n, div = [], 0, None
    for i, (r, c) in enumerate(zip(ref, cand)):
        diffs += [abs(cand_lps[i][t["id"]].item() - t["logprob"]) for t in r["top"]]
        n += 1
        if c["id"] != r["id"]:
            div = i
            break
    ok = div is None or ref[div]["margin"] <= 0.05
    return ok, n, sum(diffs) / max(1, len(diffs)), div


def detok(pieces, ids):
    """Token pieces to text: U+2581 is a space, <0xNN> a byte."""
    out = b""
    for i in ids:
        p = pieces[i]
        if len(p) == 6 and p.startswith("<0x") and p.endswith(">"):
            out += bytes([int(p[3:5], 16)])
        else:
            out += p.replace("\u2581", " ").encode("utf-8")
    return out.decode("utf-8", "replace")


def q8_0_roundtrip(w):
    return q8_0_unpack(q8_0_pack(w), w.size).reshape(w.shape) if w.ndim == 2 else w


def make_reference(cfg, weights, info, tokens_dir, device, log, with_val=True):
    """Every figure of reference.json, in float32 with TF32 off. Also measures
    how far the Q8_0 file's rounding moves them (dequantised weights alone,
    and a simulation of the reference engine's CPU rounding); if that uses
    more than half of the tests' tolerance, the reference is computed from
    the Q8_0-dequantised weights instead."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    heldout = read_u16(os.path.join(tokens_dir, "heldout.u16"))
    val = read_u16(os.path.join(tokens_dir, "val-persuasion.u16"))
    prompt = read_u16(os.path.join(tokens_dir, "prompt.u16")).tolist()
    vocab_kv, _, _ = gguf_read(os.path.join(tokens_dir, "vocab.gguf"))
    pieces = vocab_kv["tokenizer.ggml.tokens"]
    W32 = {t: torch.as_tensor(w).to(device) for t, w in weights.items()}
    W8 = {t: torch.as_tensor(q8_0_roundtrip(w)).to(device) for t, w in weights.items()}
    variants = {"fp32": (W32, False), "q8_0": (W8, False), "q8_0_sim": (W8, True)}
    figs, runs = {}, {}
    for label, (W, sim) in variants.items():
        ppl, nll, count, chunks = perplexity(W, cfg, heldout, PPL_CTX, device, sim=sim)
        figs[label] = dict(heldout_ppl=ppl, heldout_mean_nll=nll, scored=count, chunks=chunks)
        if with_val:
            figs[label]["val_ppl"] = perplexity(W, cfg, val, PPL_CTX, device, sim=sim)[0]
        runs[label] = greedy(W, cfg, prompt, N_GREEDY, device, sim=sim)
        log("%-9s heldout ppl %.4f (mean nll %.6f, %d scored, %d chunks)  Persuasion ppl %s"
            % (label, ppl, nll, count, chunks, "%.4f" % figs[label]["val_ppl"] if with_val else "-"))
    checks = {}
    for ref_label in ("fp32", "q8_0"):
        for label in ("q8_0", "q8_0_sim"):
            if label == ref_label:
                continue
            ok, n, mean, div = parity(runs[ref_label][0], runs[label][0], runs[label][1])
            rel = figs[label]["heldout_mean_nll"] / figs[ref_label]["heldout_mean_nll"] - 1
            checks["%s_vs_%s" % (label, ref_label)] = dict(
                parity_ok=ok, compared=n, mean_abs_dlogprob=mean, diverged_at=div, mean_nll_rel_diff=rel,
                ppl_rel_diff=figs[label]["heldout_ppl"] / figs[ref_label]["heldout_ppl"] - 1)
            log("%-9s vs %-5s: parity %s over %d steps, mean |dlogprob| %.5f, diverged at %s, ppl %+.4f%%"
                % (label, ref_label, ok, n, mean, div, 100 * checks["%s_vs_%s" % (label, ref_label)]["ppl_rel_diff"]))
    c = checks["q8_0_sim_vs_fp32"]
    use = "fp32" if (c["parity_ok"] and c["mean_abs_dlogprob"] <= 0.015
                     and abs(c["ppl_rel_diff"]) <= 0.005) else "q8_0"
    steps = runs[use][0]
    gen_ids = [s["id"] for s in steps]
    longer, _ = greedy(W32, cfg, prompt, 160, device)
    samples = []
    g = torch.Generator(device=device).manual_seed(7)
    with torch.no_grad():
        for _ in range(3):
            ids = list(prompt)
            for _ in range(120):
                lg = forward(W32, cfg, torch.as_tensor([ids], device=device), last=True)[0, -1]
                ids.append(int(torch.multinomial(torch.softmax(lg / 0.8, -1), 1, generator=g).item()))
            samples.append(detok(pieces, ids[len(prompt):]))
    return {
        "schema": "strata-demo-reference/1",
        "model_file": "demo/strata-demo-Q8_0.gguf",
        "weights": use,
        "weights_note": ("PyTorch float32 (TF32 off) on the %s; the Q8_0 file's own rounding "
                         "is left to the tests' tolerance" %
                         ("trained float32 weights" if use == "fp32" else
                          "Q8_0-dequantised weights, because Q8_0 rounding used more than half "
                          "of the tolerance against the float32 weights")),
        "config": cfg,
        "params": int(sum(w.size for w in weights.values())),
        "perplexity": {"text_file": "demo/heldout.txt", "n_ctx": PPL_CTX, "tokens": int(len(heldout)),
                       "chunks": figs[use]["chunks"], "scored": figs[use]["scored"],
                       "mean_nll": figs[use]["heldout_mean_nll"], "ppl": figs[use]["heldout_ppl"],
                       "method": "ARCH.md 5b: text tokenised once with BOS; floor(N/n_ctx) chunks, "
                                 "each chunk's first token set to BOS; positions n_ctx/2..n_ctx-2 "
                                 "predict the next token; PPL = exp(mean NLL)"},
        "generation": {"prompt": PROMPT, "prompt_tokens": prompt, "tokens": gen_ids,
                       "text": detok(pieces, gen_ids), "steps": steps},
        "figures": figs,
        "checks": checks,
        "greedy_160": detok(pieces, [s["id"] for s in longer]),
        "samples_temp_0.8": samples,
        "training": info.get("training"),
    }


# ---- subcommands ----

def cmd_tokens(a):
    files = sorted(glob.glob(os.path.join(a.corpus, "train-*.txt")))
    if len(files) < 3:
        raise SystemExit("no corpus in %s: run demo_corpus.py first" % a.corpus)
    os.makedirs(a.out, exist_ok=True)
    jobs = [(f, os.path.basename(f)[:-4]) for f in files]
    jobs += [(os.path.join(a.corpus, "persuasion.txt"), "val-persuasion"), (a.heldout, "heldout")]
    prompt_file = os.path.join(a.out, "prompt.txt")
    with open(prompt_file, "w", encoding="utf-8") as f:
        f.write(PROMPT)
    jobs.append((prompt_file, "prompt"))
    total = 0
    for path, stem in jobs:
        t0 = time.time()
        ids = strata_tokenize(a.strata, a.vocab, path)
        write_u16(os.path.join(a.out, stem + ".u16"), ids)
        total += len(ids)
        print("%8d tokens %6.1fs  %s" % (len(ids), time.time() - t0, stem), file=sys.stderr)
    with open(a.vocab, "rb") as src, open(os.path.join(a.out, "vocab.gguf"), "wb") as dst:
        dst.write(src.read())
    print("%d tokens in %s" % (total, a.out), file=sys.stderr)


def train_run(cfg, run, stream, val, device, log, deadline):
    """One run of the sweep: AdamW, linear warm-up then cosine decay to 10%,
    bf16 autocast; validation perplexity (the tests' method) every eval_every
    steps. Returns (best val ppl, its weights as numpy arrays, a record)."""
    W = init_weights(cfg, device, run["seed"])
    cuda = device == "cuda"
    opt = torch.optim.AdamW([{"params": [w for w in W.values() if w.ndim == 2], "weight_decay": run["wd"]},
                             {"params": [w for w in W.values() if w.ndim == 1], "weight_decay": 0.0}],
                            lr=run["lr"], betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if cuda else {}))
    gen = torch.Generator(device=device).manual_seed(run["seed"])
    T, B = cfg["n_ctx"], run["batch"]
    off = torch.arange(T + 1, device=device)
    best, best_w, best_step, curve = float("inf"), None, 0, []
    t0 = time.time()
    for step in range(1, run["steps"] + 1):
        warm = run["warmup"]
        frac = max(0.0, (step - warm) / max(1, run["steps"] - warm))
        lr = run["lr"] * (step / warm if step <= warm else 0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        for grp in opt.param_groups:
            grp["lr"] = lr
        # Random windows of T+1 tokens; each input starts with BOS in place
        # of its first token, exactly as the perplexity chunks do.
        start = torch.randint(0, len(stream) - T - 1, (B,), device=device, generator=gen)
        w = stream[start[:, None] + off]
        x, y = w[:, :-1].clone(), w[:, 1:]
        x[:, 0] = BOS
        with autocast(cuda):
            logits = forward(W, cfg, x, dropout=run["dropout"], fast=cuda)
        loss = F.cross_entropy(logits.float().reshape(-1, cfg["n_vocab"]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(W.values()), 1.0)
        opt.step()
        last = step == run["steps"] or time.time() > deadline
        if step % run["eval_every"] == 0 or last:
            ppl = perplexity(W, cfg, val, PPL_CTX, device, fast=cuda)[0]
            curve.append((step, round(loss.item(), 4), round(ppl, 3)))
            log("run %-5s step %5d  loss %.4f  val ppl %8.3f  lr %.2e  %4.0fs"
                % (run["name"], step, loss.item(), ppl, lr, time.time() - t0))
            if ppl < best:
                best, best_step = ppl, step
                best_w = {t: v.detach().float().cpu().numpy().copy() for t, v in W.items()}
        if last:
            break
    rec = dict(run, best_val_ppl_bf16=best, best_step=best_step, steps_done=step,
               seconds=round(time.time() - t0, 1), curve=curve, tokens_seen=step * B * T)
    return best, best_w, rec


def cmd_train(a):
    t_start = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(a.out, exist_ok=True)
    logf = open(os.path.join(a.out, "train.log"), "w")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    cfg, sweep = dict(CONFIG), [dict(r) for r in SWEEP]
    if a.tiny:  # a small model for a few steps: checks the script end to end
        cfg.update(n_layer=2)
        sweep = [dict(SWEEP[0], steps=a.tiny, batch=2, warmup=2, eval_every=a.tiny)]
    parts = []
    for f in sorted(glob.glob(os.path.join(a.tokens, "train-*.u16"))):
        parts += [read_u16(f)] * (a.austen_weight if "austen" in os.path.basename(f) else 1)
    stream = torch.as_tensor(np.concatenate(parts)).to(device)
    val = read_u16(os.path.join(a.tokens, "val-persuasion.u16"))
    if a.tiny:
        val = val[:4 * PPL_CTX]
    log("device %s (%s), torch %s; train stream %d tokens (Austen x%d), val %d tokens"
        % (device, torch.cuda.get_device_name() if device == "cuda" else "cpu", torch.__version__,
           len(stream), a.austen_weight, len(val)))
    deadline = t_start + a.budget
    best, records, sec_per_step = float("inf"), [], None
    for run in sweep:
        left = deadline - time.time()
        if sec_per_step and run["steps"] * sec_per_step > left:
            # Shorten the run so that its schedule still completes in time.
            run["steps"] = int(left / sec_per_step)
            log("run %s shortened to %d steps to fit the time budget" % (run["name"], run["steps"]))
        if run["steps"] < 2 * run["warmup"]:
            log("run %s skipped: time budget spent" % run["name"])
            continue
        ppl, w, rec = train_run(cfg, run, stream, val, device, log, deadline)
        sec_per_step = 1.05 * rec["seconds"] / rec["steps_done"]
        records.append(rec)
        if ppl < best:
            best, best_w, chosen = ppl, w, run["name"]
    log("chosen: run %s, val ppl %.3f (bf16)" % (chosen, best))
    info = {"training": {"runs": records, "chosen": chosen, "austen_weight": a.austen_weight,
                         "train_stream_tokens": int(len(stream)), "device": device,
                         "train_seconds": round(time.time() - t_start, 1)}}
    save_weights(a.out, cfg, best_w, info)
    ref = make_reference(cfg, best_w, info, a.tokens, device, log, with_val=not a.tiny)
    with open(os.path.join(a.out, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    log("greedy: %r" % ref["generation"]["text"])
    log("greedy 160: %r" % ref["greedy_160"])
    for s in ref["samples_temp_0.8"]:
        log("sample: %r" % s)
    log("done in %.1fs" % (time.time() - t_start))


def cmd_reference(a):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg, weights, info = load_weights(a.weights)
    ref = make_reference(cfg, weights, info, a.tokens, device, print, with_val=a.val)
    with open(a.out, "w") as f:
        json.dump(ref, f, indent=1)


def cmd_export(a):
    cfg, weights, _ = load_weights(a.weights)
    _, vocab_raw, _ = gguf_read(a.vocab)
    for qt, path in ((QT_Q8_0, a.q8_0), (QT_F16, a.f16)):
        export_gguf(path, cfg, weights, qt, vocab_raw, "strata-demo")
        print("%s: %d bytes" % (path, os.path.getsize(path)), file=sys.stderr)


def cmd_selftest(a):
    cfg = dict(CONFIG, n_layer=1, n_vocab=64, n_ctx=32)
    W = init_weights(cfg, "cpu", 0)
    wnp = {t: w.detach().numpy() for t, w in W.items()}
    kv_raw = {"tokenizer.ggml.model": gguf_kv_str("tokenizer.ggml.model", "llama")}
    path = os.path.join(a.out, "demo-selftest.gguf")
    for qt in (QT_F16, QT_Q8_0):
        export_gguf(path, cfg, wnp, qt, kv_raw, "selftest")
        kv, _, tensors = gguf_read(path)
        assert kv["general.architecture"] == "llama" and kv["llama.block_count"] == 1
        assert kv["tokenizer.ggml.model"] == "llama"
        for t in tensor_names(cfg):
            qtype, ne, data = tensors[t]
            assert ne == list(reversed(wnp[t].shape)), t
            got = (np.frombuffer(data, np.float32) if qtype == QT_F32 else
                   np.frombuffer(data, np.float16).astype(np.float32) if qtype == QT_F16 else
                   q8_0_unpack(data, wnp[t].size))
            err = np.abs(got - wnp[t].reshape(-1)).max()
            bound = 0 if qtype == QT_F32 else np.abs(wnp[t]).max() * (1e-3 if qtype == QT_F16 else 1 / 200)
            assert err <= bound, (t, err, bound)
    x = np.zeros(64, np.float32)          # a zero block, then exact halves
    x[32:] = np.arange(32, dtype=np.float32) - 15.5
    b = np.frombuffer(q8_0_pack(x), dtype=[("d", "<f2"), ("q", "i1", 32)])
    assert b["d"][0] == 0 and not b["q"][0].any()
    assert b["q"][1][0] == -127 and b["q"][1][31] == 127
    print("selftest ok")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokens")
    t.add_argument("--strata", default="./strata")
    t.add_argument("--vocab", default="../shared/testdata/vocab/ggml-vocab-llama-spm.gguf")
    t.add_argument("--corpus", default="carry/demo-corpus")
    t.add_argument("--heldout", default="demo/heldout.txt")
    t.add_argument("--out", default="carry/demo-tokens")
    r = sub.add_parser("train")
    r.add_argument("--tokens", default="carry/demo-tokens")
    r.add_argument("--out", default="carry/demo-out")
    r.add_argument("--austen-weight", type=int, default=2, help="copies of Austen in the stream")
    r.add_argument("--budget", type=float, default=330, help="seconds of training at most")
    r.add_argument("--tiny", type=int, default=0, help="steps of a tiny smoke-test run")
    f = sub.add_parser("reference")
    f.add_argument("--weights", default="carry/demo-out")
    f.add_argument("--tokens", default="carry/demo-tokens")
    f.add_argument("--out", default="demo/reference.json")
    f.add_argument("--val", action="store_true", help="also the whole held-out novel")
    e = sub.add_parser("export")
    e.add_argument("--weights", default="carry/demo-out")
    e.add_argument("--vocab", default="../shared/testdata/vocab/ggml-vocab-llama-spm.gguf")
    e.add_argument("--q8_0", default="demo/strata-demo-Q8_0.gguf", help="the committed file")
    e.add_argument("--f16", default="carry/demo-out/strata-demo-F16.gguf", help="not committed (26 MB)")
    s = sub.add_parser("selftest")
    s.add_argument("--out", default="/tmp")
    a = ap.parse_args()
    {"tokens": cmd_tokens, "train": cmd_train, "reference": cmd_reference,
     "export": cmd_export, "selftest": cmd_selftest}[a.cmd](a)


if __name__ == "__main__":
    main()
