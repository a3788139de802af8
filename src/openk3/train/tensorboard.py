"""`openk3 train --tensorboard DIR`: the metrics of metrics.jsonl as TensorBoard scalars (torch.utils.tensorboard).

Every number of a metrics record is a scalar under its own key at the record's step (loss, mtp_loss, eval_loss,
lr, grad_norm, tokens_per_s, mfu), and a dict of numbers one scalar per entry, under key/entry (maxvio/<MoE layer>),
so the event files hold exactly what metrics.jsonl holds.
"""

from __future__ import annotations


def open_writer(log_dir: str, resume_step: int = 0):
    """A SummaryWriter on `log_dir`; a resumed run (resume_step > 0) purges the events after its step, which it
    trains again. Raises with the install line when the tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ImportError("--tensorboard needs the tensorboard package: pip install 'openk3[tensorboard]' (or "
                          "pip install tensorboard)") from err
    try:
        return SummaryWriter(log_dir=log_dir, purge_step=resume_step + 1 if resume_step else None)
    except OSError as err:
        raise type(err)(f"--tensorboard {log_dir}: {err.strerror or err}") from None


def write_scalars(writer, record: dict) -> None:
    """One metrics record as scalars at its step (module docstring)."""
    step = record["step"]
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, dict):
            for entry, number in value.items():
                writer.add_scalar(f"{key}/{entry}", number, step)
        else:
            writer.add_scalar(key, value, step)
