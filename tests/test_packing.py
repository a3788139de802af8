"""Document-aware packing (`openk3 train --packing docs`): a packed batch trains as its documents run one by one.

The model-level test holds the packed loss (next-token + MTP) and every parameter's gradient to those of the
documents, and the pieces of documents cut at a row's end, each run alone through the unpacked model (fp32, CPU,
odd lengths, one document cut across two rows). The component tests hold each piece that sees more than one token
to its per-document form: the KDA layer (state reset; the PyTorch backends and the Triton kernels), the short conv
(window reset), MLA (document mask; flex_attention's document BlockMask, the CUDA path, against it), and the loss's
label masks.
"""

from __future__ import annotations

import pytest
import torch

from openk3.config import ModelConfig, get_preset
from openk3.model import K3ForCausalLM
from openk3.model.documents import Documents, same_document
from openk3.model.kda import KimiDeltaAttention
from openk3.model.mla import GatedMLA
from openk3.ops import attention
from openk3.ops.attention import document_mask, mla_attention_expanded
from openk3.ops.conv import causal_conv1d, causal_conv1d_reference
from openk3.train.loop import lm_losses
from train_tiny import FLASH_MLA, TINY, assert_compiled_matches_eager

# three rows of 18 inputs (+1 target): odd document lengths, a one-token document, and document 3 cut by row 0's
# end and continued at row 1's start (each row starts afresh: the two pieces run separately)
SEGMENTS = torch.tensor([
    [0] * 5 + [1] * 1 + [2] * 7 + [3] * 6,
    [3] * 3 + [4] * 11 + [5] * 5,
    [6] * 19,
])


def tiny_config() -> ModelConfig:
    return get_preset("k3-tiny").with_overrides(TINY)


def pieces(segments: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document piece among a batch's T = segments.shape[1] - 1 input positions."""
    T = segments.shape[1] - 1
    out = []
    for r in range(segments.shape[0]):
        start = 0
        for t in range(1, T + 1):
            if t == T or segments[r, t] != segments[r, t - 1]:
                out.append((r, start, t))
                start = t
    return out


def per_document_losses(model, batch, segments, mtp_weight):
    """The loss `lm_losses` must give, from each piece run alone: CE sums over the labels inside the piece's
    document (the next token; the token after next for MTP), divided by the counts of such labels."""
    head = model.lm_head.weight
    sums, counts = [0.0, 0.0], [0, 0]
    for r, a, e in pieces(segments):
        out = model(batch[r:r + 1, a:e], return_logits=False)
        for depth, hidden in enumerate([out.head_inputs] + list(out.mtp_head_inputs or [])):
            n = e - a - depth  # positions that predict token t + 1 + depth
            keep = segments[r, a + 1 + depth:a + n + 1 + depth] == segments[r, a:a + n]
            if keep.any():
                logits = hidden[0, :n][keep] @ head.T
                sums[depth] = sums[depth] + torch.nn.functional.cross_entropy(
                    logits, batch[r, a + 1 + depth:a + n + 1 + depth][keep], reduction="sum")
                counts[depth] += int(keep.sum())
    return sums[0] / counts[0] + mtp_weight * sums[1] / counts[1]


def test_packed_loss_and_gradients_equal_the_documents_run_one_by_one():
    torch.manual_seed(0)
    model = K3ForCausalLM(tiny_config()).train()
    B, T1 = SEGMENTS.shape
    batch = torch.randint(0, model.config.vocab_size, (B, T1))
    params = [p for p in model.parameters() if p.requires_grad]

    packed, _, _ = lm_losses(model, batch, 0.3, SEGMENTS)
    got = torch.autograd.grad(packed, params, allow_unused=True)
    reference = per_document_losses(model, batch, SEGMENTS, 0.3)
    want = torch.autograd.grad(reference, params, allow_unused=True)

    torch.testing.assert_close(packed, reference, rtol=1e-5, atol=1e-5)
    compared = 0
    for g, w in zip(got, want):
        if w is None:  # e.g. the router bias (balanced outside the loss)
            assert g is None or not g.any()
            continue
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        compared += 1
    assert compared > len(params) // 2
    # and it is not the concatenated loss: the boundaries change the numbers
    assert abs(float(lm_losses(model, batch, 0.3)[0].detach()) - float(packed.detach())) > 1e-3


def row_pieces(documents: Documents) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document of a packed [B,T] batch."""
    B, T = documents.shape
    cu = documents.cu_seqlens.tolist()
    return [(a // T, a % T, a % T + b - a) for a, b in zip(cu, cu[1:])]


INPUT_SEGMENTS = SEGMENTS[:, :-1]  # the documents of the 18 input positions


def per_piece(fn, x: torch.Tensor, documents: Documents) -> torch.Tensor:
    """fn applied to each document of x [B,T,...] alone, put back in place."""
    rows = [[] for _ in range(x.shape[0])]
    for r, a, e in row_pieces(documents):
        rows[r].append(fn(x[r:r + 1, a:e]))
    return torch.cat([torch.cat(parts, dim=1) for parts in rows])


def test_documents_from_segments():
    d = Documents.from_segments(INPUT_SEGMENTS)
    assert d.cu_seqlens.tolist() == [0, 5, 6, 13, 18, 21, 32, 36, 54]  # row starts (18, 36) start documents
    assert d.starts[0].tolist() == [0] * 5 + [5] + [6] * 7 + [13] * 5
    assert d.doc_ids[1].tolist() == [4] * 3 + [5] * 11 + [6] * 4
    assert d.resets.sum().item() == len(d.cu_seqlens) - 1
    assert same_document(SEGMENTS, 1)[0, 4].item() is False and same_document(SEGMENTS, 1)[0, 17].item() is True
    with pytest.raises(ValueError, match="segments must be"):
        Documents.from_segments(torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("width", [2, 4])
def test_conv_window_resets_at_document_starts(width):
    """causal_conv1d (the recomputing Function) and its reference with `starts` equal the conv of each document
    alone, values and gradients (x, the kernel), at scales where SiLU saturates."""
    d = Documents.from_segments(INPUT_SEGMENTS)
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(3, 18, 6, generator=g, dtype=torch.float64) * 30).requires_grad_()
    w = torch.randn(6, width, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(3, 18, 6, generator=g, dtype=torch.float64)
    want = per_piece(lambda p: causal_conv1d_reference(p, w)[0], x, d)
    for fn in (causal_conv1d, causal_conv1d_reference):
        y = fn(x, w, starts=d.starts)[0]
        torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
        for got, ref in zip(torch.autograd.grad(y, [x, w], dy),
                            torch.autograd.grad(want, [x, w], dy, retain_graph=True)):
            torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    # the state after the batch: the last W-1 inputs of each row's last document, zeros before it
    state = causal_conv1d(x, w, starts=d.starts)[1]
    torch.testing.assert_close(state, torch.stack([causal_conv1d(x[r:r + 1, a:e], w)[1][0]
                                                   for r, a, e in row_pieces(d) if e == 18]))
    with pytest.raises(ValueError, match="a state or document starts"):
        causal_conv1d(x, w, torch.zeros(3, 6, width - 1, dtype=torch.float64), starts=d.starts)


def layer_inputs(seed):
    """A packed batch's hidden states x [3, 18, D] (to differentiate) and an output gradient."""
    torch.manual_seed(seed)
    D = tiny_config().hidden_size
    return torch.randn(3, 18, D, requires_grad=True), torch.randn(3, 18, D)


def assert_layer_matches_per_document(layer, seed):
    d = Documents.from_segments(INPUT_SEGMENTS)
    x, dy = layer_inputs(seed)
    y = layer(x, documents=d)
    want = per_piece(lambda p: layer(p), x, d)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    params = [x] + list(layer.parameters())
    for got, ref in zip(torch.autograd.grad(y, params, dy, allow_unused=True),
                        torch.autograd.grad(want, params, dy, allow_unused=True)):
        if ref is not None:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["chunked", "recurrent"])
def test_kda_layer_resets_its_state_at_document_starts(backend):
    """Packed KDA (conv window and recurrent state reset) == each document through the layer alone."""
    torch.manual_seed(1)
    layer = KimiDeltaAttention(tiny_config(), 0)
    layer.kda_backend = backend
    assert_layer_matches_per_document(layer, seed=2)


def test_kda_layer_varlen_triton_matches_per_document():
    """The Triton route (the flattened batch varlen on cu_seqlens; under TRITON_INTERPRET=1 on CPU) == the
    documents alone through the PyTorch form."""
    pytest.importorskip("triton")
    torch.manual_seed(3)
    layer = KimiDeltaAttention(tiny_config(), 0)
    d = Documents.from_segments(INPUT_SEGMENTS)
    x, dy = layer_inputs(seed=4)
    layer.kda_backend = "triton"
    y = layer(x, documents=d)
    layer.kda_backend = "recurrent"
    want = per_piece(lambda p: layer(p), x, d)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
    gx = torch.autograd.grad(y, x, dy)[0]
    torch.testing.assert_close(gx, torch.autograd.grad(want, x, dy)[0], rtol=1e-4, atol=1e-5)


def test_mla_layer_attends_within_each_document():
    torch.manual_seed(5)
    assert_layer_matches_per_document(GatedMLA(tiny_config(), 3), seed=6)


def test_document_mask_attention_equals_a_plain_masked_softmax():
    """mla_attention_expanded with doc_ids (SDPA with `document_mask`) == softmax over scores with -inf outside
    the query's document and its future, written out."""
    g = torch.Generator().manual_seed(7)
    B, T, H, n, r, v, R = 3, 18, 2, 8, 4, 8, 16
    q = torch.randn(B, T, H, n + r, generator=g, dtype=torch.float64) * 3
    kv = torch.randn(B, T, R + r, generator=g, dtype=torch.float64)
    kv_b = torch.randn(H * (n + v), R, generator=g, dtype=torch.float64)
    doc_ids = Documents.from_segments(INPUT_SEGMENTS).doc_ids
    got = mla_attention_expanded(q, kv, kv_b, nope_dim=n, v_dim=v, doc_ids=doc_ids)
    w = kv_b.view(H, n + v, R)
    k = torch.cat([torch.einsum("btr,hnr->bthn", kv[..., :R], w[:, :n]),
                   kv[..., R:].unsqueeze(2).expand(B, T, H, r)], -1)
    val = torch.einsum("btr,hvr->bthv", kv[..., :R], w[:, n:])
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * (n + r) ** -0.5
    allowed = torch.tensor([[[doc_ids[b, i] == doc_ids[b, j] and j <= i for j in range(T)] for i in range(T)]
                            for b in range(B)])
    assert torch.equal(document_mask(doc_ids)[:, 0], allowed)
    want = torch.einsum("bhij,bjhv->bihv", scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1), val)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def random_doc_ids(B: int, T: int, docs: int, g: torch.Generator) -> torch.Tensor:
    """[B,T] document ids, each row `docs` documents of random lengths (at least one token each)."""
    return torch.stack([torch.bucketize(torch.arange(T), torch.randperm(T - 1, generator=g)[:docs - 1] + 1,
                                        right=True) for _ in range(B)])


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize(("T", "docs"), [(1, 1), (37, 3), (128, 1), (129, 2), (300, 1), (300, 3), (700, 40),
                                         (1023, 9)])
def test_document_block_mask_equals_flex_own_construction(T, docs):
    """The BlockMask built from the blocks' first and last documents == create_block_mask evaluating the mask_mod
    at every query and key: the same mask, the same partial and fully visible blocks both ways (for flex's forward
    and backward), at lengths that are and are not multiples of the block, documents within and across blocks."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc_ids = random_doc_ids(3, T, docs, torch.Generator().manual_seed(T + docs))
    got = attention.document_block_mask(doc_ids)
    want = create_block_mask(lambda b, h, i, j: (doc_ids[b, i] == doc_ids[b, j]) & (j <= i), 3, None, T, T,
                             device="cpu")
    assert torch.equal(got.to_dense(), want.to_dense())
    for counts, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                            ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        n = getattr(want, counts)
        assert torch.equal(getattr(got, counts), n)
        for row_got, row_want, k in zip(getattr(got, indices).flatten(0, 2), getattr(want, indices).flatten(0, 2),
                                        n.flatten()):
            assert torch.equal(row_got[:k].sort().values, row_want[:k].sort().values)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [37, 300])
def test_flex_document_attention_matches_the_dense_mask(device, T, monkeypatch):
    """flex_attention with the document BlockMask (the CUDA path of packed batches; compiled there) == SDPA with
    the dense `document_mask`, forward and gradients: odd lengths, three documents a row laid out differently in
    each row, v's head dim below q's and k's (as MLA's), a scale that is not the default. torch runs flex_attention
    on the CPU uncompiled and refuses its backward there: the test lifts that check (the uncompiled backward is
    the same math on any device) and runs flex eagerly."""
    if device == "cpu":
        import torch.nn.attention.flex_attention as flex

        monkeypatch.setattr(flex, "_validate_device", lambda *tensors: None)
        monkeypatch.setattr(attention, "compiled_flex_attention", lambda: flex.flex_attention)
    assert attention.uses_flex_attention(torch.device(device)) == (device == "cuda")
    g = torch.Generator().manual_seed(T)
    B, H, dk, dv = 2, 3, 24, 16
    dtype = torch.float64 if device == "cpu" else torch.float32
    q, k, v, dy = (torch.randn(B, H, T, d, generator=g, dtype=dtype).to(device) for d in (dk, dk, dv, dv))
    doc_ids = random_doc_ids(B, T, 3, g).to(device)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    got = attention.flex_document_attention(q, k, v, doc_ids, scale=0.3)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc_ids), scale=0.3)
    tol = dict(rtol=1e-10, atol=1e-10) if device == "cpu" else dict(rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(got, want, **tol)
    for a, b in zip(torch.autograd.grad(got, inputs, dy), torch.autograd.grad(want, inputs, dy)):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused paths of a training step run on CUDA")
@pytest.mark.parametrize("path", ["varlen", "flex"])
@pytest.mark.parametrize("v", [32, 48])
def test_packed_mla_under_bf16_autocast_on_cuda(path, v):
    """mla_attention_expanded with doc_ids as a bf16 training step runs it on CUDA (given the documents' device
    cu_seqlens the varlen flash kernel, v padded when narrower than q; without them flex_attention; inputs cast to
    bf16) against the fp32 dense-mask reference on the CPU: within bf16 rounding (of every operand, the K/V
    expansion's product too), forward and gradients."""
    g = torch.Generator().manual_seed(11)
    B, T, H, n, r, R = 2, 300, 4, 32, 16, 64
    q, kv = torch.randn(B, T, H, n + r, generator=g), torch.randn(B, T, R + r, generator=g)
    kv_b, dy = torch.randn(H * (n + v), R, generator=g) / R**0.5, torch.randn(B, T, H, v, generator=g)
    documents = Documents.from_segments(random_doc_ids(B, T, 3, g))
    cuda_documents = documents.to("cuda")
    assert attention.varlen_usable(q.cuda().bfloat16(), torch.empty(1, v, device="cuda", dtype=torch.bfloat16))
    results = []
    for device in ("cpu", "cuda"):
        inputs = [t.to(device).requires_grad_() for t in (q, kv, kv_b)]
        kw = dict(doc_ids=documents.doc_ids)
        if device == "cuda":
            kw = dict(doc_ids=cuda_documents.doc_ids, block_mask=cuda_documents.block_mask,
                      cu_seqlens=cuda_documents.device_cu_seqlens if path == "varlen" else None)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            out = mla_attention_expanded(*inputs, nope_dim=n, v_dim=v, **kw)
        results.append([t.float().cpu() for t in (out, *torch.autograd.grad(out, inputs, dy.to(device)))])
    for got, want in zip(results[1], results[0]):
        assert ((got - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled packed path of a training step runs on CUDA")
@pytest.mark.parametrize("autocast", [False, True])
def test_packed_loss_of_the_compiled_model_on_cuda(autocast):
    """A packed training step of the block-compiled model (openk3 train's default on CUDA) == the eager model's,
    loss and gradients, in fp32 (MLA through flex_attention) and under bf16 autocast (the varlen flash kernel; to
    bf16 rounding): the MTP block attends over T - 1 positions after the main layers' T (a new shape for the shared
    compiled MLA code; flex's BlockMask built inside made Inductor fail with CantSplit), over two batches whose
    documents lie differently (their counts too: one compiled graph takes both)."""
    from openk3.model.compile import compile_blocks

    torch.manual_seed(0)
    cfg = tiny_config().with_overrides(FLASH_MLA)
    eager = K3ForCausalLM(cfg).cuda().train()
    compiled = compile_blocks(K3ForCausalLM(cfg).cuda().train())
    compiled.load_state_dict(eager.state_dict())
    B, T1 = SEGMENTS.shape
    relaid = SEGMENTS.flip(1).clone()
    relaid[2, 10:] = 7  # and one document more
    for segments in (SEGMENTS, relaid):
        batch = torch.randint(0, eager.config.vocab_size, (B, T1), device="cuda")
        assert_compiled_matches_eager(eager, compiled, batch, autocast, segments)
