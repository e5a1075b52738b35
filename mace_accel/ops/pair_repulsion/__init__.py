"""mace's ZBL pair repulsion (``ZBLBasis``) as one op: per atom, the sum of half the screened
Coulomb repulsion of each edge it receives (:mod:`.spec`, :mod:`.reference`, :mod:`.cuda`,
:mod:`.autograd`)."""
