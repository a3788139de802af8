"""The runner's speculative steps against its plain ones (PyTorch ops, and the GPU path's Triton kernels under
TRITON_INTERPRET=1): a verification over K + 1 tokens equals K + 1 decode steps (logits, the draft's features,
pools, and the KDA states recorded after each token), `roll_back` restores each sequence's states after its kept
tokens, and a draft pass over the paged pools equals the draft's step on gathered latents."""

import pytest
import torch

from openk3.cache.paged import BlockTables, PagePool
from openk3.cache.state_pool import StatePool
from openk3.draft import EagleDraft
from openk3.model import K3ForCausalLM
from openk3.ops import moe as moe_ops
from openk3.serve.runner import ModelRunner
from test_model_decode import CONFIGS, randomize
from test_runner import HostSyncs, dense_grouped_glu_mlp, give_pages, one_thread  # noqa: F401  (the module fixture)

K = 3
PROMPTS, SLOTS = [7, 12, 1], [2, 0, 3]


def spec_runner(name, kernels, compile_backend=None, slots=4, pages=40, page_size=5):
    torch.manual_seed(0)
    model = randomize(K3ForCausalLM(CONFIGS[name]().with_overrides({"mtp_layers": 1})), seed=5)
    draft = EagleDraft(model)
    torch.nn.init.normal_(draft.fc.weight, std=0.1, generator=torch.Generator().manual_seed(6))
    cfg = model.config
    pool = PagePool(len(cfg.mla_layers) + 1, pages, page_size, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
    return ModelRunner(model, pool, BlockTables(slots, -(-cfg.max_seq_len // page_size)), StatePool(cfg, slots),
                       max_batch=slots, kernels=kernels, compile_backend=compile_backend, draft=draft, speculative=K)


def prefilled(runner, seed=1):
    """Three prompts of different lengths prefilled into slots 2, 0, 3 (pages for K + 1 more tokens); the draft's
    latents of the prompts random. Returns the verification's token rows."""
    rng = torch.Generator().manual_seed(seed)
    V = runner.model.config.vocab_size
    for slot, n in zip(SLOTS, PROMPTS):
        give_pages(runner, slot, n + K + 1, rng)
        with torch.no_grad():
            runner.prefill([torch.randint(0, V, (n,), generator=rng).tolist()], [slot], [0])
    runner.pages.pages[-1].normal_(generator=rng)
    return torch.randint(0, V, (len(SLOTS), K + 1), generator=rng).tolist()


def pools(runner):
    return [t.clone() for t in (runner.states.conv, runner.states.recurrent, runner.pages.pages)]


def restore(runner, saved):
    for t, s in zip((runner.states.conv, runner.states.recurrent, runner.pages.pages), saved):
        t.copy_(s)


@pytest.mark.parametrize("kernels,compile_backend",
                         [("torch", None), ("triton", None), ("torch", "eager"), ("triton", "aot_eager")])
def test_verification_equals_decode_steps_and_rolls_back(kernels, compile_backend):
    torch._dynamo.reset()
    runner = spec_runner("k3-small-mla-first", kernels, compile_backend)
    rows = prefilled(runner)
    before = pools(runner)
    with torch.no_grad():
        logits, features = runner.verify(rows, SLOTS, PROMPTS)
        logits, features = logits.clone(), features.clone()
        conv_out, recurrent_out = runner.conv_out[:, :3].clone(), runner.recurrent_out[:, :3].clone()
        verified = pools(runner)
        restore(runner, before)
        steps, step_features, after = [], [], []  # the same tokens one decode step at a time, the states after each
        for t in range(K + 1):
            if t % 2:  # `decode` and `decode_with_features` alike
                step_logits, step_feature = runner.decode_with_features([r[t] for r in rows], SLOTS,
                                                                        [n + t for n in PROMPTS])
                step_features.append(step_feature.clone())
            else:
                step_logits = runner.decode([r[t] for r in rows], SLOTS, [n + t for n in PROMPTS])
            steps.append(step_logits.clone())
            after.append((runner.states.conv[:, SLOTS].clone(), runner.states.recurrent[:, SLOTS].clone()))
    assert logits.shape == (3, K + 1, runner.model.config.vocab_size) and features.shape[:2] == (3, K + 1)
    torch.testing.assert_close(logits, torch.stack(steps, dim=1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(features[:, 1::2], torch.stack(step_features, dim=1), rtol=1e-4, atol=1e-4)
    # the pools alike, but for a padding row's scratch: the padding slot (last) and the null page (first)
    for got, want, real in zip(verified, pools(runner), (slice(0, -1), slice(0, -1), slice(1, None))):
        torch.testing.assert_close(got[:, real], want[:, real], rtol=1e-5, atol=1e-5)
    for t in range(K):
        torch.testing.assert_close(conv_out[:, :, t], after[t][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(recurrent_out[:, :, t], after[t][1], rtol=1e-5, atol=1e-5)

    restore(runner, verified)
    kept = [1, K + 1, 3]
    runner.roll_back(SLOTS, kept)
    for b, (slot, k) in enumerate(zip(SLOTS, kept)):
        torch.testing.assert_close(runner.states.conv[:, slot], after[k - 1][0][:, b], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(runner.states.recurrent[:, slot], after[k - 1][1][:, b], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("T", [1, K + 1])
def test_draft_pass_equals_the_drafts_step_on_gathered_latents(kernels, T):
    runner = spec_runner("k3-tiny", kernels)
    prefilled(runner)
    rng = torch.Generator().manual_seed(7)
    D = runner.model.config.hidden_size
    prev = torch.randn(3, T, D, generator=rng)
    ids = torch.randint(0, runner.model.config.vocab_size, (3, T), generator=rng)
    last = [T - 1, 0, T // 2]
    before = pools(runner)
    with torch.no_grad():
        hidden, logits = (t.clone() for t in runner.draft_pass(prev, ids.tolist(), SLOTS, PROMPTS, last))
        written = runner.pages.pages[-1].clone()
        restore(runner, before)
        want = runner.draft_step(prev, ids, SLOTS, PROMPTS)[torch.arange(3), last]
    torch.testing.assert_close(hidden, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, runner.draft.logits(want), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(written, runner.pages.pages[-1], rtol=1e-5, atol=1e-5)


def test_speculative_steps_never_wait_for_the_host(monkeypatch):
    """As the plain decode step (test_runner): with a sync-free stand-in for the CPU's expert loop, the verification
    and both draft passes issue no op that waits for the host, so each can be captured as a CUDA graph."""
    runner = spec_runner("k3-small-mla-first", "triton")
    runner.tables.set(1, [runner.pages.alloc(), runner.pages.alloc()])
    runner.inputs[1, :2] = torch.tensor([1, runner.states.padding_slot])
    runner.inputs[2, :2] = torch.tensor([3, 0])
    monkeypatch.setattr(moe_ops, "grouped_glu_mlp", dense_grouped_glu_mlp)
    assert sorted(runner._steps()) == ["decode", "draft1", f"draft{K + 1}", "verify"]
    for name in runner._steps():
        with torch.no_grad(), HostSyncs(monkeypatch) as syncs:
            out = runner._run(name, 2)
        assert syncs.seen == [], name
        assert all(torch.isfinite(t).all() for t in (out if isinstance(out, tuple) else (out,))), name


def test_round_costs_cover_every_bucket():
    """The policy's cost table (openk3.serve.speculation), timed eagerly here: one positive ratio per graph bucket,
    the pools' real rows untouched (the steps run on the padding slot and the null page)."""
    runner = spec_runner("k3-tiny", "torch")
    prefilled(runner)
    before = pools(runner)
    costs = runner.round_costs(repeats=1)
    assert sorted(costs) == runner.buckets and all(c > 0 for c in costs.values())
    for got, want, real in zip(pools(runner), before, (slice(0, -1), slice(0, -1), slice(1, None))):
        assert torch.equal(got[:, real], want[:, real])


def test_a_runner_with_a_draft_warms_up_its_prefill():
    """The engine warms up a draft runner's prefill at start (on a GPU): the warm-up leaves out the right-padded
    rows that a draft does not take, and a prefill after it still equals a fresh runner's."""
    runner, fresh = spec_runner("k3-tiny", "torch"), spec_runner("k3-tiny", "torch")
    runner.warm_up_prefill(tokens=4, long=(9, (5,)))
    prompt = torch.randint(0, runner.model.config.vocab_size, (7,), generator=torch.Generator().manual_seed(2))
    for r in (runner, fresh):
        give_pages(r, 1, 7, torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = (r.prefill([prompt.tolist()], [1], [0])[0] for r in (runner, fresh))
    torch.testing.assert_close(got, want)
