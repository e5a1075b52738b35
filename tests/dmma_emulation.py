"""The m16n8k8 float64 fragment layout of the PTX ISA in torch, lane by lane: what the CPU tests
of the DMMA kernels (test_silu_mlp_dmma.py) emulate the kernels with."""

from __future__ import annotations

import torch

from mace_accel.ops.radial.silu_mlp.spec import FRAG

LANE = torch.arange(32)
G, T = LANE // 4, LANE % 4


def mma(a, b):
    """One m16n8k8 product as the PTX ISA lays it out: ``a [32, 4]`` (a0..a3 per lane), ``b
    [32, 2]`` -> ``c [32, 4]``."""
    A = torch.zeros(16, 8, dtype=torch.float64)
    B = torch.zeros(8, 8, dtype=torch.float64)
    A[G, T], A[G + 8, T], A[G, T + 4], A[G + 8, T + 4] = a[:, 0], a[:, 1], a[:, 2], a[:, 3]
    B[T, G], B[T + 4, G] = b[:, 0], b[:, 1]
    C = A @ B
    return torch.stack([C[G, 2 * T], C[G, 2 * T + 1], C[G + 8, 2 * T], C[G + 8, 2 * T + 1]], 1)


def product(v, frag, kt_n, nt_n):
    """The template's ``product``: ``v [KT, 32, 4]`` fragments, ``frag`` the packed B."""
    frag = frag.view(kt_n, nt_n, 32, 2)
    out = torch.zeros(nt_n, 32, 4, dtype=torch.float64)
    for kt in range(kt_n):
        a = v[kt][:, [0, 2, 1, 3]]  # a0 = column 2t, a1 = row g + 8, a2 = column 2t + 1
        for nt in range(nt_n):
            out[nt] += mma(a, frag[kt, nt])
    return out


def load(m, tiles):
    """Rows 0..15 of ``m [16, W]`` in the fragment layout (zero past W)."""
    full = torch.zeros(16, FRAG * tiles, dtype=torch.float64)
    full[:, :m.shape[1]] = m
    return torch.stack([torch.stack([full[G, FRAG * nt + 2 * T], full[G, FRAG * nt + 2 * T + 1],
                                     full[G + 8, FRAG * nt + 2 * T],
                                     full[G + 8, FRAG * nt + 2 * T + 1]], 1)
                        for nt in range(tiles)])


def store(v, width):
    full = torch.zeros(16, FRAG * v.shape[0], dtype=torch.float64)
    for nt in range(v.shape[0]):
        full[G, FRAG * nt + 2 * T], full[G, FRAG * nt + 2 * T + 1] = v[nt][:, 0], v[nt][:, 1]
        full[G + 8, FRAG * nt + 2 * T] = v[nt][:, 2]
        full[G + 8, FRAG * nt + 2 * T + 1] = v[nt][:, 3]
    return full[:, :width]


