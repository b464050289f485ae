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
# The pages' fragments, each compiled in the context readme_snippets.cpp gives it.
nth_block() { awk -v n="$1" '/^```cpp/{k++; if (k == n) {c=1; next}} c && /^```/{exit} c' "$2"; }
nth_block 2 "$source_dir/docs/getting-started.md" >"$work/getting_started_forward.inc"
nth_block 3 "$source_dir/docs/getting-started.md" >"$work/getting_started_init.inc"
nth_block 1 "$source_dir/docs/checkpoints.md" >"$work/checkpoints_calls.inc"
nth_block 1 "$source_dir/docs/tools.md" >"$work/tools_memory_test.inc"
for f in getting_started_forward getting_started_init checkpoints_calls tools_memory_test; do
  [ -s "$work/$f.inc" ] || fail "docs: the snippet for $f is gone (tests/install/run.sh takes them by their place)"
done
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
# A newcomer's path (issue 53): docs/getting-started.md's first program, its
# CMakeLists.txt and ds_config.json, as written, built against the package
# and run (one process, then two ranks through the package's zero launch);
# the README's program is the same, compiled as written.
page=$source_dir/docs/getting-started.md
first_block() { awk -v lang="$1" '$0 == "```" lang {c=1; next} c && /^```/{exit} c' "$2"; }
mkdir -p "$work/newcomer"
first_block cpp "$page" >"$work/newcomer/main.cpp"
first_block cmake "$page" >"$work/newcomer/CMakeLists.txt"
first_block json "$page" >"$work/newcomer/ds_config.json"
for f in main.cpp CMakeLists.txt ds_config.json; do
  [ -s "$work/newcomer/$f" ] || fail "docs/getting-started.md: no $f block (its first cpp, cmake and json blocks)"
done
first_block cpp "$source_dir/README.md" >"$work/readme_program.cpp"
cmp -s "$work/readme_program.cpp" "$work/newcomer/main.cpp" ||
  fail "README.md's program differs from docs/getting-started.md's first program: keep them one"
cmake -S "$work/newcomer" -B "$work/newcomer/build" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" "${launcher[@]}" \
  "${extra[@]}" >"$work/newcomer.log" 2>&1 || { cat "$work/newcomer.log" >&2; fail "the getting-started project does not configure"; }
cmake --build "$work/newcomer/build" >>"$work/newcomer.log" 2>&1 ||
  { cat "$work/newcomer.log" >&2; fail "the getting-started program does not build"; }
(cd "$work/newcomer" && OMP_NUM_THREADS=1 ./build/train >"$work/newcomer.run" 2>&1) ||
  { cat "$work/newcomer.run" >&2; fail "the getting-started program does not run"; }
grep -q '^step 150 loss' "$work/newcomer.run" || { cat "$work/newcomer.run" >&2; fail "the getting-started program printed no loss"; }
[ -f "$work/newcomer/ckpt/latest" ] || fail "the getting-started program saved no checkpoint"
(cd "$work/newcomer" && rm -rf ckpt && OMP_NUM_THREADS=1 "$prefix/bin/zero" launch --nproc_per_node 2 -- ./build/train \
  >"$work/newcomer.run2" 2>&1) || { cat "$work/newcomer.run2" >&2; fail "the getting-started program does not run on 2 ranks"; }
[ -f "$work/newcomer/ckpt/latest" ] || fail "the getting-started program on 2 ranks saved no checkpoint"
rm -rf "$work"
