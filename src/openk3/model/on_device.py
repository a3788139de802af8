"""Build a model directly on its device and in its dtype: start-up of a large model (kimi-linear-48b: 49.1B
parameters, 98 GB in bf16) without an fp32 copy anywhere and without the host holding the weights.

`construct(cfg, device, dtype)` runs the model's own constructor with `device` as the default device, so every
tensor is created and initialised there, by the same code and in the same order of random draws as an eager
build: with the same seed on the same device it gives the same weights as `K3ForCausalLM(cfg).to(dtype)` (on
another device the generator differs, so the weights do too; their distribution does not). The cast to `dtype`
goes as construction does: a module's constructor is done when the module is registered in its parent, and from
then on its children are final (a parent may still set its own children's tensors, as K3ForCausalLM initialises
lm_head after registering it, but not its grandchildren's), so they are cast then and handed to `finish` (which
may replace parts of them: `openk3.quant.packed_experts.pack_experts_in`). Peak memory: the model in `dtype` plus
about one decoder layer in the constructor's fp32.

Building on the meta device first and initialising tensors in place afterwards would need every module's
initialisation written a second time (or its random draws replayed); this keeps the constructors the one source.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from openk3.config import ModelConfig
from openk3.model.transformer import K3ForCausalLM


def construct(cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype | None = None,
              finish: Callable[[nn.Module], object] | None = None) -> K3ForCausalLM:
    """K3ForCausalLM(cfg) built on `device`, cast to `dtype` (None: as built, fp32 but the KeepFp32 tensors'
    dtypes kept either way) and passed through `finish` module by module as construction completes them."""

    def complete(module: nn.Module) -> None:
        if dtype is not None:
            module.to(dtype)
        if finish is not None:
            finish(module)

    def registered(parent: nn.Module, name: str, module: nn.Module) -> None:
        for child in module.children():  # `module`'s constructor has returned: its children are final
            complete(child)

    # a global hook for the constructor's duration: modules another thread registers meanwhile would be cast too
    handle = nn.modules.module.register_module_module_registration_hook(registered)
    try:
        with torch.device(device):
            model = K3ForCausalLM(cfg)
    finally:
        handle.remove()
    complete(model)
    return model
