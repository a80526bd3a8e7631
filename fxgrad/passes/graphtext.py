"""Readable, stable text for backward graphs.

``normalize_code`` strips what changes between runs and adds nothing for a
reader (``;  x = None`` deletions, ``torch.ops.`` prefixes, blank lines).
``render_inserted`` prints only the nodes fxgrad inserted, with the original
gradients named after their parameters::

    # clip_by_global_norm(max_norm=1.0) on [fc]
    fxgrad_mul = aten.mul.Tensor(grad['fc.weight'], grad['fc.weight'])
    ...
    return {
        'fc.weight': fxgrad_mul_2,
    }
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, Mapping

import torch.fx

from fxgrad import passes

_DELETIONS = re.compile(r";\s+[\w\s=]+= None$")
_GROUP_NAME = re.compile(r"'([gx]\d+)'")


def normalize_code(code: str, group_label: Callable[[str], str | None] = lambda name: None) -> str:
    """``gm.code`` without variable deletions, ``torch.ops.`` prefixes and blank lines;
    state group names become their labels (``<stats>``) where ``group_label`` knows them."""
    lines = []
    for line in code.splitlines():
        line = _DELETIONS.sub("", line.rstrip()).replace("torch.ops.", "")
        line = _GROUP_NAME.sub(lambda m: f"<{group_label(m.group(1)) or m.group(1)}>", line)
        if line.strip():
            lines.append(line)
    return "\n".join(lines) + "\n"


def render_inserted(
    gm: torch.fx.GraphModule,
    gradient_names: Mapping[torch.fx.Node, str],
    outputs: Mapping[str, torch.fx.Node],
    group_label: Callable[[str], str | None] = lambda name: None,
) -> str:
    """The inserted nodes, one line each, grouped under a comment per route.

    ``gradient_names`` names the original gradient nodes (``grad['fc.weight']``);
    ``outputs`` maps parameter names to the nodes that now hold their gradients;
    ``group_label`` names state groups, as in :func:`normalize_code`.
    """
    arg = functools.partial(_arg, names=gradient_names, group_label=group_label)
    lines: list[str] = []
    label = None
    for node in passes.inserted_nodes(gm):
        if node.meta[passes.TAG] != label:
            label = node.meta[passes.TAG]
            lines.append(f"# {label}")
        args = [arg(a) for a in node.args]
        args += [f"{k}={arg(v)}" for k, v in node.kwargs.items()]
        lines.append(f"{node.name} = {_target(node)}({', '.join(args)})")
    lines.append("return {")
    lines += [f"    {name!r}: {arg(node)}," for name, node in outputs.items()]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _target(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    name = str(target)
    return name if "." in name and not name.startswith("<") else getattr(target, "__name__", name)


def _arg(value: Any, names: Mapping[torch.fx.Node, str], group_label: Callable[[str], str | None]) -> str:
    if isinstance(value, torch.fx.Node):
        return f"grad[{names[value]!r}]" if value in names else value.name
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_arg(v, names, group_label) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, str) and group_label(value) is not None:
        return f"<{group_label(value)}>"  # state group names are process-specific
    return repr(value)
