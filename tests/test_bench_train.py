"""bench/train.py: what can be checked without a GPU (the GPU run itself is the lead's, on an H200)."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench_run import run_bench
from openk3.config import get_preset

BENCH = Path(__file__).resolve().parents[1] / "bench" / "train.py"
TOY = {"vocab_size": 256, "hidden_size": 32, "num_layers": 2, "mla_layers": [1], "dense_hidden": 32,
       "attn_res_block_size": 1, "kda": {"num_heads": 2, "head_dim": 16},
       "mla": {"num_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
               "v_head_dim": 16},
       "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 16, "latent_dim": 16}}


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_train", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_gpu_mode_without_cuda_is_one_line_error():
    run = subprocess.run([sys.executable, str(BENCH), "gpu"], capture_output=True, text=True, env=dict(os.environ))
    assert run.returncode != 0
    assert run.stderr.strip().splitlines() == ["bench/train.py gpu needs a CUDA device"]


def test_top_kernels_shares():
    """The profile summary: the heaviest entries first, each with its share of the device's total time; a
    record_function range around them is not one of them."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    bench = load_bench()
    a = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("a range over the kernels"):
        for _ in range(3):
            (a @ a).relu().sum()
    rows = bench.top_kernels(prof, rows=3, device_type=DeviceType.CPU)
    assert all(r["kernel"] != "a range over the kernels" for r in bench.top_kernels(prof, 10**9, DeviceType.CPU))
    assert len(rows) == 3 and [r["ms"] for r in rows] == sorted((r["ms"] for r in rows), reverse=True)
    everything = bench.top_kernels(prof, rows=10**9, device_type=DeviceType.CPU)
    assert abs(sum(r["share"] for r in everything) - 1) < 1e-6
    assert all(0 < r["share"] <= 1 and r["calls"] >= 1 for r in rows)


def bench_on_cpu(monkeypatch, tmp_path):
    """bench/train.py pointed at the CPU with a toy k3-tiny, its JSON written under tmp_path."""
    bench = load_bench()
    toy = get_preset("k3-tiny").with_overrides(TOY)
    monkeypatch.setattr(bench, "get_preset", lambda name: toy)
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "HERE", tmp_path)
    return bench


def test_optim_mode_logic_on_cpu(monkeypatch, tmp_path, capsys):
    """`optim` on the CPU stand-ins: AdamW, Muon and Muon in PyTorch passes, each row's cost over AdamW, the table
    printed last."""
    bench = bench_on_cpu(monkeypatch, tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "optim", "--steps", "2", "--warmup", "1", "--batch-size", "1",
                                      "--seq-len", "32"])
    bench.main()
    data = json.loads((tmp_path / "train_optim.json").read_text())
    rows = data["results"]
    assert [r["optimizer"] for r in rows] == ["adamw", "muon", "muon-pytorch"]
    assert rows[0]["over_adamw_ms"] == 0 and all(r["step_ms"] > 0 for r in rows)
    assert rows[1]["over_adamw_ms"] == rows[1]["step_ms"] - rows[0]["step_ms"]
    assert rows[0]["train_over_adamw"] == 0 and all(r["train_step_ms"] > 0 for r in rows)
    assert data["env"]["parameters"] > 0
    assert "top_kernels" in data["profile_muon"] and "top_kernels" in data["profile_muon_pytorch"]
    last = capsys.readouterr().out.strip().splitlines()
    assert last[-5].startswith("| optimizer | step alone (ms)") and last[-1].startswith("| muon-pytorch |")


def test_gpu_smoke_runs_every_row(tmp_path):
    """`gpu --smoke --json PATH`: the whole gpu mode on the CPU at toy sizes, every row kind (the k3 variants but the
    CUDA graph, the dense model eager and compiled, k3 on packed documents, `openk3 train`'s defaults) with a finite
    positive step time and its ratios, the profile and MLA sections, the targets line and the results table last,
    and nothing written to the committed bench/train_gpu.json."""
    committed = BENCH.parent / "train_gpu.json"
    before = committed.read_bytes() if committed.exists() else None
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as CI's command runs: torch paths
    data, stdout = run_bench("train.py", "gpu", "--smoke", out=tmp_path / "smoke.json", env=env)
    rows = {(r["kind"], r["optimizer"], r["variant"]) for r in data["results"]}
    assert rows == {("k3", "adamw", "eager"), ("k3", "adamw", "act. ckpt"), ("k3", "muon", "eager"),
                    ("k3", "adamw", "compile"), ("dense", "adamw", "eager, fused loss"),
                    ("dense", "adamw", "eager, plain loss"), ("dense", "adamw", "compile, fused loss"),
                    ("packed", "adamw", "compile, packed"),
                    ("cli-default", "muon", "openk3 train defaults (eager, packing docs)")}
    for r in data["results"]:
        assert math.isfinite(r["step_ms"]) and r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["mfu"] > 0
        assert 0 < r["median_step_ms"] <= r["step_ms"] * data["env"]["steps"]  # a step of the timed ones
        assert r["vs_dense_compiled"] == pytest.approx(r["step_ms"] / rows_of(data, "dense")[-1]["step_ms"])
    packed, cli = rows_of(data, "packed")[0], rows_of(data, "cli-default")[0]
    compiled = next(r for r in rows_of(data, "k3") if r["variant"] == "compile")
    assert packed["vs_unpacked"] == pytest.approx(packed["step_ms"] / compiled["step_ms"])
    assert packed["vs_unpacked_median"] == pytest.approx(packed["median_step_ms"] / compiled["median_step_ms"])
    assert data["targets"]["packed_vs_unpacked_median"] == packed["vs_unpacked_median"]
    assert packed["documents_per_row"] >= 1
    best = max(r["tokens_per_s"] for r in data["results"] if r["kind"] in ("k3", "packed"))
    assert cli["vs_best_k3"] == pytest.approx(cli["tokens_per_s"] / best)
    assert cli["command"] == "openk3 train --preset k3-tiny --device cpu --batch-size 2 --seq-len 64"
    assert all(isinstance(v, float) for v in data["targets"].values())
    assert {"unpadded_backend", "padded_backend", "unpadded_ms", "padded_ms"} <= data["mla_attention"].keys()
    assert data["profile"]["top_kernels"] and data["profile_compiled"]["top_kernels"]
    last = stdout.strip().splitlines()
    assert last[-1].startswith("| k3-tiny | muon | openk3 train defaults") and last[-11].startswith("| model |")
    assert (committed.read_bytes() if committed.exists() else None) == before


def rows_of(data: dict, kind: str) -> list[dict]:
    return [r for r in data["results"] if r["kind"] == kind]


def test_train_parts_counts_what_a_forward_runs(monkeypatch):
    """bench/train_parts.py multiplies each unit's time by its count per step: the counts are the calls one training
    forward (MTP included) makes, by module hooks (RMSNorms of the hidden width: as modules or through the fused
    residual add, `add_forward`; the AttnRes norms fold into their queries)."""
    from collections import Counter

    from openk3.model import K3ForCausalLM
    from openk3.model.common import RMSNorm
    from openk3.train.loop import lm_losses

    spec = importlib.util.spec_from_file_location("bench_train_parts", BENCH.parent / "train_parts.py")
    parts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parts)
    cfg = get_preset("k3-tiny").with_overrides({**TOY, "num_layers": 4, "mla_layers": [1], "attn_res_block_size": 2})
    model = K3ForCausalLM(cfg)
    units, counts = parts.k3_units(model)
    calls = Counter()
    kinds = {"KDA token mixer": lambda m: type(m).__name__ == "KimiDeltaAttention",
             "MLA token mixer": lambda m: type(m).__name__ == "GatedMLA",
             "MoE FFN": lambda m: type(m).__name__ == "MoE",
             "dense FFN": lambda m: type(m).__name__ == "GLUMLP",
             "RMSNorm (hidden)": lambda m: type(m).__name__ == "RMSNorm" and m.weight.shape[0] == cfg.hidden_size}
    shared = {id(m.mlp.shared_experts) for m in [*model.model.layers, *(t.block for t in model.mtp)]
              if type(m.mlp).__name__ == "MoE"}  # GLUMLPs inside the MoE, not the dense FFN
    for module in model.modules():
        for name, is_kind in kinds.items():
            if is_kind(module) and id(module) not in shared:
                module.register_forward_hook(lambda *_, name=name: calls.update([name]))
    add_forward = RMSNorm.add_forward

    def counted_add_forward(self, x, residual):
        calls.update(["RMSNorm (hidden)"])
        return add_forward(self, x, residual)

    monkeypatch.setattr(RMSNorm, "add_forward", counted_add_forward)
    lm_losses(model, torch.randint(0, cfg.vocab_size, (1, 9)), mtp_weight=0.3)
    assert counts == dict(calls) and set(units) == set(counts)


def load_step_ab():
    spec = importlib.util.spec_from_file_location("bench_step_ab", BENCH.parent / "step_ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_ab_idle_gaps_against_a_timeline():
    """The GPU's idle time and gaps from kernel spans that overlap, nest and leave holes: against a microsecond
    timeline of busy marks, on random spans; the gaps longest first, each naming the kernels either side."""
    idle_gaps = load_step_ab().idle_gaps
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        starts = torch.randint(0, 400, (12,), generator=g).tolist()
        spans = [(float(s), float(s + torch.randint(1, 40, (1,), generator=g).item()), f"k{i}")
                 for i, s in enumerate(starts)]
        busy = torch.zeros(500, dtype=torch.bool)
        for start, end, _ in spans:
            busy[int(start):int(end)] = True
        first, last = int(min(s for s, _, _ in spans)), int(max(e for _, e, _ in spans))
        got = idle_gaps(list(spans), top=100)
        assert abs(got["idle_ms"] * 1e3 - (~busy[first:last]).sum().item()) < 1e-9
        holes = sum(1 for t in range(first + 1, last) if not busy[t] and busy[t - 1])
        assert len(got["gaps"]) == holes
        assert [x["ms"] for x in got["gaps"]] == sorted((x["ms"] for x in got["gaps"]), reverse=True)
        assert abs(sum(x["ms"] for x in got["gaps"]) - got["idle_ms"]) < 1e-12
    assert idle_gaps([(0.0, 10.0, "a"), (2.0, 4.0, "b"), (15.0, 20.0, "c")], top=5)["gaps"] == [
        {"ms": 0.005, "after": "a", "before": "c"}]  # the kernel before a gap is the one that ended last


def test_step_ab_rank_sources_counts_every_launch():
    """Launch sources on random operators: every kernel counted once under its operator, the totals and GPU time
    kept, the ranking by launch count, each source's most frequent kernel named."""
    rank_sources = load_step_ab().rank_sources
    g = torch.Generator().manual_seed(1)
    ops = []
    for i in range(40):
        n = int(torch.randint(1, 6, (1,), generator=g))
        ops.append((f"op{i % 7}", [(f"kernel{int(torch.randint(0, 3, (1,), generator=g))}", 2.0) for _ in range(n)]))
    got = rank_sources(ops, top=100)
    assert got["total"] == sum(len(k) for _, k in ops) == sum(s["launches"] for s in got["top"])
    assert [s["launches"] for s in got["top"]] == sorted((s["launches"] for s in got["top"]), reverse=True)
    for src in got["top"]:
        names = [name for key, kernels in ops if key == src["source"] for name, _ in kernels]
        assert src["launches"] == len(names) and abs(src["ms"] - 2e-3 * len(names)) < 1e-12
        assert names.count(src["kernel"]) == max(names.count(n) for n in set(names))
    assert len(rank_sources(ops, top=3)["top"]) == 3


def test_step_ab_compile_mode_must_name_a_tree():
    run = subprocess.run([sys.executable, str(BENCH.parent / "step_ab.py"), "--tree", "a=.", "--compile-mode",
                          "b=reduce-overhead"], capture_output=True, text=True)
    assert run.returncode != 0 and run.stderr.strip().splitlines()[-1] == "--compile-mode names no --tree: b"
