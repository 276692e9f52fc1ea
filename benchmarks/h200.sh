#!/usr/bin/env bash
# The CUDA route's measurements, run on the device machine from the repository root:
#   bash benchmarks/h200.sh PART...       (writes under $OUT, default /tmp/hebrus-out)
# PARTs: tests (GPU tests, over HEBRUS_WORKERS pytest-xdist workers where its wheels are in .whl/; HEBRUS_TESTS, if set, is pytest's -k, HEBRUS_PART names the log, HEBRUS_TEST_LIMIT cuts it, s), small (bench of the small preset), qwen (bench of the 1.68B
# Qwen3.5 shape against transformers), batch (that shape's sessions decoding together: 1, 8, 64
# and 256 at 1K, 8 at 32K, where 64 sessions' K/V in both variants would not fit), kernels (the
# decode step's kernels alone, and a profiled step of 64 sessions), eager (the 1.68B
# shape decoding eagerly, for scale), long (bench --long: QSA against dense attention, 1K to 128K), long-wide (the same on --long-shape wide), pages (bench
# --ple-pages: 8 GiB of PLE tables paged through 512 MiB against resident), quant (bench --quant: the trained
# model's validation loss per format, and the 1.68B shape's decode per format), spec (bench --spec: the
# 1.68B shape's greedy decoding plain and with prompt lookup, and the cost of a fork at 1K and 32K;
# then the trained shakespeare model, also with its int8 twin as a draft model), serve (bench --serve:
# the 1.68B shape behind the HTTP server at 1, 16 and 64 clients against the engine offline), sampled (the same at 64
# clients, sampled at temperature 0.8), serve-gather (64 clients, an idle engine gathering a burst of requests
# into one pass and not: --serve-gather-ms 5 and 0, a server each), serving (the
# workloads shared, long-serve and mixed, each with the prefix cache on and off; also parts of their own: each
# server warms up first, so the three may not fit one call), long-chunks (the long workload with one request's
# prompt chunk at 256 and 4096 tokens, --serve-prefill-chunk), long-paced (the long workload at chunk 4096 with
# --serve-passes paced, then two), paced-turns (diag/serve_turns.py: the engine loop alone with a 16K prompt among
# 32 decoders, each turn timed, paced then two),
# prefill8k (the 1.68B shape's 8K prompt against transformers, 5 rounds), shakespeare (the trained
# default's decode at batch 1 and 8), conv (benchmarks/conv_prefill.py: a GDN conv over an 8K chunk),
# gemv (benchmarks/gemv.py --update: a Triton product of one row against cuBLAS on the 1.68B shape's weights,
# the fastest launches written into this copy's ops/cuda/gemv.py), beside (the 1.68B shape at 1K and 8K, then
# the same from HEBRUS_BASE, another checkout's src, on the same machine),
# copies (benchmarks/copy_sites.py: where a planned decode step's copy and index kernels come from),
# constrained (bench --constrained at 1 and 64 sessions, and benchmarks/constrained_parts.py), constrained-later
# (diag/mask_apply.py, then constrained_parts.py --later: the worker against masks made after the step), serve-engine
# (diag/serve_engine.py: the 64-client workload in the engine loop alone, no HTTP), syncs (diag/syncs.py: where
# a pass of prompts waits for the device, with its profile),
# chain (the 1.68B shape at 1K and 8K with a step's kernels launched plain and as a chain, HEBRUS_PDL; the chained
# step profiled; the GPU tests of the kernels that take part, chained),
# profile (benchmarks/decode_profile.py on the 1.68B shape and shakespeare, archived in profiles.tgz),
# qsa (the selection kernel's GPU test, and benchmarks/qsa_layer.py with it),
# quant-profile (the 1.68B shape's graph decode step profiled in bf16, int8 and int4, archived in
# quant-profiles.tgz, then benchmarks/diag/int4_bits.py), int4-bits (diag/int4_bits.py: the int4 vector kernel beside
# designs that make a code's float from its bits), step-alone (diag/step_alone.py: a quantized
# step timed alone, fed back to back and through the bench's procedure), quant-kernels (diag/quant_vectors.py and
# diag/quant_matrix.py: kernel designs timed beside the module's),
# deepseek (bench of the 2.98B DeepSeek-V4 shape at 1K and 32K against transformers, and at 128K),
# parallel (tensor parallelism over NCCL: the 1.68B shape over 1 rank against one process, eager;
# over 2 ranks where the machine has two GPUs; and the GPU tests of tests/test_parallel.py).
# Needs fla-core, einops and greenlet wheels in .whl/ (and, for the serve part, the FastAPI stack: see benchmarks/README.md); HEBRUS_COMMIT names the commit.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/hebrus-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for part in "$@"; do
    start=$(date +%s)
    case $part in
    tests)
        # failures first, in short form; torch's captured debug logging left out; the slowest
        # tests' times after them. With pytest-xdist (its wheels in .whl/), HEBRUS_WORKERS
        # processes (default 4) share the file, the out-of-memory test run alone first: it takes
        # the device's memory
        log="$out/test-cuda${HEBRUS_PART:+-$HEBRUS_PART}.txt"
        workers=${HEBRUS_WORKERS:-4}
        python3 -c "import xdist" 2>/dev/null || workers=1
        select=${HEBRUS_TESTS:-}
        if [ "$workers" -gt 1 ]; then
            timeout 150 python3 -m pytest -q -rfEs --tb=short -p no:logging -W ignore tests/test_cuda.py \
                -k "out_of_memory${select:+ and ($select)}" > "${log%.txt}-alone.txt" 2>&1
            tail -1 "${log%.txt}-alone.txt"
            select="not out_of_memory${select:+ and ($select)}"
        fi
        timeout ${HEBRUS_TEST_LIMIT:-560} python3 -m pytest -q -rfEs --tb=short -p no:logging -W ignore --durations=30 \
            $([ "$workers" -gt 1 ] && echo "-n $workers") tests/test_cuda.py ${select:+-k "$select"} > "$log" 2>&1
        tail -3 "$log" ;;
    small)
        timeout 300 python3 -m hebrus bench --model small --contexts 1024,32768 --rounds 3 \
            --json "$out/bench-small.json" --table "$out/bench-small.md" 2>&1 | grep -v '^bench' ;;
    qwen)
        timeout 480 python3 -m hebrus bench --model qwen3.5-1.7b --contexts 1024,8192,32768 --rounds 3 \
            --compare-transformers --cache /tmp/shapes \
            --json "$out/bench-qwen3.5-1.7b.json" --table "$out/bench-qwen3.5-1.7b.md" 2>&1 | grep -v '^bench' ;;
    batch)
        timeout 300 python3 -m hebrus bench --model qwen3.5-1.7b --contexts 1024 --batch 1,8,64,256 --rounds 5 \
            --decode-steps 16 --cache /tmp/shapes --json "$out/bench-qwen3.5-1.7b-batch-1k.json" \
            --table "$out/bench-qwen3.5-1.7b-batch-1k.md" 2>&1 | grep -v '^bench'
        timeout 300 python3 -m hebrus bench --model qwen3.5-1.7b --contexts 32768 --batch 8 --rounds 2 \
            --decode-steps 16 --cache /tmp/shapes --json "$out/bench-qwen3.5-1.7b-batch-32k.json" \
            --table "$out/bench-qwen3.5-1.7b-batch-32k.md" 2>&1 | grep -v '^bench' ;;
    long)
        timeout 580 python3 -m hebrus bench --long --rounds 2 --decode-steps 16 \
            --json "$out/bench-long.json" --table "$out/bench-long.md" 2>&1 | grep -v '^bench' ;;
    long-wide)
        # issue 35's second shape: K/V rows four times as wide (floors' ratio 7.3x at 128K), at 1K
        # and 128K only (the target is 128K's), to leave room in a command for another part
        timeout 400 python3 -m hebrus bench --long --long-shape wide --contexts 1024,131072 --rounds 2 --decode-steps 16 \
            --json "$out/bench-long-wide.json" --table "$out/bench-long-wide.md" 2>&1 | grep -v '^bench' ;;
    pages)
        timeout 580 python3 -m hebrus bench --ple-pages --ple-gib 8 --ple-cache-mib 512 --rounds 3 \
            --decode-steps 64 --cache /tmp/shapes --json "$out/bench-ple-pages.json" \
            --table "$out/bench-ple-pages.md" 2>&1 | grep -v '^bench' ;;
    quant)
        # the validation text travels as recipes/shakespeare/data/val.bin (carry it)
        timeout 560 python3 -m hebrus bench --quant --model qwen3.5-1.7b --contexts 1024 --batch 1,64 --rounds 2 \
            --decode-steps 16 --cache /tmp/shapes --json "$out/bench-quant.json" --table "$out/bench-quant.md" \
            2>&1 | grep -v '^bench\|^validation' ;;
    spec)
        timeout 300 python3 -m hebrus bench --spec --model qwen3.5-1.7b --contexts 1024,32768 --rounds 2 \
            --spec-tokens 256 --cache /tmp/shapes \
            --json "$out/bench-spec-qwen3.5-1.7b.json" --table "$out/bench-spec-qwen3.5-1.7b.md" 2>&1 | grep -v '^bench'
        timeout 240 python3 -m hebrus bench --spec --model shakespeare --draft shakespeare --draft-quantize int8 \
            --contexts 1024,8000 --rounds 2 --spec-tokens 256 --json "$out/bench-spec-shakespeare.json" \
            --table "$out/bench-spec-shakespeare.md" 2>&1 | grep -v '^bench'
        timeout 120 python3 -m hebrus bench --spec --model shakespeare --draft-tokens 16 --contexts 1024 --rounds 2 \
            --spec-tokens 256 --json "$out/bench-spec-shakespeare-16.json" \
            --table "$out/bench-spec-shakespeare-16.md" 2>&1 | grep -v '^bench' ;;
    serve)
        timeout 560 python3 -m hebrus bench --serve --model qwen3.5-1.7b --clients 1,16,64 --requests 64 \
            --serve-prompt 128 --serve-tokens 64 --cache /tmp/shapes --json "$out/bench-serve-qwen3.5-1.7b.json" \
            --table "$out/bench-serve-qwen3.5-1.7b.md" 2>&1 | grep -v '^bench' ;;
    serve-gather)
        # issue 30 (a) with an idle engine gathering a burst of requests into one pass
        # (--serve-gather-ms 5) and without (0, the default), one server each, twice in turn
        for gather in 5 0 5 0; do
            timeout 400 python3 -m hebrus bench --serve --model qwen3.5-1.7b --clients 64 --requests 128 \
                --serve-prompt 128 --serve-tokens 64 --serve-gather-ms $gather --cache /tmp/shapes \
                --json "$out/bench-serve-gather-$gather-qwen3.5-1.7b.json" \
                --table "$out/bench-serve-gather-$gather-qwen3.5-1.7b.md" 2>&1 | grep -v '^bench'
        done ;;
    sampled)
        # (a) sampled: 64 clients, each request at temperature 0.8 from its own seed
        timeout 300 python3 -m hebrus bench --serve --model qwen3.5-1.7b --clients 64 --requests 128 \
            --serve-prompt 128 --serve-tokens 64 --serve-temperature 0.8 --cache /tmp/shapes \
            --json "$out/bench-serve-sampled-qwen3.5-1.7b.json" --table "$out/bench-serve-sampled-qwen3.5-1.7b.md" 2>&1 | grep -v '^bench' ;;
    serving)
        # issue 30's workloads on the 1.68B shape: (b) a shared 2,000-token system prompt, (d) a
        # 32K prompt among 32 decoders, (e) lognormal lengths; each with the prefix cache on and off.
        # Each server warms up first (73-85 s on a fresh H100 at 7c74ec4, less once the compiler's
        # cache holds its kernels): the three may not fit one 10-minute call; shared, long and
        # mixed run one each
        bash "$0" shared long-serve mixed ;;
    shared)
        timeout 200 python3 -m hebrus bench --serve --workload shared --model qwen3.5-1.7b --clients 16 \
            --system 2000 --own 64 --serve-tokens 64 --cache /tmp/shapes \
            --json "$out/bench-serve-shared-qwen3.5-1.7b.json" --table "$out/bench-serve-shared-qwen3.5-1.7b.md" 2>&1 | grep -v '^bench' ;;
    long-serve)
        timeout 200 python3 -m hebrus bench --serve --workload long --model qwen3.5-1.7b --clients 32 \
            --system 32000 --serve-tokens 512 --cache /tmp/shapes \
            --json "$out/bench-serve-long-qwen3.5-1.7b.json" --table "$out/bench-serve-long-qwen3.5-1.7b.md" 2>&1 | grep -v '^bench' ;;
    long-chunks)
        # issue 30 (d): the long workload with one request's chunk at the default 256 and at 4096 tokens
        # (hebrus serve --prefill-chunk), one after the other: a pass costs the host about the same either way
        for chunk in 256 4096; do
            timeout 240 python3 -m hebrus bench --serve --workload long --model qwen3.5-1.7b --clients 32 \
                --system 32000 --serve-tokens 512 --serve-prefill-chunk $chunk --cache /tmp/shapes \
                --json "$out/bench-serve-long-chunk-$chunk-qwen3.5-1.7b.json" \
                --table "$out/bench-serve-long-chunk-$chunk-qwen3.5-1.7b.md" 2>&1 | grep -v '^bench'
        done ;;
    long-paced)
        # issue 30 (d): the long workload with the prompt's pass a few stages a turn (--passes paced) at one
        # request's chunk of 4096 tokens, then the same with two passes a turn (the default on a GPU)
        for passes in paced two; do
            timeout 240 python3 -m hebrus bench --serve --workload long --model qwen3.5-1.7b --clients 32 \
                --system 32000 --serve-tokens 512 --serve-prefill-chunk 4096 --serve-passes $passes --cache /tmp/shapes \
                --json "$out/bench-serve-long-$passes-4096-qwen3.5-1.7b.json" \
                --table "$out/bench-serve-long-$passes-4096-qwen3.5-1.7b.md" 2>&1 | grep -v '^bench'
        done ;;
    paced-turns)
        # issue 30 (d) in the engine loop alone (benchmarks/diag/serve_turns.py): 32 decoding, a 16,000-token
        # prompt in chunks of 2048, each turn timed; paced (the pass a few stages a turn, its places' costs) then two
        for passes in paced two; do
            timeout 280 python3 benchmarks/diag/serve_turns.py --model qwen3.5-1.7b --clients 32 --prompt 16000 \
                --chunk 2048 --passes $passes > "$out/serve-turns-$passes.txt" 2>&1
            head -3 "$out/serve-turns-$passes.txt" | cut -c1-400
        done ;;
    mixed)
        timeout 180 python3 -m hebrus bench --serve --workload mixed --model qwen3.5-1.7b --clients 64 --requests 128 \
            --serve-prompt 256 --serve-tokens 64 --cache /tmp/shapes \
            --json "$out/bench-serve-mixed-qwen3.5-1.7b.json" --table "$out/bench-serve-mixed-qwen3.5-1.7b.md" 2>&1 | grep -v '^bench' ;;
    prefill8k)
        timeout 300 python3 -m hebrus bench --model qwen3.5-1.7b --contexts 8192 --rounds 5 --compare-transformers \
            --cache /tmp/shapes --json "$out/bench-qwen3.5-1.7b-8k.json" --table "$out/bench-qwen3.5-1.7b-8k.md" 2>&1 | grep -v '^bench' ;;
    shakespeare)
        timeout 240 python3 -m hebrus bench --model shakespeare --contexts 1024 --batch 1,8 --rounds 5 \
            --json "$out/bench-shakespeare.json" --table "$out/bench-shakespeare.md" 2>&1 | grep -v '^bench' ;;
    conv)
        timeout 120 python3 benchmarks/conv_prefill.py --out "$out" 2>&1 | grep -v Warn ;;
    gemv)
        # the launches measured with cold weights and written into ops/cuda/gemv.py's MEASURED (of
        # this machine's copy: it comes back as gemv-module.py, to commit); the parts after it use them
        timeout 300 python3 benchmarks/gemv.py --out "$out" --update 2>&1 | grep -v Warn
        cp src/hebrus/ops/cuda/gemv.py "$out/gemv-module.py" ;;
    beside)
        # the 1.68B shape at 1K and 8K, this checkout and then another's source (HEBRUS_BASE: its src
        # folder, carried; HEBRUS_BASE_COMMIT: its commit) on this machine, 5 rounds each
        for who in now base; do
            p=src; c=${HEBRUS_COMMIT:-}
            [ $who = base ] && p=${HEBRUS_BASE:?HEBRUS_BASE: the src folder of the other checkout} && c=${HEBRUS_BASE_COMMIT:-base}
            HEBRUS_COMMIT=$c PYTHONPATH=/tmp/site:$p timeout 150 python3 -m hebrus bench --model qwen3.5-1.7b \
                --contexts 1024,8192 --rounds 5 --cache /tmp/shapes --json "$out/bench-beside-$who.json" \
                --table "$out/bench-beside-$who.md" 2>&1 | grep -v '^bench'
        done ;;
    deepseek)
        # the DeepSeek-V4 shape (2.98B) at 1K and 32K against transformers (which needs deepseek_v4:
        # carry a transformers wheel that has it), then 128K alone
        timeout 400 python3 -m hebrus bench --model deepseek-v4-3b --contexts 1024,32768 --rounds 2 --decode-steps 16 \
            --compare-transformers --cache /tmp/shapes --json "$out/bench-deepseek-v4-3b.json" \
            --table "$out/bench-deepseek-v4-3b.md" 2>&1 | grep -v '^bench'
        timeout 300 python3 -m hebrus bench --model deepseek-v4-3b --contexts 131072 --rounds 1 --decode-steps 8 \
            --cache /tmp/shapes --json "$out/bench-deepseek-v4-3b-128k.json" \
            --table "$out/bench-deepseek-v4-3b-128k.md" 2>&1 | grep -v '^bench' ;;
    constrained)
        # issue 31: bench --constrained on the 1.68B shape at 1 and 64 sessions, then its step taken
        # apart (benchmarks/constrained_parts.py: the parts' host times, the worker alone, one
        # step's kernels free and constrained)
        timeout 200 python3 -m hebrus bench --constrained --model qwen3.5-1.7b --contexts 1024 --batch 1,64 --rounds 3 \
            --decode-steps 32 --cache /tmp/shapes --json "$out/bench-constrained.json" \
            --table "$out/bench-constrained.md" 2>&1 | grep -v '^bench'
        timeout 240 python3 benchmarks/constrained_parts.py --model qwen3.5-1.7b --batch 1,64 --out "$out" 2>&1 | grep -v Warn ;;
    constrained-later)
        # issue 31: the host's apply taken apart (diag/mask_apply.py), then the step with the masks
        # made ahead on the worker against made after it in the loop's thread (constrained_parts.py --later)
        timeout 40 python3 benchmarks/diag/mask_apply.py > "$out/mask-apply.txt" 2>&1; cat "$out/mask-apply.txt"
        timeout 150 python3 benchmarks/constrained_parts.py --model qwen3.5-1.7b --batch 1,64 --steps 24 --rounds 2 \
            --later > "$out/constrained-parts-later.txt" 2>&1; grep -E '^(##|free|constrained|later|the worker)' "$out/constrained-parts-later.txt" ;;
    serve-engine)
        # issue 30: the 64-client uniform workload fed to the engine loop alone, no HTTP (diag/serve_engine.py)
        timeout 240 python3 benchmarks/diag/serve_engine.py --spares 4,64 > "$out/serve-engine.txt" 2>&1; sed -n 1,40p "$out/serve-engine.txt" ;;
    syncs)
        # issue 30: where a pass of prompts waits for the device, and its profile (diag/syncs.py)
        timeout 300 python3 benchmarks/diag/syncs.py > "$out/syncs.txt" 2>&1; sed -n 1,30p "$out/syncs.txt" ;;
    chain)
        # the 1.68B shape at 1K and 8K with a step's kernels launched plain and as a chain
        # (HEBRUS_PDL=1: ops/cuda/chain.py), taking turns, 3 rounds each time; the chained
        # step's kernels; the GPU tests of the kernels that take part, chained
        for run in 0a 1a 0b 1b; do                  # taking turns, so that drift hits both alike
            HEBRUS_PDL=${run:0:1} timeout 120 python3 -m hebrus bench --model qwen3.5-1.7b --contexts 1024,8192 --rounds 3 \
                --cache /tmp/shapes --json "$out/bench-chain-$run.json" --table "$out/bench-chain-$run.md" 2>&1 | grep -v '^bench'
        done
        mkdir -p /tmp/chained
        HEBRUS_PDL=1 timeout 120 python3 benchmarks/decode_profile.py --model qwen3.5-1.7b --context 1024 --routes graph \
            --steps 30 --out /tmp/chained > /tmp/chained/decode-profile.log 2>&1
        head -1 /tmp/chained/kernels-*.txt; cp /tmp/chained/kernels-qwen3.5-1.7b.txt "$out/kernels-chained.txt"
        HEBRUS_PDL=1 timeout 300 python3 -m pytest -q -n ${HEBRUS_WORKERS:-4} -rfEs --tb=short -p no:logging -W ignore tests/test_cuda.py \
            -k "chain or gated_product or one_row_product or rotary or gdn_lanes or attention_lanes or graph_decode or sinkhorn or takes_the_fused" \
            > "$out/test-cuda-chained.txt" 2>&1
        tail -2 "$out/test-cuda-chained.txt" ;;
    profile)
        # a graph decode step of the 1.68B shape and of shakespeare: kernels in order, their times,
        # the host's Python; all in one archive
        mkdir -p /tmp/profiles
        timeout 150 python3 benchmarks/decode_profile.py --model qwen3.5-1.7b --context 1024 --routes graph --steps 30 \
            --out /tmp/profiles > /tmp/profiles/decode-profile-qwen.log 2>&1
        timeout 90 python3 benchmarks/decode_profile.py --model shakespeare --context 1024 --routes graph --steps 30 \
            --out /tmp/profiles > /tmp/profiles/decode-profile-shakespeare.log 2>&1
        head -qn1 /tmp/profiles/kernels-*.txt
        tar czf "$out/profiles.tgz" -C /tmp/profiles . ;;
    qsa)
        # issue 35: one QSA query's parts at 1K to 128K (benchmarks/qsa_layer.py), the selection
        # kernel set aside (diag/select_kernel.py) checked against its twin and timed beside the sort;
        # `long` is the whole decode against dense attention
        timeout 200 python3 benchmarks/qsa_layer.py --out "$out" 2>&1 | grep -v Warn | head -60 ;;
    quant-profile)
        # issue 35: where a quantized batch-1 step's time goes beside bf16's (graph route, kernels in
        # order, host Python), and the int4 product with its codes made from their bits
        mkdir -p /tmp/profiles
        for q in "" int8 int4; do
            timeout 150 python3 benchmarks/decode_profile.py --model qwen3.5-1.7b --context 1024 --routes graph \
                --steps 30 ${q:+--quantize $q} --out /tmp/profiles > "/tmp/profiles/decode-profile-qwen${q:+-$q}.log" 2>&1
        done
        head -qn1 /tmp/profiles/kernels-*.txt
        timeout 120 python3 benchmarks/diag/int4_bits.py --out "$out" 2>&1 | tail -6
        tar czf "$out/quant-profiles.tgz" -C /tmp/profiles . ;;
    step-alone)
        # issue 35: a quantized step timed alone, fed back to back, and through the bench's own procedure
        timeout 400 python3 benchmarks/diag/step_alone.py 2>&1 | grep -v Warn | tee "$out/step-alone.txt" ;;
    int4-bits)
        # issue 35: the int4 vector kernel beside designs that make a code's float from its bits
        # (diag/int4_bits.py: bits, grouped, and words: codes read as 32-bit words, centred as made)
        timeout 400 python3 benchmarks/diag/int4_bits.py --out "$out" 2>&1 | grep -v Warn | tail -7 ;;
    quant-kernels)
        # issue 35: kernel designs beside the module's: vector kernels whose threads sum their own
        # bytes (diag/quant_vectors.py), the matrix kernel turned around (diag/quant_matrix.py)
        timeout 240 python3 benchmarks/diag/quant_vectors.py --out "$out" 2>&1 | grep -v Warn | tail -14
        timeout 300 python3 benchmarks/diag/quant_matrix.py --out "$out" 2>&1 | grep -v Warn | tail -6 ;;
    copies)
        timeout 200 python3 benchmarks/copy_sites.py --model qwen3.5-1.7b > "$out/copy-sites-qwen3.5-1.7b.txt" 2>&1
        head -12 "$out/copy-sites-qwen3.5-1.7b.txt" ;;
    kernels)
        timeout 300 python3 benchmarks/decode_kernels.py --out "$out" 2>&1 | grep -v Warn
        timeout 120 python3 benchmarks/batch_profile.py --batch 64 --steps 10 --out "$out" 2>&1 | grep '^batch' ;;
    eager)
        timeout 300 python3 -m hebrus bench --model qwen3.5-1.7b --contexts 1024 --rounds 2 --decode eager \
            --cache /tmp/shapes --json "$out/bench-qwen3.5-1.7b-eager-decode.json" \
            --table "$out/bench-qwen3.5-1.7b-eager-decode.md" 2>&1 | grep -v '^bench' ;;
    parallel)
        for n in 1 $( [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && echo 2 ); do
            timeout 280 python3 -m hebrus bench --model qwen3.5-1.7b --contexts 1024,8192 --rounds 3 \
                --tensor-parallel $n --cache /tmp/shapes --json "$out/bench-qwen3.5-1.7b-tp$n.json" \
                --table "$out/bench-qwen3.5-1.7b-tp$n.md" 2>&1 | grep -v '^bench'
        done
        k=one_rank; [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && k="one_rank or equal_one"     # NCCL: a GPU a rank
        HEBRUS_DEVICE=cuda timeout 250 python3 -m pytest -q -x tests/test_parallel.py -k "$k" \
            > "$out/tests-parallel-cuda.txt" 2>&1; tail -3 "$out/tests-parallel-cuda.txt" ;;
    *)
        echo "unknown part $part" >&2; exit 2 ;;
    esac
    echo "== $part: $(( $(date +%s) - start )) s"
done
