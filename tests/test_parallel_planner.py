"""The expert-parallel planners as pure functions, property-tested on skewed routings (hypothesis).

Balanced (MoonEP): every rank computes exactly its cap (S x K rows when every rank routes S tokens with top-K);
every token-expert row is assigned exactly once; each rank hosts at most m = E / R replicas, all from one home rank;
the tables agree with each other; the plan is a function of the counts alone. Static: every row goes home.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openk3.parallel.planner import plan_balanced, plan_static


@st.composite
def routings(draw):
    """counts [R, E]: R ranks of S tokens, each token picking K distinct experts from a skewed popularity."""
    R, m = draw(st.integers(1, 8)), draw(st.integers(1, 4))
    E = R * m
    S, K = draw(st.integers(1, 24)), draw(st.integers(1, min(E, 4)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    popularity = rng.random(E) ** draw(st.sampled_from([1.0, 4.0, 16.0]))  # from mild to one dominant expert
    if draw(st.booleans()):
        popularity[draw(st.integers(0, E - 1))] += 1e6  # a hot expert: every token picks it
    p = popularity / popularity.sum()
    counts = np.zeros((R, E), dtype=np.int64)
    for r in range(R):
        for _ in range(S):
            counts[r, rng.choice(E, size=K, replace=False, p=p)] += 1
    return counts, S * K


def check_plan(plan, counts):
    R, E = counts.shape
    m = E // R
    # every row assigned exactly once
    assigned = np.zeros_like(counts)
    np.add.at(assigned.T, plan.seg_expert, plan.seg_rows.T)
    np.testing.assert_array_equal(assigned, counts)
    # the E home segments, then the replica segments sorted by (expert, destination), never the home rank
    np.testing.assert_array_equal(plan.seg_expert[:E], np.arange(E))
    np.testing.assert_array_equal(plan.seg_rank[:E], np.arange(E) // m)
    replica = np.stack([plan.seg_expert[E:], plan.seg_rank[E:]])
    assert (np.lexsort(replica[::-1]) == np.arange(replica.shape[1])).all()
    assert (replica[1] != replica[0] // m).all() and len({tuple(c) for c in replica.T}) == replica.shape[1]
    fill = plan.by_expert()  # sorted by expert, each expert's home segment first
    assert (np.diff(plan.seg_expert[fill]) >= 0).all()
    np.testing.assert_array_equal(fill[np.searchsorted(plan.seg_expert[fill], np.arange(E))], np.arange(E))
    # each segment sits in the slot that holds its expert
    np.testing.assert_array_equal(plan.slot_expert[plan.seg_rank, plan.seg_slot], plan.seg_expert)
    np.testing.assert_array_equal(plan.slot_expert[:, :m], np.arange(E).reshape(R, m))
    assert plan.seg_rows.min() >= 0


@settings(max_examples=150, deadline=None)
@given(routings())
def test_balanced_plan_gives_every_rank_exactly_s_times_k_rows(routing):
    counts, rows_per_rank = routing
    plan = plan_balanced(counts)
    check_plan(plan, counts)
    np.testing.assert_array_equal(plan.rows_received(), np.full(counts.shape[0], rows_per_rank))
    m = counts.shape[1] // counts.shape[0]
    for r in range(counts.shape[0]):
        replicas = plan.replicas(r)
        assert len(replicas) <= m
        assert len(set((replicas // m).tolist())) <= 1  # single source
        assert (np.diff(replicas) > 0).all()  # distinct, ascending slots
        assert not np.isin(replicas // m, [r]).any()  # a rank never replicates its own experts
    again = plan_balanced(counts.copy())
    for field in ("slot_expert", "seg_expert", "seg_rank", "seg_slot", "seg_rows"):
        np.testing.assert_array_equal(getattr(again, field), getattr(plan, field))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_balanced_plan_with_unequal_tokens_per_rank(R, m, seed):
    """Ranks with different token counts (CP's MTP stream): the total is spread as evenly as integers allow."""
    counts = np.random.default_rng(seed).integers(0, 30, size=(R, R * m)) * (np.arange(R * m) % 3 == 0)
    plan = plan_balanced(counts)
    check_plan(plan, counts)
    total = counts.sum()
    np.testing.assert_array_equal(plan.rows_received(), total // R + (np.arange(R) < total % R))


@settings(max_examples=50, deadline=None)
@given(routings())
def test_static_plan_sends_every_row_home(routing):
    counts, _ = routing
    plan = plan_static(counts)
    check_plan(plan, counts)
    R, E = counts.shape
    np.testing.assert_array_equal(plan.rows_received(), counts.sum(0).reshape(R, E // R).sum(1))
    assert all(len(plan.replicas(r)) == 0 for r in range(R))


def test_worked_example():
    """2 ranks x 2 experts; rank 0's experts get 7 of the 8 rows: 3 of expert 0's rows move to rank 1."""
    counts = np.array([[3, 1, 0, 0], [2, 1, 1, 0]])
    plan = plan_balanced(counts)
    np.testing.assert_array_equal(plan.rows_received(), [4, 4])
    np.testing.assert_array_equal(plan.replicas(1), [0])
    # expert 0's 5 rows (3 from rank 0, then 2 from rank 1): the first 2 stay home, the last 3 go to rank 1
    home, moved = np.flatnonzero(plan.seg_expert == 0)  # home segment first
    np.testing.assert_array_equal(plan.seg_rows[:, home], [2, 0])
    np.testing.assert_array_equal(plan.seg_rows[:, moved], [1, 2])


@pytest.mark.parametrize("counts, message", [
    (np.zeros((2, 3), dtype=np.int64), "cannot be split evenly"),
    (np.array([[1.5, 2.0]]), "integer"),
    (np.array([[-1, 2]]), "non-negative"),
])
def test_planner_rejects_impossible_tables(counts, message):
    with pytest.raises(ValueError, match=message):
        plan_balanced(counts)
