"""Prefix reuse on a synthetic multi-turn agent trace: the K3 hybrid prefix cache vs a block-aligned baseline.

    python bench/serve.py [--sessions 6] [--turns 6] [--json PATH] [--png PATH]

The trace: every session starts from one shared system prompt and its own task; each turn the model answers
(greedy), then a tool result and a follow-up question are appended and the whole history is sent again.
Sessions are closed-loop clients: a session's next turn is submitted when its previous one finishes, and session
s + 1 starts when session s's first turn finishes, so several sessions run concurrently through one engine.

Policies, all in the same run over the same trace (greedy output is identical across them; the run checks it):
- k3: prefix identity per hash block of h tokens, KDA checkpoints at every hash-block boundary, turn-boundary
  retention (SPEC §7); hits at any multiple of h.
- baseline: what public engines do for hybrid models: identity and KDA states only at physical-block (P-token)
  boundaries, written during prefill and decode and at request end at its last aligned position (vLLM's align
  mode); hits only at multiples of P.
- k3-sparse: the same with KDA checkpoints every `--sparse-every` hash blocks during prefill (plus the turn
  boundary): fewer, larger prefill chunks (faster on a CPU) for hits that may fall back to a coarser boundary.
- none: no prefix cache (the TTFT / throughput reference).
Every policy prefills the same number of tokens per engine step (`--prefill-tokens`: the scheduler cuts the chunk
that reaches the budget), so the TTFT and throughput columns compare caching, not scheduling.
Ideal reuse of a request: every full hash block (of h) of its prompt shared with a request that finished before
it was submitted (capped at the prompt length minus one, since the last prompt token must run to give logits).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

import torch

from openk3.config import get_preset
from openk3.model import K3ForCausalLM
from openk3.sampling import SamplingParams
from openk3.serve.engine import Engine, EngineConfig
from openk3.serve.scheduler import SchedulerConfig
from openk3.tokenizer import ByteTokenizer

WORDS = ("read", "file", "grep", "patch", "test", "error", "line", "module", "config", "build", "cache", "token",
         "result", "agent", "tool", "call", "output", "diff", "commit", "check")


def words(rng: random.Random, n_tokens: int) -> str:
    text = ""
    while len(text) < n_tokens:
        text += rng.choice(WORDS) + " "
    return text[:n_tokens]


def build_trace(seed: int, sessions: int, turns: int, system_tokens: int, tool_tokens: tuple[int, int]) -> dict:
    rng = random.Random(seed)
    tok = ByteTokenizer()
    system = tok.encode(f"<|im_start|>system\n{words(rng, system_tokens)}<|im_end|>\n")
    plan = []
    for s in range(sessions):
        task = tok.encode(f"<|im_start|>user\nTask {s}: {words(rng, 24)}<|im_end|>\n<|im_start|>assistant\n")
        follow = [tok.encode(f"<|im_end|>\n<|im_start|>tool\n{words(rng, rng.randint(*tool_tokens))}<|im_end|>\n"
                             f"<|im_start|>user\nnext step?<|im_end|>\n<|im_start|>assistant\n")
                  for _ in range(turns - 1)]
        plan.append({"first": system + task, "follow": follow})
    return {"sessions": plan}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_policy(model, policy: str, trace: dict, args) -> dict:
    h, P = args.hash_block, args.page_size
    config = EngineConfig(prefix_cache=policy != "none", hash_block=P if policy == "baseline" else h, page_size=P,
                          cache_bytes=args.cache_mb << 20, seed=0,
                          checkpoint_every=args.sparse_every if policy == "k3-sparse" else 1,
                          compile_decode=getattr(args, "compile_decode", True),
                          scheduler=SchedulerConfig(max_running=len(trace["sessions"]),  # the trace's concurrency
                                                    prefill_tokens_per_step=args.prefill_tokens))
    engine = Engine(model, ByteTokenizer(), config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    plans = trace["sessions"]
    history = [list(p["first"]) for p in plans]
    turn, current, finished_fed, records = [0] * len(plans), [None] * len(plans), [], []
    started = 0

    def submit(s: int) -> None:
        prompt = history[s]
        shared = max((common_prefix(prompt, fed) for fed in finished_fed), default=0)
        ideal = h * (min(shared, len(prompt) - 1) // h)
        current[s] = (engine.add_request(list(prompt), params), ideal)

    submit(0)
    started = 1
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
        for s, item in enumerate(current):
            if item is None or item[0].finish_reason is None:
                continue
            r, ideal = item
            records.append({"session": s, "turn": turn[s], "prompt_tokens": len(r.prompt),
                            "reused": r.cached_tokens, "ideal": ideal, "ttft_s": r.first_token_at - r.arrival,
                            "output": list(r.output)})
            finished_fed.append(r.prompt + r.output[:-1])
            history[s] += r.output
            current[s] = None
            if turn[s] == 0 and started < len(plans):
                submit(started)
                started += 1
            if turn[s] + 1 < args.turns:
                history[s] += plans[s]["follow"][turn[s]]
                turn[s] += 1
                submit(s)
    wall = time.perf_counter() - t0
    ttfts = [r["ttft_s"] for r in records]
    generated = sum(len(r["output"]) for r in records)
    prompt_tokens = sum(r["prompt_tokens"] for r in records)
    reused = sum(r["reused"] for r in records)
    return {
        "policy": policy, "hash_block": config.hash_block, "page_size": P,
        "checkpoint_every": config.checkpoint_every, "requests": len(records),
        "reused_tokens": reused, "ideal_tokens": sum(r["ideal"] for r in records), "prompt_tokens": prompt_tokens,
        "prefilled_tokens": prompt_tokens - reused, "wall_s": wall,
        "ttft_mean_s": statistics.mean(ttfts), "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": statistics.quantiles(ttfts, n=10)[-1], "generated_tokens": generated,
        "throughput_tok_s": (prompt_tokens + generated) / wall, "records": records,
    }


def per_turn(result: dict, key: str, turns: int) -> list[int]:
    return [sum(r[key] for r in result["records"] if r["turn"] == t) for t in range(turns)]


def plot(results: dict, turns: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = list(range(1, turns + 1))
    ax.plot(xs, per_turn(results["k3"], "ideal", turns), "k--", label="ideal (every shared hash block)")
    ax.plot(xs, per_turn(results["k3"], "reused", turns), "o-", label="K3 hybrid prefix cache")
    ax.plot(xs, per_turn(results["k3-sparse"], "reused", turns), "^:", label="K3, sparser prefill checkpoints")
    ax.plot(xs, per_turn(results["baseline"], "reused", turns), "s-", label="baseline (block-aligned)")
    ax.set_xlabel("turn")
    ax.set_ylabel("reused prefix tokens (all sessions)")
    ax.set_title("Prefix reuse on a multi-turn agent trace")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=120)
    ap.add_argument("--tool-tokens", type=int, nargs=2, default=(16, 48))
    ap.add_argument("--max-tokens", type=int, default=12, help="tokens generated per turn")
    ap.add_argument("--hash-block", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=192)
    ap.add_argument("--cache-mb", type=int, default=256)
    ap.add_argument("--prefill-tokens", type=int, default=256)
    ap.add_argument("--sparse-every", type=int, default=4, help="k3-sparse: hash blocks between KDA checkpoints")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    out = os.environ.get("OUT", "bench")
    ap.add_argument("--json", default=os.path.join(out, "serve.json"))
    ap.add_argument("--png", default=os.path.join(out, "serve_reuse.png"))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = K3ForCausalLM(get_preset(args.preset)).eval()
    trace = build_trace(args.seed, args.sessions, args.turns, args.system_tokens, tuple(args.tool_tokens))
    results = {policy: run_policy(model, policy, trace, args) for policy in ("k3", "k3-sparse", "baseline", "none")}
    outputs = [sorted((r["session"], r["turn"], r["output"]) for r in res["records"]) for res in results.values()]
    identical = all(o == outputs[0] for o in outputs)

    k3, base = results["k3"], results["baseline"]
    print(f"{'policy':<10} {'h':>4} {'P':>4} {'reused':>7} {'ideal':>6} {'of ideal':>8} {'prefilled':>9} "
          f"{'TTFT mean':>9} {'p50':>6} {'p90':>6} {'tok/s':>7} {'wall s':>6}")
    for res in results.values():
        share = res["reused_tokens"] / max(1, res["ideal_tokens"])
        print(f"{res['policy']:<10} {res['hash_block']:>4} {res['page_size']:>4} {res['reused_tokens']:>7} "
              f"{res['ideal_tokens']:>6} {share:>8.1%} {res['prefilled_tokens']:>9} {res['ttft_mean_s']:>9.3f} "
              f"{res['ttft_p50_s']:>6.3f} {res['ttft_p90_s']:>6.3f} {res['throughput_tok_s']:>7.1f} "
              f"{res['wall_s']:>6.1f}")
    ratio = k3["reused_tokens"] / base["reused_tokens"] if base["reused_tokens"] else None  # None: the baseline none
    versus = (f"{ratio:.2f}x the baseline's tokens" if ratio is not None
              else f"{k3['reused_tokens']} tokens where the baseline reused none")
    print(f"k3 reuses {k3['reused_tokens'] / max(1, k3['ideal_tokens']):.1%} of ideal, {versus}; "
          f"greedy outputs identical across policies: {identical}")
    print("reused per turn  k3:", per_turn(k3, "reused", args.turns), " baseline:",
          per_turn(base, "reused", args.turns), " ideal:", per_turn(k3, "ideal", args.turns))

    info = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(), "threads": args.threads, "preset": args.preset,
            "args": vars(args), "outputs_identical": identical, "k3_vs_baseline_reused": ratio}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"info": info, "results": {p: {k: v for k, v in r.items() if k != "records"} | {
            "per_turn_reused": per_turn(r, "reused", args.turns), "per_turn_ideal": per_turn(r, "ideal", args.turns)}
            for p, r in results.items()}}, fh, indent=1)
    plot(results, args.turns, args.png)
    print(f"json: {args.json}  png: {args.png}")


if __name__ == "__main__":
    main()
