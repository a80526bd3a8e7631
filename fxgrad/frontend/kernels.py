"""Which Inductor kernels hold the nodes fxgrad inserted: ``fxgrad.explain(..., kernels=True)``.

Inductor records, for every kernel it launches, the post-grad FX nodes the kernel
came from (its provenance tracking; :func:`fxgrad._compat.inductor_kernel_origins`
hands the records over, one generated module at a time). Here each kernel's nodes
are split into fxgrad's and the others, and printed in launch order::

    backward graph 0: 9 launches, 5 of them generated kernels
    kernel                                   model nodes  fxgrad nodes
    cpp_fused_sum_view_0                               2  fxgrad_mul_3, fxgrad_sum_3
    extern_kernels.mm                                  1  -
    cpp_fused_2                                        0  fxgrad_mul_2, fxgrad_sum_2  <- a separate pass

A node is fxgrad's when it is named ``fxgrad_*``, carries ``node.meta["fxgrad"]``, or
has the stack trace line ``fxgrad: <label>`` the recorder writes (the line also gives
each kernel the labels of the policy steps it computes).

What "holds" means: a node is in every kernel that computes it. Inductor recomputes
cheap pointwise nodes in each kernel that reads them instead of storing them (the
clip factor of a global norm is computed again in the kernel that scales the
gradients), so such a node is in several kernels. An extern kernel (``mm``) or a
fallback op (fxgrad's ``save_state``) holds only its own nodes: Inductor records for
it the nodes its inputs came from as well, and those are the ones whose users it
holds (without the graph: the ones a generated kernel computes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import textwrap
from typing import Callable, Iterator, Sequence

from fxgrad import _compat
from fxgrad.passes import PREFIX, TAG
from fxgrad.passes.capture import CapturedGraph

_STEP = "step program"
_IN_STEP = object()  # the owner of a module compiled in step_program()
_INSERTED_LINE = re.compile(rf"^({PREFIX}\w+) = ", re.MULTILINE)
_LINE_WIDTH = 110  # the fxgrad nodes column wraps here, or after 40 characters
_NAME_WIDTH = 40  # longer kernel names get a line of their own


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel launch: ``name`` as the generated code calls it, ``generated`` (``False``
    for an extern kernel or a fallback op), the fxgrad nodes and the other (``model``)
    nodes it computes, in graph order, and the labels of its fxgrad nodes (the comment
    lines of :attr:`fxgrad.Report.inserted`)."""

    name: str
    generated: bool
    fxgrad: tuple[str, ...]
    model: tuple[str, ...]
    labels: tuple[str, ...]

    @property
    def separate_pass(self) -> bool:
        """A generated kernel that computes only fxgrad's nodes."""
        return self.generated and bool(self.fxgrad) and not self.model


@dataclasses.dataclass(frozen=True)
class ProgramKernels:
    """The kernel launches of one compiled program (``"backward graph 0"``, ``"step program"``),
    in launch order; ``not_in_kernel``: fxgrad's nodes that no launch computes (views
    Inductor turned into indexing, nodes its passes removed)."""

    program: str
    kernels: tuple[Kernel, ...]
    not_in_kernel: tuple[str, ...]

    def holding(self, node: str) -> list[Kernel]:
        """The launches that compute ``node``."""
        return [k for k in self.kernels if node in k.fxgrad or node in k.model]

    def table(self) -> str:
        if not self.kernels:
            return f"{self.program}: no kernel launches"
        generated = sum(k.generated for k in self.kernels)
        lines = [f"{self.program}: {len(self.kernels)} launches, {generated} of them generated kernels"]
        width = max([len("kernel")] + [len(k.name) for k in self.kernels if len(k.name) <= _NAME_WIDTH])
        lines.append(f"{'kernel':<{width}}  model nodes  fxgrad nodes")
        indent = " " * (width + 15)
        for kernel in self.kernels:
            names = _wrap(kernel.fxgrad, max(40, _LINE_WIDTH - len(indent))) or ["-"]
            marker = ""
            if kernel.separate_pass:
                marker = "<- a separate pass"
            elif kernel.fxgrad and not kernel.generated:
                marker = "<- an extern call, not fused"
            if marker and len(indent) + len(names[-1]) + 2 + len(marker) > _LINE_WIDTH:
                names.append(marker)
            elif marker:
                names[-1] += "  " + marker
            name = kernel.name
            if len(name) > width:
                lines.append(name)
                name = ""
            lines.append(f"{name:<{width}}  {len(kernel.model):>11}  {names[0]}")
            lines += [indent + line for line in names[1:]]
        if self.not_in_kernel:
            wrapped = _wrap(self.not_in_kernel, _LINE_WIDTH - 17)
            lines += [f"not in a kernel: {wrapped[0]}"] + [f"{'':17}{line}" for line in wrapped[1:]]
        return "\n".join(line.rstrip() for line in lines)


def program_kernels(program: str, module: _compat.GeneratedModule, inserted: Sequence[str] = ()) -> ProgramKernels:
    """Sort the launches of ``module`` (see module docstring); ``inserted``: fxgrad's node
    names before Inductor's passes, so that nodes the passes removed are reported too."""
    position: dict[str, int] = {}
    labels: dict[str, str | None] = {}
    users: dict[str, set[str]] = {}
    if module.graph is not None:
        for i, node in enumerate(module.graph.nodes):
            position[node.name] = i
            labels[node.name] = _label(node)
            users[node.name] = {user.name for user in node.users}
    order = lambda name: (position.get(name, len(position)), name)  # noqa: E731
    held = [set(origins) for _, _, origins in module.launches]
    computed = set().union(*(nodes for (_, generated, _), nodes in zip(module.launches, held) if generated))
    extern_own: set[str] = set()
    for i, (_, generated, origins) in enumerate(module.launches):
        if generated:
            continue
        if users:  # its own nodes: those whose users it does not hold (the others made its inputs)
            held[i] = {n for n in held[i] if not users.get(n, set()) & held[i]}
            extern_own |= held[i]
        else:
            held[i] -= computed
    kernels = []
    for (name, generated, _), nodes in zip(module.launches, held):
        nodes = sorted(nodes - extern_own if generated else nodes, key=order)
        ours = [n for n in nodes if _ours(n, labels)]
        kernels.append(
            Kernel(
                name,
                generated,
                tuple(ours),
                tuple(n for n in nodes if n not in ours),
                tuple(dict.fromkeys(labels.get(n) or "fxgrad" for n in ours)),
            )
        )
    held = {n for kernel in kernels for n in kernel.fxgrad}
    ours_after = sorted((n for n in labels if _ours(n, labels)), key=order)
    missing = [n for n in dict.fromkeys([*inserted, *ours_after]) if n not in held]
    return ProgramKernels(program, tuple(kernels), tuple(missing))


class KernelCollector:
    """Collects the kernels of the backward graphs compiled in :meth:`capture`, and of the
    step programs compiled in :meth:`step_program`.

    A backward is matched to its graph through AOTAutograd's graph id: the forward
    ``N_forward`` is compiled right after the backend registered its graph, the
    backward is ``N_backward``.
    """

    def __init__(self, graphs: Callable[[], Sequence[CapturedGraph]]) -> None:
        self._graphs = graphs
        self._owners: dict[str, CapturedGraph] = {}
        self._modules: list[tuple[object, _compat.GeneratedModule]] = []  # owner: a CapturedGraph, _IN_STEP or None
        self._in_step = False

    def capture(self) -> contextlib.AbstractContextManager:
        return _compat.inductor_kernel_origins(self._on_module)

    @contextlib.contextmanager
    def step_program(self) -> Iterator[None]:
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False

    def _on_module(self, module: _compat.GeneratedModule) -> None:
        if self._in_step:
            self._modules.append((_IN_STEP, module))
            return
        number = module.aot_id.rpartition("_")[0] if module.aot_id else None
        if not module.is_backward:
            graphs = self._graphs()
            if number is not None and graphs:
                self._owners[number] = graphs[-1]
        else:
            self._modules.append((self._owners.get(number), module))

    def result(self, graphs: Sequence[CapturedGraph], stepped: bool) -> list[ProgramKernels]:
        """The backward graphs' programs by graph (their backwards compile last graph first),
        then the step program's; ``stepped``: a step program was asked for."""
        backwards, steps = [], []
        for owner, module in self._modules:
            if owner is _IN_STEP:
                steps.append(program_kernels(_STEP, module))
                continue
            index = next((i for i, graph in enumerate(graphs) if graph is owner), None)
            inserted = _INSERTED_LINE.findall(getattr(owner, "inserted", None) or "")
            label = f"backward graph {'?' if index is None else index}"
            backwards.append((len(graphs) if index is None else index, program_kernels(label, module, inserted)))
        if stepped and not steps:
            steps.append(ProgramKernels(f"{_STEP} (none compiled: the policy ran eagerly)", (), ()))
        return [program for _, program in sorted(backwards, key=lambda item: item[0])] + steps


def _label(node) -> str | None:
    """The fxgrad label of ``node``, ``None`` if fxgrad did not insert it."""
    if TAG in node.meta:
        return str(node.meta[TAG])
    trace = node.meta.get("stack_trace") or ""
    if trace.startswith("fxgrad: "):
        return trace[len("fxgrad: ") :].splitlines()[0]
    return "fxgrad" if node.name.startswith(PREFIX) else None


def _ours(name: str, labels: dict[str, str | None]) -> bool:
    return labels[name] is not None if name in labels else name.startswith(PREFIX)


def _wrap(names: Sequence[str], width: int) -> list[str]:
    return textwrap.wrap(", ".join(names), width=width, break_long_words=False, break_on_hyphens=False)
