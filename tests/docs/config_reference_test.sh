#!/usr/bin/env bash
# docs/configuration.md lists every key the config code reads, with the
# default it uses (scripts/config_reference.py --check: the table as the
# code would write it now).
set -euo pipefail
python3 "$1/scripts/config_reference.py" "$2" --check
