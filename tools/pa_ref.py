"""Plain float64 numpy reference of the PagedAttention op (16 inputs, 2 outputs).

Written from docs/contract.md (the contract, "SPEC.md" below), independently of any code under test.

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
* Non-finite values follow the contract's rule ("Non-finite values"): only visible keys enter a row's
  sums, logits beyond the f32 range saturate (``f32_logits``), NaN in gives NaN for that row.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "Call",
    "INPUT_NAMES",
    "Inputs",
    "normalize_inputs",
    "paged_attention_ref",
    "round_to",
    "bf16_bits_to_f32",
    "f32_to_bf16_bits",
    "round_bf16",
    "is_absent",
    "cache_compare_mask",
]


# ----------------------------------------------------------------------------- dtype helpers
# The bf16 bit conversions (plain numpy) are the Python package's, imported from the source tree.
_PY = str(Path(__file__).resolve().parent.parent / "python")
if _PY not in sys.path:
    sys.path.insert(0, _PY)
from paged_attention._tensors import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402


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


# ----------------------------------------------------------------------------- the inputs
class Call(NamedTuple):
    """The 17 inputs of the op in SPEC order. Optional inputs (9..16) default to None (absent)."""

    query: Any
    key: Any
    value: Any
    key_cache: Any
    value_cache: Any
    past_lens: Any
    subsequence_begins: Any
    block_indices: Any
    block_indices_begins: Any
    scale: Any = None
    sliding_window: Any = None
    alibi_slopes: Any = None
    rotated_block_indices: Any = None
    rotation_deltas: Any = None
    rotation_trig_lut: Any = None
    score_aggregation_window: Any = None
    sinks: Any = None


INPUT_NAMES = list(Call._fields)


@dataclass
class Inputs:
    """One call's inputs checked against SPEC.md and normalised; shared by ``paged_attention_ref``
    and ``ov_builtin.run_builtin``. Float data is left as given (``call``): each consumer converts
    it to its own precision."""

    call: Call
    NB: int
    Hkv: int
    BS: int
    D: int
    Dv: int  # value head size (value_cache dim 3)
    T: int
    H: int
    B: int
    past: np.ndarray  # int64 [B]
    sb: np.ndarray  # int64 [B+1]
    bi: np.ndarray  # int64 [len(block_indices)]
    bib: np.ndarray  # int64 [B+1]
    n: np.ndarray  # int64 [B]: new tokens per sequence
    scale: float  # as given; 0.0 when absent (0 means 1/sqrt(D))
    sliding_window: int  # 0 when absent
    alibi: np.ndarray | None  # float64 [H], None when absent
    sinks: np.ndarray | None  # float64 [H] ([1, H, 1, 1] flattened), None when absent
    score_window: np.ndarray  # int64 [B]: absent -> 1, a scalar or [1] broadcast, w < 0 kept
    rotated_blocks: np.ndarray | None  # int64 [R], None when absent
    rotation_deltas: np.ndarray | None  # int64 [R, 1] or [R, BS] ([R] reshaped to [R, 1])

    @property
    def G(self) -> int:
        return self.H // self.Hkv


def normalize_inputs(*inputs, **named) -> Inputs:
    """Check one call's inputs (positional in SPEC order and/or by ``Call`` field name) against
    SPEC.md and normalise the optional ones. Raises ValueError for a malformed call."""
    c = Call(*inputs, **named)
    kshape, vshape = np.shape(c.key_cache), np.shape(c.value_cache)
    if len(kshape) != 4 or len(vshape) != 4 or vshape[:3] != kshape[:3]:
        raise ValueError(f"bad cache shapes {kshape} {vshape}")
    NB, Hkv, BS, D = kshape
    Dv = vshape[3]  # the value head size may differ from the key's
    qshape = np.shape(c.query)
    if len(qshape) != 2 or qshape[1] % D:
        raise ValueError("query.dim1 must be a multiple of D")
    T = qshape[0]
    H = qshape[1] // D
    if H % Hkv:
        raise ValueError("H must be a multiple of Hkv")
    if np.shape(c.key) != (T, Hkv * D) or np.shape(c.value) != (T, Hkv * Dv):
        raise ValueError(f"key/value must be [{T}, {Hkv * D}] / [{T}, {Hkv * Dv}]")
    past, sb, bi, bib = (np.asarray(a, dtype=np.int64).reshape(-1) for a in
                         (c.past_lens, c.subsequence_begins, c.block_indices, c.block_indices_begins))
    B = past.shape[0]
    if sb.shape[0] != B + 1 or bib.shape[0] != B + 1:
        raise ValueError("B mismatch between past_lens, subsequence_begins, block_indices_begins")
    if sb[0] != 0 or sb[-1] != T or np.any(np.diff(sb) < 0):
        raise ValueError("bad subsequence_begins")
    if np.any(np.diff(bib) < 0) or bib[0] < 0 or bib[-1] > bi.shape[0]:
        raise ValueError("bad block_indices_begins")
    if np.any(past < 0):
        raise ValueError("negative past_lens")

    scale = 0.0 if is_absent(c.scale) else float(np.asarray(c.scale, dtype=np.float64).reshape(-1)[0])
    sw = 0 if is_absent(c.sliding_window) else int(np.asarray(c.sliding_window).reshape(-1)[0])
    alibi = None
    if not is_absent(c.alibi_slopes):
        alibi = np.asarray(c.alibi_slopes, dtype=np.float64).reshape(-1)
        if alibi.shape[0] != H:
            raise ValueError(f"alibi_slopes must have {H} values")
    if is_absent(c.score_aggregation_window):
        saw = np.ones(B, dtype=np.int64)
    else:
        w = np.asarray(c.score_aggregation_window, dtype=np.int64).reshape(-1)
        if w.shape[0] == 1:  # a scalar, or a [1] tensor treated as one: broadcast to all sequences
            saw = np.full(B, int(w[0]), dtype=np.int64)
        elif w.shape[0] == B:
            saw = w
        else:
            raise ValueError("score_aggregation_window must be a scalar or [B]")

    rbi = deltas = None
    if not is_absent(c.rotated_block_indices):
        rbi = np.asarray(c.rotated_block_indices, dtype=np.int64).reshape(-1)
        R = rbi.shape[0]
        if is_absent(c.rotation_deltas) or is_absent(c.rotation_trig_lut):
            raise ValueError("rotation needs rotation_deltas and rotation_trig_lut")
        deltas = np.asarray(c.rotation_deltas, dtype=np.int64)
        if deltas.ndim == 1:
            deltas = deltas.reshape(R, 1)
        if deltas.ndim != 2 or deltas.shape[0] != R or deltas.shape[1] not in (1, BS):
            raise ValueError(f"rotation_deltas must be [R, BS], [R, 1] or [R], got {deltas.shape}")
        lshape = np.shape(c.rotation_trig_lut)
        if len(lshape) != 2 or lshape[1] != D or D % 2:
            raise ValueError("rotation_trig_lut must be [M, D] with even D")
        if np.any((rbi < 0) | (rbi >= NB)):
            raise ValueError("rotated block id out of range")
        if np.any((deltas < 0) | (deltas >= lshape[0])):
            raise ValueError("rotation delta out of range")

    sinks = None
    if not is_absent(c.sinks):
        shape = np.shape(c.sinks)
        if shape not in ((H,), (1, H, 1, 1)):
            raise ValueError(f"sinks must be [{H}] or [1, {H}, 1, 1], got {shape}")
        sinks = np.asarray(c.sinks, dtype=np.float64).reshape(-1)

    return Inputs(call=c, NB=NB, Hkv=Hkv, BS=BS, D=D, Dv=Dv, T=T, H=H, B=B, past=past, sb=sb, bi=bi,
                  bib=bib, n=np.diff(sb), scale=scale, sliding_window=sw, alibi=alibi, sinks=sinks,
                  score_window=saw, rotated_blocks=rbi, rotation_deltas=deltas)


# ----------------------------------------------------------------------------- the op
F32_MAX = float(np.finfo(np.float32).max)


def f32_logits(logits: np.ndarray) -> np.ndarray:
    """Logits as the op holds them (docs/contract.md, "Non-finite values"): computed in f32, so
    beyond its range they are infinities, and +inf counts as the largest finite f32 (the keys
    whose logits overflow share the weight); NaN stays NaN."""
    out = np.where(logits > F32_MAX, F32_MAX, logits)
    return np.where(out < -F32_MAX, -np.inf, out)


def paged_attention_ref(*inputs, cache_dtype=None, **named):
    """float64 reference of PagedAttention per SPEC.md. ``inputs``: the 9..17 inputs in SPEC order
    (the fields of ``Call``), positional or by name. See the module docstring for conventions.

    Returns (output [T, H*D], scores [sum(past_lens)+T], key_cache_after, value_cache_after)."""
    x = normalize_inputs(*inputs, **named)
    c = x.call
    q = np.asarray(c.query, dtype=np.float64)
    k = np.asarray(c.key, dtype=np.float64)
    v = np.asarray(c.value, dtype=np.float64)
    kc = np.array(c.key_cache, dtype=np.float64, copy=True)
    vc = np.array(c.value_cache, dtype=np.float64, copy=True)
    past, sb, bi, bib = x.past, x.sb, x.bi, x.bib
    NB, Hkv, BS, D, T, H, G, B = x.NB, x.Hkv, x.BS, x.D, x.T, x.H, x.G, x.B
    sc = x.scale if x.scale != 0.0 else 1.0 / np.sqrt(D)
    sw = x.sliding_window
    alibi = x.alibi
    saw = x.score_window

    # ---- 1. rotation of the key cache (before insertion)
    if x.rotated_blocks is not None:
        deltas = x.rotation_deltas
        lut = np.asarray(c.rotation_trig_lut, dtype=np.float64)
        half = D // 2
        for r, b in enumerate(x.rotated_blocks):
            for t in range(BS):
                d = int(deltas[r, t if deltas.shape[1] == BS else 0])
                cos = lut[d, :half]
                sin = lut[d, half:]
                x0 = kc[b, :, t, :half].copy()
                y0 = kc[b, :, t, half:].copy()
                kc[b, :, t, :half] = round_to(x0 * cos - y0 * sin, cache_dtype)
                kc[b, :, t, half:] = round_to(x0 * sin + y0 * cos, cache_dtype)

    # ---- 2. insertion
    def slot_of(s, p):
        idx = bib[s] + p // BS
        if idx >= bib[s + 1]:
            raise ValueError(f"sequence {s}: block list too short for position {p}")
        blk = int(bi[idx])
        if not 0 <= blk < NB:
            raise ValueError(f"sequence {s}: block id {blk} out of range")
        return blk, p % BS

    Dv = x.Dv
    kr = k.reshape(T, Hkv, D)
    vr = v.reshape(T, Hkv, Dv)
    for s in range(B):
        n = int(sb[s + 1] - sb[s])
        for i in range(n):
            blk, slot = slot_of(s, int(past[s]) + i)
            kc[blk, :, slot, :] = round_to(kr[sb[s] + i], cache_dtype)
            vc[blk, :, slot, :] = round_to(vr[sb[s] + i], cache_dtype)

    # ---- 3. attention and 4. scores
    out = np.zeros((T, H, Dv), dtype=np.float64)
    score_blocks = []
    qr = q.reshape(T, H, D)
    for s in range(B):
        n = int(sb[s + 1] - sb[s])
        L = int(past[s]) + n
        sc_s = np.zeros(L, dtype=np.float64)
        if n > 0:
            pos = np.arange(L)
            Ks = np.empty((L, Hkv, D))
            Vs = np.empty((L, Hkv, Dv))
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
                # Only the visible keys enter the sums: a masked row's values (even inf or NaN)
                # never reach the output (0 * inf would be NaN).
                vis = np.nonzero(mask)[0]
                for h in range(H):
                    kh = h // G
                    with np.errstate(invalid="ignore", over="ignore"):
                        logits = sc * (Ks[vis, kh, :] @ qr[sb[s] + i, h])
                        if alibi is not None:
                            logits = logits + alibi[h] * (vis - p)
                        logits = f32_logits(logits)
                        m = logits.max()  # NaN if any is NaN: the row is NaN either way
                        if x.sinks is None:
                            e = np.exp(logits - m)
                            wts = e / e.sum()
                        else:
                            # The sink joins the max and the denominator, with no value.
                            sink = f32_logits(np.array([x.sinks[h]]))[0]
                            m = max(m, sink) if not np.isnan(m) else m
                            e = np.exp(logits - m)
                            wts = e / (e.sum() + np.exp(sink - m))
                        out[sb[s] + i, h] = wts @ Vs[vis, kh, :]
                    if i >= n - nagg:
                        sc_s[vis] += wts
        score_blocks.append(sc_s)
    scores = np.concatenate(score_blocks) if score_blocks else np.zeros(0)
    return out.reshape(T, H * Dv), scores, kc, vc


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
