"""What autograd keeps for backward while a function runs: the distinct storages its saved tensors live in."""

import torch


def saved_storages(fn, *args, exclude=()) -> list[tuple[torch.dtype, tuple[int, ...], int]]:
    """Run fn(*args) and return (dtype, shape, storage bytes) of each distinct storage saved for backward, leaving
    out those of `exclude` (e.g. the parameters)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in skip and key not in seen:
            seen[key] = (t.dtype, tuple(t.shape), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return list(seen.values())


def saved_bytes(fn, *args, exclude=()) -> int:
    return sum(n for _, _, n in saved_storages(fn, *args, exclude=exclude))
