"""Graph scope restarts from AOTAutograd's on-disk cache.

AOTAutograd keys its cache on the forward graph, before fxgrad rewrites the
backward, and a hit skips the rewrite. That loses two things: the policy's nodes
(the backward on disk may hold another policy's, or none), and what the rewrite
registers in this process: the device state that the graph's
``fxgrad::load_state`` and ``save_state`` name (``"g3"``), the callbacks that
read weights and the loss scale, the routes and the coverage checks.

So before the lookup the backend records the policy once more, into a
*stand-in* backward: a graph whose only nodes are one input per parameter that
requires grad, shaped like it. That makes every registration the real rewrite
makes, under the same names. The stand-in's code (the policy's ops, their
constants, the state groups they name), the policy and the skip list go into
the cache key, as the ``uuid`` of a post-grad pass that changes nothing
(:func:`fxgrad._compat.cache_keyed`). A hit is then a backward compiled for
this policy whose state names this process has just registered::

    stand_in = StandIn.record(graph, example_inputs, rewrite)
    patches = _compat.cache_keyed(patches, stand_in.key(policy_text))
    ...                                     # on a miss, the real rewrite, then:
    stand_in.covers(bw_gm)                  # False: compile it without the caches

On a miss the real backward is rewritten as before. If it names a state group
the stand-in did not (a parameter that requires grad got no gradient, so the
layers differ), it compiles without Inductor's FX graph cache, and AOTAutograd
saves no entry for it: a later process, which would only register the
stand-in's groups, never loads it.

The stand-in costs one more rewrite per compiled graph (the pass time in
docs/performance.md); a hit saves AOTAutograd's tracing and partitioning and
Inductor's compile.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, Sequence

import torch
import torch.fx
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fxgrad import _compat
from fxgrad.passes.capture import CapturedGraph
from fxgrad.runtime.state import groups_named


@dataclasses.dataclass(frozen=True)
class StandIn:
    """The policy recorded into a stand-in backward of one graph."""

    code: str
    groups: frozenset[str]  # the state groups its nodes name

    @classmethod
    def record(
        cls, graph: CapturedGraph, example_inputs: Sequence, rewrite: Callable[[torch.fx.GraphModule], None]
    ) -> StandIn | None:
        """``rewrite`` run on a stand-in backward of ``graph``; ``None`` when its parameters
        are not plain tensors (DTensors: the backward returns their local parts)."""
        values = [example_inputs[p.index] for p in graph.params]
        if any(isinstance(v, DTensor) or not isinstance(v, torch.Tensor) for v in values):
            return None
        gm = _stand_in_backward(graph, values)
        rewrite(gm)
        return cls(gm.code, groups_named(gm.graph))

    def key(self, policy: str) -> str:
        """The cache key part for this stand-in under ``policy`` (its text, with the skip list)."""
        return "fxgrad-" + hashlib.sha256(f"{policy}\n{self.code}".encode()).hexdigest()

    def covers(self, gm: torch.fx.GraphModule) -> bool:
        """Whether the real rewritten backward ``gm`` names no state group the stand-in did not."""
        return groups_named(gm.graph) <= self.groups


def _stand_in_backward(graph: CapturedGraph, values: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    """A backward of ``graph`` that returns an input like each parameter that requires grad
    (contiguous, same dtype and device) and ``None`` for every other forward input."""
    fx = torch.fx.Graph()
    fake_mode = _compat.detect_fake_mode([]) or _compat.new_fake_mode()  # Dynamo's, while it compiles
    outputs: list[torch.fx.Node | None] = [None] * graph.num_inputs
    for p, value in zip(graph.params, values):
        if value.requires_grad:
            node = fx.placeholder(f"grad_{p.index}")
            with fake_mode:
                node.meta["val"] = torch.empty(value.shape, dtype=value.dtype, device=value.device)
            outputs[p.index] = node
    fx.output(outputs)
    return torch.fx.GraphModule(nn.Module(), fx)
