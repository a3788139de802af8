"""Test-session set-up shared by every test module."""

import os

import torch

# Triton's interpreter must be chosen before triton is first imported: without a GPU, the Triton kernels run on
# CPU tensors under TRITON_INTERPRET=1 (tests/test_kda_triton.py). On a CUDA machine they compile for the GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
