"""Speculative decoding on CPU (SPEC §11): acceptance of drafts trained with different losses, decode speed with and
without speculation, and the rollback strategy for the KDA state.

    python bench/spec.py --target runs/k3-tiny --draft lk=runs/draft-lk --draft kl=runs/draft-kl [--k 3]

Per draft (`openk3 draft` run directories, the same target):
- alpha_heldout: the draft's mean acceptance sum_x min(p, q) per unrolled step, teacher-forced on held-out windows
  of the corpus (what the training loss sees, without sampling noise);
- accept_len / accept_rate: speculative decoding from held-out prompts with K drafts per verification, sampled at
  temperature 1 (seeds 0..n-1, the same for every draft) and greedy, counted as vLLM counts it
  (1 + accepted / verifications);
- decode tokens/s, batch 1, greedy: `generate_ids` against `speculative_generate` on the same prompts, interleaved,
  median of the repeats (one torch thread: the machine is shared).
- serving: the engine (`openk3.serve.engine`, CPU) with `--clients` greedy requests at once, generated tokens per
  second of wall time with and without speculation.
Rollback (with the first draft): the verification forward of K + 1 tokens recording the KDA states after each of
the first K (the per-position snapshots `HybridCache.rewind` uses) against the same forward without them plus what
the recompute strategy adds (one snapshot of the KDA states before it; after a rejection, restoring it and a second
forward over the a + 1 kept tokens), weighted by the measured distribution of accepted drafts per round; and the
`kda` op alone with states after each of the first K of K + 1 tokens, recurrence against the chunked form.
Writes a JSON (default bench/spec.json) and prints the numbers.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from openk3.checkpoints import resolve_checkpoint
from openk3.draft import SpeculationStats, load_draft, speculative_generate
from openk3.generation import generate_ids
from openk3.interop import load_pretrained
from openk3.sampling import SamplingParams
from openk3.tokenizer import TextTokenizer
from openk3.train.data import heldout_windows, load_documents, train_and_heldout_streams
from openk3.train.draft import acceptance, draft_losses


def heldout_alpha(model, draft, windows: torch.Tensor, k: int, batch: int = 8) -> list[float]:
    sums = [0.0] * k
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            _, alphas = draft_losses(model, draft, windows[i:i + batch], "lk", k)
            sums = [s + a * len(windows[i:i + batch]) for s, a in zip(sums, alphas)]
    return [s / len(windows) for s in sums]


def decode_speed(model, draft, prompts: list[list[int]], tokens: int, k: int, repeats: int) -> dict:
    """Median tokens/s of plain and speculative greedy decoding (prefill excluded: the time to the first token is
    subtracted using a 1-token run of each prompt)."""
    greedy = SamplingParams(max_tokens=tokens, temperature=0)

    def timed(fn, *args) -> float:
        start = time.perf_counter()
        fn(*args)
        return time.perf_counter() - start

    plain, spec = [], []
    for _ in range(repeats):
        for prompt in prompts:
            prefill = timed(generate_ids, model, prompt, 1, greedy)
            plain.append(tokens / max(1e-9, timed(generate_ids, model, prompt, tokens, greedy) - prefill))
            spec.append(tokens / max(1e-9, timed(speculative_generate, model, draft, prompt, tokens, greedy, k)
                                     - prefill))
    return {"plain_tokens_per_s": statistics.median(plain), "speculative_tokens_per_s": statistics.median(spec),
            "speedup": statistics.median(spec) / statistics.median(plain)}


def engine_speed(model, draft, tokenizer, prompts: list[list[int]], tokens: int, k: int) -> dict:
    """Generated tokens per second of wall time, all prompts submitted at once, greedy."""
    from openk3.serve.engine import Engine, EngineConfig
    from openk3.serve.scheduler import SchedulerConfig

    out = {}
    for label, spec in (("plain", 0), ("speculative", k)):
        engine = Engine(model, tokenizer, EngineConfig(speculative=spec, scheduler=SchedulerConfig(
            max_running=len(prompts), prefill_tokens_per_step=4096)), draft if spec else None)
        requests = [engine.add_request(p, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
                    for p in prompts]
        engine.step()  # the prefills (and first tokens)
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        out[f"{label}_tokens_per_s"] = sum(len(r.output) - 1 for r in requests) / (time.perf_counter() - start)
    out["speedup"] = out["speculative_tokens_per_s"] / out["plain_tokens_per_s"]
    return out


def kda_offset_costs(k: int, repeats: int) -> dict:
    """Milliseconds of one `kda` call over K + 1 tokens returning the states after each of the first K, k3-tiny's
    KDA shape (4 heads of 32), by batch size and backend."""
    from openk3.ops.kda import kda

    gen = torch.Generator().manual_seed(0)
    out = {}
    for batch in (1, 8, 32):
        shape = (batch, k + 1, 4, 32)
        q, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        key = torch.nn.functional.normalize(torch.randn(shape, generator=gen), dim=-1)
        g, beta = -torch.rand(shape, generator=gen), torch.rand(shape[:3], generator=gen)
        state = torch.randn(batch, 4, 32, 32, generator=gen)
        for backend in ("recurrent", "chunked"):
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                kda(q, key, v, g, beta, initial_state=state, output_final_state=True, backend=backend, gate_min=-5.0,
                    state_offsets=tuple(range(1, k + 1)))
                times.append(time.perf_counter() - start)
            out[f"batch_{batch}_{backend}_ms"] = 1e3 * statistics.median(times)
    return out


def rollback_costs(model, prompt: list[int], k: int, by_accepted: dict[int, int], repeats: int) -> dict:
    """Milliseconds per round of the two rollback strategies (module docstring)."""
    with torch.no_grad():
        base = model.new_cache(1)
        model(torch.tensor([prompt]), cache=base)
        ids = torch.tensor([prompt[:k + 1]])

        def forward(tokens: torch.Tensor, offsets: tuple[int, ...]) -> float:
            cache = copy.deepcopy(base)
            cache.checkpoint_offsets = offsets
            start = time.perf_counter()
            model(tokens, cache=cache)
            return time.perf_counter() - start

        def snapshot() -> float:
            start = time.perf_counter()
            [layer.extract(0) for layer in base.layers if layer.kind == "kda"]
            return time.perf_counter() - start

        times: dict[str, list[float]] = {"offsets": [], "plain": [], "snapshot": [],
                                         **{f"forward_{m}": [] for m in range(1, k + 1)}}
        for _ in range(repeats):
            times["offsets"].append(forward(ids, tuple(range(1, k + 1))))
            times["plain"].append(forward(ids, ()))
            times["snapshot"].append(snapshot())
            for m in range(1, k + 1):
                times[f"forward_{m}"].append(forward(ids[:, :m], ()))
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    rounds = sum(by_accepted.values())
    recompute_extra = sum(n / rounds * ms[f"forward_{a + 1}"] for a, n in by_accepted.items() if a < k)
    return {"verify_with_snapshots_ms": ms["offsets"], "verify_plain_ms": ms["plain"],
            "snapshot_ms": ms["snapshot"], **{f"forward_{m}_tokens_ms": ms[f"forward_{m}"] for m in range(1, k + 1)},
            "snapshots_per_round_ms": ms["offsets"],
            "recompute_per_round_ms": ms["plain"] + ms["snapshot"] + recompute_extra,
            "rejected_rounds": sum(n for a, n in by_accepted.items() if a < k) / rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="the `openk3 train` run the drafts were trained on")
    parser.add_argument("--draft", action="append", required=True, metavar="NAME=RUN", help="a draft run, named")
    parser.add_argument("--k", type=int, default=3, help="drafted tokens per verification")
    parser.add_argument("--windows", type=int, default=64, help="held-out windows of 128 tokens for alpha")
    parser.add_argument("--prompts", type=int, default=48, help="held-out prompts of 64 tokens for acceptance")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per prompt for acceptance")
    parser.add_argument("--speed-prompts", type=int, default=4)
    parser.add_argument("--speed-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8, help="concurrent requests of the engine measurement")
    parser.add_argument("--json", default=str(Path(__file__).with_name("spec.json")))
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    started = time.perf_counter()

    target_ckpt = resolve_checkpoint(args.target)
    tok = TextTokenizer.from_file(target_ckpt / "tokenizer.json")
    _, held = train_and_heldout_streams(load_documents(None), tok)
    windows = heldout_windows(held, 127, args.windows)
    prompts = heldout_windows(held, 63, args.prompts)
    results: dict = {"date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                     "torch": torch.__version__, "threads": 1, "k": args.k, "target": str(target_ckpt),
                     "load_before": load_before, "drafts": {}}
    first_stats = None
    for spec in args.draft:
        name, run = spec.split("=", 1)
        ckpt = resolve_checkpoint(run)
        model = load_pretrained(ckpt).eval()
        draft = load_draft(model, ckpt)
        row: dict = {"checkpoint": str(ckpt), "training": json.loads((ckpt / "draft.json").read_text())["training"]}
        row["alpha_heldout"] = heldout_alpha(model, draft, windows, args.k)
        for label, temperature in (("sampled", 1.0), ("greedy", 0.0)):
            stats: SpeculationStats = acceptance(model, draft, prompts, args.tokens, args.k, temperature, seed=0)
            row[label] = {"accept_len": stats.accept_len, "accept_rate": stats.accept_rate,
                          "verifications": stats.rounds, "by_accepted": dict(sorted(stats.by_accepted.items()))}
            if first_stats is None and label == "sampled":
                first_stats, first_model = stats, model
        row["speed"] = decode_speed(model, draft, prompts[:args.speed_prompts].tolist(), args.speed_tokens, args.k,
                                    args.repeats)
        row["engine"] = engine_speed(model, draft, tok, prompts[:args.clients].tolist(), args.speed_tokens, args.k)
        results["drafts"][name] = row
        print(f"{name}: alpha (held-out, per step) {[round(a, 4) for a in row['alpha_heldout']]}, accept_len "
              f"{row['sampled']['accept_len']:.3f} sampled / {row['greedy']['accept_len']:.3f} greedy, decode "
              f"{row['speed']['plain_tokens_per_s']:.1f} -> {row['speed']['speculative_tokens_per_s']:.1f} tok/s, "
              f"engine x{args.clients} {row['engine']['plain_tokens_per_s']:.1f} -> "
              f"{row['engine']['speculative_tokens_per_s']:.1f} tok/s", flush=True)
    results["rollback"] = rollback_costs(first_model, prompts[0].tolist(), args.k, first_stats.by_accepted,
                                         5 * args.repeats)
    results["kda_offsets"] = kda_offset_costs(args.k, 10 * args.repeats)
    print(json.dumps(results["kda_offsets"], indent=2))
    results["load_after"] = os.getloadavg()
    results["seconds"] = time.perf_counter() - started
    print(json.dumps(results["rollback"], indent=2))
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
