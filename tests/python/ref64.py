"""A small float64 reference of the op, written from SPEC.md (semantics 1-4), for the extension
tests. Independent of the Rust kernel. (tools/pa_ref.py on branch `golden` is the project's full
reference; this file is to be folded into it.)

`reference(inputs)` takes the 9..16 inputs in SPEC order as numpy arrays (an empty array or a
missing tail means "not provided") and returns float64 arrays
(output [T, H*D], scores [sum(past_lens)+T], key_cache after, value_cache after).
"""

import numpy as np


def given(inputs, i):
    """Input `i` when provided, else None (beyond the list or zero elements)."""
    if i >= len(inputs) or inputs[i] is None or np.asarray(inputs[i]).size == 0:
        return None
    return np.asarray(inputs[i])


def as_f64(a):
    """float64 copy; bf16 arrays are passed as ("bf16", uint16 array)."""
    if isinstance(a, tuple) and a[0] == "bf16":
        return (a[1].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.asarray(a).astype(np.float64)


def reference(inputs):
    q, k, v = (as_f64(inputs[i]) for i in range(3))
    kc, vc = as_f64(inputs[3]).copy(), as_f64(inputs[4]).copy()
    past, sb, bi, bib = (np.asarray(inputs[i]).astype(np.int64).reshape(-1) for i in range(5, 9))
    NB, Hkv, BS, D = kc.shape
    T = q.shape[0]
    H = q.shape[1] // D
    G = H // Hkv
    B = past.shape[0]

    scale = given(inputs, 9)
    scale = 0.0 if scale is None else float(scale.reshape(-1)[0])
    if scale == 0.0:
        scale = 1.0 / np.sqrt(D)
    sw = given(inputs, 10)
    sw = 0 if sw is None else int(sw.reshape(-1)[0])
    alibi = given(inputs, 11)
    alibi = None if alibi is None else as_f64(alibi).reshape(-1)
    w_in = given(inputs, 15)

    # 1. rotation of cached keys
    rbi = given(inputs, 12)
    if rbi is not None:
        deltas = np.asarray(inputs[13]).astype(np.int64)
        lut = as_f64(inputs[14])
        half = D // 2
        for r, b in enumerate(rbi.reshape(-1)):
            for t in range(BS):
                d = deltas[r] if deltas.ndim == 1 else deltas[r, 0 if deltas.shape[1] == 1 else t]
                cos, sin = lut[int(d), :half], lut[int(d), half:]
                x, y = kc[b, :, t, :half].copy(), kc[b, :, t, half:].copy()
                kc[b, :, t, :half] = x * cos - y * sin
                kc[b, :, t, half:] = x * sin + y * cos

    # 2. insertion of the new tokens
    for s in range(B):
        for i in range(sb[s + 1] - sb[s]):
            p = past[s] + i
            blk = bi[bib[s] + p // BS]
            row = sb[s] + i
            kc[blk, :, p % BS, :] = k[row].reshape(Hkv, D)
            vc[blk, :, p % BS, :] = v[row].reshape(Hkv, D)

    # 3. attention, 4. scores
    out = np.zeros((T, H * D))
    scores = []
    for s in range(B):
        n = sb[s + 1] - sb[s]
        L = past[s] + n
        blocks = bi[bib[s] + np.arange(L) // BS]
        slots = np.arange(L) % BS
        keys = kc[blocks, :, slots, :]  # [L, Hkv, D]
        vals = vc[blocks, :, slots, :]
        if w_in is None:
            w = 1
        else:
            wv = w_in.reshape(-1)
            w = int(wv[0] if wv.size == 1 else wv[s])
        last = n if w < 0 else min(w, n)
        acc = np.zeros(L)
        j = np.arange(L)
        for i in range(n):
            p = past[s] + i
            row = sb[s] + i
            for h in range(H):
                qv = q[row, h * D:(h + 1) * D]
                sc = scale * keys[:, h // G, :] @ qv
                if alibi is not None:
                    sc = sc + alibi[h] * (j - p)
                mask = j > p
                if sw > 0:
                    mask |= j <= p - sw
                sc = np.where(mask, -np.inf, sc)
                e = np.exp(sc - sc.max())
                wts = e / e.sum()
                out[row, h * D:(h + 1) * D] = wts @ vals[:, h // G, :]
                if i >= n - last:
                    acc += wts
        scores.append(acc)
    return out, np.concatenate(scores) if scores else np.zeros(0), kc, vc
