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


class StatsLog:
    """Which of ``backend.stats()`` a callback logs (``patterns``, fnmatch), renamed ``prefix + name``,
    and the patterns no logging step has matched yet.

    Per-layer statistics exist only for the layers that got a gradient in the latest step (a branch
    taken on some steps, a layer unfrozen later), so a pattern is only known to log nothing once the
    run is over: :meth:`tell_unmatched` at the end of training warns for those."""

    def __init__(self, patterns: tuple[str, ...], prefix: str) -> None:
        self.patterns, self.prefix = patterns, prefix
        self.unmatched = set(patterns)
        self.logged = False

    def select(self, backend: Backend) -> dict[str, torch.Tensor]:
        """The statistics to log now, on the device."""
        if not self.patterns:
            return {}
        values = backend.stats()
        self.logged = True
        self.unmatched -= {p for p in self.unmatched if any(fnmatch.fnmatchcase(k, p) for k in values)}
        return {self.prefix + k: v for k, v in values.items() if any(fnmatch.fnmatchcase(k, p) for p in self.patterns)}

    def tell_unmatched(self, backend: Backend) -> None:
        """Warn once for the patterns no logging step matched: they logged nothing (a typo, a rule the
        policy lacks). The default ``"*"`` over a policy that keeps no statistic is no mistake."""
        left = [p for p in self.patterns if p in self.unmatched]
        if not self.logged or not left or (left == ["*"] and not backend.stats()):
            return
        self.unmatched -= set(left)
        kept = ", ".join(sorted(backend.stats())) or "none (fxgrad.monitor() keeps per-layer norms)"
        warn(
            f"fxgrad: stats {', '.join(map(repr, left))} matched no statistic of the policy at any logging step, "
            f"so nothing was logged for them; its statistics now: {kept}",
            UserWarning,
        )


def check_prefix(prefix: str) -> str:
    """``prefix`` if it is a string, else ``TypeError``."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str such as 'fxgrad/', got {prefix!r}")
    return prefix
