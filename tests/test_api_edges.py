"""The Python API's edges, as a user meets them: bad model inputs are a TypeError / ValueError naming the argument
(not an IndexError or a shape error deep inside), load_pretrained names the file at fault, and save_pretrained
never leaves a stale weight file to be read instead of the new one nor writes into a training checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from openk3.checkpoints import verify_checkpoint, write_manifest
from openk3.config import get_preset
from openk3.generation import generate_ids
from openk3.interop import load_pretrained, save_pretrained
from openk3.interop.device_load import load_to_device
from openk3.model import K3ForCausalLM
from openk3.sampling import SamplingParams


def tiny_cfg():
    """k3-tiny, smaller (a few hundred kB of weights): MLA at layer 1 of 2, LatentMoE, AttnRes, one MTP layer."""
    return get_preset("k3-tiny").with_overrides({
        "vocab_size": 64, "hidden_size": 32, "num_layers": 2, "mla_layers": [1], "dense_hidden": 32,
        "kda": {"num_heads": 2, "head_dim": 16},
        "mla": {"num_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                "v_head_dim": 8},
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32, "latent_dim": 32}})


def tiny_model(seed: int = 0) -> K3ForCausalLM:
    torch.manual_seed(seed)
    return K3ForCausalLM(tiny_cfg()).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def same_weights(a: K3ForCausalLM, b: K3ForCausalLM) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---- model inputs ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ids,error,words", [
    (torch.zeros(1, 0, dtype=torch.long), ValueError, "input_ids is empty"),
    (torch.zeros(0, 3, dtype=torch.long), ValueError, "input_ids is empty"),
    (torch.tensor([1, 2, 3]), ValueError, r"input_ids must be \[batch, tokens\]"),
    (torch.zeros(1, 2, 3, dtype=torch.long), ValueError, r"input_ids must be \[batch, tokens\]"),
    (torch.tensor([[1.0, 2.0]]), TypeError, "input_ids must hold integer token ids"),
    (torch.tensor([[True, False]]), TypeError, "input_ids must hold integer token ids"),
    ([[1, 2]], TypeError, "input_ids must be a torch.Tensor"),
    (torch.tensor([[1, -1]]), ValueError, r"input_ids holds token id -1, outside .*\[0, 64\)"),
    (torch.tensor([[1, 64]]), ValueError, r"input_ids holds token id 64, outside .*\[0, 64\)"),
])
def test_bad_input_ids_are_named(model, ids, error, words):
    with pytest.raises(error, match=words):
        model(ids)


def test_bad_input_ids_with_a_cache_leave_it_untouched(model):
    cache = model.new_cache(1)
    with pytest.raises(ValueError, match="input_ids is empty"):
        model(torch.zeros(1, 0, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        model(torch.tensor([[3, 99]]), cache=cache)
    assert cache.max_length == 0


def test_bad_logits_to_keep_and_cache_sizes_are_named(model):
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="logits_to_keep must be an integer >= 0"):
        model(ids, logits_to_keep=-1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
            model.new_cache(bad)
    with pytest.raises(ValueError, match="capacity must be an integer >= 0"):
        model.new_cache(1, capacity=-4)


def test_valid_inputs_still_run(model):
    """int32 ids, one token, a NumPy batch size, and incremental decoding equal to the full forward."""
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        assert torch.equal(model(ids.to(torch.int32)).logits, full)
        assert model(ids[:1, :1]).logits.shape == (1, 1, 64)
        cache = model.new_cache(2)
        steps = [model(ids[:, :5], cache=cache).logits] + [model(ids[:, t:t + 1], cache=cache).logits
                                                            for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


# ---- generate_ids ---------------------------------------------------------------------------------------------

def test_generate_ids_checks_its_inputs_and_restores_the_mode(model):
    greedy = SamplingParams(temperature=0)
    want = generate_ids(model, [1, 2, 3], 4, greedy)
    assert generate_ids(model, torch.tensor([1, 2, 3]), 4, greedy) == want  # a 1-D tensor is a prompt too
    with pytest.raises(ValueError, match="one sequence"):
        generate_ids(model, torch.tensor([[1, 2, 3]]), 4, greedy)
    with pytest.raises(TypeError, match="not text"):
        generate_ids(model, "def ", 4, greedy)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0"):
        generate_ids(model, [1], -1, greedy)
    model.train()
    try:
        with pytest.raises(ValueError, match="token id 999"):
            generate_ids(model, [1, 999], 4, greedy)
        assert model.training  # the mode comes back after a failed forward too
    finally:
        model.eval()


# ---- load_pretrained ------------------------------------------------------------------------------------------

def test_load_names_a_missing_path_a_file_and_bad_config_json(tmp_path, model):
    with pytest.raises(ValueError, match="no config.json: checkpoint directory .* does not exist"):
        load_pretrained(tmp_path / "absent")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="no config.json: .* is a file, not a checkpoint directory"):
        load_pretrained(tmp_path / "file")
    save_pretrained(model, tmp_path / "ckpt")
    config = tmp_path / "ckpt" / "config.json"
    good = json.loads(config.read_text())
    config.write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        load_pretrained(tmp_path / "ckpt")
    config.write_text("[]")
    with pytest.raises(ValueError, match="must hold a JSON object, got list"):
        load_pretrained(tmp_path / "ckpt")
    for field, value, words in [("hidden_size", "abc", "an integer"), ("num_hidden_layers", 2.5, "an integer"),
                                ("vocab_size", True, "an integer"), ("rms_norm_eps", "tiny", "a number")]:
        bad = json.loads(json.dumps(good))
        bad["text_config"][field] = value
        config.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=f"config field '{field}' must be {words}, got {value!r}"):
            load_pretrained(tmp_path / "ckpt")


def test_load_names_a_truncated_file_and_a_missing_shard(tmp_path, model):
    save_pretrained(model, tmp_path / "single")
    file = tmp_path / "single" / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file \(truncated"):
        load_pretrained(tmp_path / "single")
    save_pretrained(model, tmp_path / "sharded", max_shard_bytes=100_000)
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=f"lacks 1 of the shards .*: {shards[1].name}$"):
        load_pretrained(tmp_path / "sharded")


def test_load_to_device_reads_a_run_directory_as_load_pretrained_does(tmp_path, model):
    step = tmp_path / "run" / "step-000002"
    step.mkdir(parents=True)
    save_pretrained(model, step)
    write_manifest(step, 2)
    loaded, _ = load_to_device(tmp_path / "run", "cpu")
    assert same_weights(loaded, model)
    assert same_weights(load_pretrained(tmp_path / "run"), model)


# ---- save_pretrained ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("first,second", [(50_000, None), (50_000, 120_000), (None, 50_000)])
def test_saving_over_an_earlier_save_leaves_only_the_new_weights(tmp_path, first, second):
    """A sharded save overwritten by a single-file one left its index behind, and loading read the old shards."""
    old, new = tiny_model(0), tiny_model(1)
    (tmp_path / "notes.txt").write_text("mine")
    save_pretrained(old, tmp_path, max_shard_bytes=first)
    save_pretrained(new, tmp_path, max_shard_bytes=second)
    assert same_weights(load_pretrained(tmp_path), new)
    names = {p.name for p in tmp_path.iterdir()}
    if second is None:
        assert names == {"config.json", "model.safetensors", "notes.txt"}
    else:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert names == {"config.json", "model.safetensors.index.json", "notes.txt", *index["weight_map"].values()}


def test_save_refuses_a_training_checkpoint_a_run_and_a_file(tmp_path, model):
    step = tmp_path / "run" / "step-000001"
    step.mkdir(parents=True)
    save_pretrained(model, step)
    write_manifest(step, 1)
    with pytest.raises(ValueError, match="is a training checkpoint"):
        save_pretrained(tiny_model(1), step)
    with pytest.raises(ValueError, match="is a training run"):
        save_pretrained(tiny_model(1), tmp_path / "run")
    verify_checkpoint(step)  # untouched
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-000001"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        save_pretrained(model, tmp_path / "file")
    with pytest.raises(TypeError, match="K3ForCausalLM"):
        save_pretrained(torch.nn.Linear(2, 2), tmp_path / "linear")
    for bad in (0, -5, 1.5):
        with pytest.raises(ValueError, match="max_shard_bytes must be None or a positive integer"):
            save_pretrained(model, tmp_path / "shards", max_shard_bytes=bad)
    assert not (tmp_path / "linear").exists() and not (tmp_path / "shards").exists()
