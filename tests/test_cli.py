"""The command line: `hf-vanilla` once installed, `python -m conversion` in the repository.

The installed wheel has one top-level package, `hf_vanilla`, with the converters inside it (`hf_vanilla.conversion`)
and the `hf-vanilla` console command; `--help` answers without importing torch or transformers.
"""

import json
import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from hf_vanilla.conversion.cli import main
from hf_vanilla.conversion.commands import CONVERSIONS
from hf_vanilla.conversion.formats import bert, distilbert, electra, roberta

REPOSITORY = Path(__file__).resolve().parents[1]
SUB_COMMANDS = ["bert", "to-bert", "warm-start", "bert2bert", "marian", "to-marian", "bart", "to-bart", "roberta",
                "to-roberta", "distilbert", "to-distilbert", "electra", "to-electra", "onnx"]

# Runs a module as `python -m` would, then reports whether torch or transformers got imported.
HELP_IMPORTS = """
import json, runpy, sys
module, sys.argv = sys.argv[1], sys.argv[1:]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit as exit:
    status = exit.code
print(json.dumps({"status": status, "heavy": sorted({"torch", "transformers"} & set(sys.modules))}))
"""


def run(python, *argv, cwd=REPOSITORY):
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(python), *map(str, argv)], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=600)


def test_every_sub_command_is_there(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("usage: python -m hf_vanilla.conversion")  # in-process: the package's name
    for name in SUB_COMMANDS:
        assert f"\n    {name} " in printed or f"\n    {name}\n" in printed, name


def test_head_and_model_type_choices_are_the_converters():
    """The light parser names each format's heads without importing the converters (from hf_vanilla/heads.py): the
    same names they convert."""
    formats = {"bert": bert.FORMAT, "roberta": roberta.FORMAT,
               "distilbert": distilbert.FORMAT, "electra": electra.FORMAT}
    for name, fmt in formats.items():
        options = {option.name: option.choices for option in CONVERSIONS[name].options}
        assert set(options["head"]) == {"auto", *fmt.heads}, name
        assert list(CONVERSIONS[f"to-{name}"].options[1].choices) == list(fmt.model_types), name
        assert CONVERSIONS[name].format() is CONVERSIONS[f"to-{name}"].format() is fmt


def test_a_format_must_convert_the_heads_heads_py_declares():
    """A head missing from a format module's table, or one heads.py does not declare for the format, is refused when
    the format is built: the command line would otherwise offer a head the converter lacks, or lack one it converts.
    Each head converts to the class heads.py declares for its name."""
    from dataclasses import replace

    from hf_vanilla.heads import MODELS

    heads = dict(roberta.FORMAT.heads)
    del heads["question-answering"]
    with pytest.raises(TypeError, match="not those hf_vanilla/heads.py declares for 'roberta'"):
        replace(roberta.FORMAT, heads=heads)
    heads = dict(roberta.FORMAT.heads, **{"causal-lm": bert.FORMAT.heads["causal-lm"]})  # declared for BERT only
    with pytest.raises(TypeError, match="not those hf_vanilla/heads.py declares for 'roberta'"):
        replace(roberta.FORMAT, heads=heads)
    for head in bert.FORMAT.heads:
        assert MODELS[bert.FORMAT.model_class(head).__name__].head == head


def test_in_process_conversion(tmp_path, capsys):
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         intermediate_size=37, max_position_embeddings=64)).save_pretrained(tmp_path / "bert")
    assert main(["bert", "--source", tmp_path / "bert", "--output", tmp_path / "out"]) == 0
    assert capsys.readouterr().out.endswith(f"Wrote {tmp_path / 'out'}\n")
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"python -m hf_vanilla.conversion bert --source {tmp_path / 'bert'} --output {tmp_path / 'out'}" in card


@pytest.mark.parametrize("argv", [["--help"], ["bert", "--help"], ["onnx", "--help"], ["bert", "--source", "x"]])
def test_help_and_usage_errors_import_no_torch(argv):
    result = run(sys.executable, "-c", HELP_IMPORTS, "conversion", *argv)
    outcome = json.loads(result.stdout.splitlines()[-1])
    assert outcome == {"status": 0 if "--help" in argv else 2, "heavy": []}, result.stderr
    if argv == ["onnx", "--help"]:
        assert 'pip install "hf_vanilla[onnx]"' in result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel built from the committed and working files (a copy: a build writes build/ and egg-info/)."""
    if shutil.which("git") is None:
        pytest.skip("git is needed to list the repository's files")
    root = tmp_path_factory.mktemp("wheel")
    files = run("git", "ls-files", "--cached", "--others", "--exclude-standard").stdout.split()
    for name in files:
        if (REPOSITORY / name).is_file():
            (root / "src" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(REPOSITORY / name, root / "src" / name)
    result = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", root / "src",
                 "-w", root / "dist")
    assert result.returncode == 0, result.stderr
    (path,) = (root / "dist").glob("hf_vanilla-*.whl")
    return path


def test_wheel_installs_one_top_level_package_and_the_command(wheel):
    import hf_vanilla

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n.rsplit("/", 1)[0] for n in names if n.endswith(".dist-info/RECORD"))
        assert archive.read(f"{info}/top_level.txt").decode() == "hf_vanilla\n"
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
        assert "hf-vanilla = hf_vanilla.conversion.cli:command_line" in entry_points
    assert {n.split("/")[0] for n in names} == {"hf_vanilla", info}
    assert {"hf_vanilla/conversion/cli.py", "hf_vanilla/conversion/flow.py", "hf_vanilla/conversion/io/reading.py",
            "hf_vanilla/conversion/formats/bert.py"} <= set(names)
    # The engines behind from_pretrained(runtime=...): the registry names them, the wheel must carry them.
    assert {"hf_vanilla/runtime_registry.py", "hf_vanilla/export.py", "hf_vanilla/runtimes/onnxruntime/engine.py"} <= set(names)
    assert info == f"hf_vanilla-{hf_vanilla.__version__}.dist-info"  # the version is hf_vanilla.__version__


def test_installed_command(wheel, tmp_path):
    """In a new virtual environment that sees this interpreter's torch and transformers, the wheel's copy of
    hf_vanilla (not the repository's) runs `hf-vanilla`: help without torch, and a real conversion."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir)  # no pip of its own (slow to set up): this pip installs into it
    python = env_dir / "bin" / "python"
    site_packages = env_dir / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    # The packages this test runs with, wherever they are: `system_site_packages=True` would instead show the base
    # interpreter's, which has no torch when the tests run in a virtual environment. A .pth file adds each folder
    # after the new environment's own site-packages, where the wheel goes, and runs no .pth file found in them (so
    # not the editable install's, which points at the repository).
    (site_packages / "running_interpreter.pth").write_text(
        "".join(f"{folder}\n" for folder in site.getsitepackages() + [site.getusersitepackages()]
                if folder in sys.path))
    installing = run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel)
    assert installing.returncode == 0, installing.stderr
    outside = tmp_path / "elsewhere"  # not the repository: its folders must not shadow the installed package
    outside.mkdir()
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def installed(*argv):
        return subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd=outside,
                              env=clean | {"HF_HUB_OFFLINE": "1"}, timeout=600)

    where = installed(python, "-c", "import hf_vanilla.conversion as c; print(c.__file__)")
    assert where.stdout.strip() == str(site_packages / "hf_vanilla" / "conversion" / "__init__.py"), where.stderr
    command = env_dir / "bin" / "hf-vanilla"
    shown = installed(command, "--help")
    assert shown.returncode == 0 and shown.stdout.startswith("usage: hf-vanilla [-h] FORMAT")
    # What the console script does (import the entry point's module with argv[0] = the command), observed.
    probe = ("import json, sys\nsys.argv = [sys.argv[1], 'bert', '--help']\nfrom hf_vanilla.conversion.cli import "
             "command_line\ntry:\n    command_line()\nexcept SystemExit as exit:\n    status = exit.code\n"
             "print(json.dumps([status, sorted({'torch', 'transformers'} & set(sys.modules))]))")
    assert json.loads(installed(python, "-c", probe, command).stdout.splitlines()[-1]) == [0, []]

    from transformers import BertConfig, BertModel

    BertModel(BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         intermediate_size=37, max_position_embeddings=64)).save_pretrained(tmp_path / "bert")
    converted = installed(command, "bert", "--source", tmp_path / "bert", "--output", tmp_path / "out")
    assert converted.returncode == 0, converted.stderr
    assert f"hf-vanilla bert --source {tmp_path / 'bert'}" in (tmp_path / "out" / "README.md").read_text()
