#!/usr/bin/env bash
# NOTE [standard library first]: every program of the build (build/bin, build/tests)
# that needs both lists libstdc++.so.6 before LibTorch's libraries, so its
# std::filesystem calls bind to libstdc++ and not to LibTorch's copies.
set -euo pipefail
build=$1
status=0 checked=0
for f in "$build"/bin/* "$build"/tests/*; do
  [ -f "$f" ] && [ -x "$f" ] || continue
  head -c 4 "$f" | grep -q 'ELF' || continue
  needed=$(readelf -d "$f" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  echo "$needed" | grep -q '^libtorch' || continue
  checked=$((checked + 1))
  first=$(echo "$needed" | grep -n -E '^(libstdc\+\+\.so|libtorch)' | head -1 | cut -d: -f2)
  case "$first" in
    libstdc++.so*) ;;
    *) echo "$f: needs $first before libstdc++.so.6 (its std::filesystem calls bind to LibTorch's copies)"; status=1 ;;
  esac
done
[ $checked -gt 0 ] || { echo "no program linking LibTorch under $build/bin or $build/tests"; exit 1; }
[ $status -eq 0 ] && echo "link order: $checked programs list libstdc++ before LibTorch"
exit $status
