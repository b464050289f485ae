#!/usr/bin/env bash
# `make docs`: the API reference, Doxygen over the public headers
# (*/include/zero/, docs/Doxyfile), written to OUT/html/index.html.
# Installs doxygen when it is missing (Debian). Every warning fails the
# build: a public name without a comment, a comment doxygen cannot read.
#   scripts/docs.sh [OUT]        (default: build/docs)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/docs}

if ! command -v doxygen >/dev/null; then
  echo "docs: installing doxygen (Debian)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq doxygen >/dev/null
fi

mkdir -p "$out"
rm -rf "$out/html"
log="$out/warnings.log"
if ! ZERO_DOCS_OUT="$out" doxygen docs/Doxyfile >"$log" 2>&1; then
  n=$(grep -c ': error: ' "$log" || true)
  cat "$log" >&2
  echo "docs: $n problem(s) in the public headers (above; also in $log): document each public name with /// or ///<" >&2
  exit 1
fi
echo "docs: $out/html/index.html ($(ls "$out/html" | wc -l) files, no warnings)"
