"""Device-side state: what transforms carry from one step to the next.

Every entry (``"2.autoclip/history"``, ``"0.monitor/mean/fc1"``) has exactly
one place in a flat float64 buffer on the gradients' device. A compiled
backward reads the entries it needs as one *group* with the custom op
``fxgrad::load_state(group)`` and writes them back with
``fxgrad::save_state(group, value)``; both run inside the compiled graph, so
thresholds, EMAs and loss scales change every step with no host sync and no
recompile. The group name is a constant of the graph; the values are not.

Groups of different graphs may share entries: when a recompile drops a frozen
layer, the new graph's group holds the other layers' entries, and both graphs
update the same EMAs and histories::

    store = StateStore()
    a = store.group("0.monitor", [("0.monitor/mean/fc1", (), 0.0), ("0.monitor/mean/fc2", (), 0.0)], device)
    b = store.group("0.monitor", [("0.monitor/mean/fc2", (), 0.0)], device)   # fc2's entry, shared
    store.values()["0.monitor/mean/fc2"]        # a live view of the device buffer

:meth:`StateStore.state_dict` maps the keys to tensors for checkpoints.

State moves once per optimizer step, as the eager references' ``step()`` does, not once per
backward pass: a backward whose gradients no optimizer steps (an adversarial attack's
``torch.autograd.grad`` of the input, a GAN generator's pass through the discriminator, a
batch dropped after its backward) leaves it as it was. Once :meth:`StateStore.defer` ran
(graph scope: at the first :meth:`StateStore.commit`, the step of an optimizer of the
backend's models, or after a checkpoint's load), a group's save goes to a copy of the
buffer, which that pass's loads of the group read and the next commit keeps: the last pass
to save a group before a step wins, and the others' saves are lost. Before, saves write the
buffer (a loop that steps no ``torch.optim`` optimizer moves its state at each backward, as
before); a step program writes it at the step anyway. A pass that computes no gradient of the
compiled graphs' parameters (``torch.autograd.grad`` of an input, before or after the step's
backward; ``backward(inputs=...)`` without them) saves nothing, deferred or not, statistics
included (the store's ``idle`` callback, :meth:`fxgrad.Backend._idle_pass`).
"""

from __future__ import annotations

import itertools
import math
import weakref
from typing import Any, Callable, Iterable, Sequence

import torch

from fxgrad import _compat

Entry = tuple[str, tuple[int, ...], float]  # key, shape, initial value

# Compiled graphs name groups by string; the backend's store keeps them alive.
_GROUPS: weakref.WeakValueDictionary[str, Group | ExternalGroup] = weakref.WeakValueDictionary()
_NAMES = itertools.count()


# Defined with torch.library's plain API rather than ``custom_op``: each runs on every step, and
# ``custom_op``'s Python autograd wrapper costs 12 us a call on the CPU, against 5 us for a kernel
# the dispatcher calls directly (neither takes a tensor that needs a gradient).
_LIBRARY = torch.library.Library("fxgrad", "FRAGMENT")
_LIBRARY.define("load_state(str group) -> Tensor")
_LIBRARY.define("save_state(str group, Tensor value) -> ()")


def load_state(group: str) -> torch.Tensor:
    """A copy of a state group's buffer (float64, flat)."""
    return _GROUPS[group].load()


def save_state(group: str, value: torch.Tensor) -> None:
    """Overwrite a state group's buffer with ``value``."""
    _GROUPS[group].save(value)


def _load_state_fake(group: str) -> torch.Tensor:
    found = _GROUPS[group]
    return torch.empty(found.numel, dtype=found.dtype, device=found.device)


def _save_state_fake(group: str, value: torch.Tensor) -> None:
    return None


for _op, _kernel, _fake in (("load_state", load_state, _load_state_fake), ("save_state", save_state, _save_state_fake)):
    _LIBRARY.impl(_op, _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"fxgrad::{_op}", _fake, lib=_LIBRARY)
torch.fx.node.has_side_effect(torch.ops.fxgrad.save_state.default)


class Slots:
    """Entries at fixed offsets in one growable float64 buffer on one device.

    Once ``deferring`` (see the module), groups save into a copy of the buffer until
    :meth:`commit` copies what they saved into it."""

    def __init__(self, device: torch.device, deferring: bool = False, idle: Callable[[], bool] | None = None) -> None:
        self.device = device
        self.idle = idle  # whether the backward pass now running is none of a step's: its saves are dropped
        self.layout: dict[str, tuple[int, tuple[int, ...]]] = {}  # key -> (offset, shape)
        self._views: dict[str | tuple[int, int, bool], torch.Tensor] = {}  # of the buffer (or copy), by key or span
        with _compat.outside_dispatch_modes():
            self.buffer = torch.empty(0, dtype=torch.float64, device=device)
        self.deferring = deferring
        self.copy: torch.Tensor | None = None  # what groups saved since the last commit, at their places
        self.deferred: dict[Group, int] = {}  # the groups that saved there, in save order: their pass

    def commit(self) -> None:
        """Keep what groups saved since the last commit."""
        for group in self.deferred:
            group.keep()
        self.deferred.clear()

    def place(self, entries: Sequence[Entry], initial: dict[str, torch.Tensor]) -> list[int]:
        """Offsets of every element of ``entries``, appending the keys not placed yet
        (initialized from ``initial``, else their initial value)."""
        new = [(key, shape, init) for key, shape, init in entries if key not in self.layout]
        if new:
            with _compat.outside_dispatch_modes():
                values = [
                    _loaded(key, initial[key], shape) if key in initial else torch.full(shape, init)
                    for key, shape, init in new
                ]
                pieces = [v.to(torch.float64).reshape(-1).to(self.device) for v in values]
                offset = self.buffer.numel()
                self.buffer = torch.cat([self.buffer, *pieces])
                if self.copy is not None:
                    self.copy = torch.cat([self.copy, *pieces])
                self._views.clear()
            for key, shape, _ in new:
                self.layout[key] = (offset, shape)
                offset += math.prod(shape)
        return [
            start + i for key, _, _ in entries for start, shape in [self.layout[key]] for i in range(math.prod(shape))
        ]

    def view(self, key: str) -> torch.Tensor:
        """The entry ``key`` of the buffer, live (the same view until the buffer grows)."""
        view = self._views.get(key)
        if view is None:
            offset, shape = self.layout[key]
            view = self._views[key] = self.span(offset, offset + math.prod(shape)).view(shape)
        return view

    def span(self, start: int, stop: int, copy: bool = False) -> torch.Tensor:
        """Elements ``start:stop`` of the buffer (or of its deferred ``copy``), live (the same view
        until the buffer grows: a slice costs 2-18 us in a training step)."""
        key = (start, stop, copy)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = (self.copy if copy else self.buffer)[start:stop]
        return view


class Group:
    """The entries one graph loads and saves together, in a fixed order."""

    def __init__(
        self,
        label: str,
        slots: Slots,
        keys: list[str],
        positions: list[int],
        on_save: Callable[[Group], None] | None = None,
    ) -> None:
        self.name = f"g{next(_NAMES)}"
        self.label, self.slots, self.keys = label, slots, keys
        self.numel, self.device, self.dtype = len(positions), slots.device, torch.float64
        self._on_save = on_save
        contiguous = positions == list(range(positions[0], positions[0] + len(positions))) if positions else True
        self._range = (positions[0] if positions else 0, (positions[0] if positions else 0) + len(positions))
        self._index = None
        if not contiguous:
            with _compat.outside_dispatch_modes():
                self._index = torch.tensor(positions, dtype=torch.long, device=slots.device)
        _GROUPS[self.name] = self

    def view(self) -> torch.Tensor | None:
        """The entries, as one live view of the buffer (flat, in order); ``None`` when they are
        spread over it."""
        return None if self._index is not None else self.slots.span(*self._range)

    def load(self) -> torch.Tensor:
        slots = self.slots
        if slots.deferred and slots.deferred.get(self) == _compat.backward_pass_id():  # saved in this pass
            return self._read(slots.copy)
        return self._read(slots.buffer)

    def save(self, value: torch.Tensor) -> None:
        slots = self.slots
        if slots.idle is not None and slots.idle():
            return
        if not slots.deferring:
            self._write(slots.buffer, value)
        else:
            if slots.copy is None:
                with _compat.outside_dispatch_modes():
                    slots.copy = torch.empty_like(slots.buffer)
            self._write(slots.copy, value)
            slots.deferred.pop(self, None)
            slots.deferred[self] = _compat.backward_pass_id()
        self.saved()

    def keep(self) -> None:
        """Copy what this group saved into the deferred copy to the buffer (:meth:`Slots.commit`)."""
        self._write(self.slots.buffer, self._read(self.slots.copy))

    def _read(self, source: torch.Tensor) -> torch.Tensor:
        if self._index is not None:
            return source.index_select(0, self._index)
        return self._entries(source).clone()

    def _write(self, target: torch.Tensor, value: torch.Tensor) -> None:
        if self._index is not None:
            target.index_copy_(0, self._index, value)
        else:
            self._entries(target).copy_(value)

    def _entries(self, tensor: torch.Tensor) -> torch.Tensor:
        """The entries' slice of the buffer or of its deferred copy (kept views)."""
        return self.slots.span(*self._range, copy=tensor is not self.slots.buffer)

    def saved(self) -> None:
        """The entries were written (a step program writes them through :meth:`view`)."""
        if self._on_save is not None:
            self._on_save(self)


class ExternalGroup:
    """A read-only group computed from tensors someone else owns.

    E.g. a GradScaler's scale, or the norms of parameters (which the backward
    graph does not otherwise see). ``read`` runs on the device, no sync.
    """

    def __init__(
        self,
        label: str,
        read: Callable[[], torch.Tensor],
        numel: int,
        device: torch.device,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        self.name = f"x{next(_NAMES)}"
        self.label = label
        self.read, self.numel, self.device, self.dtype = read, numel, device, dtype
        _GROUPS[self.name] = self

    def load(self) -> torch.Tensor:
        with torch.no_grad():
            return self.read().detach().to(self.dtype, copy=True).reshape(-1)


class StateStore:
    """All state and statistics of one backend, and checkpoint values waiting for them.

    Statistics are 0-dim entries. :meth:`latest_stats` returns those of the
    latest step: a step starts when a graph writes a per-layer statistic that
    was already written since the previous start (the next step's first
    graph); graphs of one step (graph breaks) hold different layers.
    """

    def __init__(self, defers: Callable[[], bool] = lambda: False, idle: Callable[[], bool] | None = None) -> None:
        self._defers = defers  # whether saves may defer to a step (graph scope), see commit()
        self._idle = idle  # whether the running backward pass computes no gradient a step takes (see the module)
        self._state: dict[torch.device, Slots] = {}
        self._stats: dict[torch.device, Slots] = {}
        self._groups: dict[tuple, Group] = {}
        self.external: dict[tuple, ExternalGroup] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._loaded_keys: frozenset[str] = frozenset()  # those of the latest load_state_dict
        self._layer_stats: dict[str, tuple[str, str]] = {}  # per-layer statistic key -> (statistic, layer)
        self._step: list[Group] = []  # statistics groups saved in the latest step
        self._overlap: dict[tuple[str, str], bool] = {}  # do two groups share a per-layer statistic?
        self._deferring = False  # whether defer() ran: state saves go to the deferred copy from then on
        self.spanning: set[str] = set()  # the labels of the rules with a state over all their layers ...
        self.by_layer: set[str] = set()  # ... and of those with a state per layer or per parameter

    def group(self, label: str, entries: Sequence[Entry], device: torch.device) -> Group:
        """The group of ``entries`` (state), placing entries seen for the first time."""
        return self._group(label, entries, device, self._state, self._pending, None, self._deferring, self._idle)

    def stats_group(self, keys: Sequence[str], device: torch.device, per_layer: dict[str, tuple[str, str]]) -> Group:
        """The group of 0-dim statistics ``keys``; ``per_layer`` maps those that are one
        layer's value of a statistic to ``(statistic, layer)``."""
        self._layer_stats.update(per_layer)
        entries = [(k, (), 0.0) for k in keys]
        return self._group("stats", entries, device, self._stats, {}, self._stats_saved, False, self._idle)

    def _group(
        self,
        label: str,
        entries: Sequence[Entry],
        device: torch.device,
        table: dict[torch.device, Slots],
        initial: dict[str, torch.Tensor],
        on_save: Callable[[Group], None] | None,
        deferring: bool,
        idle: Callable[[], bool] | None = None,
    ) -> Group:
        keys = [key for key, _, _ in entries]
        found = self._groups.get((id(table), device, tuple(keys)))
        if found is None:
            slots = table.setdefault(device, Slots(device, deferring, idle))
            found = Group(label, slots, keys, slots.place(entries, initial), on_save)
            self._groups[(id(table), device, tuple(keys))] = found
        return found

    def _stats_saved(self, group: Group) -> None:
        """Runs every step (a graph saved its statistics): O(graphs in the step), not O(keys)."""
        if any(self._overlaps(group, other) for other in self._step):
            self._step = []
        self._step.append(group)

    def _overlaps(self, a: Group, b: Group) -> bool:
        found = self._overlap.get((a.name, b.name))
        if found is None:
            found = a is b or any(key in self._layer_stats for key in set(a.keys) & set(b.keys))
            self._overlap[(a.name, b.name)] = found
        return found

    def external_group(
        self,
        label: str,
        key: tuple,
        read: Callable[[], torch.Tensor],
        numel: int,
        device: torch.device,
        dtype: torch.dtype = torch.float64,
    ) -> ExternalGroup:
        """The read-only group for ``key``, created the first time."""
        if key not in self.external:
            self.external[key] = ExternalGroup(label, read, numel, device, dtype)
        return self.external[key]

    def values(self, stats: bool = False) -> dict[str, torch.Tensor]:
        """Live views of every entry, by key."""
        table = self._stats if stats else self._state
        return {key: slots.view(key) for slots in table.values() for key in slots.layout}

    def commit(self) -> None:
        """An optimizer steps the gradients: keep the state the latest passes saved, and defer
        later saves to the next commit (see the module). Nothing unless ``defers()``: a step
        program writes the state at the step itself."""
        if not self._defers():
            return
        for slots in self._state.values():
            slots.commit()
        self.defer()

    def defer(self) -> None:
        """Save state into the deferred copy from now on, once steps are known to come (a commit,
        a checkpoint's load), if ``defers()``."""
        if not self._defers():
            return
        self._deferring = True
        for slots in self._state.values():
            slots.deferring = True

    def stat(self, key: str) -> torch.Tensor:
        """A live view of the statistic ``key`` (``KeyError`` until a step wrote it)."""
        for slots in self._stats.values():
            if key in slots.layout:
                return slots.view(key)
        raise KeyError(key)

    def stat_offsets(self, keys: Sequence[str], device: torch.device) -> tuple[int | None, ...]:
        """The offset of each of the 0-dim statistics ``keys`` in :meth:`stats_buffer` (``None``
        for one not written there yet): what a program reads them by, with no view per key. An
        offset stays as it is: the buffer grows at its end."""
        slots = self._stats.get(device)
        layout = slots.layout if slots is not None else {}
        return tuple(layout[key][0] if key in layout else None for key in keys)

    def stats_buffer(self, device: torch.device) -> torch.Tensor:
        """The statistics' buffer on ``device``, live (a new tensor once it grows)."""
        slots = self._stats.get(device)
        return slots.buffer if slots is not None else torch.zeros(1, dtype=torch.float64, device=device)

    def keyed_by_layer(self) -> bool:
        """Whether some state or statistic is kept under a layer's or a parameter's name."""
        return bool(self.by_layer or self._layer_stats)

    def latest_stats(self) -> dict[str, torch.Tensor]:
        """Copies of the statistics the latest step wrote (one copy per device, no sync)."""
        copies = {device: slots.buffer.clone() for device, slots in self._stats.items()}
        out = {}
        for group in self._step:
            for key in group.keys:
                out[key] = copies[group.device][group.slots.layout[key][0]]
        return out

    def stat_layers(self, statistic: str) -> frozenset[str]:
        """The layers with a value of the per-layer ``statistic`` so far."""
        return frozenset(layer for name, layer in self._layer_stats.values() if name == statistic)

    def layer_stat(self, key: str) -> tuple[str, str] | None:
        """``(statistic, layer)`` for a per-layer statistic's key."""
        return self._layer_stats.get(key)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of every state entry (not statistics), plus values not yet placed."""
        state = {key: value.clone() for key, value in self._pending.items()}
        state.update({key: value.clone() for key, value in self.values().items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore entries; keys of transforms not compiled yet wait for them. All or nothing:
        every value is checked before any is copied."""
        live = self.values()
        for key, value in state.items():
            _loaded(key, value, tuple(live[key].shape) if key in live else None)
        with torch.no_grad():
            for slots in self._state.values():
                slots.deferred.clear()  # a backward pass's, before the checkpoint
            for key, value in state.items():
                if key in live:
                    live[key].copy_(value)
                else:
                    self._pending[key] = value.detach().clone()
        self._loaded_keys = frozenset(state)

    def pending(self) -> list[str]:
        """Keys loaded that no compiled transform has placed (yet)."""
        live = {key for slots in self._state.values() for key in slots.layout}
        return [key for key in self._pending if key not in live]

    def not_loaded(self) -> list[str]:
        """Entries placed so far that the latest :meth:`load_state_dict` did not give: they start over."""
        return [key for slots in self._state.values() for key in slots.layout if key not in self._loaded_keys]


class CheckpointMismatch(ValueError):
    """A checkpoint's entry has another shape than this policy's (found where the entry is
    placed, at the first step that uses it): the user's to fix, never a reason to leave a
    compiled path."""


def _loaded(key: str, value: Any, shape: tuple[int, ...] | None) -> torch.Tensor:
    """A checkpoint's ``value`` for entry ``key``, which has ``shape`` in this policy (``None``:
    not placed yet), checked: state is real floating point, with data."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"state {key!r} must be a tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"state {key!r} must be a real floating-point tensor, got dtype {value.dtype}")
    if value.is_meta:
        raise ValueError(f"state {key!r} is a meta tensor, which holds no values")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise CheckpointMismatch(
            f"state {key!r} has shape {tuple(value.shape)} in the checkpoint but {tuple(shape)} in "
            "this policy (a history or warm-up of another length?)"
        )
    return value


def groups_named(graph: torch.fx.Graph) -> frozenset[str]:
    """The names of the groups ``graph``'s nodes load or save."""
    ops = (torch.ops.fxgrad.load_state.default, torch.ops.fxgrad.save_state.default)
    return frozenset(node.args[0] for op in ops for node in graph.find_nodes(op="call_function", target=op))


def viewed_group(name: str) -> Group | None:
    """The group a graph names ``name`` if :meth:`Group.view` can stand for its loads and saves
    (not one spread over the buffer, nor an :class:`ExternalGroup`)."""
    found = _GROUPS.get(name)
    return found if isinstance(found, Group) and found.view() is not None else None


def group_label(name: str) -> str | None:
    """What a group name in a graph stands for (``"stats"``, ``"0.autoclip"``, ...)."""
    found = _GROUPS.get(name)
    return found.label if found is not None else None


def flat(values: Iterable[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors, flattened and as float64, in graph code.

    Written as a sum of zero-padded pieces rather than ``torch.cat``: Inductor
    fuses the padding into the kernels that compute the pieces, while a
    ``cat`` of reduction results made it split the gradient-norm reductions
    into one extra kernel per gradient. The pieces are not cast one by one: the
    first padded piece is, and adding float64 promotes the rest exactly (one
    recorded op less per piece; a 1000-layer monitor flattens 1000 norms).
    """
    pieces = [v.reshape(-1) for v in values]
    total, offset, out = sum(p.numel() for p in pieces), 0, None
    for piece in pieces:
        padded = torch.nn.functional.pad(piece, (offset, total - offset - piece.numel()))
        out = padded.to(torch.float64) if out is None else out + padded
        offset += piece.numel()
    return out
