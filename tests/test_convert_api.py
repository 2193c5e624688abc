"""The Python conversion calls (`hf_vanilla.conversion.convert`, `to_transformers`) against the command line.

Each source is a small random transformers model saved with `save_pretrained`. The calls and the command line must
write the same files, bit for bit (the model card records the `hf-vanilla` command that does what the call did, and
that command, run, writes the same folder); refuse the same inputs with the same message; and the module-level names
of the formats before the one flow (`hf_vanilla.conversion.bert.convert`, ...) still convert, with a
DeprecationWarning naming the call that replaces them.
"""

import hashlib
import json
import re
import shlex
from contextlib import redirect_stderr, redirect_stdout
from io import StringIO
from pathlib import Path

import pytest
import torch
import transformers

from hf_vanilla.conversion import ConversionError, convert, to_transformers
from hf_vanilla.conversion.cli import main
from hf_vanilla.conversion.commands import CONVERSIONS
from hf_vanilla.conversion.io.output import MANIFEST

BERT = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=64)
MARIAN = dict(vocab_size=50, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
              decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=32,
              pad_token_id=49, decoder_start_token_id=49, eos_token_id=0)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    torch.manual_seed(0)
    transformers.BertForMaskedLM(transformers.BertConfig(**BERT)).save_pretrained(root / "bert-mlm")
    roberta = transformers.RobertaConfig(**BERT | {"max_position_embeddings": 66}, type_vocab_size=1, pad_token_id=1)
    transformers.RobertaForQuestionAnswering(roberta).save_pretrained(root / "roberta-qa")
    transformers.MarianMTModel(transformers.MarianConfig(**MARIAN)).save_pretrained(root / "marian")
    return root


def quiet(function, *args, **kwargs):
    out = StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        return function(*args, **kwargs), out.getvalue()


def cli(*argv) -> tuple[int, str]:
    return quiet(main, [str(a) for a in argv])


def files(folder: Path, rename: Path | None = None) -> dict:
    """name -> sha256 of every file; the model card with the folder's path written as `rename`'s (the card names
    its output folder) and the command line's program name as the installed command's; the manifest as the names it
    lists (it records each file's size and time)."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            if path.name == "README.md":
                data = data.replace(str(folder).encode(), str(rename or folder).encode())
                data = data.replace(b"python -m hf_vanilla.conversion ", b"hf-vanilla ")
            if path.name == MANIFEST:
                data = json.dumps(sorted(json.loads(data)["files"])).encode()
            out[str(path.relative_to(folder))] = hashlib.sha256(data).hexdigest()
    return out


def recorded_command(folder: Path) -> list[str]:
    """The `hf-vanilla ...` line of a converted folder's model card, as argv."""
    card = (folder / "README.md").read_text()
    (line,) = re.findall(r"^hf-vanilla .*$|^python -m \S+ .*$", card, flags=re.M)
    words = shlex.split(line)
    return words[1:] if words[0] == "hf-vanilla" else words[3:]


CALLS = {  # case -> (python call, source, options, the command line's flags)
    "bert mlm bfloat16": (convert, "bert", "bert-mlm", {"head": "masked-lm", "dtype": "bfloat16"},
                          ["--head", "masked-lm", "--dtype", "bfloat16"]),
    "bert base": (convert, "bert", "bert-mlm", {"head": "base"}, ["--head", "base"]),
    "roberta qa float16": (convert, "roberta", "roberta-qa", {"dtype": "float16"}, ["--dtype", "float16"]),
    "warm-start seed 3": (convert, "warm-start", "bert-mlm", {"seed": 3, "decoder_start_token_id": 2,
                                                              "eos_token_id": 3},
                          ["--seed", "3", "--decoder-start-token-id", "2", "--eos-token-id", "3"]),
    "marian": (convert, "marian", "marian", {}, []),
}


@pytest.mark.parametrize("case", list(CALLS))
def test_a_call_writes_what_the_command_line_writes(case, sources, tmp_path):
    """Bit for bit, the model card too: the call's card records the command line that repeats it, and that command,
    run, writes the same files."""
    call, fmt, source, options, flags = CALLS[case]
    (written, _) = quiet(call, fmt, sources / source, tmp_path / "api", **options)
    assert written == tmp_path / "api"
    status, report = cli(fmt, "--source", sources / source, "--output", tmp_path / "cli", *flags)
    assert status == 0, report
    recorded = recorded_command(tmp_path / "api")
    assert recorded == [fmt, "--source", str(sources / source), "--output", str(tmp_path / "api"), *flags]
    recorded[4] = tmp_path / "rep"
    status, report = cli(*recorded)
    assert status == 0, report
    assert files(tmp_path / "api") == files(tmp_path / "rep", rename=tmp_path / "api")
    assert files(tmp_path / "api") == files(tmp_path / "cli", rename=tmp_path / "api")


@pytest.mark.parametrize("fmt, source, options, flags", [
    ("bert", "bert-mlm", {}, []),
    ("roberta", "roberta-qa", {"model_type": "xlm-roberta", "dtype": "bfloat16"},
     ["--model-type", "xlm-roberta", "--dtype", "bfloat16"]),
    ("marian", "marian", {}, []),
])
def test_to_transformers_writes_what_to_format_writes(fmt, source, options, flags, sources, tmp_path):
    quiet(convert, fmt, sources / source, tmp_path / "vanilla")
    (written, report) = quiet(to_transformers, fmt, tmp_path / "vanilla", tmp_path / "api", **options)
    assert written == tmp_path / "api" and "OK: max |diff|" in report  # transformers loaded it, and agrees
    status, report = cli(f"to-{fmt}", "--source", tmp_path / "vanilla", "--output", tmp_path / "cli", *flags)
    assert status == 0, report
    assert files(tmp_path / "api") == files(tmp_path / "cli")


def failure(call, *args, **options) -> str:
    with pytest.raises(ConversionError) as error:
        quiet(call, *args, **options)
    return str(error.value)


def test_refusals_are_the_command_lines(sources, tmp_path):
    """The same checks refuse the same inputs: the call's ConversionError is the command line's `error:` line."""
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("not the converter's")
    cases = [
        ((convert, "bert", sources / "bert-mlm", tmp_path / "taken"), {}, ["bert", "--source", sources / "bert-mlm",
                                                                            "--output", tmp_path / "taken"]),
        ((convert, "bert", sources / "roberta-qa", tmp_path / "a"), {}, ["bert", "--source", sources / "roberta-qa",
                                                                          "--output", tmp_path / "a"]),
        ((convert, "bert", sources / "bert-mlm", tmp_path / "b"), {"head": "question-answering"},
         ["bert", "--source", sources / "bert-mlm", "--output", tmp_path / "b", "--head", "question-answering"]),
        ((to_transformers, "bart", sources / "marian", tmp_path / "c"), {},
         ["to-bart", "--source", sources / "marian", "--output", tmp_path / "c"]),
    ]
    for (call, *args), options, argv in cases:
        message = failure(call, *args, **options)
        status, printed = cli(*argv)
        assert status == 2 and printed.endswith(f"error: {message}\n"), (message, printed)
    assert not any((tmp_path / name).exists() for name in "abc")


def test_options_are_checked_as_the_command_line_checks_them(sources, tmp_path):
    """A value outside the flag's choices is refused naming them (the command line's usage error names the same);
    an option the format lacks is a TypeError; nothing is read or written."""
    message = failure(convert, "bert", sources / "bert-mlm", tmp_path / "x", head="masked_lm")
    assert message.startswith("head='masked_lm' is not one of ['auto', 'base', 'pretraining', 'masked-lm'")
    with pytest.raises(SystemExit) as exit, redirect_stderr(StringIO()) as usage:
        main(["bert", "--source", str(sources / "bert-mlm"), "--output", str(tmp_path / "x"), "--head", "masked_lm"])
    assert exit.value.code == 2
    choices = re.search(r"choose from (.*)\)", usage.getvalue()).group(1)
    assert [c.strip("'") for c in choices.split(", ")] == list(CONVERSIONS["bert"].options[0].choices)
    assert "dtype='int8' is not one of ['float32', 'float16', 'bfloat16']" in failure(
        to_transformers, "bert", tmp_path, tmp_path / "x", dtype="int8")
    assert "seed='3' is not an integer (--seed" in failure(convert, "warm-start", sources / "bert-mlm",
                                                             tmp_path / "x", seed="3")
    with pytest.raises(TypeError, match=r"marian takes no option 'head'; its options: \['dtype'\]"):
        convert("marian", sources / "marian", tmp_path / "x", head="base")
    with pytest.raises(TypeError, match=r"to-marian takes no option 'dtype'; its options: none"):
        to_transformers("marian", sources / "marian", tmp_path / "x", dtype="float32")
    assert "No conversion 'gpt2' to vanilla: convert() reads ['bert', 'warm-start', 'bert2bert', 'marian'" in failure(
        convert, "gpt2", sources / "bert-mlm", tmp_path / "x")
    assert "force='yes' is not True or False (--force of hf-vanilla bert)" in failure(
        convert, "bert", sources / "bert-mlm", tmp_path / "x", force="yes")
    assert "verify=1 is not True or False (--no-verify of hf-vanilla to-bert)" in failure(
        to_transformers, "bert", tmp_path, tmp_path / "x", verify=1)
    assert "No conversion 'to-bert' to vanilla" in failure(convert, "to-bert", sources / "bert-mlm", tmp_path / "x")
    assert "No conversion 'warm-start' back to transformers: " in failure(
        to_transformers, "warm-start", sources / "bert-mlm", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_the_names_before_the_one_flow_warn_and_convert(sources, tmp_path):
    """`hf_vanilla.conversion.bert.convert(source, output, head, ...)` and its kin: their old positional order and
    `verify_parity`, a DeprecationWarning naming the new call, and the same files as that call."""
    from hf_vanilla.conversion import bart, bert, bert2bert, marian

    quiet(convert, "bert", sources / "bert-mlm", tmp_path / "new", head="base")
    with pytest.warns(DeprecationWarning, match=r"hf_vanilla\.conversion\.bert\.convert is deprecated; call "
                                                r"hf_vanilla\.conversion\.convert\('bert', \.\.\.\)"):
        (written, _) = quiet(bert.convert, str(sources / "bert-mlm"), str(tmp_path / "old"), "base")
    assert written == tmp_path / "old"
    assert files(tmp_path / "old", rename=tmp_path / "new") == files(tmp_path / "new")

    with pytest.warns(DeprecationWarning, match=r"convert_marian is deprecated; call hf_vanilla\.conversion\."
                                                r"convert\('marian'"):
        quiet(marian.convert_marian, sources / "marian", tmp_path / "marian", "float32", False, False)
    assert "Not verified" in (tmp_path / "marian" / "README.md").read_text()  # verify_parity, positionally
    with pytest.warns(DeprecationWarning, match=r"to_marian is deprecated; call hf_vanilla\.conversion\."
                                                r"to_transformers\('marian'"):
        quiet(marian.to_marian, tmp_path / "marian", tmp_path / "marian-back", verify_parity=False)
    assert (tmp_path / "marian-back" / "config.json").is_file()
    with pytest.warns(DeprecationWarning, match=r"to_bart is deprecated"), pytest.raises(ConversionError):
        quiet(bart.to_bart, tmp_path / "marian", tmp_path / "bart")  # a Marian model is no BART: refused alike
    with pytest.warns(DeprecationWarning, match=r"convert_warm_start is deprecated; call hf_vanilla\.conversion\."
                                                r"convert\('warm-start'"):
        quiet(bert2bert.convert_warm_start, sources / "bert-mlm", tmp_path / "warm-old", "float32", False, False, 3,
              2, 3)
    quiet(convert, "warm-start", sources / "bert-mlm", tmp_path / "warm-new", seed=3, decoder_start_token_id=2,
          eos_token_id=3, verify=False)
    assert files(tmp_path / "warm-old", rename=tmp_path / "warm-new") == files(tmp_path / "warm-new")
