"""compile_blocks: torch.compile per decoder block, in place."""

import pytest
import torch

from openk3.config import get_preset
from openk3.model import K3ForCausalLM
from openk3.model.compile import compile_blocks, uncompile_blocks
from train_tiny import FLASH_MLA, TINY, assert_compiled_matches_eager


def test_compile_blocks_same_values_and_names():
    """compile_blocks compiles the sublayers, norms and AttnRes phases in place (Dynamo's tracing with the eager
    backend: Inductor's code generation takes minutes on this CPU): parameter names unchanged, graphs captured, and
    logits and every gradient equal to the uncompiled model."""
    cfg = get_preset("k3-tiny").with_overrides({"num_layers": 2, "mla_layers": [1], "attn_res_block_size": 1})
    torch.manual_seed(0)
    eager, compiled = K3ForCausalLM(cfg), K3ForCausalLM(cfg)
    compiled.load_state_dict(eager.state_dict())
    compile_blocks(compiled, backend="eager")
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    results = []
    for model in (eager, compiled):
        out = model(ids)
        (out.logits.float().logsumexp(-1).mean() + out.mtp_logits.float().logsumexp(-1).mean()).backward()
        results.append((out.logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    assert results[1][1].keys() == results[0][1].keys()
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert compiled.model.layers[0].mlp._compiled_call_impl is not None
    assert "combine" in vars(compiled.mtp[0])  # the MTP layer's input projection, compiled
    uncompile_blocks(compiled)
    assert compiled.model.layers[0].mlp._compiled_call_impl is None and "combine" not in vars(compiled.mtp[0])


# (device, torch.compile backend, bf16 autocast): on CPU AOTAutograd's tracing of the backward (Inductor's C++ builds
# take minutes here), on CUDA Inductor's code with the GPU's fused paths
GRADIENT_CASES = [("cpu", "aot_eager", False)] + (
    [("cuda", "inductor", False), ("cuda", "inductor", True)] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device,backend,autocast", GRADIENT_CASES)
def test_compiled_training_gradients_equal_eager(device, backend, autocast):
    """Every parameter's gradient of the LM + MTP loss through the compiled blocks equals the eager model's: fp32
    (on CUDA the experts' loop over groups) and bf16 autocast (their grouped GEMM; to bf16 rounding), the routers
    made decisive so that near-ties cannot flip an expert between the two runs. On CUDA (torch 2.11) Dynamo's trace
    of the experts' combine (`ops.moe._CombineRows`) passed no gradient back: every router, routed_down and expert
    gradient was zero in every backend, packed or not, fp32 or bf16, while CPU runs agreed
    (bench/decode_profile_runs/101-*); compiled code now takes the combine's autograd reference."""
    torch.manual_seed(0)
    # two layers (KDA + dense FFN, MLA + MoE) and the MTP layer (MoE)
    cfg = get_preset("k3-tiny").with_overrides(TINY).with_overrides(
        {"num_layers": 2, "mla_layers": [1], **FLASH_MLA})
    eager = K3ForCausalLM(cfg).to(device).train()
    compiled = compile_blocks(K3ForCausalLM(cfg).to(device).train(), backend=backend)
    compiled.load_state_dict(eager.state_dict())
    batch = torch.randint(0, cfg.vocab_size, (3, 41), device=device)
    assert_compiled_matches_eager(eager, compiled, batch, autocast)
