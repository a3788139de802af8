"""Checkpoint interop: Kimi Linear hub checkpoints (HF transformers' layout), the released K3 key layout, and
openk3's own checkpoints (K3 layout). See layouts.py for the key mapping and configs.py for config.json."""

from openk3.interop.checkpoint import config_from_json, detect_layout, load_pretrained, save_pretrained
from openk3.interop.configs import config_from_hub, config_from_k3, config_to_hub, config_to_k3

__all__ = ["load_pretrained", "save_pretrained", "config_from_json", "detect_layout", "config_from_hub",
           "config_from_k3", "config_to_hub", "config_to_k3"]
