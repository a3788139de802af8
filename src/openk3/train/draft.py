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

from openk3.checkpoints import fsync_file, latest_checkpoint, resolve_checkpoint, step_dir_name, write_manifest
from openk3.draft.loss import DEFAULT_ETA, LOSSES, draft_loss
from openk3.draft.model import EagleDraft, save_draft, tapped_hidden_states
from openk3.draft.speculative import SpeculationStats, speculative_generate
from openk3.sampling import SamplingParams
from openk3.train.data import BatchStream, heldout_windows, load_documents, train_and_heldout_streams
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
        for name in ("max_steps", "draft_tokens", "batch_size", "seq_len", "eval_prompts", "eval_prompt_len",
                     "eval_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be at least 0, got {self.eval_every}")
        if not (self.lr > 0 and self.eta >= 0 and self.eval_temperature >= 0):
            raise ValueError(f"--lr must be > 0, --eta and --eval-temperature >= 0; got {self.lr}, {self.eta}, "
                             f"{self.eval_temperature}")


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
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def claim_out(out: Path, overwrite: bool) -> None:
    found = [p for p in (out / "metrics.jsonl", latest_checkpoint(out)) if p is not None and p.exists()]
    if found and not overwrite:
        raise ValueError(f"--out {out} already holds a draft run ({', '.join(p.name for p in found)}); choose "
                         "another --out or pass --overwrite")
    if found:
        (out / "metrics.jsonl").unlink(missing_ok=True)
        for step in out.glob("step-*"):
            shutil.rmtree(step)


def train_draft(args: DraftArgs) -> dict:
    from openk3.cli_options import cpu_threads
    from openk3.model import configure_kda

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(args.threads))
    ckpt = resolve_checkpoint(args.ckpt)
    out = Path(args.out)
    claim_out(out, args.overwrite)
    torch.manual_seed(args.seed)
    model, tokenizer = load_target(ckpt, device)
    configure_kda(model, backend=args.kda_backend)
    draft = EagleDraft(model, args.taps)
    params = draft.trainable_parameters()
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = WSDSchedule.for_run(args.lr, args.max_steps)

    train_tokens, held_tokens = train_and_heldout_streams(load_documents(args.data), tokenizer)
    stream = BatchStream(train_tokens, args.seq_len - 1, args.batch_size, args.seed)  # windows of seq_len tokens
    prompts = heldout_windows(held_tokens, args.eval_prompt_len - 1, args.eval_prompts).to(device)
    n_params = sum(p.numel() for p in params)
    print(f"openk3 draft: {model.config.name} from {ckpt}, draft = fc + MTP layer ({n_params / 1e6:.2f}M trainable), "
          f"taps {list(draft.taps)}, loss={args.loss}, {args.max_steps} steps x {args.batch_size} x {args.seq_len} "
          f"tokens, {args.draft_tokens} draft tokens, device={device}, out={out}", flush=True)

    def evaluate() -> dict:
        started = time.perf_counter()
        stats = acceptance(model, draft, prompts, args.eval_tokens, args.draft_tokens, args.eval_temperature,
                           args.seed)
        return {"accept_len": stats.accept_len, "accept_rate": stats.accept_rate, "verifications": stats.rounds,
                "eval_seconds": time.perf_counter() - started}

    out.mkdir(parents=True, exist_ok=True)
    bar = None
    if args.progress:
        from tqdm import tqdm

        bar = tqdm(total=args.max_steps, desc="draft", unit="step", dynamic_ncols=True)
    record: dict = {}
    with (out / "metrics.jsonl").open("w") as log:
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
                record.update(evaluate())
            log.write(json.dumps(record) + "\n")
            log.flush()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.3f}", alpha=f"{alphas[0]:.3f}")
    if bar is not None:
        bar.close()
    tokenizer_file = ckpt / "tokenizer.json"
    saved = save_draft_checkpoint(out, args.max_steps, model, draft, tokenizer_file,
                                  {**asdict(args), "source": str(ckpt), "accept_len": record["accept_len"]})
    summary = {"steps": args.max_steps, "loss": record["loss"], "accept_len": record["accept_len"],
               "accept_rate": record["accept_rate"], "checkpoint": str(saved)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"acceptance length {summary['accept_len']:.3f} at K = {args.draft_tokens} (accept rate "
          f"{summary['accept_rate']:.3f}, temperature {args.eval_temperature:g}, {args.eval_prompts} held-out "
          f"prompts); checkpoint: {saved}", flush=True)
    return summary
