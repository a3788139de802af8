"""Block Attention Residuals: the op and the model's block bookkeeping against a direct reading of SPEC §4."""

import math

import torch

from openk3.config import get_preset
from openk3.model import K3ForCausalLM
from openk3.ops.attnres import attn_res


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


def test_model_block_schedule_matches_spec():
    """K3Model's Block AttnRes equals SPEC §4 steps 1-4 written out here, with the sublayers as black boxes."""
    cfg = get_preset("k3-tiny").with_overrides({"attn_res_block_size": 3, "num_layers": 7, "mla_layers": [2, 6]})
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_res_proj" in name:
                p.normal_(0, 1.0)
            elif "_res_norm" in name:
                p.uniform_(0.5, 1.5)
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
