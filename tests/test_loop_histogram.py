"""serve.metrics.LoopHistogram against prometheus_client's Histogram (the reference): the same exposition."""

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from openk3.serve.metrics import ITL_BUCKETS, LoopHistogram


def _series(registry: CollectorRegistry) -> list[str]:
    """The exposition's sample lines, without the reference's _created series."""
    return [line for line in generate_latest(registry).decode().splitlines()
            if line and not line.startswith("#") and "_created" not in line]


def test_loop_histogram_exposes_what_prometheus_histogram_does():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = LoopHistogram("latency_seconds", "doc", ITL_BUCKETS)
    ours.register(fast)
    reference = Histogram("latency_seconds", "doc", buckets=ITL_BUCKETS, registry=theirs)
    rng = random.Random(0)
    # every bound exactly (the "le" edge), zero, values between and beyond the last bound
    values = [*ITL_BUCKETS, 0.0, 1e9] + [rng.lognormvariate(-5, 2) for _ in range(500)]
    assert _series(ours) == _series(theirs)  # empty
    for value in values:
        fast.observe(value)
        reference.observe(value)
    assert _series(ours) == _series(theirs)
