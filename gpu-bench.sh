#!/bin/bash
# gpu-bench.sh — one device run of the CUDA backend (issue 6): the GPU tests,
# then `strata bench` on `strata synth` models of the Qwen3-8B and
# Qwen3-30B-A3B shapes, as recorded in BENCH.md. The GPU machine keeps
# nothing and should spend its time running, not compiling, so everything is
# built beforehand into DIR:
#
#   make GPU=cuda CUDA_ARCH=90 MARCH=x86-64-v3 B=build-gpu build-gpu/test build-gpu/strata.o
#   mkdir -p carry/gpu/testdata && cp build-gpu/test carry/gpu/ &&
#   nvcc -cudart static -o carry/gpu/strata $(ls build-gpu/*.o | grep -v /test) -lm -lpthread -ldl &&
#   cp ../shared/testdata/tiny-qwen3-Q4_K_M.gguf carry/gpu/testdata/
#
# (64 MiB travel with a run, the working tree included: one tiny model; the
# synthetic models get synth's own plain vocabulary. DIR/strata.gz and
# DIR/test.gz, gzip -9 of the stripped binaries, take 5 MB each instead of 13,
# so that both tiny models fit; they are unpacked to $TMPDIR.)
#
# Usage: bash gpu-bench.sh DIR STEP...   with steps: tests, profile (test_gpu.c's per-stage profile of
# an 8B Q4_K decode step and 512-token prompt; profile-moe: the same and 12 layers of the 30B-A3B
# shape), mv (the products alone: Q4_K and F16 at 1..16 rows, Q6_K, Q8_0 and BF16 at one;
# ncu-mv: Nsight Compute's counters of two of them), 8b-q4k, 8b-q4km (a Q4_K_M file's mix),
# 8b-q8, 8b-q5km (a Q5_K_M file's), 8b-q4_0, 8b-f16, 8b-bf16, 30b-q4k, 30b-q4km, 30b-q8,
# 32b-q4k, 32b-q4km (the Qwen3-32B shape, 18 GB at Q4_K), batch (bench --batch 2..16 on the 8B shape at Q4_K, Q4_K_M and Q8_0,
# or the synth types in BATCH_TYPES),
# serve (strata serve --parallel N on the 8B Q4_K, N concurrent completions of 256 tokens by
# curl, the wall time; SERVE_N, default "8 16"),
# trace (the timeline of one decode step, 8B and 30B-A3B Q4_K at 512 cells, from DIR/strata-trace.gz:
# `make cuda TRACE=1 CUDA_ARCH=90 MARCH=x86-64-v3` leaves that measuring build in ./strata; strip and
# gzip it there; the timelines, and the same step block by block, go to $OUT; TRACE_SHAPES picks the
# shapes, TRACE_TYPE the type (default q4_k), TRACE_ARGS replaces "-d 512 -c 1024", e.g. "-d 32768 -c 33024 --kv int8")
# (each model step writes its model to /tmp, benchmarks it and deletes it),
# sweep (a model's tg128 and pp4096 once for each environment setting in
# SWEEP, e.g. SWEEP="STRATA_GEMM_BLAS=0 STRATA_GEMM_BLAS=1 A=1+B=2"; the model:
# SWEEP_SHAPE, default qwen3-8b, SWEEP_TYPE, default q4_k; SWEEP_P prompt
# tokens, default 4096; SWEEP_ARGS replaces the bench arguments, e.g.
# "-p 0 -n 128 -d 32768 -r 3 -c 33024 --kv int8" for decode at 32K).
# STRATA=path runs another strata binary; BUDGET=s skips the steps that would
# start after s seconds (a run has a time limit). The test log goes to $OUT
# when that is set (the device tool's folder that comes back).
set -u
D=$1
shift
T=${TMPDIR:-/tmp}
B=$D   # the binaries
if [ -f "$D/test.gz" ]; then
    B=$T/strata-bin
    mkdir -p "$B" && for f in strata test; do gunzip -c "$D/$f.gz" >"$B/$f" && chmod +x "$B/$f"; done
fi
S=${STRATA:-$B/strata}
BUDGET=${BUDGET:-86400}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader
# gpu_gemm.cu opens cuBLAS at run time: from the loader's path, else from
# wherever a toolkit or a Python wheel put it
if ! ldconfig -p | grep -q 'libcublas\.so\.[0-9]'; then
    lib=$(find /usr /opt /root /home -name 'libcublas.so.[0-9]*' 2>/dev/null | head -n 1)
    [ -n "$lib" ] && export LD_LIBRARY_PATH=$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
echo "cuBLAS: ${lib:-$(ldconfig -p | grep -o '/[^ ]*libcublas\.so\.[0-9]*' | head -n 1)}"

bench_model() { # name shape type
    local m=$T/$1.gguf t0=$SECONDS
    $S synth --shape "$2" --type "$3" -o "$m" >/dev/null || return
    echo "== $1 (synth $((SECONDS - t0)) s)"
    $S bench -m "$m" --device gpu -p 512 -n 128 -r 5 -c 1024 2>/dev/null
    for ch in 512 2048 4096; do
        echo "-- pp4096, --prefill-chunk $ch"
        $S bench -m "$m" --device gpu -p 4096 -n 0 -r 5 -c 4096 --prefill-chunk $ch 2>/dev/null | grep -E '^prompt'
    done
    for kv in f16 int8; do
        echo "-- tg128 at 32K context, --kv $kv"
        $S bench -m "$m" --device gpu --kv $kv -p 0 -n 128 -d 32768 -r 3 -c 33024 2>/dev/null |
            grep -E '^(decode|depth)'
    done
    rm -f "$m"
}

batch() { # several sequences decoding together (bench --batch), the 8B shape at each of BATCH_TYPES, 512 cells
    local m=$T/batch.gguf
    for type in ${BATCH_TYPES:-q4_k q4_k_m q8_0}; do
        $S synth --shape qwen3-8b --type $type -o "$m" >/dev/null || return
        echo "== batch: qwen3-8b $type, tg128 of B sequences together at 512 cells each"
        for b in 2 4 8 16; do
            echo "-- --batch $b"
            $S bench -m "$m" --device gpu -p 0 -n 128 -d 512 -r 3 -c 1024 --batch $b 2>/dev/null | grep -E '^decode '
        done
        rm -f "$m"
    done
}

serve() { # the server's parallel streams end to end: N concurrent completions of 256 tokens (8B Q4_K)
    local m=$T/serve.gguf
    $S synth --shape qwen3-8b --type q4_k -o "$m" >/dev/null || return
    for n in ${SERVE_N:-8 16}; do
        $S serve -m "$m" --device gpu --parallel $n --port 18080 -c 1024 >"$T/serve.log" 2>&1 &
        local pid=$!
        for _ in $(seq 300); do curl -sf http://127.0.0.1:18080/health >/dev/null && break; sleep 0.2; done
        for len in 32 256; do   # (the first round captures the graphs)
            local t0=$(date +%s.%N)
            for i in $(seq $n); do
                curl -s http://127.0.0.1:18080/v1/completions -H 'Content-Type: application/json' -d \
                    "{\"prompt\": \"Story $i: once upon a time\", \"max_tokens\": $len, \"seed\": $i}" \
                    -o "$T/serve.$i.json" &
            done
            wait $(jobs -p | grep -v "^$pid$")
            [ $len = 256 ] && cat "$T"/serve.*.json | grep -o '"completion_tokens":[0-9]*' | cut -d: -f2 |
                awk -v n=$n -v t0=$t0 -v t1=$(date +%s.%N) '{ s += $1 } END {
                    printf "serve --parallel %d: %d tokens in %.2f s, %.1f tok/s\n", n, s, t1 - t0, s / (t1 - t0) }'
        done
        kill $pid; wait $pid 2>/dev/null
    done
    rm -f "$m" "$T"/serve.*.json
}

trace() { # one decode step's timeline (a TRACE=1 build), 8B and 30B-A3B Q4_K at 512 cells
    local m=$T/trace.gguf st=$T/strata-trace args=${TRACE_ARGS:-"-d 512 -c 1024"}
    gunzip -c "$D/strata-trace.gz" >"$st" && chmod +x "$st" || return
    for shape in ${TRACE_SHAPES:-qwen3-8b qwen3-30b-a3b}; do
        $S synth --shape $shape --type ${TRACE_TYPE:-q4_k} -o "$m" >/dev/null || return
        echo "== trace: $shape ${TRACE_TYPE:-q4_k}, tg16, $args"
        STRATA_GPU_TRACE=${OUT:-$T}/trace-$shape.txt STRATA_GPU_TRACE_BLOCKS=${OUT:-$T}/blocks-$shape.txt \
            $st bench -m "$m" --device gpu -p 0 -n 16 -r 1 $args 2>/dev/null | grep -E '^decode '
        head -n 16 "${OUT:-$T}/trace-$shape.txt"
        rm -f "$m"
    done
}

sweep() { # tg128 and a prompt (chunk 2048) of a model per setting in SWEEP
    local m=$T/sweep.gguf shape=${SWEEP_SHAPE:-qwen3-8b} p=${SWEEP_P:-4096}
    local args=${SWEEP_ARGS:-"-p $p -n 128 -r 5 -c $((p + 256)) --prefill-chunk 2048"}
    $S synth --shape $shape --type ${SWEEP_TYPE:-q4_k} -o "$m" >/dev/null || return
    echo "== sweep: $shape ${SWEEP_TYPE:-q4_k}, bench $args"
    for e in ${SWEEP:-}; do
        echo "-- $e"
        env ${e//+/ } $S bench -m "$m" --device gpu $args 2>/dev/null | grep -E '^(prompt|decode) '
    done
    rm -f "$m"
}

for step in "$@"; do
    if ((SECONDS > BUDGET)); then
        echo "== $step skipped: past the budget of $BUDGET s"
        continue
    fi
    case $step in
    tests) # every failure with the lines before it, then the count
        STRATA_TESTDATA=$D/testdata "$B/test" gpu/ >"$T/tests.log" 2>&1
        grep -B6 '^FAIL' "$T/tests.log"
        [ -n "${OUT:-}" ] && cp "$T/tests.log" "$OUT/"
        tail -n 1 "$T/tests.log" ;;
    profile) STRATA_GPU_BENCH=1 "$B/test" gpu/bench 2>&1 | grep -E '^  (qwen|tg128|profile)' ;;
    profile-moe) STRATA_GPU_BENCH=moe "$B/test" gpu/bench 2>&1 | grep -E '^  (qwen|tg128|profile)' ;;
    mv) STRATA_GPU_BENCH=mv "$B/test" gpu/mv/ 2>&1 | grep -E '^  (Q4_K|Q6_K|Q8_0|F16|BF16)' ;;
    ncu-mv) # the hardware counters of one 8B gate+up product: gf_mvk_kernel with one row (the mv
        # step's 41st launch of it), gf_mvq_kernel with 8 (its 281st: after 120 at 2 rows, 120 at 4)
        for k in gf_mvk_kernel:40 gf_mvq_kernel:280; do
            STRATA_GPU_BENCH=mv /usr/local/cuda/bin/ncu --clock-control none --kernel-name "regex:${k%:*}" \
                --launch-skip "${k#*:}" --launch-count 1 --section SpeedOfLight --section Occupancy \
                --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
                --section ComputeWorkloadAnalysis --section LaunchStats "$B/test" gpu/mv/ 2>&1 |
                grep -vE '^\s*$|^==PROF==|^  (Q4_K|Q6_K|Q8_0)'
        done ;;
    8b-q4k) bench_model q8b-q4k qwen3-8b q4_k ;;
    8b-q4km) bench_model q8b-q4km qwen3-8b q4_k_m ;;
    8b-q8) bench_model q8b-q8 qwen3-8b q8_0 ;;
    8b-q5km) bench_model q8b-q5km qwen3-8b q5_k_m ;;
    8b-q4_0) bench_model q8b-q4_0 qwen3-8b q4_0 ;;
    8b-f16) bench_model q8b-f16 qwen3-8b f16 ;;
    8b-bf16) bench_model q8b-bf16 qwen3-8b bf16 ;;
    30b-q4k) bench_model q30b-q4k qwen3-30b-a3b q4_k ;;
    30b-q4km) bench_model q30b-q4km qwen3-30b-a3b q4_k_m ;;
    30b-q8) bench_model q30b-q8 qwen3-30b-a3b q8_0 ;;
    32b-q4k) bench_model q32b-q4k qwen3-32b q4_k ;;
    32b-q4km) bench_model q32b-q4km qwen3-32b q4_k_m ;;
    batch) batch ;;
    serve) serve ;;
    trace) trace ;;
    sweep) sweep ;;
    *) echo "gpu-bench.sh: unknown step $step" >&2; exit 2 ;;
    esac
done
