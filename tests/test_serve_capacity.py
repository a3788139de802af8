"""Serving capacity (issue 41): the latent pool sized from device memory (openk3.serve.capacity's arithmetic, on
made-up devices), the flags that bound it (--gpu-memory-utilization, --max-model-len, --max-num-seqs) refused
early with one line, and a real `openk3 serve` process that states its capacity, refuses a prompt over
--max-model-len with a 413 naming the flag, and serves with its experts kept MXFP4 (--quantization mxfp4) the
same greedy text as the MXFP4 checkpoint dequantized."""

import subprocess
import sys

import httpx
import pytest

from openk3.serve.capacity import (
    CACHE_SHARE,
    CPU_CACHE_BYTES,
    CPU_POOL_TOKENS,
    GRAPH_RESERVE_BYTES,
    Capacity,
    fixed_capacity,
    gpu_capacity,
    pages_for,
)
from serve_process import o1_checkpoint, serve_process

GiB = 1 << 30
PAGE = dict(page_bytes=3 << 20, page_size=768)  # k3-debug's page: 3 MLA layers x 768 tokens x 320 x bf16


def test_gpu_pool_takes_what_the_utilization_leaves():
    total, free, reserved, peak = 140 * GiB, 120 * GiB, 10 * GiB, 6 * GiB
    cap = gpu_capacity(total=total, free=free, reserved=reserved, peak_allocated=peak, utilization=0.9,
                       max_model_len=65536, cache_bytes=None, prefix_cache=True, **PAGE)
    budget = int(0.9 * total) - (total - free - reserved) - peak - GRAPH_RESERVE_BYTES
    assert cap.budget_bytes == budget and cap.cache_bytes == int(budget * CACHE_SHARE)
    assert cap.pages == 1 + (budget - cap.cache_bytes) // PAGE["page_bytes"]
    assert cap.tokens == (cap.pages - 1) * 768 > 64 * 16384  # the 64 sequences of 16k tokens fit
    # without the prefix cache the pool takes the whole budget; an explicit cache tier is taken as given
    off = gpu_capacity(total=total, free=free, reserved=reserved, peak_allocated=peak, utilization=0.9,
                       max_model_len=65536, cache_bytes=None, prefix_cache=False, **PAGE)
    assert off.cache_bytes == 0 and off.pages == 1 + budget // PAGE["page_bytes"]
    given = gpu_capacity(total=total, free=free, reserved=reserved, peak_allocated=peak, utilization=0.5,
                         max_model_len=65536, cache_bytes=GiB, prefix_cache=True, **PAGE)
    assert given.cache_bytes == GiB and given.pages < cap.pages


def test_gpu_pool_too_small_for_one_sequence_names_both_flags():
    need = pages_for((1 << 20) + 1, 768) * PAGE["page_bytes"] / GiB
    with pytest.raises(ValueError, match=rf"--gpu-memory-utilization 0.1 leaves .* GiB .* one sequence of "
                                         rf"--max-model-len 1048576 needs {need:.2f} GiB"):
        gpu_capacity(total=80 * GiB, free=70 * GiB, reserved=8 * GiB, peak_allocated=6 * GiB, utilization=0.1,
                     max_model_len=1 << 20, cache_bytes=None, prefix_cache=False, **PAGE)
    # weights and activations past the utilization's share: nothing is left, and the message says so plainly
    with pytest.raises(ValueError, match=r"leaves 0.00 GiB .* 72.00 GiB weights and activations, .* 0.00 GiB prefix "
                                         r"cache\)"):
        gpu_capacity(total=80 * GiB, free=8 * GiB, reserved=72 * GiB, peak_allocated=72 * GiB, utilization=0.9,
                     max_model_len=65536, cache_bytes=None, prefix_cache=True, **PAGE)
    for bad in (0, -0.5, 1.01):
        with pytest.raises(ValueError, match="--gpu-memory-utilization must be in"):
            gpu_capacity(total=80 * GiB, free=70 * GiB, reserved=0, peak_allocated=0, utilization=bad,
                         max_model_len=4096, cache_bytes=None, prefix_cache=False, **PAGE)


def test_fixed_pool_on_a_cpu():
    cap = fixed_capacity(kv_pages=None, max_model_len=4096, max_num_seqs=8, cache_bytes=None, prefix_cache=True,
                         page_bytes=1 << 16, page_size=192)
    assert cap == Capacity(pages=1 + 8 + pages_for(CPU_POOL_TOKENS, 192) + CPU_CACHE_BYTES // (1 << 16),
                           page_size=192, cache_bytes=CPU_CACHE_BYTES)
    assert fixed_capacity(kv_pages=30, max_model_len=4096, max_num_seqs=8, cache_bytes=0, prefix_cache=True,
                          page_bytes=1, page_size=192).pages == 30
    with pytest.raises(ValueError, match="--kv-pages 20 holds 3648 tokens; one sequence of --max-model-len 4096"):
        fixed_capacity(kv_pages=20, max_model_len=4096, max_num_seqs=8, cache_bytes=None, prefix_cache=False,
                       page_bytes=1, page_size=192)


@pytest.mark.parametrize("flag,value,message", [
    ("--gpu-memory-utilization", "1.5", "must be in (0, 1], got 1.5"),
    ("--gpu-memory-utilization", "most", "must be a number in (0, 1]"),
    ("--max-model-len", "1", "must be at least 2"),
    ("--max-num-seqs", "0", "must be at least 1"),
    ("--quantization", "int3", "invalid choice"),
])
def test_bad_capacity_flags_fail_in_one_line(flag, value, message):
    run = subprocess.run([sys.executable, "-m", "openk3", "serve", flag, value], capture_output=True, text=True,
                         timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and flag in lines[0] and message in lines[0], run.stderr


def test_served_capacity_max_model_len_and_mxfp4_experts(tmp_path):
    """A k3-tiny checkpoint served with its experts packed MXFP4 gives the greedy text of its MXFP4 export served
    dequantized; the ready line states dtype, graphs and capacity; a prompt of --max-model-len tokens is a 413."""
    ckpt = o1_checkpoint(tmp_path / "plain")
    export = subprocess.run([sys.executable, "-m", "openk3", "export", "--ckpt", ckpt, "--out",
                             str(tmp_path / "mxfp4"), "--quantization", "mxfp4"], capture_output=True, text=True,
                            timeout=300)
    assert export.returncode == 0, export.stderr
    body = {"model": "m", "prompt": list(range(3, 40)), "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    texts = []
    for args in (("--ckpt", ckpt, "--quantization", "mxfp4", "--max-model-len", "600", "--max-num-seqs", "3"),
                 ("--ckpt", str(tmp_path / "mxfp4"), "--quantization", "none")):
        with serve_process(*args, "--model-name", "m") as (url, ready):
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            texts.append(reply.json()["choices"][0]["text"])
            if "--max-model-len" in args:
                assert "float32, eager decode; capacity " in ready and "3 sequences, 600 tokens a sequence" in ready
                long = httpx.post(f"{url}/v1/completions", json={**body, "prompt": [5] * 600}, timeout=60)
                assert long.status_code == 413 and "--max-model-len" in long.json()["error"]["message"]
    assert texts[0] == texts[1] and texts[0]
