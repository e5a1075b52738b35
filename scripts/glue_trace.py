"""Every aten op of one MACE-MP energy+forces call outside our own ops, by Python origin
(forward: the innermost mace / e3nn / mace-accel source line) or autograd node (backward), with
its input shapes: where the torch glue between our kernels comes from (GPU machine).

    python scripts/glue_trace.py cuda 256 [float64]

A ``TorchDispatchMode`` sees each op once, as it is dispatched; our custom ops (``mace_accel``)
run with the mode off, so their insides are not listed. On the CPU the reference paths
(``torch.func.vjp`` inside some reference backwards) do not run under a dispatch mode: use it on
the GPU.
"""

from __future__ import annotations

import collections
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from mace_accel.bench.backends import prepare_backend, resolve_model_source
from mace_accel.bench.systems import build_system, make_batch
from mace_accel.models.batch import model_info
from mace_accel.models.outputs import evaluate as evaluate_model

# views, allocations and metadata: no kernel
SKIP = {"aten.empty.memory_format", "aten.empty_strided.default", "aten.view.default",
        "aten.as_strided.default", "aten.detach.default", "aten.expand.default", "aten.t.default",
        "aten.transpose.int", "aten._reshape_alias.default", "aten.unsqueeze.default",
        "aten.squeeze.dim", "aten.select.int", "aten.slice.Tensor", "aten.permute.default",
        "aten.alias.default", "aten.lift_fresh.default", "aten._local_scalar_dense.default",
        "aten.unbind.int", "aten.split.Tensor", "aten.narrow.default", "aten.empty_like.default",
        "aten._unsafe_view.default", "aten.split_with_sizes.default",
        "aten.new_empty_strided.default", "aten.new_empty.default", "aten.empty_permuted.default",
        "aten.squeeze.dims", "aten.view_as.default", "aten.sym_size.int", "aten.sym_stride.int",
        "aten.sym_numel.default", "aten.is_same_size.default", "aten.squeeze.default",
        "aten.reshape.default", "aten.expand_as.default"}


class GlueTrace(TorchDispatchMode):
    """Counts ``(op, origin, input shapes)``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name not in SKIP:
            node = torch._C._current_autograd_node()
            where = node.name() if node is not None else ""
            frames = [f for f in traceback.extract_stack()[:-1]
                      if ("mace" in f.filename or "e3nn" in f.filename)
                      and "glue_trace" not in f.filename]
            if frames:
                f = frames[-1]
                where += (f" {f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}"
                          f":{f.lineno} {f.name}")
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            self.rows[(name, where.strip(), str(shapes)[:48])] += 1
        if name.startswith("mace_accel"):
            with _disable_current_modes():
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    dtype = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else torch.float32
    model = resolve_model_source("mp-medium").load(dtype, torch.device(device))
    info = model_info(model)
    batch, n_edges = make_batch(build_system(info, size), info, dtype, device)
    prepared = prepare_backend("mace-accel", model, device, allow_reference=(device == "cpu"))

    def call():
        b = dict(batch)
        b["positions"] = batch["positions"].detach().clone().requires_grad_(True)
        return evaluate_model(prepared.model, b, False)["forces"]  # as the calculator does

    call()
    call()
    trace = GlueTrace()
    with trace:
        call()
    total = sum(trace.rows.values())
    ours = sum(c for (n, _, _), c in trace.rows.items() if n.startswith("mace_accel"))
    print(f"{device} {size} atoms E={n_edges}: {total} ops, {ours} ours")
    for (name, where, shapes), count in sorted(trace.rows.items(),
                                               key=lambda kv: (-kv[1], kv[0][1])):
        print(f"{count:3d} {name[:34]:34s} {where[:100]:100s} {shapes}")


if __name__ == "__main__":
    main()
