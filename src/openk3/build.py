"""Build the model a command runs, on its device, with the start-up phases timed: a preset's random-init model
(`build_model`: constructed on the device in its dtype, `model.on_device`) or a checkpoint (`load_model`: read
shard by shard onto the device, `interop.device_load`), the routed experts plain or kept MXFP4
(`quant.packed_experts`). Both first check that the weights fit the device (`check_fits`: one line naming the GiB
needed and free) and return a `BuildReport`, whose `line()` is what start-up prints.

    model, report = build_model(get_preset("kimi-linear-48b"), "cuda", torch.bfloat16, quantization="mxfp4")
    print(report.line())
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from openk3.config import ModelConfig
from openk3.interop.device_load import check_quantization, load_to_device, synchronize
from openk3.model import K3ForCausalLM
from openk3.model.moe import Experts
from openk3.model.on_device import construct
from openk3.quant.packed_experts import PackedExperts, expert_bytes, pack_experts_in, packed_bytes, tensor_bytes

GIB = 1 << 30


@dataclass
class BuildReport:
    device: str
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds, in the order they ran
    weights_bytes: int = 0  # resident parameters and buffers (a tied tensor once)
    experts_bytes: tuple[int, int] | None = None  # routed experts with plain weights in the model's dtype, as held

    def line(self) -> str:
        phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items())
        total = sum(self.phases.values())
        line = f"model on {self.device} in {total:.1f} s ({phases}); weights {size(self.weights_bytes)}"
        if self.experts_bytes is not None and self.experts_bytes[0] != self.experts_bytes[1]:
            line += f" (routed experts {size(self.experts_bytes[0])} -> {size(self.experts_bytes[1])}, MXFP4)"
        return line


def size(nbytes: int) -> str:
    """GiB, or MiB below a tenth of one."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB // 10 else f"{nbytes / (1 << 20):.1f} MiB"


def weight_bytes(model: nn.Module, packed_experts: bool = False) -> tuple[int, int]:
    """(all weights, routed experts) in bytes as `model` (meta or real) holds them, or with its plain `Experts`
    packed MXFP4 when packed_experts."""
    total = tensor_bytes(model)
    experts = 0
    for m in model.modules():
        if isinstance(m, Experts) and packed_experts:
            held = sum(packed_bytes(p.numel()) for p in m.parameters())
            total += held - tensor_bytes(m)
            experts += held
        elif isinstance(m, (Experts, PackedExperts)):
            experts += tensor_bytes(m)
    return total, experts


def plain_expert_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes the routed experts would take with plain weights in `dtype`."""
    values = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    values += sum(2 * t.numel() for m in model.modules() if isinstance(m, PackedExperts)
                  for t in (m.gate_up_packed, m.down_packed))
    return values * torch.empty(0, dtype=dtype).element_size()


def free_bytes(device: torch.device | str) -> int | None:
    """Memory free on `device` (CUDA: the driver's free bytes; CPU: MemAvailable), None where unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu" and Path("/proc/meminfo").is_file():
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def check_fits(need_bytes: int, device: torch.device | str, what: str = "the weights", hint: str = "") -> None:
    """ValueError, one line, when `need_bytes` exceed what `device` has free (no check where that is unknown)."""
    free = free_bytes(device)
    if free is not None and need_bytes > free:
        raise ValueError(f"{what} do not fit: they need {size(need_bytes)} and {device} has {size(free)} free{hint}")


def _check_weights(model: nn.Module, packed: bool, device: torch.device, reserve_bytes: int) -> None:
    """check_fits for `model`'s weights (meta), plus reserve_bytes; the MXFP4 size as a hint when it would help."""
    need = weight_bytes(model, packed)[0]
    hint = ""
    if not packed and any(isinstance(m, Experts) for m in model.modules()):
        hint = f" (with --quantization mxfp4: {size(weight_bytes(model, True)[0] + reserve_bytes)})"
    what = "the weights" + (f" and {size(reserve_bytes)} reserved" if reserve_bytes else "")
    check_fits(need + reserve_bytes, device, what, hint)


def _timed(phases: dict[str, float], name: str, device: torch.device, start: float) -> float:
    synchronize(device)
    now = time.perf_counter()
    phases[name] = phases.get(name, 0.0) + now - start
    return now


def build_model(cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype | None = None,
                quantization: str | None = None, method: str = "auto", check: bool = True,
                reserve_bytes: int = 0) -> tuple[K3ForCausalLM, BuildReport]:
    """The random-init model of `cfg` on `device` in `dtype` (None: fp32), in eval mode, the same weights as
    `K3ForCausalLM(cfg).to(dtype)` built on that device under the same seed; quantization "mxfp4" keeps the routed
    experts MXFP4 (each layer's packed as soon as it is built; `method`: the packed experts' kernel), None or
    "none" plain. Phases: plan (the weights' size on the meta device; when `check`, `check_fits` of that plus
    reserve_bytes, what the caller will need beside them), construct, quantize."""
    device = torch.device(device)
    check_quantization(quantization, cfg.moe is not None, cfg.name)
    packed = quantization == "mxfp4"
    report = BuildReport(str(device))
    start = time.perf_counter()
    with torch.device("meta"):
        meta = K3ForCausalLM(cfg).to(dtype or torch.float32)
    if check:
        _check_weights(meta, packed, device, reserve_bytes)
    start = _timed(report.phases, "plan", device, start)
    quantize_seconds = []

    def pack(module: nn.Module) -> None:
        synchronize(device)
        begin = time.perf_counter()
        pack_experts_in(module, method)
        synchronize(device)
        quantize_seconds.append(time.perf_counter() - begin)

    model = construct(cfg, device, dtype, finish=pack if packed else None).eval()
    _timed(report.phases, "construct", device, start)
    if packed:
        report.phases["construct"] -= sum(quantize_seconds)
        report.phases["quantize"] = sum(quantize_seconds)
    return model, _measured(report, model, dtype or torch.float32)


def load_model(path: str | Path, device: torch.device | str, dtype: torch.dtype | None = None,
               quantization: str | None = None, method: str = "auto", check: bool = True,
               reserve_bytes: int = 0) -> tuple[K3ForCausalLM, BuildReport]:
    """A checkpoint directory's model on `device`, in eval mode: `load_pretrained(path, dtype)` moved there, read
    shard by shard without a host copy; quantization None keeps MXFP4-stored experts packed (automatic for an MXFP4
    checkpoint), "none" dequantizes them, "mxfp4" packs plain ones. Phases: plan (config and headers checked;
    `check_fits` as in build_model), read, quantize."""
    device = torch.device(device)

    def fits(plan, packed: bool) -> None:
        if check:
            _check_weights(plan.model, packed, device, reserve_bytes)

    model, phases = load_to_device(path, device, dtype, quantization, method, before_read=fits)
    return model, _measured(BuildReport(str(device), phases), model, model.model.embed_tokens.weight.dtype)


def _measured(report: BuildReport, model: nn.Module, dtype: torch.dtype) -> BuildReport:
    report.weights_bytes = tensor_bytes(model)
    if any(isinstance(m, (Experts, PackedExperts)) for m in model.modules()):
        report.experts_bytes = (plain_expert_bytes(model, dtype), expert_bytes(model))
    return report
