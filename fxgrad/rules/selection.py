"""Selection: ``by_type`` and ``by_name`` route layers to transforms.

    >>> import torch.nn as nn, fxgrad
    >>> fxgrad.by_type({nn.LSTM: fxgrad.clip_by_norm(0.5)}, default=fxgrad.clip_by_norm(1.0))
    by_type({torch.nn.LSTM: clip_by_norm(max_norm=0.5)}, default=clip_by_norm(max_norm=1.0))

Routers (``by_type``, ``by_name``) hand each non-skipped layer to the first
matching entry, in mapping order; ``default`` gets the rest (``None`` leaves
them untouched). A transform that reduces across its layers under a router, such as
``clip_by_global_norm``, reduces over the layers routed to it: that is
clipping per layer type.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from fxgrad.core import match
from fxgrad.core.layers import WHAT_IS_A_LAYER, Layer
from fxgrad.core.rule import Leaf, Route, Transform, check_transform, listed


def _names(layers: Sequence[Layer], limit: int = 3) -> str:
    return listed([layer.name for layer in layers], limit)


@dataclasses.dataclass(frozen=True, repr=False)
class _Router(Transform):
    entries: tuple[tuple[Any, Transform], ...]
    default: Transform | None = None

    name = ""

    def __repr__(self) -> str:
        body = ", ".join(f"{match.key_repr(k)}: {t!r}" for k, t in self.entries)
        default = f", default={self.default!r}" if self.default is not None else ""
        return f"{self.name}({{{body}}}{default})"

    def routes(self, layers: Sequence[Layer]) -> list[Route]:
        groups, rest = self._route(layers)
        routed = [r for (_, t), group in zip(self.entries, groups) for r in t.routes(group)]
        if self.default is not None:
            routed += self.default.routes(rest)
        return routed

    def unrouted_leaves(self) -> list[Leaf]:
        return []

    def named(self, layers: Sequence[Layer]) -> list[set[str]]:
        groups, rest = self._route(layers)
        keyed = [{layer.name for layer in group} for group in groups]  # the default is no key: every other layer
        inner = [chosen for (_, t), group in zip(self.entries, groups) for chosen in t.named(group)]
        return keyed + inner + (self.default.named(rest) if self.default is not None else [])

    def _route(self, layers: Sequence[Layer]) -> tuple[list[list[Layer]], list[Layer]]:
        """The non-skipped layers of each entry (first match wins), and the rest."""
        return match.route_by_first_match(self.entries, layers, key_of=lambda entry: entry[0])

    def unmatched(self, layers: Sequence[Layer]) -> list[str]:
        groups, rest = self._route(layers)
        out = []
        for (key, transform), group in zip(self.entries, groups):
            if group:
                out += transform.unmatched(group)
                continue
            matching = [layer for layer in layers if match.matches(key, layer)]
            skipped = [layer for layer in matching if layer.skip_reason is not None]
            entry = f"{self.name} key {match.key_repr(key)}"
            if skipped and len(skipped) == len(matching):
                out.append(
                    f"{entry} reaches no layer: the skip list leaves alone all it matches "
                    f"({_names(skipped)}: {skipped[0].skip_reason}); a skip= list without that entry "
                    "would let it treat them"
                )
            elif matching:
                out.append(f"{entry} reaches no layer: earlier keys took all it matches ({_names(matching)})")
            else:
                out.append(f"{entry} matches no layer ({WHAT_IS_A_LAYER})")
        if self.default is not None and rest:
            out += self.default.unmatched(rest)
        return out


class ByType(_Router):
    """See :func:`by_type`."""

    name = "by_type"


class ByName(_Router):
    """See :func:`by_name`."""

    name = "by_name"


def _entries(argument: str, mapping: Any, check_key, default: Any) -> tuple[tuple[Any, Transform], ...]:
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{argument} must be a dict, got {type(mapping).__name__}")
    if not mapping and default is None:
        raise ValueError(f"{argument} is empty and there is no default: it would route no layer")
    return tuple((check_key(key), check_transform(f"{argument}[{key!r}]", value)) for key, value in mapping.items())


def _module_type(key: Any) -> type:
    return match.check_key("by_type keys", key, patterns=False, hint="; use by_name for patterns")


def _pattern(key: Any) -> str:
    return match.check_key("by_name keys", key, types=False, hint="; use by_type for module types")


def _default(default: Any) -> Transform | None:
    return check_transform("default", default, optional=True)


def by_type(mapping: Mapping[type, Transform], default: Transform | None = None) -> ByType:
    """Route each layer by ``isinstance`` on its module; the first match wins.

    >>> import torch.nn as nn, fxgrad
    >>> fxgrad.by_type({nn.Conv2d: fxgrad.rescale(alpha=0.5)})
    by_type({torch.nn.Conv2d: rescale(alpha=0.5, target='mean')})
    """
    return ByType(_entries("mapping", mapping, _module_type, default), _default(default))


def by_name(mapping: Mapping[str, Transform], default: Transform | None = None) -> ByName:
    """Route each layer by pattern; the first match wins.

    A pattern is matched against the layer's qualified name and its class
    name (see :mod:`fxgrad.core.match`).

        >>> import fxgrad
        >>> fxgrad.by_name({"policy.*": fxgrad.rescale(alpha=0.3), "value.*": fxgrad.rescale(alpha=0.7)})
        by_name({'policy.*': rescale(alpha=0.3, target='mean'), 'value.*': rescale(alpha=0.7, target='mean')})
    """
    return ByName(_entries("mapping", mapping, _pattern, default), _default(default))
