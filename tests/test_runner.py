"""The model runner over the engine's pools: prefill chunks and static-shape decode steps (PyTorch ops, and the
GPU path's Triton kernels under TRITON_INTERPRET=1) give the logits of one full forward; the decode step touches
only the slots and pages it addresses."""

import ast
import copy
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from openk3.cache.paged import BlockTables, PagePool
from openk3.cache.state_pool import StatePool
from openk3.model import K3ForCausalLM
from openk3.model.common import FusableLinears, fuse_inference_projections
from openk3.model.decode import kda_input_projections
from openk3.model.kda import KimiDeltaAttention
from openk3.ops import fused
from openk3.ops import moe as moe_ops
from openk3.ops.activations import swiglu
from openk3.ops.transfer import to_device
from openk3.serve.runner import ModelRunner, graph_buckets
from test_model_decode import CONFIGS, randomize


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is faster and leaves the shared cores alone
    yield
    torch.set_num_threads(threads)


def make_runner(model, kernels, page_size=5, slots=4, pages=40, compile_backend=None, prefill_compile_backend=None,
                short_prefill=0, short_prefill_rows=0, cuda_graphs=False, piecewise_tokens=0):
    cfg = model.config
    p = model.model.embed_tokens.weight
    pool = PagePool(len(cfg.mla_layers), pages, page_size, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim,
                    dtype=p.dtype, device=p.device)
    tables = BlockTables(slots, -(-cfg.max_seq_len // page_size), device=p.device)
    states = StatePool(cfg, slots, dtype=p.dtype, device=p.device)
    return ModelRunner(model, pool, tables, states, max_batch=slots, kernels=kernels, compile_backend=compile_backend,
                       prefill_compile_backend=prefill_compile_backend, short_prefill=short_prefill,
                       short_prefill_rows=short_prefill_rows, cuda_graphs=cuda_graphs,
                       piecewise_tokens=piecewise_tokens)


def give_pages(runner, slot, tokens, rng):
    """Pages for `tokens` positions, taken from the pool in a shuffled order (tables need not be ascending)."""
    free = []
    while len(free) < -(-tokens // runner.pages.page_size):
        free.append(runner.pages.alloc())
    order = torch.randperm(len(free), generator=rng).tolist()
    runner.tables.set(slot, [free[i] for i in order])


@pytest.mark.parametrize("kernels", ["torch", "torch-fused", "triton"])  # the runner fuses for the Triton kernels
@pytest.mark.parametrize("name", ["k3-small-mla-first", "kimi-tiny"])
def test_prefill_chunks_then_decode_steps_equal_one_forward(name, kernels):
    torch.manual_seed(0)
    model = randomize(K3ForCausalLM(CONFIGS[name]()), seed=1)
    if kernels == "torch-fused":
        fuse_inference_projections(model)
    runner = make_runner(model, kernels.removesuffix("-fused"))
    rng = torch.Generator().manual_seed(2)
    V = model.config.vocab_size
    lengths, steps = [7, 12, 1], 4  # prompts of different lengths, in slots 2, 0, 3
    slots = [2, 0, 3]
    ids = [torch.randint(0, V, (n + steps,), generator=rng).tolist() for n in lengths]
    for slot, n in zip(slots, lengths):
        give_pages(runner, slot, n + steps, rng)
    logits = {}
    with torch.no_grad():
        # first chunks of 5 tokens for the two longer prompts (with a KDA checkpoint request), then the rest one
        # sequence at a time
        out, ckpts = runner.prefill([ids[0][:5], ids[1][:5]], slots[:2], [0, 0], checkpoint_offsets=(2, 5))
        assert sorted(ckpts) == [2, 5] and ckpts[5]["recurrent"].shape[:2] == (len(model.config.kda_layers), 2)
        torch.testing.assert_close(ckpts[5]["recurrent"], runner.states.recurrent[:, slots[:2]])
        for b, n in enumerate(lengths):
            start = 5 if b < 2 else 0
            out, _ = runner.prefill([ids[b][start:n]], [slots[b]], [start])
            logits[b] = [out[0]]
        for t in range(steps - 1):
            out = runner.decode([ids[b][n + t] for b, n in enumerate(lengths)], slots,
                                [n + t for n in lengths])
            for b in range(len(lengths)):
                logits[b].append(out[b])
        for b, n in enumerate(lengths):
            full = model(torch.tensor([ids[b][: n + steps - 1]])).logits[0, n - 1:]
            torch.testing.assert_close(torch.stack(logits[b]), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["k3-small-mla-first", "kimi-tiny"])
def test_right_padded_prefill_of_different_lengths_equals_each_chunk_alone(name):
    """Chunks of 9, 2, 14 and 1 tokens (two continuing a prompt) in one right-padded forward give each chunk's
    logits, KDA conv windows and recurrent states and MLA latents of the chunk prefilled alone, and, at the union
    of checkpoint offsets, each row's checkpoints within its chunk those of the chunk alone; the padding writes
    only the null page (K3's bounded gates and Kimi's unbounded ones)."""
    torch.manual_seed(0)
    model = randomize(K3ForCausalLM(CONFIGS[name]()), seed=21)
    runner = make_runner(model, "torch", slots=5, pages=60)
    rng = torch.Generator().manual_seed(22)
    slots, starts, lengths = [3, 0, 4, 1], [0, 6, 3, 0], [9, 2, 14, 1]
    offsets = (1, 5, 8, 13)  # their union: within some chunks, past others' ends
    ids = [torch.randint(0, model.config.vocab_size, (s + n,), generator=rng).tolist()
           for s, n in zip(starts, lengths)]
    for slot, s, n in zip(slots, starts, lengths):
        give_pages(runner, slot, s + n, rng)
    pools = (runner.states.conv, runner.states.recurrent, runner.pages.pages)
    with torch.no_grad():
        for b, s in enumerate(starts):  # the prompts' earlier parts, one by one
            if s:
                runner.prefill([ids[b][:s]], [slots[b]], [0])
        before = [t.clone() for t in pools]
        alone, alone_ckpts = [], []
        for b, s in enumerate(starts):
            inside = tuple(o for o in offsets if o < lengths[b])
            logits, ckpt = runner.prefill([ids[b][s:]], [slots[b]], [s], checkpoint_offsets=inside)
            alone.append(logits[0])
            alone_ckpts.append(ckpt)
        want = [t.clone() for t in pools]
        for t, b in zip(pools, before):
            t.copy_(b)
        got, ckpts = runner.prefill([x[s:] for x, s in zip(ids, starts)], slots, starts, checkpoint_offsets=offsets)
    assert sorted(ckpts) == list(offsets)
    for b, ckpt in enumerate(alone_ckpts):
        assert sorted(ckpt) == [o for o in offsets if o < lengths[b]]
        for o, states in ckpt.items():
            for name, t in states.items():
                torch.testing.assert_close(ckpts[o][name][:, b], t[:, 0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, torch.stack(alone), rtol=1e-4, atol=1e-4)
    for t, w in zip(pools[:2], want[:2]):
        torch.testing.assert_close(t, w, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(runner.pages.pages[:, 1:], want[2][:, 1:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernels,compile_backend,rows", [("torch", None, 0), ("triton", None, 0),
                                                          ("torch", "eager", 0), ("torch", "eager", 2)])
def test_short_prefills_of_any_lengths_equal_the_models_prefill(kernels, compile_backend, rows):
    """Chunks of 3, 8 and 1 tokens (one continuing a prompt) in one short-prefill step give each chunk's logits, KDA
    states and latents of the model's own prefill of that chunk (compiled: bucket 4, a padding row; at most 2 rows a
    step: a step of 2 rows, then one of 1)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = randomize(K3ForCausalLM(CONFIGS["k3-small-mla-first"]()), seed=11)
    runner = make_runner(model, kernels, compile_backend=compile_backend, short_prefill=8, short_prefill_rows=rows)
    rng = torch.Generator().manual_seed(12)
    slots, starts, lengths = [2, 0, 3], [0, 5, 0], [3, 8, 1]
    ids = [torch.randint(0, model.config.vocab_size, (s + n,), generator=rng).tolist() for s, n in
           zip(starts, lengths)]
    for slot, s, n in zip(slots, starts, lengths):
        give_pages(runner, slot, s + n + 8, rng)
    with torch.no_grad():
        runner.prefill([ids[1][:5]], [0], [0])
        before = runner.states.conv.clone(), runner.states.recurrent.clone(), runner.pages.pages.clone()
        short = runner.prefill_short([x[s:] for x, s in zip(ids, starts)], slots, starts).clone()
        after = runner.states.conv[:, slots].clone(), runner.states.recurrent[:, slots].clone()
        latents = [runner.pages.pages.view(runner.pages.pages.shape[0], -1, runner.pages.width)[
            :, runner.tables.tables[slot].long().repeat_interleave(5)[: s + n] * 5 + torch.arange(s + n) % 5]
            for slot, s, n in zip(slots, starts, lengths)]
        for t, b in zip((runner.states.conv, runner.states.recurrent, runner.pages.pages), before):
            t.copy_(b)
        for row, (slot, s, x) in enumerate(zip(slots, starts, ids)):
            want = runner.prefill([x[s:]], [slot], [s])[0][0]
            torch.testing.assert_close(short[row], want, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(after[0][:, row], runner.states.conv[:, slot], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(after[1][:, row], runner.states.recurrent[:, slot], rtol=1e-5, atol=1e-5)
            n = len(x)
            got = runner.pages.pages.view(runner.pages.pages.shape[0], -1, runner.pages.width)[
                :, runner.tables.tables[slot].long().repeat_interleave(5)[:n] * 5 + torch.arange(n) % 5]
            torch.testing.assert_close(latents[row], got, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="1 to 8 tokens"):
        runner.prefill_short([ids[1]], [0], [0])


def test_decode_touches_only_its_slots_and_pages():
    torch.manual_seed(0)
    model = randomize(K3ForCausalLM(CONFIGS["k3-small-mla-first"]()), seed=3)
    runner = make_runner(model, "triton")
    rng = torch.Generator().manual_seed(4)
    give_pages(runner, 1, 9, rng)
    runner.states.recurrent.normal_(generator=rng)
    runner.pages.pages.normal_(generator=rng)
    before_states, before_pages = runner.states.recurrent.clone(), runner.pages.pages.clone()
    with torch.no_grad():
        runner.decode([5], [1], [7])
    changed_slots = (runner.states.recurrent != before_states).flatten(2).any(-1).any(0).nonzero().flatten()
    assert changed_slots.tolist() == [1]
    page, offset = runner.tables.pages[1][7 // 5], 7 % 5
    changed = (runner.pages.pages != before_pages).any(-1).any(0).nonzero().tolist()
    assert changed == [[page, offset]]


def test_prefill_attention_never_takes_cudnn(monkeypatch):
    """The prefill's SDPA runs with cuDNN attention off (its per-shape plan costs 45-71 ms at every new prompt
    length on an H200) and the settings are restored after; the MLA layers' attention is what sees them."""
    torch.manual_seed(0)
    model = randomize(K3ForCausalLM(CONFIGS["k3-small-mla-first"]()), seed=5)
    runner = make_runner(model, "torch")
    give_pages(runner, 0, 6, torch.Generator().manual_seed(6))
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    cudnn_before = torch.backends.cuda.cudnn_sdp_enabled()
    runner.prefill([[1, 2, 3, 4, 5]], [0], [0])
    assert seen and all(s == (False, True) for s in seen)
    assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn_before


def test_graph_buckets_cover_every_batch_size():
    assert graph_buckets(1) == [1]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert graph_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


class HostSyncs(TorchDispatchMode):
    """Records what would make a CUDA stream wait for the host (and so break CUDA-graph capture): ops that read a
    device value on the host, and Python reading a tensor's value (tolist, item, bool, int, float)."""

    SYNCING = ("aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal")
    READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        super().__init__()
        self.seen = []
        for name in self.READS:
            original = getattr(torch.Tensor, name)

            def read(tensor, *args, _original=original, _name=name):
                if self.active:
                    self.seen.append(_name)
                return _original(tensor, *args)

            monkeypatch.setattr(torch.Tensor, name, read)
        self.active = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.SYNCING:
            self.seen.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def dense_grouped_glu_mlp(x_sorted, counts, gate_up, down, act):
    """A host-sync-free stand-in for `grouped_glu_mlp` (each row gathers its expert's weights)."""
    expert = torch.repeat_interleave(torch.arange(len(counts)), counts, output_size=x_sorted.shape[0])
    gate, up = torch.einsum("md,mod->mo", x_sorted, gate_up[expert]).chunk(2, dim=-1)
    return torch.einsum("mi,moi->mo", act(gate, up), down[expert])


def test_gpu_decode_step_never_waits_for_the_host(monkeypatch):
    """The Triton decode path has no host synchronisation apart from the expert matmuls of `grouped_glu_mlp`
    (the CPU's loop reads the group sizes on the host; a GPU's grouped GEMM does not): with a sync-free stand-in
    for it, one decode step issues no op that would wait for the host, so it can be captured."""
    x, counts = torch.randn(7, 6), torch.tensor([3, 0, 4])
    gate_up, down = torch.randn(3, 10, 6), torch.randn(3, 6, 5)
    torch.testing.assert_close(dense_grouped_glu_mlp(x, counts, gate_up, down, swiglu),
                               moe_ops.grouped_glu_mlp(x, counts, gate_up, down, swiglu))
    torch.manual_seed(0)
    model = randomize(K3ForCausalLM(CONFIGS["k3-small-mla-first"]()), seed=3)
    runner = make_runner(model, "triton", short_prefill=4)
    runner.tables.set(1, [runner.pages.alloc(), runner.pages.alloc()])
    runner.inputs[1, :2] = torch.tensor([1, runner.states.padding_slot])
    runner.short_lengths[:2] = torch.tensor([3, 0])
    with torch.no_grad(), HostSyncs(monkeypatch) as syncs:
        runner._run("decode", 2)
    assert "tolist" in syncs.seen  # today's loop reads the group sizes: the detector sees it
    monkeypatch.setattr(moe_ops, "grouped_glu_mlp", dense_grouped_glu_mlp)
    for step in ("decode", "prefill"):  # (and the short-prefill step)
        with torch.no_grad(), HostSyncs(monkeypatch) as syncs:
            logits = runner._run(step, 2)
        assert syncs.seen == [] and torch.isfinite(logits).all(), step


def gpu_paths(monkeypatch) -> None:
    """Every module's `use_triton` answers as on a GPU for these CPU tensors (their Triton kernels then run in
    the interpreter), so that what traces here is what a GPU's step traces."""
    def as_on_a_gpu(x: torch.Tensor, compiled: bool = False) -> bool:
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16) and (
            compiled or not torch.compiler.is_compiling())

    original = fused.use_triton
    for module in [m for name, m in sys.modules.items() if name.startswith("openk3.")]:
        if getattr(module, "use_triton", None) is original:
            monkeypatch.setattr(module, "use_triton", as_on_a_gpu)


@pytest.mark.parametrize("dense_experts", [False, True])
def test_compiled_decode_step_is_few_graphs_and_equals_eager(monkeypatch, dense_experts):
    """The decode step torch.compile'd as the engine does on a GPU (Dynamo's tracing with the aot_eager backend:
    Inductor's code generation takes minutes on this CPU), with the GPU's code paths (`gpu_paths`), traces whole,
    with the Triton kernels (interpreted) as custom ops updating the pools in place: no graph break (a break per
    layer made Dynamo recompile the pieces per layer past its limit on a GPU, the rest running eagerly), and the
    eager step's logits, KDA states, conv windows and latent pages (apart from the scratch rows that padding
    writes). Graphs for the buckets 1, 2, 4: batch 1, batch 2 (4 rows among 6 experts: the row kernel), batch 4
    (8 rows: the sorted path, or with the dense experts path, from batch 3 on, that one): three, one compile each
    at the engine's start-up."""
    monkeypatch.setattr(moe_ops, "grouped_glu_mlp", dense_grouped_glu_mlp)  # the CPU's loop reads counts on host
    gpu_paths(monkeypatch)
    if not dense_experts:
        monkeypatch.setattr(moe_ops, "DENSE_MAX_TOKENS", 0)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = randomize(K3ForCausalLM(CONFIGS["k3-small-mla-first"]()), seed=5)
    runners = [make_runner(model, "triton"), make_runner(model, "triton", compile_backend="aot_eager")]
    results = []
    for runner in runners:
        rng = torch.Generator().manual_seed(6)
        for slot in (0, 2, 3):
            give_pages(runner, slot, 12, rng)
        runner.states.recurrent.normal_(generator=rng)
        runner.states.conv.normal_(generator=rng)
        runner.pages.pages.normal_(generator=rng)
        with torch.no_grad():
            logits = [runner.decode([7], [0], [9]), runner.decode([5, 2], [3, 2], [1, 5]),
                      runner.decode([3, 9, 4], [2, 0, 3], [6, 10, 2])]
        live = slice(0, runner.states.padding_slot)  # a bucket's padded rows write the padding slot and page 0
        states = runner.states
        results.append((logits, states.recurrent[:, live], states.conv[:, live], runner.pages.pages[:, 1:]))
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 3
    # (two fp32 computations: compiled, AttnRes phase 1 takes its PyTorch reference where the eager step runs the
    # Triton kernel; they differ by ~2e-5 in the logits with triton 3.9's interpreter and numpy 2.4)
    for got, want in zip(results[1][0], results[0][0]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for got, want in zip(results[1][1:], results[0][1:]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_compiled_decode_step_that_breaks_says_so(caplog):
    """A graph break in the compiled decode step (here the CPU's expert loop, which reads the group sizes on the
    host) is logged once per compile, naming the step and the count, since the step then runs as pieces."""
    torch._dynamo.reset()
    model = randomize(K3ForCausalLM(CONFIGS["k3-tiny"]()), seed=5)
    runner = make_runner(model, "torch", compile_backend="eager")
    with torch.no_grad(), caplog.at_level("WARNING", logger="openk3.serve.runner"):
        runner.decode([7], [0], [9])
        runner.decode([5], [1], [3])  # compiled already: nothing more to say
    said = [r.getMessage() for r in caplog.records if "graph breaks" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("the compiled decode step at batch 1 has ")


def test_prefill_units_compiled_give_the_eager_logits(monkeypatch):
    """prefill_compile_backend (the engine's compile_prefill): the FFN, norm and AttnRes units compiled in place
    with dynamic shapes (Dynamo's tracing with aot_eager here) trace without a graph break and give the eager
    runner's prefill and decode logits, at three prefill shapes and under the decode step compiled whole (which
    inlines them); the warm-up on the padding slot compiles every graph the prefills need and touches no live
    state (the logits after it are the eager runner's)."""
    monkeypatch.setattr(moe_ops, "grouped_glu_mlp", dense_grouped_glu_mlp)  # the CPU's loop reads counts on host
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = randomize(K3ForCausalLM(CONFIGS["k3-small-mla-first"]()), seed=8)
    runners = [make_runner(copy.deepcopy(model), "triton"),
               make_runner(model, "triton", compile_backend="aot_eager", prefill_compile_backend="aot_eager")]
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(9)).tolist()
    results, prefill_graphs = [], []
    for runner in runners:
        rng = torch.Generator().manual_seed(10)
        for slot in (0, 1):
            give_pages(runner, slot, 16, rng)
        if runner.prefill_compiled:
            runner.warm_up_prefill(tokens=4)
        warm = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            out = [runner.prefill([ids[0][:7], ids[1][:7]], [0, 1], [0, 0])[0],
                   runner.prefill([ids[0][7:12]], [0], [7])[0], runner.prefill([ids[1][7:10]], [1], [7])[0]]
            prefill_graphs.append((warm, counters["stats"]["unique_graphs"]))
            out.append(runner.decode([ids[0][12], ids[1][10]], [0, 1], [12, 10]))
        results.append(out)
    assert not counters["graph_break"]
    # eager: no graph; compiled: the units' graphs all come from the warm-up, none from the prefills after it
    assert prefill_graphs[0] == (0, 0) and prefill_graphs[1][0] == prefill_graphs[1][1] > 0
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_prefill_units_that_fail_to_compile_go_back_to_eager(caplog):
    """A compile failure in the warm-up (here a backend that raises) is logged and leaves every unit eager: the
    prefill after it runs and gives the eager runner's logits."""
    def broken_backend(graph_module, example_inputs):
        raise RuntimeError("this backend cannot compile")

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = randomize(K3ForCausalLM(CONFIGS["k3-small-mla-first"]()), seed=8)
    eager = make_runner(copy.deepcopy(model), "torch")
    runner = make_runner(model, "torch", prefill_compile_backend=broken_backend)
    runner.warm_up_prefill(tokens=4)
    assert not runner.prefill_compiled and "prefilling eagerly" in caplog.text
    ids = torch.randint(0, model.config.vocab_size, (7,), generator=torch.Generator().manual_seed(3)).tolist()
    for r in (eager, runner):
        give_pages(r, 0, 7, torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(runner.prefill([ids], [0], [0])[0], eager.prefill([ids], [0], [0])[0])


def synchronous_copies(source: str) -> list[int]:
    """Lines of `torch.tensor(..., device=...)` calls: a copy from pageable memory, which makes the host wait for
    every kernel queued on the GPU."""
    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            and ast.unparse(node.func) == "torch.tensor" and any(k.arg == "device" for k in node.keywords)]


def test_serving_copies_to_the_device_without_waiting_for_it():
    """The engine, the runner and the caches build their index tensors with `ops.transfer.to_device` (pinned
    memory, non_blocking): with `torch.tensor(..., device=...)` the host waited for the GPU at every prefill chunk,
    so a chunk cost its host time plus its device time instead of the larger of the two."""
    assert synchronous_copies("x = torch.tensor([1], device=d)\ny = torch.tensor([1])") == [1]
    src = Path(__file__).resolve().parents[1] / "src" / "openk3"
    paths = sorted([*src.glob("serve/*.py"), *src.glob("cache/*.py")])
    offenders = [f"{path.relative_to(src)}:{line}" for path in paths for line in synchronous_copies(path.read_text())]
    assert offenders == []
    x = to_device([[1, 2], [3, 4]], "cpu", torch.int32)
    assert x.dtype == torch.int32 and x.device.type == "cpu" and x.tolist() == [[1, 2], [3, 4]]


@pytest.mark.parametrize("name", ["k3-small-mla-first", "kimi-tiny"])  # full-rank and low-rank output gates
def test_fused_input_projections_keep_the_values_in_one_buffer(name):
    """fuse_inference_projections (the engine's start-up): every group of Linears that read one input (KDA's six,
    MLA's query / latent / output gate, the FFNs' gate|up, LatentMoE's routed_down with the shared expert's) becomes
    views of one buffer with the same values (the model's forward unchanged up to the order of the products' sums,
    the state dict unchanged), fusing again keeps those buffers, one product over KDA's gives its six projections,
    and a dtype move drops every fusion."""
    torch.manual_seed(0)
    model = randomize(K3ForCausalLM(CONFIGS[name]()), seed=7)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = model(ids).logits
        fuse_inference_projections(model)
        modules = [m for m in model.modules() if isinstance(m, FusableLinears)]
        buffers = {(m, group): buf for m in modules for group, buf in m.fused.items()}
        assert all(m.fused.keys() == m.fusion_groups().keys() for m in modules)
        latent = {"MoE"} if model.config.moe.latent_dim is not None else set()  # else the shared GLUMLP's own
        assert {type(m).__name__ for m, _ in buffers} == {"KimiDeltaAttention", "GatedMLA", "GLUMLP"} | latent
        layer = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
        fused = layer.fused["input"]
        assert all(lin.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
                   for lin in layer.input_linears())
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-4)  # ~1e-5 here: sums in other orders
        after = model.state_dict()
        assert list(after) == list(state) and all(torch.equal(v, state[k]) for k, v in after.items())
        fuse_inference_projections(model)  # a second engine on the model: the buffers its first engine's graphs read
        assert all(m.fused[group] is buf for (m, group), buf in buffers.items())
        x = torch.randn(3, 1, model.config.hidden_size)
        got = kda_input_projections(layer, x)
        layer.fused = {}
        for a, b in zip(got, kda_input_projections(layer, x), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    fuse_inference_projections(model)
    model.double()
    assert not any(m.fused for m in modules) and layer.q_proj.weight.dtype == torch.float64
