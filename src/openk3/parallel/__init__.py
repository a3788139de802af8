"""Scale-out applied to a plain model from outside (SPEC §10): KDA context parallel (kcp.py) with MLA under context
parallel (mla.py), both installed by cp.py; expert parallel with MoonEP's balanced planner (ep.py, planner.py); and
`parallelize` (apply.py), which composes them with FSDP2. model/ knows nothing about any of it."""

from openk3.parallel.apply import Parallel, ParallelDims, apply_fsdp, parallelize
from openk3.parallel.cp import ContextParallel, PackedBatch, cp_lm_losses, parallelize_cp
from openk3.parallel.ep import ExpertParallel, parallelize_ep
from openk3.parallel.layout import SequenceSplit
from openk3.parallel.planner import EPPlan, plan_balanced, plan_static

__all__ = [
    "Parallel",
    "ParallelDims",
    "apply_fsdp",
    "parallelize",
    "ContextParallel",
    "PackedBatch",
    "cp_lm_losses",
    "parallelize_cp",
    "ExpertParallel",
    "parallelize_ep",
    "SequenceSplit",
    "EPPlan",
    "plan_balanced",
    "plan_static",
]
