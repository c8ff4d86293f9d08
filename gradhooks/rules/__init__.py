"""Built-in rules, one file per layer family. Importing this package registers them all."""

import importlib
import pkgutil

RULE_MODULES = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))

for _name in RULE_MODULES:
    importlib.import_module(f"{__name__}.{_name}")
