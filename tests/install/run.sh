#!/usr/bin/env bash
# The installed package works for another project as a user would use it:
# installed into one prefix, copied to another (the first removed), with no
# path of the build tree in its files and no warning flags imposed on the
# consumer; the consumer configures with only the copy's prefix (LibTorch is
# found from python3, as zero's own build finds it), builds and runs.
set -euo pipefail
build_dir=$(cd "$1" && pwd) source_dir=$(cd "$2" && pwd)
work=$build_dir/install-test
rm -rf "$work"
mkdir -p "$work"
cmake --install "$build_dir" --prefix "$work/first" >/dev/null
cp -a "$work/first" "$work/moved"
rm -rf "$work/first"
prefix=$work/moved
fail() { echo "install test: $*" >&2; exit 1; }
for dir in "$build_dir" "$source_dir" "$work/first"; do
  if grep -rIl --include='*.cmake' -F "$dir" "$prefix" >/dev/null; then
    fail "the package names $dir: $(grep -rIl --include='*.cmake' -F "$dir" "$prefix" | head -3 | tr '\n' ' ')"
  fi
done
if grep -rIl --include='*.cmake' -e '-Wall' -e '-Wextra' "$prefix" >/dev/null; then
  fail "the package imposes warning flags on its users: $(grep -rIl --include='*.cmake' -e '-Wall' "$prefix" | head -3)"
fi
for lib in libc10.so libnvrtc.so; do
  if grep -rIl --include='*.cmake' -F "/$lib" "$prefix" >/dev/null; then fail "the package links $lib by absolute path"; fi
done
deps=$(sed -n 's/^ZERO_DEPS_PREFIX:PATH=//p' "$build_dir/CMakeCache.txt")
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
extra=()
[ -n "$deps" ] && extra=(-DZERO_DEPS_PREFIX="$deps" -DCMAKE_PREFIX_PATH="$prefix;$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)")
# The fine-tuning page's first snippet, as written, for consumer/readme_snippets.cpp.
awk '/^# Fine-tuning/{f=1} f && /^```cpp/{c=1; next} c && /^```/{exit} c' "$source_dir/docs/fine-tuning.md" \
  >"$work/readme_fine_tuning.inc"
[ -s "$work/readme_fine_tuning.inc" ] || fail "docs/fine-tuning.md: no C++ snippet under its Fine-tuning heading"
extra+=(-DREADME_SNIPPETS_DIR="$work")
cmake -S "$source_dir/tests/install/consumer" -B "$work/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_EXPORT_COMPILE_COMMANDS=ON "${launcher[@]}" "${extra[@]}" >"$work/configure.log" 2>&1 ||
  { cat "$work/configure.log" >&2; fail "the consumer does not configure against the moved package"; }
cmake --build "$work/consumer" >"$work/build.log" 2>&1 || { cat "$work/build.log" >&2; fail "the consumer does not build"; }
if grep -q -e ' -Wall' -e ' -Wextra' "$work/consumer/compile_commands.json"; then
  fail "the consumer is compiled with zero's warning flags: $(grep -o -e ' -W[a-z-]*' "$work/consumer/compile_commands.json" | sort -u | tr '\n' ' ')"
fi
# NOTE [standard library first]: the user's program lists libstdc++ before LibTorch too.
first=$(readelf -d "$work/consumer/consumer" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | grep -E '^(libstdc\+\+\.so|libtorch)' | head -1)
case "$first" in
  libstdc++.so*) ;;
  *) fail "the consumer lists ${first:-no libstdc++} before libstdc++.so.6 (NOTE [standard library first])" ;;
esac
"$work/consumer/consumer"
rm -rf "$work"
