"""Block Attention Residuals: the op and the model's block bookkeeping against a direct reading of SPEC §4, and the
two-phase form (phase 1 over the block sums, online-softmax merge of the partial sum) against the plain softmax."""

import math

import pytest
import torch

from openk3.config import get_preset
from openk3.model import K3ForCausalLM, transformer
from openk3.model.attnres import COMPILABLE_PHASES, BlockStream
from openk3.ops.attnres import attn_res, attn_res_blocks, attn_res_merge


def attn_res_direct(sources, w, r, eps):
    """SPEC §4 read literally, one token at a time:
    keys_i = RMSNorm_noweight(v_i); score_i = sum_d r_d w_d keys_i[d]; h = sum_i softmax(score)_i v_i."""
    N = len(sources)
    B, T, D = sources[0].shape
    out = torch.zeros(B, T, D, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            scores = []
            for i in range(N):
                v = sources[i][b, t].double()
                rms = math.sqrt(sum(float(x) ** 2 for x in v) / D + eps)
                scores.append(sum(float(r[d]) * float(w[d]) * float(v[d]) / rms for d in range(D)))
            m = max(scores)
            e = [math.exp(s - m) for s in scores]
            for i in range(N):
                out[b, t] += e[i] / sum(e) * sources[i][b, t].double()
    return out


def test_op_matches_direct_reading():
    g = torch.Generator().manual_seed(0)
    D = 6
    sources = [torch.randn(2, 3, D, generator=g) * (i + 1) for i in range(4)]
    w, r = torch.randn(D, generator=g), torch.rand(D, generator=g) + 0.5
    out = attn_res(sources, w, r, eps=1e-5)
    assert torch.allclose(out.double(), attn_res_direct(sources, w, r, 1e-5), atol=1e-5)
    assert torch.allclose(attn_res(torch.stack(sources), w, r, eps=1e-5), out)


def test_zero_query_is_uniform_mean():
    sources = [torch.randn(1, 2, 4) for _ in range(3)]
    out = attn_res(sources, torch.zeros(4), torch.ones(4))
    assert torch.allclose(out, sum(sources) / 3, atol=1e-6)


def spread_attnres(model, std: float, norms: bool = True) -> None:
    """The model's AttnRes pseudo-queries drawn from N(0, std) (their init, zeros, mixes uniformly) and, with
    `norms`, its AttnRes norm weights from U(0.5, 1.5): a mix over depth far from uniform."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_res_proj" in name:
                p.normal_(0, std)
            elif norms and "_res_norm" in name:
                p.uniform_(0.5, 1.5)


def test_model_block_schedule_matches_spec():
    """K3Model's Block AttnRes equals SPEC §4 steps 1-4 written out here, with the sublayers as black boxes."""
    cfg = get_preset("k3-tiny").with_overrides({"attn_res_block_size": 3, "num_layers": 7, "mla_layers": [2, 6]})
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).double().eval()
    spread_attnres(model, std=1.0)
    ids = torch.randint(0, cfg.vocab_size, (2, 5))
    m = model.model
    mix = lambda srcs, proj, norm: attn_res_direct(srcs, proj.weight[0], norm.weight, norm.eps)
    with torch.no_grad():
        blocks, partial = [], m.embed_tokens(ids)
        for l, layer in enumerate(m.layers):
            x = mix(blocks + [partial], layer.attn_res_proj, layer.attn_res_norm) if blocks else partial
            opens = l % 3 == 0
            if opens:
                blocks.append(partial)
            h = layer.self_attn(layer.input_layernorm(x))
            partial = h if opens else partial + h
            x = mix(blocks + [partial], layer.mlp_res_proj, layer.mlp_res_norm)
            partial = partial + layer.mlp(layer.post_attention_layernorm(x))
        assert len(blocks) == 3  # embedding + blocks opened at layers 3 and 6
        expected = mix(blocks + [partial], m.output_res_proj, m.output_res_norm)
        got = m(ids)
    assert torch.allclose(got, expected, atol=1e-9)
    assert not hasattr(m.layers[0], "attn_res_proj")  # layer 0 has no attention AttnRes
    assert hasattr(m.layers[1], "attn_res_proj")


def two_phase_case(N, B, T, D, Q, seed, dtype, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    blocks = [torch.randn(B, T, D, generator=g, dtype=dtype) * 10.0 ** float(torch.randint(-3, 4, (1,), generator=g))
              for _ in range(N)]
    partial = torch.randn(B, T, D, generator=g, dtype=dtype) * 100
    w = torch.randn(Q, D, generator=g, dtype=dtype) * scale
    r = torch.rand(Q, D, generator=g, dtype=dtype) + 0.5
    return blocks, partial, w, r


def two_phase_all(blocks, partial, w, r, eps=1e-5):
    mixed = attn_res_blocks(blocks, r * w, eps)
    return torch.stack([attn_res_merge(mixed.mix[q], mixed.lse[q], partial, r[q] * w[q], eps)
                        for q in range(w.shape[0])])


def one_phase_all(blocks, partial, w, r, eps=1e-5):
    return torch.stack([attn_res(blocks + [partial], w[q], r[q], eps) for q in range(w.shape[0])])


def run_with_grads(fn, leaves, N, dy):
    leaves = [t.clone().requires_grad_() for t in leaves]
    out = fn(leaves[:N], *leaves[N:])
    out.backward(dy.to(out.dtype))
    return [out] + [t.grad for t in leaves]


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("N", [1, 2, 5])
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_two_phase_equals_one_phase(N, scale):
    """Phase 1 over the block sums for Q queries + the online-softmax merge of the partial sum equals the plain
    softmax over blocks + [partial]: outputs and the gradients of every input (blocks, partial, pseudo-queries, norm
    weights), for sources from 1e-3 to 1e3 in scale and queries large enough (scale 30) to saturate the softmax.
    In fp64 the two agree to 1e-12; in fp32 both are compared with fp64 and the two-phase error stays at the one-phase
    error's level (rounding noise differs between the two orders of operations by a small factor)."""
    blocks, partial, w, r = two_phase_case(N, 2, 3, 7, 4, seed=N, dtype=torch.float64, scale=scale)
    dy = torch.randn(4, 2, 3, 7, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    leaves = blocks + [partial, w, r]
    truth = run_with_grads(one_phase_all, leaves, N, dy)
    for a, b in zip(run_with_grads(two_phase_all, leaves, N, dy), truth):
        assert rel(a, b) <= 1e-12
    f32 = [t.float() for t in leaves]
    two, one = run_with_grads(two_phase_all, f32, N, dy), run_with_grads(one_phase_all, f32, N, dy)
    for a, b, t in zip(two, one, truth):
        assert torch.isfinite(a).all()
        assert rel(a, t) <= 4 * rel(b, t) + 3e-5


def test_two_phase_extremes():
    """The partial sum taking all the weight or none (scores far apart), and mixed source dtypes (a bf16 partial
    sum over fp32 blocks) give the one-phase result in the promoted dtype."""
    blocks, partial, w, r = two_phase_case(3, 1, 4, 8, 2, seed=11, dtype=torch.float32)
    w[0] = partial[0, 0] / partial[0, 0].norm() * 1e4  # token 0: the partial sum wins outright
    w[1] = -w[0]
    got, want = two_phase_all(blocks, partial, w, r), one_phase_all(blocks, partial, w, r)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
    assert torch.equal(got[0, 0, 0], partial[0, 0])
    half = partial.bfloat16()
    mixed = attn_res_blocks(blocks, r * w)
    out = attn_res_merge(mixed.mix[0], mixed.lse[0], half, r[0] * w[0],
                         dtype=torch.promote_types(torch.float32, half.dtype))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, attn_res(blocks + [half], w[0], r[0]), rtol=1e-5, atol=1e-3)


class OnePhaseStream:
    """The block bookkeeping before the two-phase form: every AttnRes is the plain softmax over blocks + [partial]."""

    def __init__(self, embedding, block_size, epochs, phases):
        self.blocks, self.partial, self.block_size = [], embedding, block_size

    def _mix(self, proj, norm):
        return attn_res(self.blocks + [self.partial], proj.weight[0], norm.weight, norm.eps)

    def attn_input(self, layer_idx, proj, norm, then):
        x = self.partial if not self.blocks else self._mix(proj, norm)
        self._opened = layer_idx % self.block_size == 0
        if self._opened:
            self.blocks.append(self.partial)
        return then(x)

    def add_attn(self, h):
        self.partial = h if self._opened else self.partial + h

    def mlp_input(self, proj, norm, then):
        return then(self._mix(proj, norm))

    def add_mlp(self, h):
        self.partial = self.partial + h

    def output(self, proj, norm):
        return self._mix(proj, norm)


@pytest.mark.parametrize("merge_kernel", [False, pytest.param(True, marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="runs the kernel on CPU tensors under the interpreter; on a GPU "
    "tests/test_triton_attnres.py checks it"))])
def test_model_two_phase_matches_one_phase(monkeypatch, merge_kernel):
    """K3Model with the two-phase stream (planned: one phase 1 per block; unplanned: one per AttnRes, as a caller
    that builds BlockStream(h, block_size) gets; planned with the phases compile_blocks compiles, run eagerly here:
    each residual add deferred into the next merge_norm, which with `merge_kernel` is the Triton pass each way
    that CUDA tensors take, here under the interpreter) vs the one-phase stream: logits and every parameter's
    gradient to fp32 rounding (block size 3 over 7 layers: three epochs, the last one short)."""
    if merge_kernel:
        import openk3.ops.attnres as ops_attnres

        monkeypatch.setattr(ops_attnres, "use_triton", lambda t, compiled=False: compiled)
    cfg = get_preset("k3-tiny").with_overrides({"attn_res_block_size": 3, "num_layers": 7, "mla_layers": [2, 6],
                                                "mtp_layers": 0})
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg)
    spread_attnres(model, std=0.3)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    unplanned = lambda h, block_size, epochs, phases: BlockStream(h, block_size)
    fused = lambda h, block_size, epochs, phases: BlockStream(h, block_size, epochs, COMPILABLE_PHASES)
    runs = []
    for stream in (transformer.BlockStream, unplanned, fused, OnePhaseStream):
        monkeypatch.setattr(transformer, "BlockStream", stream)
        model.zero_grad()
        logits = model(ids).logits
        logits.float().logsumexp(-1).sum().backward()
        runs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (a, ga) = runs[-1]
    for b, gb in runs[:-1]:
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert ga.keys() == gb.keys()
        for name in ga:  # atol scaled to the gradient's size: fp32 sums taken in another order differ there
            scale = max(1.0, ga[name].abs().max().item())
            torch.testing.assert_close(gb[name], ga[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_fp32_under_bf16_autocast():
    """AttnRes is an fp32 island (DESIGN.md): under a bf16 autocast its scores and mixes are the same fp32 values
    as without autocast (autocast would otherwise run their matmuls in bf16)."""
    torch.manual_seed(4)
    blocks = [torch.randn(3, 5, 64) * 10 for _ in range(4)]
    queries, partial = torch.randn(2, 64), torch.randn(3, 5, 64)
    want = attn_res_blocks(blocks, queries)
    want_merge = attn_res_merge(want.mix[0], want.lse[0], partial, queries[0])
    want_one = attn_res(blocks, queries[0], torch.ones(64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attn_res_blocks(blocks, queries)
        got_merge = attn_res_merge(got.mix[0], got.lse[0], partial, queries[0])
        got_one = attn_res(blocks, queries[0], torch.ones(64))
    for a, b in (*zip(got.mix + got.lse, want.mix + want.lse), (got_merge, want_merge), (got_one, want_one)):
        assert a.dtype == torch.float32 and torch.equal(a, b)

