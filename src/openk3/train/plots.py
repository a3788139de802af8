"""loss.png: training loss per step (raw and smoothed), held-out loss, the baseline (unigram, or text-only for the
vision task), and MaxVio."""

from __future__ import annotations

from pathlib import Path


def smooth(values: list[float], span: int) -> list[float]:
    """Exponential moving average with the given span (bias-corrected, so the start is not dragged to 0)."""
    alpha, avg, weight, out = 2.0 / (span + 1), 0.0, 0.0, []
    for v in values:
        avg = (1 - alpha) * avg + alpha * v
        weight = (1 - alpha) * weight + alpha
        out.append(avg / weight)
    return out


def plot_losses(history: list[dict], path: Path, unigram: float | None = None, label: str = "unigram baseline") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    losses = [r["loss"] for r in history]
    evals = [(r["step"], r["eval_loss"]) for r in history if "eval_loss" in r]
    layers = sorted({k for r in history for k in r.get("maxvio", {})}, key=int)
    fig, axes = plt.subplots(1, 2 if layers else 1, figsize=(12 if layers else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    ax.plot(steps, losses, color="tab:blue", alpha=0.25, lw=0.8)
    ax.plot(steps, smooth(losses, 20), color="tab:blue", label="train (EMA 20)")
    if evals:
        ax.plot(*zip(*evals), "o-", color="tab:orange", label="held-out")
    if unigram is not None:
        ax.axhline(unigram, color="gray", ls="--", label=f"{label} {unigram:.2f}")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="loss")
    ax.legend()
    if layers:
        ax = axes[0][1]
        for layer in layers:
            pts = [(r["step"], r["maxvio"][layer]) for r in history if layer in r.get("maxvio", {})]
            ax.plot(*zip(*pts), lw=0.6, alpha=0.35)
        mean = [(r["step"], sum(r["maxvio"].values()) / len(r["maxvio"])) for r in history if r.get("maxvio")]
        steps_m, values_m = zip(*mean)
        ax.plot(steps_m, smooth(list(values_m), 20), color="black", label="mean over MoE layers (EMA 20)")
        ax.set(xlabel="step", ylabel="MaxVio = max load / mean load - 1", title="expert load imbalance (per layer)")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
