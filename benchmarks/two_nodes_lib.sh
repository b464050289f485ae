# What benchmarks/zeropp.sh and benchmarks/mics.sh share: a free port, a
# command on two nodes of 2 ranks on loopback, and the text the loss runs
# train on. Sourced; expects $bin (the built binaries) and $root.

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

two_nodes() {  # two_nodes LOG COMMAND...: the command on 2 nodes x 2 ranks
  local log=$1 port other
  shift
  port=$(free_port)
  node() {
    env OMP_NUM_THREADS=1 "$bin/zero" launch --nnodes 2 --node_rank "$1" --nproc_per_node 2 \
      --master_addr 127.0.0.1 --master_port "$port" -- "${@:2}"
  }
  node 1 "$@" >"$log.1" 2>&1 &
  other=$!
  node 0 "$@" >"$log.0" 2>&1 || { kill "$other" 2>/dev/null; wait "$other" 2>/dev/null; cat "$log.0" >&2; exit 1; }
  wait "$other" || { cat "$log.1" >&2; exit 1; }
}

text_data() {  # text_data DIR: DIR/text.txt (the docs and README), DIR/tokens.bin (its bytes), DIR/llama (2 layers)
  cat "$root"/docs/*.md "$root"/README.md >"$1/text.txt"
  python3 - "$1/text.txt" "$1/tokens.bin" <<'PY'
import struct, sys
data = open(sys.argv[1], "rb").read()
open(sys.argv[2], "wb").write(struct.pack("<%dH" % len(data), *data))  # byte tokens, under the vocabulary's 1024
PY
  mkdir -p "$1/llama"
  python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); c["num_hidden_layers"]=2; json.dump(c, open(sys.argv[2], "w"))' \
    "$root/benchmarks/configs/llama_small_config.json" "$1/llama/config.json"
}
