"""Whole-call CUDA graphs: one energy + forces (+ stress) call of a MACE model replayed as one
graph per shape bucket.

A small system's call is bound by ~500-1,000 kernel launches and the Python that issues them,
not by the GPU. Captured once into a CUDA graph, a call costs one replay. Graphs need fixed
shapes, so a structure of ``N`` atoms and ``E`` edges is padded up to a bucket ``(N_pad, E_pad)``:

* the padding atoms ``N .. N_pad-1`` form one more, *dummy* structure of the batch (after the
  batch's ``S`` structures: ``batch = S``), with zero node attributes, at the origin;
* the padding edges join padding atoms to themselves (at most 32 on each) across one cell
  vector of the dummy structure's cell, ``L = 2 r_max + 1`` Å long: beyond the cutoff;
* the dummy structure's energy, forces and stress are dropped. The real atoms never
  exchange a message with a padding atom, so their results do not depend on the padding (the
  padding atoms' own forces come out exactly zero; tested).

The calculator pads one structure; :mod:`mace_accel.training` pads a training batch of many.
Static input buffers are written before every replay; outputs are read from the graph's static
outputs. The edge orderings the fused kernels walk (receiver and sender CSRs of the static
``edge_index``) are built outside the graph, which reads them, and rebuilt in place only when
the edges change: a replay with the same neighbour list sorts nothing. All graphs share one
memory pool and are replayed one at a time on the capturing stream; at most ``max_graphs`` are
kept (least recently used dropped first). A structure beyond every captured bucket is captured
afresh (logged at debug level).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from typing import Dict, Optional, Set, Tuple

import torch

from mace_accel.models.outputs import evaluate as evaluate_model
from mace_accel.ops.graph import ConvGraph, cached_graph, forget_cached_graph
from mace_accel.ops.runtime import side_stream
from mace_accel.state import StateWatch

log = logging.getLogger(__name__)

Tensor = torch.Tensor
# how each field of mace's batch dict is padded (anything else: per node if it has N rows,
# per graph if it has one)
PER_EDGE = ("edge_index", "shifts", "unit_shifts")
PER_NODE = ("positions", "node_attrs", "batch", "charges", "density_coefficients")
CELLS = ("cell", "rcell")
LABELS = ("energy", "forces", "stress", "virials", "dipole", "polarizability")


# the most edges a captured call has: a graph keeps its working set in its own memory pool, and
# a capture first runs the call eagerly beside the graphs already kept, so a large structure
# would need its working set twice; there the call is bound by the GPU's work, not by launches,
# and runs eagerly (4.2M edges: about 54,000 atoms of a dense solid at 6 Å)
GRAPH_MAX_EDGES = 1 << 22

# padding edges per padding atom at most: each atom's edges are one thread block's work in the
# fused convolution, so piling every padding edge onto one atom would make a long tail (a real
# atom of a dense solid has ~80 edges at 6 Å)
PAD_EDGES_PER_ATOM = 96


def padded_shape(n_atoms: int, n_edges: int) -> Tuple[int, int]:
    """``(N_pad, E_pad)``: the bucket of a structure, with at least one padding atom and at
    most :data:`PAD_EDGES_PER_ATOM` padding edges on each padding atom.

    ``N_pad`` depends on ``n_edges`` only through its bucket: enough padding atoms for any edge
    count of the bucket, so that MD, whose edge count wanders within a bucket as the
    neighbour list is rebuilt, keeps replaying one graph."""
    e_pad = bucket(n_edges)
    widest = e_pad - bucket_below(e_pad)  # most padding edges any count in this bucket needs
    dummies = max(1, -(-widest // PAD_EDGES_PER_ATOM))
    return bucket(n_atoms + dummies), e_pad


def bucket(n: int, minimum: int = 16, steps_per_octave: int = 8) -> int:
    """The smallest size of the ladder ``minimum * 2^(k/steps_per_octave)`` (rounded up to a
    multiple of 8) that holds ``n``: steps of 9% at the default 8 per doubling (at most 12%
    padding above 256, 20% above 64)."""
    if n <= minimum:
        return minimum
    k = math.ceil(steps_per_octave * math.log2(n / minimum) - 1e-9)
    size = minimum * 2 ** (k / steps_per_octave)
    return int(math.ceil(size / 8) * 8)


def bucket_below(size: int, minimum: int = 16, steps_per_octave: int = 8) -> int:
    """The ladder size just below the rung ``size`` of :func:`bucket` (0 below the smallest)."""
    if size <= minimum:
        return 0
    k = math.ceil(steps_per_octave * math.log2(size / minimum) - 1e-9)  # a rung of size
    while k > 0:  # rounding to 8 merges some small rungs: step down to a smaller one
        k -= 1
        below = int(math.ceil(minimum * 2 ** (k / steps_per_octave) / 8) * 8)
        if below < size:
            return below
    return 0


@dataclasses.dataclass
class _Captured:
    graph: Optional[torch.cuda.CUDAGraph]
    inputs: Dict[str, Tensor]
    outputs: Dict[str, Tensor]
    n_atoms: int
    n_edges: int
    # what each static input was last filled from: (tensor, its version); an unchanged source
    # (the same tensor, not modified since) is not copied again (MD: only positions change)
    sources: Dict[str, Tuple[Tensor, int]] = dataclasses.field(default_factory=dict)
    # every result in one float64 vector, packed inside the graph (see pack())
    packed: Optional[Tensor] = None
    # the edge orderings the kernels walk, built outside the graph (the graph reads them) and
    # rebuilt in place when the edges change; None: built inside the graph on every replay
    edges: Optional[ConvGraph] = None
    edge_keys: Tuple = ()


def shortest_edge(inputs: Dict[str, Tensor]) -> Tensor:
    """``[1]`` float64: the shortest edge of a batch (inf without edges), padding included
    (padding edges are longer than the cutoff), so the real structure's shortest interatomic
    distance: any pair closer than the cutoff is an edge. O(edges), no synchronisation."""
    pos = inputs["positions"].detach().to(torch.float64)
    ei = inputs["edge_index"]
    if ei.shape[1] == 0:
        return torch.full((1,), math.inf, dtype=torch.float64, device=ei.device)
    vectors = pos[ei[1]] - pos[ei[0]] + inputs["shifts"].to(torch.float64)
    return vectors.norm(dim=1).min().reshape(1)


def pack(inputs: Dict[str, Tensor], out: Dict[str, Tensor], compute_stress: bool,
         shortest: Optional[Tensor] = None) -> Tensor:
    """All results of a padded call in one float64 vector, so that a step copies them to the
    host with one copy: ``[energy, shortest edge (Å), stress (9, if computed),
    node energies (N_pad), forces (3 N_pad), edge gradients (3 E_pad, if computed)]``
    (:func:`unpack` reads it).

    ``shortest``: :func:`shortest_edge` of ``inputs`` if already computed (the capture runs it
    on a side stream beside the model)."""
    if shortest is None:
        shortest = shortest_edge(inputs)
    parts = [out["energy"][:1], shortest]
    if compute_stress:
        parts.append(out["stress"][:1].reshape(-1))
    parts += [out["node_energy"].reshape(-1), out["forces"].reshape(-1)]
    if "edge_gradients" in out:
        parts.append(out["edge_gradients"].reshape(-1))
    return torch.cat([p.detach().to(torch.float64).reshape(-1) for p in parts])


def unpack(flat, n_atoms: int, n_pad: int, with_stress: bool, n_edges: Optional[int] = None
           ) -> Tuple[Dict[str, object], float]:
    """``(results, shortest edge)`` from a packed vector copied to the host (numpy float64):
    ``energy`` (float), ``node_energy [n_atoms]``, ``forces [n_atoms, 3]``, ``stress [3, 3]``
    (if packed), ``edge_gradients [n_edges, 3]`` (if packed: give ``n_edges``), as copies."""
    head = 11 if with_stress else 2
    results: Dict[str, object] = {"energy": float(flat[0])}
    if with_stress:
        results["stress"] = flat[2:11].reshape(3, 3).copy()
    results["node_energy"] = flat[head:head + n_atoms].copy()
    forces = flat[head + n_pad:head + 4 * n_pad].reshape(n_pad, 3)
    results["forces"] = forces[:n_atoms].copy()
    if n_edges is not None:
        start = head + 4 * n_pad
        results["edge_gradients"] = flat[start:start + 3 * n_edges].reshape(n_edges, 3).copy()
    return results, float(flat[1])


class PinnedResults:
    """The page-locked float64 host buffer a call's packed results (:func:`pack`) land in: one
    copy from the device, then one wait; grown as needed."""

    def __init__(self) -> None:
        self._host: Optional[Tensor] = None

    def fetch(self, packed: Tensor):
        """``packed [P]`` (float64, on a CUDA device) as a numpy view of the buffer, valid
        until the next fetch."""
        size = int(packed.numel())
        if self._host is None or self._host.numel() < size:
            self._host = torch.empty(size, dtype=torch.float64, pin_memory=True)
        self._host[:size].copy_(packed, non_blocking=True)
        torch.cuda.current_stream(packed.device).synchronize()
        return self._host.numpy()[:size]


def n_structures(batch: Dict[str, Tensor]) -> int:
    """``S``: the structures of a mace batch dict (``ptr [S + 1]``; one without ``ptr``)."""
    ptr = batch.get("ptr")
    return int(ptr.shape[0]) - 1 if torch.is_tensor(ptr) else 1


def static_inputs(batch: Dict[str, Tensor], n_pad: int, e_pad: int) -> Dict[str, Tensor]:
    """Zeroed static buffers of the bucket ``(n_pad, e_pad)`` with the layout of ``batch`` (``S``
    structures, :func:`n_structures`) and the dummy structure after them: per-node fields
    ``[N_pad, ...]``, per-edge ``[E_pad, ...]``, per-structure ``[S + 1, ...]``, cells
    ``[3 (S + 1), 3]``, ``ptr [S + 2]``. Labels and their weights are not model inputs and are
    left out."""
    n = int(batch["positions"].shape[0])
    s = n_structures(batch)
    inputs: Dict[str, Tensor] = {}
    for name, value in batch.items():
        if not torch.is_tensor(value) or name in LABELS or name.endswith("weight"):
            continue
        if name in PER_EDGE:
            shape = (2, e_pad) if name == "edge_index" else (e_pad, *value.shape[1:])
        elif name in CELLS:
            shape = (3 * (s + 1), 3)
        elif name == "ptr":
            shape = (s + 2,)
        elif name in PER_NODE or (value.dim() >= 1 and value.shape[0] == n and n > s):
            shape = (n_pad, *value.shape[1:])
        elif value.dim() >= 1 and value.shape[0] == s:
            shape = (s + 1, *value.shape[1:])
        else:
            continue
        inputs[name] = torch.zeros(shape, dtype=value.dtype, device=value.device)
    return inputs


def fill_static(entry: _Captured, batch: Dict[str, Tensor], pad: float) -> Set[str]:
    """Write ``batch`` (``S`` structures) and the padding around it into ``entry``'s static
    inputs (module docstring: the padding atoms are structure ``S``, their edges are longer
    than the cutoff ``< pad``); the names of the inputs written (those unchanged since the
    last fill are not)."""
    s = entry.inputs
    n, e = int(batch["positions"].shape[0]), int(batch["edge_index"].shape[1])
    n_pad = s["positions"].shape[0]
    structures = n_structures(batch)
    layout_changed = (n, e) != (entry.n_atoms, entry.n_edges)
    written: Set[str] = set()
    with torch.no_grad():
        for name, buf in s.items():
            value = batch[name]
            seen = entry.sources.get(name)
            if not layout_changed and seen is not None and seen[0] is value \
                    and seen[1] == value._version:
                continue
            entry.sources[name] = (value, value._version)
            written.add(name)
            if name == "edge_index":
                buf[:, :e].copy_(value)
                # padding edges join padding atoms to themselves, spread over all of them
                spread = torch.arange(buf.shape[1] - e, device=buf.device) % (n_pad - n)
                buf[:, e:].copy_((n + spread).to(buf.dtype).expand(2, -1))
            elif name in PER_EDGE:
                buf[:e].copy_(value)
                buf[e:].zero_()
                buf[e:, 0] = pad if name == "shifts" else 1  # one dummy cell vector
            elif name in CELLS:
                buf[:3 * structures].copy_(value.reshape(3 * structures, 3))
                eye = torch.eye(3, dtype=buf.dtype, device=buf.device)
                # the dummy structure: a cube of side pad (rcell is mace's 2 pi inv(cell^T))
                buf[3 * structures:].copy_(eye * (pad if name == "cell" else 2 * math.pi / pad))
            elif name == "ptr":
                buf[:structures + 1].copy_(value)
                buf[structures + 1:].fill_(n_pad)
            elif name == "batch":
                buf[:n].copy_(value)
                buf[n:].fill_(structures)
            elif buf.shape[0] == n_pad and name != "head":
                buf[:n].copy_(value)
                buf[n:].zero_()       # padding atoms: no element, no charge, at the origin
            else:                     # per structure: the dummy copies the first real one
                buf[:structures].copy_(value)
                buf[structures:].copy_(value[:1])
    if "edge_index" in written and entry.edges is not None:  # new list: new orderings
        entry.edges.refresh(s["edge_index"], entry.edge_keys)
    entry.n_atoms, entry.n_edges = n, e
    return written


def capture_pool(pool: Optional[Tuple], graphs_alive: bool) -> Tuple:
    """The memory pool a new capture shares: ``pool`` while a graph captured into it is alive,
    else a new one (torch frees a pool with its last graph, and reusing the handle after that
    trips an internal assertion in torch's allocator)."""
    return pool if pool is not None and graphs_alive else torch.cuda.graph_pool_handle()


def keep_edge_orderings(entry: _Captured) -> None:
    """Before a capture: keep the edge orderings (CSRs: two stable sorts) that the eager call
    before it built from ``entry``'s static ``edge_index`` outside the graph, which reads them;
    :func:`fill_static` rebuilds them in place when the edges change (MD: a new neighbour
    list). Where no fused op built them, they are built inside the graph."""
    n_pad = int(entry.inputs["positions"].shape[0])
    entry.edges = cached_graph(entry.inputs["edge_index"], n_pad)
    entry.edge_keys = tuple(entry.edges._derived) if entry.edges is not None else ()
    if entry.edges is None:
        forget_cached_graph()


class GraphedCall:
    """Energy + forces (+ stress) of ``model`` through CUDA graphs, one per shape bucket.

    Args:
        model: an (accelerated) MACE model on a CUDA device, parameters not requiring grad.
        r_max: the model's cutoff (Å); padding edges are made longer than it.
        max_graphs: how many captured buckets to keep.

    Call it with a one-structure mace batch dict (as :func:`mace_accel.models.batch.atoms_to_batch`
    makes it, on the model's device) and get ``{"energy": [1], "forces": [N, 3],
    "node_energy": [N], "stress": [1, 3, 3] (if asked), "edge_gradients": [E, 3] (if asked:
    dE/dv of each edge vector), "packed": [P] (:func:`pack`), "n_pad": N_pad}`` (views of the
    static outputs: copy them before the next call).
    """

    def __init__(self, model: torch.nn.Module, r_max: float, max_graphs: int = 8) -> None:
        self.model = model
        self.pad_length = 2.0 * float(r_max) + 1.0
        self.max_graphs = int(max_graphs)
        self._graphs: "collections.OrderedDict[Tuple, _Captured]" = collections.OrderedDict()
        self._pool = None
        self._watch: Optional[StateWatch] = None  # what the kept graphs were captured from
        self.n_captures = 0

    # -- public ---------------------------------------------------------------------------------
    def __call__(self, batch: Dict[str, Tensor], compute_stress: bool,
                 edge_gradients: bool = False) -> Dict[str, Tensor]:
        n_atoms = int(batch["positions"].shape[0])
        n_edges = int(batch["edge_index"].shape[1])
        key = (*padded_shape(n_atoms, n_edges), bool(compute_stress),
               batch["positions"].dtype, batch["positions"].device, bool(edge_gradients))
        entry = self._graphs.get(key)
        if entry is not None:
            self._graphs.move_to_end(key)
            if "node_attrs" in self._fill(entry, batch) and self._watch is not None:
                self._watch.cover(entry.inputs["node_attrs"])  # new elements: new tables
            if self._watch is None or self._watch.changed():
                self.drop("the model changed since its call was captured")
                entry = None
        if entry is None:
            entry = self._capture(key, batch, compute_stress, edge_gradients)
        entry.graph.replay()
        out = {"energy": entry.outputs["energy"][:1],
               "forces": entry.outputs["forces"][:n_atoms],
               "node_energy": entry.outputs["node_energy"][:n_atoms],
               "packed": entry.packed, "n_pad": key[0]}
        if compute_stress:
            out["stress"] = entry.outputs["stress"][:1]
        if edge_gradients:
            out["edge_gradients"] = entry.outputs["edge_gradients"][:n_edges]
        return out

    def drop(self, why: str = "") -> None:
        """Forget every captured graph (the next call of each bucket captures afresh)."""
        if self._graphs:
            log.info("mace-accel: dropped %d captured CUDA graph(s)%s", len(self._graphs),
                     f": {why}" if why else "")
        self._graphs.clear()
        self._watch = None

    @property
    def buckets(self) -> Tuple[Tuple[int, int, bool], ...]:
        """``(atoms, edges, stress)`` of every graph kept, oldest first."""
        return tuple(k[:3] for k in self._graphs)

    # -- padding --------------------------------------------------------------------------------
    def _static_inputs(self, key: Tuple, batch: Dict[str, Tensor]) -> Dict[str, Tensor]:
        return static_inputs(batch, key[0], key[1])

    def _fill(self, entry: _Captured, batch: Dict[str, Tensor]) -> Set[str]:
        return fill_static(entry, batch, self.pad_length)

    def padded_eager(self, batch: Dict[str, Tensor], compute_stress: bool,
                     edge_gradients: bool = False) -> Dict[str, Tensor]:
        """The padded call run eagerly (no graph): what a replay computes. For tests, and on
        devices without CUDA graphs."""
        n_atoms, n_edges = int(batch["positions"].shape[0]), int(batch["edge_index"].shape[1])
        key = (*padded_shape(n_atoms, n_edges), bool(compute_stress))
        entry = _Captured(None, self._static_inputs(key, batch), {}, 0, 0)
        self._fill(entry, batch)
        out = self._run(entry.inputs, compute_stress, edge_gradients)
        result = {"energy": out["energy"][:1], "forces": out["forces"][:n_atoms],
                  "node_energy": out["node_energy"][:n_atoms],
                  "packed": pack(entry.inputs, out, compute_stress), "n_pad": key[0],
                  "padding": {"energy": out["energy"][1:], "forces": out["forces"][n_atoms:]}}
        if compute_stress:
            result["stress"] = out["stress"][:1]
        if edge_gradients:
            result["edge_gradients"] = out["edge_gradients"][:n_edges]
        return result

    # -- capture --------------------------------------------------------------------------------
    def _run(self, inputs: Dict[str, Tensor], compute_stress: bool,
             edge_gradients: bool = False) -> Dict[str, Tensor]:
        # stress from the edges
        out = evaluate_model(self.model, dict(inputs), compute_stress, edge_gradients)
        keep = (("energy", "forces", "node_energy") + (("stress",) if compute_stress else ())
                + (("edge_gradients",) if edge_gradients else ()))
        return {k: out[k] for k in keep}

    def _capture(self, key: Tuple, batch: Dict[str, Tensor], compute_stress: bool,
                 edge_gradients: bool) -> _Captured:
        while len(self._graphs) >= self.max_graphs:
            old, _ = self._graphs.popitem(last=False)
            log.debug("mace-accel: dropped the CUDA graph of bucket %s", old[:3])
        entry = _Captured(torch.cuda.CUDAGraph(), self._static_inputs(key, batch), {}, 0, 0)
        self._fill(entry, batch)
        self._pool = capture_pool(self._pool, graphs_alive=bool(self._graphs))
        # warm up on a side stream (compiles the kernels, initialises cuBLAS), then capture
        side = side_stream("warm-up", batch["positions"].device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(entry.inputs, compute_stress, edge_gradients)
        torch.cuda.current_stream().wait_stream(side)
        # the warm-up's memory back to the device for the graph's own pool: a large structure's
        # capture then needs its working set once, not twice
        torch.cuda.synchronize(batch["positions"].device)
        torch.cuda.empty_cache()
        keep_edge_orderings(entry)
        try:
            with torch.cuda.graph(entry.graph, pool=self._pool):
                # the shortest-distance check needs no result of the model: beside it
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    shortest = shortest_edge(entry.inputs)
                entry.outputs = self._run(entry.inputs, compute_stress, edge_gradients)
                main.wait_stream(side)
                entry.packed = pack(entry.inputs, entry.outputs, compute_stress, shortest)
        except Exception as exc:  # anything the model does that a graph cannot hold
            forget_cached_graph()
            first = (str(exc).strip().splitlines() or [""])[0]
            raise CaptureError(f"{type(exc).__name__}: {first}") from exc
        # orderings first asked for inside the capture live in the graph's pool (rebuilt by
        # every replay): no eager call may reuse this graph object
        forget_cached_graph()
        watch = StateWatch(self.model)
        if self._watch is None or watch.key != self._watch.key:
            # the weights or the radial pairs changed since the other graphs were captured
            # (this capture's warm-up may have rebuilt derived tensors they point to)
            self.drop("the model changed since their calls were captured")
            self._watch = watch
        self._graphs[key] = entry
        self.n_captures += 1
        log.debug("mace-accel: captured a CUDA graph for %d atoms / %d edges (bucket %s)",
                  entry.n_atoms, entry.n_edges, key[:3])
        return entry


class CaptureError(RuntimeError):
    """The model's call could not be captured in a CUDA graph (it copies from the host,
    synchronises, or leaves work on a stream it does not join); run it eagerly."""


def graphs_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why whole-call CUDA graphs cannot be used on ``device``, or None."""
    if torch.device(device).type != "cuda":
        return f"CUDA graphs need a CUDA device, the model is on {device}"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    return None
