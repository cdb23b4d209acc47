"""PagedAttention for CPUs: the OpenVINO extension and a numpy binding of the C library.

    import openvino as ov, paged_attention as pa
    core = ov.Core()
    core.add_extension(pa.extension_path())      # the op `PagedAttention` in ie_internal_opset
    output, scores = pa.execute(inputs)           # or without OpenVINO: numpy arrays in, out

``execute`` takes the op's 9 to 17 inputs (docs/contract.md order, ``INPUT_NAMES``) as numpy
arrays: float32, float16, uint16 (bf16 bit patterns), int32 (indices, lengths), uint8 (u8
caches). The caches (inputs 3 and 4) are written in place, so pass writable C-contiguous arrays.
``paged_attention.ir`` writes OpenVINO IR models with the op (``paged_attention_ir``).

The extension is built for one OpenVINO release (``OPENVINO_VERSION``); the package requires it.
"""
from __future__ import annotations

from ._native import (OPENVINO_VERSION, PaError, execute, extension_path, library_path,
                      validate, version)
from ._tensors import INPUT_NAMES, bf16_bits_to_f32, f32_to_bf16_bits

__version__ = "0.1.0"

__all__ = ["OPENVINO_VERSION", "INPUT_NAMES", "PaError", "execute", "validate", "extension_path",
           "library_path", "version", "f32_to_bf16_bits", "bf16_bits_to_f32", "__version__"]
