#!/usr/bin/env bash
# The GPU machine's one command (see scripts/gpu/README.md). It has CMake,
# ninja, nvcc, CUDA and python3 with torch, and no package registry: the
# other build dependencies come from the folder scripts/gpu/bundle.sh made
# here (carried with the call), nothing is installed.
#
#   scripts/gpu/run.sh all      the one call of a session (10 minutes): build only gpu_tests, mingpt and
#                               zero; the gpu-labelled tests; each failed or crashed one again under
#                               cuda-gdb (thread apply all bt) into gdb.log; then scripts/gpu/bench.py
#                               with the time left. Works to a deadline (ZERO_DEADLINE_S after the
#                               start, default 560): each phase gets what is left and the results so
#                               far are written whatever happens. The CPU suite is CI's, not run here.
#   scripts/gpu/run.sh test     configure, build everything, run the CTest suite (the gpu tests, then
#                               the CPU suite with the GPU hidden): more than one call's 10 minutes
#   scripts/gpu/run.sh bench    configure, build mingpt and zero, run scripts/gpu/bench.py
#   scripts/gpu/run.sh maxparams  build mingpt and zero, run benchmarks/max_params.sh on the
#                               one GPU with budgets from ZERO_MAXP_ARGS (default: device
#                               8GiB, host 16GiB, NVMe 24GiB, bf16): max_params.{md,json,png}
#   scripts/gpu/run.sh llama30b build llama and zero, then train LLaMA-30B's shape
#                               (benchmarks/configs/llama30b_config.json, 32.5B parameters) for 3
#                               steps under zero::Init, its bf16 master and 8-bit moments placed by
#                               zero estimate's planner over 0.95 of the card's free memory, 120GB of host memory and
#                               ZERO_NVME_BYTES (default 56GB) under ZERO_NVME_DIR:
#                               llama30b.{md,json,log} (issue 37 §5)
#   scripts/gpu/run.sh lora     build llama and zero, run benchmarks/lora.sh on the one card (1 rank):
#                               LoRA r=16 on an 8-layer Llama of hidden 1024 at stage 3, with and
#                               without CPU offload, beside full fine-tuning: lora.{md,json,log}
#                               (issue 50, issue 52 §6)
#
# Environment: OUT (where results go; default ./gpu-out), ZERO_DEPS_PREFIX
# (default ./.gpu-deps), ZERO_GPU_BUILD (default ./build-gpu), ZERO_COMMIT
# (the commit tested, for the record; default: git's, if there is a .git),
# ZERO_NVME_DIR (the NVMe benchmarks' folder; default /tmp/zero-nvme),
# ZERO_BENCH_SCALE (full, or smoke: tiny models, to check the script itself).
# Results, at most 8 files (what the device tool brings back): env.txt,
# build.log, test.log, bench.log, bench.json, summary.md, and for all gdb.log
# and trace-stage3-cpu-offload.json (the CPU-offload benchmarks' ZERO_TRACE, without and with
# super_offload, each a process of its own), for
# test ctest-gpu.xml and ctest-cpu.xml. Exits non-zero when the build, a test
# or a benchmark fails.
set -uo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
mode=${1:-all}
case "$mode" in test|bench|all|maxparams|llama30b|lora) ;; *) echo "usage: scripts/gpu/run.sh test|bench|all|maxparams|llama30b|lora" >&2; exit 2 ;; esac
out=${OUT:-$root/gpu-out}
deps=${ZERO_DEPS_PREFIX:-$root/.gpu-deps}
build=${ZERO_GPU_BUILD:-$root/build-gpu}
commit=${ZERO_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
jobs=$(nproc)
mkdir -p "$out"
summary=$out/summary.md
status=0
t_start=$(date +%s)

say() { echo "run.sh: $*" | tee -a "$out/env.txt" >&2; }
elapsed() { echo $(( $(date +%s) - t_start ))s; }
deadline=$(( t_start + ${ZERO_DEADLINE_S:-560} ))
remaining() { echo $(( deadline - $(date +%s) )); }

# ---- the machine ------------------------------------------------------------
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $commit"
  echo "mode: $mode"
  echo "host: $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME"), $(nproc) cores, $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB"}') RAM"
  # The CPU behind `zero bench adam`'s figures: its model, whether the
  # cores are hyperthreads (two threads a core share one divider), and the
  # vector extensions the kernels choose from.
  echo "cpu: $(lscpu 2>/dev/null | awk -F: '/^Model name/ {gsub(/^ +/, "", $2); print $2}'), $(lscpu 2>/dev/null | awk -F: '/^Thread\(s\) per core/ {gsub(/ /, "", $2); print $2}') thread(s) a core, $(lscpu 2>/dev/null | awk -F: '/^Socket\(s\)/ {gsub(/ /, "", $2); print $2}') socket(s), $(grep -o -w -E 'avx512f|avx512bw|avx2|f16c' /proc/cpuinfo 2>/dev/null | sort -u | tr '\n' ' ')"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  else
    echo "gpu: none (no nvidia-smi)"
  fi
  echo "disk ($(dirname "${ZERO_NVME_DIR:-/tmp/zero-nvme}")): $(df -h "$(dirname "${ZERO_NVME_DIR:-/tmp/zero-nvme}")" 2>/dev/null | awk 'NR==2 {print $4 " free of " $2}')"
  echo "python3: $(python3 -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>/dev/null || echo "cannot import torch")"
  echo "cmake: $(cmake --version 2>&1 | head -1)"
  echo "ninja: $(ninja --version 2>&1)"
  echo "c++: $(c++ --version 2>&1 | head -1)"
  echo "nvcc: $(nvcc --version 2>&1 | tail -1)"
  echo "bundle: $(head -1 "$deps/MANIFEST" 2>&1)"
} >"$out/env.txt"
cat "$out/env.txt" >&2

{
  echo "# zero on the GPU machine"
  echo
  echo "$(grep -E '^(date|commit|gpu|host):' "$out/env.txt" | sed 's/^/- /')"
  echo
} >"$summary"

if [ ! -f "$deps/MANIFEST" ]; then
  say "error: no bundle at $deps (run scripts/gpu/bundle.sh where the registries are reachable, and carry .gpu-deps)"
  exit 1
fi
export PATH="$deps/bin:$PATH"  # fio, for zero bench aio

# ---- configure and build ----------------------------------------------------
configure() {
  [ -f "$build/build.ninja" ] && return 0
  say "configuring $build ($(elapsed))"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DZERO_DEPS_PREFIX="$deps" -DTORCH_CUDA_ARCH_LIST=9.0 >>"$out/build.log" 2>&1
}

build() {  # targets...
  local what=("$@")
  say "building ${what[*]:-everything} on $jobs cores ($(elapsed))"
  local args=()
  for t in "${what[@]}"; do args+=(--target "$t"); done
  if ! cmake --build "$build" -j "$jobs" "${args[@]}" >>"$out/build.log" 2>&1; then
    say "error: the build failed; the end of build.log:"
    tail -40 "$out/build.log" >&2
    { echo "## Build: FAILED"; echo; echo '```'; tail -40 "$out/build.log"; echo '```'; } >>"$summary"
    return 1
  fi
  say "built ($(elapsed))"
}

if ! configure; then
  say "error: cmake could not configure; the end of build.log:"
  tail -40 "$out/build.log" >&2
  { echo "## Configure: FAILED"; echo; echo '```'; tail -40 "$out/build.log"; echo '```'; } >>"$summary"
  exit 1
fi
grep -E "^-- zero:" "$out/build.log" | sed 's/^-- /  /' >>"$out/env.txt"

# ---- tests ------------------------------------------------------------------
# The tests labelled gpu run with the GPU, one at a time (they share it). The
# rest is the CPU suite CI runs: it runs with the GPU hidden
# (CUDA_VISIBLE_DEVICES=), as on CI's machines, on all cores.
failed_lines() {  # ctest log -> its lines of tests that failed, timed out or crashed
  grep -hE "^\s*[0-9]+ - .*\((Failed|Timeout|SEGFAULT|Subprocess|Exception|Child|BUS|ILLEGAL|OTHER)" "$1"
}

count() {  # ctest log -> "passed failed skipped total"
  local log=$1
  local total failed skipped
  total=$(grep -oE "tests failed out of [0-9]+" "$log" | tail -1 | grep -oE "[0-9]+$")
  failed=$(grep -oE "[0-9]+ tests failed out of" "$log" | tail -1 | grep -oE "^[0-9]+")
  skipped=$(grep -cE "\*\*\*Skipped|Not Run|Disabled" "$log")
  total=${total:-0}; failed=${failed:-0}
  echo "$((total - failed - skipped)) $failed $skipped $total"
}

run_tests() {
  build || return 1
  local rc=0
  check_link_order || rc=1
  say "GPU tests ($(elapsed))"
  (cd "$build" && ctest -L gpu --output-on-failure --timeout 600 --output-junit "$out/ctest-gpu.xml") \
    >"$out/test.log" 2>&1 || rc=1
  local gpu_counts
  gpu_counts=$(count "$out/test.log")
  say "CPU suite with the GPU hidden, -j $jobs ($(elapsed))"
  (cd "$build" && CUDA_VISIBLE_DEVICES= ctest -LE gpu -j "$jobs" --output-on-failure --timeout 600 \
                    --output-junit "$out/ctest-cpu.xml") >"$out/test-cpu.log" 2>&1 || rc=1
  local cpu_counts
  cpu_counts=$(count "$out/test-cpu.log")
  { echo; echo "==== CPU suite (CUDA_VISIBLE_DEVICES=) ===="; cat "$out/test-cpu.log"; } >>"$out/test.log"
  rm -f "$out/test-cpu.log"
  read -r gp gf gs gt <<<"$gpu_counts"
  read -r cp cf cs ct <<<"$cpu_counts"
  {
    echo "## Tests ($(elapsed))"
    echo
    echo "| suite | passed | failed | skipped | total |"
    echo "|---|---|---|---|---|"
    echo "| gpu (\`ctest -L gpu\`) | $gp | $gf | $gs | $gt |"
    echo "| cpu (\`CUDA_VISIBLE_DEVICES= ctest -LE gpu\`) | $cp | $cf | $cs | $ct |"
    echo
    if [ "$rc" -ne 0 ]; then
      echo "Failed:"
      echo '```'
      failed_lines "$out/test.log" | head -40
      echo '```'
    fi
    echo "Skipped (with their reasons in test.log):"
    echo '```'
    grep -hE "\*\*\*Skipped" "$out/test.log" | head -20
    echo '```'
  } >>"$summary"
  say "tests: gpu $gp passed, $gf failed, $gs skipped; cpu $cp passed, $cf failed, $cs skipped ($(elapsed))"
  return $rc
}

# NOTE [standard library first] on this machine's build, whose compiler is not
# CI's: each program lists libstdc++ before LibTorch (round 2 of 2026-11-27:
# /opt/gcc's -lstdc++ was the static library and six gpu tests crashed).
check_link_order() {
  local text rc=0
  text=$(bash "$root/tests/core/needed_order_test.sh" "$build" 2>&1) || rc=1
  { echo "## Link order"; echo; echo '```'; echo "$text" | head -20; echo '```'; echo; } >>"$summary"
  say "link order: $(echo "$text" | tail -1)"
  return $rc
}

# all: the gpu tests only (CI runs the CPU suite), to the deadline.
run_gpu_tests() {
  build gpu_tests mingpt zero_cli || return 1
  local rc=0 left
  check_link_order || rc=1
  left=$(remaining)
  say "GPU tests, $left s left ($(elapsed))"
  (cd "$build" && timeout -k 10 "$(( left > 180 ? left - 120 : 60 ))" \
     ctest -L gpu --output-on-failure --timeout 300) >"$out/test.log" 2>&1 || rc=1
  read -r gp gf gs gt <<<"$(count "$out/test.log")"
  {
    echo "## GPU tests ($(elapsed))"
    echo
    echo "| suite | passed | failed | skipped | total |"
    echo "|---|---|---|---|---|"
    echo "| gpu (\`ctest -L gpu\`) | $gp | $gf | $gs | $gt |"
    echo
    if [ "$rc" -ne 0 ]; then
      echo "Failed (each again under a debugger in gdb.log):"
      echo '```'
      failed_lines "$out/test.log" | head -40
      echo '```'
    fi
  } >>"$summary"
  say "gpu tests: $gp passed, $gf failed, $gs skipped ($(elapsed))"
  return $rc
}

# Each failed or crashed gpu test once more under cuda-gdb (gdb where there
# is none), its threads' stacks into gdb.log; at most four, while the
# benchmarks keep 150 s.
rerun_under_debugger() {
  local names dbg
  names=$(failed_lines "$out/test.log" | sed -E 's/^\s*[0-9]+ - ([^ ]+) .*/\1/' | sort -u | head -4)
  [ -n "$names" ] || return 0
  dbg=$(command -v cuda-gdb || command -v gdb || true)
  if [ -z "$dbg" ]; then
    echo "no cuda-gdb or gdb on this machine: the failed tests were not rerun" >>"$out/gdb.log"
    return 0
  fi
  for t in $names; do
    local left
    left=$(remaining)
    if [ "$left" -lt 210 ]; then
      echo "== $t: not rerun ($left s left, kept for the benchmarks)" >>"$out/gdb.log"
      continue
    fi
    say "rerunning $t under $(basename "$dbg") ($(elapsed))"
    echo "== $t under $dbg" >>"$out/gdb.log"
    # cuda-gdb needs a temporary folder it may execute from; /tmp was not
    # (CUresult=10 at cuInit, round 2 of 2026-11-27).
    mkdir -p "$build/gdb-tmp"
    TMPDIR="$build/gdb-tmp" timeout -s KILL "$(( left - 150 < 120 ? left - 150 : 120 ))" "$dbg" -batch -ex run -ex "thread apply all bt" \
      -ex "info sharedlibrary" -ex quit --args "$build/tests/gpu_tests" --gtest_filter="$t" >>"$out/gdb.log" 2>&1
    echo "== $t: $dbg ended with status $?" >>"$out/gdb.log"
  done
}

run_bench() {
  build mingpt zero_cli || return 1
  say "benchmarks, $(remaining) s left ($(elapsed))"
  local rc=0
  python3 "$root/scripts/gpu/bench.py" --build "$build" --out "$out" --commit "$commit" \
    --nvme "${ZERO_NVME_DIR:-/tmp/zero-nvme}" --scale "${ZERO_BENCH_SCALE:-full}" --deadline "$deadline" \
    >"$out/bench.log" 2>&1 || rc=1
  if [ -f "$out/bench.md" ]; then
    cat "$out/bench.md" >>"$summary"
    rm -f "$out/bench.md"
  fi
  [ "$rc" -eq 0 ] || { say "error: a benchmark failed; the end of bench.log:"; tail -30 "$out/bench.log" >&2; }
  say "benchmarks done ($(elapsed))"
  return $rc
}

run_maxparams() {
  build mingpt zero_cli || return 1
  say "max-parameter benchmark ($(elapsed))"
  local rc=0 tmp="$out/max_params.tmp"
  mkdir -p "${ZERO_NVME_DIR:-/tmp/zero-nvme}"
  # shellcheck disable=SC2086  # ZERO_MAXP_ARGS is a list of options
  "$root/benchmarks/max_params.sh" --ranks 1 --bin "$build/bin" --out "$tmp" --nvme-path "${ZERO_NVME_DIR:-/tmp/zero-nvme}" \
    ${ZERO_MAXP_ARGS:---device-memory 8GiB --host-memory 16GiB --nvme-bytes 24GiB --precision bf16} >"$out/maxparams.log" 2>&1 || rc=1
  for f in max_params.md max_params.json max_params.png; do [ -f "$tmp/$f" ] && cp "$tmp/$f" "$out/$f"; done
  if [ "$rc" -ne 0 ]; then  # the searches' own logs, into the one that comes back
    for f in "$tmp"/*.log; do [ -f "$f" ] && { echo "== $(basename "$f"), its last 40 lines"; tail -40 "$f"; }; done >>"$out/maxparams.log"
  fi
  rm -rf "$tmp"
  [ -f "$out/max_params.md" ] && cat "$out/max_params.md" >>"$summary"
  [ "$rc" -eq 0 ] || { say "error: the max-parameter benchmark failed; the end of maxparams.log:"; tail -30 "$out/maxparams.log" >&2; }
  return $rc
}

# NOTE [state placement]: a Llama of LLaMA-30B's shape, 60 layers, on the
# one card, its states where the planner puts them (benchmarks/RESULTS.md,
# 2026-11-28: the device's share, host memory within max_in_cpu, NVMe).
run_llama30b() {
  build llama zero_cli || return 1
  say "LLaMA-30B's shape, 3 steps ($(elapsed))"
  local rc=0 tmp="$out/llama30b.tmp" device
  rm -f "$out/llama30b.md" "$out/llama30b.json"
  # The budget: 0.95 of the card's free memory (the CUDA context and the
  # allocator's own are outside the ledger).
  device=$(python3 -c 'import torch; print(int(0.95 * torch.cuda.mem_get_info()[0]))' 2>>"$out/llama30b.log")
  [ -n "$device" ] || { say "error: torch could not read the card's free memory (llama30b.log)"; return 1; }
  mkdir -p "${ZERO_NVME_DIR:-/tmp/zero-nvme}"
  "$root/benchmarks/llama_max_layers.sh" --hf-config "$root/benchmarks/configs/llama30b_config.json" \
    --configs zero3_placed_bf16_8bit --plan zero3_placed_bf16_8bit --layers 60 --checkpoint \
    --device-memory "$device" --host-memory 120GB --nvme-bytes "${ZERO_NVME_BYTES:-56GB}" \
    --nvme-path "${ZERO_NVME_DIR:-/tmp/zero-nvme}" --batch-size 1 --block-size 256 --steps 3 \
    --bin "$build/bin" --out "$tmp" >"$out/llama30b.log" 2>&1 || rc=1
  [ -f "$tmp/llama_max_layers.md" ] && cp "$tmp/llama_max_layers.md" "$out/llama30b.md"
  [ -f "$tmp/llama_max_layers.json" ] && cp "$tmp/llama_max_layers.json" "$out/llama30b.json"
  for f in "$tmp"/*.log; do [ -f "$f" ] && { echo "== $(basename "$f"), its last 60 lines"; tail -60 "$f"; }; done >>"$out/llama30b.log"
  rm -rf "$tmp"
  [ -f "$out/llama30b.md" ] && cat "$out/llama30b.md" >>"$summary"
  [ "$rc" -eq 0 ] || { say "error: the LLaMA-30B run failed; the end of llama30b.log:"; tail -30 "$out/llama30b.log" >&2; }
  return $rc
}

# NOTE [frozen groups]: LoRA at stage 3 on the card (benchmarks/lora.sh, one rank).
run_lora() {
  build llama zero_cli || return 1
  say "LoRA at stage 3 ($(elapsed))"
  local rc=0
  "$root/benchmarks/lora.sh" --ranks 1 --steps 6 --bin "$build/bin" --out "$out/lora.tmp" >"$out/lora.log" 2>&1 || rc=1
  [ -f "$out/lora.tmp/lora.md" ] && cp "$out/lora.tmp/lora.md" "$out/lora.md" && cat "$out/lora.md" >>"$summary"
  [ -f "$out/lora.tmp/lora.json" ] && cp "$out/lora.tmp/lora.json" "$out/lora.json"
  rm -rf "$out/lora.tmp"
  [ "$rc" -eq 0 ] || { say "error: the LoRA benchmark failed; the end of lora.log:"; tail -30 "$out/lora.log" >&2; }
  return $rc
}

case "$mode" in
  lora) run_lora || status=1 ;;
  maxparams) run_maxparams || status=1 ;;
  llama30b) run_llama30b || status=1 ;;
  test) run_tests || status=1 ;;
  bench) run_bench || status=1 ;;
  all) run_gpu_tests || status=1; rerun_under_debugger; run_bench || status=1 ;;
esac

# Files over the size the device tool brings back keep their ends.
for f in "$out"/*.log; do
  [ -f "$f" ] || continue
  if [ "$(stat -c %s "$f")" -gt 12000000 ]; then tail -c 12000000 "$f" >"$f.tmp" && mv "$f.tmp" "$f"; fi
done
echo >>"$summary"
echo "run.sh $mode: $([ $status -eq 0 ] && echo passed || echo FAILED) in $(elapsed)" >>"$summary"
cat "$summary"
exit $status
