"""`openk3 train` for a model with a vision tower: the training loop of openk3.train.loop on the embedded shapes
task (openk3.train.shapes) instead of text.

What changes (the `Trainer` hooks): batches are captioned pictures (images packed into one ImageBatch, token rows
right-padded, loss on the caption tokens only), the held-out loss is over 256 held-out scenes' captions, and the run
ends with the held-out caption accuracy (greedy captions decoded with the model's cache after the image: per
attribute and exact match of all four) beside the text-only baseline, the best any model that cannot see the image
can do (shapes.AttributePrior). Everything else (optimizer, schedule, balancing, checkpoints, --resume, FSDP,
progress, time limit) is the text loop's. --data and --tokenizer do not apply; --seq-len is not used (a sequence
is as long as its image's tokens plus the caption); --cp must stay 1 (a caption's sequence is not split).
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.accounting import count_parameters, parameter_summary
from openk3.ops.loss import linear_cross_entropy
from openk3.train.args import TrainArgs
from openk3.train.loop import Trainer
from openk3.train.shapes import (
    IGNORE,
    AttributePrior,
    CaptionBatch,
    SceneStream,
    caption_tokenizer,
    held_out_scenes,
    make_batch,
    scene,
    score,
)

HELD_OUT_SCENES = 256
PRIOR_SCENES = 4096  # training scenes whose attribute frequencies make the text-only baseline
EVAL_BATCH = 64


def caption_losses(model: nn.Module, batch: CaptionBatch,
                   mtp_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(total loss, caption CE, MTP CE or None), the last two detached, for a caption batch (as `train.loop.
    lm_losses`); MTP position t predicts target t+1 (IGNORE kept)."""
    want_mtp = mtp_weight > 0 and getattr(model.config, "mtp_layers", 0) > 0
    out = model(batch.inputs, images=batch.images, return_mtp=want_mtp, return_logits=False)
    head = model.lm_head.weight  # the head applied inside the loss (train.loop.lm_losses says why this is safe)
    lm = linear_cross_entropy(out.head_inputs.flatten(0, 1), head, batch.targets.flatten(), ignore_index=IGNORE)
    if not want_mtp or not out.mtp_head_inputs:
        return lm, lm.detach(), None
    mtp = linear_cross_entropy(out.mtp_head_inputs[0].flatten(0, 1), head, batch.targets[:, 1:].flatten(),
                               ignore_index=IGNORE)
    return lm + mtp_weight * mtp, lm.detach(), mtp.detach()


@torch.no_grad()
def greedy_captions(model: nn.Module, batch: CaptionBatch, num_words: int) -> list[list[int]]:
    """The model's greedy continuation (num_words tokens) of each row's prompt (everything before the caption), with
    the decode cache: one prefill of prompt + image, then one token per step. Rows must share the prompt length."""
    starts = {int((row != IGNORE).nonzero()[0]) for row in batch.targets}
    if len(starts) != 1:
        raise ValueError(f"greedy_captions needs rows of one prompt length, got {sorted(starts)}")
    start = starts.pop() + 1
    cache = model.new_cache(len(batch.scenes))
    logits = model(batch.inputs[:, :start], cache=cache, images=batch.images, logits_to_keep=1).logits[:, -1]
    out = [logits.argmax(-1)]
    for _ in range(num_words - 1):
        out.append(model(out[-1].unsqueeze(1), cache=cache, logits_to_keep=1).logits[:, -1].argmax(-1))
    return torch.stack(out, dim=1).tolist()


class CaptionTrainer(Trainer):
    BASELINE = "text-only baseline"
    DEFAULT_BATCH = 16  # captioned images per step
    DEFAULT_STEPS = 1200  # 19,200 images: over 90% of held-out captions exactly right (bench/RESULTS.md)

    def __init__(self, args: TrainArgs):
        """The flags this task cannot take fail first, before any process group or output directory."""
        for flag, value in (("--data", args.data), ("--tokenizer", args.tokenizer)):
            if value is not None:
                raise ValueError(f"{flag}: preset {args.preset!r} has a vision tower and trains on the embedded "
                                 "shapes task, which has its own data and tokenizer")
        if args.cuda_graphs:
            raise ValueError("--cuda-graphs needs batches of one shape; the shapes task's prompts change length "
                             "with the image's canvas")
        if args.cp > 1:
            raise ValueError(f"--cp {args.cp}: the shapes task's sequences (an image and its caption) are not split "
                             "across ranks; train a model with a vision tower with --cp 1")
        super().__init__(args)

    def _setup_data(self) -> None:
        args, vc = self.args, self.cfg.vision
        self.tokenizer = caption_tokenizer()
        if not self.tokenizer.vocab_size <= vc.image_token_id < self.cfg.vocab_size:
            raise ValueError(f"config field 'vision.image_token_id' must be in [{self.tokenizer.vocab_size}, "
                             f"vocab_size={self.cfg.vocab_size}) for the shapes task's {self.tokenizer.vocab_size}-word"
                             f" tokenizer, got {vc.image_token_id}")
        self.stream = SceneStream(args.seed, args.batch_size)
        self.held_out = held_out_scenes(HELD_OUT_SCENES)
        by_canvas: dict[tuple[int, int], list] = {}
        for s in self.held_out:
            by_canvas.setdefault(s.canvas, []).append(s)
        self.eval_batches = [make_batch(group[i:i + EVAL_BATCH], self.tokenizer, vc)  # one prompt length each
                             for group in by_canvas.values() for i in range(0, len(group), EVAL_BATCH)]
        self.prior = AttributePrior([scene(args.seed, i) for i in range(PRIOR_SCENES)])
        self.unigram = self.prior.loss(self.held_out)  # the plotted baseline
        self.train_tokens = 0

    def _next_batch(self) -> CaptionBatch:
        scenes = self.stream.next(self.world.rank // self.dims.cp, self.dims.dp)  # this data-parallel index's share
        return make_batch(scenes, self.tokenizer, self.cfg.vision).to(self.device)

    def _losses(self, batch: CaptionBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return caption_losses(self.model, batch, self.args.mtp_weight)

    def _batch_tokens(self, batch: CaptionBatch) -> int:
        return batch.inputs.numel() * self.dims.dp

    def _heldout(self) -> float:
        """Mean CE per caption token over the held-out scenes (every rank evaluates all of them)."""
        self.model.eval()
        total = count = 0
        with torch.no_grad():
            for batch in self.eval_batches:
                batch = batch.to(self.device)
                with torch.autocast(self.device.type, dtype=self.amp or torch.float32, enabled=self.amp is not None):
                    normed = self.model(batch.inputs, images=batch.images, return_mtp=False,
                                        return_logits=False).head_inputs
                    total += float(linear_cross_entropy(normed.flatten(0, 1), self.model.lm_head.weight,
                                                        batch.targets.flatten(), ignore_index=IGNORE, reduction="sum"))
                count += int((batch.targets != IGNORE).sum())
        self.model.train()
        return total / count

    def accuracy(self) -> dict[str, float]:
        """Held-out greedy-caption accuracy: per attribute and "exact" (all four right)."""
        self.model.eval()
        hits = []
        words = len(self.held_out[0].words)
        for batch in self.eval_batches:
            with torch.autocast(self.device.type, dtype=self.amp or torch.float32, enabled=self.amp is not None):
                predicted = greedy_captions(self.model, batch.to(self.device), words)
            for s, ids in zip(batch.scenes, predicted):
                hits.append([a == b for a, b in zip(self.tokenizer.encode(s.caption), ids)])
        self.model.train()
        return score(hits)

    def _baseline_metrics(self) -> dict:
        return {"text_only_loss": self.unigram, "caption_accuracy": self.accuracy(),
                "text_only_accuracy": self.prior.accuracy(self.held_out)}

    def _sample(self) -> str:
        """Captions of the first held-out scene of each canvas size: truth -> the model's greedy caption."""
        self.model.eval()
        lines = []
        firsts = {s.canvas: s for s in reversed(self.held_out)}.values()
        for s in firsts:
            first = make_batch([s], self.tokenizer, self.cfg.vision).to(self.device)
            ids = greedy_captions(self.model, first, len(first.scenes[0].words))[0]
            lines.append(f"{first.scenes[0].caption:<32} -> {self.tokenizer.decode_plain(ids)}")
        self.model.train()
        return "\n".join(lines) + "\n"

    def _announce(self) -> None:
        print(f"openk3 train: {self.cfg.name} ({parameter_summary(count_parameters(self.cfg))}) on "
              f"the shapes task, {self.schedule.total_steps} steps x {self.args.batch_size} captioned images, "
              f"{HELD_OUT_SCENES} held-out scenes, optimizer={self.args.optimizer}, device={self._device_words()}, "
              f"processes={self.world.size}, out={self.out}", flush=True)

    def _report(self, summary: dict, sample: str) -> None:
        acc, base = summary["caption_accuracy"], summary["text_only_accuracy"]
        print(f"\nheld-out caption loss {summary['heldout_loss']:.3f} nats/token vs text-only baseline "
              f"{summary['text_only_loss']:.3f} ({summary['steps']} steps, {summary['train_seconds']:.0f} s)")
        print("held-out accuracy (greedy captions)   " + "  ".join(f"{k} {v:.1%}" for k, v in acc.items()))
        print("text-only baseline (attribute prior)  " + "  ".join(f"{k} {v:.1%}" for k, v in base.items()))
        print(f"checkpoint: {summary['checkpoint']}\nsample ({self.out / 'sample.txt'}):\n{sample}", flush=True)

