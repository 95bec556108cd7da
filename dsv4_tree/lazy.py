"""Package attributes loaded on first access (PEP 562): the names that need the `hf` extra
(transformers 5.23.0) stay out of `import dsv4_tree.<torch-only module>`."""
from __future__ import annotations

import importlib


def lazy_attributes(package: str, namespace: dict, table: dict):
    """(__getattr__, __dir__) for `package`, whose name -> relative module is `table`; a loaded
    name is cached in the package's `namespace`."""
    def __getattr__(name: str):
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
