"""The model runner over the engine's pools: prefill chunks and static-shape decode steps (PyTorch ops, and the
GPU path's Triton kernels under TRITON_INTERPRET=1) give the logits of one full forward; the decode step touches
only the slots and pages it addresses."""

import pytest
import torch

from openk3.cache.paged import BlockTables, PagePool
from openk3.cache.state_pool import StatePool
from openk3.model import K3ForCausalLM
from openk3.serve.runner import ModelRunner, graph_buckets
from test_model_decode import CONFIGS, randomize


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is faster and leaves the shared cores alone
    yield
    torch.set_num_threads(threads)


def make_runner(model, kernels, page_size=5, slots=4, pages=40):
    cfg = model.config
    pool = PagePool(len(cfg.mla_layers), pages, page_size, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
    tables = BlockTables(slots, -(-cfg.max_seq_len // page_size))
    states = StatePool(cfg, slots)
    return ModelRunner(model, pool, tables, states, max_batch=slots, kernels=kernels)


def give_pages(runner, slot, tokens, rng):
    """Pages for `tokens` positions, taken from the pool in a shuffled order (tables need not be ascending)."""
    free = []
    while len(free) < -(-tokens // runner.pages.page_size):
        free.append(runner.pages.alloc())
    order = torch.randperm(len(free), generator=rng).tolist()
    runner.tables.set(slot, [free[i] for i in order])


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("name", ["k3-small-mla-first", "kimi-tiny"])
def test_prefill_chunks_then_decode_steps_equal_one_forward(name, kernels):
    torch.manual_seed(0)
    model = randomize(K3ForCausalLM(CONFIGS[name]()), seed=1)
    runner = make_runner(model, kernels)
    rng = torch.Generator().manual_seed(2)
    V = model.config.vocab_size
    lengths, steps = [7, 12, 1], 4  # prompts of different lengths, in slots 2, 0, 3
    slots = [2, 0, 3]
    ids = [torch.randint(0, V, (n + steps,), generator=rng).tolist() for n in lengths]
    for slot, n in zip(slots, lengths):
        give_pages(runner, slot, n + steps, rng)
    logits = {}
    with torch.no_grad():
        # first chunks of 5 tokens for the two longer prompts (with a KDA checkpoint request), then the rest one
        # sequence at a time
        out, ckpts = runner.prefill([ids[0][:5], ids[1][:5]], slots[:2], [0, 0], checkpoint_offsets=(2, 5))
        assert sorted(ckpts) == [2, 5] and ckpts[5]["recurrent"].shape[:2] == (len(model.config.kda_layers), 2)
        torch.testing.assert_close(ckpts[5]["recurrent"], runner.states.recurrent[:, slots[:2]])
        for b, n in enumerate(lengths):
            start = 5 if b < 2 else 0
            out, _ = runner.prefill([ids[b][start:n]], [slots[b]], [start])
            logits[b] = [out[0]]
        for t in range(steps - 1):
            out = runner.decode([ids[b][n + t] for b, n in enumerate(lengths)], slots,
                                [n + t for n in lengths])
            for b in range(len(lengths)):
                logits[b].append(out[b])
        for b, n in enumerate(lengths):
            full = model(torch.tensor([ids[b][: n + steps - 1]])).logits[0, n - 1:]
            torch.testing.assert_close(torch.stack(logits[b]), full, rtol=1e-4, atol=1e-4)


def test_decode_touches_only_its_slots_and_pages():
    torch.manual_seed(0)
    model = randomize(K3ForCausalLM(CONFIGS["k3-small-mla-first"]()), seed=3)
    runner = make_runner(model, "triton")
    rng = torch.Generator().manual_seed(4)
    give_pages(runner, 1, 9, rng)
    runner.states.recurrent.normal_(generator=rng)
    runner.pages.pages.normal_(generator=rng)
    before_states, before_pages = runner.states.recurrent.clone(), runner.pages.pages.clone()
    with torch.no_grad():
        runner.decode([5], [1], [7])
    changed_slots = (runner.states.recurrent != before_states).flatten(2).any(-1).any(0).nonzero().flatten()
    assert changed_slots.tolist() == [1]
    page, offset = runner.tables.pages[1][7 // 5], 7 % 5
    changed = (runner.pages.pages != before_pages).any(-1).any(0).nonzero().tolist()
    assert changed == [[page, offset]]


def test_graph_buckets_cover_every_batch_size():
    assert graph_buckets(1) == [1]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert graph_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
