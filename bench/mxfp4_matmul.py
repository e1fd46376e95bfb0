"""MXFP4 expert matmuls, side by side in one run (IREE llvm-cpu, --iree-opt-level=O3, target-cpu=host,
local-task), every form built the way kimi-compile builds a model: torch module ->
torch_mlir.fx.export_and_import(decomposition_table={}) -> kimi_iree.passes.run_passes(weight_matmul=True,
backend="llvm-cpu") -> iree-compile with the cpu target's flags.

  fused      the unit (frontend/units.py, torch.ops.kimi.weight_expert_matmul, fmt mxfp4), rewritten by
             passes/mxfp4.py as kimi-compile does for this host: the AVX-512 dispatch of
             passes/mxfp4_avx512.py where the CPU has AVX-512F, else the linalg kernel of
             passes/mxfp4_cpu.py. M = 16 is reported in two forms: decode (x [16, 1, K], each row
             through its selected expert, here all expert 0) and batched
             (torch.ops.kimi.weight_batched_matmul, x [16, 1, K] through E = 1 expert).
  linalg     (AVX-512 hosts only) the decode form built with the linalg kernel that CPUs without
             AVX-512 get, timed beside the dispatch.
  unfused    the same module calling the unit's reference (frontend/mxfp4.py: gather the selected
             experts' bytes, dequantise to f32, einsum): the pass finds nothing (--no-weight-fusion).
             In the decode form that gathers and dequantises the weight once per row (16x at M = 16).
  dense f32  F.linear with an f32 weight [N, K] of the same shape.

Shapes: M in {1, 16} rows, (N, K) = (out, in) in {(2048, 2048), (4096, 1024), (1024, 4096)}, one expert.
Weights are function inputs, resident on the device (rt.asdevicearray). Two residencies:
  cached     the same weight on every call: a 16 MiB f32 weight (2 MiB of MXFP4) stays in the L3;
  DRAM       each call reads the next of enough distinct weight copies (>= 4x the L3 in all), as a
             model reading each layer's weights once per token does.
MoE decode step: one token, top-4 of 64 experts, hidden = moe_intermediate = 2048, the project's
frontend/moe.py RoutedExperts (w1, w3 gathered matmuls, gated SiLU, w2 gathered matmul, weighted sum;
the router's combine weights are an input) with fused_mxfp4 on and off, against 4 dense f32 expert FFNs
(12 f32 [2048, 2048] matvecs, 192 MiB a step: never cache-resident). Each fused call selects another
set of 4 experts (64 experts = 408 MiB of MXFP4), so the expert bytes come from DRAM too.
MoE prefill block: 32 tokens through the same experts in RoutedExperts' two static forms (routed
pairs; all experts on the block), both fused, to check frontend/moe.py's choice between them.

Before timing, each compiled form's result is checked against the eager reference (frontend/mxfp4.py,
in float64) to 1e-5 of max|reference|. Timing: the forms interleaved round by round (the machine may be
shared), ROUNDS x REPS calls each after a warm-up call; median and min in ms.

    python bench/mxfp4_matmul.py [--rounds 4] [--reps 5] [--quick]

Prints a markdown table and writes bench/results/mxfp4_matmul.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import re
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kimi_iree.frontend import mxfp4, units
from kimi_iree.frontend.config import ModelConfig
from kimi_iree.frontend.layers import gated_activation
from kimi_iree.frontend.model import use_fused_units
from kimi_iree.frontend.moe import RoutedExperts, set_expert_format
from kimi_iree.frontend.units import FusedUnits
from kimi_iree.passes import PassOptions, run_passes
from kimi_iree.targets import cpu

FLAGS = [*cpu.flags("host").flags, "--iree-opt-level=O3"]
PASS_OPTIONS = PassOptions(weight_matmul=True, sparse_attention=False, backend="llvm-cpu",
                           avx512=cpu.flags("host").avx512)
# the linalg kernels (passes/mxfp4_cpu.py) that targets without AVX-512 get, timed beside the AVX-512 dispatch
LINALG_OPTIONS = dataclasses.replace(PASS_OPTIONS, avx512=False)
SHAPES = [(2048, 2048), (4096, 1024), (1024, 4096)]          # (N, K) = (out, in)
ROWS = [1, 16]
MOE = dict(experts=64, topk=4, hidden=2048, intermediate=2048)
TOLERANCE = 1e-5


# ----------------------------------------------------------------------------- machine facts
def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    field = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in lscpu.splitlines() if ":" in line)}
    return {"model_name": field.get("Model name"), "cpus": int(field.get("CPU(s)", 0)),
            "cores_per_socket": int(field.get("Core(s) per socket", 0)), "sockets": int(field.get("Socket(s)", 0)),
            "l2": field.get("L2 cache"), "l3": field.get("L3 cache"), "l3_bytes": l3_bytes(field.get("L3 cache")),
            "hypervisor": field.get("Hypervisor vendor"), "kernel": platform.release()}


def l3_bytes(text: str | None) -> int:
    """'32 MiB (1 instance)' -> bytes (32 MiB when lscpu says nothing)."""
    m = re.match(r"([\d.]+)\s*([KMG])i?B", text or "")
    if not m:
        return 32 << 20
    return int(float(m.group(1)) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)])


# ------------------------------------------------------------------------------ the modules
class ExpertMatmul(torch.nn.Module):
    """The decode unit: x [N, J, K] through expert experts[n, j]."""

    def __init__(self, fused: bool):
        super().__init__()
        self.fused = fused

    def forward(self, x, packed, scales, experts):
        return units.weight_expert_matmul(x=x, packed=packed, scales=scales, experts=experts, fmt="mxfp4",
                                          fused=self.fused)


class BatchedMatmul(ExpertMatmul):
    """The prefill unit: x [M, E, K], column e through expert e."""

    def forward(self, x, packed, scales):
        return units.weight_batched_matmul(x=x, packed=packed, scales=scales, fmt="mxfp4", fused=self.fused)


class Dense(torch.nn.Module):
    def forward(self, x, weight):
        return F.linear(x, weight)


def moe_config() -> ModelConfig:
    E, k, D, I = MOE["experts"], MOE["topk"], MOE["hidden"], MOE["intermediate"]
    return ModelConfig(model_type="bench", text_model_type="bench", vocab_size=16, hidden_size=D, num_layers=1,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, layer_kinds=("mla",), ffn_kinds=("moe",),
                       intermediate_size=I, num_experts=E, experts_per_token=k, moe_intermediate_size=I,
                       expert_format="mxfp4")


EXPERT_WEIGHTS = [f"{p}.{b}" for p in ("w1", "w3", "w2") for b in ("packed", "scales")]


class MoEStep(torch.nn.Module):
    """frontend/moe.py RoutedExperts for one token, its expert bytes as inputs (in the model they are
    parameters; here they stay on the device between calls). The RoutedExperts instance lives on the
    meta device outside the module's state, so the export holds no weight of its own."""

    def __init__(self, fused: bool):
        super().__init__()
        with torch.device("meta"):
            self.__dict__["experts"] = use_fused_units(set_expert_format(RoutedExperts(moe_config()), "mxfp4"),
                                                       FusedUnits(weight_matmul=fused))

    def forward(self, z, combine, *weights):
        return torch.func.functional_call(self.experts, dict(zip(EXPERT_WEIGHTS, weights)), (z, combine))


class DenseMoEStep(torch.nn.Module):
    """4 dense f32 expert FFNs for one token: sum_i c_i w2_i(silu(w1_i z) * (w3_i z)), 12 matvecs."""

    def forward(self, z, weights, *w):
        cfg, k = moe_config(), MOE["topk"]
        y = 0
        for i in range(k):
            w1, w3, w2 = w[3 * i], w[3 * i + 1], w[3 * i + 2]
            y = y + weights[i] * F.linear(gated_activation(F.linear(z, w1), F.linear(z, w3), cfg), w2)
        return y


# ------------------------------------------------------------------------- compile and run
def compile_form(module: torch.nn.Module, args: list[torch.Tensor], units_expected: int,
                 options: PassOptions = PASS_OPTIONS) -> bytes:
    """kimi-compile's path: export, our passes, iree-compile. `units_expected`: how many MXFP4 units the
    pass must rewrite (0 for the reference and dense forms: the pass finds nothing)."""
    import iree.compiler as ic
    from torch_mlir import fx

    mlir = str(fx.export_and_import(module, *args, func_name="main", decomposition_table={}))
    report = run_passes(mlir, options)
    assert report.rewritten.get("weight_matmul", 0) == units_expected, report.rewritten
    return ic.compile_str(report.mlir, input_type="torch", extra_args=FLAGS)


class Runner:
    def __init__(self):
        import iree.runtime as rt

        self.rt = rt
        self.config = rt.Config("local-task")
        self.device = self.config.device

    def load(self, vmfb: bytes):
        context = self.rt.SystemContext(config=self.config)
        context.add_vm_module(self.rt.VmModule.copy_buffer(self.config.vm_instance, vmfb))
        return context.modules.module.main

    def upload(self, tensors: list[torch.Tensor]) -> list:
        """Device copies (each a distinct allocation, from its own host copy)."""
        return [self.rt.asdevicearray(self.device, np.array(t.numpy(), copy=True)) for t in tensors]


def copies_for(nbytes: int, l3: int) -> int:
    """Distinct weight copies so that the copies together are >= 4x the L3 (at least 2)."""
    return max(2, math.ceil(4 * l3 / nbytes))


class Form:
    """A compiled function and the argument sets its calls cycle through."""

    def __init__(self, main, arg_sets: list[list]):
        self.main, self.arg_sets, self.calls, self.ms = main, arg_sets, 0, []

    def call(self):
        args = self.arg_sets[self.calls % len(self.arg_sets)]
        self.calls += 1
        return self.main(*args).to_host()


def time_forms(forms: dict[str, Form], rounds: int, reps: int) -> dict[str, dict]:
    for form in forms.values():
        form.call()                                     # warm-up
    for _ in range(rounds):
        for form in forms.values():
            for _ in range(reps):
                start = time.perf_counter()
                form.call()
                form.ms.append(1e3 * (time.perf_counter() - start))
    return {name: {"median_ms": statistics.median(f.ms), "min_ms": min(f.ms), "calls": len(f.ms),
                   "distinct_arg_sets": len(f.arg_sets)} for name, f in forms.items()}


def check(name: str, got: np.ndarray, want: torch.Tensor) -> float:
    want = want.numpy()
    err = float(np.abs(got.astype(np.float64) - want).max() / np.abs(want).max())
    assert got.shape == want.shape and np.isfinite(got).all() and err <= TOLERANCE, (name, got.shape, err)
    return err


def random_mxfp4(E: int, O: int, K: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Every code; scales 2^-9 .. 2^2 (finite dequantised values whatever the code)."""
    packed = torch.randint(0, 256, (E, O, K // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(118, 130, (E, O, K // mxfp4.BLOCK), generator=g, dtype=torch.int32).to(torch.uint8)
    return packed, scales


# ------------------------------------------------------------------------------- the cases
def matmul_case(runner: Runner, M: int, N: int, K: int, l3: int, rounds: int, reps: int) -> list[dict]:
    g = torch.Generator().manual_seed(M * 100003 + N * 7 + K)
    x = torch.randn(M, 1, K, generator=g)
    packed, scales = random_mxfp4(1, N, K, g)
    experts = torch.zeros(M, 1, dtype=torch.int64)
    weight = torch.randn(N, K, generator=g) / math.sqrt(K)
    # float64 references: the exact dequantised weight
    w64 = mxfp4.dequantize(packed, scales).double()[0]
    want = torch.einsum("mk,nk->mn", x[:, 0].double(), w64)[:, None]
    want_dense = x[:, 0].double() @ weight.double().t()

    started = time.time()
    mx_args, batched_args = [x, packed, scales, experts], [x, packed, scales]
    mains = {"fused": runner.load(compile_form(ExpertMatmul(True), mx_args, 1)),
             "unfused": runner.load(compile_form(ExpertMatmul(False), mx_args, 0)),
             "dense": runner.load(compile_form(Dense(), [x[:, 0], weight], 0))}
    if PASS_OPTIONS.avx512:
        mains["linalg"] = runner.load(compile_form(ExpertMatmul(True), mx_args, 1, LINALG_OPTIONS))
    if M > 1:
        mains["batched"] = runner.load(compile_form(BatchedMatmul(True), batched_args, 1))
        mains["batched_unfused"] = runner.load(compile_form(BatchedMatmul(False), batched_args, 0))
    compile_s = time.time() - started

    dx, dpk, dsc, dex, dxd, dw = runner.upload([x, packed, scales, experts, x[:, 0].contiguous(), weight])
    errors = {}
    for name, main in mains.items():
        args = {"dense": [dxd, dw]}.get(name, [dx, dpk, dsc] if name.startswith("batched") else [dx, dpk, dsc, dex])
        errors[name] = check(f"M={M} {name}", main(*args).to_host(), want_dense if name == "dense" else want)

    mx_bytes = packed.numel() + scales.numel()
    n_mx, n_f32 = copies_for(mx_bytes, l3), copies_for(weight.numel() * 4, l3)
    mx_copies = [runner.upload([packed, scales]) for _ in range(n_mx)]
    w_copies = runner.upload([weight] * n_f32)
    forms = {"fused": Form(mains["fused"], [[dx, dpk, dsc, dex]]),
             "fused_dram": Form(mains["fused"], [[dx, p, s, dex] for p, s in mx_copies]),
             "unfused": Form(mains["unfused"], [[dx, dpk, dsc, dex]]),
             "dense": Form(mains["dense"], [[dxd, dw]]),
             "dense_dram": Form(mains["dense"], [[dxd, w] for w in w_copies])}
    if "linalg" in mains:
        forms["linalg"] = Form(mains["linalg"], [[dx, dpk, dsc, dex]])
        forms["linalg_dram"] = Form(mains["linalg"], [[dx, p, s, dex] for p, s in mx_copies])
    if M > 1:
        forms["batched"] = Form(mains["batched"], [[dx, dpk, dsc]])
        forms["batched_dram"] = Form(mains["batched"], [[dx, p, s] for p, s in mx_copies])
        forms["batched_unfused"] = Form(mains["batched_unfused"], [[dx, dpk, dsc]])
    t = time_forms(forms, rounds, reps)
    del mx_copies, w_copies

    rows = []
    # (form, its fused name, its unfused name): at M = 16 the decode and the batched unit
    for form, fused, unfused in [("decode", "fused", "unfused")] + ([("batched", "batched", "batched_unfused")] if M > 1 else []):
        row = dict(M=M, N=N, K=K, form=form, fused=t[fused], fused_dram=t[f"{fused}_dram"], unfused=t[unfused],
                   dense=t["dense"], dense_dram=t["dense_dram"],
                   max_rel_error={"fused": errors[fused], "unfused": errors[unfused], "dense": errors["dense"]},
                   mxfp4_bytes=mx_bytes, f32_bytes=weight.numel() * 4, dram_copies={"mxfp4": n_mx, "f32": n_f32},
                   compile_s=compile_s)
        med = {k: row[k]["median_ms"] for k in ("fused", "fused_dram", "unfused", "dense", "dense_dram")}
        row["dense_over_fused_cached"] = med["dense"] / med["fused"]
        row["dense_over_fused_dram"] = med["dense_dram"] / med["fused_dram"]
        row["unfused_over_fused"] = med["unfused"] / med["fused"]
        if "linalg" in t and form == "decode":
            row["linalg"], row["linalg_dram"] = t["linalg"], t["linalg_dram"]
            row["max_rel_error"]["linalg"] = errors["linalg"]
            row["linalg_over_fused_dram"] = t["linalg_dram"]["median_ms"] / med["fused_dram"]
            print(f"M={M:2} N={N} K={K} {form:7}: linalg kernel {t['linalg']['median_ms']:.3f} "
                  f"(DRAM {t['linalg_dram']['median_ms']:.3f}) ms, {row['linalg_over_fused_dram']:.2f}x the "
                  "AVX-512 dispatch from DRAM", flush=True)
        rows.append(row)
        print(f"M={M:2} N={N} K={K} {form:7}: fused {med['fused']:.3f} (DRAM {med['fused_dram']:.3f})  "
              f"unfused {med['unfused']:.2f}  dense f32 {med['dense']:.3f} (DRAM {med['dense_dram']:.3f}) ms  "
              f"dense/fused {row['dense_over_fused_cached']:.2f}x (DRAM {row['dense_over_fused_dram']:.2f}x)  "
              f"unfused/fused {row['unfused_over_fused']:.1f}x  [compiled in {compile_s:.0f} s]", flush=True)
    return rows


def moe_case(runner: Runner, rounds: int, reps: int, selections: int = 16) -> dict:
    E, k, D, I = MOE["experts"], MOE["topk"], MOE["hidden"], MOE["intermediate"]
    g = torch.Generator().manual_seed(64)
    z = torch.randn(1, D, generator=g)
    weights = []
    for name in EXPERT_WEIGHTS[::2]:
        out, inp = (D, I) if name.startswith("w2") else (I, D)
        weights += list(random_mxfp4(E, out, inp, g))
    combines = []
    for _ in range(selections):
        chosen = torch.randperm(E, generator=g)[:k]
        c = torch.zeros(1, E)
        c[0, chosen] = torch.rand(k, generator=g) + 0.1
        combines.append(c / c.sum())
    # expert i: w1, w3 [I, D], w2 [D, I]
    dense_w = [torch.randn(*((I, D) if j < 2 else (D, I)), generator=g) / math.sqrt(D if j < 2 else I)
               for _ in range(k) for j in range(3)]
    dense_c = combines[0][combines[0] > 0]

    started = time.time()
    fused = runner.load(compile_form(MoEStep(True), [z, combines[0], *weights], 3))
    unfused = runner.load(compile_form(MoEStep(False), [z, combines[0], *weights], 0))
    dense = runner.load(compile_form(DenseMoEStep(), [z, dense_c, *dense_w], 0))
    compile_s = time.time() - started

    with torch.no_grad():
        # the eager reference (the units' reference, float32: dequantize widens to f32)
        want = MoEStep(False)(z, combines[0], *weights)
        want_dense = DenseMoEStep()(z.double(), dense_c.double(), *[w.double() for w in dense_w])
    dz, *dweights = runner.upload([z, *weights])
    dcombines = runner.upload(combines)
    errors = {"fused": check("MoE fused", fused(dz, dcombines[0], *dweights).to_host(), want),
              "unfused": check("MoE unfused", unfused(dz, dcombines[0], *dweights).to_host(), want)}
    dense_sets = [runner.upload([z, dense_c, *dense_w]) for _ in range(2)]
    errors["dense"] = check("MoE dense", dense(*dense_sets[0]).to_host(), want_dense)
    forms = {"fused": Form(fused, [[dz, c, *dweights] for c in dcombines]),
             "unfused": Form(unfused, [[dz, c, *dweights] for c in dcombines]),
             "dense": Form(dense, dense_sets)}
    t = time_forms(forms, rounds, reps)
    row = dict(MOE, compile_s=compile_s, selections=selections, max_rel_error=errors,
               expert_bytes_mxfp4_per_step=3 * k * (I * D // 2 + I * D // 32),
               expert_bytes_f32_per_step=3 * k * I * D * 4, **t)
    row["fused_over_dense"] = t["fused"]["median_ms"] / t["dense"]["median_ms"]
    row["unfused_over_fused"] = t["unfused"]["median_ms"] / t["fused"]["median_ms"]
    print(f"MoE decode step top-{k}/{E}, {D}/{I}: fused {t['fused']['median_ms']:.3f}  "
          f"unfused {t['unfused']['median_ms']:.1f}  4 dense f32 FFNs {t['dense']['median_ms']:.3f} ms  "
          f"fused/dense {row['fused_over_dense']:.2f}  [compiled in {compile_s:.0f} s]", flush=True)
    return row


def moe_prefill_case(runner: Runner, rounds: int, reps: int, tokens: int = 32) -> dict:
    """One prefill block through RoutedExperts (fused MXFP4) in its two static forms, forced side by
    side: routed pairs (tokens x k rows, each through its expert) and all experts (every expert on the
    whole block, combine-weighted). frontend/moe.py `routed_pairs_cheaper` picks between them."""
    from kimi_iree.frontend import moe as moe_module

    E, k, D, I = MOE["experts"], MOE["topk"], MOE["hidden"], MOE["intermediate"]
    g = torch.Generator().manual_seed(65)
    z = torch.randn(tokens, D, generator=g)
    weights = []
    for name in EXPERT_WEIGHTS[::2]:
        out, inp = (D, I) if name.startswith("w2") else (I, D)
        weights += list(random_mxfp4(E, out, inp, g))
    combine = torch.zeros(tokens, E)
    for t in range(tokens):
        combine[t, torch.randperm(E, generator=g)[:k]] = torch.rand(k, generator=g) + 0.1
    combine = combine / combine.sum(-1, keepdim=True)
    real_choice = moe_module.routed_pairs_cheaper
    modules = {}
    started = time.time()
    try:
        for form, pairs in (("routed_pairs", True), ("all_experts", False)):
            moe_module.routed_pairs_cheaper = lambda *a, pairs=pairs: pairs
            modules[form] = runner.load(compile_form(MoEStep(True), [z, combine, *weights], 3))
            with torch.no_grad():
                if form == "routed_pairs":
                    want = MoEStep(False)(z, combine, *weights)
    finally:
        moe_module.routed_pairs_cheaper = real_choice
    compile_s = time.time() - started
    args = runner.upload([z, combine, *weights])
    errors = {form: check(f"MoE prefill {form}", main(*args).to_host(), want) for form, main in modules.items()}
    t = time_forms({form: Form(main, [args]) for form, main in modules.items()}, rounds, reps)
    row = dict(MOE, tokens=tokens, compile_s=compile_s, max_rel_error=errors, **t,
               chosen="routed_pairs" if real_choice(tokens, k, E, True) else "all_experts")
    row["all_experts_over_routed_pairs"] = t["all_experts"]["median_ms"] / t["routed_pairs"]["median_ms"]
    print(f"MoE prefill block of {tokens} tokens, top-{k}/{E}: routed pairs {t['routed_pairs']['median_ms']:.1f} ms, "
          f"all experts {t['all_experts']['median_ms']:.1f} ms, ratio {row['all_experts_over_routed_pairs']:.2f} "
          f"(frontend/moe.py picks {row['chosen']})  [compiled in {compile_s:.0f} s]", flush=True)
    return row


# ---------------------------------------------------------------------------------- report
def cell(r: dict) -> str:
    return f"{r['median_ms']:.3f} ({r['min_ms']:.3f})"


def table(rows: list[dict], moe: dict | None, calls: int) -> str:
    lines = ["| M | N x K (out x in) | form | fused | fused, DRAM | unfused | dense f32 | dense f32, DRAM "
             "| dense/fused | dense/fused, DRAM | unfused/fused |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['M']} | {r['N']} x {r['K']} | {r['form']} | {cell(r['fused'])} | {cell(r['fused_dram'])} "
                     f"| {r['unfused']['median_ms']:.2f} ({r['unfused']['min_ms']:.2f}) | {cell(r['dense'])} "
                     f"| {cell(r['dense_dram'])} | {r['dense_over_fused_cached']:.2f}x | {r['dense_over_fused_dram']:.2f}x "
                     f"| {r['unfused_over_fused']:.1f}x |")
    linalg = [r for r in rows if "linalg" in r]
    if linalg:
        lines += ["", "| M | N x K | linalg kernel (no AVX-512) | linalg, DRAM | linalg / AVX-512 dispatch, DRAM |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['M']} | {r['N']} x {r['K']} | {cell(r['linalg'])} | {cell(r['linalg_dram'])} "
                  f"| {r['linalg_over_fused_dram']:.2f}x |" for r in linalg]
    if moe:
        lines += ["", "| MoE decode step (1 token) | fused | unfused | 4 dense f32 FFNs | fused / dense | unfused/fused |",
                  "|---|---|---|---|---|---|",
                  f"| top-{moe['topk']} of {moe['experts']}, hidden {moe['hidden']}, intermediate {moe['intermediate']} "
                  f"| {cell(moe['fused'])} | {moe['unfused']['median_ms']:.1f} ({moe['unfused']['min_ms']:.1f}) "
                  f"| {cell(moe['dense'])} | {moe['fused_over_dense']:.2f} | {moe['unfused_over_fused']:.0f}x |"]
    lines.append(f"\nms: median of {calls} calls (min in parentheses). cached: the same weight every call; "
                 "DRAM: each call the next of distinct copies >= 4x the L3 (the MoE step: another 4 of 64 "
                 "experts each call; the dense FFNs read 192 MiB a call).")
    return "\n".join(lines)


def goals(rows: list[dict], moe: dict | None) -> list[str]:
    out = []
    for r in rows:
        if r["M"] == 1:
            out.append(f"M=1 {r['N']}x{r['K']}: dense/fused {r['dense_over_fused_dram']:.2f}x DRAM, "
                       f"{r['dense_over_fused_cached']:.2f}x cached (goal >= 2); unfused/fused "
                       f"{r['unfused_over_fused']:.1f}x (goal >= 10)")
    if moe:
        out.append(f"MoE step: fused / 4 dense FFNs {moe['fused_over_dense']:.2f} (goal <= 1.5)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="one shape at M = 1 and the MoE step")
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--moe-prefill-only", action="store_true", help="only the MoE prefill block's two forms")
    args = ap.parse_args()
    torch.set_num_threads(2)
    facts = machine()
    print(f"{facts['model_name']}, {facts['cpus']} CPUs, L2 {facts['l2']}, L3 {facts['l3']}; flags {' '.join(FLAGS)}",
          flush=True)
    runner = Runner()
    if args.moe_prefill_only:
        moe_prefill_case(runner, args.rounds, args.reps)
        return
    cases = [(M, N, K) for M in ROWS for N, K in SHAPES]
    if args.quick:
        cases = cases[:1]
    rows = []
    for M, N, K in cases:
        rows += matmul_case(runner, M, N, K, facts["l3_bytes"], args.rounds, args.reps)
    moe = None if args.skip_moe else moe_case(runner, args.rounds, args.reps)
    prefill = None if args.skip_moe else moe_prefill_case(runner, max(1, args.rounds // 2), 1)
    calls = args.rounds * args.reps
    report = table(rows, moe, calls)
    print("\n" + report + "\n")
    for line in goals(rows, moe):
        print(line)
    result = {"machine": facts, "flags": FLAGS, "pass_options": dataclasses.asdict(PASS_OPTIONS), "rounds": args.rounds,
              "reps": args.reps, "tolerance": TOLERANCE, "matmul": rows, "moe_decode_step": moe,
              "moe_prefill_block": prefill,
              "goals": goals(rows, moe)}
    out = Path(__file__).parent / "results" / "mxfp4_matmul.json"
    if not args.quick:
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
