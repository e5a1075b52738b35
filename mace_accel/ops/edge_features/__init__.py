"""Edge features of a MACE model as fused ops: spherical harmonics and the radial embedding.

``edge_attrs = Y(vectors)`` (e3nn ``SphericalHarmonics``) and ``edge_feats, cutoff =
radial_embedding(lengths)`` (mace ``RadialEmbeddingBlock``: Bessel basis times polynomial
cutoff), each one op with its own forward, backward and double-backward kernel, generated from
the module's constants (:mod:`.spec`) by sympy (:mod:`.symbolic`, :mod:`.codegen`).
"""
