"""Check that a rewrite kept the backward graph's contract.

signature = output_signature(bw_gm)
...  # rewrite
check_outputs(bw_gm, signature)   # raises if a gradient changed shape or dtype
"""

from __future__ import annotations

from typing import NamedTuple

import torch.fx


class OutputSignature(NamedTuple):
    """Shape and dtype of each backward output (``None`` for empty slots)."""

    slots: tuple[tuple[tuple[str, ...], torch.dtype] | None, ...]


def _describe(node) -> tuple[tuple[str, ...], torch.dtype] | None:
    if not isinstance(node, torch.fx.Node):
        return None
    value = node.meta.get("val")
    if value is None:
        raise AssertionError(f"node {node.name} has no meta['val']")
    # str() keeps symbolic sizes comparable without installing shape guards.
    return tuple(str(size) for size in value.shape), value.dtype


def output_signature(gm: torch.fx.GraphModule) -> OutputSignature:
    return OutputSignature(tuple(_describe(n) for n in gm.graph.output_node().args[0]))


def check_outputs(gm: torch.fx.GraphModule, before: OutputSignature) -> None:
    """Raise ``AssertionError`` if the outputs' count, shapes or dtypes changed."""
    after = output_signature(gm)
    if len(after.slots) != len(before.slots):
        raise AssertionError(
            f"rewrite changed the number of backward outputs: {len(before.slots)} -> {len(after.slots)}"
        )
    for i, (old, new) in enumerate(zip(before.slots, after.slots)):
        if old != new:
            raise AssertionError(f"rewrite changed backward output {i}: {old} -> {new}")
