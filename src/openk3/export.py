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


def run_export(args: argparse.Namespace) -> int:
    from openk3.interop import load_pretrained, save_pretrained
    from openk3.interop.files import CONFIG_NAME

    source = resolve_checkpoint(args.ckpt)
    out = Path(args.out)
    if out.resolve() == source.resolve():
        raise ValueError(f"--out {out} is the checkpoint being exported; choose another directory")
    if (out / CONFIG_NAME).exists() and not args.overwrite:
        raise ValueError(f"--out {out} already holds a checkpoint ({CONFIG_NAME}); choose another --out or pass "
                         "--overwrite to replace its files")
    model = load_pretrained(source)
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
    p.add_argument("--out", required=True, metavar="DIR", help="the new checkpoint directory")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="mxfp4: routed experts packed (their widths must be multiples of 32); default: the weights "
                        "as stored")
    p.add_argument("--layout", default="k3", choices=LAYOUTS,
                   help="k3: openk3's and the released K3 key layout (default); hub: Kimi Linear's (transformers)")
    p.add_argument("--overwrite", action="store_true", help="replace the checkpoint files already in --out")
    p.set_defaults(func=run_export)
