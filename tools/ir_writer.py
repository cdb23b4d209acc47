"""The IR writer, for the tools and tests that run from a checkout: it is part of the Python
package (python/paged_attention/ir.py), imported from the source tree here."""
import sys
from pathlib import Path

_PY = str(Path(__file__).resolve().parent.parent / "python")
if _PY not in sys.path:
    sys.path.insert(0, _PY)

from paged_attention.ir import (  # noqa: E402,F401
    PRECISION, IRBuilder, Layer, Port, add_paged_attention, encode, pa_port_dims,
    paged_attention_ir, shape_attr)
