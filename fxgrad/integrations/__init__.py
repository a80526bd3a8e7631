"""fxgrad in the trainers people already use: PyTorch Lightning and the Hugging Face ``Trainer``.

Each integration is a module of its own, imported on demand (its framework is an optional dependency)::

    from fxgrad.integrations.lightning import FxgradCallback       # pip install "fxgrad[lightning]"
    from fxgrad.integrations.transformers import prepare           # pip install transformers accelerate

This package holds what both share: choosing which of ``backend.stats()`` to log. Options, exactness
and limits: docs/integrations.md.

    >>> check_stats(["grad_norm/total*"])
    ('grad_norm/total*',)
"""

from __future__ import annotations

import fnmatch
from typing import Iterable

import torch

from fxgrad.core.warn import warn
from fxgrad.frontend.backend import Backend


def check_stats(stats: Iterable[str]) -> tuple[str, ...]:
    """``stats`` as a tuple of fnmatch patterns over statistic names (``()``: log none).

    Raises ``TypeError`` for a bare string (a pattern per character is never meant) or a non-string entry.
    """
    if isinstance(stats, str) or not isinstance(stats, Iterable):
        raise TypeError(f"stats must be a list of name patterns such as ['grad_norm/total*'], got {stats!r}")
    patterns = tuple(stats)
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:
        raise TypeError(f"stats must hold name patterns (str), got {bad[0]!r}")
    return patterns


def selected_stats(backend: Backend, stats: tuple[str, ...], prefix: str, told: set[str]) -> dict[str, torch.Tensor]:
    """``backend.stats()`` whose names match a pattern of ``stats``, renamed ``prefix + name``; on the device.

    Warns once per pattern (``told``: the patterns warned of) that matches no statistic, which
    would log nothing for ever: the statistics exist from the policy's first run. The default
    ``"*"`` over a policy that keeps none is no mistake."""
    if not stats:
        return {}
    values = backend.stats()
    unmatched = [p for p in stats if p not in told and not any(fnmatch.fnmatchcase(k, p) for k in values)]
    if unmatched and (values or stats != ("*",)):
        told.update(unmatched)
        kept = ", ".join(sorted(values)) or "none (fxgrad.monitor() keeps per-layer norms)"
        warn(
            f"fxgrad: stats {', '.join(map(repr, unmatched))} match no statistic of the policy, so nothing is "
            f"logged for them; its statistics: {kept}",
            UserWarning,
        )
    return {prefix + k: v for k, v in values.items() if any(fnmatch.fnmatchcase(k, p) for p in stats)}


def check_prefix(prefix: str) -> str:
    """``prefix`` if it is a string, else ``TypeError``."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str such as 'fxgrad/', got {prefix!r}")
    return prefix
