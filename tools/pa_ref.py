"""Plain float64 numpy reference of the PagedAttention op (16 inputs, 2 outputs).

Written from ../shared/SPEC.md (the contract), independently of any code under test.

Conventions
-----------
* Every floating input may be given as float16 / float32 / float64 numpy arrays; it is converted to
  float64 exactly (every f16/f32 value is exactly representable in f64).
* bf16 data: pass it as float32 (or float64) arrays *holding bf16 values* (use ``bf16_bits_to_f32``
  to decode raw uint16 bit patterns). The reference never sees uint16 bits.
* Optional inputs (9..15) are ``None`` or an empty array (a zero-sized dimension) for "absent".
* The function returns ``(output, scores, key_cache_after, value_cache_after)``, all float64.
  ``output`` and ``scores`` are *not* rounded to any storage type (compare with a tolerance).
  The caches are computed in float64; with ``cache_dtype="f16"`` or ``"bf16"`` every value the op
  writes into a cache (inserted keys/values, rotated keys) is rounded to that type (round to nearest
  even) *before* attention reads it, as an implementation storing the cache in that type does.
  With ``cache_dtype`` ``None``/``"f32"``/``"f64"`` written values are rounded to f32 for "f32" and left
  in float64 otherwise. The returned caches are float64 arrays holding values exactly representable
  in the cache type (convert with ``.astype(np.float16)`` or ``f32_to_bf16_bits`` losslessly).
"""
from __future__ import annotations

import numpy as np

__all__ = [
    "paged_attention_ref",
    "round_to",
    "bf16_bits_to_f32",
    "f32_to_bf16_bits",
    "round_bf16",
    "is_absent",
    "cache_compare_mask",
]


# ----------------------------------------------------------------------------- dtype helpers
def f32_to_bf16_bits(x) -> np.ndarray:
    """Round float32 values to bf16 (round to nearest, ties to even) and return the raw uint16 bits.

    Values are first converted to float32 (so float64 input is rounded twice: f64->f32->bf16; feed
    float32 or bf16-exact values to avoid double rounding). NaN stays NaN (quiet)."""
    a = np.require(x, dtype=np.float32, requirements="C")
    u = a.view(np.uint32).astype(np.uint64)
    lsb = (u >> 16) & 1
    rounded = (u + 0x7FFF + lsb) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        out = np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), out)
    return out.reshape(a.shape)


def bf16_bits_to_f32(bits) -> np.ndarray:
    """Decode raw bf16 bit patterns (uint16) into float32 values (exact)."""
    b = np.require(bits, dtype=np.uint16, requirements="C")
    return (b.astype(np.uint32) << 16).view(np.float32).reshape(b.shape)


def round_bf16(x) -> np.ndarray:
    """float64 array of the bf16 values nearest to float32(x)."""
    return bf16_bits_to_f32(f32_to_bf16_bits(x)).astype(np.float64)


def round_to(x, dtype) -> np.ndarray:
    """Round float64 values to the storage type ``dtype`` ('f16', 'bf16', 'f32', None/'f64')
    and return them as float64."""
    x = np.asarray(x, dtype=np.float64)
    if dtype in (None, "f64", "float64"):
        return x
    if dtype in ("f32", "float32"):
        return x.astype(np.float32).astype(np.float64)
    if dtype in ("f16", "float16"):
        return x.astype(np.float16).astype(np.float64)
    if dtype in ("bf16", "bfloat16"):
        # f64 -> f32 (RNE) -> bf16 (RNE). Double rounding can differ from a direct f64->bf16 RNE
        # only in astronomically rare ties; document rather than hide it.
        return round_bf16(x.astype(np.float32))
    raise ValueError(f"unknown dtype {dtype!r}")


def is_absent(x) -> bool:
    """An optional input is absent when it is None or has a zero-sized dimension."""
    return x is None or np.asarray(x).size == 0


# ----------------------------------------------------------------------------- the op
def paged_attention_ref(
    query,
    key,
    value,
    key_cache,
    value_cache,
    past_lens,
    subsequence_begins,
    block_indices,
    block_indices_begins,
    scale=None,
    sliding_window=None,
    alibi_slopes=None,
    rotated_block_indices=None,
    rotation_deltas=None,
    rotation_trig_lut=None,
    score_aggregation_window=None,
    *,
    cache_dtype=None,
):
    """float64 reference of PagedAttention per SPEC.md. See the module docstring for conventions.

    Returns (output [T, H*D], scores [sum(past_lens)+T], key_cache_after, value_cache_after)."""
    q = np.asarray(query, dtype=np.float64)
    k = np.asarray(key, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    kc = np.array(key_cache, dtype=np.float64, copy=True)
    vc = np.array(value_cache, dtype=np.float64, copy=True)
    past = np.asarray(past_lens, dtype=np.int64).reshape(-1)
    sb = np.asarray(subsequence_begins, dtype=np.int64).reshape(-1)
    bi = np.asarray(block_indices, dtype=np.int64).reshape(-1)
    bib = np.asarray(block_indices_begins, dtype=np.int64).reshape(-1)

    if kc.ndim != 4 or vc.shape != kc.shape:
        raise ValueError(f"bad cache shapes {kc.shape} {vc.shape}")
    NB, Hkv, BS, D = kc.shape
    if q.ndim != 2 or q.shape[1] % D:
        raise ValueError("query.dim1 must be a multiple of D")
    T = q.shape[0]
    H = q.shape[1] // D
    if H % Hkv:
        raise ValueError("H must be a multiple of Hkv")
    G = H // Hkv
    if k.shape != (T, Hkv * D) or v.shape != (T, Hkv * D):
        raise ValueError(f"key/value must be [{T}, {Hkv * D}]")
    B = past.shape[0]
    if sb.shape[0] != B + 1 or bib.shape[0] != B + 1:
        raise ValueError("B mismatch between past_lens, subsequence_begins, block_indices_begins")
    if sb[0] != 0 or sb[-1] != T or np.any(np.diff(sb) < 0):
        raise ValueError("bad subsequence_begins")
    if np.any(np.diff(bib) < 0) or bib[0] < 0 or bib[-1] > bi.shape[0]:
        raise ValueError("bad block_indices_begins")
    if np.any(past < 0):
        raise ValueError("negative past_lens")

    # ---- optional inputs
    if is_absent(scale):
        sc = 0.0
    else:
        sc = float(np.asarray(scale, dtype=np.float64).reshape(-1)[0])
    if sc == 0.0:
        sc = 1.0 / np.sqrt(D)
    if is_absent(sliding_window):
        sw = 0
    else:
        sw = int(np.asarray(sliding_window).reshape(-1)[0])
    if is_absent(alibi_slopes):
        alibi = None
    else:
        alibi = np.asarray(alibi_slopes, dtype=np.float64).reshape(-1)
        if alibi.shape[0] != H:
            raise ValueError(f"alibi_slopes must have {H} values")
    if is_absent(score_aggregation_window):
        saw = np.ones(B, dtype=np.int64)
    else:
        w = np.asarray(score_aggregation_window, dtype=np.int64).reshape(-1)
        if w.shape[0] == 1 and np.asarray(score_aggregation_window).ndim == 0:
            saw = np.full(B, int(w[0]), dtype=np.int64)
        elif w.shape[0] == B:
            saw = w
        elif w.shape[0] == 1:  # a [1] tensor: treat as a scalar broadcast to all sequences
            saw = np.full(B, int(w[0]), dtype=np.int64)
        else:
            raise ValueError("score_aggregation_window must be a scalar or [B]")

    # ---- 1. rotation of the key cache (before insertion)
    if not is_absent(rotated_block_indices):
        rbi = np.asarray(rotated_block_indices, dtype=np.int64).reshape(-1)
        R = rbi.shape[0]
        if is_absent(rotation_deltas) or is_absent(rotation_trig_lut):
            raise ValueError("rotation needs rotation_deltas and rotation_trig_lut")
        deltas = np.asarray(rotation_deltas, dtype=np.int64)
        if deltas.ndim == 1:
            deltas = deltas.reshape(R, 1)
        if deltas.shape[0] != R or deltas.shape[1] not in (1, BS):
            raise ValueError(f"rotation_deltas must be [R, BS], [R, 1] or [R], got {deltas.shape}")
        lut = np.asarray(rotation_trig_lut, dtype=np.float64)
        M = lut.shape[0]
        if lut.ndim != 2 or lut.shape[1] != D or D % 2:
            raise ValueError("rotation_trig_lut must be [M, D] with even D")
        half = D // 2
        for r in range(R):
            b = int(rbi[r])
            if not 0 <= b < NB:
                raise ValueError("rotated block id out of range")
            for t in range(BS):
                d = int(deltas[r, t if deltas.shape[1] == BS else 0])
                if not 0 <= d < M:
                    raise ValueError("rotation delta out of range")
                cos = lut[d, :half]
                sin = lut[d, half:]
                x = kc[b, :, t, :half].copy()
                y = kc[b, :, t, half:].copy()
                kc[b, :, t, :half] = round_to(x * cos - y * sin, cache_dtype)
                kc[b, :, t, half:] = round_to(x * sin + y * cos, cache_dtype)

    # ---- 2. insertion
    def slot_of(s, p):
        idx = bib[s] + p // BS
        if idx >= bib[s + 1]:
            raise ValueError(f"sequence {s}: block list too short for position {p}")
        blk = int(bi[idx])
        if not 0 <= blk < NB:
            raise ValueError(f"sequence {s}: block id {blk} out of range")
        return blk, p % BS

    kr = k.reshape(T, Hkv, D)
    vr = v.reshape(T, Hkv, D)
    for s in range(B):
        n = int(sb[s + 1] - sb[s])
        for i in range(n):
            blk, slot = slot_of(s, int(past[s]) + i)
            kc[blk, :, slot, :] = round_to(kr[sb[s] + i], cache_dtype)
            vc[blk, :, slot, :] = round_to(vr[sb[s] + i], cache_dtype)

    # ---- 3. attention and 4. scores
    out = np.zeros((T, H, D), dtype=np.float64)
    score_blocks = []
    qr = q.reshape(T, H, D)
    for s in range(B):
        n = int(sb[s + 1] - sb[s])
        L = int(past[s]) + n
        sc_s = np.zeros(L, dtype=np.float64)
        if n > 0:
            pos = np.arange(L)
            Ks = np.empty((L, Hkv, D))
            Vs = np.empty((L, Hkv, D))
            for j in range(L):
                blk, slot = slot_of(s, j)
                Ks[j] = kc[blk, :, slot, :]
                Vs[j] = vc[blk, :, slot, :]
            w = int(saw[s])
            if w < 0:
                nagg = n
            else:
                nagg = min(w, n)
            for i in range(n):
                p = int(past[s]) + i
                mask = pos <= p
                if sw > 0:
                    mask &= pos > p - sw
                for h in range(H):
                    kh = h // G
                    logits = sc * (Ks[:, kh, :] @ qr[sb[s] + i, h])
                    if alibi is not None:
                        logits = logits + alibi[h] * (pos - p)
                    logits = np.where(mask, logits, -np.inf)
                    m = logits.max()
                    e = np.where(mask, np.exp(logits - m), 0.0)
                    wts = e / e.sum()
                    out[sb[s] + i, h] = wts @ Vs[:, kh, :]
                    if i >= n - nagg:
                        sc_s += wts
        score_blocks.append(sc_s)
    scores = np.concatenate(score_blocks) if score_blocks else np.zeros(0)
    return out.reshape(T, H * D), scores, kc, vc


def cache_compare_mask(key_cache_shape, past_lens, subsequence_begins, block_indices,
                       block_indices_begins):
    """Boolean mask [NB, Hkv, BS] of cache slots that tests compare (SPEC "Slots that hold no token"):
    slots holding a token after the call (past or new) and every slot of blocks that no sequence
    references (ids absent from every sequence's block list). A rotated block no sequence references
    is compared in full: rotation applies to all its slots (SPEC step 1; OpenVINO does the same).
    Slots past a sequence's length in blocks it references are don't-care (not compared)."""
    NB, Hkv, BS, _ = key_cache_shape
    past = np.asarray(past_lens, dtype=np.int64).reshape(-1)
    sb = np.asarray(subsequence_begins, dtype=np.int64).reshape(-1)
    bi = np.asarray(block_indices, dtype=np.int64).reshape(-1)
    bib = np.asarray(block_indices_begins, dtype=np.int64).reshape(-1)
    B = past.shape[0]
    mask = np.zeros((NB, Hkv, BS), dtype=bool)
    referenced = np.zeros(NB, dtype=bool)
    for s in range(B):
        for idx in range(bib[s], bib[s + 1]):
            if 0 <= bi[idx] < NB:
                referenced[bi[idx]] = True
        L = int(past[s] + sb[s + 1] - sb[s])
        for p in range(L):
            blk = bi[bib[s] + p // BS]
            mask[blk, :, p % BS] = True
    mask[~referenced] = True
    return mask
