"""Tiny-scale ablations of three K3 ingredients, in one command (CPU, a few minutes):

  1. router balancing: Quantile Balancing vs the sign rule (two gammas) vs none -> MaxVio per step (mean over
     MoE layers)
  2. Block AttnRes vs a plain pre-norm residual stream                   -> train / held-out loss at equal steps
  3. SiTU-GLU vs SwiGLU                                                  -> max |GLU output| (what enters the down
                                                                            projections of experts, shared experts
                                                                            and dense FFNs)

Every run trains the same small K3-shaped model (`SMALL` below) on the embedded stdlib corpus with the same seed,
data order and optimizer (per-head Muon); only the named switch differs. Writes bench/ablate.json, bench/ablate.png
and prints a Markdown table.

    python bench/ablate.py [--steps 100] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from openk3.train.args import TrainArgs
from openk3.train.loop import Trainer

HERE = Path(__file__).parent
SMALL = {
    "hidden_size": 64,
    "num_layers": 4,
    "mla_layers": [3],
    "kda": {"num_heads": 2, "head_dim": 32},
    "mla": {"num_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
            "v_head_dim": 16},
    "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32, "num_shared_experts": 1, "latent_dim": 32},
    "dense_hidden": 128,
    "attn_res_block_size": 2,
    "mtp_layers": 0,
}
RUNS = {  # name -> (model-config changes, balance method, sign-rule gamma)
    "quantile": ({}, "quantile", 0.0),
    "sign": ({}, "sign", 1e-3),  # DeepSeek-V3's gamma
    "sign-0.01": ({}, "sign", 1e-2),  # a gamma sized for a 100-step run
    "none": ({}, "none", 0.0),
    "plain-residual": ({"attn_res_block_size": None}, "quantile", 0.0),
    "swiglu": ({"activation": "swiglu"}, "quantile", 0.0),
}


def record_glu_peaks(model: torch.nn.Module) -> dict:
    """Wrap every GLU activation (modules with an `act` attribute) to keep the running max |output|."""
    peak = {"max_abs": 0.0}

    def wrap(act):
        def recorded(gate, up):
            out = act(gate, up)
            peak["max_abs"] = max(peak["max_abs"], float(out.detach().abs().max()))
            return out
        return recorded

    for module in model.modules():
        if callable(getattr(module, "act", None)):
            module.act = wrap(module.act)
    return peak


def run_one(name: str, steps: int, seq_len: int, batch: int, threads: int, out_root: Path) -> dict:
    changes, balance, gamma = RUNS[name]
    args = TrainArgs(overrides={**SMALL, **changes}, balance=balance, balance_gamma=gamma, max_steps=steps,
                     seq_len=seq_len, batch_size=batch, lr=3e-3, eval_every=steps, eval_windows=16,
                     out=str(out_root / name), sample_tokens=1, progress=False, plot=False, time_limit=0,
                     threads=threads)
    trainer = Trainer(args)
    peak = record_glu_peaks(trainer.model)
    started = time.perf_counter()
    summary = trainer.run()
    history = [json.loads(line) for line in (out_root / name / "metrics.jsonl").read_text().splitlines()]
    maxvio = [sum(r["maxvio"].values()) / len(r["maxvio"]) for r in history]
    tail = max(1, steps // 4)
    return {
        "name": name, "balance": balance + (f" (gamma {gamma:g})" if balance == "sign" else ""),
        "changes": changes, "seconds": time.perf_counter() - started,
        "train_loss_last": sum(r["loss"] for r in history[-tail:]) / tail,
        "heldout_loss": summary["heldout_loss"], "unigram_loss": summary["unigram_loss"],
        "maxvio": maxvio, "maxvio_last": sum(maxvio[-tail:]) / tail,
        "glu_max_abs": peak["max_abs"],
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name in ("quantile", "sign", "sign-0.01", "none"):
        axes[0].plot(range(1, len(results[name]["maxvio"]) + 1), results[name]["maxvio"],
                     label=results[name]["balance"])
    axes[0].set(xlabel="step", ylabel="MaxVio (mean over MoE layers)", title="router balancing", yscale="log")
    axes[0].legend()
    names = ["quantile", "plain-residual"]
    axes[1].bar(["Block AttnRes", "plain residual"], [results[n]["heldout_loss"] for n in names],
                color=["tab:blue", "tab:gray"])
    axes[1].set(ylabel="held-out loss (nats/token)", title="residual stream, equal steps")
    lo = min(results[n]["heldout_loss"] for n in names)
    axes[1].set_ylim(lo - 0.3, lo + 0.3)
    axes[2].bar(["SiTU-GLU", "SwiGLU"], [results[n]["glu_max_abs"] for n in ("quantile", "swiglu")],
                color=["tab:blue", "tab:gray"])
    axes[2].set(ylabel="max |GLU output| during training", title="activation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: dict) -> str:
    rows = ["| run | balance | change | MaxVio (last 25%) | train loss (last 25%) | held-out loss | max abs GLU | s |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results.values():
        change = ", ".join(f"{k}={v}" for k, v in r["changes"].items()) or "-"
        rows.append(f"| {r['name']} | {r['balance']} | {change} | {r['maxvio_last']:.3f} | {r['train_loss_last']:.3f} "
                    f"| {r['heldout_loss']:.3f} | {r['glu_max_abs']:.1f} | {r['seconds']:.0f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="training steps of each run")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens a sequence")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences a step")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: the trainer's auto choice)")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), help="the runs to train")
    parser.add_argument("--json", type=Path, default=HERE / "ablate.json",
                        help="the results (the plot goes beside it, .png, when every run is in)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run_one(name, args.steps, args.seq_len, args.batch_size, args.threads, Path(tmp))
                   for name in args.runs}
    args.json.write_text(json.dumps(results, indent=1))
    if set(RUNS) <= set(results):
        plot(results, args.json.with_suffix(".png"))
    print(table(results))


if __name__ == "__main__":
    main()
