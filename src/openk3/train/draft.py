"""`openk3 draft`: fine-tune a trained model's MTP layer into an EAGLE-3-style draft (SPEC §11), target frozen.

One step: a batch of windows from the corpus (train/data.py: the embedded stdlib corpus by default) -> the target's
forward (no gradient) gives its next-token distributions p and the three tapped hidden states -> the draft unrolls
`draft_tokens` steps on its own outputs (training-time test, `EagleDraft.unroll`) -> loss = sum_i 0.8^i L_i /
sum_i 0.8^i, L_i the step's LK^alpha / KL / hybrid loss against p (openk3.draft.loss: the mean over positions) ->
AdamW on the fc fusion and the MTP layer (embedding, LM head and router biases stay as trained) with a WSD schedule.

Evaluation every `eval_every` steps and at the end: speculative decoding (`openk3.draft.speculative`) from held-out
prompts with `draft_tokens` drafts per verification, sampled at `eval_temperature` (1: where alpha is the
acceptance probability) with fixed seeds, counted as vLLM counts it: accept_len = 1 + accepted / verifications,
accept_rate = accepted / drafted.

Out directory: metrics.jsonl (per step `loss`, `alpha` per unrolled step, `lr`; at evaluations `accept_len`,
`accept_rate`) and step-NNNNNN/: the target with the fine-tuned MTP layer (config.json + model.safetensors),
tokenizer.json, draft.json + draft.safetensors (openk3.draft.model), manifest.json; written to a temporary
directory and renamed into place. `openk3 generate --speculative K` and `openk3 serve --speculative K` read it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from openk3.checkpoints import fsync_file, resolve_checkpoint, step_dir_name, write_manifest
from openk3.draft.loss import DEFAULT_ETA, LOSSES, draft_loss
from openk3.draft.model import EagleDraft, has_draft, save_draft, tapped_hidden_states
from openk3.draft.speculative import SpeculationStats, speculative_generate
from openk3.sampling import SamplingParams
from openk3.train.args import MAX_LR
from openk3.train.checkpoint import publish
from openk3.train.data import BatchStream, heldout_windows, load_documents, train_and_heldout_streams
from openk3.train.interrupt import Interrupted
from openk3.train.preflight import check_kda_backend, checked_device
from openk3.train.schedule import WSDSchedule

STEP_DECAY = 0.8  # EAGLE-3: the loss of unrolled step i is weighted 0.8^i


@dataclass
class DraftArgs:
    ckpt: str = ""
    out: str = "runs/draft"
    loss: str = "lk"
    eta: float = DEFAULT_ETA
    max_steps: int = 200
    draft_tokens: int = 3
    taps: tuple[int, ...] | None = None  # None: EAGLE-3's (2, L//2, L-3)
    lr: float = 1e-3
    batch_size: int = 8
    seq_len: int = 128
    data: str | None = None
    eval_every: int = 50
    eval_prompts: int = 8
    eval_prompt_len: int = 64
    eval_tokens: int = 48
    eval_temperature: float = 1.0
    seed: int = 0
    device: str | None = None
    threads: int = 0
    kda_backend: str = "auto"
    overwrite: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"--loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        for name, low in (("max_steps", 1), ("draft_tokens", 1), ("batch_size", 1), ("seq_len", 2),
                          ("eval_prompts", 1), ("eval_prompt_len", 2), ("eval_tokens", 1), ("eval_every", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be at least {low}, got {getattr(self, name)}")
        if self.seq_len < self.draft_tokens:
            raise ValueError(f"--seq-len {self.seq_len} must be at least --draft-tokens {self.draft_tokens} (the last "
                             "unrolled step predicts that many tokens ahead within a window)")
        numbers = (self.lr, self.eta, self.eval_temperature)
        if not (all(map(math.isfinite, numbers)) and 0 < self.lr <= MAX_LR and self.eta >= 0
                and self.eval_temperature >= 0):
            raise ValueError(f"--lr must be in (0, {MAX_LR:g}], --eta and --eval-temperature >= 0, all finite; got "
                             f"{self.lr}, {self.eta}, {self.eval_temperature}")


def load_target(ckpt: Path, device: torch.device):
    """The frozen target (with its MTP layer) and the tokenizer of a checkpoint; clear errors for what is missing."""
    from openk3.interop import load_pretrained
    from openk3.interop.files import read_config
    from openk3.tokenizer import TextTokenizer

    if not (ckpt / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{ckpt} has no tokenizer.json (the draft trains on text): pass a checkpoint of "
                                "`openk3 train`")
    mtp = read_config(ckpt).get("text_config", {}).get("num_nextn_predict_layers", 0)
    if not mtp:
        raise ValueError(f"{ckpt} has no MTP layer (num_nextn_predict_layers = 0, as in the released K3 files): "
                         "`openk3 draft` fine-tunes the MTP layer into the draft. Train a model with one, e.g. "
                         "`openk3 train` (k3-tiny and the other K3 presets have mtp_layers = 1), and pass its --out")
    model = load_pretrained(ckpt).to(device).eval()
    model.requires_grad_(False)
    return model, TextTokenizer.from_file(ckpt / "tokenizer.json")


def draft_losses(model, draft: EagleDraft, batch: torch.Tensor, kind: str, steps: int,
                 eta: float = DEFAULT_ETA) -> tuple[torch.Tensor, list[float]]:
    """(the weighted loss over the unrolled steps, each step's mean alpha) for windows [B, T]."""
    with torch.no_grad(), tapped_hidden_states(model, draft.taps) as tapped:
        probs = torch.softmax(model(batch, return_mtp=False).logits.float(), dim=-1)  # [B,T,V]
        taps = {i: t.detach() for i, t in tapped.items()}
    T = batch.shape[1]
    total, weights, alphas = 0.0, 0.0, []
    for i, logits in enumerate(draft.unroll(draft.fuse(taps), batch, steps)):
        # step i at index t predicts token t+i+1: the target's distribution at position t+i
        loss, alpha = draft_loss(logits[:, :T - i], probs[:, i:], kind, eta)
        total = total + STEP_DECAY**i * loss
        weights += STEP_DECAY**i
        alphas.append(float(alpha))
    return total / weights, alphas


def acceptance(model, draft: EagleDraft, prompts: torch.Tensor, tokens: int, num_draft: int, temperature: float,
               seed: int) -> SpeculationStats:
    """Speculative decoding from each prompt [n, P] for `tokens` tokens (no stop token), seeds seed, seed+1, ..."""
    stats = SpeculationStats()
    device = prompts.device
    for i, prompt in enumerate(prompts.tolist()):
        params = SamplingParams(max_tokens=tokens, temperature=temperature, seed=seed + i)
        speculative_generate(model, draft, prompt, tokens, params, num_draft, device=device, stats=stats)
    return stats


def save_draft_checkpoint(out: Path, step: int, model, draft: EagleDraft, tokenizer_file: Path,
                          training: dict) -> Path:
    """out/step-NNNNNN holding the target (with the fine-tuned MTP layer), its tokenizer and the draft; atomic."""
    from openk3.interop import save_pretrained

    final = out / step_dir_name(step)
    tmp = out / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_pretrained(model, tmp)
    shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
    save_draft(draft, tmp, **training)
    for path in tmp.iterdir():
        fsync_file(path)
    write_manifest(tmp, step)
    publish(tmp, final)
    return final


def check_apart(out: Path, source: Path, ckpt: Path) -> None:
    """--out may not be the --ckpt run or checkpoint, lie inside it or hold it: the target stays untouched."""
    mine = out.resolve()
    for theirs in {source.resolve(), ckpt.resolve()}:
        if mine == theirs or mine in theirs.parents or theirs in mine.parents:
            latest = f" ({ckpt})" if ckpt != source else ""
            raise ValueError(f"--out {out} overlaps --ckpt {source}{latest}; write the draft to a directory of its own")


def _draft_metrics(path: Path) -> bool:
    """Whether metrics.jsonl is a draft run's (its records have `alpha`), not a training run's."""
    with path.open(encoding="utf-8", errors="replace") as f:
        first = f.readline()
    try:
        return "alpha" in json.loads(first)
    except (json.JSONDecodeError, TypeError):
        return False


def claim_out(out: Path, overwrite: bool) -> None:
    """Refuse an --out that holds a run's files: an earlier draft run's unless --overwrite (then deleted), any other
    run's always (a training run's checkpoints are never deleted). An empty metrics.jsonl (a run that failed
    before its first step) is no run."""
    metrics = out / "metrics.jsonl"
    found = ([metrics] if metrics.is_file() and metrics.stat().st_size else []) + sorted(
        p for p in out.glob("step-*") if p.is_dir())
    foreign = [p for p in found if not (_draft_metrics(p) if p == metrics else has_draft(p))]
    names = ", ".join(p.name + ("/" if p.is_dir() else "") for p in (foreign or found)[:4]) + (
        ", ..." if (foreign or found)[4:] else "")
    if foreign:
        raise ValueError(f"--out {out} holds a training run or other files that are not a draft's ({names}), "
                         "which `openk3 draft` never replaces; choose another --out")
    if found and not overwrite:
        raise ValueError(f"--out {out} already holds a draft run ({names}); choose another --out or pass --overwrite")
    for path in found:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    (out / "summary.json").unlink(missing_ok=True)


def train_draft(args: DraftArgs) -> dict:
    """Load and check everything (target, data, --out) before writing, then fine-tune; Ctrl-C raises Interrupted."""
    from openk3.cli_options import cpu_threads
    from openk3.model import configure_kda

    device = checked_device(args.device)
    check_kda_backend(args.kda_backend, device)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(args.threads))
    ckpt = resolve_checkpoint(args.ckpt)
    out = Path(args.out)
    check_apart(out, Path(args.ckpt), ckpt)
    torch.manual_seed(args.seed)
    model, tokenizer = load_target(ckpt, device)
    if args.seq_len > model.config.max_seq_len:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's max_seq_len {model.config.max_seq_len}")
    configure_kda(model, backend=args.kda_backend)
    draft = EagleDraft(model, args.taps)
    params = draft.trainable_parameters()
    for p in params:
        p.requires_grad_(True)
    train_tokens, held_tokens = train_and_heldout_streams(load_documents(args.data), tokenizer)
    stream = BatchStream(train_tokens, args.seq_len - 1, args.batch_size, args.seed,  # windows of seq_len tokens
                         shown=f"--seq-len {args.seq_len}")
    prompts = heldout_windows(held_tokens, args.eval_prompt_len - 1, args.eval_prompts,
                              shown=f"--eval-prompt-len {args.eval_prompt_len}").to(device)
    claim_out(out, args.overwrite)
    n_params = sum(p.numel() for p in params)
    print(f"openk3 draft: {model.config.name} from {ckpt}, draft = fc + MTP layer ({n_params / 1e6:.2f}M trainable), "
          f"taps {list(draft.taps)}, loss={args.loss}, {args.max_steps} steps x {args.batch_size} x {args.seq_len} "
          f"tokens, {args.draft_tokens} draft tokens, device={device}, out={out}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    record = _fine_tune(args, model, draft, params, stream, prompts, out / "metrics.jsonl")
    saved = save_draft_checkpoint(out, args.max_steps, model, draft, ckpt / "tokenizer.json",
                                  {**asdict(args), "source": str(ckpt), "accept_len": record["accept_len"]})
    summary = {"steps": args.max_steps, "loss": record["loss"], "accept_len": record["accept_len"],
               "accept_rate": record["accept_rate"], "checkpoint": str(saved)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"acceptance length {summary['accept_len']:.3f} at K = {args.draft_tokens} (accept rate "
          f"{summary['accept_rate']:.3f}, temperature {args.eval_temperature:g}, {args.eval_prompts} held-out "
          f"prompts); checkpoint: {saved}", flush=True)
    return summary


def _fine_tune(args: DraftArgs, model, draft: EagleDraft, params: list, stream: BatchStream, prompts: torch.Tensor,
               metrics: Path) -> dict:
    """The training steps, each a line of `metrics` (created with the first); returns the last record."""
    device = prompts.device
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = WSDSchedule.for_run(args.lr, args.max_steps)
    bar = log = None
    if args.progress:
        from tqdm import tqdm

        bar = tqdm(total=args.max_steps, desc="draft", unit="step", dynamic_ncols=True)
    record: dict = {}
    step = 0
    try:
        for step in range(args.max_steps):
            for group in optimizer.param_groups:
                group["lr"] = schedule(step)
            started = time.perf_counter()
            loss, alphas = draft_losses(model, draft, stream.next().to(device), args.loss, args.draft_tokens,
                                        args.eta)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            record = {"step": step + 1, "loss": float(loss.detach()), "alpha": alphas, "lr": schedule(step),
                      "seconds": time.perf_counter() - started}
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(f"the draft loss became {record['loss']} at step {step + 1}; lower --lr")
            if (args.eval_every and (step + 1) % args.eval_every == 0) or step + 1 == args.max_steps:
                record.update(_evaluate(args, model, draft, prompts))
            log = log or metrics.open("w")
            log.write(json.dumps(record) + "\n")
            log.flush()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.3f}", alpha=f"{alphas[0]:.3f}")
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted at step {step} of {args.max_steps}; the draft is saved at the end only, so "
                          "nothing was saved") from None
    finally:
        for handle in (bar, log):
            if handle is not None:
                handle.close()
    return record


def _evaluate(args: DraftArgs, model, draft: EagleDraft, prompts: torch.Tensor) -> dict:
    started = time.perf_counter()
    stats = acceptance(model, draft, prompts, args.eval_tokens, args.draft_tokens, args.eval_temperature, args.seed)
    return {"accept_len": stats.accept_len, "accept_rate": stats.accept_rate, "verifications": stats.rounds,
            "eval_seconds": time.perf_counter() - started}
