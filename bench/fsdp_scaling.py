"""`openk3 train` on one GPU and on N GPUs of one host in each parallel layout, same seed and global batch
(issues 13 and 14): the losses step by step, which the layout must leave alone up to bf16 rounding, and tokens/s
per GPU.

    python bench/fsdp_scaling.py [--gpus 2] [--layouts fsdp cp ep] [--preset k3-debug] [--steps 20]
                                 [--batch-size 8] [--seq-len 4096] [--optimizer adamw] [--smoke]
                                 [--json bench/train_gpu.json] [--key fsdp]
    python bench/fsdp_scaling.py --gpus 8 --layouts cp=2,ep=4 --steps 50 --key combined   # FSDP2 x CP x EP

Every run is a real process: `python -m openk3 train` alone, then under `torchrun --standalone --nproc-per-node
N` once per layout: fsdp (FSDP2 data parallel; `--batch-size` is the global batch, so each GPU takes batch / N
sequences), cp (`--cp N`: one packed stream split over the GPUs, KDA context parallel) and ep (`--ep N`: data
parallel with the experts split over the GPUs, balanced planner); `cp=C,ep=E` (either may be left out) combines
them: C-rank context-parallel groups, E-rank expert groups, data parallel over what remains. Each writes
metrics.jsonl (per step: loss and the global batch's tokens/s); tokens/s is the median over the steps after the
first three (compilation and allocator warm-up). The result goes under the key --key (default "fsdp") of the JSON
file (other keys kept: by default bench/train_gpu.json, beside bench/train.py's rows): one row per run with
`gpus`, `tokens_per_s`, `tokens_per_s_per_gpu`, `loss_max_abs_diff_vs_1gpu` (over all steps), and the scaling
efficiency (per-GPU rate with N GPUs over the 1-GPU rate). `--smoke` runs the same on the CPU (gloo, k3-tiny,
4 steps) to check the script, its JSON in the temp directory unless --json says where.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import default_json  # bench/common.py (the script's folder is on sys.path)

WARMUP_STEPS = 3


LAYOUT_FLAGS = {"fsdp": [], "cp": ["--cp"], "ep": ["--ep"]}


def layout_args(layout: str, gpus: int) -> list[str]:
    """`openk3 train`'s flags for a layout: fsdp, cp or ep over all the GPUs, or `cp=C,ep=E` (groups of C and E
    ranks; either part may be left out). Raises ValueError for anything else or sizes that do not divide `gpus`."""
    if layout in LAYOUT_FLAGS:
        return [a for flag in LAYOUT_FLAGS[layout] for a in (flag, str(gpus))]
    flags = []
    for part in layout.split(","):
        name, _, size = part.partition("=")
        if name not in ("cp", "ep") or not size.isdigit() or int(size) < 1 or gpus % int(size):
            raise ValueError(f"layout {layout!r}: expected fsdp, cp, ep or cp=C,ep=E with C and E dividing {gpus}")
        flags += [f"--{name}", size]
    return flags


def train_command(args: argparse.Namespace, out: Path, gpus: int, layout: str) -> list[str]:
    train = ["-m", "openk3", "train", "--preset", args.preset, "--max-steps", str(args.steps), "--seed", "7",
             "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--optimizer", args.optimizer,
             "--out", str(out), "--overwrite", "--no-progress", "--eval-every", "0", "--sample-tokens", "0",
             "--device", "cpu" if args.smoke else "cuda", *(["--lr", str(args.lr)] if args.lr else [])]
    if gpus == 1:
        return [sys.executable, *train]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", *train,
            *layout_args(layout, gpus)]


def run(args: argparse.Namespace, gpus: int, workdir: Path, layout: str) -> dict:
    """One run; a run that fails keeps the losses of the steps it logged and its error line ("failed")."""
    out = workdir / f"gpus-{gpus}-{layout}"
    started = time.perf_counter()
    proc = subprocess.run(train_command(args, out, gpus, layout), capture_output=True, text=True,
                          timeout=args.timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    records = [json.loads(line) for line in lines if line.strip()]
    steps = [r for r in records if "loss" in r and "tokens_per_s" in r]
    failed = None
    if proc.returncode != 0:
        lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "Error" in line] or ["(no error line)"]
        failed = lines[-1].strip()
        print(f"bench/fsdp_scaling.py: the {gpus}-process {layout} run failed after {len(steps)} steps: {failed}",
              file=sys.stderr)
    rate = statistics.median(r["tokens_per_s"] for r in steps[WARMUP_STEPS:] or steps) if steps else None
    print(f"{gpus} GPU(s), {layout}: {len(steps)} steps in {time.perf_counter() - started:.0f} s, "
          f"{rate or 0:,.0f} tokens/s, losses {[round(r['loss'], 4) for r in steps]}", flush=True)
    return {"gpus": gpus, "layout": layout if gpus > 1 else "1 GPU", "losses": [r["loss"] for r in steps],
            "tokens_per_s": rate, "tokens_per_s_per_gpu": rate / gpus if rate else None, "failed": failed,
            "wall_s": time.perf_counter() - started}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=2, help="processes (GPUs) of the parallel runs")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUT_FLAGS),
                    help="parallel layouts to run on --gpus GPUs, each against the 1-GPU run: fsdp, cp, ep (each "
                         "over all the GPUs) or cp=C,ep=E (FSDP2 x CP x EP)")
    ap.add_argument("--preset", default=None, help="model preset (default k3-debug; k3-tiny with --smoke)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 20; 4 with --smoke)")
    ap.add_argument("--batch-size", type=int, default=None, help="global batch (default 8; 4 with --smoke)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 4096; 64 with --smoke)")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"])
    ap.add_argument("--lr", type=float, default=None,
                    help="learning rate of every run (default 3e-4; with --smoke openk3 train's): at openk3 train's "
                         "3e-3 k3-debug's loss spikes, and a 2-GPU run went to NaN at step 15 (bench/RESULTS.md)")
    ap.add_argument("--timeout", type=float, default=480.0, help="seconds each run may take")
    ap.add_argument("--smoke", action="store_true", help="the same on the CPU (gloo) at toy sizes")
    ap.add_argument("--json", default=None,
                    help="JSON file whose --key key gets the result (the file's other keys are kept; default "
                         "bench/train_gpu.json, under --smoke the temp directory's)")
    ap.add_argument("--key", default="fsdp", help="the JSON key of this result (default fsdp)")
    args = ap.parse_args()
    args.json = args.json or default_json("train_gpu.json", args.smoke)
    for layout in args.layouts:
        try:
            layout_args(layout, args.gpus)
        except ValueError as err:
            ap.error(str(err))
    toy = args.smoke
    for key, full, small in (("preset", "k3-debug", "k3-tiny"), ("steps", 20, 4), ("batch_size", 8, 4),
                             ("seq_len", 4096, 64), ("lr", 3e-4, None)):
        if getattr(args, key) is None:
            setattr(args, key, small if toy else full)
    if args.batch_size % args.gpus:
        ap.error(f"--batch-size {args.batch_size} must be a multiple of --gpus {args.gpus} (the global batch)")
    if not toy:
        import torch

        if torch.cuda.device_count() < args.gpus:
            raise SystemExit(f"bench/fsdp_scaling.py: needs {args.gpus} CUDA GPUs, torch sees "
                             f"{torch.cuda.device_count()}; --smoke runs it on the CPU")
    with tempfile.TemporaryDirectory(prefix="openk3-fsdp-") as tmp:
        rows = [run(args, 1, Path(tmp), "fsdp")] + [run(args, args.gpus, Path(tmp), layout) for layout in args.layouts]
    single = rows[0]
    for r in rows:  # over the steps both logged (a failed run stops early)
        r["loss_max_abs_diff_vs_1gpu"] = max((abs(a - b) for a, b in zip(single["losses"], r["losses"])), default=None)
        both = r["tokens_per_s_per_gpu"] and single["tokens_per_s_per_gpu"]
        r["scaling_efficiency"] = r["tokens_per_s_per_gpu"] / single["tokens_per_s_per_gpu"] if both else None
    show = lambda v, f: "-" if v is None else format(v, f)
    print(f"\n{args.preset}, global batch {args.batch_size} x {args.seq_len}, {args.optimizer}, {args.steps} steps"
          f"{' (CPU smoke)' if toy else ''}\n| gpus | layout | tokens/s | tokens/s per GPU | scaling efficiency | "
          "max |loss - 1-GPU loss| | failed |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['gpus']} | {r['layout']} | {show(r['tokens_per_s'], ',.0f')} | "
              f"{show(r['tokens_per_s_per_gpu'], ',.0f')} | {show(r['scaling_efficiency'], '.0%')} | "
              f"{show(r['loss_max_abs_diff_vs_1gpu'], '.2e')} | {r['failed'] or '-'} |")
    header = " | ".join(r["layout"] for r in rows)
    print(f"\nlosses per step\n| step | {header} |\n" + "|---" * (len(rows) + 1) + "|")
    for step in range(max(len(r["losses"]) for r in rows)):
        print(f"| {step + 1} | " + " | ".join(show(r["losses"][step] if step < len(r["losses"]) else None, ".4f")
                                              for r in rows) + " |")
    path = Path(args.json)
    data = json.loads(path.read_text()) if path.exists() else {}
    data[args.key] = {"preset": args.preset, "steps": args.steps, "batch_size": args.batch_size,
                    "seq_len": args.seq_len, "optimizer": args.optimizer, "lr": args.lr, "smoke": toy,
                    "date": time.strftime("%Y-%m-%d"), "rows": rows}
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path} (key {args.key!r})")
    if any(r["failed"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
