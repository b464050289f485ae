#!/usr/bin/env bash
# The layout's one-way rules (NOTE [build layout]): nothing in tools/
# includes a header of benchmarks/ (the tools run any program; minGPT is one
# of their clients, its model a library in models/mingpt).
set -euo pipefail
cd "$1"
status=0
for f in tools/*.cpp tools/*.h; do
  while IFS= read -r inc; do
    for hit in benchmarks/*/"$inc" benchmarks/"$inc"; do
      [ -e "$hit" ] && { echo "$f includes \"$inc\", which is $hit"; status=1; }
    done
  done < <(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$f")
done
[ $status -eq 0 ] && echo "layout: nothing in tools/ includes benchmarks/"
exit $status
