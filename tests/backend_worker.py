"""Runs one compiled case in a fresh process (tests/backend_ops.py `run_in_subprocess`), so that
settings a driver reads once per process (lavapipe's LP_NATIVE_VECTOR_WIDTH) can differ per run.

    python backend_worker.py DIR DRIVER N   DIR: module.vmfb, weights.npz, inputs.npz -> outputs.npz
                                            (arrays "{case}_{index}" for cases 0..N-1)
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from backend_ops import run_module  # noqa: E402


def main(directory: str, driver: str, cases: str) -> None:
    d = Path(directory)
    weights = dict(np.load(d / "weights.npz"))
    stored = np.load(d / "inputs.npz")
    inputs = [[stored[f"{i}_{j}"] for j in range(sum(k.startswith(f"{i}_") for k in stored.files))]
              for i in range(int(cases))]
    outputs = run_module((d / "module.vmfb").read_bytes(), weights, inputs, driver)
    np.savez(d / "outputs.npz", **{f"{i}_{j}": a for i, outs in enumerate(outputs) for j, a in enumerate(outs)})


if __name__ == "__main__":
    main(*sys.argv[1:])
