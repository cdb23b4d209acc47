"""ctypes binding of the project's continuous-batching scheduler and cache helpers (the C ABI of
include/paged_attention_cache.h, exported by libpaged_attention.so): requests, steps (the op's
block inputs, token packing, copies, rotation), scores, completion, forks, event counters,
``pa_cache_copy_blocks`` and ``pa_cache_rotation_lut``.

Every failing call raises ``SchedulerError`` with the library's message.
"""
from __future__ import annotations

import ctypes as ct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_LIB = Path(__file__).resolve().parents[1] / "target/release/libpaged_attention.so"
# The OpenVINO extension module: the same C ABI, for a process that also runs the op in OpenVINO.
DEFAULT_EXTENSION = Path(__file__).resolve().parents[1] / "target/release/libpaged_attention_openvino.so"


class SchedulerError(RuntimeError):
    def __init__(self, what, status, message):
        super().__init__(f"{what}: status {status}: {message}")
        self.status = status


class _Config(ct.Structure):
    _fields_ = [("num_blocks", ct.c_size_t), ("block_size", ct.c_size_t), ("prefix_caching", ct.c_int32),
                ("max_batched_tokens", ct.c_size_t), ("max_seqs", ct.c_size_t),
                ("eviction_budget", ct.c_size_t), ("eviction_start", ct.c_size_t),
                ("eviction_recent", ct.c_size_t)]


class _Copy(ct.Structure):
    _fields_ = [("src", ct.c_uint32), ("dst", ct.c_uint32)]


_P = ct.POINTER
_STEP_FIELDS = [
    ("num_seqs", ct.c_size_t), ("num_tokens", ct.c_size_t), ("num_block_indices", ct.c_size_t),
    ("scores_len", ct.c_size_t), ("seq_ids", _P(ct.c_uint64)), ("past_lens", _P(ct.c_int32)),
    ("subsequence_begins", _P(ct.c_int32)), ("block_indices", _P(ct.c_int32)),
    ("block_indices_begins", _P(ct.c_int32)), ("emits", _P(ct.c_uint8)), ("token_ids", _P(ct.c_uint32)),
    ("token_seq", _P(ct.c_int32)), ("token_pos", _P(ct.c_int32)), ("num_copies", ct.c_size_t),
    ("copies", _P(_Copy)), ("num_rotated", ct.c_size_t), ("rotated_block_indices", _P(ct.c_int32)),
    ("rotation_deltas", _P(ct.c_int32)), ("lut_rows", ct.c_size_t), ("num_preempted", ct.c_size_t),
    ("preempted", _P(ct.c_uint64)),
]


class _Step(ct.Structure):
    _fields_ = _STEP_FIELDS


COUNTERS = ("steps", "preemptions", "forks", "prefix_hits", "prefix_hit_tokens", "block_copies",
            "evictions", "evicted_blocks", "rotated_blocks")


class _Counters(ct.Structure):
    _fields_ = [(name, ct.c_uint64) for name in COUNTERS]


@dataclass
class Step:
    """One op call, copied out of the scheduler (its arrays are only valid until the next
    ``schedule``)."""
    seq_ids: list
    past_lens: np.ndarray
    subsequence_begins: np.ndarray
    block_indices: np.ndarray
    block_indices_begins: np.ndarray
    emits: list
    token_ids: list
    token_pos: np.ndarray
    copies: list  # (src, dst)
    rotated_block_indices: np.ndarray  # [R]
    rotation_deltas: np.ndarray  # [R, BS]
    lut_rows: int
    preempted: list
    scores_len: int

    def tokens_of(self, b):
        """Token ids of sequence ``b`` of the batch."""
        lo, hi = self.subsequence_begins[b], self.subsequence_begins[b + 1]
        return self.token_ids[lo:hi]

    def blocks_of(self, b):
        return [int(x) for x in self.block_indices[self.block_indices_begins[b]:self.block_indices_begins[b + 1]]]


def _arr(p, n, dtype):
    return np.ctypeslib.as_array(p, (n,)).astype(dtype, copy=True) if n else np.zeros(0, dtype)


class Library:
    def __init__(self, path=DEFAULT_LIB):
        self.lib = ct.CDLL(str(path))
        self.lib.pa_last_error_message.restype = ct.c_size_t
        self.lib.pa_last_error_message.argtypes = [ct.c_char_p, ct.c_size_t]
        self.lib.pa_scheduler_destroy.restype = None
        self.lib.pa_scheduler_destroy.argtypes = [ct.c_void_p]
        for name, args in (
            ("pa_scheduler_create", [_P(_Config), _P(ct.c_void_p)]),
            ("pa_scheduler_add_request", [ct.c_void_p, ct.c_uint64, _P(ct.c_uint32), ct.c_size_t,
                                          ct.c_size_t, ct.c_int32]),
            ("pa_scheduler_schedule", [ct.c_void_p, _P(_Step)]),
            ("pa_scheduler_accumulate_scores", [ct.c_void_p, _P(ct.c_float), ct.c_size_t]),
            ("pa_scheduler_complete_step", [ct.c_void_p, _P(ct.c_uint64), _P(ct.c_uint32), ct.c_size_t,
                                            _P(ct.c_size_t)]),
            ("pa_scheduler_fork", [ct.c_void_p, ct.c_uint64, ct.c_uint64, ct.c_uint32, ct.c_size_t]),
            ("pa_scheduler_get_counters", [ct.c_void_p, _P(_Counters)]),
            ("pa_scheduler_counts", [ct.c_void_p, _P(ct.c_size_t), _P(ct.c_size_t)]),
            ("pa_cache_copy_blocks", [ct.c_void_p, ct.c_void_p, ct.c_size_t, ct.c_size_t, _P(_Copy),
                                      ct.c_size_t]),
            ("pa_cache_copy_blocks_kv", [ct.c_void_p, ct.c_void_p, ct.c_size_t, ct.c_size_t, ct.c_size_t,
                                         _P(_Copy), ct.c_size_t]),
            ("pa_cache_rotation_lut", [ct.c_size_t, ct.c_size_t, ct.c_double, ct.c_int32, _P(ct.c_float),
                                       ct.c_size_t]),
        ):
            f = getattr(self.lib, name)
            f.restype, f.argtypes = ct.c_int32, args

    def check(self, what, status):
        if status != 0:
            buf = ct.create_string_buffer(1024)
            self.lib.pa_last_error_message(buf, len(buf))
            raise SchedulerError(what, status, buf.value.decode(errors="replace"))

    def copy_blocks(self, key_cache: np.ndarray, value_cache: np.ndarray, copies):
        """``cache[dst] = cache[src]`` on both caches (C-contiguous, [NB, ...], the same number of
        blocks; their rows may differ: a value head size other than the key's) for each copy, in
        order."""
        if not copies:
            return
        nb = key_cache.shape[0]
        for c in (key_cache, value_cache):
            if not c.flags.c_contiguous or c.shape[0] != nb:
                raise ValueError("the caches must be C-contiguous arrays of the same number of blocks")
        arr = (_Copy * len(copies))(*[_Copy(s, d) for s, d in copies])
        self.check("pa_cache_copy_blocks_kv", self.lib.pa_cache_copy_blocks_kv(
            key_cache.ctypes.data, value_cache.ctypes.data, nb, key_cache.nbytes // nb,
            value_cache.nbytes // nb, arr, len(copies)))

    def rotation_lut(self, rows: int, head_size: int, base: float) -> np.ndarray:
        """The op's ``rotation_trig_lut`` [rows, head_size] that rotates keys back by the
        scheduler's deltas (RoPE base ``base``)."""
        out = np.zeros((rows, head_size), np.float32)
        self.check("pa_cache_rotation_lut", self.lib.pa_cache_rotation_lut(
            rows, head_size, base, 1, out.ctypes.data_as(_P(ct.c_float)), out.size))
        return out


class Scheduler:
    """A ``pa_scheduler``. ``eviction``: ``(start, recent, budget)`` in blocks, or None."""

    def __init__(self, lib: Library, num_blocks, block_size, max_batched_tokens, max_seqs,
                 prefix_caching=True, eviction=None):
        self.lib = lib
        start, recent, budget = eviction or (0, 0, 0)
        cfg = _Config(num_blocks, block_size, int(prefix_caching), max_batched_tokens, max_seqs,
                      budget, start, recent)
        h = ct.c_void_p()
        lib.check("pa_scheduler_create", lib.lib.pa_scheduler_create(ct.byref(cfg), ct.byref(h)))
        self.h = h
        self.block_size = block_size

    def close(self):
        if self.h:
            self.lib.lib.pa_scheduler_destroy(self.h)
            self.h = None

    def __del__(self):
        self.close()

    def add_request(self, rid, prompt, max_new_tokens, priority=0):
        p = np.ascontiguousarray(prompt, np.uint32)
        self.lib.check(f"add_request {rid}", self.lib.lib.pa_scheduler_add_request(
            self.h, rid, p.ctypes.data_as(_P(ct.c_uint32)), len(p), max_new_tokens, priority))

    def schedule(self) -> Step:
        s = _Step()
        self.lib.check("schedule", self.lib.lib.pa_scheduler_schedule(self.h, ct.byref(s)))
        b, t, r = s.num_seqs, s.num_tokens, s.num_rotated
        return Step(
            seq_ids=[int(x) for x in _arr(s.seq_ids, b, np.uint64)],
            past_lens=_arr(s.past_lens, b, np.int32),
            subsequence_begins=_arr(s.subsequence_begins, b + 1, np.int32),
            block_indices=_arr(s.block_indices, s.num_block_indices, np.int32),
            block_indices_begins=_arr(s.block_indices_begins, b + 1, np.int32),
            emits=[bool(x) for x in _arr(s.emits, b, np.uint8)],
            token_ids=[int(x) for x in _arr(s.token_ids, t, np.uint32)],
            token_pos=_arr(s.token_pos, t, np.int32),
            copies=[(s.copies[i].src, s.copies[i].dst) for i in range(s.num_copies)],
            rotated_block_indices=_arr(s.rotated_block_indices, r, np.int32),
            rotation_deltas=_arr(s.rotation_deltas, r * self.block_size, np.int32).reshape(r, self.block_size),
            lut_rows=s.lut_rows,
            preempted=[int(x) for x in _arr(s.preempted, s.num_preempted, np.uint64)],
            scores_len=s.scores_len,
        )

    def accumulate_scores(self, scores):
        sc = np.ascontiguousarray(scores, np.float32)
        self.lib.check("accumulate_scores", self.lib.lib.pa_scheduler_accumulate_scores(
            self.h, sc.ctypes.data_as(_P(ct.c_float)), len(sc)))

    def complete_step(self, sampled: dict) -> int:
        """``sampled``: request id -> token, one per emitting sequence. Returns how many requests
        finished."""
        ids = np.array(list(sampled), np.uint64)
        toks = np.array([sampled[i] for i in sampled], np.uint32)
        fin = ct.c_size_t()
        self.lib.check("complete_step", self.lib.lib.pa_scheduler_complete_step(
            self.h, ids.ctypes.data_as(_P(ct.c_uint64)), toks.ctypes.data_as(_P(ct.c_uint32)), len(ids),
            ct.byref(fin)))
        return fin.value

    def fork(self, parent, child, first_token, max_new_tokens):
        self.lib.check(f"fork {parent} -> {child}", self.lib.lib.pa_scheduler_fork(
            self.h, parent, child, first_token, max_new_tokens))

    def counters(self) -> dict:
        c = _Counters()
        self.lib.check("counters", self.lib.lib.pa_scheduler_get_counters(self.h, ct.byref(c)))
        return {name: int(getattr(c, name)) for name in COUNTERS}

    def counts(self):
        w, r = ct.c_size_t(), ct.c_size_t()
        self.lib.check("counts", self.lib.lib.pa_scheduler_counts(self.h, ct.byref(w), ct.byref(r)))
        return w.value, r.value
