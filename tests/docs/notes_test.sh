#!/usr/bin/env bash
# Every NOTE [name] cited in the sources is defined once, and docs/notes.md
# lists every definition with its file.
set -euo pipefail
root=$1
cd "$root"
if git rev-parse --git-dir >/dev/null 2>&1; then
  files=$(git ls-files '*.h' '*.cpp' 'CMakeLists.txt' '*/CMakeLists.txt')
else  # a copy of the tree without git (the GPU machine)
  files=$(find . \( -path './build*' -o -path './.gpu-deps' \) -prune -o \( -name '*.h' -o -name '*.cpp' -o -name CMakeLists.txt \) -print |
          sed 's|^\./||')
fi
defs=$(grep -hE '^\s*(//|#) NOTE \[[^]]+\]\s*$' $files | sed -E 's/.*NOTE \[([^]]+)\].*/\1/' | sort)
dups=$(echo "$defs" | uniq -d)
[ -z "$dups" ] || { echo "defined more than once: $dups"; exit 1; }
status=0
while IFS= read -r name; do
  [ -n "$name" ] || continue
  # (a here-string: `echo | grep -q` under pipefail fails when grep quits first and echo gets SIGPIPE)
  grep -qxF "$name" <<<"$defs" || { echo "cited but never defined: NOTE [$name]"; status=1; }
done < <(grep -ohE 'NOTE \[[^]]+\]' $files | sed -E 's/NOTE \[([^]]+)\]/\1/' | sort -u)
while IFS= read -r name; do
  file=$(grep -lE "^\s*(//|#) NOTE \[$name\]\s*$" $files | sed -n 1p)
  grep -qF "| [$name] | \`$file\` |" docs/notes.md || { echo "docs/notes.md: missing or wrong row for NOTE [$name] ($file)"; status=1; }
done <<< "$defs"
[ $status -eq 0 ] && echo "notes: $(echo "$defs" | wc -l) definitions, every citation defined, docs/notes.md complete"
exit $status
