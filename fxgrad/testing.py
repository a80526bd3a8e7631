"""Helpers for graph-level tests of gradient policies.

Copy this pattern to pin what fxgrad inserts into your own model's backward
(refresh the expected text with ``EXPECTTEST_ACCEPT=1 pytest ...``)::

    import expecttest, torch, fxgrad
    from fxgrad.testing import inserted_code

    class TestPolicy(expecttest.TestCase):
        def test_clip(self):
            code = inserted_code(MyModel(), torch.randn(2, 8),
                                 transform=fxgrad.clip_by_global_norm(1.0))
            self.assertExpectedInline(code, '''...''')

The text is :meth:`fxgrad.Report.inserted`: only the nodes fxgrad added, with
the original gradients written ``grad['<parameter name>']``. It depends on the
policy and the parameter names, not on the rest of the backward graph, so it
stays stable across torch releases that change the backward itself.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch.nn as nn

from fxgrad.core.layers import DEFAULT_SKIP, SkipEntry
from fxgrad.core.rule import Transform
from fxgrad.frontend.backend import Backend
from fxgrad.frontend.explain import Report, explain
from fxgrad.passes import graphtext
from fxgrad.runtime.state import group_label

__all__ = ["backward_code", "inserted_code", "normalize_code", "report_for"]


def normalize_code(code: str) -> str:
    """``gm.code`` as stable text: no deletions or ``torch.ops.`` prefixes, state groups by label."""
    return graphtext.normalize_code(code, group_label)


def report_for(
    model: nn.Module,
    *args: Any,
    transform: Transform | None,
    skip: Iterable[SkipEntry] = DEFAULT_SKIP,
    compiler: str = "aot_eager",
    scope: str = "auto",
    **kwargs: Any,
) -> Report:
    """:func:`fxgrad.explain` with a backend built from ``transform``, ``skip``, ``compiler`` and
    ``scope`` (``"step"``: the step program's nodes; ``kwargs`` go to the model's forward)."""
    backend = Backend(transform, skip=skip, compiler=compiler, scope=scope)
    return explain(model, *args, backend=backend, **kwargs)


def inserted_code(model: nn.Module, *args: Any, transform: Transform, **kwargs: Any) -> str:
    """The nodes ``transform`` inserts into ``model``'s backward (with ``scope="step"``: the
    step program's), as stable text."""
    return report_for(model, *args, transform=transform, **kwargs).inserted


def backward_code(model: nn.Module, *args: Any, transform: Transform | None, **kwargs: Any) -> str:
    """The whole rewritten backward graph as normalized code."""
    return report_for(model, *args, transform=transform, **kwargs).backward_after
