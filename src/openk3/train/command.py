"""`openk3 train`: argparse front end of the training loop (defaults from TrainArgs).

Under torchrun (`torchrun --nproc-per-node N -m openk3 train ...`) the same command runs FSDP2 data parallel, with
--cp / --ep adding context and expert parallelism (openk3.parallel); --batch-size is the global batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from openk3.cli_options import ShowDefaults, add_kda_options
from openk3.config import PRESETS
from openk3.train.args import DEFAULT_STEPS, PACKINGS, QAT_FORMATS, TrainArgs, flag_name, flag_type


def add_train_parser(subparsers) -> None:
    d = TrainArgs()
    p = subparsers.add_parser(
        "train", help="train a model (default: k3-tiny on the embedded stdlib corpus, a few minutes on CPU)",
        formatter_class=ShowDefaults,
        description="Train a K3-family model. With no arguments: k3-tiny on the running Python's standard library "
                    "sources, under 10 minutes on 2 CPU cores. Under torchrun: FSDP2 data parallel.")

    def number(name: str, kind: type, help: str, **kw) -> None:
        p.add_argument(flag_name(name), type=flag_type(name, kind), default=getattr(d, name), help=help, **kw)

    p.add_argument("--preset", default=d.preset, choices=sorted(PRESETS), help="model configuration")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="JSON object of model-config overrides (default: none)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="text file, JSONL (a 'text' field per line) or directory (default: Python stdlib sources)")
    p.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="a tokenizer.json (default: byte-level BPE trained on the data and cached)")
    number("seq_len", int, "tokens per training window")
    number("batch_size", int, "global batch (sequences per step, all processes together; default: 8, or 16 "
                              "captioned images for a preset with a vision tower)")
    p.add_argument("--max-steps", type=flag_type("max_steps", int), default=None,
                   help=f"optimizer steps (default: {DEFAULT_STEPS}, or the resumed checkpoint's schedule; 1200 for a "
                        "preset with a vision tower)")
    number("lr", float, "peak learning rate (Muon and AdamW)")
    number("weight_decay", float, "decoupled weight decay")
    number("grad_clip", float, "gradient-norm clipping threshold")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the initialisation, data order and sampling")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="run directory (default: runs/PRESET); one that holds another run's files is refused unless "
                        "--resume continues it or --overwrite replaces it")
    p.add_argument("--overwrite", action="store_true",
                   help="delete another run's files in --out (metrics, checkpoints, sample, plot) before starting")
    number("save_every", int, "checkpoint every N steps (0: only at the end)", metavar="N")
    number("eval_every", int, "held-out loss every N steps (0: only at the end)", metavar="N")
    p.add_argument("--resume", default=None, metavar="CKPT_DIR",
                   help="continue from a step-NNNNNN/ checkpoint, or a run directory's latest")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    number("threads", int, "torch threads on CPU (0: auto: all cores, or 1 when the machine is already busy)")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16"],
                   help="autocast dtype (auto: bf16 on GPU, fp32 on CPU); parameters stay fp32")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model block by block (default: on with CUDA, off on CPU)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="after two eager warm-up steps, replay each step's forward and backward as one CUDA graph "
                        "(one CUDA device, one process, fixed batch shapes; the optimizer, clipping and balancing "
                        "run outside it). Default: on with CUDA in one process, with --compile (the host's launches "
                        "are the limit there), except where the batches' shapes or layout vary (the captioning task, "
                        "--packing docs: a line says so); off on CPU")
    p.add_argument("--packing", default=d.packing, choices=list(PACKINGS),
                   help="docs: each window is a packed row of whole or cut documents, the model working within each "
                        "document (KDA state and conv window reset, MLA attends within it, no loss across a "
                        "boundary); concat: windows of the concatenated documents; auto: docs when the data has "
                        "more than one document")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also write the metrics (loss, eval loss, lr, grad norm, tokens/s, MFU, MaxVio per MoE "
                        "layer) as TensorBoard event files in DIR (`tensorboard --logdir DIR`)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each token mixer and FFN in backward")
    p.add_argument("--optimizer", default=d.optimizer, choices=["muon", "adamw"],
                   help="per-head Muon for the matrices (AdamW for the rest), or AdamW for everything")
    p.add_argument("--balance", default=d.balance, choices=["quantile", "sign", "none"],
                   help="MoE router-bias balancing")
    number("balance_gamma", float, "sign-rule step")
    number("mtp_weight", float, "weight of the multi-token-prediction loss")
    p.add_argument("--qat", default=None, choices=QAT_FORMATS,
                   help="quantization-aware training: the routed experts run on fake-quantized MXFP4 weights and "
                        "MXFP8 inputs (straight-through gradients); checkpoints keep the full-precision weights "
                        "(default: off)")
    number("time_limit", float, "opt-in wall-time budget of the whole run: the step count shrinks to fit it and "
                                "the WSD decay moves with it, so the model depends on the machine's speed "
                                "(0: off, the run keeps its steps)", metavar="SECONDS")
    number("sample_tokens", int, "length of the final text sample")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_kda_options(p)
    p.add_argument("--cp", type=flag_type("cp", int), default=d.cp, metavar="C",
                   help="context parallel: C processes share each window group as one packed stream (KDA KCP, MLA "
                        "latent all-gather); data parallel is the rest of the processes")
    p.add_argument("--ep", type=flag_type("ep", int), default=d.ep, metavar="E",
                   help="expert parallel: the routed experts split over groups of E processes")
    p.add_argument("--ep-planner", default=d.ep_planner, choices=["balanced", "static"],
                   help="balanced: MoonEP replicas, exactly S x K rows per rank; static: every row to its expert")
    p.set_defaults(func=run_train)


def train(args: TrainArgs) -> dict:
    """A text model trains on the corpus (train/loop.py); a model with a vision tower on the embedded shapes task
    (train/vision_loop.py, a Trainer subclass: deciding here keeps the loop from importing its own subclass)."""
    from openk3.train.loop import Trainer, model_config
    from openk3.train.vision_loop import CaptionTrainer

    return (CaptionTrainer if model_config(args).vision is not None else Trainer)(args).run()


def train_args(args: argparse.Namespace) -> TrainArgs:
    names = {f.name for f in dataclasses.fields(TrainArgs)}
    return TrainArgs(**{k: v for k, v in vars(args).items() if k in names}, progress=not args.no_progress)


def run_train(args: argparse.Namespace) -> int:
    from openk3.train.interrupt import Interrupted

    try:
        train(train_args(args))
    except Interrupted as stop:  # Ctrl-C during the run (during set-up: openk3.cli says "interrupted")
        print(f"openk3 train: {stop}", file=sys.stderr)
        return 130
    return 0
