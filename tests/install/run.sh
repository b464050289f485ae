#!/usr/bin/env bash
# Installs the built package into a scratch prefix, then configures, builds and
# runs tests/install/consumer against it with find_package(zero).
set -euo pipefail
build_dir=$1 source_dir=$2
prefix=$build_dir/install-test
rm -rf "$prefix" "$build_dir/consumer"
cmake --install "$build_dir" --prefix "$prefix" >/dev/null
torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$source_dir/tests/install/consumer" -B "$build_dir/consumer" -G Ninja \
  -DCMAKE_PREFIX_PATH="$prefix;$torch_prefix" "${launcher[@]}" >/dev/null
cmake --build "$build_dir/consumer" >/dev/null
"$build_dir/consumer/consumer"
