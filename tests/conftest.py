"""Test-session set-up shared by every test module."""

import os

import pytest
import torch

# Triton's interpreter must be chosen before triton is first imported: without a GPU, the Triton kernels run on
# CPU tensors under TRITON_INTERPRET=1 (tests/test_kda_triton.py). On a CUDA machine they compile for the GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


POISON_SEED = 666  # sampled requests with this seed fail inside the engine (`poisoned_sampling`)


@pytest.fixture
def poisoned_sampling(monkeypatch):
    """The engine's sampling raises for any batch that holds a sampled request seeded POISON_SEED (greedy batches
    never reach it); the engine then samples row by row, so that only that request fails."""
    from openk3.sampling import sample_tokens
    from openk3.serve import engine as engine_module

    def poisoned(logits, params, generators, previous=None):
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("injected sampling failure")
        return sample_tokens(logits, params, generators, previous)

    monkeypatch.setattr(engine_module, "sample_tokens", poisoned)
    return POISON_SEED


@pytest.fixture(scope="module")
def o1_checkpoint_dir(tmp_path_factory) -> str:
    """A k3-tiny checkpoint with O(1)-scale random weights, per test module (tests/serve_process.py)."""
    from serve_process import o1_checkpoint

    return o1_checkpoint(tmp_path_factory.mktemp("o1-k3-tiny"))


@pytest.fixture(scope="module")
def o1_server(o1_checkpoint_dir):
    """A real `openk3 serve` process over `o1_checkpoint_dir` per test module, model name "k3-tiny"; yields its
    base URL."""
    from serve_process import serve_process

    with serve_process("--ckpt", o1_checkpoint_dir, "--model-name", "k3-tiny") as (url, _):
        yield url


@pytest.fixture
def client(server):
    """The official `openai` client on the module's `server` fixture (a base URL)."""
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
