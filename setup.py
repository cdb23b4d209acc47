"""The two shared objects of the wheel (pyproject.toml has the metadata): the C library and the
OpenVINO extension, each built in release mode by cargo and copied into the package directory
(ctypes and `core.add_extension` load them by path: no Python bindings), debug info stripped."""
from setuptools import setup
from setuptools_rust import Binding, RustExtension, Strip

setup(
    rust_extensions=[
        RustExtension("paged_attention.libpaged_attention", path="Cargo.toml",
                      binding=Binding.NoBinding, py_limited_api=False, strip=Strip.Debug),
        RustExtension("paged_attention.libpaged_attention_openvino", path="openvino/Cargo.toml",
                      binding=Binding.NoBinding, py_limited_api=False, strip=Strip.Debug),
    ],
)
