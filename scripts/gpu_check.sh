#!/usr/bin/env bash
# The GPU checks, as one short run (about 7 minutes on one H200): the CUDA tests (tree masks
# through sdpa and eager in fp32 and bf16, greedy output equal to the base's for every drafter,
# lossless sampling, bf16 partings only at near-ties), then scripts/bench_verify.py on random
# weights: Llama-3-8B's shape in bf16 and fp32, and SmolLM2-135M's shape in bf16.
#
#   bash scripts/gpu_check.sh [OUT_DIR]     # default: $OUT, else runs/gpu-check
#
# Writes OUT_DIR/check.log and OUT_DIR/NAME/verify.{json,md} per benchmark. Run it from the
# repository root after `pip install -e '.[dev]'` (or with PYTHONPATH=. where torch with CUDA,
# transformers 5.x and pytest are already installed); nothing is downloaded (random weights).
set -uo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
out=${1:-${OUT:-runs/gpu-check}}
python=${PYTHON:-python3}
if ! cuda=$("$python" -c 'import torch; print(torch.cuda.is_available())'); then
    echo "gpu_check: $python cannot import torch: set PYTHON to the environment's python" >&2
    exit 2
elif [[ $cuda != True ]]; then  # else 8B models of random weights would be built on the CPU
    echo "gpu_check: torch sees no CUDA device here; run it on a machine with one" >&2
    exit 2
fi
export PYTHONUNBUFFERED=1 TQDM_DISABLE=${TQDM_DISABLE:-1}  # no progress bars in the log
mkdir -p "$out"

bench() { # NAME ARGS...: one bench_verify run into $out/NAME
    local name=$1
    shift
    echo "== $name"
    "$python" scripts/bench_verify.py --out "$out/$name" "$@"
}

{
    status=0
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
    "$python" -m pytest -m gpu tests/gpu -q -p no:cacheprovider || status=1
    bench llama3-8b-bf16 --device cuda --base random:llama3-8b --dtype bf16 --prompts 4 || status=1
    bench llama3-8b-fp32 --device cuda --base random:llama3-8b --dtype fp32 --sizes 1,8,32,64 --repeats 10 \
        --prompts 2 --shapes 0x1,4x1,6x10 || status=1
    bench smollm2-135m-bf16 --device cuda --base random:smollm2-135m --dtype bf16 --prompts 4 || status=1
    exit $status
} 2>&1 | tee "$out/check.log"
exit "${PIPESTATUS[0]}"
