"""Incremental decoding with the hybrid cache equals one full forward (fp32, tight tolerance), for K3-style and
Kimi-Linear-style models, including ragged batches, chunked prefill, extract / from_sequences and cut + restore."""

import math

import pytest
import torch

from openk3.cache import HybridCache, KDAState, MLAState, SequenceState
from openk3.config import get_preset
from openk3.model import K3ForCausalLM

TINY_OVERRIDES = {"vocab_size": 97, "hidden_size": 48, "dense_hidden": 64,
                  "kda": {"num_heads": 3, "head_dim": 8},
                  "mla": {"num_heads": 3, "q_lora_rank": 24, "kv_lora_rank": 12, "qk_nope_head_dim": 8,
                          "qk_rope_head_dim": 4, "v_head_dim": 6},
                  "moe": {"num_experts": 6, "top_k": 2, "expert_hidden": 16, "latent_dim": 24}}


def kimi_tiny():
    return get_preset("kimi-linear-48b").with_overrides({
        "vocab_size": 97, "hidden_size": 48, "num_layers": 5, "mla_layers": [1, 4], "dense_hidden": 64,
        "kda": {"num_heads": 3, "head_dim": 8},
        "mla": {"num_heads": 3, "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6},
        "moe": {"num_experts": 6, "top_k": 2, "expert_hidden": 16, "num_shared_experts": 1},
    })


CONFIGS = {
    "k3-tiny": lambda: get_preset("k3-tiny"),
    "k3-small-mla-first": lambda: get_preset("k3-tiny").with_overrides(
        {**TINY_OVERRIDES, "num_layers": 6, "mla_layers": [0, 5], "attn_res_block_size": 4,
         "mla": {**TINY_OVERRIDES["mla"], "output_norm": True}}),
    "kimi-tiny": kimi_tiny,
}


def randomize(model: K3ForCausalLM, seed: int = 0) -> K3ForCausalLM:
    """O(1) activations everywhere so that the comparisons below are meaningful."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")) or "conv1d" in name:
                continue
            if name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            else:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        for _, router in model.routers():
            router.e_score_correction_bias.copy_(torch.randn(router.num_experts, generator=g) * 0.1)
    return model.eval()


def build(name, seed=0):
    torch.manual_seed(seed)
    return randomize(K3ForCausalLM(CONFIGS[name]()), seed)


def assert_close(a, b, tol=5e-5):
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), f"max |diff| {err} (scale {b.abs().max().item()})"


@pytest.mark.parametrize("name,dtype", [(n, torch.float32) for n in CONFIGS] + [("k3-tiny", torch.float64)])
def test_prefill_then_steps_equals_full_forward(name, dtype):
    """Prefill 20 tokens, a 5-token chunk, then 12 single steps; fp32 to fp32 round-off, fp64 to 1e-10."""
    model = build(name).to(dtype)
    V = model.config.vocab_size
    ids = torch.randint(0, V, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(2)
        pieces = [model(ids[:, :20], cache=cache).logits, model(ids[:, 20:25], cache=cache).logits]
        for t in range(25, 37):
            pieces.append(model(ids[:, t : t + 1], cache=cache).logits)
    assert cache.lengths.tolist() == [37, 37]
    assert_close(torch.cat(pieces, 1), full, tol=5e-5 if dtype == torch.float32 else 1e-10)


@pytest.mark.parametrize("name", ["k3-tiny", "kimi-tiny"])
def test_ragged_batch_decode(name):
    """Sequences of different lengths, prefilled alone, merged, then decoded together one token at a time."""
    model = build(name, seed=2)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (5, 17, 1, 11)]
    steps = 6
    new_tokens = torch.randint(0, V, (len(prompts), steps), generator=g)
    with torch.no_grad():
        states, last = [], []
        for p in prompts:
            c = model.new_cache(1)
            last.append(model(p[None], cache=c).logits[0, -1])
            states.append(c.extract(0))
        cache = HybridCache.from_sequences(states)
        assert cache.lengths.tolist() == [5, 17, 1, 11]
        step_logits = [torch.stack(last)]
        for s in range(steps):
            step_logits.append(model(new_tokens[:, s : s + 1], cache=cache).logits[:, 0])
        for i, p in enumerate(prompts):
            full = model(torch.cat([p, new_tokens[i]])[None]).logits[0, len(p) - 1 :]
            assert_close(torch.stack([sl[i] for sl in step_logits]), full)


def test_extract_from_sequences_roundtrip_and_clone():
    model = build("k3-tiny", seed=4)
    ids = torch.randint(0, model.config.vocab_size, (3, 12))
    with torch.no_grad():
        cache = model.new_cache(3)
        model(ids[:, :9], cache=cache)
        states = [cache.extract(i) for i in range(3)]
        backup = [s.clone() for s in states]
        rebuilt = HybridCache.from_sequences(states)
        a = model(ids[:, 9:], cache=cache).logits
        b = model(ids[:, 9:], cache=rebuilt).logits
        assert torch.equal(a, b)
        # extract() and clone() are copies: decoding did not touch them
        for s, bk in zip(states, backup):
            for x, y in zip(s.layers, bk.layers):
                kda = isinstance(x, KDAState)
                tensors = (x.conv, y.conv, x.recurrent, y.recurrent) if kda else (x.latent, y.latent)
                for u, v in zip(tensors[::2], tensors[1::2]):
                    assert torch.equal(u, v)
    s = states[0]
    kinds = ["mla" if i in model.config.mla_layers else "kda" for i in range(model.config.num_layers)]
    assert [("mla" if isinstance(x, MLAState) else "kda") for x in s.layers] == kinds
    H, K, W = model.config.kda.num_heads, model.config.kda_head_dim, model.config.kda.conv_kernel
    assert s.layers[0].recurrent.shape == (H, K, K) and s.layers[0].recurrent.dtype == torch.float32
    assert s.layers[0].conv.shape == (3 * H * K, W - 1)
    m = model.config.mla
    assert s.layers[3].latent.shape == (9, m.kv_lora_rank + m.qk_rope_head_dim)
    assert s.length == 9 and s.nbytes() > 0


def test_cut_at_checkpoint_restores_exactly():
    """Checkpoint the KDA states at 16 tokens, run on to 30, then cut the MLA latents back to 16 and resume."""
    model = build("k3-tiny", seed=5)
    ids = torch.randint(0, model.config.vocab_size, (1, 30))
    with torch.no_grad():
        cache = model.new_cache(1)
        model(ids[:, :16], cache=cache)
        checkpoint = cache.extract(0).kda_states()
        ref = model(ids[:, 16:], cache=cache).logits
        s30 = cache.extract(0)
        with pytest.raises(ValueError, match="KDA checkpoint"):
            s30.cut(16)
        s16 = s30.cut(16, checkpoint)
        assert s16.length == 16
        resumed = HybridCache.from_sequences([s16])
        got = model(ids[:, 16:], cache=resumed).logits
        assert_close(got, ref, tol=1e-6)
        # assemble from parts gives the same state
        s16b = SequenceState.assemble(16, checkpoint, {i: st.cut(16) for i, st in s30.mla_states().items()})
        got2 = model(ids[:, 16:], cache=HybridCache.from_sequences([s16b])).logits
        assert torch.equal(got, got2)
    assert s30.cut(30).length == 30  # cutting at the full length keeps the KDA states


def test_mtp_logits_shape_and_causality():
    model = build("k3-tiny", seed=6)
    V = model.config.vocab_size
    ids = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        out = model(ids)
        assert out.logits.shape == (2, 10, V)
        assert out.mtp_logits.shape == (2, 9, V)
        # position t reads tokens <= t+1 only: changing token 6 leaves positions 0..4 unchanged
        ids2 = ids.clone()
        ids2[:, 6] = (ids2[:, 6] + 1) % V
        out2 = model(ids2)
        assert torch.allclose(out.mtp_logits[:, :5], out2.mtp_logits[:, :5], atol=1e-4)
        assert not torch.allclose(out.mtp_logits[:, 5], out2.mtp_logits[:, 5])
        # and it equals the MTP layer applied by hand
        layer = model.mtp[0]
        h = layer(out.hidden_states[:, :-1], model.model.embed_tokens(ids[:, 1:]))
        assert torch.allclose(model.lm_head(layer.norm(h)), out.mtp_logits, atol=1e-5)
        assert model(ids, cache=model.new_cache(2)).mtp_logits is None
        assert model(ids, logits_to_keep=1).logits.shape == (2, 1, V)
    kimi = build("kimi-tiny")
    assert kimi(ids % kimi.config.vocab_size).mtp_logits is None


@pytest.mark.parametrize("offsets", [(5, 16, 29), (16, 32)])  # split calls; one chunked call (chunk multiples)
@pytest.mark.parametrize("name", ["k3-tiny", "kimi-tiny"])
def test_checkpoints_inside_one_forward_equal_separate_forwards(name, offsets):
    """KDA states recorded at offsets inside one prefill forward equal the states after forwards that stop there,
    and requesting checkpoints does not change the logits (fp64, so only the logic is compared, not rounding)."""
    model = build(name, seed=3).double()
    ids = torch.randint(0, model.config.vocab_size, (2, 40))

    whole = model.new_cache(2)
    whole.checkpoint_offsets = offsets
    logits = model(ids, cache=whole).logits
    assert whole.checkpoint_offsets == ()  # consumed by the forward

    torch.testing.assert_close(model(ids, cache=model.new_cache(2)).logits, logits, rtol=1e-9, atol=1e-9)
    for offset in offsets:
        stepped = model.new_cache(2)
        model(ids[:, :offset], cache=stepped)
        recorded = whole.checkpoints[offset]
        assert sorted(recorded) == list(model.config.kda_layers)
        for i, layer in recorded.items():
            torch.testing.assert_close(layer.conv_state, stepped.layers[i].conv_state, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(layer.recurrent_state, stepped.layers[i].recurrent_state, rtol=1e-9, atol=1e-9)
