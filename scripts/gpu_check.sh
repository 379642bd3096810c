#!/usr/bin/env bash
# `make gpu-check`: proves the CUDA path on a machine with a GPU, in one
# command, and prints one report.
#   1. bootstrap (offline with FSDP2CPP_DEBS, see docs/gpu.md) and a build with
#      CUDA on (-DFSDP2CPP_CUDA=ON) in $GPU_BUILD (default build-gpu) of the
#      fsdp2cpp_gpu_check target: the gpu-labelled tests and the trainer;
#   2. every CTest test labelled `gpu` (ctest -L gpu);
#   3. the GPU benchmarks that exist in this tree (missing ones are listed as
#      skipped: fsdp_bench's CUDA rows, the planner's simulated step against
#      the measured one, activation checkpointing against PyTorch FSDP2) and
#      a short CUDA training run of fsdp_train with --profile;
#   4. the report: device, driver, then PASS / FAIL / SKIP and the wall time of
#      every step and test. Logs stay in $GPU_BUILD/gpu-check/.
# Exits 0 when everything ran and passed; 1 when something failed; 2 when
# there is no GPU here (it says so and builds nothing).
#
# Environment: FSDP2CPP_PYTHON (the torch to build against; bootstrap.sh),
# FSDP2CPP_DEBS (offline .deb folder), JOBS (build parallelism, default
# nproc), GPU_BUILD, GPU_CHECK_BUILD (all: build the whole tree, not only the
# fsdp2cpp_gpu_check target), CTEST_ARGS (extra ctest arguments, e.g.
# "-R nccl").
set -uo pipefail
cd "$(dirname "$0")/.."

BUILD=${GPU_BUILD:-build-gpu}
JOBS=${JOBS:-$(nproc)}
LOGS=$BUILD/gpu-check
say() { echo "gpu-check: $*"; }

# --- is there a GPU? -------------------------------------------------------
PY=${FSDP2CPP_PYTHON:-}
[[ -z "$PY" && -x .venv/bin/python ]] && PY=.venv/bin/python
[[ -z "$PY" ]] && PY=python3
smi="nvidia-smi not found"
if command -v nvidia-smi >/dev/null; then
  smi=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1) || true
fi
torch_gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo "?")
if [[ "$torch_gpus" == "?" || "$torch_gpus" == 0 ]]; then
  say "no GPU visible here: nvidia-smi says '${smi//$'\n'/; }', torch ($PY) counts ${torch_gpus/\?/no torch} CUDA device(s)."
  say "nothing was built or run. Run it on a GPU machine (docs/gpu.md); the CPU checks are 'make test'."
  exit 2
fi
device=$("$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")')
torch_version=$("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda, "NCCL", ".".join(map(str, torch.cuda.nccl.version())))')

mkdir -p "$LOGS"
results=()  # "STATUS|name|seconds|note"
failed=0
record() {  # status name seconds [note]
  results+=("$1|$2|$3|${4:-}")
  [[ $1 == FAIL ]] && failed=1
  return 0
}
# Runs a step, times it, records PASS/FAIL, keeps its log.
step() {  # name logfile command...
  local name=$1 log=$2 start=$SECONDS rc
  shift 2
  say "$name ..."
  "$@" >"$log" 2>&1
  rc=$?
  if ((rc == 0)); then record PASS "$name" $((SECONDS - start)); else
    record FAIL "$name" $((SECONDS - start)) "exit $rc, log $log"
    tail -30 "$log"
  fi
  return $rc
}

# --- build ----------------------------------------------------------------
export FSDP2CPP_PYTHON=$PY
built=1
step "bootstrap" "$LOGS/bootstrap.log" scripts/bootstrap.sh || built=0
if ((built)); then
  step "configure (CUDA on)" "$LOGS/configure.log" cmake -S . -B "$BUILD" -DFSDP2CPP_CUDA=ON ${CMAKE_ARGS:-} || built=0
fi
if ((built)) && ! grep -q "CUDA/NCCL paths ON\|CUDA/NCCL paths TRUE" "$LOGS/configure.log"; then
  record FAIL "CUDA paths compiled" 0 "configure did not turn CUDA on (see $LOGS/configure.log)"
  built=0
fi
# Only what the check runs (the fsdp2cpp_gpu_check target: the gpu tests and
# the trainer) unless GPU_CHECK_BUILD=all: a GPU machine has no compiler
# cache, and the whole tree is several times the work.
if [[ "${GPU_CHECK_BUILD:-}" == all ]]; then targets=(); what="everything"; else
  targets=(--target fsdp2cpp_gpu_check); what="gpu tests + trainer"
fi
((built)) && { step "build $what (-j $JOBS)" "$LOGS/build.log" cmake --build "$BUILD" -j "$JOBS" "${targets[@]}" || built=0; }

# --- gpu tests --------------------------------------------------------------
if ((built)); then
  start=$SECONDS
  say "ctest -L gpu ..."
  # shellcheck disable=SC2086
  ctest --test-dir "$BUILD" -L gpu --output-on-failure ${CTEST_ARGS:-} >"$LOGS/ctest-gpu.log" 2>&1
  ran=0 skipped=0
  # "  1/12 Test  #3: name ........   Passed    1.23 sec" (and ***Failed, ***Skipped, ***Timeout, ***Exception)
  while IFS= read -r line; do
    name=$(sed -E 's/^.*Test +#[0-9]+: ([^ ]+) .*$/\1/' <<<"$line")
    secs=$(grep -oE '[0-9.]+ sec' <<<"$line" | cut -d' ' -f1)
    ran=$((ran + 1))
    if grep -q ' Passed ' <<<"$line"; then record PASS "$name" "${secs:-?}"
    elif grep -q 'Skipped' <<<"$line"; then record SKIP "$name" "${secs:-?}" "skipped by the test"; skipped=$((skipped + 1))
    else record FAIL "$name" "${secs:-?}" "$(grep -oE '\*\*\*[A-Za-z]+.*' <<<"$line" | head -1 | cut -c1-60)"
    fi
  done < <(grep -E 'Test +#[0-9]+: ' "$LOGS/ctest-gpu.log")
  if ((ran == 0)); then
    record FAIL "ctest -L gpu" $((SECONDS - start)) "no gpu-labelled test ran (log $LOGS/ctest-gpu.log)"
  elif ((skipped == ran)); then
    record FAIL "ctest -L gpu" $((SECONDS - start)) "every gpu test skipped although torch sees $torch_gpus GPU(s)"
  fi
fi

# --- benchmarks and a CUDA training run ------------------------------------
bench_dir=$BUILD/tools/bench
run_bench() {  # name binary args...
  local name=$1 bin=$2
  shift 2
  if [[ ! -x "$bin" ]]; then record SKIP "$name" 0 "not in this tree ($bin)"; return; fi
  step "$name" "$LOGS/$name.log" "$bin" "$@" && sed -n '1,60p' "$LOGS/$name.log" >>"$LOGS/benchmarks.txt"
}
# Whether a program exists and lists a flag in --helpfull. The help text is
# read whole first: Abseil's --helpfull exits 1, and under pipefail a pipe
# into `grep -q` would read as "no such flag" either way.
has_flag() {  # binary flag
  [[ -x "$1" ]] || return 1
  local help
  help=$("$1" --helpfull 2>&1)
  grep -q -- "$2" <<<"$help"
}
if ((built)); then
  : >"$LOGS/benchmarks.txt"
  # GPU rows of fsdp_bench (issue 12: bf16 ~1B model, copy-in/out bandwidth),
  # when the benchmark has learned --device.
  if has_flag "$bench_dir/fsdp_bench" --device; then
    run_bench fsdp_bench_cuda "$bench_dir/fsdp_bench" --device cuda --nproc 1
  else
    record SKIP fsdp_bench_cuda 0 "fsdp_bench has no --device flag in this tree"
  fi
  # The planner's simulated step against fsdp_train's on this GPU (issue 32),
  # under the shipped profile of this GPU.
  if has_flag "$bench_dir/fsdp_plan_time_bench" --profile; then
    profile=h100
    [[ "$device" == *H200* ]] && profile=h200
    run_bench fsdp_plan_time_bench_cuda "$bench_dir/fsdp_plan_time_bench" --device cuda --profile "$profile" --max_nproc 1
  else
    record SKIP fsdp_plan_time_bench_cuda 0 "fsdp_plan_time_bench has no --device cuda in this tree"
  fi
  # Activation checkpointing against PyTorch FSDP2 on this GPU (issue 31; its
  # first GPU run found full AC's activations 1.18x PyTorch's,
  # docs/benchmarks.md).
  if has_flag "$bench_dir/fsdp_ac_bench" --device; then
    run_bench fsdp_ac_bench_cuda "$bench_dir/fsdp_ac_bench" --device cuda --nproc 1 --models deep
  else
    record SKIP fsdp_ac_bench_cuda 0 "fsdp_ac_bench has no --device flag in this tree"
  fi
  for bin in "$bench_dir"/*gpu*bench* "$bench_dir"/*bench*gpu* "$bench_dir"/*cuda*bench*; do
    [[ -x "$bin" && -f "$bin" ]] && run_bench "$(basename "$bin")" "$bin"
  done
  train=$BUILD/tools/train/fsdp_train
  if [[ -x "$train" ]]; then
    rm -rf "$LOGS/profile"
    step "fsdp_train --device cuda (20 steps, --profile)" "$LOGS/fsdp_train_cuda.log" \
      "$train" --device cuda --steps 20 --log-every 5 --profile "$LOGS/profile" --profile-steps 3:4 &&
      { grep -q '"cat": *"kernel"' "$LOGS/profile/trace_rank0.json" ||
          record FAIL "profile shows CUDA kernels" 0 "no kernel events in $LOGS/profile/trace_rank0.json"; }
  else
    record SKIP "fsdp_train --device cuda" 0 "no trainer in this build"
  fi
fi

# --- report -----------------------------------------------------------------
{
  echo
  echo "==================== fsdp2cpp gpu-check ===================="
  echo "device   $device ($torch_gpus visible)"
  echo "driver   ${smi%%$'\n'*}"
  echo "torch    $torch_version ($PY)"
  echo "source   $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' + local changes')"
  echo "date     $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "------------------------------------------------------------"
  printf '%-5s %8s  %s\n' "" "seconds" "step / test"
  for r in "${results[@]}"; do
    IFS='|' read -r status name secs note <<<"$r"
    printf '%-5s %8s  %s%s\n' "$status" "$secs" "$name" "${note:+  ($note)}"
  done
  echo "------------------------------------------------------------"
  printf 'PASS %d, FAIL %d, SKIP %d\n' "$(printf '%s\n' "${results[@]}" | grep -c '^PASS')" \
    "$(printf '%s\n' "${results[@]}" | grep -c '^FAIL')" "$(printf '%s\n' "${results[@]}" | grep -c '^SKIP')"
  [[ -s "$LOGS/benchmarks.txt" ]] && { echo "benchmark output: $LOGS/benchmarks.txt"; cat "$LOGS/benchmarks.txt"; }
  echo "logs: $LOGS"
} | tee "$LOGS/report.txt"
exit $failed
