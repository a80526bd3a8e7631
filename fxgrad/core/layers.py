"""Parameters -> layers, and the norm-layer skip list.

A *layer* is a module that directly owns parameters
(``module.parameters(recurse=False)``). A parameter belongs to the **first**
module that owns it in ``model.named_modules()`` order, so tied weights (GPT-2's
``wte``/``lm_head``) belong to exactly one layer. The originals of a parametrized
tensor (``torch.nn.utils.parametrize``: ``weight_norm``, ``spectral_norm``) belong to
the module they parametrize, not to the ``parametrizations.<name>`` list that holds them:
``lin.parametrizations.weight.original0`` is in layer ``lin``, with ``lin.bias``. A
parametrization's own parameters (LoRA's ``A`` and ``B`` written as one) are a layer of
their own, ``lin.parametrizations.weight.0``.

    >>> import torch.nn as nn
    >>> owners = parameter_owners(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)))
    >>> sorted(owner.layer for owner in owners.values())
    ['0', '0', '1', '1']
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import weakref
from typing import Iterable, Mapping, NamedTuple, Sequence

import torch.nn as nn
from torch.nn.parameter import is_lazy
from torch.nn.utils.parametrize import ParametrizationList

from fxgrad import _compat
from fxgrad.core import match
from fxgrad.core.warn import CoverageWarning, warn

SkipEntry = match.Key

# The per-step helpers below map C functions over a step's tensors: no Python frame per
# tensor, which counts on a launch-bound model's hundred-odd gradients.
GRAD = operator.attrgetter("grad")


def not_none(values: Iterable[object]) -> list[bool]:
    """``[v is not None for v in values]``, in C."""
    return list(map(operator.is_not, values, itertools.repeat(None)))


def same_objects(a: Sequence[object], b: Sequence[object]) -> bool:
    """Whether ``a`` and ``b`` hold the same objects (by identity: ``==`` on tensors compares values)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


DEFAULT_SKIP: tuple[SkipEntry, ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    # Norm classes of model zoos that don't subclass torch's (LlamaRMSNorm,
    # T5LayerNorm, timm's LayerNorm2d, apex's FusedLayerNorm, ...), and layers
    # named as norms (MobileBERT's NoNorm, stored as ...LayerNorm):
    "*LayerNorm*",
    "*RMSNorm*",
    "*GroupNorm*",
    "*BatchNorm*",
    "*InstanceNorm*",
)
"""Layers that per-layer transforms leave alone: normalization layers.

Rescaling or clipping the gain and bias of a norm layer per layer destabilises
training (see docs/transforms.md, "Why skip norm layers"). Entries match as
:mod:`fxgrad.core.match` says: types by ``issubclass``, strings by fnmatch on
the class name and on the layer's qualified name.
Extend it with ``fxgrad.DEFAULT_SKIP + ("*.out_proj",)``; ``skip=()`` turns it off.
"""


WHAT_IS_A_LAYER = (
    "a layer is a module that owns parameters directly, named as in model.named_modules(); a tied or shared "
    "parameter belongs to its first owner (GPT-2's lm_head weight to transformer.wte), and a parametrized "
    "weight's originals to the module it parametrizes"
)


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer as the policy sees it.

    ``depth`` is the layer's position in forward order, scaled to [0, 1]
    (0 = first layer the forward touches). ``skip_reason`` is ``None`` unless
    the layer matches the skip list.
    """

    name: str
    module_type: type | None
    params: tuple[str, ...]
    numel: int
    depth: float = 0.0
    skip_reason: str | None = None

    @property
    def type_name(self) -> str:
        return self.module_type.__name__ if self.module_type is not None else "-"


class Owner(NamedTuple):
    """Where a parameter lives: its layer's qualified name and the module."""

    layer: str
    param: str  # the parameter's qualified name
    module: nn.Module | None
    tensor: nn.Parameter | None


ROOT_LAYER = "(root)"
"""The layer of the parameters registered on the model itself (CLIP's ``logit_scale``)."""


def parameter_owners(model: nn.Module, prefix: str = "") -> dict[int, Owner]:
    """``id(parameter) -> Owner`` for every parameter of ``model``, first owner wins.

    The dict is in ``named_modules()`` order.
    """
    owners: dict[int, Owner] = {}
    modules: dict[str, nn.Module] = {}
    for module_name, module in model.named_modules():
        path = _join(prefix, _compat.module_path(module_name))  # a submodule compiled alone keeps its name
        modules[path] = module
        layer, owner = path, module
        if isinstance(module, ParametrizationList):  # <layer>.parametrizations.<tensor>: the layer's own
            layer = path.rsplit(".", 2)[0] if path.count(".") >= 2 else ""
            owner = modules.get(layer, owner)
        for local_name, param in module._parameters.items():
            if param is not None and id(param) not in owners:
                owners[id(param)] = Owner(layer or ROOT_LAYER, _join(path, local_name), owner, param)
    return owners


class ModelParameters:
    """The parameters of some models, each once: walked once, then checked cheaply on each call.

    Walking ``model.parameters()`` visits every module (0.5 ms for the benchmark's 97-module
    MLP), and step scope needs the list on every optimizer step. The walk is kept while every
    module's ``_parameters`` and ``_modules`` hold the same values in the same order (which
    catches a parameter or submodule added, deleted or replaced). Nothing global is hooked:
    a global registration hook would run inside every compiled forward that builds a module
    (transformers' ``self.layers[:n]``), and Dynamo would guard on it and recompile on every
    step::

        walk = ModelParameters()
        params = walk([model])  # walks
        params = walk([model])  # the same tuple, after checking about 400 entries
    """

    def __init__(self) -> None:
        self._models: tuple[weakref.ref, ...] = ()  # weakly: a new model can take a dead one's id
        self._dicts: tuple[dict, ...] = ()  # each module's _parameters and _modules
        self._sizes: list[int] = []  # their sizes
        self._values: tuple[object, ...] = ()  # their values, in order
        self._params: tuple[nn.Parameter, ...] = ()

    def __call__(self, models: Sequence[nn.Module]) -> tuple[nn.Parameter, ...]:
        # The checks map C functions over the dicts: a generator's frame per entry took 90 us.
        if (
            len(models) != len(self._models)
            or any(ref() is not model for ref, model in zip(self._models, models))
            or list(map(len, self._dicts)) != self._sizes
            or not all(map(operator.is_, itertools.chain.from_iterable(map(dict.values, self._dicts)), self._values))
        ):
            self._models, params = tuple(map(weakref.ref, models)), {}
            modules = [module for model in models for module in model.modules()]
            self._dicts = tuple(slots for module in modules for slots in (module._modules, module._parameters))
            for slots in self._dicts[1::2]:
                params.update((id(p), p) for p in slots.values() if p is not None)
            self._sizes = list(map(len, self._dicts))
            self._values = tuple(itertools.chain.from_iterable(map(dict.values, self._dicts)))
            self._params = tuple(params.values())
        return self._params

    def alive(self) -> bool:
        """Whether the models last walked all live."""
        return all(ref() is not None for ref in self._models)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def module_type(module: nn.Module) -> type:
    """``module``'s class, as the skip list and ``by_type`` match it: for a module that
    ``torch.export.unflatten`` rebuilt (a ``pipeline()`` stage's ``InterpreterModule``), the
    class it was exported from.

    >>> import torch
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    >>> stage = torch.export.unflatten(torch.export.export(model, (torch.ones(1, 2),)))
    >>> norm = stage.get_submodule("1")
    >>> type(norm).__name__, module_type(norm).__name__
    ('InterpreterModule', 'LayerNorm')

    A class fxgrad cannot find (its module not imported) is stood in for by a class of its
    name, which string keys (``"*RMSNorm*"``) match and types do not, after a
    ``CoverageWarning`` that says so.
    """
    found = _compat.exported_class(module)
    if isinstance(found, str):
        return _stand_in(found)
    return found or type(module)


@functools.cache
def _stand_in(qualified_name: str) -> type:
    module_name, _, name = qualified_name.rpartition(".")
    warn(
        f"fxgrad: a layer of this model was exported from {qualified_name}, which is not imported in this "
        f"process (a program torch.export.load loaded?): fxgrad matches it by its class name {name!r} alone, so "
        "string keys (the skip list's '*LayerNorm*', '*RMSNorm*') reach it and module types (nn.LayerNorm for a "
        "subclass of it) do not. Import the model's module before the first step to match it by type.",
        CoverageWarning,
    )
    return type(name, (nn.Module,), {"__module__": module_name, "__qualname__": name})


def validate_skip(skip: Iterable[SkipEntry]) -> tuple[SkipEntry, ...]:
    """Check a ``skip=`` argument: module types and pattern strings (see :mod:`fxgrad.core.match`)."""
    if isinstance(skip, (str, type, Mapping)) or not isinstance(skip, Iterable):
        single = "" if isinstance(skip, Mapping) else f"; write skip=({skip!r},) for a single entry"
        raise TypeError(f"skip must be a tuple or list of nn.Module types and name patterns, got {skip!r}{single}")
    return tuple(match.check_key("skip entries", entry) for entry in skip)


@functools.lru_cache(maxsize=65536)
def skip_reason(name: str, module_type: type | None, skip: tuple[SkipEntry, ...]) -> str | None:
    """Why a layer is skipped, or ``None``. The first matching entry is named.

    Cached: step scope asks for every layer on every step."""
    return next(filter(None, (match.reason(entry, name, module_type) for entry in skip)), None)


class ParamRow(NamedTuple):
    layer: str
    param: str
    module_type: type | None
    numel: int


def build_layers(rows: Iterable[ParamRow], order: Sequence[str], skip: Sequence[SkipEntry]) -> list[Layer]:
    """Group parameter rows into layers, in the order the rows come.

    ``order`` is the forward order of all layers known for the model; a layer's
    depth is its index there divided by ``len(order) - 1``.
    """
    grouped: dict[str, list[ParamRow]] = {}
    for row in rows:
        grouped.setdefault(row.layer, []).append(row)
    position = {name: i for i, name in enumerate(order)}
    span = max(len(order) - 1, 1)
    layers = []
    for name, members in grouped.items():
        module_type = members[0].module_type
        layers.append(
            Layer(
                name=name,
                module_type=module_type,
                params=tuple(row.param for row in members),
                numel=sum(row.numel for row in members),
                depth=position.get(name, 0) / span,
                skip_reason=skip_reason(name, module_type, tuple(skip)),
            )
        )
    return layers


def model_rows(model: nn.Module, prefix: str) -> tuple[list[ParamRow], list[ParamRow]]:
    """``(trainable, frozen)`` parameter rows of a model, in ``named_modules`` order; a lazy
    module's parameter (``nn.LazyLinear`` before its first forward) counts 0 elements."""
    trainable, frozen = [], []
    for owner in parameter_owners(model, prefix).values():
        numel = 0 if is_lazy(owner.tensor) else owner.tensor.numel()
        row = ParamRow(owner.layer, owner.param, module_type(owner.module), numel)
        (trainable if owner.tensor.requires_grad else frozen).append(row)
    return trainable, frozen
