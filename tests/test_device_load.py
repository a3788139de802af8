"""Checkpoints read shard by shard onto a device (`interop.device_load`, `openk3.build.load_model`) against
`load_pretrained`: the K3 and the hub layouts, sharded so that experts straddle shards, tied embeddings, plain and
MXFP4-stored experts, each kept as stored, dequantized or packed; one shard open at a time; the fit check before any
weight is read; and the errors."""

from __future__ import annotations

import pytest
import torch

from openk3 import build
from openk3.build import load_model
from openk3.config import get_preset
from openk3.interop import device_load, load_pretrained, save_pretrained
from openk3.interop.device_load import load_to_device
from openk3.model.moe import Experts
from openk3.quant.packed_experts import PackedExperts, quantize_experts_
from test_interop_k3 import random_model
from test_packed_experts import tiny_kimi_linear

CASES = {  # layout, config, shard size (bytes)
    "k3-tied": ("k3", lambda: get_preset("k3-tiny").with_overrides({"tie_embeddings": True}), 300_000),
    "hub": ("hub", tiny_kimi_linear, 40_000),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{(case, stored quantization): directory}."""
    out = {}
    for case, (layout, config, shard) in CASES.items():
        model = random_model(config(), seed=3)
        for stored in (None, "mxfp4"):
            path = tmp_path_factory.mktemp(f"{case}-{stored}")
            save_pretrained(model, path, layout=layout, max_shard_bytes=shard, quantization=stored)
            out[case, stored] = path
    return out


def plain_state(model) -> dict[str, torch.Tensor]:
    return {k: t for k, t in model.state_dict().items() if ".experts." not in k}


@pytest.mark.parametrize("quantization", [None, "none", "mxfp4"])
@pytest.mark.parametrize("stored", [None, "mxfp4"])
@pytest.mark.parametrize("case", list(CASES))
def test_loads_what_load_pretrained_loads(checkpoints, case, stored, quantization, monkeypatch):
    path = checkpoints[case, stored]
    opened, open_now = [], []
    real_open = device_load.safe_open

    class Shard:  # safe_open, recording that shards are opened one at a time, each once
        def __init__(self, file, framework, device):
            self.inner = real_open(file, framework, device=device)
            opened.append(file)

        def __enter__(self):
            open_now.append(self)
            assert len(open_now) == 1
            return self.inner.__enter__()

        def __exit__(self, *exc):
            open_now.remove(self)
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(device_load, "safe_open", Shard)
    want = load_pretrained(path)
    got, phases = load_to_device(path, "cpu", quantization=quantization)
    assert len(opened) == len(set(opened)) == len(list(path.glob("*.safetensors"))) > 1
    assert not got.training and got.model.layers[0].self_attn.A_log.dtype == torch.float32
    expected = plain_state(want)
    assert list(plain_state(got)) == list(expected)
    assert all(t.dtype == expected[k].dtype and torch.equal(t, expected[k]) for k, t in plain_state(got).items())
    if got.config.tie_embeddings:
        assert got.lm_head.weight is got.model.embed_tokens.weight
    packed = quantization == "mxfp4" or (quantization is None and stored == "mxfp4")
    assert list(phases) == ["plan", "read"] + (["quantize"] if packed and stored is None else [])
    for name, module in want.named_modules():
        if not isinstance(module, Experts):
            continue
        mine = got.get_submodule(name)
        if not packed:
            assert type(mine) is Experts
            assert torch.equal(mine.gate_up_proj, module.gate_up_proj) and torch.equal(mine.down_proj, module.down_proj)
            continue
        assert isinstance(mine, PackedExperts)
        if stored == "mxfp4":  # the stored bytes as they are: their values are what load_pretrained dequantizes
            gate_up, down = mine.dequantized(module.gate_up_proj.dtype)
            assert torch.equal(gate_up, module.gate_up_proj) and torch.equal(down, module.down_proj)
    if packed and stored is None:  # packed on loading: what quantize_experts_ makes of load_pretrained's model
        quantize_experts_(want)
        assert all(torch.equal(t, want.state_dict()[k]) for k, t in got.state_dict().items())


def test_fit_check_runs_before_any_weight_is_read(checkpoints, monkeypatch):
    path = checkpoints["k3-tied", "mxfp4"]
    reads = []
    monkeypatch.setattr(device_load, "safe_open", lambda *a, **k: reads.append(a))
    monkeypatch.setattr(build, "free_bytes", lambda device: 1 << 20)
    with pytest.raises(ValueError, match=r"^the weights do not fit: they need [\d.]+ MiB and cpu has 1\.0 MiB free$"):
        load_model(path, "cpu")
    assert not reads
    monkeypatch.undo()
    model, report = load_model(path, "cpu", dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert report.experts_bytes[1] < report.experts_bytes[0] / 3 and "MXFP4" in report.line()


def test_errors(checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"quantization \(--quantization\) must be one of"):
        load_to_device(checkpoints["k3-tied", None], "cpu", quantization="fp8")
    dense = get_preset("k3-tiny").with_overrides({"name": "dense-tiny", "moe": None})
    save_pretrained(random_model(dense, seed=1), tmp_path)
    with pytest.raises(ValueError, match=r"model 'dense-tiny' has none \(config field 'moe' is None\)"):
        load_to_device(tmp_path, "cpu", quantization="mxfp4")
    with pytest.raises(ValueError, match="no config.json"):
        load_to_device(tmp_path / "missing", "cpu")
