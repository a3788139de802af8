"""The dynamic speculation policy (openk3.serve.speculation) on synthetic acceptances and round costs: rounds where
they yield more tokens per unit of time than plain steps, plain decoding where they do not (large batches, low
acceptance), monotonic in both, probing again after plain steps; and `openk3 serve --speculative` parsing."""

import random

import pytest

from openk3.cli import build_parser
from openk3.serve.speculation import DEFAULT_ROUND_COST, SpecPolicy

# a round's cost in plain steps rising with the batch, as a verification of K + 1 tokens stops being memory-bound
COSTS = {1: 1.6, 2: 1.7, 4: 1.9, 8: 2.3, 16: 2.9, 32: 3.8, 64: 4.6}


def measured(accepted: float, k: int = 3, costs=COSTS, **kw) -> SpecPolicy:
    """A policy whose moving average has settled at `accepted` drafts per verification."""
    policy = SpecPolicy(k, costs, alpha=1.0, **kw)
    policy.accepted = accepted
    return policy


def test_rounds_pay_at_high_acceptance_and_small_batches_only():
    assert measured(2.4).choose(1) == 3  # 3.4 tokens for 1.6 steps
    assert measured(0.3).choose(1) == 0  # 1.3 tokens for 1.6 steps
    assert measured(2.4).choose(64) == 0  # 3.4 tokens for 4.6 steps
    assert measured(2.4).choose(40) == 0  # batches between buckets cost as the next bucket (64)
    assert measured(2.4).choose(1000) == 0  # past the largest bucket: its cost
    assert measured(1.0, k=1, costs={1: 1.5}).choose(1) == 1  # every draft accepted: 2 tokens for 1.5 steps


def test_choice_is_monotonic_in_acceptance_and_batch():
    """More acceptance never turns rounds off; a larger batch (costs rising with it) never turns them on."""
    batches = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    acceptances = [i / 20 for i in range(61)]
    grid = [[measured(a).choose(b) for b in batches] for a in acceptances]
    for row in grid:
        assert row == sorted(row, reverse=True)
    for column in zip(*grid):
        assert list(column) == sorted(column)
    assert {k for row in grid for k in row} == {0, 3}
    for a, row in zip(acceptances, grid):  # a round where it yields more tokens per plain step's time
        for b, k in zip(batches, row):
            cost = next(c for size, c in COSTS.items() if size >= b)
            assert (k == 3) == (1 + a > cost)


def test_unmeasured_policy_probes_and_reprobes_after_plain_steps():
    policy = SpecPolicy(3, COSTS, probe_every=4)
    assert policy.choose(64) == 0  # 4 tokens at most for 4.6 steps: no round is worth measuring
    assert policy.accepted is None and policy.choose(1) == 3  # unmeasured: a round measures the acceptance
    policy.observe([0, 0])
    assert policy.accepted == 0.0
    assert [policy.choose(1) for _ in range(10)] == [0, 0, 0, 0, 3, 0, 0, 0, 0, 3]
    assert [policy.choose(64) for _ in range(10)] == [0] * 10  # large batches never probe


def test_moving_average_follows_the_accepted_drafts():
    policy = SpecPolicy(4, alpha=0.1)
    rng = random.Random(0)
    for _ in range(400):
        policy.observe([rng.choice([1, 2, 3]) for _ in range(rng.randint(1, 8))])
    assert policy.accepted == pytest.approx(2.0, abs=0.3)
    policy.observe([0] * 200)
    assert policy.accepted < 1e-6
    assert policy.cost(7) == DEFAULT_ROUND_COST and policy.choose(7) == 0
    policy.observe([4] * 200)  # a round at DEFAULT_ROUND_COST pays again
    assert policy.choose(7) == 4


def test_bad_policy_arguments_name_the_field():
    with pytest.raises(ValueError, match="K >= 1"):
        SpecPolicy(0)
    with pytest.raises(ValueError, match="weight"):
        SpecPolicy(3, alpha=0.0)
    with pytest.raises(ValueError, match="positive"):
        SpecPolicy(3, {1: 0.0})
    with pytest.raises(ValueError, match="0 to 3 drafts"):
        SpecPolicy(3).observe([4])


def test_speculative_flag_takes_k_or_auto(capsys):
    parse = build_parser().parse_args
    assert parse(["serve"]).speculative is None  # auto when the checkpoint holds a draft (test_spec_serve)
    assert parse(["serve", "--speculative", "auto"]).speculative == "auto"
    assert parse(["serve", "--speculative", "4"]).speculative == 4
    assert parse(["serve", "--speculative", "0"]).speculative == 0
    for bad in ("-1", "x", "2.5", "Auto", ""):
        with pytest.raises(SystemExit) as exit_info:
            parse(["serve", "--speculative", bad])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--speculative: must be auto or a number of drafts K >= 0" in err[0]
