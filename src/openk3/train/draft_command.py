"""`openk3 draft`: argparse front end of the draft fine-tuning (defaults from train/draft.py's DraftArgs)."""

from __future__ import annotations

import argparse
import sys

from openk3.cli_options import ShowDefaults, add_kda_options, int_at_least


def _taps(text: str) -> tuple[int, ...]:
    try:
        taps = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be three comma-separated layer indices, got {text!r}") from None
    if len(taps) != 3:
        raise argparse.ArgumentTypeError(f"must be three comma-separated layer indices, got {text!r}")
    return taps


def add_draft_parser(subparsers) -> None:
    from openk3.draft.loss import DEFAULT_ETA, LOSSES  # light: torch only

    p = subparsers.add_parser(
        "draft", help="fine-tune a trained model's MTP layer into an EAGLE-3-style speculative draft",
        formatter_class=ShowDefaults,
        description="Freeze the target model of a checkpoint and fine-tune its MTP layer into an EAGLE-3-style draft "
                    "reading a fusion of three target hidden states, with training-time test over --draft-tokens "
                    "steps, on the embedded corpus by default. Writes metrics.jsonl (loss; accept_len and "
                    "accept_rate at evaluations) and a checkpoint (target + draft) that `openk3 generate "
                    "--speculative K` and `openk3 serve --speculative K` read.")
    p.add_argument("--ckpt", required=True, metavar="RUN_OR_CHECKPOINT",
                   help="a checkpoint directory, or an `openk3 train` --out directory (its latest checkpoint)")
    p.add_argument("--out", default="runs/draft", metavar="DIR", help="run directory (metrics and checkpoint)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier draft run in --out")
    p.add_argument("--loss", default="lk", choices=LOSSES,
                   help="lk: -log sum_x min(p, q) (the acceptance rate itself); kl: KL(p || q); hybrid: "
                        "lambda KL + (1 - lambda)(1 - alpha), lambda = exp(-eta alpha)")
    p.add_argument("--eta", type=float, default=DEFAULT_ETA, help="the hybrid loss's eta")
    p.add_argument("--max-steps", type=int_at_least(1), default=200, metavar="N", help="optimizer steps")
    p.add_argument("--draft-tokens", type=int_at_least(1), default=3, metavar="K",
                   help="drafted tokens per verification: the steps unrolled in training and drafted at evaluation")
    p.add_argument("--taps", type=_taps, default=None, metavar="LO,MID,HI",
                   help="the target layers whose entering hidden states the draft reads (default: EAGLE-3's "
                        "2, L//2, L-3)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (WSD schedule)")
    p.add_argument("--batch-size", type=int_at_least(1), default=8, help="windows per step")
    p.add_argument("--seq-len", type=int_at_least(2), default=128,
                   help="tokens per window (at least --draft-tokens)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="text file, JSONL or directory (default: the Python stdlib sources, as `openk3 train`)")
    p.add_argument("--eval-every", type=int, default=50, metavar="N",
                   help="acceptance on held-out prompts every N steps (0: only at the end)")
    p.add_argument("--eval-prompts", type=int_at_least(1), default=8, help="held-out prompts per evaluation")
    p.add_argument("--eval-prompt-len", type=int_at_least(2), default=64, metavar="N",
                   help="tokens of each held-out prompt")
    p.add_argument("--eval-tokens", type=int_at_least(1), default=48, help="tokens generated from each prompt")
    p.add_argument("--eval-temperature", type=float, default=1.0,
                   help="sampling temperature of the evaluation (1: alpha is the acceptance probability; 0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="data order and evaluation seeds")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    p.add_argument("--threads", type=int_at_least(0), default=0,
                   help="torch threads on CPU (0: auto: all cores, or 1 when the machine is already busy)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_kda_options(p)
    p.set_defaults(func=run_draft)


def run_draft(args: argparse.Namespace) -> int:
    from openk3.train.draft import DraftArgs, train_draft
    from openk3.train.interrupt import Interrupted

    settings = DraftArgs(ckpt=args.ckpt, out=args.out, loss=args.loss, eta=args.eta, max_steps=args.max_steps,
                         draft_tokens=args.draft_tokens, taps=args.taps, lr=args.lr, batch_size=args.batch_size,
                         seq_len=args.seq_len, data=args.data, eval_every=args.eval_every,
                         eval_prompts=args.eval_prompts, eval_prompt_len=args.eval_prompt_len,
                         eval_tokens=args.eval_tokens,
                         eval_temperature=args.eval_temperature, seed=args.seed, device=args.device,
                         threads=args.threads, kda_backend=args.kda_backend, overwrite=args.overwrite,
                         progress=not args.no_progress)
    try:
        train_draft(settings)
    except Interrupted as stop:  # Ctrl-C during the steps (during set-up: openk3.cli says "interrupted")
        print(f"openk3 draft: {stop}", file=sys.stderr)
        return 130
    return 0
