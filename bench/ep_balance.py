"""Expert-parallel load balance at K3 scale, simulated on the CPU (no GPUs, no model).

  python bench/ep_balance.py [--tokens-per-rank 4096] [--steps 20] [--ranks 64 128] [--router-ckpt RUN_OR_CKPT]

896 routed experts, top-16, 64 and 128 EP ranks, S tokens per rank. Each step draws a tokens-per-expert table
[R, E] from a routing distribution and reports, per placement, max / mean rows computed per rank (1.00 = every
rank does the same work; the step waits for the slowest rank):
  static     every row on its expert's home rank (plain EP, `openk3.parallel.planner.plan_static`);
  EPLB       DeepSeek EPLB-style static replicas (one redundant slot per rank): the experts with the highest
             load per replica get the extra replicas, replicas are packed heaviest first onto the least-loaded rank
             with a free slot; planned from the mean load of 10 earlier steps of the same distribution, as EPLB runs
             periodically from statistics, then used on a fresh step; an expert's rows are split evenly over its
             replicas;
  balanced   MoonEP's online planner (`plan_balanced`) on the step's own table: exactly S x K rows per rank; its
             planning time per step (one MoE layer; wall and CPU time of the thread, medians over the steps: on a
             shared machine the wall time includes waiting for a core), and the most replicas on one rank.
Routing distributions (expert popularity p; each token picks K distinct experts, so an expert's share of a token's
picks is capped at 1: inclusion probabilities pi = min(1, c p) with sum K, rows drawn multinomially per rank):
  uniform, zipf-1.0 / zipf-1.5 (p ~ 1 / rank^s over a random expert order), hot-expert (one expert chosen by half
  of all tokens, the rest uniform), zipf-1.0-drift (zipf-1.0 times per-rank, per-step lognormal noise, sigma 1:
  what each rank's data prefers changes from batch to batch).
--router-ckpt: also the routers of a trained openk3 model (e.g. `runs/k3-tiny`) on held-out windows of its
training corpus (the stdlib), per MoE layer, at 2, 4 and 8 ranks (k3-tiny has 8 experts).

Prints a Markdown table and writes bench/ep_balance.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from openk3.parallel.planner import plan_balanced, plan_static

HERE = Path(__file__).parent
EXPERTS, TOP_K = 896, 16
HISTORY_STEPS = 10


def inclusion_probabilities(p: np.ndarray, k: int) -> np.ndarray:
    """pi_e = min(1, c p_e) with sum_e pi_e = k (water-filling): the chance a token picks expert e among its k."""
    pi = np.zeros_like(p)
    free = np.ones(len(p), dtype=bool)
    budget = float(k)
    while True:
        pi[free] = budget * p[free] / p[free].sum()
        over = free & (pi > 1)
        if not over.any():
            return pi
        pi[over] = 1.0
        free &= ~over
        budget = k - pi[~free].sum()


def popularity(name: str, rng: np.random.Generator) -> np.ndarray:
    if name == "uniform":
        return np.full(EXPERTS, 1.0 / EXPERTS)
    if name.startswith("zipf"):
        s = float(name.split("-")[1])
        p = 1.0 / np.arange(1, EXPERTS + 1) ** s
        return rng.permutation(p / p.sum())
    if name == "hot-expert":
        p = np.full(EXPERTS, (TOP_K - 0.5) / (EXPERTS - 1))
        p[rng.integers(EXPERTS)] = 0.5
        return p / p.sum()
    raise ValueError(name)


def draw_counts(p: np.ndarray, ranks: int, tokens: int, rng: np.random.Generator, drift: bool) -> np.ndarray:
    """[R, E] rows per (source rank, expert): tokens x TOP_K rows per rank."""
    rows = []
    for _ in range(ranks):
        q = p * rng.lognormal(0.0, 1.0, size=p.shape) if drift else p
        pi = inclusion_probabilities(q / q.sum(), TOP_K)
        rows.append(rng.multinomial(tokens * TOP_K, pi / TOP_K))
    return np.stack(rows)


def eplb_placement(load: np.ndarray, ranks: int, extra_per_rank: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(replicas per expert [E], rank of each replica slot): DeepSeek EPLB's replicate-then-pack, greedy."""
    E = len(load)
    replicas = np.ones(E, dtype=np.int64)
    for _ in range(ranks * extra_per_rank):
        replicas[np.argmax(load / replicas)] += 1
    slots = (E + ranks * extra_per_rank) // ranks
    rank_load, rank_free = np.zeros(ranks), np.full(ranks, slots)
    owners = []  # (expert, rank) per replica
    pieces = [(load[e] / replicas[e], e) for e in range(E) for _ in range(replicas[e])]
    for weight, e in sorted(pieces, reverse=True):
        candidates = np.flatnonzero(rank_free > 0)
        r = candidates[np.argmin(rank_load[candidates])]
        rank_load[r] += weight
        rank_free[r] -= 1
        owners.append((e, r))
    experts, owner_ranks = np.array(owners).T
    return replicas, np.stack([experts, owner_ranks])


def eplb_rows(counts: np.ndarray, replicas: np.ndarray, owners: np.ndarray, ranks: int) -> np.ndarray:
    load = counts.sum(0)
    experts, owner_ranks = owners
    return np.bincount(owner_ranks, weights=load[experts] / replicas[experts], minlength=ranks)


def imbalance(rows: np.ndarray) -> float:
    return float(rows.max() / rows.mean())


def simulate(dist: str, ranks: int, tokens: int, steps: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    p = popularity(dist.removesuffix("-drift"), rng)
    drift = dist.endswith("-drift")
    history = sum(draw_counts(p, ranks, tokens, rng, drift).sum(0) for _ in range(HISTORY_STEPS)) / HISTORY_STEPS
    replicas, owners = eplb_placement(history, ranks)
    static, eplb, eplb_oracle, balanced, times, cpu_times, most_replicas = [], [], [], [], [], [], 0
    for _ in range(steps):
        counts = draw_counts(p, ranks, tokens, rng, drift)
        static.append(imbalance(plan_static(counts).rows_received()))
        eplb.append(imbalance(eplb_rows(counts, replicas, owners, ranks)))
        eplb_oracle.append(imbalance(eplb_rows(counts, *eplb_placement(counts.sum(0), ranks), ranks)))
        start, cpu = time.perf_counter(), time.thread_time()
        plan = plan_balanced(counts)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.thread_time() - cpu)
        rows = plan.rows_received()
        assert (rows == tokens * TOP_K).all(), "the balanced planner must give every rank S x K rows"
        balanced.append(imbalance(rows))
        most_replicas = max(most_replicas, max(len(plan.replicas(r)) for r in range(ranks)))
    return {"distribution": dist, "ranks": ranks, "tokens_per_rank": tokens, "steps": steps,
            "static": float(np.mean(static)), "static_worst": float(np.max(static)),
            "eplb": float(np.mean(eplb)), "eplb_worst": float(np.max(eplb)),
            "eplb_same_step": float(np.mean(eplb_oracle)),
            "balanced": float(np.mean(balanced)), "balanced_worst": float(np.max(balanced)),
            "plan_ms_median": 1e3 * float(np.median(times)), "plan_ms_max": 1e3 * float(np.max(times)),
            "plan_cpu_ms_median": 1e3 * float(np.median(cpu_times)),
            "max_replicas_per_rank": int(most_replicas), "replica_slots": EXPERTS // ranks}


def router_tables(ckpt: str, ranks_list=(2, 4, 8), windows: int = 64, seq_len: int = 128) -> list[dict]:
    """Tokens-per-expert tables of a trained model's routers on held-out windows, split over ranks by windows."""
    import torch

    from openk3.checkpoints import resolve_checkpoint
    from openk3.interop import load_pretrained
    from openk3.tokenizer import TextTokenizer
    from openk3.train.data import heldout_windows, load_documents, train_and_heldout_streams

    path = resolve_checkpoint(ckpt)
    model = load_pretrained(path).eval()
    tok = TextTokenizer.from_file(path / "tokenizer.json")
    _, held = train_and_heldout_streams(load_documents(None), tok)
    batch = heldout_windows(held, seq_len, windows)[:, :-1]
    indices = {}
    for layer, router in model.routers():
        router.register_forward_hook(lambda _m, _i, out, layer=layer: indices.__setitem__(layer, out.indices))
    with torch.no_grad():
        model(batch, return_mtp=True)
    results = []
    for ranks in ranks_list:
        for layer, idx in sorted(indices.items()):
            E = model.config.moe.num_experts
            per_rank = idx.view(ranks, -1)  # consecutive windows per rank
            counts = np.stack([np.bincount(r.numpy().ravel(), minlength=E) for r in per_rank])
            plan = plan_balanced(counts)
            results.append({"layer": layer, "ranks": ranks, "tokens_per_rank": per_rank.shape[1] // idx.shape[-1],
                            "static": imbalance(plan_static(counts).rows_received()),
                            "balanced": imbalance(plan.rows_received())})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens-per-rank", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--distributions", nargs="+",
                        default=["uniform", "zipf-1.0", "zipf-1.5", "hot-expert", "zipf-1.0-drift"])
    parser.add_argument("--router-ckpt", default=None, help="a trained openk3 run or checkpoint directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(HERE / "ep_balance.json"))
    args = parser.parse_args()

    rows = [simulate(d, r, args.tokens_per_rank, args.steps, args.seed) for r in args.ranks for d in args.distributions]
    print(f"\n{EXPERTS} experts, top-{TOP_K}, {args.tokens_per_rank} tokens per rank, {args.steps} steps: max / mean "
          "rows per rank (mean over steps; worst in brackets)\n")
    print("| ranks | routing | static | EPLB (history) | EPLB (same step) | balanced | plan ms (median / max) | "
          "plan CPU ms | replicas per rank (max / slots) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']} | {r['distribution']} | {r['static']:.2f} ({r['static_worst']:.2f}) | "
              f"{r['eplb']:.2f} ({r['eplb_worst']:.2f}) | {r['eplb_same_step']:.2f} | "
              f"{r['balanced']:.2f} ({r['balanced_worst']:.2f}) | {r['plan_ms_median']:.2f} / {r['plan_ms_max']:.2f} "
              f"| {r['plan_cpu_ms_median']:.2f} | {r['max_replicas_per_rank']} / {r['replica_slots']} |")
    routers = router_tables(args.router_ckpt) if args.router_ckpt else []
    if routers:
        print(f"\nrouters of {args.router_ckpt} on held-out windows, all MoE layers (per layer in the JSON)\n")
        print("| ranks | tokens per rank | static (mean / worst layer) | balanced (worst layer) |\n|---|---|---|---|")
        for ranks in sorted({r["ranks"] for r in routers}):
            rs = [r for r in routers if r["ranks"] == ranks]
            static = [r["static"] for r in rs]
            print(f"| {ranks} | {rs[0]['tokens_per_rank']} | {np.mean(static):.2f} / {max(static):.2f} | "
                  f"{max(r['balanced'] for r in rs):.2f} |")
    result = {"experts": EXPERTS, "top_k": TOP_K, "simulated": rows, "router_ckpt": args.router_ckpt,
              "routers": routers, "machine": platform.machine(), "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d")}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
