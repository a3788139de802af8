"""A/B of the compiled k3 training step across source trees, with the step's kernel time by category.

  python bench/step_ab.py [--tree NAME=DIR ...] [--compile-mode NAME=MODE ...] [--steps 8] [--kernels 40]
                          [--gaps 12] [--host-profile N] [--launches N] [--packed NAME ...]
                          [--preset k3-debug] [--batch-size 8 --seq-len 4096]

CUDA only. For each tree (DIR holds a `src/` with the openk3 package; default: this checkout's, as "main") a
process of its own builds the k3 model with `compile_blocks`, runs the bf16-autocast AdamW step of
`bench/train.py gpu` (LM + MTP loss, fresh random batches, the same in every tree: each step's loss is listed),
times `--steps` steps after 3 warm-up steps (which compile), then profiles one step and sums its kernels by
category (KDA kernels, the conv, cuBLAS GEMMs, grouped GEMMs, attention, Inductor's kernels, ATen's, the loss
rows, the optimizer), with the GPU's idle time inside that step and its longest gaps between kernels (the GPU
waiting for the host), and runs one more step under CUDA's sync debug mode to list where the host waited for the
GPU (file:line, count); `--host-profile N` adds the host's N costliest functions in a forward and a backward
(cProfile); `--launches N` the N host operators that launch the most kernels (each launch costs the GPU a gap
beside its kernel); `--compile-mode NAME=MODE` compiles tree NAME's units in that torch.compile mode; `--packed
NAME` gives tree NAME packed documents (`openk3 train --packing docs`: the corpus's segment ids on the same random
tokens, `bench/train.py`'s packed row), so `--tree unpacked=. --tree packed=. --packed packed` splits packing's
cost by category. Trees run
one after another on the same GPU and share Inductor's cache, so a variant recompiles only the graphs it changed.
Prints a table per tree (the `--kernels` heaviest kernels) and the comparison last; writes bench/step_ab.json. Use
it for the A/B of a change before `bench/train.py gpu` records the result: a tree can be a `git worktree` or an
exported copy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
CATEGORIES = [  # (category, pattern on the kernel name), first match wins
    ("kda", r"_prepare_kernel|_state_fwd_kernel|_state_bwd_kernel|_intra_bwd_kernel|_kda_|_act_"),
    ("conv", r"_conv"),
    ("loss", r"_ce_rows"),
    ("grouped_gemm", r"GroupProblemShape|grouped"),
    ("attn", r"sdpa|flash|fmha|attention"),
    ("gemm", r"nvjet|gemm|xmma|cutlass|cublas"),
    ("optim", r"FusedOpti|multi_tensor"),
    ("inductor", r"^triton_"),
    ("aten", r"at::native|at::cuda"),
]


def category(kernel: str) -> str:
    for name, pattern in CATEGORIES:
        if re.search(pattern, kernel):
            return name
    return "other"


def summarise(kernels: list[tuple[str, float, int]], top: int) -> dict:
    """kernels: (name, ms, calls) -> totals by category and the `top` heaviest kernels."""
    by_cat: dict[str, float] = {}
    for name, ms, _ in kernels:
        by_cat[category(name)] = by_cat.get(category(name), 0.0) + ms
    kernels = sorted(kernels, key=lambda k: -k[1])
    return {"kernel_ms": sum(k[1] for k in kernels), "by_category": dict(sorted(by_cat.items(), key=lambda c: -c[1])),
            "top_kernels": [{"kernel": n, "category": category(n), "ms": ms, "calls": c} for n, ms, c in kernels[:top]]}


def child(args: argparse.Namespace) -> None:
    """One tree's measurement (run with PYTHONPATH at its src/): JSON on the last line of stdout."""
    import importlib.util

    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    import openk3
    from openk3.config import get_preset

    spec = importlib.util.spec_from_file_location("bench_train", HERE / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    cfg = get_preset(args.preset)

    def batch() -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), device="cuda")

    from openk3.train.loop import lm_losses

    model, opt = train.build_k3(cfg, "compile", "adamw", **({"mode": args.mode} if args.mode else {}))
    losses = []  # every step's loss, read after the timing (the same seed and batches in every tree)
    next_segments = train.corpus_segments(cfg, args)[0] if args.packed else lambda: None

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _, _ = lm_losses(model, batch(), mtp_weight=0.3, segments=next_segments())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    torch.cuda.reset_peak_memory_stats()
    seconds, warmup_s = train.time_steps(step, args.steps, 3)
    peak = torch.cuda.max_memory_allocated() / 2**30
    host_ms = []  # the host's time to issue a step (no sync): near the step time, the step is bound by the host
    for _ in range(3):
        start = time.perf_counter()
        step()
        host_ms.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # no CPU tracing: it would slow the host
        step()
        torch.cuda.synchronize()
    kernels = [(e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()
               if e.device_type == DeviceType.CUDA and not e.is_user_annotation]  # ranges span kernels
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
             if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    row = {"source": str(Path(openk3.__file__).parent), "step_ms": seconds * 1e3, "warmup_s": warmup_s,
           "peak_gib": peak, "host_ms": host_ms, "losses": [float(x) for x in losses],
           **summarise(kernels, args.kernels), **idle_gaps(spans, args.gaps), "syncs": host_syncs(step)}
    if args.host_profile:
        row["host_profile"] = host_profile(model, batch, next_segments, opt, args.host_profile)
    if args.launches:
        row["launches"] = launch_sources(step, args.launches)
    print(json.dumps(row))


def host_profile(model, batch, next_segments, opt, top: int) -> dict:
    """The host's side of one step under cProfile, the forward (with the loss) and the backward apart: the `top`
    functions by own time, as text."""
    import cProfile
    import io
    import pstats

    import torch

    from openk3.train.loop import lm_losses

    out = {}
    torch.cuda.synchronize()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        forward = cProfile.Profile()
        forward.enable()
        loss, _, _ = lm_losses(model, batch(), mtp_weight=0.3, segments=next_segments())
        forward.disable()
    backward = cProfile.Profile()
    backward.enable()
    loss.backward()
    backward.disable()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    for name, prof in (("forward", forward), ("backward", backward)):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
        out[name] = text.getvalue()
    return out


def launch_sources(step, top: int) -> dict:
    """One more step profiled with the host's operators: each kernel (memsets and copies too) counted under the
    operator that launched it, named with its parent ("aten::fill_ < aten::zeros"); the `top` sources by launch
    count, with their GPU time and most frequent kernel. Every launch costs the GPU ~2 us beside its kernel."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return rank_sources([(e.name + (f" < {e.cpu_parent.name}" if e.cpu_parent is not None else ""),
                          [(k.name, k.duration) for k in e.kernels])
                         for e in prof.events() if e.device_type == DeviceType.CPU and e.kernels], top)


def rank_sources(ops: list[tuple[str, list[tuple[str, float]]]], top: int) -> dict:
    """ops: (source, [(kernel, us), ...]) per launching operator -> the launch total and the `top` sources."""
    sources: dict[str, dict] = {}
    for key, kernels in ops:
        src = sources.setdefault(key, {"launches": 0, "ms": 0.0, "kernels": {}})
        for name, us in kernels:
            src["launches"] += 1
            src["ms"] += us / 1e3
            src["kernels"][name[:80]] = src["kernels"].get(name[:80], 0) + 1
    ranked = sorted(sources.items(), key=lambda kv: -kv[1]["launches"])
    return {"total": sum(v["launches"] for v in sources.values()),
            "top": [{"source": key[:140], "launches": v["launches"], "ms": v["ms"],
                     "kernel": max(v["kernels"], key=v["kernels"].get)} for key, v in ranked[:top]]}


def idle_gaps(spans: list[tuple[float, float, str]], top: int) -> dict:
    """The GPU's idle time inside the profiled step (its span less the union of its kernels, in ms) and the `top`
    longest gaps between kernels, with the kernels either side: where the GPU waited for the host."""
    spans.sort()
    gaps, busy_until, prev, idle = [], spans[0][1] if spans else 0.0, spans[0][2] if spans else "", 0.0
    for start, end, name in spans[1:]:
        if start > busy_until:
            idle += start - busy_until
            gaps.append({"ms": (start - busy_until) / 1e3, "after": prev[:90], "before": name[:90]})
        if end > busy_until:
            busy_until, prev = end, name
    gaps.sort(key=lambda g: -g["ms"])
    return {"idle_ms": idle / 1e3, "gaps": gaps[:top]}


def host_syncs(step) -> list[dict]:
    """One more step under CUDA's sync debug mode: each place (file:line of the Python caller) where the host waited
    for the GPU, with its count and the first line of the warning."""
    import warnings

    import torch

    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()
    torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    places: dict[str, dict] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            place = places.setdefault(f"{w.filename}:{w.lineno}", {"count": 0, "message": str(w.message)[:120]})
            place["count"] += 1
    return [{"place": k, **v} for k, v in sorted(places.items(), key=lambda kv: -kv[1]["count"])]


def run_tree(name: str, tree: Path, args: argparse.Namespace, modes: dict[str, str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str((tree / "src").resolve()) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, __file__, "--child", "--steps", str(args.steps), "--kernels", str(args.kernels),
           "--gaps", str(args.gaps), "--host-profile", str(args.host_profile), "--launches", str(args.launches),
           "--mode", modes.get(name, ""), *(["--packed", name] if name in args.packed else []),
           "--preset", args.preset, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n")
        return {"tree": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    row = {"tree": name, **json.loads(proc.stdout.strip().splitlines()[-1]), "wall_s": time.perf_counter() - start}
    print(f"\n## {name}: step {row['step_ms']:.1f} ms, kernels {row['kernel_ms']:.1f} ms, peak {row['peak_gib']:.2f} "
          f"GiB, warm-up {row['warmup_s']:.0f} s ({row['source']})")
    print("  host time to issue a step (ms) " + " ".join(f"{x:.1f}" for x in row["host_ms"]) + "; losses "
          + " ".join(f"{x:.4f}" for x in row["losses"]))
    print("  " + ", ".join(f"{c} {ms:.2f}" for c, ms in row["by_category"].items()))
    print("| ms | calls | category | kernel |\n|---|---|---|---|")
    for k in row["top_kernels"]:
        print(f"| {k['ms']:.2f} | {k['calls']} | {k['category']} | {k['kernel'][:110]} |")
    print(f"  GPU idle in the profiled step: {row['idle_ms']:.2f} ms; longest gaps (ms, after -> before):")
    for g in row["gaps"]:
        print(f"    {g['ms']:.3f}  {g['after'][:60]} -> {g['before'][:60]}")
    if "launches" in row:
        print(f"  launches in one step: {row['launches']['total']}; by the operator that made them:")
        for src in row["launches"]["top"]:
            print(f"    {src['launches']:5d}  {src['ms']:7.2f} ms  {src['source'][:90]}  [{src['kernel'][:50]}]")
    for phase, text in row.get("host_profile", {}).items():
        print(f"  host profile, {phase}:\n{text}")
    print("  host syncs in one step: " + ("; ".join(f"{s['count']}x {s['place']} ({s['message'][:60]})"
                                                   for s in row["syncs"]) or "none"))
    sys.stdout.flush()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                        help="a source tree to measure (DIR/src holds openk3); repeatable; default main=.")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per tree (after 3 warm-up steps)")
    parser.add_argument("--kernels", type=int, default=40, help="heaviest kernels to list per tree")
    parser.add_argument("--gaps", type=int, default=12, help="longest idle gaps between kernels to list per tree")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="also profile the host's side of a step (cProfile, forward and backward apart) and "
                             "list its N costliest functions")
    parser.add_argument("--launches", type=int, default=0, metavar="N",
                        help="also count one step's kernel launches by the host operator that made them and list "
                             "the N sources with the most")
    parser.add_argument("--compile-mode", action="append", default=[], metavar="NAME=MODE",
                        help="torch.compile's mode for tree NAME (e.g. reduce-overhead: CUDA graphs); repeatable. "
                             "The same DIR may appear as two trees with different modes")
    parser.add_argument("--packed", action="append", default=[], metavar="NAME",
                        help="tree NAME trains on packed documents (openk3 train --packing docs); repeatable")
    parser.add_argument("--mode", default="", help=argparse.SUPPRESS)  # the child's
    parser.add_argument("--preset", default="k3-debug")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    trees = [t.split("=", 1) for t in args.tree] or [["main", str(HERE.parent)]]
    modes = dict(m.split("=", 1) for m in args.compile_mode)
    for flag, named in (("--compile-mode", modes), ("--packed", args.packed)):
        unknown = sorted(set(named) - {name for name, _ in trees})
        if unknown:
            raise SystemExit(f"{flag} names no --tree: {', '.join(unknown)}")
    for name, tree in trees:
        if not (Path(tree) / "src" / "openk3").is_dir():
            raise SystemExit(f"--tree {name}={tree}: no src/openk3 there")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/step_ab.py needs a CUDA device")
    rows = [run_tree(name, Path(tree), args, modes) for name, tree in trees]
    cats = sorted({c for r in rows for c in r.get("by_category", {})})
    print("\n| tree | step (ms) | kernels (ms) | peak (GiB) | " + " | ".join(cats) + " |")
    print("|---" * (4 + len(cats)) + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['tree']} | failed: {r['error']} |")
            continue
        print(f"| {r['tree']} | {r['step_ms']:.1f} | {r['kernel_ms']:.1f} | {r['peak_gib']:.2f} | "
              + " | ".join(f"{r['by_category'].get(c, 0.0):.2f}" for c in cats) + " |")
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": args.preset,
           "batch": args.batch_size, "seq_len": args.seq_len, "steps": args.steps}
    (HERE / "step_ab.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
