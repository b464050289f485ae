#!/usr/bin/env bash
# Installs what the build needs, and nothing that is already there.
# Idempotent: a second run on a ready machine only checks and returns.
#   Debian: cmake ninja-build g++ ccache liburing-dev libtbb-dev nlohmann-json3-dev libgtest-dev
#           libgloo-dev (headers only: Gloo itself is inside LibTorch) fio
#   PyPI:   torch==2.11.* (its CUDA 13.0 build; LibTorch is taken from it), safetensors
#           (the checkpoint tests read consolidated weights with it, as users do), transformers
#           5 (the Llama tests compare with Hugging Face's model and load what zero saves)
#           deepspeed 0.18.9 (tests/deepspeed: its checkpoints in and out, on CPU ranks)
set -euo pipefail

PY=${PYTHON:-python3}
debs=(cmake ninja-build g++ make ccache pkg-config liburing-dev libtbb-dev nlohmann-json3-dev libgtest-dev libgloo-dev fio)

missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

have_torch=$($PY - <<'PY' 2>/dev/null || true
import torch
print(torch.__version__)
PY
)
case "$have_torch" in
  2.11.*) ;;
  *)
    echo "setup: installing torch==2.11.* from PyPI (found: ${have_torch:-none})"
    $PY -m pip install --quiet "torch==2.11.*" || {
      echo "setup: error: 'pip install torch==2.11.*' failed; LibTorch 2.11 is required (see README)." >&2
      exit 1
    }
    ;;
esac

if ! $PY -c "import safetensors" 2>/dev/null; then
  echo "setup: installing safetensors from PyPI"
  $PY -m pip install --quiet "safetensors>=0.4" || {
    echo "setup: error: 'pip install safetensors' failed; the checkpoint tests need it (see README)." >&2
    exit 1
  }
fi

# Version 5: tests/models/make_llama.py uses its keys (rope_parameters, dtype=).
if ! $PY -c "import sys, transformers; sys.exit(int(transformers.__version__.split('.')[0]) != 5)" 2>/dev/null; then
  echo "setup: installing transformers 5 from PyPI"
  $PY -m pip install --quiet "transformers>=5,<6" || {
    echo "setup: error: 'pip install transformers' failed; the Llama tests compare with it (see README)." >&2
    exit 1
  }
fi

# DeepSpeed itself, on CPU: tests/deepspeed resumes its checkpoints in zero and
# zero's exports in it (they skip, saying why, without it). Its ops are not
# built: the tests use torch's Adam and Gloo.
if ! DS_ACCELERATOR=cpu $PY -c "import deepspeed" 2>/dev/null; then
  echo "setup: installing deepspeed 0.18.9 from PyPI"
  DS_BUILD_OPS=0 $PY -m pip install --quiet "deepspeed==0.18.9" || {
    echo "setup: error: 'pip install deepspeed==0.18.9' failed; the DeepSpeed checkpoint tests use it (see docs/checkpoints.md)." >&2
    exit 1
  }
fi
