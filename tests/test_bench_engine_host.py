"""bench/engine_host.py (the engine's host work per decode step, the model stubbed out) runs end to end at toy
sizes: every request decodes through the window and each row's host time is a positive measurement."""

from bench_run import run_bench


def test_engine_host_bench_times_every_batch(tmp_path):
    data, _ = run_bench("engine_host.py", "--batches", "1", "3", "--lengths", "24", "--window", "8", "--repeats", "1",
                        "--label", "smoke", out=tmp_path / "host.json")
    rows = data["runs"]["smoke"]["rows"]
    assert [(r["batch"], r["output_tokens"], r["steps"]) for r in rows] == [(1, 24, 8), (3, 24, 8)]
    assert all(r["host_ms_per_step"] > 0 and r["wall_ms_per_step"] > 0 for r in rows)
