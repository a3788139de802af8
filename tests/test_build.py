"""Start-up of a model on its device (`model.on_device.construct`, `openk3.build`): construction on the device in
the target dtype gives the eager build's weights to the bit under the same seed (fp32 and bf16, three topologies,
the vision tower included), each decoder layer is cast before the next one is built (the bound on peak memory),
MXFP4 experts packed during construction equal the bf16 model's experts packed afterwards, and the start-up errors
(`--quantization mxfp4` without experts, weights that do not fit) are one line naming the need."""

from __future__ import annotations

import pytest
import torch

from openk3 import build
from openk3.build import build_model, check_fits, weight_bytes
from openk3.config import get_preset
from openk3.model import K3ForCausalLM
from openk3.model.on_device import construct
from openk3.model.transformer import DecoderLayer
from openk3.quant.packed_experts import PackedExperts, quantize_experts_
from test_packed_experts import tiny_kimi_linear

CONFIGS = {"k3-tiny": lambda: get_preset("k3-tiny"), "k3-tiny-vl": lambda: get_preset("k3-tiny-vl"),
           "kimi-linear-tiny": tiny_kimi_linear}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_construct_gives_the_eager_weights(name, dtype):
    cfg = CONFIGS[name]()
    torch.manual_seed(5)
    eager = K3ForCausalLM(cfg)
    eager = eager.to(dtype) if dtype is not None else eager
    torch.manual_seed(5)
    built = construct(cfg, "cpu", dtype)
    want, got = eager.state_dict(), built.state_dict()
    assert list(got) == list(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key
    assert built.model.layers[0].self_attn.A_log.dtype == torch.float32  # KeepFp32 tensors stay fp32
    if cfg.tie_embeddings:
        assert built.lm_head.weight is built.model.embed_tokens.weight


def test_each_layer_is_cast_before_the_next_is_built(monkeypatch):
    """When decoder layer i + 1 starts, layer i's tensors already have their final dtypes: the fp32 the
    constructors create lives for one layer at a time."""
    built, snapshots = [], []
    original = DecoderLayer.__init__

    def init(self, *args, **kwargs):
        if built:
            snapshots.append({n: t.dtype for n, t in built[-1].state_dict().items()})
        original(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(DecoderLayer, "__init__", init)
    construct(get_preset("k3-tiny"), "cpu", torch.bfloat16)
    assert len(snapshots) == len(built) - 1 >= 8
    for layer, seen in zip(built, snapshots):
        final = {n: t.dtype for n, t in layer.state_dict().items()}
        assert seen == final and torch.bfloat16 in final.values()


def test_mxfp4_build_packs_what_quantize_experts_packs():
    cfg = get_preset("k3-tiny")
    torch.manual_seed(1)
    want = K3ForCausalLM(cfg).to(torch.bfloat16)
    memory = quantize_experts_(want)
    torch.manual_seed(1)
    model, report = build_model(cfg, "cpu", torch.bfloat16, quantization="mxfp4")
    assert not model.training
    got, expected = model.state_dict(), want.state_dict()
    assert list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    assert sum(isinstance(m, PackedExperts) for m in model.modules()) == memory.modules
    assert list(report.phases) == ["plan", "construct", "quantize"]
    assert report.experts_bytes == (memory.bytes_before, memory.bytes_after)
    assert report.weights_bytes == weight_bytes(model)[0]
    assert "MXFP4" in report.line() and report.line().startswith("model on cpu in ")


def test_estimate_is_what_the_build_holds():
    cfg = tiny_kimi_linear()
    for quantization in (None, "mxfp4"):
        with torch.device("meta"):
            meta = K3ForCausalLM(cfg).to(torch.bfloat16)
        model, report = build_model(cfg, "cpu", torch.bfloat16, quantization=quantization)
        assert weight_bytes(meta, quantization == "mxfp4") == weight_bytes(model)
        assert report.weights_bytes == weight_bytes(model)[0]


def test_startup_errors(monkeypatch):
    dense = get_preset("k3-tiny").with_overrides({"name": "dense-tiny", "moe": None})
    with pytest.raises(ValueError, match=r"^--quantization mxfp4 keeps routed MoE experts packed, but model "
                                         r"'dense-tiny' has none \(config field 'moe' is None\)$"):
        build_model(dense, "cpu", quantization="mxfp4")
    with pytest.raises(ValueError, match=r"^quantization \(--quantization\) must be one of none, mxfp4 \(or unset: "
                                         r"as stored\), got 'int4'$"):
        build_model(dense, "cpu", quantization="int4")
    monkeypatch.setattr(build, "free_bytes", lambda device: 3 << 20)
    with pytest.raises(ValueError, match=r"^the weights do not fit: they need 11\.\d MiB and cpu has 3\.0 MiB free "
                                         r"\(with --quantization mxfp4: 9\.\d MiB\)$"):
        build_model(get_preset("k3-tiny"), "cpu")
    small = dense.with_overrides({"vocab_size": 256})
    with torch.device("meta"):
        need = weight_bytes(K3ForCausalLM(small))[0]
    monkeypatch.setattr(build, "free_bytes", lambda device: need + (1 << 19))
    build_model(small, "cpu")  # the weights alone fit, with the reserve they do not:
    with pytest.raises(ValueError, match=r"^the weights and 1\.0 MiB reserved do not fit: they need "
                                         f"{(need + (1 << 20)) / (1 << 20):.1f} MiB and cpu has"):
        build_model(small, "cpu", reserve_bytes=1 << 20)
    check_fits(2 << 20, "cpu")  # fits
