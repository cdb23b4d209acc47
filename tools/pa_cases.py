"""Builders of random, well-formed PagedAttention calls (shared by tests and models/gen.py).

A call is a dict with the 16 input names of SPEC.md as keys (absent optional inputs are None).
"""
from __future__ import annotations

import numpy as np

from pa_ref import INPUT_NAMES, round_to


def rope_lut(M, D, base=10000.0):
    """[M, D] table: row d = [cos(d*f_0..f_{D/2-1}), sin(d*f_0..)], f_i = base^(-2i/D)."""
    half = D // 2
    inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / D)
    ang = np.arange(M, dtype=np.float64)[:, None] * inv[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1)


def alibi_slopes_for(H):
    """Standard ALiBi slopes 2^(-8(h+1)/H)."""
    return 2.0 ** (-8.0 * (np.arange(H) + 1) / H)


def make_call(
    rng,
    *,
    H,
    Hkv,
    D,
    BS,
    seqs,
    dtype="f32",
    extra_blocks=2,
    slack_blocks=0,
    pad_minus_one=False,
    scale=None,
    sliding_window=None,
    alibi=False,
    rotation=None,
    lut_rows=64,
    score_window=None,
    magnitude=1.0,
):
    """Build one call.

    seqs: list of (past_len, n_new).
    dtype: 'f32' | 'f16' | 'bf16' -- float data is rounded to that type (kept as float32 arrays for
      'f32'/'bf16', float16 arrays for 'f16'; bf16 values are held in float32 arrays).
    extra_blocks: physical blocks no sequence references (filled with random data).
    slack_blocks: blocks appended to each sequence's list beyond what it reaches.
    pad_minus_one: the slack entries are -1 instead of real block ids.
    scale: None (absent) or a float (0.0 allowed).
    sliding_window: None or int.
    alibi: bool, standard slopes per query head.
    rotation: None or 'R1' | 'RBS' | 'R' (shape of rotation_deltas); rotates up to 3 blocks that hold
      past tokens.
    score_window: None (absent), an int (scalar), or a list of ints ([B]).
    """
    B = len(seqs)
    need = [-(-(p + n) // BS) for p, n in seqs]
    n_listed = [nd + (slack_blocks if nd or slack_blocks else 0) for nd in need]
    n_real = sum(need) + (0 if pad_minus_one else sum(n_listed) - sum(need))
    NB = n_real + extra_blocks
    perm = rng.permutation(NB)
    bi, bib, used = [], [0], 0
    for s in range(B):
        ids = list(perm[used:used + need[s]])
        used += need[s]
        for _ in range(n_listed[s] - need[s]):
            if pad_minus_one:
                ids.append(-1)
            else:
                ids.append(perm[used])
                used += 1
        bi += ids
        bib.append(len(bi))
    T = sum(n for _, n in seqs)
    sb = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)

    def rnd(*shape):
        return rng.standard_normal(shape) * magnitude

    def cast(x):
        x = round_to(x, dtype)
        return x.astype(np.float16) if dtype == "f16" else x.astype(np.float32)

    call = dict.fromkeys(INPUT_NAMES)
    call["query"] = cast(rnd(T, H * D))
    call["key"] = cast(rnd(T, Hkv * D))
    call["value"] = cast(rnd(T, Hkv * D))
    call["key_cache"] = cast(rnd(NB, Hkv, BS, D))
    call["value_cache"] = cast(rnd(NB, Hkv, BS, D))
    call["past_lens"] = np.array([p for p, _ in seqs], np.int32)
    call["subsequence_begins"] = sb
    call["block_indices"] = np.array(bi, np.int32)
    call["block_indices_begins"] = np.array(bib, np.int32)
    if scale is not None:
        call["scale"] = cast(np.array(scale))
    if sliding_window is not None:
        call["sliding_window"] = np.array(sliding_window, np.int32)
    if alibi:
        call["alibi_slopes"] = cast(alibi_slopes_for(H))
    if rotation is not None:
        # blocks holding past tokens
        cand = []
        for s, (p, _) in enumerate(seqs):
            for j in range(-(-p // BS)):
                cand.append(int(bi[bib[s] + j]))
        cand = sorted(set(cand))
        R = min(3, len(cand))
        rbi = np.array(rng.choice(cand, size=R, replace=False), np.int32)
        M = lut_rows
        if rotation == "R1":
            rd = rng.integers(0, M, size=(R, 1)).astype(np.int32)
        elif rotation == "RBS":
            rd = rng.integers(0, M, size=(R, BS)).astype(np.int32)
        elif rotation == "R":
            rd = rng.integers(0, M, size=(R,)).astype(np.int32)
        else:
            raise ValueError(rotation)
        call["rotated_block_indices"] = rbi
        call["rotation_deltas"] = rd
        call["rotation_trig_lut"] = cast(rope_lut(M, D))
    if score_window is not None:
        if isinstance(score_window, (list, tuple)):
            call["score_aggregation_window"] = np.array(score_window, np.int32)
        else:
            call["score_aggregation_window"] = np.array(score_window, np.int32)
    return call


def call_args(call):
    """The call's inputs in SPEC order: 16, or 17 when it has sinks."""
    names = INPUT_NAMES if call.get("sinks") is not None else INPUT_NAMES[:16]
    return [call[n] for n in names]
