"""The package's layout rules, read from the source (shared/STYLE.md's layout): the package's import graph has no
circle and points downwards only, string imports counted; the model finds its engines through the registry and
never imports one; the engines and the exporter never import the model's code or the converters."""

import ast
import sys
from pathlib import Path

import hf_vanilla

PACKAGE = Path(hf_vanilla.__file__).parent
# The model code: the base, then one module per family.
MODEL_MODULES = ("modeling_vanilla", "modeling_encoder", "modeling_seq2seq", "modeling_decoder")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, from_modules: bool = True) -> set[str]:
    """Every module a file imports, by statement or by name in a string ("module" or "module:function").
    `from m import n` gives "m.n", and "m" too unless `from_modules` is false (then "m.n" alone says which)."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = set(string_names(tree))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base
                                                                                                    else []))
            names.update(([base] if from_modules else []) + [f"{base}.{alias.name}" for alias in node.names])
    return names


def string_names(tree) -> set[str]:
    """The "hf_vanilla.<module>" part of every string that starts so (an import by name, or just a name)."""
    return {node.value.partition(":")[0] for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("hf_vanilla.")}


def import_graph() -> dict[str, set[str]]:
    """hf_vanilla module -> the hf_vanilla modules it imports: by statement (`from package import name` imports the
    module `package.name` where there is one, else the package's `__init__`), or by a string that names a module
    exactly (a registry's "module:function"; "hf_vanilla.cache_key" is a name, not an import)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        strings = string_names(ast.parse(path.read_text()))
        targets = {imported for imported in strings if imported in modules}
        for imported in imported_names(path, from_modules=False) - strings:
            while imported and imported not in modules:  # "pkg.module.function" -> "pkg.module"
                imported = imported.rpartition(".")[0]
            targets.add(imported)
        graph[name] = targets - {"", name}
    return graph


def test_the_import_graph_has_no_circle_and_no_upward_import():
    """A module never imports a package that holds it (hf_vanilla's `__init__`, or its own subpackage's), and no
    chain of imports, string imports included, comes back to where it started. The package root is the one
    exception by design: it loads the public modules lazily (PEP 562) and is imported by nothing inside."""
    graph = import_graph()
    upward = sorted(f"{name} -> {target}" for name, targets in graph.items() for target in targets
                    if name.startswith(target + "."))
    assert not upward, upward
    state, circles = {}, []

    def visit(name, path):
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, circles


def test_engines_sit_beside_the_model():
    """The model finds its engines through the registry and never imports one; the engines receive the model and
    never import its code; the registry, which travels with remote-code checkpoints, imports the standard library
    only and names the engines it loads on request."""
    model_code = {f"hf_vanilla.{name}" for name in ("configuration_vanilla", *MODEL_MODULES)}
    for path in [*(PACKAGE / "runtimes").rglob("*.py"), PACKAGE / "export.py"]:
        assert not imported_names(path) & model_code, path
        assert not any(name.startswith("hf_vanilla.conversion") for name in imported_names(path)), path
    registry = imported_names(PACKAGE / "runtime_registry.py")
    assert {name for name in registry if not name.startswith("hf_vanilla.")} <= set(sys.stdlib_module_names)
    assert {name for name in registry if name.startswith("hf_vanilla.")} == {"hf_vanilla.runtimes.auto",
                                                                              "hf_vanilla.runtimes.onnxruntime",
                                                                              "hf_vanilla.runtimes.openvino"}
    assert "hf_vanilla.runtime_registry" in imported_names(PACKAGE / "modeling_vanilla.py")
    for name in MODEL_MODULES:
        assert not any("runtimes" in imported for imported in imported_names(PACKAGE / f"{name}.py")), name


def test_auto_reaches_the_engines_through_the_registry_it_is_handed():
    """runtime="auto" puts the other engines on by name through the `apply_runtime` the registry hands it: it imports
    no engine's module, and not the registry, which names it (a circle)."""
    imported = imported_names(PACKAGE / "runtimes" / "auto.py")
    barred = ("hf_vanilla.runtimes.onnxruntime.", "hf_vanilla.runtimes.openvino.", "hf_vanilla.runtime_registry.")
    assert not sorted(name for name in imported if (name + ".").startswith(barred))


def test_modules_and_functions_stay_readable():
    """A module is read whole: at most 500 lines; a function is read at once: at most 60 lines."""
    long_modules, long_functions = [], []
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        if len(source.splitlines()) > 500:
            long_modules.append(f"{module_name(path)}: {len(source.splitlines())} lines (at most 500)")
        long_functions += [f"{module_name(path)}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
                           for node in ast.walk(ast.parse(source))
                           if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                           and node.end_lineno - node.lineno + 1 > 60]
    assert not long_modules and not long_functions, long_modules + long_functions


def test_calls_of_our_functions_name_their_arguments():
    """No call of a function, method or class defined in hf_vanilla/ or conversion/ passes five or more arguments
    by position (a `*args` splat counts as one): such a call depends on the order of a signature, and a reordering
    silently miswires it (shared/STYLE.md: arguments by name past the first two or three). Calls on torch, F, nn and
    np are theirs, whatever the name."""
    sources = [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "conversion").rglob("*.py")]
    trees = {path: ast.parse(path.read_text()) for path in sources}
    ours = {node.name for tree in trees.values() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    positional = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or len(node.args) < 5:
                continue
            function = node.func
            if isinstance(function, ast.Attribute) and isinstance(function.value, ast.Name) \
                    and function.value.id in ("torch", "F", "nn", "np"):
                continue
            name = function.id if isinstance(function, ast.Name) else getattr(function, "attr", None)
            if name in ours:
                positional.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}: {len(node.args)}")
    assert not positional, positional
