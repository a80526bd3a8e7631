"""The one rule by which ``skip``, ``by_type``, ``by_name`` and ``rescale(multipliers=...)`` pick layers.

A key is an ``nn.Module`` type or a pattern string:

* a type matches a layer whose module is an instance of it (``issubclass`` on
  the layer's module type);
* a string is a case-sensitive ``fnmatch`` pattern, matched against the
  layer's qualified name (``blocks.0.fc``) and against its module's class name
  (``LlamaRMSNorm``).

In a list or a mapping of keys, the first matching key wins. ``by_type`` takes
types only and ``by_name`` strings only; ``skip`` and ``multipliers`` take both.

    >>> import torch.nn as nn
    >>> reason(nn.Linear, "fc", nn.Linear), reason("*Norm*", "ln_f", nn.LayerNorm), reason("blocks.*", "fc", nn.Linear)
    ('is a Linear', "class LayerNorm matches '*Norm*'", None)
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Any, Iterable, Sequence, TypeVar

import torch.nn as nn

if TYPE_CHECKING:
    from fxgrad.core.layers import Layer

Key = type | str
K = TypeVar("K")


def reason(key: Key, name: str, module_type: type | None) -> str | None:
    """Why ``key`` matches the layer ``name`` (a module of ``module_type``), or ``None``."""
    if isinstance(key, str):
        if module_type is not None and fnmatch.fnmatchcase(module_type.__name__, key):
            return f"class {module_type.__name__} matches {key!r}"
        if fnmatch.fnmatchcase(name, key):
            return f"name matches {key!r}"
        return None
    if module_type is not None and issubclass(module_type, key):
        article = "an" if key.__name__[:1] in "AEIOU" else "a"  # an Embedding, a LayerNorm
        return f"is {article} {key.__name__}"
    return None


def matches(key: Key, layer: Layer) -> bool:
    return reason(key, layer.name, layer.module_type) is not None


def first_match(keys: Iterable[K], layer: Layer, key_of=lambda entry: entry) -> K | None:
    """The first of ``keys`` (or entries whose key is ``key_of(entry)``) that matches ``layer``."""
    return next((entry for entry in keys if matches(key_of(entry), layer)), None)


def route_by_first_match(
    keys: Sequence[K], layers: Iterable[Layer], key_of=lambda entry: entry
) -> tuple[list[list[Layer]], list[Layer]]:
    """The layers that each of ``keys`` matches first, and those none matches; layers the skip
    list leaves alone in neither."""
    groups: list[list[Layer]] = [[] for _ in keys]
    rest: list[Layer] = []
    for layer in layers:
        if layer.skip_reason is not None:
            continue
        index = first_match(range(len(keys)), layer, key_of=lambda i: key_of(keys[i]))
        (rest if index is None else groups[index]).append(layer)
    return groups, rest


def check_key(argument: str, key: Any, *, types: bool = True, patterns: bool = True, hint: str = "") -> Key:
    """``key`` if it is an allowed kind of key; ``TypeError`` or ``ValueError`` naming ``argument``."""
    if patterns and isinstance(key, str):
        if not key:
            raise ValueError(f"{argument} must be non-empty patterns, got ''")
        return str(key)  # numpy.str_ as str: the repr evaluates back
    if types and isinstance(key, type) and issubclass(key, nn.Module):
        return key
    kinds = " or ".join(
        kind for kind, allowed in (("nn.Module subclasses", types), ("fnmatch pattern strings", patterns)) if allowed
    )
    raise TypeError(f"{argument} must be {kinds}, got {key!r} ({type(key).__name__}){hint}")


def key_repr(key: Key) -> str:
    """A type by its import path, ``torch.nn``'s by the public one, a pattern as a string
    literal, so a ``repr`` evaluates back: ``{torch.nn.Conv2d: 3.0, '*.q_proj': 1.3}``."""
    if not isinstance(key, type):
        return repr(key)
    if key.__module__.startswith("torch.nn.") and getattr(nn, key.__name__, None) is key:
        return f"torch.nn.{key.__name__}"
    return f"{key.__module__}.{key.__qualname__}"
