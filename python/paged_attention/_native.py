"""ctypes binding of the C library (include/paged_attention.h) and where the shared objects are.

Inside an installed wheel both libraries sit next to this file. From a source checkout (the
tools and tests), they are target/release/ of the repository; ``PA_LIBRARY`` and
``PA_EXTENSION_LIB`` override either path.
"""
from __future__ import annotations

import ctypes as ct
import os
from pathlib import Path

import numpy as np

from ._tensors import DTYPE, ELEM, elem_of

# The OpenVINO release the extension was built against (the wheel pins it).
OPENVINO_VERSION = "2026.4.1"
_HERE = Path(__file__).resolve().parent
_CHECKOUT = _HERE.parent.parent / "target" / "release"
_MAX_RANK = 8


def _find(env: str, stem: str) -> Path:
    if os.environ.get(env):
        return Path(os.environ[env])
    # In a wheel: setuptools-rust names the file after the module (stem + the platform suffix).
    for p in sorted(_HERE.glob(stem + "*.so")):
        if stem != "libpaged_attention" or "openvino" not in p.name:
            return p
    p = _CHECKOUT / f"{stem}.so"
    if p.exists():
        return p
    raise FileNotFoundError(
        f"{stem}.so not found next to {__file__} nor in {_CHECKOUT}; "
        f"build it (README, 'Use it from C') or set {env}")


def library_path() -> str:
    """Path of the C library (no OpenVINO dependency)."""
    return str(_find("PA_LIBRARY", "libpaged_attention"))


def extension_path() -> str:
    """Path of the OpenVINO extension: ``core.add_extension(extension_path())``."""
    return str(_find("PA_EXTENSION_LIB", "libpaged_attention_openvino"))


class PaError(RuntimeError):
    """A call the library refused: ``status`` is the PA_STATUS_* name, the message says why."""

    def __init__(self, status: str, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


class _Tensor(ct.Structure):
    _fields_ = [("elem_type", ct.c_int32), ("rank", ct.c_int32),
                ("dims", ct.c_int64 * _MAX_RANK), ("data", ct.c_void_p)]


class _Shape(ct.Structure):
    _fields_ = [("elem_type", ct.c_int32), ("rank", ct.c_int32), ("dims", ct.c_int64 * _MAX_RANK)]


_lib = None


def _load():
    global _lib
    if _lib is None:
        lib = ct.CDLL(library_path())
        lib.pa_version_string.restype = ct.c_char_p
        lib.pa_status_name.restype = ct.c_char_p
        lib.pa_status_name.argtypes = [ct.c_int32]
        lib.pa_last_error_message.restype = ct.c_size_t
        lib.pa_last_error_message.argtypes = [ct.c_char_p, ct.c_size_t]
        lib.pa_validate.argtypes = [ct.POINTER(_Tensor), ct.c_size_t, ct.POINTER(_Shape)]
        lib.pa_execute.argtypes = [ct.POINTER(_Tensor), ct.c_size_t, ct.POINTER(_Tensor), ct.c_size_t]
        _lib = lib
    return _lib


def version() -> str:
    """The C library's version string."""
    return _load().pa_version_string().decode()


def _check(status: int) -> None:
    if status != 0:
        lib = _load()
        buf = ct.create_string_buffer(lib.pa_last_error_message(None, 0) + 1)
        lib.pa_last_error_message(buf, len(buf))
        raise PaError(lib.pa_status_name(status).decode(), buf.value.decode(errors="replace"))


def _tensors(arrays) -> tuple:
    arrays = [np.asarray(a) for a in arrays]
    if not 9 <= len(arrays) <= 17:
        raise ValueError(f"{len(arrays)} inputs: the op takes 9 to 17")
    ts = (_Tensor * len(arrays))()
    for t, a in zip(ts, arrays):
        if a.ndim > _MAX_RANK:
            raise ValueError(f"rank {a.ndim} > {_MAX_RANK}")
        if not a.flags.c_contiguous:
            raise ValueError("inputs must be C-contiguous (np.ascontiguousarray)")
        t.elem_type, t.rank = ELEM[elem_of(a)], a.ndim
        for i, d in enumerate(a.shape):
            t.dims[i] = d
        t.data = a.ctypes.data if a.size else None
    return arrays, ts


def _validate(ts) -> tuple:
    shapes = (_Shape * 2)()
    _check(_load().pa_validate(ts, len(ts), shapes))
    return tuple(tuple(s.dims[i] for i in range(s.rank)) for s in shapes)


def validate(inputs) -> tuple:
    """Checks a call without writing anything; returns the (output, scores) shapes it needs."""
    return _validate(_tensors(inputs)[1])


def execute(inputs) -> tuple:
    """Runs the op: writes the new tokens into the caches (inputs 3 and 4, in place) and returns
    ``(output, scores)`` of the query's element type. Raises ``PaError`` (nothing written) for a
    call the contract refuses."""
    arrays, ts = _tensors(inputs)
    for i in (3, 4):
        if not arrays[i].flags.writeable:
            raise ValueError(f"input {i} (a cache) must be writable: it is written in place")
    out_shapes = _validate(ts)
    dt = DTYPE[elem_of(arrays[0])]
    outs = [np.empty(s, dtype=dt) for s in out_shapes]
    os_ = (_Tensor * 2)()
    for t, a in zip(os_, outs):
        t.elem_type, t.rank = ELEM[elem_of(a)], a.ndim
        for i, d in enumerate(a.shape):
            t.dims[i] = d
        t.data = a.ctypes.data if a.size else None
    _check(_load().pa_execute(ts, len(ts), os_, 2))
    return outs[0], outs[1]
