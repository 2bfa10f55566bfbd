#!/usr/bin/env bash
# One call on a lent GPU host (docs/gpu-campaign.md): install the carried wheels, preflight, run the campaign rows
# given (default: the headline set, then whatever fits) within the call, and pack every result into $OUT as ONE
# archive (a loan returns at most 8 files): results.tgz holds benchmarks/results (CSVs, PNGs, ledger, summary,
# failed rows' tails) and the per-row logs; campaign.log beside it.
#
#   GRPO_ACCEL_GIT_SHA=<sha> bash benchmarks/campaign/loan.sh [CALL_S] [campaign flags...]
#
# CALL_S (default 590): the seconds this call may take in all. The campaign gets what is left after the install
# and the preflight, less 30 s for packing; a hard `timeout` stops it 15 s before CALL_S so the archive is always
# written (a row cut short is recorded as timed out by the ledger's next call; its finished variants are in the CSV).
set -uo pipefail
call_s=${1:-590}; shift || true
out=${OUT:-/tmp/grpo_accel_loan}; mkdir -p "$out"
log=$out/campaign.log
mkdir -p /tmp/loan_results /tmp/loan_logs
pack() { tar czf "$out/.results.tgz" -C /tmp loan_results loan_logs 2>/dev/null && mv "$out/.results.tgz" "$out/results.tgz"; }
# every 20 s, so a call cut short by the loan's end still returns what was measured
( while sleep 20; do pack; done ) & packer=$!
{
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site
  # vLLM 0.26 from the bundle's three calls (receive.sh install puts it there): our wheels beside it are one set
  # (benchmarks/campaign/loan_wheels.sh --with-bundle); flashinfer is not in the bundle, so not its sampler
  if [ -d /root/vllm_site ]; then export PYTHONPATH=$PYTHONPATH:/root/vllm_site VLLM_USE_FLASHINFER_SAMPLER=0; fi
  # loan_wheels.sh --with-bundle leaves pydantic to the bundle: on a machine without it DeepSpeed (which transformers
  # imports when installed) fails every row (H200, 2026-11-28: a fresh machine after the bundle's went back)
  if ! python3 -c "import pydantic" 2> /dev/null; then
    echo "error: no pydantic here (DeepSpeed needs it): no vLLM bundle on this machine and none in .whl. Fix: build" \
         "the set without --with-bundle (benchmarks/campaign/loan_wheels.sh), or make the bundle's three calls first"
    exit 1
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 benchmarks/campaign/run.py --preflight
  budget=$((call_s - SECONDS - 30))
  echo "[loan] campaign budget ${budget} s (call ${call_s} s, ${SECONDS} s used)"
  timeout --kill-after=5 $((call_s - SECONDS - 15)) \
    python3 benchmarks/campaign/run.py --budget-s "$budget" --mirror /tmp/loan_results --logs /tmp/loan_logs "$@"
  echo "[loan] campaign exit $?, ${SECONDS} s"
} 2>&1 | tee "$log"
kill $packer 2>/dev/null; pack
ls -la "$out"
