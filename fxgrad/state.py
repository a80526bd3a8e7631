"""Device-side state: what transforms carry from one step to the next.

State lives in flat float64 buffers on the gradients' device, one buffer per
*group* (a transform's state over a set of layers, or a graph's statistics).
The compiled backward reads a group with the custom op
``fxgrad::load_state(group)`` and writes it back with
``fxgrad::save_state(group, value)``; both run inside the compiled graph, so
thresholds, EMAs and loss scales change every step with no host sync and no
recompile. The group name is a constant of the graph; the values are not.

    store = StateStore()
    group = store.group("0.monitor", [("mean", (), 0.0)], device)
    group.view("mean")          # a live view of the device buffer

Keys are strings (``"2.autoclip/history"``, ``"0.monitor/ema_mean/fc1"``);
:meth:`StateStore.state_dict` maps them to tensors for checkpoints.
"""

from __future__ import annotations

import itertools
import math
import weakref
from typing import Callable, Iterable, Sequence

import torch

from fxgrad import _compat

Entry = tuple[str, tuple[int, ...], float]  # key, shape, initial value

# Compiled graphs name groups by string; the backend's store keeps them alive.
_GROUPS: weakref.WeakValueDictionary[str, Group | ExternalGroup] = weakref.WeakValueDictionary()
_NAMES = itertools.count()


@torch.library.custom_op("fxgrad::load_state", mutates_args=())
def load_state(group: str) -> torch.Tensor:
    """A copy of a state group's buffer (float64, flat)."""
    return _GROUPS[group].load()


@load_state.register_fake
def _load_state_fake(group: str) -> torch.Tensor:
    found = _GROUPS[group]
    return torch.empty(found.numel, dtype=found.dtype, device=found.device)


@torch.library.custom_op("fxgrad::save_state", mutates_args=())
def save_state(group: str, value: torch.Tensor) -> None:
    """Overwrite a state group's buffer with ``value``."""
    _GROUPS[group].save(value)


@save_state.register_fake
def _save_state_fake(group: str, value: torch.Tensor) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.fxgrad.save_state.default)


class Group:
    """Named entries packed in one device buffer."""

    def __init__(self, label: str, entries: Sequence[Entry], device: torch.device,
                 initial: dict[str, torch.Tensor]) -> None:
        self.name = f"g{next(_NAMES)}"
        self.label = label
        self.layout: dict[str, tuple[int, tuple[int, ...]]] = {}
        offset = 0
        for key, shape, _ in entries:
            self.layout[key] = (offset, shape)
            offset += math.prod(shape)
        self.numel = offset
        self.device = device
        self.dtype = torch.float64
        with _compat.outside_dispatch_modes():
            self.buffer = torch.empty(offset, dtype=torch.float64, device=device)
            for key, shape, init in entries:
                self.view(key).copy_(initial[key] if key in initial else torch.full(shape, init))
        _GROUPS[self.name] = self

    @property
    def keys(self) -> list[str]:
        return list(self.layout)

    def view(self, key: str) -> torch.Tensor:
        offset, shape = self.layout[key]
        return self.buffer[offset : offset + math.prod(shape)].view(shape)

    def load(self) -> torch.Tensor:
        return self.buffer.clone()

    def save(self, value: torch.Tensor) -> None:
        self.buffer.copy_(value)


class ExternalGroup:
    """A read-only group computed from tensors someone else owns.

    E.g. a GradScaler's scale, or the norms of parameters (which the backward
    graph does not otherwise see). ``read`` runs on the device, no sync.
    """

    def __init__(self, label: str, read: Callable[[], torch.Tensor], numel: int, device: torch.device,
                 dtype: torch.dtype = torch.float64) -> None:
        self.name = f"x{next(_NAMES)}"
        self.label = label
        self.read, self.numel, self.device, self.dtype = read, numel, device, dtype
        _GROUPS[self.name] = self

    def load(self) -> torch.Tensor:
        with torch.no_grad():
            return self.read().detach().to(self.dtype, copy=True).reshape(-1)


class StateStore:
    """All state groups of one backend, and checkpoint values waiting for them."""

    def __init__(self) -> None:
        self.groups: dict[tuple, Group] = {}
        self.stats: dict[tuple, Group] = {}
        self.external: dict[tuple, ExternalGroup] = {}
        self._pending: dict[str, torch.Tensor] = {}

    def group(self, label: str, key: tuple, entries: Sequence[Entry], device: torch.device, *,
              stats: bool = False) -> Group:
        """The group for ``key``, created with ``entries`` the first time."""
        table = self.stats if stats else self.groups
        if key not in table:
            table[key] = Group(label, entries, device, {} if stats else self._pending)
        return table[key]

    def external_group(self, label: str, key: tuple, read: Callable[[], torch.Tensor], numel: int,
                       device: torch.device, dtype: torch.dtype = torch.float64) -> ExternalGroup:
        """The read-only group for ``key``, created the first time."""
        if key not in self.external:
            self.external[key] = ExternalGroup(label, read, numel, device, dtype)
        return self.external[key]

    def values(self, stats: bool = False) -> dict[str, torch.Tensor]:
        """Live views of every entry, by key."""
        table = self.stats if stats else self.groups
        return {key: group.view(key) for group in table.values() for key in group.keys}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of every state entry (not statistics), plus values not yet placed."""
        state = {key: value.clone() for key, value in self._pending.items()}
        state.update({key: value.clone() for key, value in self.values().items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore entries; keys of transforms not compiled yet wait for them."""
        live = self.values()
        for key, value in state.items():
            if key in live:
                live[key].copy_(value)
            else:
                self._pending[key] = value.clone()


def group_label(name: str) -> str | None:
    """What a group name in a graph stands for (``"stats"``, ``"0.autoclip"``, ...)."""
    found = _GROUPS.get(name)
    return found.label if found is not None else None


def flat(values: Iterable[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors, flattened and as float64, in graph code.

    Written as a sum of zero-padded pieces rather than ``torch.cat``: Inductor
    fuses the padding into the kernels that compute the pieces, while a
    ``cat`` of reduction results made it split the gradient-norm reductions
    into one extra kernel per gradient.
    """
    pieces = [v.reshape(-1).to(torch.float64) for v in values]
    total, offset, out = sum(p.numel() for p in pieces), 0, None
    for piece in pieces:
        padded = torch.nn.functional.pad(piece, (offset, total - offset - piece.numel()))
        out = padded if out is None else out + padded
        offset += piece.numel()
    return out
