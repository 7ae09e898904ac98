#!/usr/bin/env bash
# Every check that needs a GPU, in one run on one CUDA machine (a few minutes), each step under its own
# time limit and all of them under one deadline (DEADLINE seconds, 500 unless set), so one failure or
# hang does not hide the rest. Output: gpu_checks.log and the benchmarks' JSON in $OUT (or ./gpu-checks/).
#
#   python scripts/fetch_sglang.py      # once, where the network is: SGLang 0.5.23's Python source
#   bash scripts/gpu_checks.sh
#   BUNDLE=DIR bash scripts/gpu_checks.sh   # the loop-period comparison refining with that bundle (width 2048,
#                                           # block 32: tests/live/live_bundle.py writes one)
#
# Needs torch with CUDA, numpy, pyarrow, safetensors, typer, rich, onnx (no lightgbm: nothing here
# trains an admission model). SGLang's source is read from DWISE_SGLANG_SRC, else the fetch's cache.
#
# Steps: the hook under real CUDA graphs (scripts/gpu_smoke_hook.py, with the loop period against a
# pass-through); Amin et al.'s dispatch overhead on CUDA; the early signals' cost on CUDA; collect on
# CUDA against collect on the CPU (same requests: round counts and pooled first-round states); D2F
# collect on CUDA; the round-cost profile of the tiny model on CUDA.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu-checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.:tests${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
work=$(mktemp -d)

deadline=${DEADLINE:-500}
log=$out/gpu_checks.log
: >"$log"

step() {  # step NAME SECONDS COMMAND...: run under its limit (cut to the time left), log it, say how it ended
    local name=$1 limit=$2
    shift 2
    local left=$((deadline - SECONDS)) started=$SECONDS
    if ((left < 5)); then
        echo "== $name: not run (deadline)" | tee -a "$log"
        return
    fi
    echo "== $name" >>"$log"
    timeout "$((limit < left ? limit : left))" "$@" >>"$log" 2>&1
    echo "== $name: exit $? in $((SECONDS - started)) s" | tee -a "$log"
}

step environment 60 "$py" -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, \
torch.cuda.get_device_name())"
step gpu_smoke_hook 240 "$py" scripts/gpu_smoke_hook.py ${BUNDLE:+--bundle "$BUNDLE"}
step collect_cpu 60 "$py" -m dwise_predict.cli collect --out "$work/cpu" --limit 64 --device cpu
step collect_cuda 60 "$py" -m dwise_predict.cli collect --out "$work/cuda" --limit 64 --device cuda
step collect_compare 30 "$py" scripts/compare_traces.py "$work/cpu" "$work/cuda"
step dispatch_overhead 90 "$py" benchmarks/dispatch_overhead.py --device cuda --batches 1,2,4,8,16 \
    --json "$out/dispatch_overhead.json"
step signal_cost 30 "$py" benchmarks/signal_cost.py --device cuda
step collect_d2f_cuda 60 "$py" -m dwise_predict.cli collect --algorithm D2F --out "$work/d2f" --limit 32 --device cuda
step profile_rounds 60 "$py" -m dwise_predict.cli profile-rounds --device cuda --out "$out/tiny_cuda_profile.json"
rm -rf "$work"
tail -c 11000 "$log"
