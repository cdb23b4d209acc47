"""Puts tools/ on sys.path: the tests use the project's float64 reference (tools/pa_ref.py), the
OpenVINO built-in op oracle (tools/ov_builtin.py) and the IR writer (tools/ir_writer.py). Puts
OpenVINO's libraries on LD_LIBRARY_PATH for the `pa-engine` processes the tests start directly
(tools/engine_env.py: the engine has no RUNPATH; `pa` does this for users)."""
import sys
from pathlib import Path

TOOLS = str(Path(__file__).resolve().parents[2] / "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

import engine_env  # noqa: E402

engine_env.use_in_this_process()
