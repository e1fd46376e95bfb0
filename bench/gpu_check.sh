#!/usr/bin/env bash
# The NVIDIA GPU check (bench/gpu_check.py): CUDA modules of the synthetic K3.1 and a tiny DeepSeek-V3.2
# against the CPU module's logits, and their speed at depth 0 and 4096; writes WORKDIR/report.json.
#
#   bench/gpu_check.sh [WORKDIR]        on a machine with an NVIDIA GPU and the package registry:
#                                       installs kimi-iree[compile,test] in .venv, prepares, runs
#   bench/gpu_check.sh --run WORKDIR [WHEELS]
#                                       on a GPU machine without the compiler or a registry: WORKDIR made
#                                       by `python bench/gpu_check.py prepare WORKDIR` elsewhere, the
#                                       iree-base-runtime wheel (and others missing there) in WHEELS
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"

if [[ "${1:-}" == "--run" ]]; then
  work="$2"; wheels="${3:-}"
  site=/tmp/kimi-gpu-check-site
  if [[ -n "$wheels" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl
  fi
  # the runtime needs no install: kimi_iree.runtime is the repository's runtime/ folder
  mkdir -p "$site/kimi_iree"
  ln -sfn "$repo/runtime" "$site/kimi_iree/runtime"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  exec python3 "$repo/bench/gpu_check.py" run "$work"
fi

work="${1:-/tmp/kimi-gpu-check}"
cd "$repo"
make .venv/.installed-test >/dev/null
.venv/bin/python bench/gpu_check.py prepare "$work"
.venv/bin/python bench/gpu_check.py run "$work"
