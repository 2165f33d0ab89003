#!/usr/bin/env bash
# GPU smoke test: on one CUDA GPU, runs the embedded tiny pair through the paths a CPU cannot check and prints one
# PASS / FAIL / SKIP line each. Usage, from the repository root:
#
#     bash scripts/gpu_smoke.sh
#
# Needs the package's dependencies (`pip install -e ".[test,deepspeed]"`). On a machine without network, put wheels of
# what is missing (trl, datasets, math-verify, deepspeed and their dependencies) in `.whl/`: they are installed into a
# scratch folder first. vLLM is checked only when it is installed.
set -uo pipefail
cd "$(dirname "$0")/.."

if ! python3 -c "import trl, datasets, math_verify, deepspeed" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tvopd-site .whl/*.whl
    export PYTHONPATH="/tmp/tvopd-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
nvidia-smi -L
python3 -c "import torch, triton, trl, transformers, deepspeed; print(f'torch {torch.__version__}, triton {triton.__version__}, trl {trl.__version__}, transformers {transformers.__version__}, deepspeed {deepspeed.__version__}')"

failures=0
check() {  # check NAME TEST-NODE: one pytest node of tests/test_gpu.py
    local log
    log=$(mktemp)
    if python3 -m pytest "tests/test_gpu.py::$2" -q -p no:cacheprovider >"$log" 2>&1; then
        echo "PASS  $1"
    else
        echo "FAIL  $1"
        tail -25 "$log" | sed 's/^/      /'
        failures=$((failures + 1))
    fi
}
check "transformers generate in bf16 with autocast" test_bf16_autocast_generation_keeps_the_teacher_accurate
check "TV-OPD training in bf16 (float32 log-probs)" test_cuda_bf16_training_keeps_float32_log_probs
check "TRL Triton fused log-prob head" test_fused_lm_head_runs_trls_triton_kernels_and_matches_float32_log_softmax
check "DeepSpeed ZeRO-3, one process" test_single_gpu_deepspeed_zero3_trains_partitions_and_saves_a_loadable_model

if python3 -c "import vllm" 2>/dev/null; then
    out=$(mktemp -d)
    if python3 -m tvopd_trl.scripts.train --config recipes/tiny/tvopd.yaml --output_dir "$out" --use_cpu false \
        --bf16 true --max_steps 20 --use_vllm true --vllm_mode colocate >"$out/log" 2>&1; then
        echo "PASS  vLLM colocate rollouts (main job, 20 steps)"
    else
        echo "FAIL  vLLM colocate rollouts"
        tail -25 "$out/log" | sed 's/^/      /'
        failures=$((failures + 1))
    fi
else
    echo "SKIP  vLLM rollouts (vLLM is not installed)"
fi
echo "$failures failed"
exit $((failures > 0))
