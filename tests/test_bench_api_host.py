"""bench/api_host.py (the HTTP API's host cost per streamed token, over a synthetic engine) runs end to end: a real
uvicorn process (the stack openk3 serve runs, and asyncio + h11) streams to raw-socket clients, at a step rate the
API keeps up with and at one where the engine runs ahead of it (the API then sends the tokens that queued up in
one write): every reply arrives with one well-formed event per token (the bench's clients raise otherwise) and
each row is a positive measurement."""

from bench_run import run_bench


def test_api_host_bench_streams_every_token(tmp_path):
    rows = run_bench("api_host.py", "--clients", "6", "--step-ms", "20", "0.2", "--reply", "24", "--seconds", "1.0",
                     "--rounds", "1", out=tmp_path / "api.json")[0]["rows"]
    assert [(r["stack"], r["clients"], r["step_ms"]) for r in rows] == [
        ("auto", 6, 20.0), ("h11", 6, 20.0), ("auto", 6, 0.2), ("h11", 6, 0.2)]
    assert all(r["tok_per_s"] > 0 and r["server_cpu_us_per_token"] > 0 and len(r["rounds_tok_per_s"]) == 1
               for r in rows)
    # at 20 ms a step the API keeps up: the rate is the synthetic engine's (6 clients x 50 steps a second)
    demanded = 6 * 1000 / 20
    assert all(0.5 * demanded < r["tok_per_s"] <= 1.05 * demanded for r in rows[:2])
