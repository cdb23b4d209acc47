"""Drives a paged LLM graph step by step from Python: the inputs ``paged_attention_transformation``
gives a model (input_ids, position_ids, past_lens, subsequence_begins, block_indices,
block_indices_begins, max_context_len, key_cache.N, value_cache.N), whichever op sits in it
(OpenVINO's ``PagedAttentionExtension`` or our ``PagedAttention`` after tools/pa_convert.py).

The caller owns the schedule (which sequences run, their new tokens, past lengths and block
tables, cache rotations); ``PagedModel`` owns the caches (one numpy array per cache input, shared
with the request so the op's in-place writes land there; u8 and u4 caches as bytes) and sets every
input explicitly on every call (the CPU plugin misbehaves with default tensors of dynamic inputs).

A graph transformed with ``pa_convert.to_paged(..., serving=True)`` also has the inputs of cache
rotation (``rotated_block_indices.N``, ``rotation_deltas.N``, ``model_rotation_trig_lut``) and
``score_aggregation_window``, and outputs ``scores.N``: ``step`` feeds the rotation it is given to
every layer (or empty tensors), sums each sequence's new tokens' attention
(``score_aggregation_window = n_s``) and keeps the scores of the call in ``self.scores``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import openvino as ov

F32_CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}

# numpy arrays of the cache inputs: u8 and u4 caches (OpenVINO's quantized layouts) are bytes, a u4
# cache two elements a byte (its last dimension halved), bound as a u4 tensor over the bytes.
_NP = {ov.Type.f32: np.float32, ov.Type.f16: np.float16, ov.Type.i32: np.int32, ov.Type.i64: np.int64,
       ov.Type.u8: np.uint8, ov.Type.u4: np.uint8}


@dataclass
class Seq:
    """One sequence's part of a step: ``tokens`` new token ids at positions ``past..past+n``,
    its cache blocks ``blocks`` (enough for past + n tokens)."""
    tokens: list
    past: int
    blocks: list


class PagedModel:
    def __init__(self, compiled: ov.CompiledModel, num_blocks: int):
        self.compiled = compiled
        self.req = compiled.create_infer_request()
        self.names = {i.get_any_name() for i in compiled.inputs}
        self.caches = {}
        self.u4 = set()  # names of the u4 caches
        for inp in compiled.inputs:
            name = inp.get_any_name()
            if name.startswith(("key_cache.", "value_cache.")):
                ps = inp.get_partial_shape()
                dims = [num_blocks] + [ps[i].get_length() for i in range(1, 4)]
                if inp.get_element_type() == ov.Type.u4:
                    if dims[-1] % 2:
                        raise ValueError(f"{name}: u4 rows of {dims[-1]} elements are not whole bytes")
                    dims[-1] //= 2
                    self.u4.add(name)
                self.caches[name] = np.zeros(dims, _NP[inp.get_element_type()])
        if not self.caches:
            raise ValueError("the model has no key_cache.N / value_cache.N inputs")
        # dim 2 of a value cache (keys by channel have extra rows when quantized)
        self.block_size = next(c for n, c in self.caches.items() if n.startswith("value_cache.")).shape[2]
        self._keep = []
        self.scores = []
        self.last_infer_s = 0.0

    def step(self, seqs: list[Seq], rotation=None) -> np.ndarray:
        """Runs one call over ``seqs`` (in order); returns the logits of every new token, [T, V]
        float32, rows in the order of the sequences' tokens. ``rotation``: ``(block_indices [R],
        deltas [R, BS], trig_lut [M, D])`` applied to every layer's key cache before the call
        (the op's inputs), or None. ``self.scores`` then holds each layer's scores output."""
        bs = self.block_size
        ids, pos, past, begins, bi, bib = [], [], [], [0], [], [0]
        for s in seqs:
            need = -(-(s.past + len(s.tokens)) // bs)
            if len(s.blocks) < need:
                raise ValueError(f"{len(s.blocks)} blocks for {s.past + len(s.tokens)} tokens")
            ids += list(s.tokens)
            pos += range(s.past, s.past + len(s.tokens))
            past.append(s.past)
            begins.append(len(ids))
            bi += list(s.blocks)
            bib.append(len(bi))
        feeds = {
            "input_ids": np.array(ids, np.int64),
            "position_ids": np.array(pos, np.int64),
            "past_lens": np.array(past, np.int32),
            "subsequence_begins": np.array(begins, np.int32),
            "block_indices": np.array(bi, np.int32),
            "block_indices_begins": np.array(bib, np.int32),
            "max_context_len": np.array(max(p + len(s.tokens) for p, s in zip(past, seqs)), np.int32),
        }
        feeds.update(self.caches)
        feeds["score_aggregation_window"] = np.array([len(s.tokens) for s in seqs], np.int32)
        if rotation is None:
            rotation = (np.zeros(0, np.int32), np.zeros((0, bs), np.int32), np.zeros((0, 0), np.float32))
        rbi, deltas, lut = rotation
        feeds["model_rotation_trig_lut"] = np.asarray(lut, np.float32)
        for name in self.names:
            if name.startswith("rotated_block_indices."):
                feeds[name] = np.asarray(rbi, np.int32)
            elif name.startswith("rotation_deltas."):
                feeds[name] = np.asarray(deltas, np.int32).reshape(len(rbi), bs)
        missing = self.names - set(feeds)
        if missing:
            raise ValueError(f"no value for the model inputs {sorted(missing)}")
        tensors = {}
        for inp in self.compiled.inputs:
            name = inp.get_any_name()
            a = np.require(feeds[name], requirements="C")
            tensors[name] = (ov.Tensor(a, [*a.shape[:-1], 2 * a.shape[-1]], ov.Type.u4) if name in self.u4
                             else ov.Tensor(a, shared_memory=True))
            self.req.set_tensor(inp, tensors[name])
        self._keep = tensors  # alive until the next call replaces them
        t0 = time.perf_counter()
        self.req.infer()
        self.last_infer_s = time.perf_counter() - t0  # infer() alone, for benchmarks
        logits = self.req.get_tensor(self.compiled.outputs[0]).data
        self.scores = [np.array(self.req.get_tensor(o).data, np.float32, copy=True)
                       for o in self.compiled.outputs if o.get_any_name().startswith("scores.")]
        return np.array(logits, dtype=np.float32, copy=True).reshape(len(ids), -1)
