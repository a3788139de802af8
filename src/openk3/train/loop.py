"""The training loop behind `openk3 train` (SPEC §5, §6).

One step: WSD lr -> next global batch (each data-parallel rank takes its slice) -> forward under autocast
(bf16 on GPU) -> loss = next-token CE + mtp_weight * MTP CE (position t predicts t+2) -> backward -> gradient
clipping -> per-head Muon + AdamW -> router bias update (Quantile Balancing / sign rule / none) from that step's
scores -> metrics line, read once the next step is queued (openk3.train.queued). Held-out loss every
`eval_every` steps and at the end, checkpoints every `save_every` steps and at the end, then loss.png, a text
sample, and the held-out loss beside the unigram baseline. With --cuda-graphs the forward and backward replay as
one CUDA graph after two warm-up steps (openk3.train.graphs).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import statistics
import sys
import time
from collections import deque
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from openk3.accounting import count_parameters, parameter_summary
from openk3.checkpoints import CheckpointError, latest_checkpoint, resolve_checkpoint, step_dir_name
from openk3.cli_options import cpu_threads
from openk3.config import ModelConfig, get_preset
from openk3.draft.model import DRAFT_CONFIG
from openk3.model import K3ForCausalLM, configure_kda
from openk3.model.compile import compile_blocks, uncompile_blocks
from openk3.model.documents import Documents, same_document
from openk3.ops.loss import linear_cross_entropy
from openk3.ops.transfer import queued
from openk3.parallel import ParallelDims, cp_lm_losses, parallelize
from openk3.quant.qat import enable_qat
from openk3.tokenizer import TextTokenizer, load_or_train
from openk3.train import checkpoint as ckpt
from openk3.train.args import DEFAULT_STEPS, TrainArgs, flag_name, resolve_fast_path
from openk3.train.balance import RouterBalancer
from openk3.train.data import (
    BatchStream,
    PackedRows,
    heldout_windows,
    load_documents,
    resolve_packing,
    split_documents,
    train_and_heldout_documents,
    unigram_cross_entropy,
)
from openk3.train.distributed import (
    World,
    average_across,
    clip_grad_norm,
    close_world,
    full_model_state,
    full_optimizer_state,
    init_world,
    load_full_state,
    mean_across,
    raise_from_main,
)
from openk3.train.graphs import GraphedForwardBackward
from openk3.train.interrupt import stopped_at
from openk3.train.mfu import flops_per_token, peak_flops
from openk3.train.optim import build_optimizer
from openk3.train.preflight import check_host_memory, check_kda_backend, checked_device
from openk3.train.queued import DeviceMark, QueuedStep
from openk3.train.schedule import WSDSchedule
from openk3.train.tensorboard import open_writer, write_scalars

SAMPLE_PROMPT = "def "
CLOSING_STEPS = 8  # the final evaluation, save and text sample cost about this many training steps
FIT_WINDOW = 20  # steps whose median time predicts the rest of the run
SLOW_RUN_SECONDS = 600  # the default run's budget on 2 CPU cores: a longer projection is a warning
SLOWDOWN_FACTOR = 1.5  # warn once more when the projected duration grows by this factor during the run
IGNORE_INDEX = -100  # a label the losses do not count
RUN_FILES = ("metrics.jsonl", "summary.json", "sample.txt", "loss.png", "tokenizer.json")  # besides step-*/
RESUME_MUST_MATCH = ("optimizer",)  # settings the saved state is for (seq-len, batch and seed: BatchStream checks)


def model_config(args: TrainArgs) -> ModelConfig:
    cfg = get_preset(args.preset)
    if args.config:
        cfg = cfg.with_config_file(args.config)
    if args.overrides:
        cfg = cfg.with_overrides(args.overrides)
    if args.seq_len > cfg.max_seq_len:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
    return cfg


def resolve_device(device: torch.device, world: World) -> torch.device:
    """The checked --device (preflight.checked_device) with its index: set_device needs one (this process's GPU
    under torchrun, else the current one)."""
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", world.local_rank if world.distributed else torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def resume_checkpoint(path: str) -> Path:
    """--resume as a training checkpoint: a step-NNNNNN/ of `openk3 train`, or a run directory (its latest)."""
    try:
        found = resolve_checkpoint(path)
    except OSError as err:
        raise type(err)(f"--resume {err}") from None
    if not (found / "trainer.pt").is_file():
        raise ValueError(f"--resume {found} is not a training checkpoint (no trainer.pt); pass a step-NNNNNN/ "
                         "directory of `openk3 train`, or its --out")
    return found


def check_resume(path: Path, trainer: dict, args: TrainArgs, processes: int) -> None:
    """Refuse a checkpoint this run cannot continue: other settings its saved state depends on, or no step left."""
    if trainer["world_size"] != processes:
        raise CheckpointError(f"checkpoint {path} was saved by {trainer['world_size']} processes; resume "
                              f"with the same number, under any --cp / --ep (this run has {processes})")
    saved = trainer.get("args", {})
    for name in RESUME_MUST_MATCH:
        if name in saved and saved[name] != getattr(args, name):
            raise ValueError(f"{flag_name(name)} {getattr(args, name)}: checkpoint {path} was trained with "
                             f"{flag_name(name)} {saved[name]}; resume with the same")
    step = trainer["step"]
    if args.max_steps is not None and args.max_steps <= step:
        raise ValueError(f"--max-steps {args.max_steps} is not past the checkpoint's step {step}; pass more steps "
                         "to train further")
    if args.max_steps is None and trainer["schedule"]["total_steps"] <= step:
        raise ValueError(f"--resume {path}: its run ended at step {step}; pass --max-steps above {step} to train "
                         "further")


def autocast_dtype(args: TrainArgs, device: torch.device) -> torch.dtype | None:
    """The autocast dtype (parameters and optimizer state stay fp32): bf16 on GPU by default, none on CPU."""
    choices = {"auto": torch.bfloat16 if device.type == "cuda" else None, "float32": None, "fp32": None,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if args.dtype not in choices:
        raise ValueError(f"--dtype must be one of {sorted(choices)}, got {args.dtype!r}")
    return choices[args.dtype]


def enable_activation_checkpointing(model: K3ForCausalLM) -> None:
    """Recompute each token mixer and FFN in backward instead of storing their activations.

    The sublayers are wrapped rather than whole decoder layers because a Block AttnRes layer mutates the shared
    block stream; the sublayers are pure functions of their input. Parameter names are unchanged.
    """
    from torch.utils.checkpoint import checkpoint

    def wrap(module: nn.Module) -> None:
        inner = module.forward
        module.forward = lambda *a, **k: checkpoint(inner, *a, use_reentrant=False, **k)

    for layer in list(model.model.layers) + [m.block for m in model.mtp or []]:
        wrap(layer.self_attn)
        wrap(layer.mlp)


def lm_losses(model: nn.Module, batch: torch.Tensor, mtp_weight: float,
              segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(total loss, next-token CE, MTP CE or None without MTP) for a batch of windows [B, T+1], the last two
    detached (tensors: reading them on the host would stall a GPU step halfway). The LM head is applied inside the loss
    (openk3.ops.loss, chunked: no [tokens, vocab] logits); under FSDP2 the root unit, which holds lm_head, stays
    unsharded after its forward, so lm_head.weight is the full weight here and its gradient reaches the unit.

    segments [B, T+1] (host; --packing docs): each token's document (openk3.train.data). The model then works
    within each document (openk3.model.documents), and a prediction counts only when its target lies in the
    position's own document: the next-token label of a document's last token (its EOS; the next token begins
    another document) and every MTP label two tokens ahead across a boundary are ignored. Each CE is the mean over
    the predictions it counts, so the loss is that of the documents (and document pieces) run one by one."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    mtp_targets = batch[:, 2:]
    documents = None
    if segments is not None:
        documents = Documents.from_segments(segments[:, :-1]).to(batch.device)
        targets = torch.where(queued(same_document(segments, 1), batch.device), targets, IGNORE_INDEX)
        mtp_targets = torch.where(queued(same_document(segments, 2), batch.device), mtp_targets, IGNORE_INDEX)
    want_mtp = mtp_weight > 0 and getattr(model.config, "mtp_layers", 0) > 0
    out = model(inputs, return_mtp=want_mtp, return_logits=False, documents=documents)
    head = model.lm_head.weight
    lm = linear_cross_entropy(out.head_inputs.flatten(0, 1), head, targets.flatten(), ignore_index=IGNORE_INDEX)
    if not want_mtp or not out.mtp_head_inputs:
        return lm, lm.detach(), None
    mtp = linear_cross_entropy(out.mtp_head_inputs[0].flatten(0, 1), head, mtp_targets.flatten(),
                               ignore_index=IGNORE_INDEX)
    return lm + mtp_weight * mtp, lm.detach(), mtp.detach()


@torch.no_grad()
def heldout_loss(model: nn.Module, windows: torch.Tensor, batch_size: int, device: torch.device,
                 amp: torch.dtype | None, world: World, segments: torch.Tensor | None = None) -> float:
    """Mean next-token CE over the fixed held-out windows (eval mode: router biases frozen, nothing recorded);
    with their `segments` (--packing docs) within documents, as `lm_losses` counts."""
    model.eval()
    total, count = 0.0, 0
    # every rank runs the same number of forwards (FSDP gathers collectively): equal shares, the short ones padded
    # with a repeated window that is not counted
    share = -(-len(windows) // world.size)

    def my_share(rows: torch.Tensor) -> torch.Tensor:
        mine = rows[world.rank * share:(world.rank + 1) * share]
        return torch.cat([mine, rows[-1:].expand(share - len(mine), -1)]) if len(mine) < share else mine

    counted = len(windows[world.rank * share:(world.rank + 1) * share])
    mine, my_segments = my_share(windows), None if segments is None else my_share(segments)
    for i in range(0, share, batch_size):
        batch = mine[i:i + batch_size].to(device)
        keep = max(0, min(batch_size, counted - i))
        targets, documents = batch[:keep, 1:], None
        if my_segments is not None:
            seg = my_segments[i:i + batch_size]
            documents = Documents.from_segments(seg[:, :-1]).to(device)
            targets = torch.where(queued(same_document(seg[:keep], 1), device), targets, IGNORE_INDEX)
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            normed = model(batch[:, :-1], return_mtp=False, return_logits=False, documents=documents).head_inputs
            total += float(linear_cross_entropy(normed[:keep].flatten(0, 1), model.lm_head.weight, targets.flatten(),
                                                ignore_index=IGNORE_INDEX, reduction="sum")) if keep else 0.0
        count += targets.numel() if my_segments is None else int(same_document(my_segments[i:i + keep], 1).sum())
    model.train()
    if world.distributed:
        t = torch.tensor([total, count], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t)
        total, count = float(t[0]), float(t[1])
    return total / count


def run_files(out: Path) -> list[Path]:
    """What a training run leaves in its --out directory (metrics, summary, sample, plot, tokenizer, checkpoints)."""
    if not out.is_dir():
        return []
    files = [out / name for name in RUN_FILES if (out / name).exists()]
    files = [p for p in files if p.name != "metrics.jsonl" or p.stat().st_size]  # empty: a run that failed at once
    return files + sorted(p for p in out.glob("step-*") if p.is_dir())


def claim_out_dir(out: Path, resume: str | None, overwrite: bool, delete: bool) -> None:
    """Refuse to start a run in a directory that holds another run's files, so a typo loses nothing: continuing
    it is --resume from one of its checkpoints, replacing it is --overwrite (its run files are deleted first, by
    the process with `delete`; other files in the directory are left alone)."""
    if out.exists() and not out.is_dir():  # checked by every rank, before anything is built or written
        raise ValueError(f"--out {out} is a file; pass a directory (new, or a run to --resume or --overwrite)")
    found = run_files(out)
    if not found or (resume is not None and Path(resume).resolve().parent == out.resolve()):
        return
    if not overwrite:
        latest = latest_checkpoint(out)
        names = ", ".join(p.name + ("/" if p.is_dir() else "") for p in found[:4]) + (", ..." if found[4:] else "")
        if latest is not None and (latest / DRAFT_CONFIG).is_file():  # `openk3 draft --out`: a target and a draft
            raise ValueError(f"--out {out} holds a draft run of `openk3 draft` ({names}), which `openk3 train` "
                             "cannot continue; choose another --out, or pass --overwrite to replace it")
        resumable = latest is not None and (latest / "trainer.pt").is_file()
        raise ValueError(f"--out {out} already holds a training run ({names}); "
                         + (f"continue it with --resume {latest}, " if resumable else "")
                         + "choose another --out, or pass --overwrite to replace it")
    for path in found if delete else []:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def _duration(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"


class Trainer:
    """Holds everything a run needs; `run()` trains to max_steps and returns the summary dict."""

    DEFAULT_BATCH = 8  # --batch-size when not given
    DEFAULT_STEPS = DEFAULT_STEPS  # --max-steps when not given (and not resuming)

    def __init__(self, args: TrainArgs):
        args = self.args = replace(args, batch_size=args.batch_size or self.DEFAULT_BATCH)
        self.created = time.perf_counter()  # the time limit counts from here: setup is part of the run
        self.out = Path(args.out)
        device = checked_device(args.device)
        self.world = init_world(device.type)
        self.device = resolve_device(device, self.world)
        resolve_fast_path(args.compile, args.cuda_graphs, self.device.type, self.world.size)  # refusals, early
        check_kda_backend(args.kda_backend, self.device)
        self.amp = autocast_dtype(args, self.device)
        self.dims = ParallelDims(self.world.size, args.cp, args.ep)
        self.dims.check_batch(args.batch_size, args.seq_len)
        self.cfg = model_config(args)
        if self.device.type == "cpu":
            check_host_memory(self.cfg, args.preset)
        self.last_checkpoint = self._resumed = None
        if args.resume:  # loaded and checked before anything in --out changes
            args = self.args = replace(args, resume=str(resume_checkpoint(args.resume)))
            self._resumed = ckpt.load_checkpoint(args.resume, self.cfg)
            check_resume(Path(args.resume), self._resumed["trainer"], args, self.world.size)
        claim_out_dir(self.out, args.resume, args.overwrite, delete=self.world.is_main)
        if self.device.type == "cpu":
            torch.set_num_threads(cpu_threads(args.threads, self.world.size))
        self._seed(args.seed)
        self._setup_data()
        fast = resolve_fast_path(args.compile, args.cuda_graphs, self.device.type, self.world.size,
                                 self._varying_layout())
        args = self.args = replace(args, compile=fast.compile, cuda_graphs=fast.cuda_graphs)
        self.fast_path_note = fast.note
        self.peak_flops = peak_flops(self.device)  # MFU on the GPUs openk3.train.mfu knows
        self.flops_per_token = flops_per_token(self.cfg, args.seq_len) if self.peak_flops else None
        self.model = K3ForCausalLM(self.cfg).to(self.device)
        configure_kda(self.model, backend=args.kda_backend)
        if args.qat:  # before checkpointing, sharding and compile; checkpoints keep the fp32 master weights
            enable_qat(self.model, args.qat)
        if args.activation_checkpointing:
            enable_activation_checkpointing(self.model)
        if args.compile:  # per block, after checkpointing and before sharding, as torchtitan orders them
            compile_blocks(self.model)
        self.parallel = parallelize(self.model, self.dims, self.world.rank, self.device.type,
                                    ep_planner=args.ep_planner, activation_checkpointing=args.activation_checkpointing)
        self.graphed = (GraphedForwardBackward(self._forward_backward, list(self.model.parameters()))
                        if args.cuda_graphs else None)
        self.optimizer = build_optimizer(self.model, args.lr, args.weight_decay, args.optimizer)
        self.balancer = RouterBalancer(self.model, args.balance, self.cfg.moe.top_k if self.cfg.moe else 1,
                                       args.balance_gamma)
        self.schedule = WSDSchedule.for_run(args.lr, args.max_steps or self.DEFAULT_STEPS, args.warmup_frac,
                                            args.decay_frac)
        self.step = 0
        self.steps_queued = 0  # by this process (the first ones compile)
        if self._resumed is not None:
            self._resume(Path(args.resume))
        self.requested_steps = self.schedule.total_steps
        self._recent: deque[float] = deque(maxlen=FIT_WINDOW)
        self._announced_fit = False
        self._expected_seconds: float | None = None
        self._warned_slowdown = False

    # ---- setup -----------------------------------------------------------------------------------------------
    def _seed(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)  # same on every rank: FSDP shards one identical initialisation

    def _setup_data(self) -> None:
        args = self.args
        docs = load_documents(args.data)
        self.packing = resolve_packing(args.packing, len(docs), args.cp)
        resume_tok = Path(args.resume) / "tokenizer.json" if args.resume else None
        if resume_tok is not None and resume_tok.is_file():
            self.tokenizer = TextTokenizer.from_file(resume_tok)
        elif args.tokenizer:  # every rank reads the user's file: one that fails, fails on all of them alike
            self.tokenizer = load_or_train([], self.cfg.vocab_size, args.tokenizer)
        else:
            train_docs = split_documents(docs)[0]
            error = None
            if self.world.is_main:  # train (or find) the tokenizer once; the others read the cache
                try:
                    self.tokenizer = load_or_train([d.text for d in train_docs], self.cfg.vocab_size, args.tokenizer)
                except OSError as err:  # an unwritable cache: every rank stops with this line
                    error = err
            raise_from_main(self.world, error)
            if not self.world.is_main:
                self.tokenizer = load_or_train([d.text for d in train_docs], self.cfg.vocab_size, args.tokenizer)
        (train_tokens, train_segments), (held_tokens, held_segments) = train_and_heldout_documents(docs,
                                                                                                    self.tokenizer)
        packed = self.packing == "docs"
        self.stream = BatchStream(train_tokens, args.seq_len, args.batch_size, args.seed,
                                  segments=train_segments if packed else None)
        self.eval_windows = heldout_windows(held_tokens, args.seq_len, args.eval_windows)
        self.eval_segments = heldout_windows(held_segments, args.seq_len, args.eval_windows) if packed else None
        targets = self.eval_windows[:, 1:]
        if packed:  # the labels the held-out loss counts (none across a document boundary)
            targets = targets[same_document(self.eval_segments, 1)]
        self.unigram = unigram_cross_entropy(train_tokens, targets.flatten(), self.cfg.vocab_size)
        self.train_tokens = len(train_tokens)

    def _resume(self, path: Path) -> None:
        state, self._resumed = self._resumed, None  # the state dicts are dropped once loaded
        load_full_state(self.model, self.optimizer, state["model"], state["optimizer"])
        trainer = state["trainer"]
        self.balancer.load_state_dict(trainer["balance_bias"])
        self.stream.load_state_dict(trainer["data"])
        ckpt.set_rng_state(trainer["rng"][self.world.rank])
        self.step = trainer["step"]
        self.last_checkpoint = path
        if self.args.max_steps is None:  # continue the saved schedule (it may have been fitted to a time limit)
            self.schedule = WSDSchedule(**trainer["schedule"])

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def save(self) -> Path:
        """Collective: every rank contributes its shards and RNG state; rank 0 writes. Every rank returns (and
        remembers, for an interruption's message) the path once the checkpoint is in place."""
        model_state = full_model_state(self.model)
        optim_state = full_optimizer_state(self.model, self.optimizer)
        rng = [ckpt.rng_state()]
        if self.world.distributed:
            rng = [None] * self.world.size
            torch.distributed.all_gather_object(rng, ckpt.rng_state())
        error = None
        if self.world.is_main:
            trainer_state = {"data": self.stream.state_dict(), "balance_bias": self.balancer.state_dict(),
                             "schedule": self.schedule.state_dict(), "rng": rng, "world_size": self.world.size,
                             "args": asdict(self.args)}
            try:
                self.out.mkdir(parents=True, exist_ok=True)
                tok_file = self.out / "tokenizer.json"
                self.tokenizer.save(tok_file)
                ckpt.save_checkpoint(self.out, self.step, self.cfg, model_state, optim_state, trainer_state, tok_file)
            except OSError as err:  # a full disk, a directory gone read-only: every rank stops with this line
                error = err
        raise_from_main(self.world, error)  # the barrier: the checkpoint is in place when the ranks go on
        self.last_checkpoint = self.out / step_dir_name(self.step)
        return self.last_checkpoint

    # ---- what the data decides (openk3.train.vision_loop.CaptionTrainer overrides these) -------------------------
    BASELINE = "unigram baseline"  # the plot's name for self.unigram

    packing = "concat"  # what _setup_data chose (a task without documents keeps this)

    def _varying_layout(self) -> str | None:
        """What changes the step's shapes or layout from batch to batch (automatic CUDA graphs stay off), or None."""
        if self.cfg.vision is not None:
            return "the shapes task's prompts change length with the image's canvas"
        if self.packing == "docs":
            return ("--packing docs gives every batch its own document boundaries (the KDA kernels' varlen chunk "
                    "tables); --packing concat keeps one layout")
        return None

    def _next_batch(self) -> torch.Tensor | PackedRows:
        """This rank's share of the next global batch (its data-parallel index's rows), on the device; with
        --packing docs with its rows' segment ids, which stay on the host (openk3.model.documents)."""
        if self.packing == "docs":
            tokens, segments = (self.parallel.data_rows(t) for t in self.stream.next_packed())
            return PackedRows(tokens.to(self.device), segments)
        return self.parallel.data_rows(self.stream.next()).to(self.device)

    def _losses(self, batch: torch.Tensor | PackedRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if isinstance(batch, PackedRows):
            return lm_losses(self.model, batch.tokens, self.args.mtp_weight, batch.segments)
        if self.parallel.cp is not None:
            return cp_lm_losses(self.model, batch, self.args.mtp_weight, self.parallel.cp)
        return lm_losses(self.model, batch, self.args.mtp_weight)

    def _batch_tokens(self, batch: torch.Tensor) -> int:
        """Tokens of the global batch (for tokens_per_s)."""
        return self.args.batch_size * self.args.seq_len

    def _heldout(self) -> float:
        return heldout_loss(self.model, self.eval_windows, max(1, self.args.batch_size // self.world.size),
                            self.device, self.amp, self.world, self.eval_segments)

    def _baseline_metrics(self) -> dict:
        """summary.json's numbers to read the held-out loss against."""
        return {"unigram_loss": self.unigram}

    # ---- the loop --------------------------------------------------------------------------------------------
    def _forward_backward(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM and MTP losses of `batch` (detached), their weighted sum back-propagated."""
        with torch.autocast(self.device.type, dtype=self.amp or torch.float32, enabled=self.amp is not None,
                            cache_enabled=not self.args.cuda_graphs):
            loss, lm, mtp = self._losses(batch)
        loss.backward()
        return lm.detach(), None if mtp is None else mtp.detach()

    def _compiled_or_eager(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward and backward of `batch` (through the CUDA graph if any). When compiling fails (a Dynamo or
        Inductor error, at the first steps or at a later recompilation) the run says so in one line and goes on
        eagerly from this batch, as `openk3 serve` does; the failed call's partial gradients are dropped."""
        try:
            return (self.graphed or self._forward_backward)(batch)
        except torch._dynamo.exc.TorchDynamoException as err:  # Inductor's errors derive from it too
            if not self.args.compile:
                raise
            lines = [line.strip() for line in str(err).splitlines() if line.strip() and "TORCH" not in line]
            reason = " ".join([type(err).__name__ + ":"] + lines[:2])  # the backend's own error is the 2nd line
            self._say(f"compiling the training step failed, training eagerly ({reason})", None)
            uncompile_blocks(self.model)
            self.args = replace(self.args, compile=False)
            self.optimizer.zero_grad(set_to_none=True)
            if self.graphed is not None:
                self.graphed = GraphedForwardBackward(self._forward_backward, list(self.model.parameters()))
            return (self.graphed or self._forward_backward)(batch)

    def queue_step(self) -> QueuedStep:
        """Queue one step (lr, batch, forward and backward, clipping, optimizer, router bias) on the device; its
        numbers are read by `.record()`. Nothing here waits for the device."""
        args = self.args
        lr = self.schedule(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        start = DeviceMark(self.device)
        batch = self._next_batch()
        lm, mtp = self._compiled_or_eager(batch)
        losses = average_across(self.world, torch.stack([lm] if mtp is None else [lm, mtp]).float())
        grad_norm = clip_grad_norm(self.model, args.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        maxvio = self.balancer.step()
        self.step += 1
        self.steps_queued += 1
        return QueuedStep(self.step, lr, self._batch_tokens(batch), losses, grad_norm, maxvio, start,
                          DeviceMark(self.device))

    def train_step(self) -> dict:
        """One step, its metrics line read at once."""
        return self._read(self.queue_step())

    def _read(self, queued: QueuedStep) -> dict:
        return queued.record(self.flops_per_token, self.peak_flops, self.world.size)

    def _pauses_after(self, step: int) -> bool:
        """Whether the run evaluates or saves after `step` (or ends there): nothing may be queued past it first."""
        a = self.args
        return step >= self.schedule.total_steps or bool(a.eval_every and step % a.eval_every == 0) or bool(
            a.save_every and step % a.save_every == 0)

    def steps(self, bar=None):
        """The remaining steps' metrics lines, in order. Step n's numbers are read once step n + 1 is queued, so
        the host's work between steps overlaps the device's; a step the run evaluates or saves after is read
        before anything more is queued, and the caller does that work before asking for the next line. `bar`:
        the progress bar whose description names a compile or a graph capture while it happens."""
        waiting = None
        while self.step < self.schedule.total_steps:
            phase = self._phase(self.steps_queued)
            if bar is not None and phase:
                bar.set_description_str(f"train [{phase}]", refresh=True)
            queued = self.queue_step()
            if bar is not None and phase:
                bar.set_description_str("train", refresh=False)
            if waiting is not None:
                yield self._read(waiting)
            waiting = queued
            if self._pauses_after(queued.step):
                yield self._read(waiting)
                waiting = None
        if waiting is not None:
            yield self._read(waiting)

    def run(self) -> dict:
        """Train to the schedule's end and close the run; Ctrl-C raises an Interrupted naming the last checkpoint."""
        try:
            return self._run()
        except KeyboardInterrupt:
            raise stopped_at(self.step, self.last_checkpoint) from None

    def _run(self) -> dict:
        args, world = self.args, self.world
        if world.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            self._announce()
        metrics_path = self.out / "metrics.jsonl"
        history = self._metrics_history(metrics_path) if world.is_main else []
        started = time.perf_counter()
        last_eval = log = board = None
        bar = self._progress()
        try:
            board = open_writer(args.tensorboard, self.step) if args.tensorboard and world.is_main else None
            last = time.perf_counter()
            for record in self.steps(bar):
                step = record["step"]  # the run has queued no step past it when it evaluates or saves (`steps`)
                if args.eval_every and (step % args.eval_every == 0 or step == self.schedule.total_steps):
                    last_eval = record["eval_loss"] = self._heldout()
                if not math.isfinite(record["loss"]):
                    raise FloatingPointError(f"loss became {record['loss']} at step {step}; lower --lr")
                if world.is_main:  # metrics.jsonl appears with its first line: a run that fails first leaves none
                    log = log or metrics_path.open("a")
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                    history.append(record)
                if board is not None:
                    write_scalars(board, record)
                if bar is not None:
                    bar.update(1)
                    mfu = {"mfu": f"{record['mfu']:.1%}"} if "mfu" in record else {}
                    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", **mfu)
                if args.save_every and step % args.save_every == 0 and step < self.schedule.total_steps:
                    self.save()
                now = time.perf_counter()
                self._recent.append(now - last)
                last = now
                self._fit_time_limit(bar)
                self._watch_pace(bar)
        finally:
            for handle in (bar, log, board):
                if handle is not None:
                    handle.close()
        if last_eval is None:
            last_eval = self._heldout()
        saved = self.save()
        summary = {"steps": self.step, "heldout_loss": last_eval, **self._baseline_metrics(),
                   "train_seconds": time.perf_counter() - started, "checkpoint": str(saved) if saved else None}
        sample = self._sample()
        if world.is_main:
            (self.out / "sample.txt").write_text(sample)
            if args.plot and history:
                from openk3.train.plots import plot_losses

                plot_losses(history, self.out / "loss.png", self.unigram, self.BASELINE)
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
            self._report(summary, sample)
        close_world(world)
        return summary

    def _phase(self, steps_run: int) -> str | None:
        """What the next step spends its time on besides training, for the progress line: compiling (the first
        two steps a compiled run takes in this process, a recompilation when the second batch differs) or
        capturing the CUDA graph (the call after the graph's warm-up)."""
        graphed = self.graphed
        if graphed is not None and graphed.graph is None and graphed.failed is None and graphed.calls == graphed.warmup:
            return "capturing the CUDA graph"
        return "compiling" if self.args.compile and steps_run < 2 else None

    def _fit_time_limit(self, bar) -> None:
        """Fit the schedule's length to --time-limit (opt-in) while its decay has not begun.

        Projection: elapsed + remaining steps x (median of the last FIT_WINDOW step times: one stall does not move
        it) + the closing work (held-out evaluation, save, text sample: about CLOSING_STEPS steps). The length
        moves between step + 1 and the requested number of steps, so a slow patch on a shared machine shortens
        the run and a fast one gives the steps back; the WSD decay moves with it. All ranks agree on the numbers
        (means across processes).
        """
        schedule = self.schedule
        if not self.args.time_limit or len(self._recent) < FIT_WINDOW // 2 or (
                self.step >= schedule.total_steps - schedule.decay):
            return
        per_step = mean_across(self.world, statistics.median(self._recent), self.device)
        elapsed = mean_across(self.world, time.perf_counter() - self.created, self.device)
        budget = self.args.time_limit - elapsed - CLOSING_STEPS * per_step
        total = min(self.requested_steps, self.step + max(1, int(budget / per_step)))
        if total == schedule.total_steps:
            return
        a = self.args
        fitted = WSDSchedule.for_run(a.lr, total, a.warmup_frac, a.decay_frac)
        if fitted.total_steps - fitted.decay < self.step:  # too late for the full decay: it starts now
            fitted = WSDSchedule(a.lr, total, fitted.warmup, total - self.step, fitted.min_ratio)
        self.schedule = fitted
        if bar is not None:
            bar.total = total
            bar.refresh()
        if not self._announced_fit:
            self._announced_fit = True
            self._say(f"--time-limit {a.time_limit:.0f}s: at {per_step:.2f} s/step the run is fitted to {total} "
                      "steps (re-fitted as the speed changes; never above the requested steps)", bar)

    def _watch_pace(self, bar) -> None:
        """Say once how long the run will take, as a warning when that is over SLOW_RUN_SECONDS, and warn again if
        the machine then slows the projection by SLOWDOWN_FACTOR. Without --time-limit the run keeps its steps
        whatever the pace (the same model on any machine), so a slow machine gets words, not a different model."""
        if len(self._recent) < FIT_WINDOW // 2:
            return
        per_step = statistics.median(self._recent)
        steps = self.schedule.total_steps
        projected = time.perf_counter() - self.created + (steps - self.step + CLOSING_STEPS) * per_step
        keeps = (f"it keeps its {steps} steps; --time-limit SECONDS would instead shorten the schedule to a "
                 "budget (a different model)")
        if self._expected_seconds is None:
            self._expected_seconds = projected
            line = f"at {per_step:.2f} s/step the run is expected to take {_duration(projected)} ({steps} steps)"
            if projected > SLOW_RUN_SECONDS and not self.args.time_limit:
                line = f"warning: {line}, over {SLOW_RUN_SECONDS // 60} min (a slow or busy machine?); {keeps}"
            self._say(line, bar)
        elif projected > SLOWDOWN_FACTOR * self._expected_seconds and not (
                self._warned_slowdown or self.args.time_limit):
            self._warned_slowdown = True
            self._say(f"warning: steps slowed to {per_step:.2f} s: the run now needs about {_duration(projected)} "
                      f"(expected {_duration(self._expected_seconds)}); {keeps}", bar)

    def _say(self, message: str, bar) -> None:
        """A line for the user, above the progress bar when there is one (which then redraws below it)."""
        if not self.world.is_main:
            return
        if bar is not None:
            bar.write(message, file=sys.stderr)
        else:
            print(message, flush=True)

    # ---- output ----------------------------------------------------------------------------------------------
    def _device_words(self) -> str:
        """The device as the first line names it: cpu with its thread count ("cpu (1 thread)"), else as is."""
        n = torch.get_num_threads()
        return f"{self.device} ({n} thread{'s' if n > 1 else ''})" if self.device.type == "cpu" else str(self.device)

    def _announce(self) -> None:
        print(f"openk3 train: {self.cfg.name} ({parameter_summary(count_parameters(self.cfg))}), "
              f"{self.train_tokens:,} training tokens, "
              f"{self.schedule.total_steps} steps x {self.args.batch_size} x {self.args.seq_len} tokens, "
              f"optimizer={self.args.optimizer}, balance={self.args.balance}, device={self._device_words()}"
              f"{f', qat={self.args.qat} (checkpoints hold the full-precision weights)' if self.args.qat else ''}, "
              f"processes={self.world.size}, packing={self.packing}"
              f"{', compiled' if self.args.compile else ''}{', CUDA graphs' if self.args.cuda_graphs else ''}, "
              f"out={self.out}", flush=True)
        if self.fast_path_note:
            print(self.fast_path_note, flush=True)

    def _metrics_history(self, path: Path) -> list[dict]:
        """Earlier lines of metrics.jsonl up to the current step (a resumed run drops the ones it will redo)."""
        if not path.is_file():
            return []
        kept = [r for r in map(json.loads, path.read_text().splitlines()) if r["step"] <= self.step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        return kept

    def _progress(self):
        if not (self.args.progress and self.world.is_main):
            return None
        from tqdm import tqdm

        return tqdm(total=self.schedule.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)

    def _sample(self) -> str:
        from openk3.generation import generate_ids
        from openk3.sampling import SamplingParams

        params = SamplingParams(max_tokens=max(1, self.args.sample_tokens), temperature=0.8, top_k=50,
                                seed=self.args.seed)
        if self.args.compile:  # the last use of the model: token-by-token decoding through the blocks compiled for
            uncompile_blocks(self.model)  # training would recompile them at every new cache shape (minutes on a GPU)
        # under expert parallelism every forward is collective and the ranks' logits may differ in the last bit:
        # all ranks generate the full length (the same number of forwards), cut at the stop token afterwards
        eos = self.tokenizer.eos_id
        ids = generate_ids(self.model, self.tokenizer.encode(SAMPLE_PROMPT), self.args.sample_tokens, params,
                           set() if self.dims.ep > 1 else {eos}, self.device)
        ids = ids[:ids.index(eos)] if eos in ids else ids
        return SAMPLE_PROMPT + self.tokenizer.decode(ids)

    def _report(self, summary: dict, sample: str) -> None:
        print(f"\nheld-out loss {summary['heldout_loss']:.3f} nats/token vs unigram baseline "
              f"{summary['unigram_loss']:.3f} ({summary['steps']} steps, {summary['train_seconds']:.0f} s)")
        print(f"checkpoint: {summary['checkpoint']}\nsample ({self.out / 'sample.txt'}):\n{sample}", flush=True)

