"""The environment `pa-engine` runs in when started directly, not through `pa`: the engine links
OpenVINO with no RUNPATH (so it can be installed and moved), and `pa` puts OpenVINO's libraries on
LD_LIBRARY_PATH before running it. Scripts and tests that start the engine themselves do the same
here, with the `openvino` package of the Python running them.

``engine_env(env)`` returns a copy of ``env`` (default ``os.environ``) with that directory first on
LD_LIBRARY_PATH; ``use_in_this_process()`` does it to ``os.environ``, for every child started
after it."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def openvino_libs():
    """The ``libs`` directory of the importable ``openvino`` package (not imported), or None."""
    spec = importlib.util.find_spec("openvino")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = Path(list(spec.submodule_search_locations)[0]) / "libs"
    return libs if libs.is_dir() else None


def engine_env(env=None):
    env = dict(os.environ if env is None else env)
    libs = openvino_libs()
    if libs is not None:
        old = [d for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d and d != str(libs)]
        env["LD_LIBRARY_PATH"] = os.pathsep.join([str(libs), *old])
    return env


def use_in_this_process():
    os.environ.update(engine_env())
