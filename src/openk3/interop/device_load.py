"""Load a checkpoint directory straight onto a device: the start-up path of a large model on a GPU.

The model is planned on the meta device (`checkpoint.plan_checkpoint`: config, shard headers, every tensor's name
and shape checked before any weight is read). Then the shards are read one at a time, each opened with
safetensors' `device=` (memory-mapped; each tensor copied to the device as it is read), and every openk3 tensor is
assembled on the device as soon as its file tensors are in, cast to its dtype and put in the model. The host never
holds the weights; the device holds the model plus the file tensors of the tensors still waiting on a later shard
(an expert split over two shards). The result is `load_pretrained(path, dtype)` moved to `device`, tensor for
tensor (tests/test_device_load.py), except that routed experts can be kept MXFP4 (`quant.packed_experts`):

  quantization None     as stored: MXFP4 experts stay packed (their bytes copied as they are), others plain
  quantization "none"   plain experts (MXFP4 ones dequantized, as load_pretrained does)
  quantization "mxfp4"  packed experts (plain stored ones quantized as soon as each experts module is loaded)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from openk3.interop.checkpoint import CheckpointPlan, checkpoint_path, finish_loading, plan_checkpoint
from openk3.interop.files import weight_map
from openk3.model import K3ForCausalLM
from openk3.model.moe import Experts
from openk3.quant.mx import unpack_mxfp4
from openk3.quant.packed_experts import PackedExperts, no_experts, pack_experts_in

QUANTIZATIONS = ("none", "mxfp4")
_PAIR = ("_packed", "_scale")  # an MXFP4 weight's file tensors: name + suffix (interop.quantization)


def check_quantization(quantization: str | None, has_experts: bool, model_name: str) -> None:
    """ValueError naming the argument (and its flag) when its value is not one of QUANTIZATIONS or when MXFP4 has
    no experts."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization (--quantization) must be one of {', '.join(QUANTIZATIONS)} (or unset: as "
                         f"stored), got {quantization!r}")
    if quantization == "mxfp4" and not has_experts:
        raise no_experts(model_name)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (phase timings of CUDA work)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _assign(model: nn.Module, key: str, tensor: torch.Tensor) -> None:
    """Put `tensor` in the model as the parameter or buffer `key` (replacing its meta placeholder)."""
    prefix, _, name = key.rpartition(".")
    module = model.get_submodule(prefix)
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(tensor, requires_grad=module._parameters[name].requires_grad)
    else:
        module._buffers[name] = tensor


class _Assembler:
    """Collects the file tensors of each openk3 tensor as the shards are read, and finishes each openk3 tensor (or
    experts module) once all of its parts are in."""

    def __init__(self, p: CheckpointPlan, stored: set[str], device: torch.device, keep_packed: bool,
                 quantize: bool, method: str):
        self.p, self.device = p, device
        self.keep_packed, self.quantize, self.method = keep_packed, quantize, method
        self.targets = {k: t.dtype for k, t in p.model.state_dict().items()}
        self.slots: dict[str, tuple[str, int, str | None]] = {}  # file name -> (openk3 key, part index, half)
        for key, entry in p.plan.items():
            for i, file_key in enumerate(entry.keys):
                name = p.names[file_key]
                if name in stored:
                    self.slots[name] = (key, i, None)
                else:  # an MXFP4 pair that reads as `name` (checked by plan_checkpoint)
                    self.slots.update({name + suffix: (key, i, suffix) for suffix in _PAIR})
        self.parts: dict[str, list] = {}
        self.packed: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}  # experts module -> leaf -> pair
        self.quantize_seconds = 0.0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        key, i, half = self.slots[name]
        parts = self.parts.setdefault(key, [None] * len(self.p.plan[key].keys))
        if half is None:
            parts[i] = tensor
        else:
            parts[i] = {**(parts[i] or {}), half: tensor}
        if all(part is not None and (not isinstance(part, dict) or len(part) == 2) for part in parts):
            self._finish(key, self.parts.pop(key))

    def _finish(self, key: str, parts: list) -> None:
        join = self.p.plan[key].join
        if isinstance(parts[0], dict) and self.keep_packed:
            module, _, leaf = key.rpartition(".")
            pair = tuple(join([part[suffix] for part in parts]) for suffix in _PAIR)
            self.packed.setdefault(module, {})[leaf] = pair
            if len(self.packed[module]) == 2:
                self._set_packed(module, self.packed.pop(module))
            return
        if isinstance(parts[0], dict):
            parts = [self._dequantize(part) for part in parts]
        _assign(self.p.model, key, join(parts).to(self.targets[key]))
        module_name = key.rpartition(".")[0]
        module = self.p.model.get_submodule(module_name)
        if self.quantize and isinstance(module, Experts) and not any(t.is_meta for t in module.parameters()):
            synchronize(self.device)
            start = time.perf_counter()
            pack_experts_in(self.p.model.get_submodule(module_name.rpartition(".")[0]), self.method)
            synchronize(self.device)
            self.quantize_seconds += time.perf_counter() - start

    def _dequantize(self, pair: dict[str, torch.Tensor]) -> torch.Tensor:
        try:
            return unpack_mxfp4(pair["_packed"], pair["_scale"], torch.bfloat16)
        except ValueError as e:
            raise ValueError(f"an MXFP4 expert weight: {e}") from None

    def _set_packed(self, module_name: str, leaves: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        parent, _, child = module_name.rpartition(".")
        experts = self.p.model.get_submodule(module_name)
        packed = PackedExperts(leaves["gate_up_proj"], leaves["down_proj"], experts.act, self.method)
        setattr(self.p.model.get_submodule(parent), child, packed)


def load_to_device(path: str | Path, device: torch.device | str, dtype: torch.dtype | None = None,
                   quantization: str | None = None, method: str = "auto",
                   before_read: Callable[[CheckpointPlan, bool], None] | None = None,
                   ) -> tuple[K3ForCausalLM, dict[str, float]]:
    """(model in eval mode on `device`, seconds per phase: plan, read and, when plain experts are packed,
    quantize). `dtype` as in load_pretrained; `quantization` in the module docstring; `method` the packed experts'
    kernel (`ops.triton_mxfp4.METHODS`). before_read(plan, packed) runs once the checkpoint is checked and before
    any weight is read (packed: whether the experts will be kept MXFP4), e.g. to check that the weights fit."""
    device = torch.device(device)
    start = time.perf_counter()
    path = checkpoint_path(path)  # a training run directory: its latest checkpoint, as load_pretrained reads
    p = plan_checkpoint(path, dtype)
    check_quantization(quantization, p.cfg.moe is not None, p.cfg.name)
    keep_packed = p.mxfp4 and quantization != "none"
    quantize = quantization == "mxfp4" and not p.mxfp4
    if before_read is not None:
        before_read(p, keep_packed or quantize)
    phases = {"plan": time.perf_counter() - start}
    start = time.perf_counter()
    files = weight_map(path)
    assembler = _Assembler(p, set(files), device, keep_packed, quantize, method)
    for file in sorted(set(files.values())):
        with safe_open(file, "pt", device=str(device)) as shard:
            for name in shard.keys():
                if name in assembler.slots:  # else an inert tensor the plan leaves out (layouts.canonical_names)
                    assembler.add(name, shard.get_tensor(name))
    synchronize(device)
    phases["read"] = time.perf_counter() - start - assembler.quantize_seconds
    if quantize:
        phases["quantize"] = assembler.quantize_seconds
    return finish_loading(p.model), phases
