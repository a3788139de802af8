"""Speculative decoding on a trained target with trained drafts (issue 43): decode tokens/s with and without drafts,
accepted drafts per verification, and acceptance by context length with the prefix cache on and off.

    python bench/spec_gpu.py                                   # all of it: train, then measure (one H200)
    python bench/spec_gpu.py --train-only                      # 1st call: the target and its drafts
    python bench/spec_gpu.py --target runs/spec_gpu/target \\
        --drafts runs/spec_gpu/draft-lk runs/spec_gpu/draft-kl runs/spec_gpu/draft-hybrid   # 2nd call: measure
        [--parts throughput | --parts context --update --json FILE]                        # (or in two calls)
    python bench/spec_gpu.py --smoke                           # k3-tiny on the CPU, toy sizes: checks the script

1. The recipe (skipped for what --target / --drafts name): `openk3 train --preset k3-debug --device cuda` on the
   embedded corpus (the Python stdlib sources; --train-steps of 16 x 1024 tokens, 200 by default: past that it
   overfits the corpus; --train-seconds guards the time; uncompiled: the compile cost more than it saved), then
   `openk3 draft --loss L` from it for each of --losses (lk, kl, hybrid; --draft-steps of 16 x 512 tokens, a
   minute or two, side by side, while this script builds the plain engine of step 2). All run as subprocesses,
   their output appended to WORKDIR/recipe.log (the target) and WORKDIR/draft-L.log; the target's held-out loss
   (its summary.json, and every 50 steps from its metrics.jsonl) and each draft's last training loss and evaluated
   acceptance length go to the JSON ("recipe").
2. Throughput, in-process on `openk3.serve.engine.Engine` in bf16 as `openk3 serve` runs it (prefix cache off, so
   repeated prompts are prefilled alike): for --clients x --temperatures, C requests of 128 tokens from 128-token
   prompts cut from the corpus's held-out documents (`openk3.train.data`'s split: the target never trained on
   them), one warm-up batch then one timed batch. Plain decoding (an engine without a draft, timed once the drafts
   have finished training) once; then
   one engine with K = --k drafts per round whose draft weights are swapped in place for each draft (the target is
   frozen in `openk3 draft`, so only the draft's fc and MTP layer differ; the captured graphs read the same
   tensors), timed with K fixed and with the dynamic policy (`openk3.serve.speculation.SpecPolicy` with the
   engine's measured round costs, as `--speculative auto`; a fresh one per row, learning from its warm-up batch).
   A row: {clients, temperature, loss, k (K or "auto"), tok_per_s (plain), spec_tok_per_s,
   speedup, accepted_per_verify (engine.metrics spec_accepted_tokens / spec_drafts; null where no round ran)};
   beside them "round_costs" (the policy's measured round / plain step times by batch) and "auto_steps" (the engine
   steps of each auto row by the K chosen, "0" for plain ones).
3. Acceptance by context (`acceptance_by_context`): --sessions multi-turn sessions, each turn appending 4096
   held-out tokens (the ~90k-token held-out stream, wrapping around) to the conversation so far (its earlier
   prompts and replies) and asking for 128 greedy tokens, until the context passes --context-max (default 80000,
   past 64k; the engine's max_model_len is raised to fit),
   one request at a time with the --context-loss draft and K fixed; each step's verifications are counted in the
   bucket of the request's context length (0-16k, 16-64k, 64k+), once with the prefix cache on (each turn hits the
   one before) and once off.
Prints the tables and writes JSON (--json; default $OUT/spec_gpu.json when $OUT is set, else bench/spec_gpu.json;
--smoke: the temp directory's).
Split over calls, the runs under --workdir (default runs/spec_gpu) must still be there for --target / --drafts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import openk3
from common import default_json  # bench/common.py (the script's folder is on sys.path)
from openk3.build import load_model
from openk3.checkpoints import resolve_checkpoint
from openk3.draft import has_draft, load_draft
from openk3.interop import load_pretrained
from openk3.sampling import SamplingParams
from openk3.serve.engine import Engine, EngineConfig
from openk3.serve.scheduler import SchedulerConfig
from openk3.serve.speculation import SpecPolicy
from openk3.tokenizer import load_tokenizer
from openk3.train.data import load_documents, train_and_heldout_streams

LOSSES = ("lk", "kl", "hybrid")
BUCKETS = ((0, 16_384, "0-16k"), (16_384, 65_536, "16-64k"), (65_536, None, "64k+"))


@dataclass(frozen=True)
class Sizes:
    """What differs between the H200 run and --smoke."""
    preset: str
    train_steps: int  # `openk3 train`: --max-steps, --batch-size, --seq-len, --time-limit (a guard), --eval-every
    train_batch: int
    train_seq: int
    train_seconds: int
    train_eval_every: int
    draft_steps: int  # `openk3 draft`: --max-steps, --batch-size, --seq-len, --eval-prompts, --eval-tokens
    draft_batch: int
    draft_seq: int
    draft_eval_prompts: int
    draft_eval_tokens: int
    clients: tuple[int, ...]
    new_tokens: int
    prompt_tokens: int
    turn_tokens: int
    answer_tokens: int
    context_max: int


# the corpus's training split is ~1.0M tokens under k3-debug's 32k BPE (62 steps of 16 x 1024 an epoch). The target
# overfits past ~3 epochs: held-out loss 4.79 / 4.76 / 5.13 / 5.65 / 5.86 at steps 100 / 200 / 300 / 400 / 495 (H100,
# 2026-12-06, log 97), so the recipe stops at 200 steps; --time-limit stays as a guard
FULL = Sizes("k3-debug", 200, 16, 1024, 210, 50, 300, 16, 512, 16, 48,
             (1, 8, 64), 128, 128, 4096, 128, 80_000)
SMOKE = Sizes("k3-tiny", 3, 2, 64, 0, 0, 2, 2, 64, 2, 8,
              (1, 2), 6, 32, 48, 8, 150)


# ---- 1. the recipe ---------------------------------------------------------------------------------------------

def launch(commands: list[tuple[list[str], Path]]) -> Callable[[], None]:
    """Start `openk3` commands side by side (the openk3 this script imports), each one's output appended to its log;
    returns the wait for them all, which ends the script with one line if any failed."""
    src = str(Path(openk3.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (src, os.environ.get("PYTHONPATH"))))}
    started, running = time.perf_counter(), []
    for cmd, log in commands:
        fh = log.open("a")
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        running.append((cmd, log, fh, subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)))

    def wait() -> None:
        failed = []
        for cmd, log, fh, proc in running:
            code = proc.wait()
            fh.close()
            print(f"  {' '.join(cmd[2:7])}: {time.perf_counter() - started:.0f} s (exit {code})", flush=True)
            if code:
                failed.append(f"`{' '.join(cmd[2:])}` failed (exit {code}); see {log}")
        if failed:
            raise SystemExit("bench/spec_gpu.py: " + "; ".join(failed))

    return wait


def train_target(args, sizes: Sizes, out: Path, log: Path) -> Path:
    """`openk3 train` uncompiled: a compiled run spent ~150 of its 245 s compiling (H100, log 97) and then stepped
    at 0.16 s; eager steps are expected at ~0.3 s (not measured at this shape), ~60 s for 200 steps."""
    launch([([sys.executable, "-m", "openk3", "train", "--preset", sizes.preset, "--device", args.device,
              "--out", str(out), "--overwrite", "--no-progress", "--no-compile", "--max-steps", str(sizes.train_steps),
              "--batch-size", str(sizes.train_batch), "--seq-len", str(sizes.train_seq),
              "--time-limit", str(sizes.train_seconds), "--eval-every", str(sizes.train_eval_every),
              "--sample-tokens", "16"], log)])()
    return out


def draft_command(args, sizes: Sizes, target: Path, loss: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "openk3", "draft", "--ckpt", str(target), "--loss", loss, "--device",
            args.device, "--draft-tokens", str(args.k), "--out", str(out), "--overwrite", "--no-progress",
            "--eval-every", "0", "--max-steps", str(sizes.draft_steps), "--batch-size", str(sizes.draft_batch),
            "--seq-len", str(sizes.draft_seq), "--eval-prompts", str(sizes.draft_eval_prompts),
            "--eval-tokens", str(sizes.draft_eval_tokens)]


def summary(run_dir: Path) -> dict:
    path = run_dir / "summary.json"
    if not path.is_file():
        raise SystemExit(f"bench/spec_gpu.py: {run_dir} has no summary.json (not an `openk3 train`/`draft` run)")
    return json.loads(path.read_text())


def draft_notes(ckpt: Path) -> dict:
    """How a draft checkpoint was trained (its draft.json's training notes: loss, ckpt of the target, ...)."""
    if not has_draft(ckpt):
        raise SystemExit(f"bench/spec_gpu.py: --drafts {ckpt} holds no draft (draft.json); pass `openk3 draft` runs")
    return json.loads((ckpt / "draft.json").read_text())["training"]


def build_runs(args, sizes: Sizes) -> tuple[Path, Callable[[], dict[str, Path]]]:
    """The target run directory (trained first where not given), and the wait for {loss: draft checkpoint}: the
    drafts to train are started and train while the caller goes on (it builds the plain engine meanwhile)."""
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "recipe.log"
    if args.target:
        target = Path(args.target)
    elif args.drafts:  # the run the drafts were fine-tuned from (their draft.json's training notes)
        target = Path(draft_notes(resolve_checkpoint(args.drafts[0]))["ckpt"])
    else:
        target = train_target(args, sizes, work / "target", log)
    if args.drafts:
        runs, training = [Path(d) for d in args.drafts], (lambda: None)
    else:  # the drafts side by side (each a small model on a frozen target: together about one's time on a GPU)
        runs = [work / f"draft-{loss}" for loss in args.losses]
        training = launch([(draft_command(args, sizes, target, loss, run), work / f"draft-{loss}.log")
                           for loss, run in zip(args.losses, runs)])
    return target, lambda: draft_checkpoints(training, runs)


def draft_checkpoints(training: Callable[[], None], runs: list[Path]) -> dict[str, Path]:
    """{loss: checkpoint} of the draft runs, once `training` has waited for them."""
    training()
    drafts = {}
    for run in runs:
        ckpt = resolve_checkpoint(run)
        loss = draft_notes(ckpt).get("loss", "?")
        if loss in drafts:
            raise SystemExit(f"bench/spec_gpu.py: --drafts {drafts[loss]} and {ckpt} both hold a {loss} draft")
        drafts[loss] = ckpt
    return drafts


def heldout_curve(run_dir: Path) -> list[list[float]]:
    """[step, held-out loss] at each evaluation of an `openk3 train` run (its metrics.jsonl)."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return [[r["step"], r["eval_loss"]] for r in records if "eval_loss" in r]


def recipe_record(target: Path, drafts: dict[str, Path]) -> dict:
    t = summary(target)
    record = {"target": {**{k: t.get(k) for k in ("steps", "heldout_loss", "unigram_loss", "train_seconds")},
                         "heldout_curve": heldout_curve(target)},
              "drafts": {}}
    for loss, ckpt in drafts.items():
        run = ckpt.parent if (ckpt.parent / "summary.json").is_file() else ckpt
        d = summary(run)
        record["drafts"][loss] = {"train_loss": d.get("loss"), "steps": d.get("steps"),
                                  "eval_accept_len": d.get("accept_len"), "checkpoint": str(ckpt)}
    return record


# ---- prompts ---------------------------------------------------------------------------------------------------

def heldout_stream(tokenizer) -> list[int]:
    """The embedded corpus's held-out token stream under the target's tokenizer (openk3.train.data's split)."""
    return train_and_heldout_streams(load_documents(None), tokenizer)[1].tolist()


def cut(stream: list[int], start: int, n: int) -> list[int]:
    """n tokens of the stream from `start`, wrapping around at its end."""
    return [stream[(start + i) % len(stream)] for i in range(n)]


def prompts_for(stream: list[int], clients: int, length: int) -> list[list[int]]:
    step = max(1, len(stream) // clients)
    return [cut(stream, i * step, length) for i in range(clients)]


# ---- engines ---------------------------------------------------------------------------------------------------

# of the device's memory for each engine: the plain engine is built while both drafts train in processes of their
# own, and `openk3 serve`'s 0.9 left them nothing (each draft run stopped out of memory on an H100, log 120)
ENGINE_MEMORY_SHARE = 0.45

def make_engine(model, tokenizer, args, draft=None, clients: int = 2, prefix_cache: bool = False,
                max_model_len: int | None = None) -> Engine:
    """An engine as `openk3 serve` builds one (bf16 weights, CUDA graphs, compiled steps unless --no-compile); with a
    draft, K = --k and the dynamic policy on, so that it times its round costs (`set_policy` picks per row)."""
    gpu = args.device == "cuda"
    k = args.k if draft is not None else 0
    config = EngineConfig(prefix_cache=prefix_cache, speculative=k, auto_speculation=bool(k),
                          compile_decode=gpu and not args.no_compile, max_model_len=max_model_len,
                          gpu_memory_utilization=ENGINE_MEMORY_SHARE,
                          scheduler=SchedulerConfig(max_running=max(clients, 2)))  # `openk3 serve`'s prefill budget
    started = time.perf_counter()
    engine = Engine(model, tokenizer, config, draft=draft)
    graphs = engine.runner.captured() or engine.runner.graph_error
    print(f"engine (K={k}, prefix cache {'on' if prefix_cache else 'off'}) started in "
          f"{time.perf_counter() - started:.0f} s (graphs: {graphs})", flush=True)
    return engine


def free_memory() -> None:
    """Give a deleted engine's pools back before the next one sizes its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def set_policy(engine: Engine, mode, costs: dict[int, float] | None) -> None:
    """K fixed (mode an int: every step a round) or the dynamic policy (mode "auto": a fresh SpecPolicy with the
    engine's measured round costs, as `--speculative auto` builds it)."""
    engine.policy = SpecPolicy(engine.config.speculative, costs) if mode == "auto" else None


def swap_draft(engine: Engine, ckpt: Path) -> None:
    """The draft of checkpoint `ckpt` in place of the engine's (same taps; only the trainable weights differ)."""
    other = load_draft(load_pretrained(ckpt), ckpt)
    if tuple(other.taps) != tuple(engine.draft.taps) or other.depth != engine.draft.depth:
        raise SystemExit(f"bench/spec_gpu.py: the draft in {ckpt} reads taps {list(other.taps)}, the first one "
                         f"{list(engine.draft.taps)}: train the drafts alike")
    with torch.no_grad():
        for mine, theirs in zip(engine.draft.trainable_parameters(), other.trainable_parameters(), strict=True):
            mine.copy_(theirs)


def spec_counts(engine: Engine) -> tuple[int, int]:
    return engine.metrics.spec_drafts, engine.metrics.spec_accepted_tokens


def run_batch(engine: Engine, prompts: list[list[int]], temperature: float, new_tokens: int, seed: int) -> dict:
    """All prompts at once until done: generated tokens per second, accepted drafts per verification, and the
    engine steps by the K chosen for them ("0": plain steps)."""
    before, steps_before = spec_counts(engine), dict(engine.metrics.spec_steps)
    start = time.perf_counter()
    requests = [engine.add_request(p, SamplingParams(max_tokens=new_tokens, temperature=temperature, ignore_eos=True,
                                                     seed=seed * 1000 + i)) for i, p in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    seconds = time.perf_counter() - start
    drafts, accepted = (now - then for now, then in zip(spec_counts(engine), before))
    steps = {str(k): n - steps_before.get(k, 0) for k, n in engine.metrics.spec_steps.items()}
    return {"tok_per_s": sum(len(r.output) for r in requests) / seconds,
            "accepted_per_verify": accepted / drafts if drafts else None,
            "steps_by_k": {k: n for k, n in steps.items() if n}}


def timed(engine: Engine, prompts: list[list[int]], temperature: float, new_tokens: int) -> dict:
    run_batch(engine, prompts, temperature, new_tokens, seed=1)  # warm-up: the allocator, this batch's shapes
    return run_batch(engine, prompts, temperature, new_tokens, seed=2)


# ---- 2. throughput ---------------------------------------------------------------------------------------------

def plain_rates(engine: Engine, stream, args, sizes: Sizes) -> dict[tuple[int, float], float]:
    rates = {}
    for clients in sizes.clients:
        for t in args.temperatures:
            rates[clients, t] = timed(engine, prompts_for(stream, clients, sizes.prompt_tokens), t,
                                      sizes.new_tokens)["tok_per_s"]
            print(f"plain, {clients} clients, temperature {t:g}: {rates[clients, t]:,.0f} tok/s", flush=True)
    return rates


def draft_engine(model, tokenizer, ckpt: Path, args, **engine_fields) -> Engine:
    """An engine with checkpoint `ckpt`'s draft (its fc and MTP layer: earlier swaps rewrote the model's)."""
    engine = make_engine(model, tokenizer, args, draft=load_draft(model, ckpt), **engine_fields)
    swap_draft(engine, ckpt)
    return engine


def spec_rows(model, tokenizer, stream, drafts: dict[str, Path], plain: dict, args, sizes: Sizes) -> dict:
    """The rows of every draft, K fixed and auto; the round costs the policy was given, and what it chose."""
    engine = draft_engine(model, tokenizer, next(iter(drafts.values())), args, clients=max(sizes.clients))
    costs = dict(zip(engine.policy.buckets, engine.policy.costs)) or None
    rows, choices = [], []
    for loss, ckpt in drafts.items():
        swap_draft(engine, ckpt)
        for mode in (args.k, "auto"):
            for clients in sizes.clients:
                for t in args.temperatures:
                    set_policy(engine, mode, costs)  # auto: a fresh policy, which learns from the warm-up batch
                    got = timed(engine, prompts_for(stream, clients, sizes.prompt_tokens), t, sizes.new_tokens)
                    base = plain[clients, t]
                    rows.append({"clients": clients, "temperature": t, "loss": loss, "k": mode, "tok_per_s": base,
                                 "spec_tok_per_s": got["tok_per_s"], "speedup": got["tok_per_s"] / base,
                                 "accepted_per_verify": got["accepted_per_verify"]})
                    if mode == "auto":
                        choices.append({"clients": clients, "temperature": t, "loss": loss,
                                        "steps_by_k": got["steps_by_k"]})
                    print(row_line(rows[-1]), flush=True)
    del engine
    free_memory()
    return {"rows": rows, "round_costs": costs, "auto_steps": choices}


# ---- 3. acceptance by context ----------------------------------------------------------------------------------

def bucket_of(context: int) -> str:
    return next(name for lo, hi, name in BUCKETS if context >= lo and (hi is None or context < hi))


def session_turns(engine: Engine, stream: list[int], start: int, sizes: Sizes, tally: dict) -> list[list[int]]:
    """One multi-turn session, one request at a time; each step's verifications go to its context's bucket.
    Returns the replies."""
    history: list[int] = []
    replies = []
    while len(history) < sizes.context_max:
        history += cut(stream, start + len(history), sizes.turn_tokens)
        request = engine.add_request(list(history), SamplingParams(max_tokens=sizes.answer_tokens, temperature=0.0,
                                                                   ignore_eos=True))
        while engine.has_work():
            before, context = spec_counts(engine), len(request.prompt) + len(request.output)
            engine.step()
            drafts, accepted = (now - then for now, then in zip(spec_counts(engine), before))
            counts = tally[bucket_of(context)]
            counts[0] += drafts
            counts[1] += accepted
        history += request.output
        replies.append(list(request.output))
    return replies


def context_acceptance(model, tokenizer, stream, ckpt: Path, args, sizes: Sizes, prefix_cache: bool) -> dict:
    max_len = sizes.context_max + sizes.turn_tokens + sizes.answer_tokens + 2 * args.k + 64
    engine = draft_engine(model, tokenizer, ckpt, args, prefix_cache=prefix_cache, max_model_len=max_len)
    set_policy(engine, args.k, None)
    tally = {name: [0, 0] for *_, name in BUCKETS}
    replies = [reply for s in range(args.sessions)
               for reply in session_turns(engine, stream, s * len(stream) // args.sessions, sizes, tally)]
    hit = engine.prefix_cache.stats.hit_tokens if engine.prefix_cache is not None else 0
    del engine
    free_memory()
    return {"hit_tokens": hit, "replies": replies,
            "buckets": {name: {"verifications": d, "accepted_per_verify": a / d if d else None}
                        for name, (d, a) in tally.items()}}


def acceptance_by_context(model, tokenizer, stream, drafts: dict[str, Path], args, sizes: Sizes) -> dict:
    loss = args.context_loss if args.context_loss in drafts else next(iter(drafts))
    result = {"loss": loss, "k": args.k, "sessions": args.sessions, "turn_tokens": sizes.turn_tokens,
              "answer_tokens": sizes.answer_tokens, "context_max": sizes.context_max}
    for on in (True, False):
        result["cache_on" if on else "cache_off"] = context_acceptance(model, tokenizer, stream, drafts[loss], args,
                                                                       sizes, prefix_cache=on)
    # greedy replies with and without prefix-cache hits (equal up to bf16 near-ties, as speculation keeps the text)
    on, off = (result[side].pop("replies") for side in ("cache_on", "cache_off"))
    result["turns"] = len(on)
    result["same_replies"] = sum(a == b for a, b in zip(on, off)) / max(1, len(on))
    return result


# ---- report ----------------------------------------------------------------------------------------------------

def fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def row_line(r: dict) -> str:
    return (f"| {r['loss']} | {r['k']} | {r['clients']} | {r['temperature']:g} | {r['tok_per_s']:,.0f} | "
            f"{r['spec_tok_per_s']:,.0f} | {r['speedup']:.2f}x | {fmt(r['accepted_per_verify'])} |")


def print_tables(result: dict) -> None:
    recipe = result.get("recipe", {})
    if recipe:
        print(f"\ntarget: held-out loss {fmt(recipe['target']['heldout_loss'], '.3f')} nats/token "
              f"({recipe['target']['steps']} steps); drafts' last training loss: "
              + ", ".join(f"{k} {fmt(v['train_loss'], '.3f')}" for k, v in recipe["drafts"].items()))
    if result.get("rows"):
        print("\n| loss | k | clients | temperature | tok/s | spec tok/s | speedup | accepted per verification |\n"
              "|---|---|---|---|---|---|---|---|")
        for r in result["rows"]:
            print(row_line(r))
    ctx = result.get("acceptance_by_context")
    if ctx:
        print(f"\nacceptance by context ({ctx['loss']} draft, K = {ctx['k']}, greedy; {ctx['turns']} turns, "
              f"{ctx['cache_on']['hit_tokens']:,} tokens hit the prefix cache, replies equal on and off: "
              f"{ctx['same_replies']:.0%})\n"
              "| context | verifications (cache on / off) | accepted per verification, cache on | cache off |\n"
              "|---|---|---|---|")
        for *_, name in BUCKETS:
            on, off = ctx["cache_on"]["buckets"][name], ctx["cache_off"]["buckets"][name]
            print(f"| {name} | {on['verifications']} / {off['verifications']} | {fmt(on['accepted_per_verify'])} | "
                  f"{fmt(off['accepted_per_verify'])} |")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="k3-tiny on the CPU at toy sizes (checks the script)")
    ap.add_argument("--workdir", default=None, help="where the recipe writes its runs and logs "
                    "(default runs/spec_gpu, runs/spec_gpu_smoke with --smoke)")
    ap.add_argument("--target", default=None, metavar="DIR",
                    help="an `openk3 train` run to reuse (no training; default with --drafts: the one they came from)")
    ap.add_argument("--drafts", nargs="+", default=None, metavar="DIR",
                    help="`openk3 draft` runs (or checkpoints) to reuse instead of training --losses")
    ap.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES, help="draft losses to train")
    ap.add_argument("--train-only", action="store_true", help="build the target and drafts, measure nothing")
    ap.add_argument("--train-steps", type=int, default=None, help=f"target steps (default {FULL.train_steps})")
    ap.add_argument("--train-seconds", type=int, default=None,
                    help=f"the target run's --time-limit (default {FULL.train_seconds}; 0: off)")
    ap.add_argument("--draft-steps", type=int, default=None, help=f"steps of each draft (default {FULL.draft_steps})")
    ap.add_argument("--parts", nargs="+", default=["throughput", "context"], choices=("throughput", "context"),
                    help="what to measure (default both)")
    ap.add_argument("--k", type=int, default=3, help="drafts per round (trained with, and fixed K)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="0: greedy (default 0 1)")
    ap.add_argument("--clients", type=int, nargs="+", default=None, help="concurrent requests (default 1 8 64)")
    ap.add_argument("--sessions", type=int, default=1, help="multi-turn sessions of the context trace")
    ap.add_argument("--context-max", type=int, default=None, help="a session ends past this many tokens (80000)")
    ap.add_argument("--context-loss", default="lk", choices=LOSSES, help="the draft of the context trace")
    ap.add_argument("--no-compile", action="store_true",
                    help="engines' steps uncompiled (still CUDA graphs): faster start, slower steps")
    ap.add_argument("--json", default=None, help="output (default $OUT/spec_gpu.json, else bench/spec_gpu.json; "
                                                 "under --smoke the temp directory's)")
    ap.add_argument("--update", action="store_true",
                    help="keep what an earlier run wrote to --json and this one did not measure (a split run: "
                         "--parts throughput, then --parts context --update)")
    args = ap.parse_args(argv)
    for flag, value in (("--k", args.k), ("--sessions", args.sessions), ("--train-steps", args.train_steps),
                        ("--draft-steps", args.draft_steps), ("--context-max", args.context_max),
                        *(("--clients", c) for c in args.clients or [])):
        if value is not None and value < 1:
            ap.error(f"{flag} must be >= 1, got {value}")
    if args.train_seconds is not None and args.train_seconds < 0:
        ap.error(f"--train-seconds must be >= 0, got {args.train_seconds}")
    args.device = "cpu" if args.smoke else "cuda"
    args.workdir = args.workdir or ("runs/spec_gpu_smoke" if args.smoke else "runs/spec_gpu")
    args.json = args.json or default_json("spec_gpu.json", args.smoke)
    return args


def sizes_for(args) -> Sizes:
    """The run's sizes: --smoke's or the H200's, with what the flags override."""
    base = SMOKE if args.smoke else FULL
    flags = {"clients": args.clients and tuple(args.clients), "context_max": args.context_max,
             "train_steps": args.train_steps, "train_seconds": args.train_seconds, "draft_steps": args.draft_steps}
    return replace(base, **{k: v for k, v in flags.items() if v is not None})


def measure(args, sizes: Sizes, target: Path, drafts: Callable[[], dict[str, Path]]) -> tuple[dict, dict]:
    """(the drafts' checkpoints, throughput rows and acceptance by context) on the target. The plain engine is built
    (compiled, captured) while the drafts train and timed once they have ended."""
    ckpt = resolve_checkpoint(target)
    dtype = torch.bfloat16 if args.device == "cuda" else None
    model, _ = load_model(ckpt, args.device, dtype)
    tokenizer = load_tokenizer(str(ckpt), model.config.vocab_size)
    stream = heldout_stream(tokenizer)
    print(f"held-out corpus: {len(stream):,} tokens", flush=True)
    result: dict = {"heldout_tokens": len(stream)}
    if "throughput" not in args.parts:
        checkpoints = drafts()
    else:
        engine = make_engine(model, tokenizer, args, clients=max(sizes.clients))
        checkpoints = drafts()
        plain = plain_rates(engine, stream, args, sizes)
        del engine
        free_memory()
        result.update(spec_rows(model, tokenizer, stream, checkpoints, plain, args, sizes))
    if "context" in args.parts:
        result["acceptance_by_context"] = acceptance_by_context(model, tokenizer, stream, checkpoints, args, sizes)
    return checkpoints, result


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench/spec_gpu.py: needs a CUDA GPU (torch sees none); --smoke runs it on the CPU")
    if args.smoke:
        torch.set_num_threads(1)
    sizes = sizes_for(args)
    torch.manual_seed(0)
    target, drafts = build_runs(args, sizes)
    measured: dict = {}
    if args.train_only:
        checkpoints = drafts()
    else:
        checkpoints, measured = measure(args, sizes, target, drafts)
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "preset": sizes.preset, "k": args.k, "new_tokens": sizes.new_tokens,
              "prompt_tokens": sizes.prompt_tokens, "compile_decode": args.device == "cuda" and not args.no_compile,
              "smoke": args.smoke, "recipe": recipe_record(target, checkpoints), **measured}
    out = Path(args.json)
    if args.update and out.is_file():
        result = {**json.loads(out.read_text()), **result}
    print_tables(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
