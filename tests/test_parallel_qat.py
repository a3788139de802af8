"""`--qat mxfp4` under torchrun: FSDP2 (and expert parallel) over fake-quantized experts, in 2 real processes (gloo).

FSDP2 finds each parameter it sharded by reading the module attribute of its name; QAT's experts answer that
attribute with the quantized view, so the first forward failed ("got mixed torch.Tensor and DTensor"), and
expert parallel cut each rank's experts out of the quantized view, replacing the full-precision masters. Here the
2-process loss and gradient norm equal one process's on the same batch, and the gathered state still holds the
unquantized masters.
"""

import torch
import torch.distributed as dist

from distributed_spawn import run_ranks
from openk3.parallel import ParallelDims, parallelize
from openk3.quant.qat import enable_qat
from openk3.train.distributed import clip_grad_norm, full_model_state
from test_interop_k3 import random_model, tiny_k3

TOL = 1e-5


def _loss(model, ids):
    logits = model(ids[:, :-1], return_mtp=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _worker(rank, world):
    cfg = tiny_k3()
    ids = torch.randint(0, cfg.vocab_size, (2 * world, 9), generator=torch.Generator().manual_seed(1))
    reference = random_model(cfg, seed=3).train()
    masters = {k: v.clone() for k, v in reference.state_dict().items()}
    enable_qat(reference)
    ref_loss = _loss(reference, ids)
    ref_loss.backward()
    ref_norm = torch.stack([p.grad.norm() for p in reference.parameters() if p.grad is not None]).norm()
    for ep in (1, 2):
        model = random_model(cfg, seed=3).train()
        enable_qat(model)
        parallel = parallelize(model, ParallelDims(world, 1, ep), rank, "cpu")
        loss = _loss(model, parallel.data_rows(ids))
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        assert abs(float(mean) / world - float(ref_loss)) <= TOL * float(ref_loss), (ep, float(mean), ref_loss)
        norm = clip_grad_norm(model, 1e9)  # the global norm (the gradients are the mean over the ranks)
        assert abs(float(norm) - float(ref_norm)) <= TOL * float(ref_norm), (ep, float(norm), float(ref_norm))
        state = full_model_state(model)
        if rank == 0:
            for name, value in masters.items():
                assert torch.equal(state[name], value), f"--ep {ep}: {name} is not the full-precision master"


def test_qat_under_fsdp_and_expert_parallel_follows_one_process():
    run_ranks(_worker, 2)
