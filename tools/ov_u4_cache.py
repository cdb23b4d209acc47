"""u4 KV caches in OpenVINO 2026.4.1's own layout: drive the CPU plugin's built-in PagedAttention
with ``KV_CACHE_PRECISION=u4``, read the cache bytes back, and check them against a numpy model of
the conventions written in docs/contract.md ("u4 caches").

    .venv/bin/python tools/ov_u4_cache.py check        # random cases, every layout variant
    .venv/bin/python tools/ov_u4_cache.py mutations    # alternative conventions must disagree

The layouts are u8's (tools/ov_u8_cache.py) with every quantized value a nibble, two per byte, the
even element in the high nibble, and the parameters (f32 scale, f32 zero point) kept as 8 bytes:
- key cache, by channel: ``u4 [NB, Hkv, BS + 16, D]`` = bytes ``[NB, Hkv, 8*D + BS*D/2]`` per slab:
  f32 scale[D], f32 zero point[D], then row ``t`` of nibbles at byte ``8D + t*D/2``.
- value cache, and key cache with ``KEY_CACHE_QUANT_MODE=BY_TOKEN``: ``u4 [NB, Hkv, BS, D + 16*D/G]``;
  each token row is ``D/G`` groups of ``[f32 scale][f32 zp][G/2 bytes]``.
Quantization: scale = (max - min) / 15 (0 -> 0.0001), zp = -min / scale, nibble =
min(15, max(0, round(x * (1/scale) + zp))) with the same vector/scalar split as u8 (see
ov_u8_cache.py): the leading multiple of 16 (by token) or 8 (by channel) elements round half to
even after a fused multiply-add, the rest take a true division and round half away from zero.

A u4 ov.Tensor wraps our u8 byte arrays (packed), so the plugin's writes land in them.
"""
from __future__ import annotations

import os
import sys

import numpy as np

import openvino as ov

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ov_builtin import build_model, _get_core  # noqa: E402
from ov_u8_cache import (BS, F32, SCENARIOS, VARIANTS, _fused, _round_away, make_case,  # noqa: E402
                         runs_on_plugin, token_mask)

LEVELS = 15
# Alternative readings of the conventions; `mutations` shows each one disagrees with OpenVINO.
ALT = {"nibble": "high_first", "round": "even", "key_scale": "recip", "growth": "requant",
       "channel_quant_vec": 16}


def u4_config(key_group=0, value_group=0, key_by_token=False, threads=1):
    cfg = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "u4",
           "KEY_CACHE_GROUP_SIZE": str(key_group), "VALUE_CACHE_GROUP_SIZE": str(value_group),
           "INFERENCE_NUM_THREADS": str(threads)}
    if key_by_token:
        cfg["KEY_CACHE_QUANT_MODE"] = "BY_TOKEN"
    return cfg


def token_row_bytes(D, group):
    g = group or D
    return D // 2 + 8 * (D // g)


def cache_shapes(NB, Hkv, D, key_group=0, value_group=0, key_by_token=False, Dv=None):
    """Byte shapes of the caches (u8 arrays holding the packed u4 tensors)."""
    v = (NB, Hkv, BS, token_row_bytes(D if Dv is None else Dv, value_group))  # Dv: value head size
    k = (NB, Hkv, BS, token_row_bytes(D, key_group)) if key_by_token else (NB, Hkv, BS + 16, D // 2)
    return k, v


def u4_dims(shape):
    """The u4 tensor shape of a byte array shape (the last dimension counts nibbles)."""
    return list(shape[:-1]) + [2 * shape[-1]]


def run_u4(D, key, value, kc, vc, past_lens, subsequence_begins, block_indices,
           block_indices_begins, cfg, query=None, H=None, with_scores=False, rotation=None):
    """One call of the built-in op on u4 caches ``kc``/``vc`` (byte arrays, copied, not modified),
    scores over each sequence's new tokens. Returns (output, key_cache_after, value_cache_after).
    ``rotation``: (rotated_block_indices, rotation_deltas [R, 1|BS], lut [M, D]) or None."""
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
    if rotation is None:
        rotation = (np.zeros([0], np.int32), np.zeros([0, 1], np.int32), np.zeros([0, D], F32))
    rbi, rd, lut = (np.ascontiguousarray(a) for a in rotation)
    feeds = [np.ascontiguousarray(query, F32), np.ascontiguousarray(key, F32),
             np.ascontiguousarray(value, F32), kc, vc, past, sb,
             np.asarray(block_indices, np.int32), np.asarray(block_indices_begins, np.int32),
             np.array(0, F32), np.array(0, np.int32), np.zeros([0], F32),
             np.array(int((past + n).max()), np.int32), np.ascontiguousarray(n, np.int32),
             rbi.astype(np.int32), rd.astype(np.int32), lut.astype(F32)]
    model = build_model(H, Hkv, D, ov.Type.dynamic, Dv=Dv)
    compiled = _get_core().compile_model(model, "CPU", cfg)
    req = compiled.create_infer_request()
    tensors = []
    for i, a in enumerate(feeds):
        if i in (3, 4):
            t = ov.Tensor(a, u4_dims(a.shape), ov.Type.u4)
        else:
            t = ov.Tensor(a, shared_memory=True)
        tensors.append(t)
        req.set_input_tensor(i, t)
    req.infer()
    out = np.array(req.get_output_tensor(0).data, dtype=np.float32, copy=True)
    scores = np.array(req.get_output_tensor(1).data, dtype=np.float32, copy=True)
    del req, compiled, tensors
    return ((out, scores) if with_scores else out), kc, vc


# ---------------------------------------------------------------------------------------------
# numpy model

def pack(q):
    """Nibbles [..., 2n] -> bytes [..., n]: element 2i in the high nibble of byte i."""
    q = np.asarray(q, np.uint8)
    hi, lo = q[..., 0::2], q[..., 1::2]
    if ALT["nibble"] == "low_first":
        hi, lo = lo, hi
    return ((hi << 4) | lo).astype(np.uint8)


def unpack(b):
    b = np.asarray(b, np.uint8)
    out = np.empty(b.shape[:-1] + (2 * b.shape[-1],), np.uint8)
    out[..., 0::2], out[..., 1::2] = b >> 4, b & 15
    return out


def _to_u4(v):
    r = np.rint(v) if ALT["round"] == "even" else _round_away(v)
    return np.clip(np.nan_to_num(r, nan=0.0, posinf=0.0, neginf=0.0), 0, LEVELS).astype(np.uint8)


def _scalar_u4(x, scale, zp):
    v = np.maximum((x / scale).astype(F32) + zp, F32(0)).astype(F32)
    return np.clip(_round_away(v), 0, LEVELS).astype(np.uint8)


def quant_token(x):
    x = np.asarray(x, F32)
    mn, mx = x.min(), x.max()
    scale = F32(F32(mx - mn) / F32(LEVELS))
    if scale == 0:
        scale = F32(0.0001)
    zp = F32(-mn / scale)
    inv = F32(F32(1) / scale)
    v = x.size - x.size % 16
    q = np.empty(x.size, np.uint8)
    q[:v] = _to_u4(_fused(x[:v], np.full(v, inv, F32), np.full(v, zp, F32)))
    q[v:] = _scalar_u4(x[v:], scale, zp)
    return q, scale, zp


def quant_channel(rows):
    rows = np.asarray(rows, F32)
    D = rows.shape[1]
    # the scales: 16 and 8 channels at a time, then the D % 8 rest; the nibbles: 16 channels at a
    # time, then the D % 16 rest (the plugin has no 8-wide u4 quantizer)
    v = D - D % 8
    vq = D - D % ALT["channel_quant_vec"]
    mn, mx = rows.min(0), rows.max(0)
    scale = np.empty(D, F32)
    if ALT["key_scale"] == "recip":
        scale[:v] = (mx[:v] - mn[:v]).astype(F32) * F32(1.0 / LEVELS)
    else:
        scale[:v] = (mx[:v] - mn[:v]).astype(F32) / F32(LEVELS)
    scale[v:] = (mx[v:] - mn[v:]).astype(F32) / F32(LEVELS)
    scale = np.where(scale == 0, scale + F32(0.0001), scale).astype(F32)
    zp = (-mn / scale).astype(F32)
    inv = (F32(1) / scale).astype(F32)
    q = np.empty(rows.shape, np.uint8)
    q[:, :vq] = _to_u4(_fused(rows[:, :vq], np.broadcast_to(inv[:vq], rows[:, :vq].shape),
                              np.broadcast_to(zp[:vq], rows[:, :vq].shape)))
    q[:, vq:] = _scalar_u4(rows[:, vq:], scale[vq:], zp[vq:])
    return q, scale, zp


def dequant(q, scale, zp):
    return ((np.asarray(q, F32) - zp).astype(F32) * scale).astype(F32)


def write_token_row(row_bytes, x, group):
    D = x.shape[0]
    g = group or D
    for i in range(D // g):
        q, s, z = quant_token(x[i * g:(i + 1) * g])
        base = i * (g // 2 + 8)
        row_bytes[base:base + 4] = np.frombuffer(F32(s).tobytes(), np.uint8)
        row_bytes[base + 4:base + 8] = np.frombuffer(F32(z).tobytes(), np.uint8)
        row_bytes[base + 8:base + 8 + g // 2] = pack(q)


def read_token_row(row_bytes, D, group):
    g = group or D
    out = np.empty(D, F32)
    for i in range(D // g):
        base = i * (g // 2 + 8)
        s = row_bytes[base:base + 4].view(F32)[0]
        z = row_bytes[base + 4:base + 8].view(F32)[0]
        out[i * g:(i + 1) * g] = dequant(unpack(row_bytes[base + 8:base + 8 + g // 2]), s, z)
    return out


def token_row_steps(row_bytes, D, group):
    """The scale of each element of a by-token row."""
    g = group or D
    return np.repeat([row_bytes[i * (g // 2 + 8):][:4].view(F32)[0] for i in range(D // g)], g)


def channel_block_params(slab):
    """slab: bytes [BS + 16, D/2] -> (scale[D], zp[D], nibbles [BS, D])."""
    D = slab.shape[1] * 2
    flat = slab.reshape(-1)
    return flat[:4 * D].view(F32), flat[4 * D:8 * D].view(F32), unpack(slab[16:])


def insert_model(key, value, kc, vc, past_lens, sb, bi, bib, key_group=0, value_group=0,
                 key_by_token=False):
    """Our reading of OpenVINO's u4 insertion, in numpy: returns new (kc, vc)."""
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
        p = past
        while p < past + n:
            lo = p % BS
            hi = min(BS, lo + past + n - p)
            blk = bi[bib[s] + p // BS]
            for h in range(Hkv):
                scale, zp, rows = channel_block_params(kc[blk, h])
                new = key[sb[s] + (p - past):sb[s] + (p - past) + (hi - lo), h * D:(h + 1) * D]
                if ALT["growth"] == "fixed" and lo > 0:
                    inv = (F32(1) / scale).astype(F32)
                    q = _to_u4(_fused(new.astype(F32), np.broadcast_to(inv, new.shape),
                                      np.broadcast_to(zp, new.shape)))
                    kc[blk, h, 16 + lo:16 + hi] = pack(q)
                    continue
                prev = dequant(rows[:lo], scale, zp)
                q, s2, z2 = quant_channel(np.concatenate([prev, new.astype(F32)]))
                flat = kc[blk, h].reshape(-1)
                flat[:4 * D] = np.frombuffer(s2.astype(F32).tobytes(), np.uint8)
                flat[4 * D:8 * D] = np.frombuffer(z2.astype(F32).tobytes(), np.uint8)
                kc[blk, h, 16:16 + hi] = pack(q)
            p += hi - lo
    return kc, vc


def dequantized_caches(kc, vc, D, key_group=0, value_group=0, key_by_token=False, Dv=None):
    """Both caches dequantized to float64: keys [NB, Hkv, BS, D], values [NB, Hkv, BS, Dv] (Dv: the
    value head size, D when not given)."""
    NB, Hkv = kc.shape[:2]
    Dv = D if Dv is None else Dv
    kd = np.zeros((NB, Hkv, BS, D))
    vd = np.zeros((NB, Hkv, BS, Dv))
    for b in range(NB):
        for h in range(Hkv):
            if key_by_token:
                kd[b, h] = [read_token_row(kc[b, h, t], D, key_group) for t in range(BS)]
            else:
                scale, zp, rows = channel_block_params(kc[b, h])
                kd[b, h] = dequant(rows, scale, zp)
            vd[b, h] = [read_token_row(vc[b, h, t], Dv, value_group) for t in range(BS)]
    return kd, vd


# ---------------------------------------------------------------------------------------------

U4_VARIANTS = dict(VARIANTS)
U4_SCENARIOS = {k: v for k, v in SCENARIOS.items() if k != "head8"}
U4_SCENARIOS["head24"] = (1, 24, [[(0, 10)], [(10, 3)]])


def _ties(rng, T, width):
    """Per token and per channel range [0, 15], values on .5: every element a rounding tie."""
    x = (rng.integers(0, 15, (T, width)) + 0.5).astype(F32)
    x[:, 0::7], x[:, 1::7] = 0, 15
    x[0, :], x[-1, :] = 0, 15
    return x


def run_scenario(rng, name, variant, kind="normal", spread=1.0):
    Hkv, D, steps = U4_SCENARIOS[name]
    v = U4_VARIANTS[variant]
    NB, calls = make_case(rng, Hkv, D, steps, spread=spread,
                          kind="normal" if kind == "ties" else kind)
    if kind == "ties":
        for c in calls:
            c["key"] = _ties(rng, *c["key"].shape)
            c["value"] = c["key"][::-1].copy()
    ks, vs = cache_shapes(NB, Hkv, D, **v)
    kc = np.zeros(ks, np.uint8)
    vc = np.zeros(vs, np.uint8)
    cfg = u4_config(**v)
    records = []
    for c in calls:
        _, kc2, vc2 = run_u4(D, c["key"], c["value"], kc, vc, c["past_lens"],
                             c["subsequence_begins"], c["block_indices"],
                             c["block_indices_begins"], cfg)
        records.append(dict(call=c, kc_before=kc, vc_before=vc, kc_after=kc2, vc_after=vc2))
        kc, vc = kc2, vc2
    return D, v, records


def compare(D, v, rec):
    """(key data, key params, value) bytes that differ between the model and OpenVINO, on slots
    that hold tokens."""
    c = rec["call"]
    km, vm = insert_model(c["key"], c["value"], rec["kc_before"], rec["vc_before"], c["past_lens"],
                          c["subsequence_begins"], c["block_indices"], c["block_indices_begins"], **v)
    mask = token_mask(rec["kc_before"].shape, c["past_lens"], c["subsequence_begins"],
                      c["block_indices"], c["block_indices_begins"])
    vd = (vm != rec["vc_after"])[mask]
    if v.get("key_by_token"):
        return int((km != rec["kc_after"])[mask].sum()), 0, int(vd.sum())
    kd = (km[:, :, 16:] != rec["kc_after"][:, :, 16:])[mask]
    held = mask.any(2)
    kparam = int((km[:, :, :16] != rec["kc_after"][:, :, :16])[held].sum())
    return int(kd.sum()), kparam, int(vd.sum())


def main_check():
    rng = np.random.default_rng(1)
    bad = 0
    for kind, spread in (("normal", 1.0), ("normal", 1e-3), ("grid", 1.0), ("ties", 1.0)):
        for variant in U4_VARIANTS:
            for name in U4_SCENARIOS:
                if not runs_on_plugin(U4_SCENARIOS[name][1], U4_VARIANTS[variant]):
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
    silent = 0
    for key, alt in (("nibble", "low_first"), ("round", "away"), ("key_scale", "div"),
                     ("growth", "fixed"), ("channel_quant_vec", 8)):
        rng = np.random.default_rng(2)
        default = ALT[key]
        ALT[key] = alt
        n_diff = 0
        for kind in ("normal", "grid", "ties"):
            for name in ("prefill_70", "chunked_prefill", "head20", "head40"):
                for variant in ("default", "key_by_token_g8_vg8"):
                    if not runs_on_plugin(U4_SCENARIOS[name][1], U4_VARIANTS[variant]):
                        continue
                    D, v, recs = run_scenario(rng, name, variant, kind)
                    n_diff += sum(compare(D, v, r) != (0, 0, 0) for r in recs)
        ALT[key] = default
        print(f"alternative {key}={alt}: {n_diff} mismatching steps")
        silent += n_diff == 0
    return silent


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "check":
        sys.exit(1 if main_check() else 0)
    if len(sys.argv) >= 2 and sys.argv[1] == "mutations":
        sys.exit(1 if main_mutations() else 0)
    print(__doc__)
    sys.exit(2)
