"""hf_vanilla: a from-scratch, readable Transformer that is a first-class Hugging Face model.

`import hf_vanilla` registers the configs and models with transformers' Auto classes (hf_vanilla/auto_classes.py), so a
converted checkpoint loads with `AutoModel.from_pretrained(path)` without `trust_remote_code`.

The import itself is light: torch and transformers take seconds to import, and the `hf-vanilla` command (whose
module Python imports through this package) answers `--help` without either. So the public names are loaded on first
use (PEP 562), and the registration runs as soon as transformers is imported: at once if it already is, else right
after its own import, whichever module imports it.
"""

import importlib
import importlib.abc
import sys

from .version import __version__

# The modules whose `__all__` make up the public API, each listing its own names once.
_PUBLIC_MODULES = ("auto_classes", "configuration_vanilla", "modeling_vanilla", "modeling_encoder",
                   "modeling_seq2seq", "modeling_decoder")


class _RegisterWithTransformers(importlib.abc.MetaPathFinder):
    """Runs the Auto registration as soon as it can: once transformers is imported and no module of this package
    is halfway through its own import (the registration imports them all, and a module that imports transformers
    before its own classes are defined would otherwise be asked for them too early).

    It finds nothing itself: for `transformers` and this package's modules it lets the other finders find them,
    then tries the registration after each has run. Once the registration has run it leaves `sys.meta_path`."""

    def __init__(self):
        self.importing = set()  # this package's modules whose code is running

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "transformers" and not fullname.startswith(f"{__name__}."):
            return None
        later = sys.meta_path[sys.meta_path.index(self) + 1:]
        spec = next(filter(None, (f.find_spec(fullname, path, target) for f in later if hasattr(f, "find_spec"))),
                     None)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            ours = fullname != "transformers"
            if ours:
                self.importing.add(fullname)
            try:
                exec_module(module)
            finally:
                self.importing.discard(fullname)
            self.register_if_ready()

        spec.loader.exec_module = exec_then_register
        return spec

    def register_if_ready(self):
        if "transformers" in sys.modules and not self.importing and self in sys.meta_path:
            sys.meta_path.remove(self)
            importlib.import_module(".auto_classes", __name__).register()


_registration = _RegisterWithTransformers()
sys.meta_path.insert(0, _registration)
_registration.register_if_ready()


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
