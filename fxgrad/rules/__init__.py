"""The rules, one module per family; each rule registers itself where it is defined.

Importing this package imports every module in it, so :data:`RULES` is complete:
a new family module needs no entry anywhere else.
"""

import importlib
import pkgutil

from fxgrad.core.rule import RULES

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["RULES"]
