#!/usr/bin/env bash
# Largest batch per mode (issue 7): `fxfuse audit --fit batch` for liger and fxfuse, one model per
# argument, each worker process under WORKER_TIMEOUT seconds, outputs under $OUT/fit_<model>/ (audit.json) and $OUT/*.log.
#   FIT_LIMIT_GIB=64 WORKER_TIMEOUT=200 bash bench/session_fit.sh llama-1b gemma2-2b    (after run_all.sh none)
#   FIT_ARGS=--checkpointing FIT_START=32 bash bench/session_fit.sh llama-1b   (extra audit flags; first probe)
set -u
repo=$(pwd)
out=${OUT:-$repo/bench_logs}
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd /tmp
for model in "$@"; do
  batch=4; [ "$model" = gemma2-2b ] && batch=2
  batch=${FIT_START:-$batch}
  echo "== fit $model (limit ${FIT_LIMIT_GIB:-64} GiB)"
  python3 -m fxfuse audit --model "$model" --batch $batch --seq 2048 --steps 2 \
    --warmup 0 --profile-steps 0 --timeout "${WORKER_TIMEOUT:-200}" --compare "${FIT_MODES:-liger,fxfuse}" --fit batch \
    --mem-limit-gib "${FIT_LIMIT_GIB:-64}" ${FIT_ARGS:-} --out "$out/fit_$model" 2>&1 | grep -v Warning | tee "$out/fit_$model.log" | tail -25
  rm -f "$out/fit_$model/audit.png" "$out/fit_$model/audit.txt"
done
