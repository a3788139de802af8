"""The serving engine on a GPU (skipped without one): its default overlapped decode (each step queued, sampling
included, before the host reads the previous step's tokens; openk3.serve.engine `Engine._decode`) replays CUDA
graphs fed from the device and gives the synchronous engine's greedy and seeded replies; the prefix cache's KDA
checkpoints come out of memory reserved at start-up, not from cudaMalloc calls during prefills."""

import pytest
import torch

from openk3.model import K3ForCausalLM
from openk3.sampling import SamplingParams
from openk3.serve.engine import Engine, EngineConfig
from openk3.serve.scheduler import SchedulerConfig
from openk3.tokenizer import ByteTokenizer
from test_model_decode import CONFIGS, randomize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU engine needs a CUDA device")


def replies(model, overlap: bool = True, words: int = 5, **config) -> list[list[int]]:
    """Six staggered requests of `words` x i words (i = 0..5); EngineConfig fields in `config`."""
    config = dict(compile_decode=False, prefill_graphs=False) | config
    engine = Engine(model, ByteTokenizer(), EngineConfig(
        overlap=overlap, kv_pages=64, cache_bytes=8 << 20, scheduler=SchedulerConfig(max_running=8), **config))
    assert engine.overlap is overlap and engine.runner.graphs  # decode replays its graphs
    tok, made = ByteTokenizer(), []
    for i in range(6):  # staggered: steps mix new rows (ids from the host) with carried ones (from the device)
        params = SamplingParams(max_tokens=20 + 3 * i, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
        made.append(engine.add_request(tok.encode(f"request {i}: " + "words " * (words * i)), params))
        engine.step()
        engine.step()
    while engine.has_work():
        engine.step()
    assert all(r.finish_reason == "length" and len(r.output) == r.params.max_tokens for r in made)
    return [r.output for r in made]


@torch.no_grad()
def test_overlapped_decode_on_the_gpu_gives_the_synchronous_replies():
    torch.manual_seed(0)
    model = randomize(K3ForCausalLM(CONFIGS["k3-tiny"]()), seed=5).to("cuda", torch.bfloat16).eval()
    assert replies(model, overlap=True) == replies(model, overlap=False)



@torch.no_grad()
def test_prefill_checkpoints_take_no_new_device_memory():
    """A prompt checkpointed at many offsets (every hash block here) allocates its checkpoints from the segment the
    engine reserved for the prefix cache's device tier: no cudaMalloc during the prefill."""
    torch.manual_seed(0)
    model = randomize(K3ForCausalLM(CONFIGS["k3-tiny"]()), seed=5).to("cuda", torch.bfloat16).eval()
    engine = Engine(model, ByteTokenizer(), EngineConfig(compile_decode=False, kv_pages=64, cache_bytes=64 << 20,
                                                         checkpoint_every=1, hash_block=16))
    prompt = list(range(1, 400))
    first = engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_work():  # the same shapes as the second request's: what they allocate is cached after this
        engine.step()
    mallocs = torch.cuda.memory_stats()["num_device_alloc"]
    second = engine.add_request(prompt[::-1], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_work():
        engine.step()
    assert first.finish_reason == second.finish_reason == "length"
    assert engine.prefix_cache.stats.inserted_blocks >= 2 * (len(prompt) // 16)  # both prompts' blocks checkpointed
    assert torch.cuda.memory_stats()["num_device_alloc"] == mallocs
