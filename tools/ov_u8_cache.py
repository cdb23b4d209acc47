"""u8 KV caches in OpenVINO 2026.4.1's own layout: drive the CPU plugin's built-in PagedAttention
with ``KV_CACHE_PRECISION=u8``, read the cache bytes back, and check them against a numpy model of
the conventions written in docs/contract.md ("u8 caches").

    .venv/bin/python tools/ov_u8_cache.py check            # random cases, every layout variant
    .venv/bin/python tools/ov_u8_cache.py mutations        # alternative conventions must disagree
    .venv/bin/python tools/ov_u8_cache.py attention        # its output vs float64 over dequantized caches
    .venv/bin/python tools/ov_u8_cache.py fixtures DIR     # write the golden byte fixtures

Layouts (block size BS = 32, the only one the CPU plugin runs; D = head size; G = group size):
- key cache, by channel (the default): ``u8 [NB, Hkv, BS + 8, D]``. Per (block, head): bytes
  ``0..4D`` are f32 scale[D], ``4D..8D`` f32 zero point[D], then row ``t`` of the block's tokens at
  byte ``8D + t*D``. KEY_CACHE_GROUP_SIZE does not change it (the group is the block).
- value cache, and key cache with ``KEY_CACHE_QUANT_MODE=BY_TOKEN``: ``u8 [NB, Hkv, BS, D + 8*D/G]``
  (G = D when the group size is 0). Each token row is ``D/G`` groups of ``[f32 scale][f32 zp][G bytes]``.

The numpy model below is the independent check of our Rust code (src/kernel/quant.rs): the Rust
tests compare against the bytes written by OpenVINO that ``fixtures`` stores.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

import openvino as ov

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ov_builtin import build_model, infer  # noqa: E402

BS = 32
F32 = np.float32


def u8_config(key_group=0, value_group=0, key_by_token=False, threads=1):
    cfg = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "u8",
           "KEY_CACHE_GROUP_SIZE": str(key_group), "VALUE_CACHE_GROUP_SIZE": str(value_group),
           "INFERENCE_NUM_THREADS": str(threads)}
    if key_by_token:
        cfg["KEY_CACHE_QUANT_MODE"] = "BY_TOKEN"
    return cfg


def token_row_bytes(D, group):
    g = group or D
    return D + 8 * (D // g)


def cache_shapes(NB, Hkv, D, key_group=0, value_group=0, key_by_token=False, Dv=None):
    v = (NB, Hkv, BS, token_row_bytes(D if Dv is None else Dv, value_group))  # Dv: value head size
    k = (NB, Hkv, BS, token_row_bytes(D, key_group)) if key_by_token else (NB, Hkv, BS + 8, D)
    return k, v


def plugin_shapes(Hkv, D, cfg):
    """The cache ports' partial shapes the plugin reports after compiling with ``cfg``."""
    model = build_model(Hkv, Hkv, D, ov.Type.dynamic)
    c = ov.Core().compile_model(model, "CPU", cfg)
    return [(str(c.input(i).get_element_type()), str(c.input(i).get_partial_shape())) for i in (3, 4)]


def run_quant(D, key, value, kc, vc, past_lens, subsequence_begins, block_indices,
           block_indices_begins, cfg, query=None, H=None, with_scores=False):
    """One call of the built-in op on u8 caches ``kc``/``vc`` (copied, not modified), scores over
    each sequence's new tokens. Returns (output, key_cache_after, value_cache_after), or
    ((output, scores), ...) with ``with_scores``."""
    Hkv = kc.shape[1]
    H = H or Hkv
    T = key.shape[0]
    Dv = value.shape[1] // Hkv  # the value head size, D unless the model's differs
    if query is None:
        query = np.zeros([T, H * D], F32)
    kc = np.array(kc, dtype=np.uint8, order="C", copy=True)
    vc = np.array(vc, dtype=np.uint8, order="C", copy=True)
    past = np.asarray(past_lens, np.int32)
    sb = np.asarray(subsequence_begins, np.int32)
    n = np.diff(sb)
    feeds = [np.ascontiguousarray(query, F32), np.ascontiguousarray(key, F32),
             np.ascontiguousarray(value, F32), kc, vc, past, sb,
             np.asarray(block_indices, np.int32), np.asarray(block_indices_begins, np.int32),
             np.array(0, F32), np.array(0, np.int32), np.zeros([0], F32),
             np.array(int((past + n).max()), np.int32), np.ascontiguousarray(n, np.int32),
             np.zeros([0], np.int32), np.zeros([0, 1], np.int32), np.zeros([0, D], F32)]
    model = build_model(H, Hkv, D, ov.Type.dynamic, Dv=Dv)
    out, scores = infer(model, feeds, cfg)
    return ((out, scores) if with_scores else out), kc, vc


# ---------------------------------------------------------------------------------------------
# numpy model of the conventions (float32 arithmetic, fused multiply-add emulated in float64:
# the product of two f32 is exact in f64, the one rounding of the sum happens in f64 then f32).

def _fused(a, b, c):
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(F32)


def _fma(a, b, c):
    if ALT["fma"] == "unfused":
        return ((a * b).astype(F32) + c).astype(F32)
    return _fused(a, b, c)


# Alternative readings of the conventions; `mutations` shows each one disagrees with OpenVINO.
ALT = {"round": "even", "key_scale": "recip", "growth": "requant", "fma": "fused"}


def _to_u8(v):
    # round half to even, clamp at 0, saturate at 255
    r = np.rint(v) if ALT["round"] == "even" else _round_away(v)
    return np.clip(r, 0, 255).astype(np.uint8)


def _round_away(v):
    return np.where(v >= 0, np.floor(v + 0.5), np.ceil(v - 0.5))


def _scalar_u8(x, scale, zp):
    # the plugin's scalar tail: a true division, clamp at 0, std::round (half away from zero)
    v = np.maximum((x / scale).astype(F32) + zp, F32(0)).astype(F32)
    return np.clip(_round_away(v), 0, 255).astype(np.uint8)


def quant_token(x):
    """One group of one token -> (bytes, scale, zp). The first multiple of 16 elements take the
    AVX-512 path (multiply by the f32 reciprocal, fused add, round half to even); the rest, the
    scalar tail."""
    x = np.asarray(x, F32)
    mn, mx = x.min(), x.max()
    scale = F32(F32(mx - mn) / F32(255))
    if scale == 0:
        scale = F32(0.0001)
    zp = F32(-mn / scale)
    inv = F32(F32(1) / scale)
    v = x.size - x.size % 16
    q = np.empty(x.size, np.uint8)
    q[:v] = _to_u8(_fma(x[:v], np.full(v, inv, F32), np.full(v, zp, F32)))
    q[v:] = _scalar_u8(x[v:], scale, zp)
    return q, scale, zp


def quant_channel(rows):
    """[n, D] keys of one block -> (bytes [n, D], scale[D], zp[D]). Columns go 16 at a time
    (AVX-512), then 8 (AVX2), both: scale = (max - min) * f32(1/255), reciprocal, fused add, round
    half to even; the last D % 8 columns take the scalar path: scale = (max - min) / 255, a true
    division, round half away from zero."""
    rows = np.asarray(rows, F32)
    D = rows.shape[1]
    v = D - D % 8
    mn, mx = rows.min(0), rows.max(0)
    scale = np.empty(D, F32)
    if ALT["key_scale"] == "recip":
        scale[:v] = (mx[:v] - mn[:v]).astype(F32) * F32(1.0 / 255)
    else:
        scale[:v] = (mx[:v] - mn[:v]).astype(F32) / F32(255)
    scale[v:] = (mx[v:] - mn[v:]).astype(F32) / F32(255)
    scale = np.where(scale == 0, scale + F32(0.0001), scale).astype(F32)
    zp = (-mn / scale).astype(F32)
    inv = (F32(1) / scale).astype(F32)
    q = np.empty(rows.shape, np.uint8)
    q[:, :v] = _to_u8(_fma(rows[:, :v], np.broadcast_to(inv[:v], rows[:, :v].shape),
                           np.broadcast_to(zp[:v], rows[:, :v].shape)))
    q[:, v:] = _scalar_u8(rows[:, v:], scale[v:], zp[v:])
    return q, scale, zp


def dequant(q, scale, zp):
    return ((np.asarray(q, F32) - zp).astype(F32) * scale).astype(F32)


def write_token_row(row_bytes, x, group):
    D = x.shape[0]
    g = group or D
    for i in range(D // g):
        q, s, z = quant_token(x[i * g:(i + 1) * g])
        base = i * (g + 8)
        row_bytes[base:base + 4] = np.frombuffer(F32(s).tobytes(), np.uint8)
        row_bytes[base + 4:base + 8] = np.frombuffer(F32(z).tobytes(), np.uint8)
        row_bytes[base + 8:base + 8 + g] = q


def read_token_row(row_bytes, D, group):
    g = group or D
    out = np.empty(D, F32)
    for i in range(D // g):
        base = i * (g + 8)
        s = row_bytes[base:base + 4].view(F32)[0]
        z = row_bytes[base + 4:base + 8].view(F32)[0]
        out[i * g:(i + 1) * g] = dequant(row_bytes[base + 8:base + 8 + g], s, z)
    return out


def channel_block_params(block):
    """block: u8 [BS + 8, D] -> (scale[D], zp[D], rows u8 [BS, D])."""
    D = block.shape[1]
    flat = block.reshape(-1)
    return flat[:4 * D].view(F32), flat[4 * D:8 * D].view(F32), block[8:]


def insert_model(key, value, kc, vc, past_lens, sb, bi, bib, key_group=0, value_group=0,
                 key_by_token=False):
    """Our reading of OpenVINO's insertion, in numpy: returns new (kc, vc)."""
    kc = kc.copy()
    vc = vc.copy()
    Hkv = kc.shape[1]
    D = key.shape[1] // Hkv
    for s in range(len(past_lens)):
        past = int(past_lens[s])
        n = int(sb[s + 1] - sb[s])
        for i in range(n):
            p = past + i
            blk = bi[bib[s] + p // BS]
            for h in range(Hkv):
                write_token_row(vc[blk, h, p % BS], value[sb[s] + i, h * D:(h + 1) * D], value_group)
                if key_by_token:
                    write_token_row(kc[blk, h, p % BS], key[sb[s] + i, h * D:(h + 1) * D], key_group)
        if key_by_token:
            continue
        # by channel: every block touched gets requantized over all its tokens; a block that
        # already held tokens contributes them dequantized
        p = past
        while p < past + n:
            j = p // BS
            lo = p % BS
            hi = min(BS, lo + past + n - p)
            blk = bi[bib[s] + j]
            for h in range(Hkv):
                scale, zp, rows = channel_block_params(kc[blk, h])
                prev = dequant(rows[:lo], scale, zp)
                new = key[sb[s] + (p - past):sb[s] + (p - past) + (hi - lo), h * D:(h + 1) * D]
                if ALT["growth"] == "fixed" and lo > 0:
                    # alternative: the range is fixed at the block's first insertion
                    inv = (F32(1) / scale).astype(F32)
                    kc[blk, h, 8 + lo:8 + hi] = _to_u8(_fma(new.astype(F32), np.broadcast_to(inv, new.shape),
                                                            np.broadcast_to(zp, new.shape)))
                    continue
                q, s2, z2 = quant_channel(np.concatenate([prev, new.astype(F32)]))
                flat = kc[blk, h].reshape(-1)
                flat[:4 * D] = np.frombuffer(s2.astype(F32).tobytes(), np.uint8)
                flat[4 * D:8 * D] = np.frombuffer(z2.astype(F32).tobytes(), np.uint8)
                kc[blk, h, 8:8 + hi] = q
            p += hi - lo
    return kc, vc


def dequantize_caches(kc, vc, D, Dv, key_group=0, value_group=0, key_by_token=False):
    """u8 caches of any layout -> float64 ``[NB, Hkv, BS, D]`` keys and ``[NB, Hkv, BS, Dv]`` values."""
    NB, Hkv = kc.shape[:2]
    kd = np.zeros((NB, Hkv, BS, D), np.float64)
    vd = np.zeros((NB, Hkv, BS, Dv), np.float64)
    for b in range(NB):
        for h in range(Hkv):
            if key_by_token:
                for t in range(BS):
                    kd[b, h, t] = read_token_row(kc[b, h, t], D, key_group)
            else:
                scale, zp, rows = channel_block_params(kc[b, h])
                kd[b, h] = dequant(rows, scale, zp)
            for t in range(BS):
                vd[b, h, t] = read_token_row(vc[b, h, t], Dv, value_group)
    return kd, vd


def attention_over_dequantized(query, key_shape, kc, vc, past_lens, sb, bi, bib, score_window,
                               Dv=None, key_group=0, value_group=0, key_by_token=False):
    """Float64 attention (tools/pa_ref.py) over u8 caches after a call, dequantized: the call's new
    keys and values are read back from their slots, so the reference re-inserts exactly what the
    caches hold. ``key_shape`` is the key input's ``[T, Hkv * D]``; ``Dv`` the value head size (D
    when not given); the layout arguments as for ``u8_config``. Returns (output, scores)."""
    D = key_shape[1] // kc.shape[1]
    Dv = D if Dv is None else Dv
    kd, vd = dequantize_caches(kc, vc, D, Dv, key_group, value_group, key_by_token)
    return attention_over(query, key_shape, kd, vd, past_lens, sb, bi, bib, score_window)


def attention_over(query, key_shape, kd, vd, past_lens, sb, bi, bib, score_window):
    """Float64 attention over dequantized caches ``kd`` ``[NB, Hkv, BS, D]`` and ``vd``
    ``[NB, Hkv, BS, Dv]`` (any quantized type), the call's new keys and values read back from
    their slots. Returns (output, scores)."""
    from pa_ref import paged_attention_ref
    Hkv, Dv = kd.shape[1], vd.shape[3]
    key = np.zeros(key_shape, np.float64)
    value = np.zeros((key_shape[0], Hkv * Dv), np.float64)
    for s in range(len(past_lens)):
        for i in range(int(sb[s + 1] - sb[s])):
            pos = int(past_lens[s]) + i
            blk = bi[bib[s] + pos // BS]
            key[sb[s] + i] = kd[blk, :, pos % BS].reshape(-1)
            value[sb[s] + i] = vd[blk, :, pos % BS].reshape(-1)
    out, scores, _, _ = paged_attention_ref(
        np.asarray(query, np.float64), key, value, kd, vd, past_lens, sb, bi, bib,
        None, None, None, None, None, None, score_window)
    return out, scores


def key_row_mask(held):
    """Rows of a by-channel key cache ``[NB, Hkv, BS + 8]`` from a slot mask ``[NB, Hkv, BS]``:
    a token row as its slot, the 8 parameter rows when any slot of the block is set."""
    return np.concatenate([np.repeat(held.any(2, keepdims=True), 8, 2), held], 2)


def token_mask(kc_shape, past_lens, sb, bi, bib):
    """[NB, Hkv, BS] slots that hold a token after the call."""
    m = np.zeros((kc_shape[0], kc_shape[1], BS), bool)
    for s in range(len(past_lens)):
        total = int(past_lens[s] + sb[s + 1] - sb[s])
        for p in range(total):
            m[bi[bib[s] + p // BS], :, p % BS] = True
    return m


# ---------------------------------------------------------------------------------------------

def _fma_sensitive_groups(rng, count, g=16):
    """``count`` random groups of ``g`` values (by token) whose bytes differ when the multiply-add
    is not fused: only such data tells a fused from an unfused quantizer (about 1 group in 1e5)."""
    found = []
    while sum(len(f) for f in found) < count:
        x = rng.normal(0, 1, (1 << 18, g)).astype(F32)
        mn, mx = x.min(1), x.max(1)
        scale = ((mx - mn) / F32(255)).astype(F32)
        zp = (-mn / scale).astype(F32)
        inv = (F32(1) / scale).astype(F32)
        fused = _fused(x, inv[:, None] + np.zeros_like(x), zp[:, None] + np.zeros_like(x))
        unfused = ((x * inv[:, None]).astype(F32) + zp[:, None]).astype(F32)
        found.append(x[(np.rint(fused) != np.rint(unfused)).any(1)])
    return np.concatenate(found)[:count]


def _fma_sensitive_columns(rng, count, n):
    """``count`` key columns of ``n`` tokens (by channel) with the same property."""
    found = []
    while sum(len(f) for f in found) < count:
        x = rng.normal(0, 1, (1 << 18, n)).astype(F32)
        mn, mx = x.min(1), x.max(1)
        scale = ((mx - mn) * F32(1.0 / 255)).astype(F32)
        zp = (-mn / scale).astype(F32)
        inv = (F32(1) / scale).astype(F32)
        fused = _fused(x, inv[:, None] + np.zeros_like(x), zp[:, None] + np.zeros_like(x))
        unfused = ((x * inv[:, None]).astype(F32) + zp[:, None]).astype(F32)
        found.append(x[(np.rint(fused) != np.rint(unfused)).any(1)])
    return np.concatenate(found)[:count]


def make_case(rng, Hkv, D, steps, NB=None, spread=1.0, kind="normal"):
    """steps: list of per-step [(past, new), ...] per sequence; sequences keep their blocks."""
    nseq = len(steps[0])
    final = [max(p + n for st in steps for (p, n) in [st[s]]) for s in range(nseq)]
    blocks_per = [(t + BS - 1) // BS for t in final]
    NB = NB or sum(blocks_per) + 1
    perm = rng.permutation(NB)[:sum(blocks_per)]
    bi = perm.astype(np.int32)
    bib = np.concatenate([[0], np.cumsum(blocks_per)]).astype(np.int32)
    calls = []
    for st in steps:
        n = [x[1] for x in st]
        T = sum(n)
        if kind in ("fma_channel", "fma_token"):
            # one prefill step; values (and by-token keys) in groups of 16
            value = _fma_sensitive_groups(rng, T * Hkv * D // 16).reshape(T, Hkv * D)
            if kind == "fma_token":
                key = _fma_sensitive_groups(rng, T * Hkv * D // 16).reshape(T, Hkv * D)
            else:
                key = _fma_sensitive_columns(rng, Hkv * D, T).T.copy()
        elif kind == "normal":
            key = rng.normal(0, spread, (T, Hkv * D)).astype(F32)
            value = rng.normal(0, spread, (T, Hkv * D)).astype(F32)
        elif kind == "ties":  # range [0, 255] per token and per channel: scale 1, x + zp on .5
            key = (rng.integers(0, 255, (T, Hkv * D)) + 0.5).astype(F32)
            key[:, 0::D], key[:, 1::D] = 0, 255
            key[0, :], key[-1, :] = 0, 255
            value = key[::-1].copy()
        else:  # integers and ties: values on a coarse grid, constant channels
            key = rng.integers(-4, 5, (T, Hkv * D)).astype(F32) * F32(0.5)
            value = rng.integers(-4, 5, (T, Hkv * D)).astype(F32) * F32(0.5)
            key[:, ::7] = 1.25
            value[:, 3::5] = -2.0
        calls.append(dict(key=key, value=value,
                          past_lens=np.array([x[0] for x in st], np.int32),
                          subsequence_begins=np.concatenate([[0], np.cumsum(n)]).astype(np.int32),
                          block_indices=bi, block_indices_begins=bib))
    return NB, calls


VARIANTS = {
    "default": dict(),
    "vgroup16": dict(value_group=16),
    "kgroup16_bychannel": dict(key_group=16),
    "key_by_token": dict(key_by_token=True),
    "key_by_token_g16_vg32": dict(key_by_token=True, key_group=16, value_group=32),
    "key_by_token_g8_vg8": dict(key_by_token=True, key_group=8, value_group=8),
    "key_by_token_g16_vg16": dict(key_by_token=True, key_group=16, value_group=16),
}


def runs_on_plugin(D, v):
    """The plugin refuses (at compile time) a group size that does not divide D."""
    return all(D % g == 0 for g in (v.get("key_group", 0) or D, v.get("value_group", 0) or D))

SCENARIOS = {
    # (Hkv, D, steps)
    "prefill_5": (2, 64, [[(0, 5)]]),
    "prefill_32": (2, 64, [[(0, 32)]]),
    "prefill_70": (2, 64, [[(0, 70)]]),
    "prefill_then_decode": (2, 64, [[(0, 5)], [(5, 1)], [(6, 1)]]),
    "decode_crosses_block": (1, 64, [[(0, 31)], [(31, 1)], [(32, 1)]]),
    "chunked_prefill": (1, 64, [[(0, 20)], [(20, 50)]]),
    "two_seqs_mixed": (2, 32, [[(0, 9), (0, 40)], [(9, 3), (40, 1)]]),
    # head sizes that leave a tail after the 16-wide (and 8-wide) vector loops
    "head40": (1, 40, [[(0, 10)], [(10, 3)]]),
    "head20": (1, 20, [[(0, 10)], [(10, 3)]]),
    "head8": (1, 8, [[(0, 10)], [(10, 3)]]),
    "prefill_8": (1, 64, [[(0, 8)]]),
}


def run_scenario(rng, name, variant, kind="normal", spread=1.0):
    Hkv, D, steps = SCENARIOS[name]
    v = VARIANTS[variant]
    NB, calls = make_case(rng, Hkv, D, steps, spread=spread, kind=kind)
    ks, vs = cache_shapes(NB, Hkv, D, **v)
    kc = np.zeros(ks, np.uint8)
    vc = np.zeros(vs, np.uint8)
    cfg = u8_config(**v)
    records = []
    for c in calls:
        _, kc2, vc2 = run_quant(D, c["key"], c["value"], kc, vc, c["past_lens"],
                               c["subsequence_begins"], c["block_indices"],
                               c["block_indices_begins"], cfg)
        records.append(dict(call=c, kc_before=kc, vc_before=vc, kc_after=kc2, vc_after=vc2))
        kc, vc = kc2, vc2
    return D, v, records


def compare(D, v, rec):
    c = rec["call"]
    km, vm = insert_model(c["key"], c["value"], rec["kc_before"], rec["vc_before"], c["past_lens"],
                          c["subsequence_begins"], c["block_indices"], c["block_indices_begins"], **v)
    mask = token_mask(rec["kc_before"].shape, c["past_lens"], c["subsequence_begins"],
                      c["block_indices"], c["block_indices_begins"])
    vd = (vm != rec["vc_after"])[mask]
    if v.get("key_by_token"):
        kd = (km != rec["kc_after"])[mask]
        kparam = 0
    else:
        kd = (km[:, :, 8:] != rec["kc_after"][:, :, 8:])[mask]
        kparam = int((km[:, :, :8] != rec["kc_after"][:, :, :8]).sum())
    return int(kd.sum()), kparam, int(vd.sum())


def main_check():
    rng = np.random.default_rng(1)
    for variant, v in VARIANTS.items():
        print(variant, plugin_shapes(2, 64, u8_config(**v)))
    bad = 0
    for kind, spread in (("normal", 1.0), ("normal", 1e-3), ("grid", 1.0), ("ties", 1.0)):
        for variant in VARIANTS:
            for name in SCENARIOS:
                if not runs_on_plugin(SCENARIOS[name][1], VARIANTS[variant]):
                    continue
                D, v, recs = run_scenario(rng, name, variant, kind, spread)
                diffs = [compare(D, v, r) for r in recs]
                flag = "" if all(d == (0, 0, 0) for d in diffs) else "  <-- DIFF"
                bad += bool(flag)
                print(f"{kind:6} {spread:6g} {variant:22} {name:22} "
                      f"(key data, key params, value) byte diffs per step: {diffs}{flag}")
    print("mismatching runs:", bad)
    return bad


def main_mutations():
    """Each alternative reading must disagree with OpenVINO somewhere, or the check proves nothing."""
    silent = 0
    for key, alt in (("round", "away"), ("key_scale", "div"), ("growth", "fixed"), ("fma", "unfused")):
        rng = np.random.default_rng(2)
        ALT[key] = alt
        n_diff = 0
        runs = [(k, n, "default") for k in ("normal", "grid", "ties") for n in SCENARIOS]
        runs += [("fma_channel", "prefill_8", "vgroup16"), ("fma_token", "prefill_8", "key_by_token_g16_vg16")]
        for kind, name, variant in runs:
            D, v, recs = run_scenario(rng, name, variant, kind)
            n_diff += sum(compare(D, v, r) != (0, 0, 0) for r in recs)
        ALT[key] = {"round": "even", "key_scale": "recip", "growth": "requant", "fma": "fused"}[key]
        print(f"alternative {key}={alt}: {n_diff} mismatching steps")
        silent += n_diff == 0
    return silent


def main_attention():
    """OpenVINO's output on u8 caches vs float64 attention over the caches dequantized by this
    model's formula (one sequence: a 40-token prefill, then a decode; H = 4, Hkv = 2, D = 64)."""
    rng = np.random.default_rng(4)
    worst_all = 0.0
    for variant in ("default", "key_by_token", "vgroup16"):
        v = VARIANTS[variant]
        Hkv, D, H = 2, 64, 4
        NB, calls = make_case(rng, Hkv, D, [[(0, 40)], [(40, 1)]])
        ks, vs = cache_shapes(NB, Hkv, D, **v)
        kc, vc = np.zeros(ks, np.uint8), np.zeros(vs, np.uint8)
        worst = 0.0
        for c in calls:
            T = c["key"].shape[0]
            q = rng.normal(0, 1, (T, H * D)).astype(F32)
            out, kc, vc = run_quant(D, c["key"], c["value"], kc, vc, c["past_lens"],
                                 c["subsequence_begins"], c["block_indices"],
                                 c["block_indices_begins"], u8_config(**v), query=q, H=H)
            past, bi = int(c["past_lens"][0]), c["block_indices"]
            K = np.zeros((Hkv, past + T, D))
            V = np.zeros((Hkv, past + T, D))
            for p in range(past + T):
                b = bi[p // BS]
                for h in range(Hkv):
                    V[h, p] = read_token_row(vc[b, h, p % BS], D, v.get("value_group", 0))
                    if v.get("key_by_token"):
                        K[h, p] = read_token_row(kc[b, h, p % BS], D, v.get("key_group", 0))
                    else:
                        s, z, rows = channel_block_params(kc[b, h])
                        K[h, p] = dequant(rows[p % BS], s, z)
            for i in range(T):
                for hh in range(H):
                    kv = hh // (H // Hkv)
                    sc = K[kv, :past + i + 1] @ q[i, hh * D:(hh + 1) * D].astype(np.float64) / np.sqrt(D)
                    w = np.exp(sc - sc.max())
                    ref = (w / w.sum()) @ V[kv, :past + i + 1]
                    worst = max(worst, float(np.abs(out[i, hh * D:(hh + 1) * D] - ref).max()))
        print(f"{variant}: max |OpenVINO output - float64 over dequantized caches| = {worst:.2e}")
        worst_all = max(worst_all, worst)
    return worst_all > 1e-5


FIXTURES = [
    # (fixture name, scenario, variant, kind, spread)
    ("default_prefill_then_decode", "prefill_then_decode", "default", "normal", 1.0),
    ("default_chunked_prefill", "chunked_prefill", "default", "normal", 1.0),
    ("default_two_seqs_mixed", "two_seqs_mixed", "default", "normal", 1.0),
    ("default_decode_crosses_block", "decode_crosses_block", "default", "grid", 1.0),
    ("vgroup16_prefill_70", "prefill_70", "vgroup16", "normal", 1.0),
    ("key_by_token_g16_vg32_mixed", "two_seqs_mixed", "key_by_token_g16_vg32", "grid", 1.0),
    ("default_prefill_then_decode_ties", "prefill_then_decode", "default", "ties", 1.0),
    ("default_head20_ties", "head20", "default", "ties", 1.0),
    ("key_by_token_g8_vg8_head40_ties", "head40", "key_by_token_g8_vg8", "ties", 1.0),
    ("vgroup16_fma_sensitive", "prefill_8", "vgroup16", "fma_channel", 1.0),
    ("key_by_token_g16_vg16_fma_sensitive", "prefill_8", "key_by_token_g16_vg16", "fma_token", 1.0),
]


def main_fixtures(outdir):
    rng = np.random.default_rng(7)
    for fname, scen, variant, kind, spread in FIXTURES:
        D, v, recs = run_scenario(rng, scen, variant, kind, spread)
        d = os.path.join(outdir, fname)
        os.makedirs(d, exist_ok=True)
        for i, r in enumerate(recs):
            if compare(D, v, r) != (0, 0, 0):
                raise SystemExit(f"{fname} step {i}: OpenVINO differs from the numpy model")
            c = r["call"]
            for k in ("key", "value", "past_lens", "subsequence_begins", "block_indices",
                      "block_indices_begins"):
                np.save(os.path.join(d, f"step{i}_{k}.npy"), c[k])
            np.save(os.path.join(d, f"step{i}_key_cache_after.npy"), r["kc_after"])
            np.save(os.path.join(d, f"step{i}_value_cache_after.npy"), r["vc_after"])
        meta = dict(D=D, Hkv=int(recs[0]["kc_before"].shape[1]), NB=int(recs[0]["kc_before"].shape[0]),
                    steps=len(recs), key_by_token=bool(v.get("key_by_token", False)),
                    key_group=int(v.get("key_group", 0)), value_group=int(v.get("value_group", 0)),
                    source="OpenVINO 2026.4.1 CPU plugin, built-in PagedAttentionExtension, "
                           f"config {u8_config(**v)}; caches start as zeros",
                    generator="python tools/ov_u8_cache.py fixtures cli/tests/data/u8_cache")
        with open(os.path.join(d, "case.json"), "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.write("\n")
        print("wrote", d)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "check":
        sys.exit(1 if main_check() else 0)
    if len(sys.argv) >= 2 and sys.argv[1] == "attention":
        sys.exit(1 if main_attention() else 0)
    if len(sys.argv) >= 2 and sys.argv[1] == "mutations":
        sys.exit(1 if main_mutations() else 0)
    if len(sys.argv) == 3 and sys.argv[1] == "fixtures":
        main_fixtures(sys.argv[2])
        sys.exit(0)
    print(__doc__)
    sys.exit(2)
