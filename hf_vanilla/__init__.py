"""hf_vanilla: a from-scratch, readable Transformer that is a first-class Hugging Face model.

`import hf_vanilla` registers the configs and models with transformers' Auto classes (hf_vanilla/auto.py), so a
converted checkpoint loads with `AutoModel.from_pretrained(path)` without `trust_remote_code`.

The import itself is light: torch and transformers take seconds to import, and the `hf-vanilla` command (whose
module Python imports through this package) answers `--help` without either. So the public names are loaded on first
use (PEP 562), and the registration runs as soon as transformers is imported: at once if it already is, else right
after its own import, whichever module imports it.
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.2.0"

# The modules whose `__all__` make up the public API, each listing its own names once.
_PUBLIC_MODULES = ("auto", "configuration_vanilla", "modeling_vanilla")


def _register() -> None:
    importlib.import_module(".auto", __name__).register()


class _RegisterAfterTransformers(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `transformers` is about to be imported, it lets the other finders find it and
    runs the registration right after transformers' own module has run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "transformers":
            return None
        sys.meta_path.remove(self)  # once, and never in the way of the lookup below
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


if "transformers" in sys.modules:
    _register()
else:
    sys.meta_path.insert(0, _RegisterAfterTransformers())


def __getattr__(name):
    modules = [importlib.import_module(f".{module}", __name__) for module in _PUBLIC_MODULES]
    if name == "__all__":
        return [public for module in modules for public in module.__all__]
    for module in modules:
        if name in module.__all__:
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__getattr__("__all__")))
