"""Built-in rules, one file per layer family. Importing this package registers them all."""

import importlib
import pkgutil

#: The modules of this package that are not rules: the registry they register in, and the rule
#: for modules that have none.
MACHINERY = ("registry", "fallback")

RULE_MODULES = sorted(
    m.name
    for m in pkgutil.iter_modules(__path__)
    if not m.name.startswith("_") and m.name not in MACHINERY
)

for _name in RULE_MODULES:
    importlib.import_module(f"{__name__}.{_name}")
