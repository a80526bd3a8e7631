"""Composition: ``chain`` applies transforms one after the other.

>>> import fxgrad
>>> fxgrad.chain(fxgrad.rescale(alpha=0.5), fxgrad.clip_by_global_norm(1.0))
chain(rescale(alpha=0.5, target='mean'), clip_by_global_norm(max_norm=1.0))
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from fxgrad.core.layers import Layer
from fxgrad.core.rule import Leaf, Route, Transform, check_transform


@dataclasses.dataclass(frozen=True, repr=False)
class Chain(Transform):
    """See :func:`chain`."""

    transforms: tuple[Transform, ...]

    def __repr__(self) -> str:
        return f"chain({', '.join(map(repr, self.transforms))})"

    def routes(self, layers: Sequence[Layer]) -> list[Route]:
        return [route for t in self.transforms for route in t.routes(layers)]

    def unrouted_leaves(self) -> list[Leaf]:
        return [leaf for t in self.transforms for leaf in t.unrouted_leaves()]

    def unmatched(self, layers: Sequence[Layer]) -> list[str]:
        return [why for t in self.transforms for why in t.unmatched(layers)]

    def named(self, layers: Sequence[Layer]) -> list[set[str]]:
        return [chosen for t in self.transforms for chosen in t.named(layers)]


def chain(*transforms: Transform) -> Chain:
    """Apply ``transforms`` one after the other, each to the previous one's output.

    >>> import fxgrad
    >>> fxgrad.chain(fxgrad.clip_by_value(5.0), fxgrad.clip_by_global_norm(1.0))
    chain(clip_by_value(clip_value=5.0), clip_by_global_norm(max_norm=1.0))
    """
    if not transforms:
        raise ValueError("chain() needs at least one transform")
    return Chain(tuple(check_transform(f"chain() argument {i}", t) for i, t in enumerate(transforms)))
