"""`openk3 train`: argparse front end of the training loop (defaults from TrainArgs).

Under torchrun (`torchrun --nproc-per-node N -m openk3 train ...`) the same command runs FSDP2 data parallel, with
--cp / --ep adding context and expert parallelism (openk3.parallel); --batch-size is the global batch.
"""

from __future__ import annotations

import argparse
import dataclasses

from openk3.config import PRESETS
from openk3.train.args import DEFAULT_STEPS, TrainArgs


def add_train_parser(subparsers) -> None:
    d = TrainArgs()
    p = subparsers.add_parser(
        "train", help="train a model (default: k3-tiny on the embedded stdlib corpus, a few minutes on CPU)",
        description="Train a K3-family model. With no arguments: k3-tiny on the running Python's standard library "
                    "sources, under 10 minutes on 2 CPU cores. Under torchrun: FSDP2 data parallel.")
    p.add_argument("--preset", default=d.preset, choices=sorted(PRESETS))
    p.add_argument("--config", default=None, metavar="FILE", help="JSON object of model-config overrides")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="text file, JSONL (a 'text' field per line) or directory (default: Python stdlib sources)")
    p.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="a tokenizer.json (default: byte-level BPE trained on the data and cached)")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch (sequences per step)")
    p.add_argument("--max-steps", type=int, default=None,
                   help=f"optimizer steps (default {DEFAULT_STEPS}, or the resumed checkpoint's schedule)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (Muon and AdamW)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out, metavar="DIR")
    p.add_argument("--save-every", type=int, default=d.save_every, metavar="N", help="0: only at the end")
    p.add_argument("--eval-every", type=int, default=d.eval_every, metavar="N")
    p.add_argument("--resume", default=None, metavar="CKPT_DIR", help="a step-NNNNNN/ checkpoint directory")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch threads on CPU (0: auto: all cores, or 1 when the machine is already busy)")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16"],
                   help="autocast dtype (auto: bf16 on GPU, fp32 on CPU); parameters stay fp32")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--optimizer", default=d.optimizer, choices=["muon", "adamw"])
    p.add_argument("--balance", default=d.balance, choices=["quantile", "sign", "none"])
    p.add_argument("--balance-gamma", type=float, default=d.balance_gamma, help="sign-rule step")
    p.add_argument("--mtp-weight", type=float, default=d.mtp_weight)
    p.add_argument("--time-limit", type=float, default=d.time_limit, metavar="SECONDS",
                   help="wall-time budget of the whole run; on a slower machine the step count shrinks to fit "
                        "(the WSD decay moves with it); 0: no limit")
    p.add_argument("--sample-tokens", type=int, default=d.sample_tokens, help="length of the final text sample")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--cp", type=int, default=d.cp, metavar="C",
                   help="context parallel: C processes share each window group as one packed stream (KDA KCP, MLA "
                        "latent all-gather); data parallel is the rest of the processes")
    p.add_argument("--ep", type=int, default=d.ep, metavar="E",
                   help="expert parallel: the routed experts split over groups of E processes")
    p.add_argument("--ep-planner", default=d.ep_planner, choices=["balanced", "static"],
                   help="balanced: MoonEP replicas, exactly S x K rows per rank; static: every row to its expert")
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    from openk3.train.loop import train

    names = {f.name for f in dataclasses.fields(TrainArgs)}
    values = {k: v for k, v in vars(args).items() if k in names}
    train(TrainArgs(**values, progress=not args.no_progress))
    return 0
