"""A stage's backward in two passes: input gradients first (the previous stage waits for them), weight gradients later.

Zero-bubble schedules run the weight-gradient pass in time the stage would otherwise
idle. The split follows the autograd graph, so no work is done twice: the input pass
computes the gradients along every path from the outputs to the stage's inputs and, on
the way, notes the gradient arriving at each node where a path to a parameter branches
off that road (a Linear's matmul, say); the weight pass restarts from exactly those
nodes, with those gradients, towards the parameters only. Parameters whose branches meet
(a weight used twice) are done in one pass, in which each branch node's noted gradient
replaces whatever else reaches it, so nothing is counted twice. Gradients land in `.grad`
through torch.autograd.backward, so hooks on gradient accumulation (the replicas'
averaging) see them as after an ordinary backward. Internal to replicator.pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightGradient", "backward_input"]


class WeightGradient:
    """The deferred weight-gradient pass of one micro-batch; `run()` once."""

    def __init__(self, passes: list[Callable[[], None]]) -> None:
        self._passes = passes

    def run(self) -> None:
        passes, self._passes = self._passes, []
        for run_pass in passes:
            run_pass()


def backward_input(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor] | None,
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightGradient]:
    """The gradients of `inputs` now, and the pass that will accumulate those of `params` into `.grad`.

    `outputs` are the stage's outputs that need a gradient with their gradients `grads`
    (or a scalar loss and None). An input that needs no gradient gets None. Without any
    input that needs a gradient (the first stage), the whole backward waits for the
    weight pass.
    """
    roots, root_grads = list(outputs), (list(grads) if grads is not None else None)
    wanted = [x for x in inputs if x.requires_grad]
    trainable = [p for p in params if p.requires_grad]
    if not roots:
        return [None] * len(inputs), WeightGradient([])
    if not wanted:
        def whole() -> None:
            torch.autograd.backward(roots, root_grads)
        return [None] * len(inputs), WeightGradient([whole])
    graph = _Graph(roots, wanted, trainable)
    noted: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def noter(node: Node) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def note(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            noted[node] = grad_outputs
        return note

    handles = [node.register_prehook(noter(node)) for node in graph.branch_nodes]
    try:
        found = torch.autograd.grad(roots, wanted, root_grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    by_input = dict(zip(map(id, wanted), found))
    input_grads = [by_input.get(id(x)) for x in inputs]
    passes = []
    for members, group_params in graph.groups():
        edges: list[GradientEdge] = []
        seeds: list[torch.Tensor] = []
        for member in members:
            if isinstance(member, int):  # an output whose gradient reaches parameters only
                edges.append(get_gradient_edge(roots[member]))
                seeds.append(root_grads[member] if root_grads is not None else torch.ones_like(roots[member]))
                continue
            for k, grad in enumerate(noted.get(member, ())):
                if grad is not None:
                    edges.append(GradientEdge(member, k))
                    seeds.append(grad)
        if edges:
            replace = [m for m in members if not isinstance(m, int)] if len(members) > 1 else []
            passes.append(_weight_pass(edges, seeds, group_params, replace, noted))
    return input_grads, WeightGradient(passes)


def _weight_pass(edges: list[GradientEdge], seeds: list[torch.Tensor], params: list[torch.Tensor],
                 replace: list[Node], noted: dict[Node, tuple[torch.Tensor | None, ...]]) -> Callable[[], None]:
    def run() -> None:
        # Where several branch nodes feed the same parameters, one may lie downstream of
        # another: its noted gradient already holds what flows to it, so it replaces it.
        handles = [node.register_prehook(lambda _, saved=noted[node]: saved) for node in replace if node in noted]
        try:
            torch.autograd.backward(edges, seeds, inputs=params)
        finally:
            for handle in handles:
                handle.remove()
    return run


class _Graph:
    """The stage's autograd graph from its outputs: which nodes lead to the inputs, where parameter branches start."""

    def __init__(self, roots: list[torch.Tensor], inputs: list[torch.Tensor], params: list[torch.Tensor]) -> None:
        self.param_of: dict[Node, torch.Tensor] = {get_gradient_edge(p).node: p for p in params}
        input_nodes = {get_gradient_edge(x).node for x in inputs}
        self.root_nodes = [get_gradient_edge(t).node for t in roots]
        children: dict[Node, list[Node]] = {}
        parents: dict[Node, list[Node]] = {}
        stack = list(dict.fromkeys(self.root_nodes))
        while stack:
            node = stack.pop()
            if node in children:
                continue
            children[node] = [child for child, _ in node.next_functions if child is not None]
            for child in children[node]:
                parents.setdefault(child, []).append(node)
                if child not in children:
                    stack.append(child)
        self.children = children
        self.to_input = _ancestors(input_nodes & children.keys(), parents)
        self._reach: dict[Node, frozenset[Node]] = {}
        # A branch node leads to the inputs and has a child that leads to parameters but not to the inputs.
        self.branch_nodes = [node for node in children if node in self.to_input and self._branch_params(node)]
        self.weight_roots = [k for k, node in enumerate(self.root_nodes)
                             if node not in self.to_input and self._params_below(node)]

    def _branch_params(self, node: Node) -> frozenset[Node]:
        found: set[Node] = set()
        for child in self.children[node]:
            if child not in self.to_input:
                found |= self._params_below(child)
        return frozenset(found)

    def _params_below(self, node: Node) -> frozenset[Node]:
        """The parameter nodes reachable from `node` without passing through a node that leads to the inputs."""
        if node in self._reach:
            return self._reach[node]
        found: set[Node] = set()
        seen, stack = {node}, [node]
        while stack:
            current = stack.pop()
            if current in self.param_of:
                found.add(current)
            for child in self.children.get(current, ()):
                if child not in seen and child not in self.to_input:
                    seen.add(child)
                    stack.append(child)
        self._reach[node] = frozenset(found)
        return self._reach[node]

    def groups(self) -> list[tuple[list[Any], list[torch.Tensor]]]:
        """Branch nodes (and weight-only outputs, by index) joined when they share parameters, with those parameters."""
        members: list[Any] = [*self.branch_nodes, *self.weight_roots]
        reach = [self._branch_params(m) if not isinstance(m, int) else self._params_below(self.root_nodes[m])
                 for m in members]
        leader = list(range(len(members)))

        def find(k: int) -> int:
            while leader[k] != k:
                leader[k] = leader[leader[k]]
                k = leader[k]
            return k

        owner: dict[Node, int] = {}
        for k, params in enumerate(reach):
            for param in params:
                if param in owner:
                    leader[find(k)] = find(owner[param])
                else:
                    owner[param] = k
        joined: dict[int, tuple[list[Any], set[Node]]] = {}
        for k, member in enumerate(members):
            entry = joined.setdefault(find(k), ([], set()))
            entry[0].append(member)
            entry[1].update(reach[k])
        return [(group, [self.param_of[node] for node in nodes]) for group, nodes in joined.values()]


def _ancestors(nodes: set[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """`nodes` and every node from which one of them can be reached."""
    found, stack = set(nodes), list(nodes)
    while stack:
        for parent in parents.get(stack.pop(), ()):
            if parent not in found:
                found.add(parent)
                stack.append(parent)
    return found
