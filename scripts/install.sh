#!/usr/bin/env bash
# Builds in release mode and installs the commands and the C library, as `make install` would:
#
#   scripts/install.sh --prefix PREFIX [--no-openvino]
#
# PREFIX/bin/pa and PREFIX/bin/pa-engine (the engine: `pa generate`, `pa serve`; built when
# OpenVINO is found, as the extension below), debug info stripped. pa-engine has no RUNPATH: `pa`
# finds OpenVINO at run time ($OpenVINO_DIR, the active Python's openvino package,
# $LD_LIBRARY_PATH, the system's libraries; `pa --version` says which), so the clone can go.
# PREFIX/lib/libpaged_attention.so.X.Y.Z (+ .so.X, .so links; debug info stripped: ~25 MB -> ~2 MB),
# PREFIX/lib/libpaged_attention.a, PREFIX/include/paged_attention*.h,
# PREFIX/lib/pkgconfig/paged_attention.pc, PREFIX/lib/cmake/PagedAttention/ (imported targets
# PagedAttention::paged_attention and PagedAttention::paged_attention_static), and
# PREFIX/lib/libpaged_attention_openvino.so, the OpenVINO extension, when it builds (OpenVINO from
# scripts/setup.sh or $OPENVINO_DIR; otherwise a warning says it was skipped; --no-openvino skips
# it without trying). The .pc file and the CMake package locate the prefix from where they are,
# so an installed tree can be moved.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '4p' "$0" | sed 's/^#  */usage: /'; }
prefix=""
openvino=yes
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) [ $# -ge 2 ] || { usage >&2; exit 2; }; prefix="$2"; shift 2 ;;
    --prefix=*) prefix="${1#--prefix=}"; shift ;;
    --no-openvino) openvino=no; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
[ -n "$prefix" ] || { echo "install.sh: --prefix is required" >&2; usage >&2; exit 2; }

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n1)
major=${version%%.*}
# What a Rust staticlib needs from the system on x86_64-linux-gnu
# (`rustc --print native-static-libs`); the static link in tests/python/test_install.py checks it.
native_static="-lgcc_s -lutil -lrt -lpthread -lm -ldl -lc"

ext=""
engine=""
# With OpenVINO, one build of the whole workspace (what scripts/test.sh builds, so nothing is
# rebuilt after it); without, or if that fails, the C library and `pa` alone, then each OpenVINO
# crate on its own, so one that does not build does not stop the rest.
if [ "$openvino" = yes ] && cargo build --release --workspace --bins --lib; then
  ext=target/release/libpaged_attention_openvino.so
  engine=target/release/pa-engine
else
  cargo build --release -p paged_attention --lib
  cargo build --release -p paged_attention_cli --bin pa
  if [ "$openvino" = yes ]; then
    if cargo build --release -p paged_attention_openvino; then
      ext=target/release/libpaged_attention_openvino.so
    else
      echo "install.sh: warning: the OpenVINO extension did not build (see above); installing the C library without it" >&2
    fi
    if cargo build --release -p paged_attention_engine --bin pa-engine; then
      engine=target/release/pa-engine
    else
      echo "install.sh: warning: pa-engine did not build (see above); installing pa without \`pa generate\` and \`pa serve\`" >&2
    fi
  fi
fi

mkdir -p "$prefix/bin" "$prefix/lib/pkgconfig" "$prefix/lib/cmake/PagedAttention" "$prefix/include"
prefix=$(cd "$prefix" && pwd)
lib="$prefix/lib"

install -m 0755 target/release/libpaged_attention.so "$lib/libpaged_attention.so.$version"
strip --strip-debug "$lib/libpaged_attention.so.$version"
ln -sfn "libpaged_attention.so.$version" "$lib/libpaged_attention.so.$major"
ln -sfn "libpaged_attention.so.$major" "$lib/libpaged_attention.so"
install -m 0644 target/release/libpaged_attention.a "$lib/libpaged_attention.a"
strip --strip-debug "$lib/libpaged_attention.a"
install -m 0644 include/paged_attention.h include/paged_attention_cache.h "$prefix/include/"
if [ -n "$ext" ]; then
  install -m 0755 "$ext" "$lib/libpaged_attention_openvino.so"
  strip --strip-debug "$lib/libpaged_attention_openvino.so"
fi
for exe in target/release/pa $engine; do
  install -m 0755 "$exe" "$prefix/bin/"
  strip --strip-debug "$prefix/bin/$(basename "$exe")"
done

cat > "$lib/pkgconfig/paged_attention.pc" <<PC
prefix=\${pcfiledir}/../..
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: paged_attention
Description: PagedAttention (OpenVINO ie_internal_opset, 17 inputs / 2 outputs) for CPUs: C ABI
Version: $version
Libs: -L\${libdir} -lpaged_attention
Libs.private: $native_static
Cflags: -I\${includedir}
PC

cat > "$lib/cmake/PagedAttention/PagedAttentionConfig.cmake" <<CMAKE
# CMake package of paged_attention $version (scripts/install.sh). Imported targets:
#   PagedAttention::paged_attention         the shared library (libpaged_attention.so.$major)
#   PagedAttention::paged_attention_static  the static library, with its system libraries
# PagedAttention_OPENVINO_EXTENSION: path of the OpenVINO extension module, if installed.
# The prefix is found from this file's location, so the installed tree can be moved.
get_filename_component(_pa_prefix "\${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
if(NOT TARGET PagedAttention::paged_attention)
  add_library(PagedAttention::paged_attention SHARED IMPORTED)
  set_target_properties(PagedAttention::paged_attention PROPERTIES
    IMPORTED_LOCATION "\${_pa_prefix}/lib/libpaged_attention.so.$version"
    IMPORTED_SONAME "libpaged_attention.so.$major"
    INTERFACE_INCLUDE_DIRECTORIES "\${_pa_prefix}/include")
  add_library(PagedAttention::paged_attention_static STATIC IMPORTED)
  set_target_properties(PagedAttention::paged_attention_static PROPERTIES
    IMPORTED_LOCATION "\${_pa_prefix}/lib/libpaged_attention.a"
    INTERFACE_INCLUDE_DIRECTORIES "\${_pa_prefix}/include"
    INTERFACE_LINK_LIBRARIES "$(echo "${native_static}" | sed 's/-l//g; s/ /;/g')")
endif()
if(EXISTS "\${_pa_prefix}/lib/libpaged_attention_openvino.so")
  set(PagedAttention_OPENVINO_EXTENSION "\${_pa_prefix}/lib/libpaged_attention_openvino.so")
endif()
unset(_pa_prefix)
CMAKE

cat > "$lib/cmake/PagedAttention/PagedAttentionConfigVersion.cmake" <<CMAKE
# paged_attention $version: compatible with requests for the same major version, not newer.
set(PACKAGE_VERSION "$version")
if(PACKAGE_FIND_VERSION VERSION_GREATER PACKAGE_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE FALSE)
elseif(NOT "\${PACKAGE_FIND_VERSION_MAJOR}" STREQUAL "" AND NOT PACKAGE_FIND_VERSION_MAJOR EQUAL $major)
  set(PACKAGE_VERSION_COMPATIBLE FALSE)
else()
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
  if(PACKAGE_FIND_VERSION STREQUAL PACKAGE_VERSION)
    set(PACKAGE_VERSION_EXACT TRUE)
  endif()
endif()
if(CMAKE_SIZEOF_VOID_P AND NOT CMAKE_SIZEOF_VOID_P EQUAL 8)
  set(PACKAGE_VERSION "$version (64-bit)")
  set(PACKAGE_VERSION_UNSUITABLE TRUE)
endif()
CMAKE

echo "installed paged_attention $version into $prefix${ext:+ (with the OpenVINO extension)}${engine:+ (with pa-engine)}"
