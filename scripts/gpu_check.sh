#!/usr/bin/env bash
# The GPU checks, for a CUDA machine that already has torch, Triton and pytest (the device
# machine's image): install this checkout without dependencies, then run
#
#   scripts/gpu_check.sh tests   # every GPU test (slow ones too), one line per test, but the CLI-built engines below
#   scripts/gpu_check.sh engines # the CLI-built aoti engines with the Triton plugins: the default build, and
#                                # one with a narrower verification width and the controlled step, and the FP8 pair's
#   scripts/gpu_check.sh engine-switches # the engines built with non-default switches (PDL wait-only, the old path,
#                                # a paged pool)
#   scripts/gpu_check.sh bench   # the step benchmark (benchmarks/step.py; docs/performance.md); BENCH_ARGS=--profile adds kernel tables
#   scripts/gpu_check.sh linear  # the skinny GEMM against cuBLAS, its W8A16 (FP8 weight) form and W8A8 on the
#                                # step's shapes at batch 1, 2, 8, 32 (benchmarks/linear.py), after the FP8 kernel tests
#   scripts/gpu_check.sh linear-fp8 # the skinny kernel's W8A8 form's launch configurations, then its W8A16 form's,
#                                # swept on the step's projections (benchmarks/linear.py --sweep-fp8), batch 1 and 2
#   scripts/gpu_check.sh cxx     # the C++ embedding's CUDA tests: its CUDA graphs and chained steps against the
#                                # Python runtime (carry .whl/ for its JSON header: the nlohmann-json wheel)
#   scripts/gpu_check.sh cxx-bench # the C++ library's step and tokens/s beside the Python runtime's, 8B-shaped
#                                # pair (benchmarks/cxx_step.py; carry .whl/)
#   scripts/gpu_check.sh serving # the Triton server on the GPU: exact outputs and its throughput beside
#                                # the in-process runtime (carry .whl/: scripts/device_wheels.py)
#   scripts/gpu_check.sh workload # tokens/s at real acceptance: an 8B-shaped pair (ACCEPTANCE=0.85), its aoti
#                                # engine (BACKEND=eager: the eager one), generation at batch 1/8/32 against
#                                # target-only decoding, with fixed γ and with confidence scheduling
#   scripts/gpu_check.sh serving-sweep # bench-serving on the 8B-shaped pair, in process and through tritonserver
#   scripts/gpu_check.sh paged   # paged KV caches against a window per slot on the 8B-shaped pair (eager engines):
#                                # requests at once in one memory budget, tok/s, step time, shared-prompt TTFT
#   scripts/gpu_check.sh paged-step # the aoti engine's step on the 8B-shaped pair, paged against slot caches, at
#                                # batch 1/8/32 (the two engines stay in /tmp/w8b for a second call)
#   scripts/gpu_check.sh fp8-error # the FP8 target's logits against the bf16 target's on the 8B-shaped pair (64
#                                # prompts of 64 tokens; benchmarks/fp8_error.py)
#   scripts/gpu_check.sh fp8-step # the step of the 8B-shaped pair in bf16 and of its FP8 quantization with an FP8 KV
#                                # cache (PRECISION=bf16,fp8: both, one after the other; the pairs stay in /tmp/w8b)
#   scripts/gpu_check.sh fp8-gen # end-to-end tokens/s of the same two pairs' aoti engines at batch 1/8/32
#                                # (benchmarks/generation.py; PRECISION as for fp8-step)
#   scripts/gpu_check.sh tp      # tensor parallelism over the machine's GPUs (2, 4, 8 as it has them)
#   scripts/gpu_check.sh tp-bench # its benchmark on the 8B-shaped pair at each size the GPUs allow (BACKEND=aoti:
#                                # compiled ranks; on one GPU, tp 1 through the ranks' leader)
#
# MUSE_SPARK_ATTENTION=triton|sdpa picks the attention kernel of every mode (default triton).
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

# The 8B-shaped pairs and engines (16 GB each) live under /tmp/w8b, one folder per mode and acceptance;
# the machine's 64 GB disk holds about one pair and one engine, so a mode first removes the others'.
free_disk() {
    mkdir -p /tmp/w8b
    for d in /tmp/w8b/*; do [ "$d" = "$1" ] || rm -rf "$d"; done
}
# pair_at DIR P LOG: an 8B-shaped pair at acceptance P in DIR, made unless one is there already
pair_at() {
    [ -f "$1/pair.json" ] && return 0
    python3 -m muse_spark.cli make-pair "$1" --preset muse-spark-8b --acceptance "$2" --device cuda \
        --no-measure --overwrite >"$3" 2>&1 || { tail "$3"; return 1; }
    tail -2 "$3"
}

# The carried serving wheels (scripts/device_wheels.py: nvidia-pytriton, tritonclient, protobuf) into
# /tmp/site on the path; numpy 1.x stays a wheel for the server's stub (--stub-numpy).
server_wheels() {
    local w
    w=$(ls .whl/nvidia_pytriton-*.whl .whl/tritonclient-*.whl .whl/protobuf-*.whl 2>/dev/null) || true
    [ -n "$w" ] || return 0
    python3 -m pip install -q --no-deps --no-compile --target /tmp/site $w &&
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
}

# fp8_pairs DIR: the 8B-shaped pair (acceptance 0.8) in DIR/pair and, as PRECISION asks for them, its quantizations
# (muse-spark quantize: FP8 E4M3 projections, per-channel scales): DIR/pair-fp8 (dynamic activation scales, per
# token) and DIR/pair-fp8-static (static activation scales, calibrated on 8 prompts of the bf16 pair), each made
# unless there already
fp8_pairs() {
    free_disk "$1"
    pair_at "$1/pair" 0.8 "$OUT/make-pair.log" || return 1
    local prec extra
    for prec in $(echo "${PRECISION:-bf16,fp8}" | tr , ' '); do
        case $prec in
        fp8) extra=() ;;
        fp8-static) extra=(--calibrate 8 --device cuda) ;;
        *) continue ;;
        esac
        [ -f "$1/pair-$prec/draft/config.json" ] && continue
        python3 -m muse_spark.cli quantize --target "$1/pair/target" --out "$1/pair-$prec/target" \
            --draft "$1/pair/draft" --draft-out "$1/pair-$prec/draft" --overwrite "${extra[@]}" \
            >"$OUT/quantize-$prec.log" 2>&1 || { tail "$OUT/quantize-$prec.log"; return 1; }
        tail -1 "$OUT/quantize-$prec.log"
    done
}

# fp8_args DIR PREC: into args, a benchmark's arguments for fp8_pairs' bf16 pair (PREC bf16) or its FP8 quantization
# (fp8, fp8-static) with the target's KV cache in FP8
fp8_args() {
    case $2 in
    bf16) args=(--pair "$1/pair") ;;
    fp8 | fp8-static) args=(--pair "$1/pair-$2" --kv-cache-dtype fp8) ;;
    *) echo "PRECISION: bf16, fp8 and/or fp8-static, got $2" >&2; return 2 ;;
    esac
}

case "${1:-tests}" in
tests)
    xdist=()
    # loadgroup: an engine file's tests (or each engine build's) stay on one worker (their
    # xdist_group), every other test goes to whichever worker is free
    python3 -c "import xdist" 2>/dev/null && xdist=(-n 6 --dist loadgroup --max-worker-restart=0)
    # (the CLI-built engines: the "engines" and "engine-switches" modes; together they pass 10 minutes)
    timeout "${TEST_TIMEOUT:-560}" python3 -m pytest "${xdist[@]}" -v -rfEs -m "slow or not slow" \
        tests/test_gpu_eager.py tests/kernels tests/test_gpu_engine.py 2>&1 | tee "$OUT/gpu-tests.log" |
        grep -E "PASSED|FAILED|ERROR|SKIPPED|XFAIL|[0-9]+ (passed|failed)|node down"
    ;;
engines)
    # the default CLI build with the Triton plugins, the one with narrower widths and the FP8 pair's (each build
    # on a worker of its own; each compiles its graphs in parallel processes)
    timeout "${TEST_TIMEOUT:-580}" python3 -m pytest -n 3 --dist loadgroup --max-worker-restart=0 -v -rfEs \
        -m "slow or not slow" tests/test_gpu_triton_engine.py \
        -k "not (only_wait or without_the_rope_table or paged)" 2>&1 | tee "$OUT/gpu-engines.log" |
        grep -E "PASSED|FAILED|ERROR|SKIPPED|[0-9]+ (passed|failed)|node down"
    ;;
engine-switches)
    # The engines built with switches other than the defaults (each a CLI build, the eager engine, and
    # fresh-process runs: several minutes each, so one worker each): PDL waiting only, the path
    # without the RoPE table, the fused attention and PDL, and a paged pool.
    timeout "${TEST_TIMEOUT:-580}" python3 -m pytest -n 3 --dist loadgroup --max-worker-restart=0 -v -rfEs \
        -m "slow or not slow" tests/test_gpu_triton_engine.py \
        -k "only_wait or without_the_rope_table or paged" 2>&1 | tee "$OUT/gpu-engine-switches.log" |
        grep -E "PASSED|FAILED|ERROR|SKIPPED|[0-9]+ (passed|failed)|node down"
    ;;
bench)
    # the result in the common schema lands in $OUT (copy it into benchmarks/results/)
    timeout "${BENCH_TIMEOUT:-560}" python3 benchmarks/step.py --deadline-s "${BENCH_DEADLINE:-480}" ${BENCH_ARGS:-} \
        --out-dir "$OUT" --markdown "$OUT/benchmarks.md" 2>&1 | tee "$OUT/bench.log"
    ;;
linear-fp8)
    # the skinny kernel's W8A8 form's launch configurations, then its W8A16 form's (benchmarks/linear.py --sweep-fp8) on the
    # decoder's and the draft's projections at batch 1 and 2, beside the bf16 kernel in its default configuration,
    # and W8A8 by torch._scaled_mm (eager and compiled); then, at batch 8 and 32,
    # the W8A16 kernel in its default configuration beside W8A8 (what the engines run there); JSON in $OUT
    shapes=qkv,o,gate_up+silu,down,draft_fc
    timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/linear.py --batches ${LINEAR_BATCHES:-1,2} --sweep-fp8 \
        --shapes $shapes --deadline-s 360 --out-dir "$OUT" 2>&1 | tee "$OUT/linear-fp8.log" | grep -E "W8A|cuBLAS"
    timeout 150 python3 benchmarks/linear.py --batches 8,32 --shapes $shapes --deadline-s 120 --out-dir "$OUT" 2>&1 |
        tee "$OUT/linear-fp8-rows.log" | grep -E "W8A"
    ;;
linear)
    timeout 200 python3 -m pytest -q tests/kernels/test_linear.py -k "fp8 or w8a8" 2>&1 | tail -2
    timeout "${BENCH_TIMEOUT:-380}" python3 benchmarks/linear.py --batches ${LINEAR_BATCHES:-1,2,8,32} --deadline-s 300 --out-dir "$OUT" 2>&1 |
        tee "$OUT/linear.log"
    ;;
cxx)
    # the C++ embedding (docs/cxx.md): built with CMake against this machine's torch (its JSON header from
    # the nlohmann-json wheel carried in .whl/), then run on a CUDA engine beside the Python runtime (its CPU
    # tests: the CI's)
    ls .whl/nlohmann_json-*.whl >/dev/null 2>&1 && python3 -m pip install --no-deps -q .whl/nlohmann_json-*.whl
    timeout "${TEST_TIMEOUT:-560}" python3 -m pytest -v -rfEs tests/test_gpu_cxx.py 2>&1 |
        tee "$OUT/cxx-tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|[0-9]+ (passed|failed)"
    ;;
cxx-bench)
    # the C++ embedding beside the Python runtime (benchmarks/cxx_step.py): the 8B-shaped pair at acceptance 0.85,
    # its aoti engine (buckets 1, 8, 32; kept in /tmp/w8b for a second call), the library built with CMake against
    # this machine's torch (its JSON header from the carried nlohmann-json wheel), then step latency and tokens/s of
    # muse_spark_bench with CUDA graphs, without, and of the Python runtime on the same workload
    ls .whl/nlohmann_json-*.whl >/dev/null 2>&1 && python3 -m pip install --no-deps -q .whl/nlohmann_json-*.whl
    cmake -S cxx -B /tmp/cxx-build -DPython3_EXECUTABLE="$(command -v python3)" >"$OUT/cxx-build.log" 2>&1 &&
        cmake --build /tmp/cxx-build -j "$(nproc)" >>"$OUT/cxx-build.log" 2>&1 || { tail -20 "$OUT/cxx-build.log"; exit 1; }
    here=/tmp/w8b/cxx
    free_disk "$here"
    pair_at "$here/pair" 0.85 "$OUT/make-pair.log" || exit 1
    timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/cxx_step.py --pair "$here/pair" --work-dir "$here/engine" \
        --reuse-engine --cxx-build /tmp/cxx-build --batches 1,8,32 --max-tokens 128 --prompt-len 64 --out-dir "$OUT" \
        2>&1 | grep -v "^\[build\]" | tee "$OUT/cxx-bench.log"
    ;;
serving)
    # the Triton server on the GPU beside the in-process runtime (tests/test_gpu_serving.py runs
    # benchmarks/serving.py; its JSON lands in $OUT/serving-*). Carry .whl/ from
    # `python scripts/device_wheels.py .whl`: nvidia-pytriton, and numpy 1.x for the stub where the
    # environment has numpy 2 and no package index.
    server_wheels
    stub=$(ls .whl/numpy-1.*.whl 2>/dev/null | head -1)
    [ -n "$stub" ] && export STUB_NUMPY="$PWD/$stub"
    OUT="$OUT" timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -v -rfEs -s tests/test_gpu_serving.py 2>&1 |
        tee "$OUT/serving-tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|tok/s|[0-9]+ (passed|failed)"
    ;;
workload)
    # tokens/s at real acceptance: an 8B-shaped pair whose drafts agree at ACCEPTANCE (default 0.85; a list, e.g.
    # 0.6,0.85, runs each in turn: the later pairs' engines take every package from the build cache, the same
    # shapes), with the informative confidence head; an engine built from it (BACKEND, default aoti: with the
    # default verification widths), its cost table measured, and the Generator's 256-token generations at batch 1,
    # 8 and 32 with fixed γ and with confidence scheduling (SCHEDULES, default off,confidence), each against
    # the same engine's target-only decoding (benchmarks/generation.py; JSON and table in $OUT). The pair
    # and the engine stay in /tmp/w8b: a run the call's time limit cut short (the 8B aoti build takes
    # minutes) is picked up by the next one with the same ACCEPTANCE and BACKEND. BATCHES: the batch sizes (default
    # 1,8,32; the largest is the engine's max batch, so another list builds another engine). GEN_ARGS: more
    # arguments for benchmarks/generation.py (e.g. --prefill-batch 8: each batch size prefilled one chunk a
    # call and 8).
    backend=${BACKEND:-aoti}
    for p in $(echo "${ACCEPTANCE:-0.85}" | tr ',' ' '); do
        here=/tmp/w8b/workload-$p
        free_disk "$here"
        pair_at "$here/pair" "$p" "$OUT/make-pair-$p.log" || exit 1
        cp "$here/pair/pair.json" "$OUT/pair-$p.json"
        timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/generation.py --pair "$here/pair" --reuse-engine \
            --backend "$backend" --batches "${BATCHES:-1,8,32}" --max-tokens "${MAX_TOKENS:-256}" --prompt-len 32 \
            --work-dir "$here/engine-$backend" --out-dir "$OUT" --schedule "${SCHEDULES:-off,confidence}" --calibrate \
            --markdown "$OUT/generation-$p-$backend.md" ${GEN_ARGS:-} 2>&1 | grep -v "^\[build\]" \
            | tee "$OUT/generation-$p-$backend.log"
    done
    ;;
serving-sweep)
    # what a serving user sees on the 8B-shaped pair (acceptance 0.8): a concurrency sweep in process, the
    # target-only baseline, and through tritonserver, each run with a 2,048-token prompt sent into its running
    # streams (benchmarks/bench_serving.py; carry .whl/ as for `serving`; the engine stays in /tmp/w8b for a
    # second call when the build and the runs do not fit one)
    server_wheels
    stub=$(ls .whl/numpy-1.*.whl 2>/dev/null | head -1)
    # the server through HTTP (the standard library's client) and, where tritonclient.grpc imports (grpcio
    # on the machine), through gRPC too
    modes=inprocess,triton-http
    python3 -c "import tritonclient.grpc" 2>/dev/null && modes=$modes,triton-grpc || echo "(no tritonclient.grpc here: the gRPC mode is left out)"
    modes=${SWEEP_MODES:-$modes,inprocess-target-only}  # SWEEP_MODES: the modes to run, in order
    here=/tmp/w8b/sweep
    free_disk "$here"
    pair_at "$here/pair" 0.8 "$OUT/make-pair.log" || exit 1
    timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/bench_serving.py --pair "$here/pair" --work-dir "$here/engine" --reuse-engine \
        --mode $modes --concurrency 1,4,16,32 --num-requests 64 \
        --prompt-len 128 --output-len 128 --long-prompt 2048 \
        ${stub:+--stub-numpy "$PWD/$stub"} --out-dir "$OUT" --plot "$OUT/bench-serving.png" 2>&1 | tee "$OUT/sweep.log"
    ;;
fp8-error)
    # the FP8 target against the bf16 one (benchmarks/fp8_error.py): the 8B-shaped pair (acceptance 0.8), its target
    # quantized beside it, both run over 64 prompts of 64 tokens; JSON in $OUT
    here=/tmp/w8b/fp8
    free_disk "$here"
    pair_at "$here/pair" 0.8 "$OUT/make-pair.log" || exit 1
    timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/fp8_error.py --pair "$here/pair" --work-dir "$here" \
        --prompts 64 --prompt-len 64 --out-dir "$OUT" 2>&1 | tee "$OUT/fp8-error.log"
    ;;
fp8-step)
    # the speculative step (benchmarks/step.py: the aoti engine's, batch 1/8/32, against each one's roofline of the
    # bytes it reads) of the 8B-shaped pair (acceptance 0.8) in bf16, then of the same pair quantized (muse-spark
    # quantize: FP8 E4M3 projections, per-channel scales) with the target's KV cache in FP8; JSON in $OUT, one
    # file each. PRECISION picks them (default bf16,fp8; fp8-static: the FP8 pair with calibrated static activation
    # scales), BATCHES the batches (default 1,8,32), STEP_ARGS adds
    # arguments (STEP_ARGS="--profile": kernel tables); a call cut
    # short leaves the pairs for the next.
    here=/tmp/w8b/fp8
    fp8_pairs "$here" || exit 1
    for prec in $(echo "${PRECISION:-bf16,fp8}" | tr , ' '); do
        fp8_args "$here" "$prec" || exit 2
        # (batch 1 first, and each batch saved as it is timed: a run the time limit cuts keeps batch 1, the FP8 target's)
        timeout "${BENCH_TIMEOUT:-290}" python3 benchmarks/step.py "${args[@]}" --batches "${BATCHES:-1,8,32}" ${STEP_ARGS:-} --skip eager,compile \
            --aoti-ascending --deadline-s "${BENCH_DEADLINE:-240}" --out-dir "$OUT" --markdown "$OUT/step-$prec.md" 2>&1 |
            tee "$OUT/step-$prec.log" | grep -v "^\[build\]" | tail -15
    done
    ;;
fp8-gen)
    # end-to-end tokens/s of the FP8 pair (FP8 projections, the target's KV cache in FP8) beside the bf16 pair it was
    # quantized from (acceptance 0.8): benchmarks/generation.py on each one's aoti engine, 256-token generations at
    # batch 1/8/32 against the same engine's target-only decoding; JSON and table in $OUT. PRECISION picks them
    # (default bf16,fp8); the pairs and engines stay in /tmp/w8b/fp8 for a second call (each 8B build takes minutes).
    here=/tmp/w8b/fp8
    fp8_pairs "$here" || exit 1
    precs=$(echo "${PRECISION:-bf16,fp8}" | tr , ' ')
    # (the disk holds the bf16 pair, one quantization and one engine: the other quantizations go, and each
    # engine before the next is built)
    for d in "$here"/pair-*; do [[ " $precs " == *" ${d##*/pair-} "* ]] || rm -rf "$d"; done
    for prec in $precs; do
        fp8_args "$here" "$prec" || exit 2
        for d in "$here"/engine-*; do [ "$d" = "$here/engine-$prec" ] || rm -rf "$d"; done
        timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/generation.py "${args[@]}" --reuse-engine --backend aoti \
            --batches "${BATCHES:-1,8,32}" --max-tokens 256 --prompt-len 32 --work-dir "$here/engine-$prec" \
            --out-dir "$OUT" --markdown "$OUT/generation-$prec.md" 2>&1 | grep -v "^\[build\]" |
            tee "$OUT/generation-$prec.log" | tail -8
    done
    ;;
paged)
    # paged KV caches (benchmarks/paged_kv.py): the 8B-shaped pair (acceptance 0.8), a budget of 8 windows of
    # 1,152 positions, 64 requests of 16-512 prompt and 16-128 output tokens, 4 behind a 1,024-token system
    # prompt; the kernel tests of the attention through block tables first
    timeout 300 python3 -m pytest -q tests/kernels/test_attention.py -k block_tables 2>&1 | tail -2
    here=/tmp/w8b/paged
    free_disk "$here"
    pair_at "$here/pair" 0.8 "$OUT/make-pair.log" || exit 1
    timeout "${BENCH_TIMEOUT:-480}" python3 benchmarks/paged_kv.py --pair "$here/pair" --memory-tokens 9216 \
        --requests 64 --prompt-len 16:512 --max-tokens 16:128 --system-prompt 1024 --out-dir "$OUT" 2>&1 |
        tee "$OUT/paged.log"
    ;;
paged-step)
    # the compiled engine's speculative step, paged against slot caches (benchmarks/paged_kv.py --backend aoti): two
    # aoti engines of the 8B-shaped pair (acceptance 0.8), slot caches and a pool of the same positions (one copy
    # of the weights between them), the step at batch 1, 8 and 32 after 1,024 tokens of context; JSON and table
    # in $OUT. The engines stay in /tmp/w8b: a run the call's time limit cut short (each 8B build takes minutes)
    # is picked up by the next one.
    here=/tmp/w8b/paged-step
    free_disk "$here"
    pair_at "$here/pair" 0.8 "$OUT/make-pair.log" || exit 1
    timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/paged_kv.py --backend aoti --pair "$here/pair" \
        --work-dir "$here/engines" --reuse-engine --step-batches 1,8,32 --context 1024 --out-dir "$OUT" 2>&1 |
        grep -v "^\[build\]" | tee "$OUT/paged-step.log"
    ;;
tp)
    # tensor parallelism over the machine's GPUs (NCCL): the split target's tokens against one GPU's
    # (tests/test_gpu_tensor_parallel.py, 2/4/8 ranks as the GPUs allow) and the CPU (gloo) tests
    timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -v -rfEs tests/test_gpu_tensor_parallel.py tests/test_tensor_parallel.py \
        2>&1 | tee "$OUT/tp-tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|[0-9]+ (passed|failed)"
    ;;
tp-bench)
    # the 8B-shaped pair (acceptance 0.85) split over 1, 2, 4, 8 GPUs as the machine has them: step,
    # all-reduce and tokens/s against each size's roofline (benchmarks/tensor_parallel.py; JSON in $OUT)
    n=$(python3 -c "import torch; print(torch.cuda.device_count())")
    sizes=$(python3 -c "print(','.join(str(k) for k in (1, 2, 4, 8) if k <= $n))")
    here=/tmp/w8b/tp
    free_disk "$here"
    pair_at "$here/pair" 0.85 "$OUT/make-pair.log" || exit 1
    # BACKEND=aoti: compiled ranks (an 8B aoti engine built for each size in /tmp/w8b/tp/engines, kept for the next
    # call: the builds of four sizes do not fit one)
    timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/tensor_parallel.py --pair "$here/pair" --tp "$sizes" \
        --backend "${BACKEND:-eager}" --work-dir "$here/engines" --reuse-engine --out-dir "$OUT" 2>&1 | tee "$OUT/tp-bench.log"
    ;;
*)
    echo "usage: $0 tests|engines|engine-switches|paged|paged-step|linear|bench|cxx|cxx-bench|serving|workload|serving-sweep|fp8-error|fp8-step|tp|tp-bench" >&2
    exit 2
    ;;
esac
