#!/usr/bin/env bash
# Every GPU check the second session could not run (its device time ran out), in one device call on
# one H200, each step time-boxed, outputs under $OUT (default /tmp/gpu_pending):
#
#   R=$PWD; cd /tmp && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e $R; cd $R
#   bash benchmarks/gpu_pending.sh gpu_tests sampler decode_layer     # one call (~9 min at most)
#   bash benchmarks/gpu_pending.sh engine                              # a second call (~10 min)
#
# 1. the gpu-marked tests of the new kernels (fused rotary + KV write, FP8 writes, Triton sampler,
#    fused GEMV, prefill graphs);
# 2. the Triton sampler's timings against the exact path (flat and peaked logits);
# 3. the fused rotary + KV write and whole-layer timings;
# 4. the engine: batch-1 ITL, ITL against context through LLM, offline 1,000 x (1k + 1k) with bf16
#    and FP8 KV caches.
set -u
OUT=${OUT:-/tmp/gpu_pending}
mkdir -p "$OUT"
WANT=" $* "
step() {  # step NAME SECONDS COMMAND...: runs when NAME was asked for (or nothing was)
  local name=$1 secs=$2
  shift 2
  [[ "$WANT" == "  " || "$WANT" == *" $name "* ]] || return 0
  echo "=== $name (limit ${secs}s)"
  timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
  echo "rc=$?"
  tail -n 25 "$OUT/$name.log"
}
step gpu_tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_rotary_kv_write.py \
  tests/kernels/test_kv_cache_fp8.py tests/engine/sampling/test_sampling_fast.py tests/kernels/test_gemv.py tests/engine/runner/test_cuda_graphs.py
step sampler 150 python3 benchmarks/sampler_bench.py
step decode_layer 120 python3 benchmarks/gpu_decode_layer.py
step engine 560 python3 benchmarks/gpu_recheck.py --num-prompts 1000 --kv-dtype auto fp8 --out "$OUT"
