"""Checkpoints whose routed experts are MXFP4-packed: compressed-tensors' `mxfp4-pack-quantized` (SPEC §13).

On disk, each routed expert's `...experts.{j}.w{1,2,3}.weight` [out, in] is replaced by the pair
  `...w1.weight_packed` uint8 [out, in / 2]   two E2M1 codes per byte, the even input in the low nibble
  `...w1.weight_scale`  uint8 [out, in / 32]  one E8M0 exponent per 32 inputs
(openk3.quant.mx has the bits), and config.json declares it in `quantization_config`: `format`
"mxfp4-pack-quantized" (at the top of the section and/or in each of its `config_groups`), weights of 4 bits in
groups of 32, and an `ignore` list naming the modules left unquantized. Public K3 tooling puts that section at
the top level of config.json or inside `text_config`; both are read, and it is written at the top level (where
transformers and compressed-tensors look). Only the routed experts are ever packed; everything else stays as is.

Loading dequantizes the experts (to bf16, which holds every MXFP4 value exactly; load_pretrained then casts them
to the model's dtype). A `quantization_config` that names any other format, or MXFP4 with other parameters, is an
error naming it.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from openk3.interop.files import TensorReader
from openk3.quant.mx import BLOCK, pack_mxfp4, unpack_mxfp4

MXFP4_FORMAT = "mxfp4-pack-quantized"
QUANTIZATIONS = ("mxfp4",)  # save_pretrained(..., quantization=...)
_EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
_WEIGHT_ARGS = {"num_bits": 4, "type": "float", "group_size": BLOCK, "symmetric": True, "strategy": "group"}


def _section(config: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    for where, d in (("quantization_config", config), ("text_config.quantization_config",
                                                       config.get("text_config") or {})):
        if d.get("quantization_config"):
            return where, d["quantization_config"]
    return "quantization_config", None


def read_quantization(config: dict[str, Any]) -> str | None:
    """A checkpoint's config.json -> "mxfp4" when it declares MXFP4-packed weights, None when it declares none;
    ValueError naming the field for a format or parameter openk3 does not read."""
    where, q = _section(config)
    if q is None:
        return None
    groups = q.get("config_groups") or {}
    formats = {f"{where}.format": q.get("format")}
    formats.update({f"{where}.config_groups.{name}.format": g.get("format") for name, g in groups.items()})
    formats = {field: value for field, value in formats.items() if value is not None}
    if not formats:
        raise ValueError(f"{where} names no format (quant_method {q.get('quant_method')!r}); openk3 reads "
                         f"{MXFP4_FORMAT!r} (compressed-tensors)")
    for field, value in formats.items():
        if value != MXFP4_FORMAT:
            raise ValueError(f"{field} is {value!r}, a format openk3 does not support; it reads {MXFP4_FORMAT!r} "
                             "(compressed-tensors MXFP4 routed experts)")
    for name, group in groups.items():
        for arg, want in _WEIGHT_ARGS.items():
            got = (group.get("weights") or {}).get(arg, want)
            if got != want:
                raise ValueError(f"{where}.config_groups.{name}.weights.{arg} is {got!r}; {MXFP4_FORMAT} "
                                 f"needs {want!r}")
    return "mxfp4"


def is_expert_weight(name: str) -> bool:
    return _EXPERT_WEIGHT.search(name) is not None


def pack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """File tensors with every routed expert weight replaced by its MXFP4 pair (others unchanged)."""
    experts = [k for k in tensors if is_expert_weight(k)]
    for key in experts:
        width = tensors[key].shape[-1]
        if width % BLOCK:
            raise ValueError(f"MXFP4 groups {BLOCK} inputs: {key} has {width} (the experts' input widths, "
                             f"moe.latent_dim or hidden_size for w1 / w3 and moe.expert_hidden for w2, must be "
                             f"multiples of {BLOCK})")
    out = {k: t for k, t in tensors.items() if not is_expert_weight(k)}
    for key in experts:
        out[key + "_packed"], out[key + "_scale"] = pack_mxfp4(tensors[key])
    return out


def quantization_config(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The `quantization_config` of a checkpoint whose file tensors (after pack_experts) are `tensors`: MXFP4
    weights for Linear modules, with every matrix that is not a routed expert (the embedding aside, which is not a
    Linear) in `ignore`."""
    ignore = sorted(k.removesuffix(".weight") for k, t in tensors.items()
                    if k.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in k)
    weights = {**_WEIGHT_ARGS, "dynamic": False, "scale_dtype": "torch.uint8"}
    return {
        "quant_method": "compressed-tensors",
        "format": MXFP4_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "format": MXFP4_FORMAT, "weights": weights,
                                      "input_activations": None, "output_activations": None}},
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


class PackedExpertsReader:
    """A TensorReader's view in which each routed expert's MXFP4 pair reads as the dequantized `X.weight` (bf16).
    A pair with a half missing stays as stored (listed as unexpected by the tensor check, its weight as missing);
    a scale whose shape does not fit its packed tensor is an error naming both."""

    def __init__(self, reader: TensorReader):
        self._reader = reader
        self._pairs: dict[str, tuple[str, str]] = {}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        stored = self._reader.shapes()
        out = dict(stored)
        for packed in stored:
            weight = packed.removesuffix("_packed")
            scale = weight + "_scale"
            if packed == weight or not is_expert_weight(weight) or scale not in stored or weight in stored:
                continue
            shape, scale_shape = tuple(stored[packed]), tuple(stored[scale])
            width = 2 * shape[-1] if len(shape) == 2 else 0
            if not width or width % BLOCK or scale_shape != (shape[0], width // BLOCK):
                raise ValueError(f"MXFP4 pair {packed} {list(shape)} and {scale} {list(scale_shape)}: expected "
                                 f"[out, in / 2] and [out, in / {BLOCK}] with in a positive multiple of {BLOCK}")
            del out[packed], out[scale]
            out[weight] = (shape[0], width)
            self._pairs[weight] = (packed, scale)
        return out

    def get(self, key: str) -> torch.Tensor:
        if key not in self._pairs:
            return self._reader.get(key)
        packed, scale = self._pairs[key]
        try:
            return unpack_mxfp4(self._reader.get(packed), self._reader.get(scale), torch.bfloat16)
        except ValueError as e:
            raise ValueError(f"{packed} / {scale}: {e}") from None
