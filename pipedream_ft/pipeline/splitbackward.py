"""The backward of a stage split in two: ``I``, the gradient of the stage's inputs (what the previous stage waits
for), and ``W``, the gradient of its weights (which nobody waits for, so a zero-bubble schedule runs it later, in
what would be idle time).

**How.** ``I`` runs autograd from the stage's outputs to its inputs only, keeping the graph. Autograd then runs
exactly the graph nodes from which an input can be reached (call them the *input path*); it skips the rest,
which only lead to weights. Before it runs, a hook is put on every input-path node that has an edge into that
rest (a *boundary* node: the matrix product that reads a weight, say) to keep the gradient that reaches it —
complete, since every node above a boundary node is on the input path too. ``W`` then starts autograd at those
nodes, with those gradients, and stops at the weights: it runs the weight-only part of the graph that ``I``
skipped, plus (where a boundary node feeds another) a little of the input path again. Outputs whose graph never
reaches an input (the first stage, whose inputs are data) are started from in ``W`` with their own gradients.

A boundary node reached in ``W`` both from its own start and from a boundary node above it would count the
gradient twice; a pre-hook during ``W`` replaces whatever arrives at it with the gradient kept in ``I``, which is
already the whole of it. The result equals one backward over inputs and weights up to the order of floating-point
sums (not bitwise: the gradients of a weight used twice are added in another order).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from . import engine

__all__ = ["WeightBackward", "input_backward"]


def _node(t: torch.Tensor) -> Any:
    return get_gradient_edge(t).node


def _reaches(roots: list[Any], targets: set[Any]) -> dict[Any, bool]:
    """For every node of the graph below ``roots``: whether one of ``targets`` can be reached from it."""
    memo: dict[Any, bool] = {}
    for root in roots:
        stack: list[tuple[Any, bool]] = [(root, False)]
        while stack:  # iterative post-order: graphs of long stages are deep
            node, expanded = stack.pop()
            if node in memo:
                continue
            children = [c for c, _ in node.next_functions if c is not None]
            if expanded:
                memo[node] = node in targets or any(memo.get(c, False) for c in children)
                continue
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in memo)
    return memo


class WeightBackward:
    """The ``W`` half of a split backward (see :func:`input_backward`): :meth:`run` once."""

    def __init__(self, groups: list[tuple[list[tuple[Any, int, torch.Tensor]], list[int]]],
                 kept: dict[Any, tuple[Any, ...]], weights: list[torch.Tensor],
                 direct: dict[int, torch.Tensor] | None = None) -> None:
        self._groups = groups
        self._direct = direct or {}
        """Gradients of weights that are outputs themselves (no graph between)."""
        self._kept = kept
        self._weights: list[torch.Tensor] | None = weights

    def run(self) -> tuple[torch.Tensor | None, ...]:
        """The gradient of each weight (``None``: the stage's outputs do not depend on it); frees the graph.
        Raises RuntimeError when called again."""
        if self._weights is None:
            raise RuntimeError("the weight half of a split backward runs once")
        groups, kept, weights = self._groups, self._kept, self._weights
        self._groups, self._kept, self._weights = [], {}, None
        out: list[torch.Tensor | None] = [None] * len(weights)  # filled group by group
        handles = [node.register_prehook(lambda _grads, saved=saved: saved) for node, saved in kept.items()]
        try:
            for k, (starts, which) in enumerate(groups):  # one autograd call per group: it stops at its weights
                # a node may lie on the paths of two groups (weights each used at two depths, with the input path
                # between them): the graph is kept until the last call
                got = engine.grad([GradientEdge(node, i) for node, i, _ in starts], [weights[w] for w in which],
                                  [g for _, _, g in starts], retain_graph=k < len(groups) - 1)
                for w, g in zip(which, got):
                    out[w] = g
        finally:
            for h in handles:
                h.remove()
        direct, self._direct = self._direct, {}
        return tuple(_plus(g, direct.get(i)) for i, g in enumerate(out))


def _group(starts: list[tuple[Any, int, torch.Tensor]], on_input_path: dict[Any, bool],
           weight_index: dict[Any, int]) -> list[tuple[list[tuple[Any, int, torch.Tensor]], list[int]]]:
    """Starts that reach a common weight (outside the input path) in one group, with the weights they reach: the
    weight half then runs autograd once per group, and each call goes no further than its group's weights (one
    call for all would recompute, from each start, the input path's gradients down to the other weights)."""
    reach: dict[Any, frozenset[int]] = {}

    def weights_below(node: Any) -> frozenset[int]:
        stack, order, seen = [node], [], set()
        while stack:  # the weight-only region below node, then its nodes deepest first
            n = stack.pop()
            if n in seen or n in reach:
                continue
            seen.add(n)
            order.append(n)
            stack += [c for c, _ in n.next_functions if c is not None and not on_input_path.get(c, False)]
        for n in reversed(order):
            own = frozenset((weight_index[n],)) if n in weight_index else frozenset()
            reach[n] = own.union(*(reach.get(c, frozenset()) for c, _ in n.next_functions
                                   if c is not None and not on_input_path.get(c, False)))
        return reach[node]

    def below_start(node: Any) -> frozenset[int]:  # a start on the input path: only its weight-only children
        if not on_input_path.get(node, False):
            return weights_below(node)
        return frozenset().union(*(weights_below(c) for c, _ in node.next_functions
                                   if c is not None and not on_input_path.get(c, False)))

    groups: list[tuple[list[tuple[Any, int, torch.Tensor]], set[int]]] = []
    for start in starts:
        ws = set(below_start(start[0]))
        if not ws:
            continue
        joined = [g for g in groups if g[1] & ws]
        merged = ([start], ws)
        for g in joined:
            merged[0].extend(g[0])
            merged[1].update(g[1])
            groups.remove(g)
        groups.append(merged)
    return [(members, sorted(ws)) for members, ws in groups]


def input_backward(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]
                   ) -> tuple[tuple[torch.Tensor | None, ...], WeightBackward]:
    """The ``I`` half: the gradient of each of ``inputs`` (``None`` where unused) given ``grads`` of ``roots``
    (``None`` for a scalar loss), and the :class:`WeightBackward` that computes the gradient of ``weights``
    later. ``inputs`` and ``weights`` must require gradients."""
    grads = [torch.ones_like(r) if g is None else g for r, g in zip(roots, grads)]
    # an output that is one of the leaves itself (an input passed on unchanged, a weight sent on as it is) has
    # no graph: its gradient is that leaf's, as it is
    direct_in: dict[int, torch.Tensor] = {}
    direct_w: dict[int, torch.Tensor] = {}
    through = [(r, g) for r, g in zip(roots, grads) if r.grad_fn is not None]
    for r, g in zip(roots, grads):
        if r.grad_fn is not None:
            continue
        for leaves, direct in ((inputs, direct_in), (weights, direct_w)):
            i = next((i for i, t in enumerate(leaves) if t is r), None)
            if i is not None:
                direct[i] = direct[i] + g if i in direct else g
                break
        else:
            raise ValueError("a root of a split backward is a leaf that is neither an input nor a weight "
                             f"(shape {list(r.shape)})")
    roots, grads = [r for r, _ in through], [g for _, g in through]
    root_nodes = [r.grad_fn for r in roots]
    input_nodes = {_node(t) for t in inputs}
    weight_nodes = {_node(t) for t in weights}
    on_input_path = _reaches(root_nodes, input_nodes) if inputs else {}
    to_weights = _reaches(root_nodes, weight_nodes)
    boundary = [n for n, on in on_input_path.items()
                if on and any(c is not None and to_weights.get(c, False) and not on_input_path.get(c, False)
                              for c, _ in n.next_functions)]
    kept: dict[Any, tuple[Any, ...]] = {}

    def keep(node: Any) -> Any:
        def hook(grad_outputs: tuple[Any, ...]) -> None:
            kept[node] = tuple(grad_outputs)
        return hook

    handles = [n.register_prehook(keep(n)) for n in boundary]
    try:
        if inputs and any(on_input_path.get(n, False) for n in root_nodes):
            pairs = [(r, g) for r, g in zip(roots, grads) if on_input_path.get(r.grad_fn, False)]
            in_grads = engine.grad([r for r, _ in pairs], inputs, [g for _, g in pairs], retain_graph=True)
        else:
            in_grads = (None,) * len(inputs)
    finally:
        for h in handles:
            h.remove()
    in_grads = tuple(_plus(g, direct_in.get(i)) for i, g in enumerate(in_grads))
    starts: list[tuple[Any, int, torch.Tensor]] = []
    for node, saved in kept.items():
        starts += [(node, i, g) for i, g in enumerate(saved) if g is not None]
    # outputs from which no input is reached: their weights' gradients start from the outputs themselves
    for r, g in zip(roots, grads):
        edge = get_gradient_edge(r)
        if not on_input_path.get(edge.node, False) and to_weights.get(edge.node, False):
            starts.append((edge.node, edge.output_nr, g))
    weight_index = {_node(t): i for i, t in enumerate(weights)}
    return in_grads, WeightBackward(_group(starts, on_input_path, weight_index), kept, list(weights), direct_w)


def _plus(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b
