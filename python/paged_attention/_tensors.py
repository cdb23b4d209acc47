"""The op's input names (docs/contract.md order) and the numpy <-> element type mapping the
package uses: float32, float16, uint16 (bf16 bit patterns), int32, uint8 (u8 caches)."""
from __future__ import annotations

import numpy as np

INPUT_NAMES = [
    "query", "key", "value", "key_cache", "value_cache", "past_lens", "subsequence_begins",
    "block_indices", "block_indices_begins", "scale", "sliding_window", "alibi_slopes",
    "rotated_block_indices", "rotation_deltas", "rotation_trig_lut", "score_aggregation_window", "sinks",
]

# PA_ELEM_* of include/paged_attention.h.
ELEM = {"f32": 0, "f16": 1, "bf16": 2, "i32": 3, "u8": 4}
_OF_DTYPE = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.uint16): "bf16",
             np.dtype(np.int32): "i32", np.dtype(np.uint8): "u8"}
DTYPE = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "i32": np.int32, "u8": np.uint8}


def elem_of(a: np.ndarray) -> str:
    """The element type of an array: uint16 arrays hold bf16 bit patterns."""
    try:
        return _OF_DTYPE[a.dtype]
    except KeyError:
        raise TypeError(f"dtype {a.dtype} is not an element type of the op "
                        "(float32, float16, uint16 = bf16 bits, int32, uint8)") from None


def f32_to_bf16_bits(x) -> np.ndarray:
    """float32 values rounded to bf16 (to nearest, ties to even) as raw uint16 bits; NaN stays a
    quiet NaN."""
    a = np.require(x, dtype=np.float32, requirements="C")
    u = a.view(np.uint32).astype(np.uint64)
    out = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        out = np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), out)
    return out


def bf16_bits_to_f32(b) -> np.ndarray:
    """bf16 bit patterns (uint16) as float32 values (exact)."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
