"""Fused operations, one subpackage per family (``conv_tp``, ``symmetric_contraction``, ...).

Each family has ``spec`` (a frozen problem read off a mace/e3nn module), ``schedule`` (the
plan, launch geometry included), ``codegen`` (plan -> CUDA source from ``kernels/<family>/``),
``autograd`` (``torch.library`` custom ops with fake and autograd implementations),
``reference`` (the same op in plain torch: the CPU backend and the oracle of every GPU test) and
``catalog`` (real problems, tagged). :mod:`.runtime` compiles and launches for all of them;
:mod:`.graph` holds the edge orderings the edge ops share.
"""
