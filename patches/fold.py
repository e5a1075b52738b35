"""Whether an interaction block lets its radial MLP's last layer be folded into the conv.

With the fold, the block's ``conv_tp_weights`` returns the MLP's last hidden activations
``h [E, hidden]`` and its ``conv_tp`` applies the last layer, ``tp_weights = h @ W``. That is
exact only if the block's ``forward`` does nothing to ``tp_weights`` between the two but scale
each edge's row (mace multiplies by the cutoff ``[E, 1]``, which commutes with ``@ W``). This
module proves that from the forward's source (its syntax tree), so a block class we have not
seen is left unfolded, with the reason, instead of silently computing something else.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Dict, Optional

import torch

NAME = "tp_weights"


def _parents(tree: ast.AST) -> Dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _is_self_call(node: ast.AST, attr: str) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == attr and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self")


def _is_name(node: ast.AST, ctx=ast.Load) -> bool:
    return isinstance(node, ast.Name) and node.id == NAME and isinstance(node.ctx, ctx)


def _row_scaling(node: ast.AST) -> bool:
    """``tp_weights * other`` or ``other * tp_weights`` with ``other`` a plain name."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
        return False
    sides = (node.left, node.right)
    return any(_is_name(s) for s in sides) and all(
        _is_name(s) or (isinstance(s, ast.Name) and s.id != NAME) for s in sides)


def _allowed(name: ast.Name, parents: Dict[ast.AST, ast.AST]) -> bool:
    parent = parents.get(name)
    if isinstance(name.ctx, ast.Store):  # tp_weights = self.conv_tp_weights(..) | tp_weights * c
        return (isinstance(parent, ast.Assign) and parent.targets == [name]
                and (_is_self_call(parent.value, "conv_tp_weights")
                     or _row_scaling(parent.value)))
    if _row_scaling(parent):
        assign = parents.get(parent)
        return isinstance(assign, ast.Assign) and len(assign.targets) == 1 and \
            _is_name(assign.targets[0], ast.Store)
    return _is_self_call(parent, "conv_tp") and name in parent.args


def fold_reason(block: torch.nn.Module) -> Optional[str]:
    """Why the radial MLP's last layer cannot be folded into ``block``'s conv, or None."""
    cls = type(block)
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError) as exc:
        return f"the source of {cls.__name__}.forward cannot be read to check the fold ({exc})"
    parents = _parents(tree)
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == NAME]
    if not any(_is_self_call(parents.get(n), "conv_tp") for n in uses):
        return f"{cls.__name__}.forward does not pass {NAME} to self.conv_tp"
    for n in uses:
        if not _allowed(n, parents):
            line = ast.get_source_segment(source, parents.get(n, n)) or "?"
            return (f"{cls.__name__}.forward uses {NAME} in `{line.strip()}`, which the fold "
                    "cannot prove to be a per-edge scaling")
    return None
