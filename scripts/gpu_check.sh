#!/usr/bin/env bash
# The GPU checks, for a CUDA machine that already has torch, Triton and pytest (the device
# machine's image): install this checkout without dependencies, then run
#
#   scripts/gpu_check.sh tests   # every GPU test (slow ones too), one line per test, but the engines below
#   scripts/gpu_check.sh engines # the engines built with non-default switches (PDL wait-only, the old path, residual)
#   scripts/gpu_check.sh probe   # build a tiny CUDA engine, load it every way (scripts/aoti_load_probe.py)
#   scripts/gpu_check.sh bench   # the step benchmark (benchmarks/step.py; docs/performance.md); BENCH_ARGS=--profile adds kernel tables
#   scripts/gpu_check.sh markov  # the Markov kernel over shapes x launch configurations (scripts/markov_diag.py)
#   scripts/gpu_check.sh triton-build  # the tiny CUDA engine with the Triton plugins: build (timed), generate
#   scripts/gpu_check.sh attention     # the attention kernels: their tests, then scripts/attention_bench.py
#   scripts/gpu_check.sh chain         # the GEMM chain's GPU tests, then scripts/chain_bench.py (flat streams too)
#   scripts/gpu_check.sh boundaries    # what a GEMM boundary costs: scripts/chain_bench.py, then pdl_bench.py's
#                                      # co-resident and preload variants (docs/log.md, 2026-12-03)
#   scripts/gpu_check.sh rope          # the RoPE table's GPU tests (kernels, eager, an engine without it),
#                                      # then scripts/attention_cache_bench.py (the q/k norm and attention
#                                      # stage by stage, the fused attention with the table too)
#   scripts/gpu_check.sh residual      # the linear + gated residual launch's kernel and eager tests, then
#                                      # the batch-1 bench with it and without (--linear-residual both)
#   scripts/gpu_check.sh first         # launch, splits, then the Markov kernel's poisoned diagnosis (one call)
#   scripts/gpu_check.sh splits-step   # the batch-8/32 bench with --attention-splits both (one split a program beside)
#   scripts/gpu_check.sh splits        # the attention's splits a program (SPLITS): its tests, then
#                                      # attention_bench.py and attention_cache_bench.py at batch 8 and 32
#   scripts/gpu_check.sh cxx           # the C++ embedding's tests: CPU and CUDA engines (carry .whl/ for its
#                                      # JSON header: the nlohmann-json wheel)
#   scripts/gpu_check.sh serving       # the Triton server on the GPU: exact outputs and its throughput beside
#                                      # the in-process runtime (carry .whl/: scripts/device_wheels.py)
#   scripts/gpu_check.sh launch        # a graph launch's host time after a graph, a kernel, a copy
#                                      # (scripts/launch_probe.py: tells machine starts apart in seconds)
#   scripts/gpu_check.sh chained       # the chained steps' GPU test (the Generator launching each step's
#                                      # successor before reading its rows), then the batch-1 bench (its
#                                      # aoti_chained figure)
#
# MUSE_SPARK_ATTENTION=triton|sdpa picks the attention kernel of every mode (default triton).
# ATTENTION_ARGS=--sweep adds the Triton kernel's launch configurations to the attention mode.
#
# Logs go to $OUT (default ./gpu-out). Tests run in parallel (each engine build's tests, their
# xdist_group, on one worker; the others wherever a worker is free), and
# a worker that dies (a segfault) is not restarted: pytest-xdist would otherwise re-run the
# crashing test on a fresh worker again and again until the time limit.
set -u -o pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ulimit -c 0  # a crash's core dump takes tens of seconds here
python3 -m pip install --no-deps --no-build-isolation -e . -q >"$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }

case "${1:-tests}" in
tests)
    xdist=()
    # loadgroup: an engine file's tests (or each engine build's) stay on one worker (their
    # xdist_group), every other test goes to whichever worker is free
    python3 -c "import xdist" 2>/dev/null && xdist=(-n 6 --dist loadgroup --max-worker-restart=0)
    # (the engines built with other switches: the "engines" mode; together they pass 10 minutes)
    timeout "${TEST_TIMEOUT:-480}" python3 -m pytest "${xdist[@]}" -v -rfEs -m "slow or not slow" \
        tests/test_gpu_eager.py tests/test_gpu_kernels.py tests/test_gpu_engine.py tests/test_gpu_triton_engine.py \
        -k "not (only_wait or without_the_rope_table)" 2>&1 | tee "$OUT/gpu-tests.log" |
        grep -E "PASSED|FAILED|ERROR|SKIPPED|XFAIL|[0-9]+ (passed|failed)|node down"
    ;;
engines)
    # The engines built with switches other than the defaults (each a CLI build, the eager engine, and
    # fresh-process runs: several minutes each, so one worker each): PDL waiting only, the path without
    # the RoPE table, the fused attention and PDL, and the linear + residual launch.
    timeout "${TEST_TIMEOUT:-580}" python3 -m pytest -n 3 --dist loadgroup --max-worker-restart=0 -v -rfEs \
        -m "slow or not slow" tests/test_gpu_residual_engine.py tests/test_gpu_triton_engine.py \
        -k "only_wait or without_the_rope_table or linear_residual" 2>&1 | tee "$OUT/gpu-engines.log" |
        grep -E "PASSED|FAILED|ERROR|SKIPPED|[0-9]+ (passed|failed)|node down"
    ;;
probe)
    python3 -m muse_spark.cli make-tiny --kind agreeing /tmp/gpu-check-pair >"$OUT/probe-build.log" 2>&1
    python3 -m muse_spark.cli build --target /tmp/gpu-check-pair/target --draft /tmp/gpu-check-pair/draft \
        --out /tmp/gpu-check-engine --backend aoti --device cuda --max-batch 2 --max-seq 256 --plugins inline \
        >>"$OUT/probe-build.log" 2>&1 || { tail -30 "$OUT/probe-build.log"; exit 1; }
    timeout "${PROBE_TIMEOUT:-300}" python3 scripts/aoti_load_probe.py /tmp/gpu-check-engine \
        --cases bare_load,rtld_global_env,runtime_loader,engine_runtime 2>&1 | tee "$OUT/probe.log"
    ;;
bench)
    # the result in the common schema lands in $OUT (copy it into benchmarks/results/)
    timeout "${BENCH_TIMEOUT:-560}" python3 benchmarks/step.py --deadline-s "${BENCH_DEADLINE:-480}" ${BENCH_ARGS:-} \
        --out-dir "$OUT" --markdown "$OUT/benchmarks.md" 2>&1 | tee "$OUT/bench.log"
    ;;
triton-build)
    python3 -m muse_spark.cli make-tiny --kind agreeing /tmp/gpu-check-pair >"$OUT/triton-build.log" 2>&1
    SECONDS=0; timeout "${BUILD_TIMEOUT:-300}" python3 -m muse_spark.cli build --target /tmp/gpu-check-pair/target \
        --draft /tmp/gpu-check-pair/draft --out /tmp/gpu-check-triton --backend aoti --device cuda --max-batch 2 \
        --max-seq 256 --plugins triton 2>&1 | tee -a "$OUT/triton-build.log" || { echo "build failed after ${SECONDS}s"; exit 1; }
    echo "build took ${SECONDS}s" | tee -a "$OUT/triton-build.log"
    timeout 120 python3 -m muse_spark.cli generate --engine /tmp/gpu-check-triton --prompt-ids 1,2,3 --max-tokens 16 --ignore-eos \
        --json 2>&1 | tee -a "$OUT/triton-build.log"
    ;;
attention)
    timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -v -rfEs -k "attention" tests/test_gpu_kernels.py \
        tests/test_gpu_eager.py 2>&1 | tee "$OUT/attention-tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|[0-9]+ (passed|failed)"
    timeout "${ATTENTION_TIMEOUT:-240}" python3 scripts/attention_bench.py ${ATTENTION_ARGS:-} --json "$OUT/attention.json" 2>&1 | tee "$OUT/attention-bench.log"
    ;;
chain)
    # the GEMM chain's flat streams (fifteenth session) against the engine's GEMMs, and the chain's bit tests
    timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -v -rfEs tests/test_gpu_kernels.py -k chain 2>&1 |
        tee "$OUT/chain-tests.log" | grep -E "PASSED|FAILED|ERROR|[0-9]+ (passed|failed)"
    timeout "${CHAIN_TIMEOUT:-300}" python3 scripts/chain_bench.py --json "$OUT/chain-bench.json" 2>&1 | tee "$OUT/chain-bench.log"
    ;;
boundaries)
    timeout "${CHAIN_TIMEOUT:-240}" python3 scripts/chain_bench.py --json "$OUT/chain-bench.json" 2>&1 | tee "$OUT/chain-bench.log"
    timeout "${PDL_TIMEOUT:-240}" python3 scripts/pdl_bench.py --prefetch-kb "" \
        --only triton-coresident,pdl-coresident,pdl-coresident+preload,pdl+preload,pdl-wait-only,pdl-wait-only+preload \
        --json "$OUT/pdl-bench-coresident.json" 2>&1 | tee "$OUT/pdl-bench.log"
    ;;
markov)
    timeout "${MARKOV_TIMEOUT:-300}" python3 scripts/markov_diag.py 2>&1 | tee "$OUT/markov-diag.log"
    ;;
rope)
    # (the engine test alone builds an engine: ~220 s on the H200)
    timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -v -rfEs -k "rope_table" tests/test_gpu_kernels.py \
        tests/test_gpu_eager.py tests/test_gpu_triton_engine.py 2>&1 | tee "$OUT/rope-tests.log" |
        grep -E "PASSED|FAILED|ERROR|SKIPPED|[0-9]+ (passed|failed)"
    timeout "${ROPE_TIMEOUT:-120}" python3 scripts/attention_cache_bench.py --json "$OUT/attention-cache.json" 2>&1 |
        tee "$OUT/attention-cache.log"
    ;;
residual)
    # the o / down projection with the gated residual in its launch (MUSE_SPARK_LINEAR_RESIDUAL=1): the
    # kernel and eager tests, then the engine test (it builds an engine), then the batch-1 step with it
    # and without, timed in turns
    timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -v -rfEs -k "linear_residual" tests/test_gpu_kernels.py \
        tests/test_gpu_eager.py 2>&1 | tee "$OUT/residual-tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|[0-9]+ (passed|failed)"
    timeout "${BENCH_TIMEOUT:-300}" python3 scripts/bench.py --batches 1 --skip eager,compile --linear-residual both \
        --profile --deadline-s "${BENCH_DEADLINE:-230}" --json "$OUT/b1-residual.json" --markdown "$OUT/b1-residual.md" \
        2>&1 | tee "$OUT/bench-residual.log" | grep -v "^\s*$" | tail -30
    ;;
chained)
    # (the test file's engine builds first: ~4 minutes on a fresh machine)
    timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -v -rfEs -m "slow or not slow" -k "chained or second_stream or greedy" \
        tests/test_gpu_engine.py 2>&1 | tee "$OUT/chained-tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|[0-9]+ (passed|failed)"
    timeout "${BENCH_TIMEOUT:-240}" python3 scripts/bench.py --batches 1 --skip eager,compile \
        --deadline-s "${BENCH_DEADLINE:-200}" --json "$OUT/b1-chained.json" --markdown "$OUT/b1-chained.md" \
        2>&1 | tee "$OUT/bench-chained.log" | grep -v "^\s*$" | tail -30
    ;;
first)
    # the twenty-fourth session's changes first, in one call (≈ 5 min): the launch probe, the attention's
    # splits a program (tests, then both attention benches), the Markov kernel's checked final reads
    "$0" launch
    "$0" splits
    timeout "${MARKOV_TIMEOUT:-200}" python3 scripts/markov_diag.py --cases 7,8 --configs 1-request-blocks,default \
        --poison --probs --calls 40 2>&1 | tee "$OUT/markov-diag-poison.log"
    timeout 120 python3 scripts/markov_diag.py --cases 7 --configs 1-request-blocks --poison --probs --calls 40 \
        --same-seed 2>&1 | tee "$OUT/markov-diag-same-seed.log"
    ;;
splits-step)
    # the whole step at batch 8 and 32 with the launcher's splits a program beside one split a program
    # (MUSE_SPARK_ATTENTION_SPLITS=1), replayed in turns (batch 1 is the same kernel either way)
    timeout "${BENCH_TIMEOUT:-570}" python3 scripts/bench.py --batches 8,32 --skip eager,compile --attention-splits both \
        --deadline-s "${BENCH_DEADLINE:-500}" --json "$OUT/bench-splits.json" --markdown "$OUT/bench-splits.md" 2>&1 |
        tee "$OUT/bench-splits.log"
    ;;
splits)
    # several splits of the window a program of the attention's partial kernel (SPLITS, the launcher's
    # choice from batch 4): the attention tests (bits for every grouping), then one layer's attention
    # (bounds form, SPLITS 1-9 beside the default) and the fused attention + cache write at batch 8 and 32
    timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -v -rfEs -k "attention or splits" tests/test_gpu_kernels.py \
        2>&1 | tee "$OUT/splits-tests.log" | grep -E "FAILED|ERROR|[0-9]+ (passed|failed)"
    timeout "${ATTENTION_TIMEOUT:-200}" python3 scripts/attention_bench.py --json "$OUT/attention.json" 2>&1 |
        tee "$OUT/attention-bench.log" | grep -E "^B=|^\|"
    for b in 8 32; do
        timeout 150 python3 scripts/attention_cache_bench.py --batch $b --splits 1,2,3,5,9 \
            --json "$OUT/attention-cache-b$b.json" 2>&1 | tee "$OUT/attention-cache-b$b.log" | grep -E "SPLITS|^fused"
    done
    ;;
cxx)
    # the C++ embedding (docs/cxx.md): built with CMake against this machine's torch (its JSON header from
    # the nlohmann-json wheel carried in .whl/), then run on a CPU and a CUDA engine beside the Python runtime
    ls .whl/nlohmann_json-*.whl >/dev/null 2>&1 && python3 -m pip install --no-deps -q .whl/nlohmann_json-*.whl
    timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -v -rfEs tests/test_gpu_cxx.py tests/test_cxx.py 2>&1 |
        tee "$OUT/cxx-tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|[0-9]+ (passed|failed)"
    ;;
serving)
    # the Triton server on the GPU beside the in-process runtime (tests/test_gpu_serving.py runs
    # benchmarks/serving.py; its JSON lands in $OUT/serving-*). Carry .whl/ from
    # `python scripts/device_wheels.py .whl`: nvidia-pytriton, and numpy 1.x for the stub where the
    # environment has numpy 2 and no package index.
    if ls .whl/nvidia_pytriton-*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-deps --no-compile --target /tmp/site .whl/nvidia_pytriton-*.whl &&
            export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    stub=$(ls .whl/numpy-1.*.whl 2>/dev/null | head -1)
    [ -n "$stub" ] && export STUB_NUMPY="$PWD/$stub"
    OUT="$OUT" timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -v -rfEs -s tests/test_gpu_serving.py 2>&1 |
        tee "$OUT/serving-tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|tok/s|[0-9]+ (passed|failed)"
    ;;
launch)
    # what a graph launch costs the host by what the stream did before it (seconds; no engine)
    timeout "${TEST_TIMEOUT:-120}" python3 scripts/launch_probe.py --json "$OUT/launch-probe.json" 2>&1 |
        tee "$OUT/launch-probe.log"
    ;;
*)
    echo "usage: $0 tests|engines|probe|bench|markov|triton-build|attention|boundaries|chain|rope|residual|chained|first|splits|splits-step|launch|cxx" >&2
    exit 2
    ;;
esac
