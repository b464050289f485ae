#!/usr/bin/env bash
# The README is a front page a newcomer reads in minutes (under 150 lines),
# every page of docs/ is reachable from it (linked from the README, or from
# a page that is), and every relative link in README.md and docs/*.md names
# a file that exists (issue 53).
set -euo pipefail
cd "$1"
status=0
lines=$(wc -l < README.md)
[ "$lines" -lt 150 ] || { echo "README.md: $lines lines; a front page has under 150 (move the detail to docs/)"; status=1; }
# Relative links: [text](path) or [text](path#anchor), not http(s) or mailto.
links() { grep -oE '\]\([^)#]+(#[^)]*)?\)' "$1" | sed -E 's/^\]\(//; s/[)]$//; s/#.*//' | grep -vE '^(https?|mailto):' || true; }
declare -A reached=([README.md]=1)
queue=(README.md)
while [ ${#queue[@]} -gt 0 ]; do
  page=${queue[0]}; queue=("${queue[@]:1}")
  dir=$(dirname "$page")
  while IFS= read -r target; do
    [ -n "$target" ] || continue
    path=$(realpath -m --relative-to=. "$dir/$target")
    if [ ! -e "$path" ]; then echo "$page: links to $target, which does not exist"; status=1; continue; fi
    case "$path" in
      *.md) [ -n "${reached[$path]:-}" ] || { reached[$path]=1; queue+=("$path"); } ;;
    esac
  done < <(links "$page")
done
for page in docs/*.md; do
  [ -n "${reached[$page]:-}" ] || { echo "$page: not reachable from README.md (link it from the README or a page it links)"; status=1; }
done
[ $status -eq 0 ] && echo "README.md: $lines lines; ${#reached[@]} pages reachable, every relative link resolves"
exit $status
