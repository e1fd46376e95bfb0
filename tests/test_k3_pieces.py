"""K3's own pieces against small naive implementations written here from MODEL_SPEC ("K3 facts",
3.1, 3.2, 3.4, 3.6): loops and plain tensor ops, nothing shared with frontend/ but the modules'
weights. No installable oracle implements K3."""

import math

import pytest
import torch

from kimi_iree.frontend import load_model, parse_config
from kimi_iree.frontend.kda import KDA
from kimi_iree.frontend.layers import Step, gated_activation
from kimi_iree.frontend.mla import MLA
from kimi_iree.frontend.model import make_step
from kimi_iree.frontend import moe as moe_module
from kimi_iree.frontend.moe import MoE
from kimi_iree.frontend.synthetic import SIZES, text_config

TOL = dict(rtol=1e-4, atol=1e-5)   # fp32 throughout; only the order of sums differs


def k3_config(index=True):
    return parse_config({"model_type": "kimi_k3", "text_config": text_config(SIZES["tiny"], 6, "k3.1" if index else "k3")})


def randomise(module, seed=0, std=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if "norm" in name else 0.0))
        for name, b in module.named_buffers():
            if b.dtype == torch.uint8:
                b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))
    return module


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


# ---------------------------------------------------------------------------- SiTU
def test_situ_matches_the_formula():
    cfg = k3_config()
    gate, up = torch.randn(5, 7) * 6, torch.randn(5, 7) * 40
    got = gated_activation(gate, up, cfg)
    beta, lb = cfg.situ_beta, cfg.situ_linear_beta
    for i in range(5):
        for j in range(7):
            g, u = gate[i, j].item(), up[i, j].item()
            want = beta * math.tanh(g / beta) * sigmoid(g) * lb * math.tanh(u / lb)
            assert abs(got[i, j].item() - want) <= 1e-5 * max(1.0, abs(want))


# ---------------------------------------------------------------------------- KDA
def naive_kda(kda, a):
    """K3 KDA, token by token: conv + SiLU, l2norm, safe gate, delta rule, full-rank output gate."""
    cfg = kda.cfg
    B, T, D = a.shape
    H, d, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    proj = {x: a @ getattr(kda, f"{x}_proj").weight.t() for x in "qkv"}
    conv = {x: getattr(kda, f"{x}_conv")[:, 0, :] for x in "qkv"}          # [C, W]
    f = a @ kda.f_a_proj.weight.t() @ kda.f_b_proj.weight.t() + kda.dt_bias
    beta = torch.sigmoid(a @ kda.b_proj.weight.t())
    gate = a @ kda.g_proj.weight.t()
    out = torch.zeros(B, T, H * d)
    for b in range(B):
        S = [torch.zeros(d, d) for _ in range(H)]
        for t in range(T):
            vec = {}
            for x in "qkv":
                acc = torch.zeros(H * d)
                for j in range(W):                      # last tap = current token
                    src = t - (W - 1) + j
                    if src >= 0:
                        acc = acc + conv[x][:, j] * proj[x][b, src]
                vec[x] = acc * torch.sigmoid(acc)       # SiLU
            for h in range(H):
                sl = slice(h * d, (h + 1) * d)
                q = vec["q"][sl] / torch.sqrt((vec["q"][sl] ** 2).sum() + 1e-6) / math.sqrt(d)
                k = vec["k"][sl] / torch.sqrt((vec["k"][sl] ** 2).sum() + 1e-6)
                v = vec["v"][sl]
                g = cfg.kda_gate_lower_bound * torch.sigmoid(torch.exp(kda.A_log[h]) * f[b, t, sl])   # safe gate
                S[h] = torch.diag(torch.exp(g)) @ S[h]
                S[h] = S[h] + beta[b, t, h] * torch.outer(k, v - S[h].t() @ k)
                o = S[h].t() @ q
                o = o / torch.sqrt((o ** 2).mean() + cfg.rms_norm_eps) * kda.o_norm * torch.sigmoid(gate[b, t, sl])
                out[b, t, sl] = o
    return out @ kda.o_proj.weight.t()


def test_kda_safe_gate_and_full_rank_gate_match_naive():
    cfg = k3_config()
    assert cfg.kda_gate_lower_bound == -5.0 and cfg.kda_full_rank_gate
    kda = randomise(KDA(cfg))
    with torch.no_grad():
        kda.A_log.copy_(torch.tensor([0.5, 2.0]))
        a = torch.randn(2, 37, cfg.hidden_size, generator=torch.Generator().manual_seed(1))  # 37: > one chunk
        got, _ = kda(a, make_step(cfg, torch.zeros((), dtype=torch.int32), a.shape[1]), kda.init_state(2, a.shape[1]))
        want = naive_kda(kda, a)
    # relative to max|want| (about 5): the chunked form sums in another order than the token loop,
    # 7.2e-6 at worst over 100 random inputs; an elementwise atol of 1e-5 failed one input in 18
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-5


# ---------------------------------------------------------------------------- MLA
def naive_mla(mla, x):
    """q-LoRA, NoPE (rope dims kept, never rotated), expanded K/V, per-head causal softmax, output gate."""
    cfg = mla.cfg
    B, T, D = x.shape
    H, dn, dr, dv, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    qa = x @ mla.q_a_proj.weight.t()
    qa = qa / torch.sqrt((qa ** 2).mean(-1, keepdim=True) + 1e-6) * mla.q_a_norm.weight
    q = (qa @ mla.q_b_proj.weight.t()).view(B, T, H, dn + dr)
    kva = x @ mla.kv_a_proj.weight.t()
    c, k_pe = kva[..., :r], kva[..., r:]
    c = c / torch.sqrt((c ** 2).mean(-1, keepdim=True) + 1e-6) * mla.kv_a_norm.weight
    kv = (c @ mla.kv_b_proj.weight.t()).view(B, T, H, dn + dv)
    out = torch.zeros(B, T, H, dv)
    for b in range(B):
        for h in range(H):
            k = torch.cat([kv[b, :, h, :dn], k_pe[b]], dim=-1)                # [T, dn + dr]
            s = q[b, :, h] @ k.t() / math.sqrt(dn + dr)
            s = s.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
            out[b, :, h] = torch.softmax(s, -1) @ kv[b, :, h, dn:]
    o = out.reshape(B, T, H * dv) * torch.sigmoid(x @ mla.g_proj.weight.t())   # output gate before o_proj
    return o @ mla.o_proj.weight.t()


def test_mla_output_gate_with_nope_and_q_lora_matches_naive():
    cfg = k3_config(index=False)
    assert cfg.mla_use_nope and cfg.mla_output_gate and cfg.q_lora_rank
    mla = randomise(MLA(cfg, with_indexer=False))
    T = 9
    x = torch.randn(2, T, cfg.hidden_size)
    with torch.no_grad():
        step = Step(torch.arange(T)[None], (torch.ones(1, T, 4), torch.zeros(1, T, 4)))   # NoPE: the angles are unused
        got, _ = mla(x, step, mla.init_state(2, T))
        torch.testing.assert_close(got, naive_mla(mla, x), **TOL)


# ---------------------------------------------------------------------------- latent MoE
FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def naive_dequant(packed, scales):
    rows, half = packed.shape
    out = torch.zeros(rows, half * 2)
    for n in range(rows):
        for j in range(half):
            byte = int(packed[n, j])
            for idx, code in ((2 * j, byte & 15), (2 * j + 1, byte >> 4)):
                value = FP4[code & 7] * (-1 if code & 8 else 1)
                out[n, idx] = value * 2.0 ** (int(scales[n, idx // 32]) - 127)
    return out


def naive_situ(gate, up, cfg):
    beta, lb = cfg.situ_beta, cfg.situ_linear_beta
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * lb * torch.tanh(up / lb)


@pytest.mark.parametrize("pairs", [True, False], ids=["routed-pairs", "all-experts"])
def test_latent_moe_matches_naive(pairs, monkeypatch):
    """Both prefill forms (frontend/moe.py: the routed pairs, sorted by expert, or every expert on the
    block) and the one-token decode path against a per-token loop."""
    monkeypatch.setattr(moe_module, "routed_pairs_cheaper", lambda *args: pairs)
    cfg = k3_config()
    moe = randomise(moe_module.set_expert_format(MoE(cfg), "mxfp4"))
    with torch.no_grad():
        for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
            w.scales.copy_(torch.randint(118, 124, w.scales.shape, dtype=torch.uint8))   # O(0.01..0.1) weights
    h = torch.randn(6, cfg.hidden_size)
    experts = {(e, w): naive_dequant(getattr(moe.experts, w).packed[e], getattr(moe.experts, w).scales[e])
               for e in range(cfg.num_experts) for w in ("w1", "w2", "w3")}
    want = torch.zeros_like(h)
    for n in range(h.shape[0]):
        scores = torch.sigmoid(moe.router.weight @ h[n])
        choice = scores + moe.router.bias
        chosen = sorted(range(cfg.num_experts), key=lambda e: -choice[e].item())[: cfg.experts_per_token]
        weights = torch.stack([scores[e] for e in chosen])
        weights = weights / weights.sum() * cfg.routed_scaling_factor
        z = moe.latent_down.weight @ h[n]                       # into the routed_expert_hidden_size space
        routed = sum(wt * (experts[e, "w2"] @ naive_situ(experts[e, "w1"] @ z, experts[e, "w3"] @ z, cfg))
                     for wt, e in zip(weights, chosen))
        routed = routed / torch.sqrt((routed ** 2).mean() + cfg.rms_norm_eps) * moe.latent_norm.weight
        shared = moe.shared.down_proj.weight @ naive_situ(moe.shared.gate_proj.weight @ h[n],
                                                          moe.shared.up_proj.weight @ h[n], cfg)
        want[n] = moe.latent_up.weight @ routed + shared          # shared experts see the full hidden state
    with torch.no_grad():
        got = moe(h)
        torch.testing.assert_close(got, want, **TOL)
        got_decode = torch.cat([moe(h[n:n + 1]) for n in range(h.shape[0])])   # the gather path
        torch.testing.assert_close(got_decode, want, **TOL)


# ---------------------------------------------------------------------------- attention residuals
def naive_attn_res_forward(model, ids):
    """MODEL_SPEC's attention-residual bookkeeping, with the blocks' mixers and FFNs as black boxes."""
    cfg = model.cfg
    size = cfg.attn_res_block_size

    def mix(bank, cur, res):
        rows = bank + [cur]
        w = res.norm * res.proj[0]
        scores = torch.stack([(v / torch.sqrt((v ** 2).mean(-1, keepdim=True) + cfg.rms_norm_eps)) @ w for v in rows])
        p = torch.softmax(scores, dim=0)
        return sum(p[n].unsqueeze(-1) * rows[n] for n in range(len(rows)))

    state = model.init_state(ids.shape[0], ids.shape[1])
    step = Step(torch.arange(ids.shape[1])[None], (torch.ones(1, ids.shape[1], 4), torch.zeros(1, ids.shape[1], 4)))  # NoPE
    bank, prefix = [], model.embed(ids)
    for i, block in enumerate(model.layers):
        x_in = mix(bank, prefix, block.attn_res) if bank else prefix
        restart = i % size == 0
        if restart:
            bank.append(prefix)
        a, _ = block.mix(x_in, step, model.layer_state(state, i))
        prefix = a if restart else prefix + a
        prefix = prefix + block.ffn(block.ffn_norm(mix(bank, prefix, block.ffn_res)))
    h = model.norm(mix(bank, prefix, model.output_res))
    return h @ model.lm_head.weight.t()


@pytest.mark.parametrize("layers", [4, 6])   # block size 2: 2 and 3 blocks
def test_attention_residuals_match_naive(tmp_path, layers):
    from kimi_iree.frontend.synthetic import write_synthetic_checkpoint
    model = load_model(write_synthetic_checkpoint(tmp_path / "k3", variant="k3", num_layers=layers))
    assert model.cfg.attn_res_block_size == 2
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), naive_attn_res_forward(model, ids), **TOL)


def test_k3_a_log_gate_reads_the_first_num_heads_entries(tmp_path):
    from kimi_iree.frontend.synthetic import write_synthetic_checkpoint
    from safetensors import safe_open
    ckpt = write_synthetic_checkpoint(tmp_path / "k3", variant="k3", num_layers=2)
    model = load_model(ckpt)
    name = "language_model.model.layers.0.self_attn.A_log"
    for f in ckpt.glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            if name in s.keys():
                stored = s.get_tensor(name)
    kda = model.layers[0].mixer
    assert stored.shape == (model.cfg.kda_head_dim,) and model.cfg.kda_num_heads < model.cfg.kda_head_dim
    assert torch.equal(kda.A_log, stored)                      # kept as published
    g = kda.log_decay(torch.zeros(1, 1, model.cfg.hidden_size))
    rate = stored[: model.cfg.kda_num_heads].exp().view(1, 1, -1, 1)
    torch.testing.assert_close(g, -5.0 * torch.sigmoid(rate * kda.dt_bias.view(1, 1, 2, -1)))



def test_bf16_bits_and_words_widen_to_the_stored_values():
    """SPIR-V reads bf16 weights as int16 bits, or as int32 words of two values where the target has no
    16-bit storage (the element order of a little-endian view)."""
    from kimi_iree.frontend.layers import widen_to_f32
    w = (torch.randn(3, 8) * torch.logspace(-30, 30, 8)).to(torch.bfloat16)
    w[0, :2] = torch.tensor([-0.0, float("inf")])
    bits = w.view(torch.int16)
    assert torch.equal(widen_to_f32(bits), w.float()) and torch.equal(widen_to_f32(bits.view(torch.int32)), w.float())
