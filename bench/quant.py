"""MXFP4 routed experts at tiny scale (CPU): post-training quantization vs quantization-aware training.

Three runs of the same small K3-shaped model (bench/ablate.py's `SMALL`, whose expert widths are multiples of 32)
with the same seed, data order, optimizer and step count:

  ptq          full-precision training, then the routed experts quantized after training
  qat          `--qat mxfp4` from the first step (MXFP4 weights, MXFP8 expert inputs, straight-through)
  qat-last-20  full precision, then QAT for the last 20% of the steps

Each is scored on the held-out windows twice: as trained (full-precision experts) and with MXFP4 experts (the
weights quantized, the expert inputs in MXFP8: what a K3 deployment runs). Writes bench/quant.json and prints a
Markdown table.

    python bench/quant.py [--steps 200] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

from ablate import SMALL
from openk3.quant.qat import FakeQuantExperts, enable_qat
from openk3.train.args import TrainArgs
from openk3.train.loop import Trainer, heldout_loss

HERE = Path(__file__).parent
RUNS = {"ptq": None, "qat": 0.0, "qat-last-20": 0.8}  # name -> fraction of the steps after which QAT starts


def quantized_copy(model):
    """The model as deployed: MXFP4 expert weights and MXFP8 expert inputs (fake-quantized)."""
    if any(isinstance(m, FakeQuantExperts) for m in model.modules()):
        return model
    model = copy.deepcopy(model)
    enable_qat(model)
    return model


def run_one(name: str, steps: int, seq_len: int, batch: int, threads: int, out_root: Path) -> dict:
    start = RUNS[name]
    args = TrainArgs(overrides=SMALL, max_steps=steps, seq_len=seq_len, batch_size=batch, lr=3e-3, eval_every=0,
                     eval_windows=16, out=str(out_root / name), sample_tokens=1, progress=False, plot=False,
                     threads=threads)
    trainer = Trainer(args)
    started = time.perf_counter()
    losses = []
    for step in range(steps):
        if start is not None and step == round(start * steps):
            enable_qat(trainer.model)  # the class swap keeps the parameters the optimizer holds
        losses.append(trainer.train_step()["loss"])
    seconds = time.perf_counter() - started

    def score(model) -> float:
        return heldout_loss(model, trainer.eval_windows, batch, trainer.device, trainer.amp, trainer.world)

    tail = max(1, steps // 10)
    return {"name": name, "qat_from_step": None if start is None else round(start * steps), "seconds": seconds,
            "train_loss_last": sum(losses[-tail:]) / tail, "heldout_loss": score(trainer.model),
            "heldout_loss_mxfp4": score(quantized_copy(trainer.model)), "unigram_loss": trainer.unigram}


def table(results: dict) -> str:
    rows = ["| run | QAT from step | train loss (last 10%) | held-out, as trained | held-out, MXFP4 experts | s |",
            "|---|---|---|---|---|---|"]
    for r in results.values():
        start = "-" if r["qat_from_step"] is None else str(r["qat_from_step"])
        rows.append(f"| {r['name']} | {start} | {r['train_loss_last']:.3f} | {r['heldout_loss']:.3f} "
                    f"| {r['heldout_loss_mxfp4']:.3f} | {r['seconds']:.0f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps of each run")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens a sequence")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences a step")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: the trainer's auto choice)")
    parser.add_argument("--json", type=Path, default=HERE / "quant.json", help="the results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run_one(name, args.steps, args.seq_len, args.batch_size, args.threads, Path(tmp))
                   for name in RUNS}
    args.json.write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
