#!/usr/bin/env bash
# Every kernel benchmark in one device call (eager / inductor / liger / fxfuse side by side).
#   on the device, from the repo root, with the liger-kernel wheel carried in .whl/:
#   bash bench/run_all.sh                          # every benchmark; logs under $OUT (or ./bench_logs)
#   bash bench/run_all.sh rms_norm swiglu          # only these (BENCH_TIMEOUT=seconds per script)
#   E2E_MODELS=llama-1b bash bench/run_all.sh e2e  # end-to-end training audit (bench/e2e.py), only when
#                                                  # named; one model per 10-minute call (E2E_ARGS=extra flags,
#                                                  # e.g. E2E_ARGS="--fxfuse-option loss_head=fast --fit batch")
#   bash bench/run_all.sh tune_rms_norm            # RMSNorm launch-parameter sweep, only when named
#   bash bench/run_all.sh probe_rms_norm           # RMSNorm kernel-structure candidates, only when named
#   bash bench/run_all.sh gpu_tests                # the gpu-marked tests (kernels on CUDA), only when named
#   bash bench/run_all.sh fsdp2                    # 2-GPU FSDP2 step (examples/fsdp2_bench.py), only when named
#                                                  # (FSDP_ARGS=--checkpointing: activation checkpointing too)
#   EXTRA_SITE=/tmp/site25 bash bench/run_all.sh zoo  # with packages of /tmp/site25 first on the path (from
#                                                  # .whl_tf: pip install --no-deps --target /tmp/site25 .whl_tf/*.whl)
#   ZOO_INNER=inductor bash bench/run_all.sh zoo   # the harness on CUDA (fxfuse check --device cuda) over the HF
#                                                  # zoo and VLMs (ZOO_MODELS="llama qwen2 ..." for fewer),
#                                                  # ZOO_JOBS processes at once (default 8), logs in zoo.log; only when named
# fxfuse is installed into /tmp/site (not editable: the image has no network for build deps) and
# scripts run by path, so the repo's fxfuse/ folder never shadows the installed package.
set -u
repo=$(pwd)
out=${OUT:-$repo/bench_logs}
mkdir -p "$out" /tmp/site
if [ -z "${SKIP_INSTALL:-}" ]; then  # SKIP_INSTALL=1: runs in parallel on several GPUs after one install
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . 2>&1 | tail -2
fi
# EXTRA_SITE=dir: packages installed there shadow /tmp/site's (another transformers, say)
export PYTHONPATH=${EXTRA_SITE:+$EXTRA_SITE:}/tmp/site PYTHONUNBUFFERED=1
cd /tmp
{
  date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, liger_kernel, importlib.metadata as m; print('torch', torch.__version__, 'triton', triton.__version__, 'liger', m.version('liger-kernel'))"
} 2>&1 | tee "$out/env.log"
# a step's exit status (a pipeline's first command: 124 where timeout stopped it) said, and the script's own at
# the end: a step that failed or ran out of time must not read as a finished run
failed=0
said() {
  [ "$1" -eq 0 ] && return 0
  echo "!! $2: exit $1$([ "$1" -eq 124 ] && echo ', timed out')"; failed=1
}
# logged LOG NAME SECONDS CMD...: CMD within SECONDS, its output appended to LOG and shown without warnings
logged() {
  local log=$1 name=$2 limit=$3; shift 3
  timeout "$limit" "$@" 2>&1 | tee -a "$log" | grep -v Warning
  said "${PIPESTATUS[0]}" "$name"
}
run() {
  local name=$1; shift; echo "== $name $*"
  logged "$out/bench_$name.log" "bench_$name $*" "${BENCH_TIMEOUT:-240}" python3 "$repo/bench/bench_$name.py" "$@"
}
sel=("$@")
has() { [ ${#sel[@]} -eq 0 ] || [[ " ${sel[*]} " == *" $1 "* ]]; }  # named, or nothing named
named() { [ ${#sel[@]} -gt 0 ] && [[ " ${sel[*]} " == *" $1 "* ]]; }  # only when named
has rms_norm && run rms_norm --cuda-graph && run rms_norm --cuda-graph --providers fxfuse --pdl off \
  && run rms_norm --cuda-graph --shapes 8192x2048 8192x1536 4096x2304  # e2e models: Llama, Qwen2, Gemma2
has swiglu && run swiglu && run swiglu --cuda-graph && run swiglu --chunked --shapes 16384x8192 --cuda-graph \
  && run swiglu --act clamped_swiglu --shapes 65536x2880 16384x2880 \
  && run swiglu --act clamped_swiglu --shapes 65536x2880 16384x2880 --cuda-graph
has rope && run rope && run rope --cuda-graph
has linear_cross_entropy && run linear_cross_entropy \
  && run linear_cross_entropy --vocab-scale --shapes 8192x4096x128256 --providers eager inductor fxfuse-compiled \
     fxfuse-compiled-lean \
  && run linear_cross_entropy --log-probs --shapes 8192x4096x128256 --providers eager inductor liger fxfuse \
     fxfuse-fast fxfuse-compiled fxfuse-compiled-lean
has nanochat && run nanochat
for script in tune_rms_norm probe_rms_norm; do  # sweeps and probes, only when named
  if named $script; then
    echo "== $script"
    logged "$out/$script.log" "$script" "${BENCH_TIMEOUT:-240}" python3 "$repo/bench/$script.py"
  fi
done
if named gpu_tests; then  # from /tmp: the installed package
  echo "== gpu_tests"
  # tests import tests.helpers: a folder holding only a link to tests/, so the repo's fxfuse/ source
  # folder (not the installed layout) never lands on the path
  mkdir -p /tmp/testroot && ln -sfn "$repo/tests" /tmp/testroot/tests
  # every file with a gpu mark (a fixed list had left one out), one process per file, all at once,
  # each within BENCH_TIMEOUT; their tails printed in order
  mapfile -t files < <(cd "$repo/tests" && grep -l 'mark\.gpu' test_*.py | sed 's/\.py$//')
  pids=()
  for t in "${files[@]}"; do
    PYTHONPATH=$PYTHONPATH:/tmp/testroot FXFUSE_TEST_DEVICE=cuda timeout "${BENCH_TIMEOUT:-240}" python3 -m pytest -q \
      -p no:cacheprovider -m gpu "$repo/tests/$t.py" > "$out/gpu_$t.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!files[@]}"; do
    wait "${pids[$i]}"; rc=$?
    echo "-- ${files[$i]}"; tail -3 "$out/gpu_${files[$i]}.log"; said $rc "${files[$i]}"
  done
fi
if named e2e; then
  echo "== e2e ${E2E_MODELS:-all models}"
  # shellcheck disable=SC2086
  logged "$out/e2e.log" e2e "${E2E_TIMEOUT:-570}" python3 "$repo/bench/e2e.py" ${E2E_MODELS:+--models "$E2E_MODELS"} \
    ${E2E_ARGS:-} --out "$out/e2e"
fi
if named fsdp2; then
  for impl in ${FSDP_IMPLS:-eager inductor liger fxfuse}; do
    echo "== fsdp2 $impl"
    logged "$out/fsdp2.log" "fsdp2 $impl" "${FSDP_TIMEOUT:-240}" python3 -m torch.distributed.run --standalone \
      --nproc_per_node 2 "$repo/examples/fsdp2_bench.py" --impl "$impl" ${FSDP_ARGS:-}
  done
fi
if named zoo; then
  every="from fxfuse.zoo import HF_ZOO; from fxfuse.zoo_vlm import VLMS; print(' '.join([*HF_ZOO, *VLMS]))"
  models=${ZOO_MODELS:-$(python3 -c "$every")}
  echo "== zoo on cuda, inner ${ZOO_INNER:-aot_eager}: $models"
  mkdir -p "$out/zoo"
  # shellcheck disable=SC2086
  printf '%s\n' $models | OMP_NUM_THREADS=2 xargs -P "${ZOO_JOBS:-8}" -I{} sh -c \
    "timeout ${ZOO_TIMEOUT:-400} python3 -m fxfuse.cli check {} --device cuda --inner ${ZOO_INNER:-aot_eager} \
     > $out/zoo/{}.log 2>&1; echo \"{} rc \$?\""
  # one file back from the device (it returns a limited number of files): every log, each under its name
  for f in "$out"/zoo/*.log; do echo "=== $(basename "$f" .log)"; cat "$f"; done > "$out/zoo.log" && rm -r "$out/zoo"
  awk '/^=== /{if (m) print m, v; m=$2; v="no verdict (see zoo.log)"} /^  (PASS|NOT PASSED)/{v=$0} END{print m, v}' \
    "$out/zoo.log"
fi
[ "$failed" -eq 0 ] || echo "!! some steps failed or timed out (lines starting with !! above)"
exit $failed
