"""Declarative policies: build a backend from plain data (a JSON file, or ``options=``).

    >>> backend = from_config({
    ...     "transform": [
    ...         {"by_type": {"mapping": {"torch.nn.LSTM": {"clip_by_norm": {"max_norm": 0.5}}},
    ...                      "default": {"clip_by_norm": {"max_norm": 1.0}}}},
    ...         {"clip_by_global_norm": {"max_norm": 5.0}},
    ...     ],
    ...     "skip": ["default", "lm_head"],
    ...     "compiler": "aot_eager",
    ... })
    >>> backend.transform  # doctest: +NORMALIZE_WHITESPACE
    chain(by_type({torch.nn.LSTM: clip_by_norm(max_norm=0.5)}, default=clip_by_norm(max_norm=1.0)),
          clip_by_global_norm(max_norm=5.0))

Grammar:

* a transform is ``{"<factory name>": {<keyword arguments>}}``, or a list of
  transforms (a ``chain``);
* ``by_type`` takes ``{"mapping": {"<dotted class path>": transform}, "default": transform}``,
  ``by_name`` the same with fnmatch patterns as keys;
* where types and name patterns are both allowed (``skip``, ``rescale``'s
  ``multipliers``), a type is written ``"type:torch.nn.Conv2d"``;
* ``skip`` is a list; the entry ``"default"`` stands for :data:`fxgrad.DEFAULT_SKIP`;
* step-keyed dicts (``multi_normalize``'s ``schedule`` and ``threshold_schedule``)
  may have string keys (``{"0": ..., "500": ...}``), as JSON objects must;
* ``{"config": "policy.json", ...}`` reads the file; keys beside ``config``
  override the file's (``{"config": "policy.json", "compiler": "aot_eager"}``).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from typing import Any, Callable, Mapping

from fxgrad.core.layers import DEFAULT_SKIP
from fxgrad.core.rule import Transform
from fxgrad.frontend.backend import Backend
from fxgrad.rules import RULES, composition, selection

ROUTERS = {"by_type": selection.by_type, "by_name": selection.by_name}
BACKEND_KEYS = {"transform", "skip", "compiler", "strict", "scope"}
CONFIG_ENV = "FXGRAD_CONFIG"


def from_config(spec: Mapping[str, Any]) -> Backend:
    """A :class:`fxgrad.Backend` from a dict with the keys of :func:`fxgrad.backend`.

    ``{"transform": ..., "skip": [...], "compiler": ..., "strict": ..., "scope": ...}``.

    ``{"config": "policy.json"}`` loads the spec from a JSON file; keys given
    beside ``config`` override the file's.
    """
    if not isinstance(spec, Mapping):
        raise TypeError(f"config must be a dict, got {type(spec).__name__}")
    if "config" in spec:
        loaded = load(spec["config"])
        if "config" in loaded:
            raise ValueError(f"config file {spec['config']!r} names another config file; give the policy itself")
        spec = {**loaded, **{key: value for key, value in spec.items() if key != "config"}}
    unknown = set(spec) - BACKEND_KEYS
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; expected some of {sorted(BACKEND_KEYS)}")
    kwargs: dict[str, Any] = {key: spec[key] for key in ("compiler", "strict", "scope") if key in spec}
    if "skip" in spec:
        kwargs["skip"] = _skip(spec["skip"])
    if spec.get("transform") is None:  # a backend that compiles without a policy is fxgrad.backend(None)
        raise ValueError(
            'config names no policy: give "transform": {"<rule>": {arguments}} (or a list of them for a chain)'
        )
    return Backend(parse_transform(spec["transform"]), **kwargs)


def load(path: str | os.PathLike) -> dict:
    """The dict in a JSON policy file."""
    if not isinstance(path, (str, os.PathLike)):  # open() takes an int as a file descriptor, and closes it
        raise TypeError(f"config must be a path (str or os.PathLike), got {path!r}")
    with open(path) as file:
        try:
            spec = json.load(file)
        except json.JSONDecodeError as error:
            raise ValueError(f"config file {os.fspath(path)!r} is not valid JSON: {error}") from None
    if not isinstance(spec, dict):
        raise TypeError(f"config file {os.fspath(path)!r} must hold a JSON object, got {type(spec).__name__}")
    return spec


def parse_transform(spec: Any) -> Transform:
    """A transform from its plain-data form (see the module docstring)."""
    if isinstance(spec, list):
        return composition.chain(*(parse_transform(item) for item in spec))
    if not (isinstance(spec, Mapping) and len(spec) == 1):
        raise ValueError(f"a transform is {{'<name>': {{arguments}}}} or a list of them, got {spec!r}")
    ((name, arguments),) = spec.items()
    if name not in RULES and name not in ROUTERS:
        chain = " (a chain is written as a list of transforms)" if name == "chain" else ""
        raise ValueError(f"unknown transform {name!r}{chain}; known: {sorted(RULES) + sorted(ROUTERS)}")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, Mapping):
        raise TypeError(f"arguments of {name!r} must be a dict, got {arguments!r}")
    if name in ROUTERS:
        return _router(name, arguments)
    arguments = dict(arguments)
    for field in dataclasses.fields(RULES[name]):
        value, convert = arguments.get(field.name), KEY_SPELLINGS.get(field.metadata.get("config"))
        if convert is not None and isinstance(value, Mapping):
            arguments[field.name] = _converted(f"{name} {field.name}", value, convert)
    known = {field.name for field in dataclasses.fields(RULES[name]) if field.init}
    unknown = sorted(set(arguments) - known)
    if unknown:
        raise TypeError(f"{name} takes no argument {', '.join(map(repr, unknown))}; its arguments: {sorted(known)}")
    return RULES[name](**arguments)


def _step(key: Any) -> Any:
    """A JSON object key for a step (``"500"``) as an int; anything else as given, for the
    transform's own check to name."""
    return int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key


def _type_or_pattern(entry: Any) -> Any:
    if isinstance(entry, str) and entry.startswith("type:"):
        return import_class(entry[len("type:") :])
    return entry


def _converted(what: str, mapping: Mapping[Any, Any], convert: Callable[[Any], Any]) -> dict[Any, Any]:
    """``mapping`` with each key converted; two spellings of one key (``"torch.nn.Linear"`` and
    ``"torch.nn.modules.linear.Linear"``, ``"5"`` and ``"05"``) are refused, not merged."""
    converted: dict[Any, Any] = {}
    spelled: dict[Any, Any] = {}
    for key, value in mapping.items():
        new = _naming(what, convert, key)
        if new in converted:
            raise ValueError(f"{what}: {spelled[new]!r} and {key!r} name the same key")
        converted[new], spelled[new] = value, key
    return converted


KEY_SPELLINGS = {"layer_keys": _type_or_pattern, "step_keys": _step}
"""How a config file spells the keys of a rule field marked ``config=...`` (see :func:`fxgrad.core.rule.field`)."""


def _router(name: str, arguments: Mapping[str, Any]) -> Transform:
    unknown = set(arguments) - {"mapping", "default"}
    if unknown:
        raise ValueError(f"{name} takes 'mapping' and 'default', got {sorted(unknown)}")
    mapping = arguments.get("mapping", {})
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{name} mapping must be a dict, got {mapping!r}")
    # by_name checks its keys itself: a config spells them as it would
    keys = _converted(f"{name} mapping", mapping, import_class if name == "by_type" else lambda key: key)
    routes = {key: parse_transform(value) for key, value in keys.items()}
    default = arguments.get("default")
    return ROUTERS[name](
        routes, default=None if default is None else _naming(f"{name} default", parse_transform, default)
    )


def _skip(entries: Any) -> tuple:
    if not isinstance(entries, (list, tuple)):
        raise TypeError(f"skip must be a list, got {entries!r}")
    result: list = []
    for entry in entries:
        result += DEFAULT_SKIP if entry == "default" else [_naming("skip", _type_or_pattern, entry)]
    return tuple(result)


def _naming(what: str, parse: Callable[[Any], Any], value: Any) -> Any:
    """``parse(value)``, its ``TypeError`` or ``ValueError`` saying where in the config the value sits."""
    try:
        return parse(value)
    except ValueError as error:
        raise ValueError(f"{what}: {error}") from None
    except TypeError as error:
        raise TypeError(f"{what}: {error}") from None


def import_class(path: str) -> type:
    """``torch.nn.LSTM`` -> the class."""
    if not isinstance(path, str):
        raise TypeError(f"a class in a config is its dotted path as a string ('torch.nn.LSTM'), got {path!r}")
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        raise ValueError(f"cannot import class {path!r}") from None
