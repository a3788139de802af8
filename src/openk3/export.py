"""`openk3 export`: a checkpoint rewritten for release: MXFP4-packed routed experts (`--quantization mxfp4`,
compressed-tensors' `mxfp4-pack-quantized`, openk3.interop.quantization) and/or the Kimi Linear hub layout
(`--layout hub`), with the tokenizer.json carried along, so that `openk3 generate` / `openk3 serve --ckpt` read
the result as they read the source. The source is a checkpoint directory or a training run (its latest one); a
QAT run's full-precision master weights are quantized here.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from openk3.checkpoints import resolve_checkpoint

TOKENIZER = "tokenizer.json"
# openk3.interop's QUANTIZATIONS and LAYOUTS, not imported so that building the CLI parser stays light (it would
# import the model); tests/test_interop_k3.py checks that they agree
QUANTIZATIONS = ("mxfp4",)
LAYOUTS = ("k3", "hub")


def checkpoint_file(name: str) -> bool:
    """A file an export writes: config.json, the safetensors (one file, or shards with their index), tokenizer.json."""
    return name in ("config.json", TOKENIZER, "model.safetensors.index.json") or (
        name.startswith("model") and name.endswith(".safetensors"))


def check_out(out: Path, source: Path, overwrite: bool) -> list[Path]:
    """--out must be a new or empty directory, or with --overwrite one holding only an earlier export (whose files
    are returned, to be replaced): never the source, a training run or any other files."""
    if out.resolve() == source.resolve():
        raise ValueError(f"--out {out} is the checkpoint being exported; choose another directory")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; choose a new or empty directory")
    entries = sorted(out.iterdir()) if out.exists() else []
    foreign = [e.name for e in entries if not (e.is_file() and checkpoint_file(e.name))]
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ValueError(f"--out {out} holds other files than a checkpoint's ({shown}), such as a training run's; "
                         "export into a new or empty directory")
    if entries and not overwrite:
        raise ValueError(f"--out {out} already holds a checkpoint; choose another --out or pass --overwrite to "
                         "replace its files")
    return entries


def check_layout(source: Path, layout: str) -> None:
    """--layout hub for a config the Kimi Linear layout cannot express is refused before the weights load."""
    from openk3.interop import config_from_json, config_to_hub
    from openk3.interop.files import read_config

    if layout == "hub":
        try:
            config_to_hub(config_from_json(read_config(source))[0])
        except ValueError as exc:
            reason = str(exc).removesuffix("; save with layout='k3' instead")
            raise ValueError(f"--layout hub: {reason}; export with --layout k3 instead") from None


def run_export(args: argparse.Namespace) -> int:
    from openk3.interop import load_pretrained, save_pretrained

    source = resolve_checkpoint(args.ckpt)
    out = Path(args.out)
    replaced = check_out(out, source, args.overwrite)
    check_layout(source, args.layout)
    model = load_pretrained(source)
    for file in replaced:  # (an earlier export's shards would outlive a single-file one)
        file.unlink()
    save_pretrained(model, out, layout=args.layout, quantization=args.quantization)
    if (source / TOKENIZER).is_file():
        shutil.copyfile(source / TOKENIZER, out / TOKENIZER)
    else:
        print(f"openk3 export: note: {source} has no {TOKENIZER}; `openk3 generate` on {out} will need --tokenizer",
              file=sys.stderr)
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"openk3 export: {source} -> {out} ({args.layout} layout, "
          f"{args.quantization or 'weights as stored'}: {size / 2**20:.2f} MiB of safetensors)")
    return 0


def add_export_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="write a checkpoint with MXFP4-packed routed experts and/or in the hub layout",
        description="Rewrite a checkpoint (a step-NNNNNN/ directory, or a training run directory: its latest "
                    "checkpoint) for release: --quantization mxfp4 packs the routed experts as the released K3 "
                    "files are (the rest as stored), --layout hub writes the Kimi Linear layout transformers "
                    "reads. The tokenizer.json is copied along.")
    p.add_argument("--ckpt", required=True, metavar="RUN_OR_CHECKPOINT", help="the checkpoint to export")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the new checkpoint directory: absent or empty (or an earlier export, with --overwrite)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="mxfp4: routed experts packed (their widths must be multiples of 32); default: the weights "
                        "as stored")
    p.add_argument("--layout", default="k3", choices=LAYOUTS,
                   help="k3: openk3's and the released K3 key layout (default); hub: Kimi Linear's (transformers)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export in --out (a directory with other files is refused)")
    p.set_defaults(func=run_export)
