"""The MXFP4 expert matmul pass (passes/mxfp4.py): the rewrite on IR text, the fused implementation against
the reference dequantise-then-matmul (frontend/mxfp4.py), and whole modules fused vs unfused."""

import json

import numpy as np
import pytest
import torch

from kimi_iree.driver.kimi_compile import main as kimi_compile
from kimi_iree.frontend import mxfp4
from kimi_iree.passes import PassError, PassOptions, mxfp4 as mxfp4_pass, run_passes
from kimi_iree.passes.kda import kda_decode_applies
from kimi_iree.targets import cpu

from conftest import COMPILE_ARGS, module_logits, relative_error


def unit_ir(op_name="torch.kimi.weight_expert_matmul", weight_dtype="ui8", fmt="mxfp4") -> str:
    N, J, K, E, O = 1, 2, 64, 4, 8
    x, w, s, i = (f"!torch.vtensor<[{N},{J},{K}],f32>", f"!torch.vtensor<[{E},{O},{K // 2}],{weight_dtype}>",
                  f"!torch.vtensor<[{E},{O},{K // 32}],{weight_dtype}>", f"!torch.vtensor<[{N},{J}],si64>")
    y = f"!torch.vtensor<[{N},{J},{O}],f32>"
    return f"""
func.func @main(%x: {x}, %w: {w}, %s: {s}, %i: {i}) -> {y} {{
  %f = torch.constant.str "{fmt}"
  %r = torch.operator "{op_name}"(%x, %w, %s, %i, %f) : ({x}, {w}, {s}, {i}, !torch.str) -> {y}
  return %r : {y}
}}"""


def test_pass_rewrites_the_unit_into_a_packed_contraction():
    report = run_passes(unit_ir())
    assert report.rewritten == {"weight_matmul": 1}
    # named by its specialisation: the llvm-cpu kernel of a CPU without AVX-512F, 1 x 2 rows, K 64, O 8, 4 experts
    assert "torch.operator" not in report.mlir and "util.call @kimi_mxfp4_llvm_cpu_gathered_N1_J2_K64_O8_E4" in report.mlir
    assert "tensor<4x8x32xi8>" in report.mlir               # the packed bytes are what the function reads
    assert "4x8x64xf32" not in report.mlir                   # no dequantised weight tensor anywhere


def test_pass_on_an_avx512_target_emits_the_table_lookup_dispatch():
    report = run_passes(unit_ir(), PassOptions(avx512=True))
    assert report.rewritten == {"weight_matmul": 1}
    name = "kimi_mxfp4_avx512_gathered_N1_J2_K64_O8_E4"
    assert f"stream.executable private @{name}_rows_dispatch" in report.mlir
    assert f"flow.dispatch @{name}_rows_dispatch::@{name}_rows" in report.mlir
    assert report.mlir.count('"llvm.x86.avx512.permvar.si.512"') == 4    # lo and hi, in both row paths
    assert "memref<4x8x32xi8>" in report.mlir and "4x8x64xf32" not in report.mlir
    # the manifest's fallback notes come from the pass: none here, one for a CPU without AVX-512F
    assert report.notes == [] and "no AVX-512F" in run_passes(unit_ir()).notes[0]
    # the same option means nothing to the other backends
    assert "stream.executable" not in run_passes(unit_ir(), PassOptions(avx512=True, backend="spirv")).mlir


def test_pass_on_an_avx2_target_emits_the_8_wide_dispatch():
    report = run_passes(unit_ir(), PassOptions(avx2=True))
    name = "kimi_mxfp4_avx2_gathered_N1_J2_K64_O8_E4"
    assert f"flow.dispatch @{name}_rows_dispatch::@{name}_rows" in report.mlir
    # two halves of a block's bytes, lo and hi each, in both row paths; no AVX-512 instruction
    assert report.mlir.count('"llvm.x86.avx2.permps"') == 8 and "avx512" not in report.mlir
    assert report.notes == []


def test_pass_leaves_a_look_alike_op_alone():
    assert 'torch.operator "torch.other.weight_expert_matmul"' in run_passes(
        unit_ir(op_name="torch.other.weight_expert_matmul")).mlir


def test_unit_with_float_weights_is_refused():
    with pytest.raises(PassError, match=r"weight_expert_matmul \(mxfp4\): unexpected operand types"):
        run_passes(unit_ir(weight_dtype="f32"))


def test_unit_with_an_unknown_format_is_refused():
    with pytest.raises(PassError, match="weight_expert_matmul: expected .* a format of mxfp4, fp8_e4m3_b128"):
        run_passes(unit_ir(fmt="nf4"))


def test_unit_left_unlowered_when_the_pass_is_off_is_an_error():
    with pytest.raises(PassError, match="weight_expert_matmul has no lowering"):
        run_passes(unit_ir(), PassOptions(weight_matmul=False))


# ------------------------------------------------------------------- the implementation
def random_mxfp4(E, O, K, seed, zero_row=False):
    """Random codes (every code, -0 included) and scales around 127 plus the extremes 0, 1, 2 and 254;
    `zero_row`: also a whole row of scale 0 (2^-127) in the last expert."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (E, O, K // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(118, 136, (E, O, K // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    scales[0, 0, 0], scales[-1, -1, -1] = 254, 2
    packed[0, 0, :16] &= 0xBB          # |code| <= 1.5 there: 6 * 2^127 would overflow f32 when dequantised
    scales[0, 1 % O, 0], scales[0, 2 % O, 0] = 0, 1
    packed[0, 3 % O, :] = 0x88                                   # a row of -0.0
    if zero_row and O > 4:
        scales[-1, 4, :] = 0             # a row of 2^-127 scales (run_fused scales up its x to keep it normal)
    return packed, scales


# test name -> (backend, avx512, avx2) for choose_lowering
LOWERINGS = {"avx512": ("llvm-cpu", True, False), "avx2": ("llvm-cpu", False, True),
             "llvm-cpu": ("llvm-cpu", False, False), "portable": ("cuda", False, False), "spirv": ("spirv", False, False)}


def run_fused(N, J, K, O, E, gathered, backend, seed=0):
    import iree.compiler as ic
    import iree.runtime as rt

    if backend == "avx512" and not cpu.host_has("avx512f") or backend == "avx2" and not cpu.host_has("avx2"):
        pytest.skip(f"this CPU has no {backend.upper()}")
    # The CPU forms compute each block exactly, a 2^-127 scale too; the generic form (portable, spirv)
    # computes 2^(s - 127) as one f32, which a flush-to-zero target (local-task) reads as 0 for s == 0
    # (blocks of at most 6 * 2^-127 = 3.5e-38 a weight), so only the CPU forms take the zero row.
    exact_zero_scale = backend in ("avx512", "avx2", "llvm-cpu")
    packed, scales = random_mxfp4(E, O, K, seed, zero_row=exact_zero_scale)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(N, J, K, generator=g)
    x[..., :32] *= 2.0 ** -20          # keeps the 2^127-scaled block finite (6 * 2^127 alone is 2e38)
    experts = torch.randint(0, E, (N, J), generator=g)
    if N == 1 and J > E:
        experts = experts.sort(-1).values          # the prefill's routed pairs, grouped by expert
    # rows through the last expert meet its row of 2^-127 scales: x * 2^100 keeps that output a normal
    # f32 (~2^-27), so a kernel that flushes 2^-127 to zero is seen (the other outputs stay below 2^115)
    if exact_zero_scale:
        last = experts == E - 1 if gathered else torch.arange(J).expand(N, J) == E - 1
        x[last] *= 2.0 ** 100
    types = [f"tensor<{N}x{J}x{K}xf32>", f"tensor<{E}x{O}x{K // 2}xi8>", f"tensor<{E}x{O}x{K // 32}xi8>"]
    if gathered:
        types.append(f"tensor<{N}x{J}xi64>")
    y_t = f"tensor<{N}x{J}x{O}xf32>"
    args = ", ".join(f"%a{i}: {t}" for i, t in enumerate(types))
    name, avx512, avx2 = LOWERINGS[backend]
    lowering = mxfp4_pass.choose_lowering(name, avx512, gathered, N, E, O, K, avx2=avx2)
    assert lowering.kind == {"avx512": "avx512", "avx2": "avx2",
                             "llvm-cpu": "llvm-cpu" if gathered or N > 1 else "generic"}.get(backend, "generic")
    text = mxfp4_pass.implementation("impl", N, J, K, O, E, gathered, lowering) + f"""
util.func public @main({args}) -> {y_t} {{
  %r = util.call @impl({", ".join(f"%a{i}" for i in range(len(types)))}) : ({", ".join(types)}) -> {y_t}
  util.return %r : {y_t}
}}"""
    vmfb = ic.compile_str(text, target_backends=["llvm-cpu"],
                          extra_args=["--iree-llvmcpu-target-cpu=host", "--iree-opt-level=O3"])
    config = rt.Config("local-task")
    context = rt.SystemContext(config=config)
    context.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    inputs = [x.numpy(), packed.numpy().view(np.int8), scales.numpy().view(np.int8)]
    if gathered:
        got = context.modules.module.main(*inputs, experts.numpy()).to_host()
        w = mxfp4.dequantize(packed[experts], scales[experts]).double()                 # [N, J, O, K], exact
    else:
        got = context.modules.module.main(*inputs).to_host()
        w = mxfp4.dequantize(packed, scales).double().unsqueeze(0).expand(N, J, O, K)     # row (n, j): expert j
    want = torch.einsum("njk,njok->njo", x.double(), w)
    magnitude = torch.einsum("njk,njok->njo", x.double().abs(), w.abs())               # sum |x w|
    return got, want.numpy(), magnitude.numpy()


# avx512, avx2: the table-lookup dispatch, 16 and 8 wide; llvm-cpu: the linalg kernels of CPUs with neither;
# portable: the CUDA/ROCm generic; spirv: the same with the scale bytes read out of 32-bit words; all run on CPU
@pytest.mark.parametrize("backend", ["avx512", "avx2", "llvm-cpu", "portable", "spirv"])
@pytest.mark.parametrize("N,J,K,O,E,gathered", [
    (1, 1, 64, 8, 4, True),          # one row: the CPU kernel's single-expert slice
    (1, 4, 128, 16, 8, True),        # decode: one token, its 4 experts
    (3, 2, 64, 8, 4, True),          # several tokens
    (5, 4, 96, 8, 4, False),         # prefill: each of the 4 experts on the 5 rows
    (1, 11, 64, 48, 3, True),        # sorted routed pairs: runs of one expert, shorter tails
    # K/32 blocks a whole number of vectors: the x86 dispatches build each row's scales before its loop
    # (16 blocks for AVX-512, 8 for AVX2), a row holding a scale of 0 takes the per-block form
    (1, 6, 512, 16, 3, True),        # the bench model's K, every expert (the extreme scales) used
    (1, 12, 256, 16, 3, True),       # runs, 8 blocks a row
], ids=["row", "decode", "tokens", "batched", "runs", "rows-k512", "runs-k256"])
def test_fused_implementation_matches_dequantise_then_matmul(N, J, K, O, E, gathered, backend):
    got, want, magnitude = run_fused(N, J, K, O, E, gathered, backend)
    # Against float64 on exact weights: an f32 sum of K products is off by at most ~K * 2^-24 of
    # sum |x w| in any order; we ask for 1e-6 of it (the order only changes which f32 roundings).
    err = (np.abs(got - want) / magnitude.clip(1e-300)).max()
    assert np.isfinite(got).all() and err < 1e-6, err


# ------------------------------------------------------------------------- whole modules
# f32 sums in another order, amplified by this random model's layers: measured 1.8e-6 (AVX-512 host)
# and 3.0e-6 (AVX2 host) between fused and unfused, 2.9e-6 between two valid builds of the unfused
# module alone. A bound that depended on the machine (a floor measured from two builds, 0 where they are
# the same code) failed on an AVX2 host; a decode error (a wrong code or scale) is 1e-2 or more.
FUSED_UNFUSED_TOL = 1e-5


def test_fused_and_unfused_modules_agree(compiled, tmp_path):
    fused, checkpoint = compiled("k3.1")
    module = json.loads((fused / "model.json").read_text())["module"]
    assert module["fused_units"]["weight_matmul"] >= 1
    # the manifest says when the host's module could not use the AVX-512 dispatch
    assert any("no AVX-512F" in note for note in module["fallbacks"]) != (cpu.host_has("avx512f") or cpu.host_has("avx2"))
    unfused = tmp_path / "unfused"
    assert kimi_compile([str(checkpoint), "-o", str(unfused), *COMPILE_ARGS, "--no-weight-fusion"]) == 0
    assert "weight_matmul" not in json.loads((unfused / "model.json").read_text())["module"]["fused_units"]
    ids = np.random.default_rng(4).integers(0, 256, 40).tolist()
    err = relative_error(module_logits(fused, ids), module_logits(unfused, ids))
    print(f"k3.1: MXFP4 fused vs unfused {err:.1e} (relative to max|logit|)")
    assert err < FUSED_UNFUSED_TOL, err


def one_unit(op: str, args: dict[str, str], results: list[str]) -> str:
    """torch IR of a function that calls the unit `op` once: its arguments {name: type} and result types."""
    params = ", ".join(f"%{n}: {t}" for n, t in args.items())
    names = [f"%r{i}" for i in range(len(results))]
    out = ", ".join(results) if len(results) == 1 else f"({', '.join(results)})"
    return f"""
func.func @main({params}) -> {out} {{
  {", ".join(names)} = torch.operator "torch.kimi.{op}"({", ".join(f"%{n}" for n in args)}) : ({", ".join(args.values())}) -> {out}
  return {", ".join(names)} : {", ".join(results)}
}}"""


@pytest.mark.parametrize("J,E,avx512,avx2,dispatch", [
    (12, 4, True, False, "kimi_bf16_x86_rows_N1_J12_K32_O8_E4_rows"),     # a prefill's pairs: runs to share
    (12, 4, False, True, "kimi_bf16_x86_rows_avx2_N1_J12_K32_O8_E4_rows"),
    (12, 4, False, False, None),                                          # aarch64: the linalg kernel
    (4, 8, True, False, "kimi_bf16_x86_pairs_R4_K32_O8_E8_block"),        # a decode step's k pairs: decode rows
    (4, 4, True, False, "kimi_bf16_x86_pairs_R4_K32_O8_E4_block"),        # per head: one row an expert
    (4, 8, False, True, "kimi_bf16_x86_pairs_avx2_R4_K32_O8_E8_block"),
    (4, 8, False, False, None),
])
def test_bf16_expert_rows_take_an_x86_dispatch(J, E, avx512, avx2, dispatch):
    ir = one_unit("dense_expert_matmul", {"x": "!torch.vtensor<[1,%d,32],f32>" % J, "w": "!torch.vtensor<[%d,8,32],bf16>" % E,
                                          "i": "!torch.vtensor<[1,%d],si64>" % J}, ["!torch.vtensor<[1,%d,8],f32>" % J])
    text = run_passes(ir, PassOptions(avx512=avx512, avx2=avx2)).mlir
    assert ("stream.executable" in text) == (dispatch is not None)
    if dispatch:
        assert f"flow.dispatch @{dispatch}_dispatch::@{dispatch}" in text
        assert f"vector<{16 if avx512 else 8}xi16>" in text


def block_scaled_unit_ir(N: int, J: int, K: int, E: int, gathered: bool, fmt: str = "fp8_e4m3_b128",
                         scales: str = "bf16") -> str:
    """torch IR of one FP8 or INT4 weight-matmul unit: N x J rows through experts (gathered) or E experts'
    columns; INT4 scales as `scales` (bf16, or si16 bits as SPIR-V takes them)."""
    O = 8
    x = f"!torch.vtensor<[{N},{J},{K}],f32>"
    if fmt == "fp8_e4m3_b128":
        w, s = f"!torch.vtensor<[{E},{O},{K}],ui8>", f"!torch.vtensor<[{E},1,{-(-K // 128)}],f32>"
    else:
        w, s = f"!torch.vtensor<[{E},{O},{-(-K // 8)}],si32>", f"!torch.vtensor<[{E},{O},{-(-K // 32)}],{scales}>"
    i = f"!torch.vtensor<[{N},{J}],si64>"
    args = {"x": x, "w": w, "s": s, **({"i": i} if gathered else {})}
    unit = "weight_expert_matmul" if gathered else "weight_batched_matmul"
    y = f"!torch.vtensor<[{N},{J},{O}],f32>"
    return f"""
func.func @main({", ".join(f"%{n}: {t}" for n, t in args.items())}) -> {y} {{
  %f = torch.constant.str "{fmt}"
  %r = torch.operator "torch.kimi.{unit}"({", ".join(f"%{n}" for n in args)}, %f) : ({", ".join(args.values())}, !torch.str) -> {y}
  return %r : {y}
}}"""


@pytest.mark.parametrize("N,J,K,E,gathered,avx512,avx2,dispatch,runs", [
    (1, 4, 256, 8, True, True, False, "kimi_fp8_x86_rows_R4_K256_O8_E8", False),       # a decode step's k pairs
    (1, 4, 256, 8, True, False, True, "kimi_fp8_x86_rows_avx2_R4_K256_O8_E8", False),
    (1, 4, 200, 8, True, False, True, "kimi_fp8_x86_rows_avx2_R4_K200_O8_E8", False),  # AVX2 takes K = 25 vectors
    (1, 4, 200, 8, True, True, False, None, False),                                     # ... AVX-512 does not
    (1, 1, 256, 1, False, True, False, "kimi_fp8_x86_rows_R1_K256_O8_E1", False),       # a linear layer's decode row
    (3, 4, 256, 8, True, True, False, "kimi_fp8_x86_rows_R12_K256_O8_E8", True),        # a prefill's pairs: runs
    (1, 12, 256, 4, True, False, True, "kimi_fp8_x86_rows_avx2_R12_K256_O8_E4", True),
    (3, 4, 256, 4, False, True, False, "kimi_fp8_x86_rows_R12_K256_O8_E4", False),      # per head on a block: runs
    (3, 1, 256, 1, False, True, False, "kimi_fp8_x86_rows_R3_K256_O8_E1", False),       # a linear layer's block
    (1, 4, 256, 8, True, False, False, None, False),                                    # aarch64: the linalg kernel
])
def test_fp8_rows_take_the_x86_dispatch(N, J, K, E, gathered, avx512, avx2, dispatch, runs):
    text = run_passes(block_scaled_unit_ir(N, J, K, E, gathered), PassOptions(avx512=avx512, avx2=avx2)).mlir
    assert ("fp8_x86_rows" in text) == (dispatch is not None)
    if dispatch:
        assert f"flow.dispatch @{dispatch}_rows_dispatch::@{dispatch}_rows" in text
        # codes widened through f16 (32 a step), never a dequantised weight
        assert "xf16>" in text and f"{E}x8x{K}xf32" not in text
        assert ("scf.while" in text) == runs                # the row walk (row_runs.mlir)


@pytest.mark.parametrize("N,J,K,E,gathered,scales,avx512,dispatch", [
    (1, 4, 256, 8, True, "bf16", True, "kimi_int4_x86_rows_R4_K256_O8_E8"),        # a decode step's k pairs
    (1, 4, 256, 8, True, "bf16", False, "kimi_int4_x86_rows_avx2_R4_K256_O8_E8"),
    (3, 4, 256, 8, True, "bf16", True, "kimi_int4_x86_rows_R12_K256_O8_E8"),       # a prefill's pairs: runs
    (3, 4, 256, 8, True, "bf16", False, "kimi_int4_x86_rows_avx2_R12_K256_O8_E8"),
    (1, 4, 240, 8, True, "bf16", True, None),                                      # K outside whole groups
    (1, 4, 256, 8, True, "si16", True, None),                                      # scales as bits: the generic
])
def test_int4_rows_take_the_x86_dispatch(N, J, K, E, gathered, scales, avx512, dispatch):
    ir = block_scaled_unit_ir(N, J, K, E, gathered, "int4_g32", scales)
    text = run_passes(ir, PassOptions(avx512=avx512, avx2=True)).mlir
    assert ("int4_x86_rows" in text) == (dispatch is not None)
    if dispatch:
        assert f"flow.dispatch @{dispatch}_rows_dispatch::@{dispatch}_rows" in text
        assert f"{E}x8x{K}xf32" not in text                  # no dequantised weight
        # each weight looked up in its group's table: AVX-512 one vpermps of 16, AVX2 two of 8 and a blend
        assert ('"llvm.x86.avx512.permvar.sf.512"' in text) == avx512
        assert ('"llvm.x86.avx2.permps"' in text and '"llvm.x86.avx.blendv.ps.256"' in text) == (not avx512)


@pytest.mark.parametrize("N,K,avx512,avx2,dispatch", [
    (13, 32, True, False, "kimi_bf16_x86_block_N13_K32_O8"),              # a prefill block: registers across K
    (13, 32, False, True, "kimi_bf16_x86_block_avx2_N13_K32_O8"),
    (13, 24, True, False, None),                                          # K outside AVX-512's vectors
    (13, 32, False, False, None),                                         # aarch64: the linalg kernel
    (1, 32, True, False, "kimi_bf16_x86_block_N1_K32_O8"),                # a decode row: lanes summed in the dispatch
    (1, 32, False, True, "kimi_bf16_x86_block_avx2_N1_K32_O8"),           # AVX2: two sums over alternate vectors
    (1, 24, False, True, "kimi_bf16_x86_block_avx2_N1_K24_O8"),           # AVX2, K = 3 vectors: one sum
])
def test_bf16_linear_blocks_take_the_x86_block_dispatch(N, K, avx512, avx2, dispatch):
    ir = one_unit("dense_batched_matmul", {"x": "!torch.vtensor<[%d,1,%d],f32>" % (N, K), "w": "!torch.vtensor<[1,8,%d],bf16>" % K},
                  ["!torch.vtensor<[%d,1,8],f32>" % N])
    text = run_passes(ir, PassOptions(avx512=avx512, avx2=avx2)).mlir
    assert ("x86_block" in text) == (dispatch is not None)
    if dispatch:
        assert f"flow.dispatch @{dispatch}_block_dispatch::@{dispatch}_block" in text


@pytest.mark.parametrize("unit,N,K,avx512,bf16_dot,rounded", [
    ("dense_batched_matmul", 13, 32, True, True, True),        # --bf16-activations: rows rounded, vdpbf16ps
    ("dense_batched_matmul", 13, 32, True, False, False),      # the default: exact
    ("dense_batched_matmul", 13, 48, True, True, False),       # K not whole pairs of vectors: exact
    ("dense_batched_matmul", 13, 32, False, True, False),      # AVX2 has no bf16 dot product: exact
    ("dense_exact_matmul", 13, 32, True, True, False),         # the indexer's projections: never rounded
    ("dense_batched_matmul", 1, 32, True, True, False),        # a decode row: memory-bound, kept exact
])
def test_bf16_dot_rounds_only_what_may_be_rounded(unit, N, K, avx512, bf16_dot, rounded):
    ir = one_unit(unit, {"x": "!torch.vtensor<[%d,1,%d],f32>" % (N, K), "w": "!torch.vtensor<[1,8,%d],bf16>" % K},
                  ["!torch.vtensor<[%d,1,8],f32>" % N])
    report = run_passes(ir, PassOptions(avx512=avx512, avx2=True, bf16_dot=bf16_dot))
    assert "x86_block" in report.mlir
    assert ("dpbf16ps" in report.mlir) == rounded and ("arith.truncf" in report.mlir) == rounded
    assert report.rewritten.get("dense_matmul_bf16_dot", 0) == rounded


@pytest.mark.parametrize("dv,avx512,avx2,dispatch", [
    (32, True, False, "kimi_kda_decode_x86_B1_H3_dk16_dv32"),             # 2 vectors of 16 a chunk
    (40, False, True, "kimi_kda_decode_x86_avx2_B1_H3_dk16_dv40"),        # 1 vector of 8
    (40, True, False, None),                                              # dv outside AVX-512's vectors
    (32, False, False, None),                                             # no AVX2: never emitted
])
def test_kda_decode_takes_the_x86_dispatch_or_names_the_unit(dv, avx512, avx2, dispatch):
    qt, vt, st = "!torch.vtensor<[1,3,16],f32>", "!torch.vtensor<[1,3,%d],f32>" % dv, "!torch.vtensor<[1,3,16,%d],f32>" % dv
    ir = one_unit("kda_decode", {"q": qt, "k": qt, "v": vt, "d": qt, "b": "!torch.vtensor<[1,3],f32>", "s": st}, [vt, st])
    if dispatch is None:
        with pytest.raises(PassError, match="kda_decode: no dispatch for dv"):
            run_passes(ir, PassOptions(avx512=avx512, avx2=avx2))
        assert not kda_decode_applies(dv, avx512) or not (avx512 or avx2)
        return
    assert kda_decode_applies(dv, avx512)
    report = run_passes(ir, PassOptions(avx512=avx512, avx2=avx2))
    assert report.rewritten["kda_decode"] == 1
    assert f"flow.dispatch @{dispatch}_step_dispatch::@{dispatch}_step" in report.mlir
