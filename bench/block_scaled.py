"""Published block-scaled weights (issue 19), side by side in one run on the IREE cpu target
(--iree-opt-level=O3, target-cpu=host, local-task), every form built as kimi-compile builds a model
(torch module -> torch_mlir -> kimi_iree.passes -> iree-compile):

  matvec    one token through an [N, K] weight held four ways: FP8 E4M3 with 128x128 f32 block scales
            (the fused unit, torch.ops.kimi.weight_batched_matmul fmt fp8_e4m3_b128: how an FP8 linear of
            DeepSeek-V3.2 / Kimi-K2 runs), INT4 with bf16 scales per 32 (torch.ops.kimi.weight_expert_matmul
            fmt int4_g32: how a K2.5 routed expert runs), a bf16 weight (frontend/layers.Linear: widened to
            f32 at use) and an f32 weight. Weights from DRAM: each call reads the next of distinct copies
            >= 4x the L3 (bench/mxfp4_matmul.py's method), and cached (the same copy every call).
  decode    a bench-size DeepSeek-V3.2 (hidden 1024, 4 layers, 16 heads, kv_lora 512, rope 64, indexer
            16 x 128, index_topk 512, 32 experts top-4, vocab 32768) written in the published FP8 layout
            (ue8m0 scales, every linear FP8 as DeepSeek ships it) and the same weights widened to bf16
            (exact: an E4M3 value times a power of two is a bf16 value), both compiled with defaults,
            timed by kimi-run --bench's code path, alternating.

Every compiled matvec is checked against a float64 reference (1e-5 of max|reference|) before timing.

    python bench/block_scaled.py [--rounds 4] [--reps 5] [--skip-decode] [--workdir /tmp/kimi-bench-fp8]

Prints markdown tables and writes bench/results/block_scaled.json.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mxfp4_matmul import FLAGS, Form, Runner, check, compile_form, copies_for, machine, time_forms

from kimi_iree.frontend import units
from kimi_iree.frontend.formats import FORMATS
from kimi_iree.frontend.layers import widen_to_f32

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from hf_checkpoints import fp8_block_quantize, int4_group_quantize  # noqa: E402

SHAPES = [(2048, 2048), (4096, 1024), (1024, 4096), (7168, 2048)]          # (N, K) = (out, in)
DECODE_ROUNDS, PROMPT, GEN = 3, 32, 32


class FP8Linear(torch.nn.Module):
    """An FP8 linear as the model holds it: the one-expert batched unit."""

    def forward(self, x, packed, scales):
        return units.weight_batched_matmul(x=x[:, None], packed=packed[None], scales=scales[None],
                                           fmt="fp8_e4m3_b128", fused=True)[:, 0]


class Int4Expert(torch.nn.Module):
    """A routed INT4 expert at decode: the expert unit, one token through expert 0."""

    def forward(self, x, packed, scales, experts):
        return units.weight_expert_matmul(x=x[:, None], packed=packed, scales=scales, experts=experts,
                                          fmt="int4_g32", fused=True)[:, 0]


class Dense(torch.nn.Module):
    """frontend/layers.Linear's computation: the stored weight (f32 or bf16) widened to f32 at use."""

    def forward(self, x, weight):
        return F.linear(x, widen_to_f32(weight))


def upload(runner: Runner, tensors: list[torch.Tensor]) -> list:
    """Device copies; bf16 goes as its int16 bytes (numpy has no bfloat16) in a buffer view typed bf16
    (iree.runtime.asdevicearray ignores its element_type argument in 3.13, so the allocator is called)."""
    rt, out = runner.rt, []
    for t in tensors:
        if t.dtype != torch.bfloat16:
            out += runner.upload([t])
            continue
        view = runner.device.allocator.allocate_buffer_copy(
            memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=rt.BufferUsage.DEFAULT, device=runner.device,
            buffer=t.view(torch.int16).numpy().copy(), element_type=rt.HalElementType.BFLOAT_16)
        out.append(rt.DeviceArray(runner.device, view, override_dtype=np.int16))
    return out


def matvec_case(runner: Runner, N: int, K: int, l3: int, rounds: int, reps: int) -> dict:
    g = torch.Generator().manual_seed(N * 7 + K)
    x = torch.randn(1, K, generator=g)
    w = torch.randn(N, K, generator=g) / math.sqrt(K)
    codes, scale_inv = fp8_block_quantize(w, ue8m0=True)
    fp8 = codes.view(torch.uint8)
    int4, int4_scales = int4_group_quantize(w)
    int4, int4_scales = int4[None], int4_scales[None]
    experts = torch.zeros(1, 1, dtype=torch.int64)
    bf16 = w.to(torch.bfloat16)
    x64 = x.double()
    want = {"fp8": x64 @ FORMATS["fp8_e4m3_b128"].dequantize(fp8, scale_inv, K).double().t(),
            "int4": x64 @ FORMATS["int4_g32"].dequantize(int4, int4_scales, K)[0].double().t(),
            "bf16": x64 @ bf16.double().t(), "f32": x64 @ w.double().t()}
    started = time.time()
    mains = {"fp8": runner.load(compile_form(FP8Linear(), [x, fp8, scale_inv], 1)),
             "int4": runner.load(compile_form(Int4Expert(), [x, int4, int4_scales, experts], 1)),
             "bf16": runner.load(compile_form(Dense(), [x, bf16], 0)),
             "f32": runner.load(compile_form(Dense(), [x, w], 0))}
    compile_s = time.time() - started
    weights = {"fp8": [fp8, scale_inv], "int4": [int4, int4_scales], "bf16": [bf16], "f32": [w]}
    dx, dexperts = runner.upload([x, experts])
    tail = {"int4": [dexperts]}
    forms, errors, nbytes = {}, {}, {}
    for name, main in mains.items():
        nbytes[name] = sum(t.numel() * t.element_size() for t in weights[name])
        copies = [upload(runner, weights[name]) for _ in range(copies_for(nbytes[name], l3))]
        errors[name] = check(f"{name} {N}x{K}", main(dx, *copies[0], *tail.get(name, [])).to_host(), want[name])
        forms[name] = Form(main, [[dx, *copies[0], *tail.get(name, [])]])
        forms[f"{name}_dram"] = Form(main, [[dx, *c, *tail.get(name, [])] for c in copies])
    t = time_forms(forms, rounds, reps)
    row = dict(N=N, K=K, compile_s=compile_s, bytes=nbytes, max_rel_error=errors,
               **{k: v for k, v in t.items()})
    med = {k: v["median_ms"] for k, v in t.items()}
    for q in ("fp8", "int4"):
        row[f"bf16_over_{q}_dram"] = med["bf16_dram"] / med[f"{q}_dram"]
        row[f"f32_over_{q}_dram"] = med["f32_dram"] / med[f"{q}_dram"]
    print(f"{N}x{K}: DRAM fp8 {med['fp8_dram']:.3f}  int4 {med['int4_dram']:.3f}  bf16 {med['bf16_dram']:.3f}  "
          f"f32 {med['f32_dram']:.3f} ms; bf16/fp8 {row['bf16_over_fp8_dram']:.2f}x bf16/int4 "
          f"{row['bf16_over_int4_dram']:.2f}x  [compiled in {compile_s:.0f} s]", flush=True)
    return row


# ------------------------------------------------------------------------ bench-size FP8 DeepSeek-V3.2
def write_bench_deepseek_v32(fp8_dir: Path, bf16_dir: Path) -> None:
    """The published FP8 layout and the same weights widened to bf16 (identical values)."""
    import transformers as tf
    from safetensors.torch import load_file, save_file
    from hf_checkpoints import FP8_LINEAR, fp8_block_dequantize, write_tokenizer

    cfg = tf.DeepseekV32Config(vocab_size=32768, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                               num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
                               kv_lora_rank=512, q_lora_rank=768, qk_rope_head_dim=64, v_head_dim=128,
                               qk_nope_head_dim=128, n_routed_experts=32, num_experts_per_tok=4, n_shared_experts=1,
                               n_group=1, topk_group=1, first_k_dense_replace=1, index_n_heads=16, index_head_dim=128,
                               index_topk=512, max_position_embeddings=16384)
    torch.manual_seed(0)
    model = tf.DeepseekV32ForCausalLM(cfg)
    for p in model.parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02)
    for d in (fp8_dir, bf16_dir):
        model.save_pretrained(d)
        write_tokenizer(d, cfg.vocab_size)
    tensors = load_file(fp8_dir / "model.safetensors")
    quantized, widened = {}, {}
    for name, t in tensors.items():
        if FP8_LINEAR.fullmatch(name):
            codes, scale_inv = fp8_block_quantize(t, ue8m0=True)
            quantized[name], quantized[f"{name}_scale_inv"] = codes, scale_inv
            widened[name] = fp8_block_dequantize(codes, scale_inv).to(torch.bfloat16)
        else:
            keep = t if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
            quantized[name] = widened[name] = keep
    save_file(quantized, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(widened, str(bf16_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))


def decode_case(workdir: Path, max_context: int) -> dict:
    from kimi_iree.runtime import Session
    from kimi_iree.runtime.cli import bench

    fp8_ckpt, bf16_ckpt = workdir / "dsv32-fp8", workdir / "dsv32-bf16"
    if not (bf16_ckpt / "config.json").exists():
        shutil.rmtree(workdir, ignore_errors=True)
        write_bench_deepseek_v32(fp8_ckpt, bf16_ckpt)
    outs = {}
    for name, ckpt in (("fp8", fp8_ckpt), ("bf16", bf16_ckpt)):
        outs[name] = workdir / f"out-{name}"
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "kimi_iree.driver.kimi_compile", str(ckpt), "--target", "cpu",
                        "-o", str(outs[name]), "--max-context", str(max_context), "--quiet"], check=True)
        print(f"compiled {name} in {time.perf_counter() - t:.0f} s", flush=True)
    sessions = {name: Session(out) for name, out in outs.items()}
    # same tokens, same logits: the two modules hold the same weight values
    ids = list(range(100, 140))
    a, b = (s.prefill(ids) for s in sessions.values())
    logits_rel = float(abs(a - b).max() / abs(b).max())
    runs: dict[str, list[dict]] = {n: [] for n in sessions}
    for _ in range(DECODE_ROUNDS):
        for name, out in outs.items():
            args = argparse.Namespace(depth=0, prompt_tokens=PROMPT, gen_tokens=GEN, seed=0, warmup=True)
            runs[name].append(bench(Session(out), args))
    median = {n: {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in ("prefill_tokens_per_s", "decode_tokens_per_s")}
              for n, rs in runs.items()}
    size = {n: (o / "model.irpa").stat().st_size for n, o in outs.items()}
    row = {"median": median, "runs": runs, "irpa_bytes": size, "fp8_vs_bf16_logits_rel": logits_rel,
           "fp8_over_bf16_decode": median["fp8"]["decode_tokens_per_s"] / median["bf16"]["decode_tokens_per_s"],
           "fp8_over_bf16_prefill": median["fp8"]["prefill_tokens_per_s"] / median["bf16"]["prefill_tokens_per_s"]}
    print(f"DeepSeek-V3.2 bench-size decode: fp8 {median['fp8']['decode_tokens_per_s']:.1f} tok/s, bf16 "
          f"{median['bf16']['decode_tokens_per_s']:.1f} tok/s ({row['fp8_over_bf16_decode']:.2f}x); prefill "
          f"{row['fp8_over_bf16_prefill']:.2f}x; model.irpa {size['fp8'] / 2**20:.0f} vs {size['bf16'] / 2**20:.0f} MiB; "
          f"logits agree to {logits_rel:.1e}", flush=True)
    return row


def cell(r: dict) -> str:
    return f"{r['median_ms']:.3f} ({r['min_ms']:.3f})"


def table(rows: list[dict], decode: dict | None, calls: int) -> str:
    lines = ["| N x K (out x in) | FP8 b128, DRAM | INT4 g32, DRAM | bf16, DRAM | f32, DRAM | bf16/FP8 | bf16/INT4 "
             "| FP8 cached | INT4 cached | bf16 cached |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['N']} x {r['K']} | {cell(r['fp8_dram'])} | {cell(r['int4_dram'])} | {cell(r['bf16_dram'])} "
                     f"| {cell(r['f32_dram'])} | {r['bf16_over_fp8_dram']:.2f}x | {r['bf16_over_int4_dram']:.2f}x "
                     f"| {cell(r['fp8'])} | {cell(r['int4'])} | {cell(r['bf16'])} |")
    lines.append(f"\nms per matvec: median of {calls} calls (min). DRAM: each call the next of distinct weight "
                 "copies >= 4x the L3.")
    if decode:
        m = decode["median"]
        lines += ["", "| bench-size DeepSeek-V3.2 | decode tok/s | prefill tok/s (32) | model.irpa MiB |",
                  "|---|---|---|---|"]
        for n in ("fp8", "bf16"):
            lines.append(f"| {n} | {m[n]['decode_tokens_per_s']:.1f} | {m[n]['prefill_tokens_per_s']:.1f} "
                         f"| {decode['irpa_bytes'][n] / 2**20:.0f} |")
        lines.append(f"| fp8 / bf16 | {decode['fp8_over_bf16_decode']:.2f}x | {decode['fp8_over_bf16_prefill']:.2f}x | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-matvec", action="store_true")
    ap.add_argument("--workdir", default="/tmp/kimi-bench-fp8")
    ap.add_argument("--max-context", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(2)
    facts = machine()
    print(f"{facts['model_name']}, {facts['cpus']} CPUs, L3 {facts['l3']}; flags {' '.join(FLAGS)}", flush=True)
    rows = [] if args.skip_matvec else [matvec_case(Runner(), N, K, facts["l3_bytes"], args.rounds, args.reps)
                                        for N, K in SHAPES]
    decode = None if args.skip_decode else decode_case(Path(args.workdir), args.max_context)
    print("\n" + table(rows, decode, args.rounds * args.reps))
    out = Path(__file__).parent / "results" / "block_scaled.json"
    out.write_text(json.dumps({"machine": facts, "flags": FLAGS, "matvec": rows, "decode": decode}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
