"""The NVIDIA GPU check: the synthetic K3.1 and a tiny DeepSeek-V3.2 compiled for `cuda`, their logits
against the CPU module's (KL divergence, top-1 agreement) and their speed at depth 0 and 4096.

    python bench/gpu_check.py prepare WORKDIR [--arch sm_90]   # needs kimi-iree[compile] (+ transformers)
    python bench/gpu_check.py run WORKDIR                       # needs only the runtime and a CUDA GPU

`prepare` writes both checkpoints, compiles each for the CPU and for CUDA, and saves the CPU module's
logits on a fixed text (`kimi-run --perplexity --save-logits`); it also compiles the differential
suite's table (tests/test_backend_ops.py: every unit and block over its shapes) for CUDA, with the
eager reference's outputs. `run` scores the same text with the CUDA module against those logits
(`--kl-divergence`), benchmarks it (`--bench`) and runs the table on the GPU, writing
WORKDIR/report.json. The two halves can run on different machines (a GPU machine with no compiler:
copy WORKDIR); bench/gpu_check.sh runs both where it can.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

TEXT = ("Kimi Delta Attention keeps a matrix-valued memory per head and updates it with the delta rule, "
        "while DeepSeek sparse attention lets a lightning indexer score every earlier token and keeps only "
        "the best ones. The same PyTorch definition is exported to MLIR, rewritten by two passes and compiled "
        "by IREE for CPUs and for GPUs of every vendor; this check runs the CUDA module on an NVIDIA GPU and "
        "compares its logits, position by position, with the CPU module's on the same weights. ") * 2
MODELS = ("k3.1", "deepseek_v32")
MAX_CONTEXT = 4224                     # depth 4096 + 64 prompt + 32 generated tokens fit
DEPTHS = (0, 4096)


def sh(*args: str) -> str:
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(args[:3])} ...: {result.stderr.strip()[-2000:]}")
    return result.stdout


def write_checkpoints(work: Path) -> dict[str, Path]:
    from kimi_iree.frontend.synthetic import write_synthetic_checkpoint

    k31 = work / "k3.1-checkpoint"
    if not (k31 / "config.json").exists():
        write_synthetic_checkpoint(k31, variant="k3.1")
    dsv32 = work / "deepseek_v32-checkpoint"
    if not (dsv32 / "config.json").exists():
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from hf_checkpoints import write_hf_checkpoint      # transformers writes the published layout
        write_hf_checkpoint("deepseek_v32_issue16", dsv32)
    return {"k3.1": k31, "deepseek_v32": dsv32}


def prepare(work: Path, arch: str) -> None:
    work.mkdir(parents=True, exist_ok=True)
    (work / "text.txt").write_text(TEXT)
    for name, checkpoint in write_checkpoints(work).items():
        for target, target_arch in (("cpu", "x86-64-v3"), ("cuda", arch)):
            out = work / f"{name}-{target}"
            print(f"compile {name} for {target} {target_arch}", flush=True)
            sh("-m", "kimi_iree.driver.kimi_compile", str(checkpoint), "-o", str(out), "--target", target,
               "--arch", target_arch, "--max-context", str(MAX_CONTEXT), "--quiet")
        sh("-m", "kimi_iree.runtime.cli", str(work / f"{name}-cpu" / "model.vmfb"), "--perplexity",
           str(work / "text.txt"), "--save-logits", str(work / f"{name}-cpu-logits.npy"), "--json")
    print("compile the differential table for cuda", flush=True)
    prepare_table(work, arch)


TESTS = Path(__file__).resolve().parent.parent / "tests"


def prepare_table(work: Path, arch: str) -> None:
    """The differential table as one CUDA module, its inputs, weights and the eager outputs (tests/)."""
    import numpy as np

    sys.path.insert(0, str(TESTS))
    from backend_ops import Backend, compile_cases, export
    from test_backend_ops import TABLE

    table = work / "table"
    table.mkdir(exist_ok=True)
    cases = [row.case() for row in TABLE]
    mlir, weights = export(cases)
    vmfb, fallback = compile_cases(mlir, Backend(f"cuda-{arch}", "cuda", arch, True, driver="cuda"))
    (table / "module.vmfb").write_bytes(vmfb)
    np.savez(table / "weights.npz", **weights)
    np.savez(table / "inputs.npz", **{f"{i}_{j}": t.numpy() for i, c in enumerate(cases) for j, t in enumerate(c.inputs)})
    np.savez(table / "references.npz", **{f"{i}_{j}": a for i, c in enumerate(cases) for j, a in enumerate(c.reference())})
    (table / "rows.json").write_text(json.dumps([{"id": r.id, "case": c.name, "tolerance": c.tolerance,
                                                  "fallback": fallback} for r, c in zip(TABLE, cases)], indent=1))


def run_table(work: Path) -> list[dict]:
    """Run the prepared table on the GPU (tests/backend_worker.py) and compare with the references."""
    import numpy as np

    table = work / "table"
    rows = json.loads((table / "rows.json").read_text())
    result = subprocess.run([sys.executable, str(TESTS / "backend_worker.py"), str(table), "cuda", str(len(rows))],
                            capture_output=True, text=True)
    if result.returncode != 0:
        return [{"error": result.stderr.strip()[-2000:]}]
    outputs, references = np.load(table / "outputs.npz"), np.load(table / "references.npz")
    for i, row in enumerate(rows):
        errors = []
        for key in (k for k in references.files if k.startswith(f"{i}_")):
            got, want = outputs[key].astype(np.float64), references[key]
            ok = got.shape == want.shape and np.isfinite(got).all()
            errors.append(float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)) if ok else float("inf"))
        row["error"] = max(errors)
        row["ok"] = row["error"] <= row["tolerance"]
        print(f"table {row['id']}: {row['error']:.1e} {'ok' if row['ok'] else 'FAILED'}", flush=True)
    return rows


def run(work: Path) -> dict:
    report = {"models": {}}
    for name in MODELS:
        module = str(work / f"{name}-cuda" / "model.vmfb")
        entry = json.loads(sh("-m", "kimi_iree.runtime.cli", module, "--perplexity", str(work / "text.txt"),
                              "--kl-divergence", str(work / f"{name}-cpu-logits.npy"), "--json"))
        entry["bench"] = [json.loads(sh("-m", "kimi_iree.runtime.cli", module, "--bench", "--depth", str(depth),
                                        "--prompt-tokens", "64", "--gen-tokens", "32", "--json"))
                          for depth in DEPTHS]
        entry["manifest_fallbacks"] = json.loads((work / f"{name}-cuda" / "model.json").read_text())["module"][
            "fallbacks"]
        report["models"][name] = entry
    if (work / "table" / "rows.json").exists():
        report["table"] = run_table(work)
        print(f"{name}: KL mean {entry['kl_mean']:.2e} max {entry['kl_max']:.2e}, top-1 "
              f"{entry['top1_agreement']:.3f}, logits {entry['max_logit_error']:.1e} of max; "
              + ", ".join(f"depth {b['depth']}: prefill {b['prefill_tokens_per_s']:.0f} tok/s, decode "
                          f"{b['decode_tokens_per_s']:.0f} tok/s" for b in entry["bench"]), flush=True)
    try:
        report["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True).stdout.strip()
    except OSError:
        report["gpu"] = None
    (work / "report.json").write_text(json.dumps(report, indent=1))
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stage", choices=["prepare", "run"])
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--arch", default="sm_90", help="cuda architecture (sm_90 for H100/H200)")
    args = ap.parse_args()
    if args.stage == "prepare":
        prepare(args.workdir, args.arch)
    else:
        run(args.workdir)


if __name__ == "__main__":
    main()
