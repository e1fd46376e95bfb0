"""kimi-iree against llama.cpp on the same weights, side by side in one run (the scoreboard of issue 18).

llama.cpp comes from the llama-cpp-python 0.3.36 source distribution (its vendored llama.cpp of
2026-10-01 has Kimi-K3 and DeepSeek-V3.2's sparse attention, not K3.1's indexer): downloaded with pip,
built once (cmake Release, GGML_NATIVE=ON for the host, or the x86-64-v3 ISA flags for --arch
x86-64-v3; curl, tests, examples and server off) and cached under ~/.cache/kimi-iree/. Its
`convert_hf_to_gguf.py` converts the two bench models with `--outtype bf16` (MXFP4 experts stay MXFP4):

  k3      the project's bench-size synthetic K3 (hidden 1024, 8 layers = 6 KDA + 2 MLA, 32 MXFP4
          experts top-4 in a 512-wide latent, vocab 32768, bf16 elsewhere; no MTP layer)
  dsv32   a bench-size DeepSeek-V3.2 written with transformers (hidden 1024, 4 layers, 16 heads,
          kv_lora 512, rope 64, indexer 16 x 128, index_topk 512, 32 bf16 experts top-4)

Both sides are timed with the same thread count, alternating round by round: `llama-bench -p P -n G
-d DEPTH -t T` against kimi-run --bench's code path (`kimi_iree.runtime.cli.bench`, depth D, P prompt
tokens, G generated). Median tokens/s and the ratio ours / llama.cpp are printed; JSON goes to
bench/results/vs_llamacpp[-ARCH].json.

The converter's quirks, handled here: it needs a GPT-2 byte-level BPE tokenizer with at least one merge
and identifies pre-tokenizers by a hash (it is run with `get_vocab_base_pre` returning "gpt-2"); its K3
path rejects MXFP4 tensors outside `model.layers.N` (the MTP layer is left out of its copy); its
DeepSeek-V3.2 vocab step asserts `add_bos_token`, which transformers 5 no longer exposes
(`_set_vocab_gpt2` is called directly); its DeepSeek-V3.2 loader wants `scoring_func: "sigmoid"`.

    python bench/vs_llamacpp.py [--models k3,dsv32] [--depths 0] [--arch host|x86-64-v3] [--rounds 3]
                                [--bf16-activations]

`--bf16-activations` compiles ours with that kimi-compile flag (lossy: the bf16 matmuls' rows rounded to
bf16 for AVX512-BF16 dot products, as llama.cpp's CPU backend does; results in
vs_llamacpp[-ARCH]-bf16-activations.json); the default compares our exact form.

The memory floor (depth 0 rows): each round also times a plain read of 256 MiB on the same threads
(bench/read_bandwidth.c, built once with `cc -O3 -march=native`), and a side's decode is given as a
fraction of that round's floor, bandwidth / the bytes a step must read (`bench/decode.py`
`decode_bytes`: every weight but the unselected experts and all but one embedding row, and the state;
the GGUF holds the same weights). Past depth 0 the bytes differ by side (llama.cpp reads the whole
cache, our sparse attention the selected rows), so no floor is given there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))         # the bench's own modules, run as a script or not
from decode import decode_bytes                           # noqa: E402

VERSION = "0.3.36"
CACHE = Path(os.environ.get("KIMI_CACHE", Path.home() / ".cache" / "kimi-iree")) / f"llama-cpp-python-{VERSION}"
# GGML's per-ISA switches for an x86-64-v3 (AVX2) build, as the issue compares like with like
ISA_FLAGS = {"host": ["-DGGML_NATIVE=ON"],
             "x86-64-v3": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                           "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF"]}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- llama.cpp
def llama_cpp_source() -> Path:
    """The vendored llama.cpp of the llama-cpp-python sdist (downloaded and unpacked once)."""
    src = CACHE / "src"
    tree = src / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if tree.exists():
        return tree
    CACHE.mkdir(parents=True, exist_ok=True)
    log(f"downloading llama-cpp-python {VERSION} (sdist)")
    subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={VERSION}", "--no-deps",
                    "--no-binary", ":all:", "-d", str(CACHE), "-q"], check=True)
    tmp = CACHE / "src.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(next(CACHE.glob(f"llama_cpp_python-{VERSION}.tar.gz"))) as tar:
        tar.extractall(tmp, filter="data")
    os.replace(tmp, src)
    return tree


def llama_bench(arch: str) -> Path:
    """llama-bench built for `arch` (about 10 minutes on 2 cores, once)."""
    tree = llama_cpp_source()
    build = CACHE / f"build-{arch}"
    binary = build / "bin" / "llama-bench"
    if binary.exists():
        return binary
    log(f"building llama-bench ({arch}) in {build}")
    subprocess.run(["cmake", "-S", str(tree), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    *ISA_FLAGS[arch], "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-bench", "-j", str(os.cpu_count() or 2)],
                   check=True, stdout=subprocess.DEVNULL)
    return binary


CONVERT = """
import runpy, sys
tree = sys.argv[1]
sys.path.insert(0, tree)
sys.argv = [tree + "/convert_hf_to_gguf.py", *sys.argv[2:]]
import conversion.base as base
from conversion.deepseek import DeepseekV32Model
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
DeepseekV32Model.set_vocab = lambda self: self._set_vocab_gpt2()
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def to_gguf(checkpoint: Path, out: Path) -> Path:
    """convert_hf_to_gguf.py --outtype bf16 on a copy of the checkpoint shaped for its quirks."""
    if out.exists():
        return out
    from safetensors.torch import load_file, save_file

    staging = out.parent / f"{out.stem}-hf"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    index_file = checkpoint / "model.safetensors.index.json"
    files = sorted({*json.loads(index_file.read_text())["weight_map"].values()}) if index_file.exists() else \
        ["model.safetensors"]
    weight_map = {}
    for name in files:                                  # the MTP layer out (the K3 path rejects it)
        tensors = {k: v for k, v in load_file(checkpoint / name).items() if ".mtp." not in k}
        save_file(tensors, str(staging / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    if index_file.exists():
        (staging / index_file.name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((checkpoint / "config.json").read_text())
    if config.get("model_type") == "deepseek_v32":
        config["scoring_func"] = "sigmoid"
    (staging / "config.json").write_text(json.dumps(config, indent=1))
    # one merge: id 256 (a placeholder in our byte-level vocabulary) becomes "ab"
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    placeholder = next(t for t, i in vocab.items() if i == 256)
    vocab["ab"] = vocab.pop(placeholder)
    tokenizer["model"]["merges"] = [["a", "b"]]
    (staging / "tokenizer.json").write_text(json.dumps(tokenizer))
    tc = json.loads((checkpoint / "tokenizer_config.json").read_text())
    tc.update(add_bos_token=True, tokenizer_class="PreTrainedTokenizerFast")
    (staging / "tokenizer_config.json").write_text(json.dumps(tc))
    tmp = out.with_suffix(".partial")
    log(f"converting {checkpoint.name} to GGUF (bf16)")
    done = subprocess.run([sys.executable, "-c", CONVERT, str(llama_cpp_source()), str(staging), "--outtype", "bf16",
                           "--outfile", str(tmp)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: convert_hf_to_gguf.py failed on {staging}:\n{done.stderr[-3000:]}")
    os.replace(tmp, out)
    shutil.rmtree(staging)
    return out


def time_llama(binary: Path, gguf: Path, threads: int, depth: int, prompt: int, gen: int) -> dict:
    out = subprocess.run([str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(gen),
                          "-d", str(depth), "-r", "1", "-o", "json"], check=True, capture_output=True, text=True)
    runs = json.loads(out.stdout)
    speed = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in runs}
    return {"prefill_tokens_per_s": speed["prefill"], "decode_tokens_per_s": speed["decode"]}


def read_bandwidth_tool() -> Path:
    """bench/read_bandwidth.c, built once per source version under the cache."""
    source = Path(__file__).with_name("read_bandwidth.c")
    binary = CACHE.parent / f"read_bandwidth-{hashlib.sha256(source.read_bytes()).hexdigest()[:12]}"
    if not binary.exists():
        binary.parent.mkdir(parents=True, exist_ok=True)
        partial = binary.with_suffix(".partial")
        subprocess.run([os.environ.get("CC", "cc"), "-O3", "-march=native", "-pthread", str(source), "-o", str(partial)],
                       check=True)
        os.replace(partial, binary)
    return binary


def read_gbs(tool: Path, threads: int) -> float:
    """GB/s of a plain read on `threads` threads, now."""
    return float(subprocess.run([str(tool), str(threads)], check=True, capture_output=True, text=True).stdout)


# ------------------------------------------------------------------------------------- ours
def checkpoints(workdir: Path, models: list[str]) -> dict[str, Path]:
    found = {}
    if "k3" in models:
        ckpt = workdir / "k3"
        if not (ckpt / "config.json").exists():
            from kimi_iree.frontend.synthetic import write_synthetic_checkpoint
            write_synthetic_checkpoint(ckpt, variant="k3", num_layers=8, size="bench")
        found["k3"] = ckpt
    if "dsv32" in models:
        ckpt = workdir / "dsv32"
        if not (ckpt / "config.json").exists():
            from block_scaled import write_bench_deepseek_v32
            write_bench_deepseek_v32(workdir / "dsv32-fp8", ckpt)        # the bf16 twin is the bench model
        found["dsv32"] = ckpt
    return found


def compile_ours(checkpoint: Path, out: Path, arch: str, max_context: int, extra: list[str]) -> Path:
    """Always rebuilt (a module left from an earlier checkout would time that checkout's code)."""
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kimi_iree.driver.kimi_compile", str(checkpoint), "--target", "cpu",
                    "--arch", arch, "-o", str(out), "--max-context", str(max_context), "--quiet", *extra], check=True)
    log(f"compiled {out.name} in {time.perf_counter() - t:.0f} s")
    return out


def time_ours(out: Path, depth: int, prompt: int, gen: int) -> dict:
    from kimi_iree.runtime import Session
    from kimi_iree.runtime.cli import bench
    r = bench(Session(out), argparse.Namespace(depth=depth, prompt_tokens=prompt, gen_tokens=gen, seed=0,
                                               warmup=True))
    return {k: r[k] for k in ("prefill_tokens_per_s", "decode_tokens_per_s")}


# ---------------------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="k3,dsv32")
    ap.add_argument("--depths", default="0")
    ap.add_argument("--arch", choices=sorted(ISA_FLAGS), default="host")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--workdir", default="/tmp/kimi-vs-llamacpp")
    ap.add_argument("--bf16-activations", action="store_true",
                    help="compile ours with kimi-compile --bf16-activations (lossy; AVX512-BF16 CPUs)")
    ap.add_argument("--json", help="results file name in bench/results (default vs_llamacpp[-ARCH][-bf16-activations].json)")
    args = ap.parse_args()
    models, depths = args.models.split(","), [int(d) for d in args.depths.split(",")]
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    binary = llama_bench(args.arch)
    reader = read_bandwidth_tool()
    ckpts = checkpoints(work, models)
    max_context = max(depths) + args.prompt_tokens + args.gen_tokens
    extra, mode = (["--bf16-activations"], "-bf16-activations") if args.bf16_activations else ([], "")
    pairs = {m: (to_gguf(c, work / f"{m}.gguf"), compile_ours(c, work / f"out-{m}-{args.arch}{mode}", args.arch,
                                                               max_context, extra))
             for m, c in ckpts.items()}
    rows = []
    for model, (gguf, out) in pairs.items():
        for depth in depths:
            runs, bandwidth = {"ours": [], "llama.cpp": []}, []
            for _ in range(args.rounds):               # alternating: the machine may be shared
                bandwidth.append(read_gbs(reader, args.threads))
                runs["llama.cpp"].append(time_llama(binary, gguf, args.threads, depth, args.prompt_tokens,
                                                    args.gen_tokens))
                runs["ours"].append(time_ours(out, depth, args.prompt_tokens, args.gen_tokens))
            med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
            row = {"model": model, "depth": depth, "median": med, "runs": runs, "read_gb_per_s": bandwidth,
                   "decode_ratio": med["ours"]["decode_tokens_per_s"] / med["llama.cpp"]["decode_tokens_per_s"],
                   "prefill_ratio": med["ours"]["prefill_tokens_per_s"] / med["llama.cpp"]["prefill_tokens_per_s"],
                   "gguf_bytes": gguf.stat().st_size, "irpa_bytes": (out / "model.irpa").stat().st_size}
            floor = ""
            if depth == 0:
                step = decode_bytes(json.loads((out / "model.json").read_text()), 0)
                row["decode_bytes"] = step
                row["of_floor"] = {side: statistics.median(r["decode_tokens_per_s"] * step / (gbs * 1e9)
                                                           for r, gbs in zip(rs, bandwidth))
                                   for side, rs in runs.items()}
                floor = (f"; of the memory floor {100 * row['of_floor']['ours']:.0f}% vs "
                         f"{100 * row['of_floor']['llama.cpp']:.0f}%")
            rows.append(row)
            log(f"{model} depth {depth}: decode {med['ours']['decode_tokens_per_s']:.1f} vs "
                f"{med['llama.cpp']['decode_tokens_per_s']:.1f} tok/s ({row['decode_ratio']:.2f}x), prefill "
                f"{med['ours']['prefill_tokens_per_s']:.1f} vs {med['llama.cpp']['prefill_tokens_per_s']:.1f} "
                f"({row['prefill_ratio']:.2f}x){floor}")
    print(f"\nkimi-iree{' --bf16-activations' if args.bf16_activations else ''} vs llama.cpp {VERSION} "
          f"({args.arch} builds, {args.threads} threads, prompt "
          f"{args.prompt_tokens}, generated {args.gen_tokens}, median of {args.rounds} alternating rounds)\n")
    print("| model | depth | ours decode | llama.cpp decode | ratio | ours prefill | llama.cpp prefill | ratio "
          "| decode of the memory floor (ours / llama.cpp) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        o, ll = r["median"]["ours"], r["median"]["llama.cpp"]
        floor = (f"{100 * r['of_floor']['ours']:.0f}% / {100 * r['of_floor']['llama.cpp']:.0f}% "
                 f"({statistics.median(r['read_gb_per_s']):.0f} GB/s, {r['decode_bytes'] / 1e6:.0f} MB a step)"
                 if "of_floor" in r else "-")
        print(f"| {r['model']} | {r['depth']} | {o['decode_tokens_per_s']:.1f} | {ll['decode_tokens_per_s']:.1f} "
              f"| **{r['decode_ratio']:.2f}x** | {o['prefill_tokens_per_s']:.1f} | {ll['prefill_tokens_per_s']:.1f} "
              f"| **{r['prefill_ratio']:.2f}x** | {floor} |")
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    name = args.json or ("vs_llamacpp" + ("" if args.arch == "host" else f"-{args.arch}") + mode + ".json")
    (results / name).write_text(json.dumps({"arch": args.arch, "threads": args.threads,
                                            "bf16_activations": args.bf16_activations, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
