"""Piecewise CUDA graphs of the prefill forward (openk3.serve.piecewise): the token buckets and the mixer hook on any
machine; on a GPU, a right-padded prefill replayed from the pieces gives the eager forward's logits, KDA states,
checkpoints and latents."""

import pytest
import torch

from openk3.model import K3ForCausalLM
from openk3.serve.piecewise import (
    BUCKET_STEP,
    SMALLEST_BUCKET,
    PiecewisePrefill,
    mixers_replaced,
    run_to_end,
    token_buckets,
)
from test_model_decode import CONFIGS, randomize
from test_runner import give_pages, make_runner

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@pytest.mark.parametrize("largest", [1, SMALLEST_BUCKET, SMALLEST_BUCKET + 1, BUCKET_STEP - 3, 3 * BUCKET_STEP + 5])
def test_token_buckets_double_then_grow_by_a_step_and_cover_the_largest(largest):
    sizes = token_buckets(largest)
    assert sizes[0] == SMALLEST_BUCKET and sizes[-1] >= largest
    assert len(sizes) == 1 or sizes[-2] < largest  # no bucket past the one that covers it
    for a, b in zip(sizes, sizes[1:]):
        assert b == (2 * a if a < BUCKET_STEP else a + BUCKET_STEP)
    with pytest.raises(ValueError, match="largest must be >= 1"):
        token_buckets(0)


def test_mixers_replaced_stands_in_for_each_mixer_in_order_and_restores_them():
    torch.manual_seed(0)
    model = randomize(K3ForCausalLM(CONFIGS["k3-tiny"]()), seed=3)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        want = model(ids).logits
        seen = []

        def mix(i, x):
            seen.append(i)
            return model.model.layers[i].self_attn(x)

        with mixers_replaced(model.model.layers, mix):
            got = model(ids).logits
        assert seen == list(range(model.config.num_layers))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert all("_mix" not in layer.__dict__ for layer in model.model.layers)
        torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)


def test_buckets_share_each_mixers_output_buffer():
    pieces = PiecewisePrefill(randomize(K3ForCausalLM(CONFIGS["k3-tiny"]()), seed=4), largest_tokens=1024)
    big = [pieces._mixer_output(i, torch.ones(1, 1024, 8)) for i in range(2)]  # the largest bucket, captured first
    small = pieces._mixer_output(1, torch.ones(1, 256, 8))
    assert len(pieces._outputs) == 2 and small.shape == (1, 256, 8) and small.is_contiguous()
    assert small.data_ptr() == big[1].data_ptr() != big[0].data_ptr()
    small.view(-1, 8)[:3].fill_(2.0)  # as `run` writes a mixer's output
    assert big[1][0, :3].eq(2.0).all() and big[1][0, 3:].eq(0.0).all()


def test_runner_without_cuda_graphs_has_no_prefill_pieces():
    model = randomize(K3ForCausalLM(CONFIGS["k3-tiny"]()), seed=4)
    runner = make_runner(model, "torch")
    assert runner.piecewise is None and runner.capture_prefill() == 0.0


@needs_cuda
@pytest.mark.parametrize("name", ["k3-tiny", "kimi-tiny"])
def test_prefill_replayed_from_pieces_equals_the_eager_forward(name):
    """Chunks of 9, 2, 14 and 1 tokens (two continuing a prompt) right-padded in one forward, at a KDA checkpoint
    union, through the pieces and eagerly from the same pools: the same logits, states, checkpoints and latents
    (bf16: within its rounding)."""
    torch.manual_seed(0)
    model = randomize(K3ForCausalLM(CONFIGS[name]()), seed=21).to("cuda", torch.bfloat16)
    runner = make_runner(model, "triton", slots=5, pages=60, cuda_graphs=True, piecewise_tokens=64)
    runner.warm_up_prefill()
    assert runner.capture_prefill() > 0 and runner.piecewise is not None and runner.piecewise.pieces
    rng = torch.Generator().manual_seed(22)
    slots, starts, lengths = [3, 0, 4, 1], [0, 6, 3, 0], [9, 2, 14, 1]
    offsets = (1, 5, 8, 13)
    ids = [torch.randint(0, model.config.vocab_size, (s + n,), generator=rng).tolist()
           for s, n in zip(starts, lengths)]
    for slot, s, n in zip(slots, starts, lengths):
        give_pages(runner, slot, s + n, rng)
    pools = (runner.states.conv, runner.states.recurrent, runner.pages.pages)
    # the compared part: the padding slot and the null page are scratch that padded positions write, several to one
    # address in one kernel (which write lands there varies from run to run)
    live = (slice(None, runner.states.padding_slot), slice(None, runner.states.padding_slot), slice(1, None))
    chunks = [x[s:] for x, s in zip(ids, starts)]
    pieces = runner.piecewise
    results = []
    with torch.no_grad():
        for b, s in enumerate(starts):
            if s:
                runner.prefill([ids[b][:s]], [slots[b]], [0])
        before = [t.clone() for t in pools]
        for piecewise in (pieces, None):
            for t, b in zip(pools, before):
                t.copy_(b)
            runner.piecewise = piecewise
            logits, ckpts = runner.prefill(chunks, slots, starts, checkpoint_offsets=offsets)
            results.append((logits.float(), ckpts, [t[:, keep].float().clone() for t, keep in zip(pools, live)]))
    (got, got_ckpts, got_pools), (want, want_ckpts, want_pools) = results
    assert sorted(got_ckpts) == sorted(want_ckpts) == list(offsets)
    pairs = [(got, want), *((got_ckpts[o][key].float(), want_ckpts[o][key].float())
                            for o in offsets for key in ("conv", "recurrent")), *zip(got_pools, want_pools)]
    for g, w in pairs:  # bf16 through a dozen layers: a relative error of the whole tensor, not elementwise
        assert torch.isfinite(g).all()
        assert (g - w).norm() <= 2e-2 * w.norm() + 1e-6, ((g - w).norm().item(), w.norm().item())


@needs_cuda
def test_a_forward_paused_between_its_mixers_with_decode_steps_between_equals_it_run_whole():
    """`ModelRunner.forward_steps` paused at every pause with a decode step of another slot run there (as the engine
    splits a prefill forward over steps): the forward's logits, checkpoints and pools, and the decode steps' logits,
    are those of the forward run whole and the same decode steps after it (same shapes and kernels both ways)."""
    torch.manual_seed(0)
    model = randomize(K3ForCausalLM(CONFIGS["k3-tiny"]()), seed=21).to("cuda", torch.bfloat16)
    runner = make_runner(model, "triton", slots=5, pages=60, cuda_graphs=True, piecewise_tokens=64)
    runner.warm_up_prefill()
    assert runner.capture_prefill() > 0
    rng = torch.Generator().manual_seed(23)
    slots, chunk, decoding = [3, 0], 11, 2  # two prompts prefilled from 0; slot 2 decodes beside them
    ids = [torch.randint(0, model.config.vocab_size, (chunk,), generator=rng).tolist() for _ in slots]
    for slot in (*slots, decoding):
        give_pages(runner, slot, chunk + 8, rng)
    pauses = runner.forward_pauses(len(slots) * chunk)
    assert pauses == model.config.num_layers - 1
    pools = (runner.states.conv, runner.states.recurrent, runner.pages.pages)
    live = (slice(None, runner.states.padding_slot), slice(None, runner.states.padding_slot), slice(1, None))
    with torch.no_grad():
        runner.prefill([ids[0][:5]], [decoding], [0])  # the decoding slot's context
        before = [t.clone() for t in pools]
        results = []
        for split in (False, True):
            for t, b in zip(pools, before):
                t.copy_(b)
            steps = runner.forward_steps(ids, slots, [0, 0], checkpoint_offsets=(4, 8))
            decoded = []
            if split:
                for n in range(pauses):
                    next(steps)
                    decoded.append(runner.decode([7 + n], [decoding], [5 + n]).float().clone())
            logits, ckpts, _ = run_to_end(steps)
            for n in range(len(decoded), pauses):
                decoded.append(runner.decode([7 + n], [decoding], [5 + n]).float().clone())
            kept = [t[:, keep].float().clone() for t, keep in zip(pools, live)]
            results.append((logits.float(), ckpts, decoded, kept))
    (got, got_ckpts, got_decoded, got_pools), (want, want_ckpts, want_decoded, want_pools) = results[1], results[0]
    pairs = [(got, want), *zip(got_decoded, want_decoded), *zip(got_pools, want_pools),
             *((got_ckpts[o][k].float(), want_ckpts[o][k].float()) for o in (4, 8) for k in ("conv", "recurrent"))]
    for g, w in pairs:  # the same work both ways: equal up to the kernels' order of atomic adds
        assert (g - w).norm() <= 1e-2 * w.norm() + 1e-6, ((g - w).norm().item(), w.norm().item())
