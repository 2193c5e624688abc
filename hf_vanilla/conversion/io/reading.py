"""Reading a source checkpoint without running its code: find it (a folder, or a Hub id to download), read its
config (refused unless its model_type is one the converter reads) and its tensors (safetensors, or a pickle through
`torch.load(weights_only=True)`; sharded or not; NaN and Inf refused), and check its tokenizer (its JSON files
parse; its size against the embeddings).

Every converter, in both directions, and the ONNX export read their sources here (writing.py writes the outputs).
"""

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ConversionError

# The tokenizer files that hold a vocabulary: a source with none of these has no tokenizer to check.
VOCABULARY_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model")
# The tokenizer files that are JSON, which the converters copy into the output as they are (writing.TOKENIZER_FILES).
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                        "vocab.json", "target_vocab.json")


def resolve_source(source: str) -> Path:
    """A local checkpoint directory as is; anything else is treated as a Hub id and downloaded."""
    path = Path(source)
    if path.is_dir():
        return path
    if path.exists():
        raise ConversionError(f"--source {source} is a file; pass the checkpoint's directory.")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.spm", "1_Pooling/*", "2_Normalize/*"]
        directory = Path(snapshot_download(source, allow_patterns=patterns))
        if not any(directory.glob("*.safetensors")):
            # Older checkpoints (many OPUS-MT models) hold only a pickle; load_tensors reads it with weights_only=True.
            directory = Path(snapshot_download(source, allow_patterns=patterns + ["pytorch_model*.bin"]))
        return directory
    except Exception as error:  # offline, unknown id, gated repo: all end the same way for the user
        raise ConversionError(
            f"--source {source!r} is not a local directory and could not be fetched from the Hugging Face Hub "
            f"({type(error).__name__}: {error}). Pass a local checkpoint directory, or check the id and network."
        ) from None


# How deep a JSON file the converter reads may nest. Configs nest a few levels (bert2bert: encoder -> id2label); the
# JSON parser recurses (RecursionError near 1000 levels), and so does transformers when it copies a config (near 450).
MAX_JSON_DEPTH = 64
JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # strings (brackets inside them do not count) and brackets


def read_json(path: Path, what: str) -> dict:
    """A JSON object from `path`; anything else (empty, malformed, a list, nested deeper than `MAX_JSON_DEPTH`) is an
    error naming the file."""
    try:
        text = path.read_text()
        value = json.loads(text)
    except ValueError as error:  # malformed, empty, or not text at all (UnicodeDecodeError)
        raise ConversionError(f"{path} is not valid JSON ({error}): the {what} is damaged. Download or save the "
                              f"checkpoint again.") from None
    except RecursionError:
        value = None  # too deep for the parser: `_too_deep` says where
    where = _too_deep(text)
    if where is not None:
        raise ConversionError(f"{path} nests values more than {MAX_JSON_DEPTH} levels deep ({where}), as no {what} "
                              f"does: the file is damaged or was crafted. Download or save the checkpoint again.")
    if not isinstance(value, dict):
        raise ConversionError(f"{path} holds {type(value).__name__}, not the JSON object a {what} is: it is damaged. "
                              f"Download or save the checkpoint again.")
    return value


def read_generation_config(source_dir: Path, vocab_size: int | None = None):
    """The checkpoint's generation_config.json as transformers' `GenerationConfig` (forced_eos_token_id,
    bad_words_ids, num_beams...: what `generate` does), or None where it has none. Damaged, holding settings
    transformers refuses, a setting of the wrong type or range (`check_generation_settings`), or, given the model's
    `vocab_size`, a token id outside the vocabulary: an error naming the file and the field."""
    from transformers import GenerationConfig

    path = source_dir / "generation_config.json"
    if not path.is_file():
        return None
    read_json(path, "generation config")
    try:
        generation = GenerationConfig.from_pretrained(source_dir)
    except (ValueError, TypeError) as error:
        raise ConversionError(f"{path} holds settings transformers refuses ({error}): fix or delete that file in the "
                              f"source.") from None
    check_generation_settings(generation, path, vocab_size)
    return generation


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _whole(low: int):
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low), f"a whole number from {low} up"


def _fraction(low_open: bool, high_open: bool):
    def within(v):
        return _number(v) and (0 < v if low_open else 0 <= v) and (v < 1 if high_open else v <= 1)
    return within, f"a number in {'(' if low_open else '['}0, 1{')' if high_open else ']'}"


# What `generate` needs each setting of a generation config to be, for the settings transformers reads from the file
# without checking and then fails on, or silently misreads, in `generate()` (num_beams "four", 0 beams, a temperature
# of 2 that its warper refuses as not a float). transformers' own checks (GenerationConfig.validate) run first.
def _factor(value) -> bool:
    """A multiplier transformers' warpers take: a float above 0 (they refuse the integer 2), or 1, which none
    applies."""
    return (isinstance(value, float) and value > 0) or (value == 1 and not isinstance(value, bool))


_FACTOR = (_factor, "a number above 0 written with a decimal point (transformers refuses 2 where it needs 2.0)")
GENERATION_SETTINGS = {
    "num_beams": _whole(1), "num_return_sequences": _whole(1), "max_length": _whole(1), "max_new_tokens": _whole(1),
    "min_length": _whole(0), "min_new_tokens": _whole(0), "no_repeat_ngram_size": _whole(0),
    "encoder_no_repeat_ngram_size": _whole(0), "top_k": _whole(0),
    **dict.fromkeys(("do_sample", "use_cache", "remove_invalid_values", "renormalize_logits", "output_scores",
                     "output_logits", "output_attentions", "output_hidden_states", "return_dict_in_generate"),
                    ((lambda v: isinstance(v, bool)), "true or false")),
    "temperature": _FACTOR, "repetition_penalty": _FACTOR, "encoder_repetition_penalty": _FACTOR,
    "length_penalty": (_number, "a number"),
    "top_p": _fraction(False, False), "typical_p": _fraction(True, False), "min_p": _fraction(False, False),
    "epsilon_cutoff": _fraction(False, True), "eta_cutoff": _fraction(False, True),
}
# Token ids: one id, or (where transformers takes several) a list of ids.
TOKEN_ID_SETTINGS = {"bos_token_id": False, "pad_token_id": False, "forced_bos_token_id": False,
                     "eos_token_id": True, "forced_eos_token_id": True, "decoder_start_token_id": True}
TOKEN_LIST_SETTINGS = ("suppress_tokens", "begin_suppress_tokens")


def check_generation_settings(generation, path, vocab_size: int | None = None) -> None:
    """Refuse a generation config (read from `path`, named in the message) holding a setting `generate` would fail on
    or misread: the types and ranges of `GENERATION_SETTINGS`, and token ids that are not ids (or, given the model's
    `vocab_size`, not rows of its vocabulary; `generate` would index past the logits)."""
    def refuse(setting, value, what):
        raise ConversionError(f"{path} sets {setting}={value!r}, but it must be {what}: fix that field (or delete it, "
                              f"for transformers' default) in the source.")

    for setting, (valid, what) in GENERATION_SETTINGS.items():
        value = getattr(generation, setting, None)
        if value is not None and not valid(value):
            refuse(setting, value, what)
    span = f"from 0 to {vocab_size - 1}: the vocabulary has {vocab_size} tokens" if vocab_size else "from 0 up"

    def is_id(value):
        return (isinstance(value, int) and not isinstance(value, bool) and value >= 0
                and (vocab_size is None or value < vocab_size))

    for setting, several in TOKEN_ID_SETTINGS.items():
        value = getattr(generation, setting, None)
        if value is None:
            continue
        if not (is_id(value) or several and isinstance(value, list) and value and all(map(is_id, value))):
            refuse(setting, value, f"a token id ({span})" + (" or a list of such ids" if several else ""))
    for setting in TOKEN_LIST_SETTINGS:
        value = getattr(generation, setting, None)
        if value is not None and not (isinstance(value, list) and all(map(is_id, value))):
            refuse(setting, value, f"a list of token ids ({span})")
    bad_words = getattr(generation, "bad_words_ids", None)
    if bad_words is not None and not (isinstance(bad_words, list) and all(
            isinstance(words, list) and words and all(map(is_id, words)) for words in bad_words)):
        refuse("bad_words_ids", bad_words, f"a list of token id sequences, each a non-empty list of ids ({span})")


def _too_deep(text: str) -> str | None:
    """Where the JSON `text` nests deeper than `MAX_JSON_DEPTH` ("under 'x'", its top-level key), or None. Counted on
    the text, without the parser's recursion: a string at depth 1 is a key (or a value, but then no nesting follows)."""
    depth, key = 0, None
    for match in JSON_TOKENS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return f"under {key!r}" if key is not None else "from its top level"
        elif token in "]}":
            depth -= 1
        elif depth == 1:
            key = token[1:-1]
    return None


@dataclass(frozen=True)
class Source:
    """A source checkpoint as a format's `read` found it, for the flow's later steps: its folder, its config (a dict),
    its tensors as read (the verification's reference holds them), the head to build, and, for an encoder-decoder,
    the generation ids its config and generation config give."""

    directory: Path
    config: dict
    tensors: dict
    head: str
    ids: dict = field(default_factory=dict)


def read_source(source: str, model_types: tuple[str, ...], converter: str) -> tuple[Path, dict]:
    """The source's folder and its config.json, refused unless its model_type is one that `converter` reads."""
    source_dir = resolve_source(source)
    config = read_config(source_dir)
    require_model_type(config, model_types, converter, source_dir)
    return source_dir, config


def read_config(source_dir: Path) -> dict:
    path = source_dir / "config.json"
    if not path.is_file():
        raise ConversionError(f"{source_dir} has no config.json: it is not a transformers checkpoint.")
    return read_json(path, "model config")


def require_model_type(config: dict, expected: tuple[str, ...], converter: str, source_dir: Path) -> None:
    model_type = config.get("model_type")
    if model_type not in expected:
        raise ConversionError(
            f"{source_dir} holds a {model_type!r} model, but the {converter!r} converter reads "
            f"{' or '.join(repr(e) for e in expected)}. Pick the converter for {model_type!r} "
            f"(--help lists them)."
        )


def load_tensors(source_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, sharded or not, refused if any holds NaN or Inf (named in the error)."""
    tensors = _read_tensors(source_dir)
    bad = [name for name, tensor in tensors.items() if not all_finite(tensor)]
    if bad:
        raise ConversionError(f"The source weights contain NaN or Inf in {len(bad)} tensors: {bad[:10]}.")
    return tensors


def _read_tensors(source_dir: Path) -> dict[str, torch.Tensor]:
    """Safetensors first; a pickle (`.bin`) only through `torch.load(weights_only=True)`, which refuses anything but
    tensors: a checkpoint never runs code here. A damaged file is told apart from one that is refused as unsafe."""
    for index, single, read in (("model.safetensors.index.json", "model.safetensors", _read_safetensors),
                                ("pytorch_model.bin.index.json", "pytorch_model.bin", _read_pickle)):
        if (source_dir / index).is_file() or (source_dir / single).is_file():
            files = _shards(source_dir, index) if (source_dir / index).is_file() else [single]
            tensors = {}
            for name in files:
                tensors.update(read(source_dir / name))
            return tensors
    found = sorted(p.name for p in source_dir.iterdir())
    raise ConversionError(
        f"{source_dir} has no weights (model.safetensors, its sharded index, or pytorch_model.bin); found {found}."
    )


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as error:
        raise ConversionError(f"{path} is not a readable safetensors file ({error}): it is truncated or damaged. "
                              f"Download or save the checkpoint again.") from None


def _read_pickle(path: Path) -> dict[str, torch.Tensor]:
    import pickle

    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "Weights only load failed" in str(error) and "truncated" not in str(error):
            raise ConversionError(
                f"Refused to load {path}: it is a pickle holding more than tensors, and unpickling it could run "
                f"code. Convert it to safetensors with a tool you trust, or use a safetensors version of the "
                f"checkpoint."
            ) from None
        raise _damaged_pickle(path, error) from None
    except Exception as error:  # truncated or damaged archives raise OSError, RuntimeError, EOFError...
        raise _damaged_pickle(path, error) from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ConversionError(f"{path} holds a {type(tensors).__name__}, not a dict of named tensors: it is not a "
                              f"model's weights (a training checkpoint? then save the model's state_dict).")
    return tensors


def _damaged_pickle(path: Path, error: Exception) -> ConversionError:
    detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return ConversionError(f"{path} could not be read ({detail}): it is truncated or damaged, not unsafe. Download or "
                           f"save the checkpoint again.")


def _shards(source_dir: Path, index: str) -> list[str]:
    """The shard files an index names, each confined to `source_dir`: an index is data, and a path such as
    `../elsewhere.safetensors` or `/etc/x` in it must not make the converter read outside the checkpoint. (Shards
    that are symbolic links, as in the Hub's cache, are followed: the check is on the names the index holds.)"""
    path = source_dir / index
    weight_map = read_json(path, "shard index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConversionError(f"{path} has no weight_map of tensor names to shard files: the index is damaged. "
                              f"Download or save the checkpoint again.")
    files = sorted(set(weight_map.values()))
    for name in files:
        parts = Path(name).parts
        if Path(name).is_absolute() or ".." in parts or not parts:
            raise ConversionError(f"{path} names the shard {name!r}, outside the checkpoint folder; shards must be "
                                  f"files inside {source_dir}. The index is damaged or was crafted.")
        if not (source_dir / name).is_file():
            raise ConversionError(f"{path} names the shard {name}, which is missing from {source_dir}: download "
                                  f"every shard the index lists.")
    return files


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN or Inf: its minimum and maximum are finite exactly when every element is
    (aminmax propagates NaN). One pass and no temporary of the tensor's size, where `isfinite(tensor).all()` makes a
    boolean copy of the tensor and reads it again."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) and torch.isfinite(high))


def check_tokenizer(source_dir: Path, vocab_size: int) -> None:
    """The source's tokenizer against the `vocab_size` rows of the embedding table.

    A tokenizer with more tokens (added tokens included: `len(tokenizer)`) would produce ids past the table, an index
    error at run time: refused. One with fewer is common and harmless (tables padded to a round size, unused rows):
    a note. A source without a tokenizer has nothing to check. A tokenizer JSON file that does not parse (a download
    that stopped part-way) is refused, naming it: it would be copied into the output as it is, and the converted
    model's tokenizer would fail to load."""
    for name in TOKENIZER_JSON_FILES:
        path = source_dir / name
        try:
            json.loads(path.read_bytes()) if path.is_file() else None
        except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8
            raise ConversionError(f"{path} is not valid JSON ({error}): it is damaged, perhaps cut short by a "
                                  f"download or copy that stopped part-way. Fetch it again from where the model came "
                                  f"from, or remove it from {source_dir} to convert without it.") from None
    if not any((source_dir / name).is_file() for name in VOCABULARY_FILES):
        return
    try:
        from transformers import AutoTokenizer

        size = len(AutoTokenizer.from_pretrained(source_dir))
    except Exception as error:  # a missing library (sentencepiece), or remote code we do not run: still convertible
        print(f"Note: the tokenizer in {source_dir} could not be loaded ({type(error).__name__}: {error}); its size "
              f"was not checked against the {vocab_size} embedding rows.")
        return
    if size > vocab_size:
        raise ConversionError(
            f"The tokenizer in {source_dir} has {size} tokens (added tokens included) but the embeddings have "
            f"{vocab_size} rows: ids {vocab_size} to {size - 1} would index past the table. Resize the source model's "
            f"embeddings to its tokenizer (model.resize_token_embeddings(len(tokenizer)), then save_pretrained), or "
            f"convert with the tokenizer the model was trained with."
        )
    if size < vocab_size:
        print(f"Note: the tokenizer has {size} tokens for {vocab_size} embedding rows; the last {vocab_size - size} "
              f"rows are never looked up by it (a table padded to a round size, or unused entries).")
