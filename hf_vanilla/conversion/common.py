"""What every converter shares: find the source, read its tensors without running its code, map keys strictly,
build the target without a second copy of the weights, write the output atomically, and report parity."""

import json
import re
import shutil
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from hf_vanilla import (
    VanillaEncoderConfig,
    VanillaEncoderForMaskedLM,
    VanillaEncoderForQuestionAnswering,
    VanillaEncoderForTokenClassification,
    VanillaEncoderModel,
)

from ..heads import class_for_head, converter_heads
from .errors import ConversionError
from .output import atomic_output
from .parity import PRECISION_NAMES, check, require_parity, rule

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Files copied next to converted weights when the source has them: tokenizers of every family we read, and the
# sentence-transformers configuration (pooling, normalisation, max_seq_length), which would otherwise silently change.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.txt",
    "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model", "source.spm", "target.spm",
    "target_vocab.json",  # Marian models with separate source and target vocabularies
)
# Those of them that hold a vocabulary: a source with none of these has no tokenizer to check.
VOCABULARY_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model")
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
SENTENCE_TRANSFORMERS_DIRS = ("1_Pooling", "2_Normalize", "2_Dense", "3_Normalize")


# ---- reading the source ---------------------------------------------------------------------------------------


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
    (aminmax propagates NaN). One pass and no temporary of the tensor's size: bert-base's weights take 0.02 s, where
    `isfinite(tensor).all()` took 0.17 s."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) and torch.isfinite(high))


def check_tokenizer(source_dir: Path, vocab_size: int) -> None:
    """The source's tokenizer against the `vocab_size` rows of the embedding table.

    A tokenizer with more tokens (added tokens included: `len(tokenizer)`) would produce ids past the table, an index
    error at run time: refused. One with fewer is common and harmless (tables padded to a round size, unused rows):
    a note. A source without a tokenizer has nothing to check."""
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


# ---- mapping keys -----------------------------------------------------------------------------------------------


def require_encoder(source_config: dict, title: str, decoder_hint: str = "only encoders convert.",
                    causal: bool = False) -> None:
    """Refuse what a vanilla encoder cannot compute: relative positions, cross-attention, and (unless the format
    carries `is_decoder` over, `causal`) a stack masked to the past."""
    if source_config.get("position_embedding_type", "absolute") != "absolute":
        raise ConversionError(
            f"position_embedding_type={source_config['position_embedding_type']!r} (relative positions) has no "
            f"vanilla equivalent; only absolute (learned) positions convert."
        )
    if source_config.get("add_cross_attention") or (source_config.get("is_decoder") and not causal):
        raise ConversionError(f"This {title} is a decoder (is_decoder/add_cross_attention); {decoder_hint}")


# Buffers BERT-family checkpoints may store (module-relative keys): left out, the model recomputes them.
BUFFERS = {
    "embeddings.position_ids": "a buffer of 0..max_positions-1, recomputed by the model",
    "embeddings.token_type_ids": "a buffer of zeros, recomputed by the model",
}


def normalise_keys(tensors: dict, prefix: str = "") -> dict:
    """TF-era LayerNorm `gamma`/`beta` -> `weight`/`bias` (bert-base-uncased still has them; transformers renames
    them when loading too), and `prefix` (a head model's `bert.`) stripped, as `from_pretrained` does for a base
    model."""
    normalised = {}
    for key, tensor in tensors.items():
        if key.endswith(".gamma"):
            key = key.removesuffix(".gamma") + ".weight"
        elif key.endswith(".beta"):
            key = key.removesuffix(".beta") + ".bias"
        normalised[key.removeprefix(prefix)] = tensor
    return normalised


def expand_table(table: list[tuple[str, str]], num_layers: int) -> dict[str, str]:
    """A key table written once per layer ({i} marks the layer) -> one entry per module of the model."""
    expanded = {}
    for source, target in table:
        for i in range(num_layers) if "{i}" in source else [None]:
            expanded[source.format(i=i)] = target.format(i=i)
    return expanded


def map_tensors(source: dict, modules: dict[str, str], dropped: dict[str, str]) -> tuple[dict, list[str]]:
    """Rename `module.leaf` keys through the module table. Returns the mapped tensors and the unmapped keys;
    `dropped` maps a key prefix to the reason it is left out (e.g. a head the target does not have)."""
    mapped, unknown = {}, []
    for key, tensor in source.items():
        module, _, leaf = key.rpartition(".")
        if module in modules:
            mapped[f"{modules[module]}.{leaf}"] = tensor
        elif not any(key.startswith(prefix) for prefix in dropped):
            unknown.append(key)
    return mapped, unknown


def untie(tensors: dict, tied: dict[str, str], title: str, way_out: str) -> None:
    """Drop from `tensors` the stored copies of tied weights ({copy: original}), each checked equal to its original:
    a copy that differs means an untied checkpoint, which a head that ties them would silently change. A copy whose
    original is missing stands in for it, as transformers' loader lets it."""
    for copy, original in tied.items():
        if copy not in tensors:
            continue
        tensor = tensors.pop(copy)
        if original not in tensors:
            tensors[original] = tensor
        elif not torch.equal(tensor, tensors[original]):
            raise ConversionError(f"{copy} differs from {original}, the weight it is tied to: the checkpoint is "
                                  f"untied, and {title}'s head ties them. {way_out}")


def source_namer(table: dict[str, str], checkpoint_names: dict[str, str] | None = None):
    """For error messages: target key -> the source key it is read from (through `table`, source module -> target
    module), as the checkpoint spells it when `checkpoint_names` knows it."""
    inverse = {target: source for source, target in table.items()}

    def source_name(key: str) -> str | None:
        module, _, leaf = key.rpartition(".")
        if module not in inverse:
            return None
        name = f"{inverse[module]}.{leaf}"
        return (checkpoint_names or {}).get(name, name)

    return source_name


def build_model(model_class, config, tensors: dict[str, torch.Tensor], unknown: list[str], source_name=None):
    """Build `model_class(config)` on the meta device and give it `tensors` without copying them.

    Strict: unknown source keys, missing target tensors (other than tied ones) and shape mismatches are all
    errors listing the offending keys. `source_name` (target key -> the source key it is read from, or None), when
    given, names the source tensor next to each target key in those messages."""
    with torch.device("meta"):
        model = model_class(config)
    tied = set(model.get_expanded_tied_weights_keys(all_submodels=True))
    targets = model.state_dict()  # on the meta device: shapes and dtypes, no memory
    expected = {k: v.shape for k, v in targets.items()}

    def named(key):
        source = source_name(key) if source_name is not None else None
        return f"{key} (from {source})" if source else key

    missing = [named(k) for k in sorted(expected) if k not in tensors and k not in tied]
    unexpected = sorted(k for k in tensors if k not in expected)
    wrong_shape = [
        f"{named(k)}: source {tuple(t.shape)} vs target {tuple(expected[k])}"
        for k, t in tensors.items() if k in expected and t.shape != expected[k]
    ]
    wrong_dtype = [f"{named(k)}: {t.dtype}" for k, t in tensors.items()
                   if k in targets and targets[k].is_floating_point() and not t.is_floating_point()]
    problems = []
    if unknown:
        problems.append(f"source tensors with no mapping: {unknown}")
    if missing:
        problems.append(f"target tensors the source does not fill: {missing}")
        stacks = ("encoder.", "decoder.", "model.encoder.", "model.decoder.")
        if not any(key.startswith(stacks) for key in missing):  # only the head's own weights (its pooler too)
            problems.append(f"the source has no trained {model_class.__name__} head: convert the encoder alone "
                            f"(--head base) and fine-tune it (examples/finetune_classification.py), or start from "
                            f"a checkpoint fine-tuned for this task")
    if unexpected:
        problems.append(f"mapped tensors the target does not have: {unexpected}")
    if wrong_shape:
        problems.append(f"shape mismatches: {wrong_shape}")
    if wrong_dtype:
        problems.append(f"weights of an integer or bool dtype (a model's weights are floating point: float32, "
                        f"float16 or bfloat16; the checkpoint is damaged or not a model's weights): {wrong_dtype}")
    if problems:
        raise ConversionError("The checkpoint does not fit the target model:\n  " + "\n  ".join(problems))
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    _materialise_buffers(model)
    return model.eval()


def _materialise_buffers(model) -> None:
    """Non-persistent buffers (the sinusoidal table) are not in checkpoints: rebuild them off the meta device."""
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                module.register_buffer(name, torch.empty(buffer.shape, dtype=buffer.dtype), persistent=False)
                model._init_weights(module)


# ---- writing the output -----------------------------------------------------------------------------------------


def write_conversion(output: str, force: bool, source: str, source_dir: Path, build, verify, save, title: str,
                     command: str, notes: str = "", dtype: str = "float32") -> Path:
    """How every source -> vanilla converter ends, inside `atomic_output` (so nothing is written unless every step
    passes): `build()` the model, check the source's tokenizer against its vocabulary, `verify(model)` -> (ok,
    summary) in float32 unless `verify` is None (--no-verify), cast it to `dtype` (`cast_for_saving`) and, for a half
    precision, `verify` it again as it will be saved, `save(model, directory)`, and a model card that records
    `command`, the parity summaries and `notes`. The float32 check compares the conversion exactly; the second what is
    written, in the dtype it runs in."""
    with atomic_output(output, force, sources=(source_dir,)) as staging:
        model = build()
        check_tokenizer(source_dir, model.config.vocab_size)
        parity = "Not verified (--no-verify)."
        if verify is not None:
            ok, parity = verify(model.float())
            require_parity(ok, parity)
        cast_for_saving(model, dtype)
        if verify is not None and dtype != "float32":
            print(f"Verifying the model as saved, in {dtype}:")
            ok, saved = verify(model)
            require_parity(ok, saved)
            parity = f"{parity}\n\nAs saved ({dtype}): {saved}"
        save(model, staging)
        write_model_card(staging, title, source, command, f"{parity}\n\n{notes}".strip())
    return Path(output)


def cast_for_saving(model, dtype: str) -> None:
    """Cast `model` to `dtype`, refused if a weight becomes Inf: the source's weights are finite (`load_tensors`), but
    one beyond float16's range (65504) is Inf in float16, and the saved model would compute Inf and NaN."""
    model.to(DTYPES[dtype])
    bad = [name for name, tensor in model.state_dict().items() if not all_finite(tensor)]
    if bad:
        raise ConversionError(
            f"In {dtype} {len(bad)} tensors would hold Inf or NaN (values beyond its range, "
            f"±{torch.finfo(DTYPES[dtype]).max:.0f}): {bad[:10]}. Convert with --dtype float32 or bfloat16 (which "
            f"keeps float32's range), or check the source's weights."
        )


def save_checkpoint(model, directory: Path, source_dir: Path | None) -> None:
    """Save weights (safetensors, in the model's dtype: `cast_for_saving`), config with a full `auto_map`, our code
    files for `trust_remote_code`, and the source's tokenizer and sentence-transformers files."""
    from hf_vanilla import AUTO_CLASSES

    config_class = type(model.config)
    auto_map = {"AutoConfig": f"configuration_vanilla.{config_class.__name__}"}
    for auto_class, model_class in AUTO_CLASSES[config_class].items():
        auto_map[auto_class.__name__] = f"modeling_vanilla.{model_class.__name__}"
    # `import hf_vanilla` registered every class for its Auto class, so save_pretrained copies configuration_vanilla.py
    # and modeling_vanilla.py next to the weights; it records only the saved class, so the full map (every task
    # class) is set afterwards.
    model.save_pretrained(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = auto_map
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if source_dir is not None:
        copy_side_files(source_dir, directory)


def copy_side_files(source_dir: Path, directory: Path, names=TOKENIZER_FILES + SENTENCE_TRANSFORMERS_FILES,
                    folders=SENTENCE_TRANSFORMERS_DIRS) -> list[str]:
    """Copy the files `names` and the folders `folders` that the source has; returns the file names copied.

    Contents only (`shutil.copyfile`), not the source's permission bits: the output follows the umask, as the
    files `save_pretrained` writes do."""
    copied = [name for name in names if (source_dir / name).is_file()]
    for name in copied:
        shutil.copyfile(source_dir / name, directory / name)
    for name in folders:
        if (source_dir / name).is_dir():
            (directory / name).mkdir()
            for path in sorted((source_dir / name).rglob("*")):  # not copytree: it copies the folders' modes
                target = directory / path.relative_to(source_dir)
                target.mkdir() if path.is_dir() else shutil.copyfile(path, target)
    return copied


def write_model_card(directory: Path, title: str, source: str, command: str, parity: str) -> None:
    (directory / "README.md").write_text(
        f"---\nlibrary_name: transformers\ntags:\n- hf_vanilla\n---\n\n# {title}\n\n"
        f"Converted with [hf_vanilla](https://github.com/hf-vanilla/hf_vanilla) from `{source}`:\n\n"
        f"```\n{command}\n```\n\n## Parity\n\n{parity}\n\n## Loading\n\n"
        f"```python\nimport hf_vanilla  # registers the model classes\nfrom transformers import AutoModel\n"
        f"model = AutoModel.from_pretrained(PATH)\n# or, without hf_vanilla installed (runs the code files saved "
        f"here):\nmodel = AutoModel.from_pretrained(PATH, trust_remote_code=True)\n```\n"
    )


# ---- verification -----------------------------------------------------------------------------------------------


def reference_model(model_class, tensors: dict, source_dir: Path | None = None, config=None):
    """`model_class` as `model_class.from_pretrained(source_dir)` loads it (its config and generation config; eager
    attention, float32, eval mode), but holding `tensors`, the weights the converter has already read.

    transformers' own loader still places them (its key renames such as gamma -> weight, prefixes, tied weights), so
    the reference owes nothing to our key tables; it only avoids a second copy of the weights (from_pretrained would
    map the file again, and the process's memory would count both). The reference and our model therefore share the
    tensors' storage: verification relies on conversion never writing into them. `config`, when given, is used
    instead of the source's config.json (a reference built, not loaded)."""
    from transformers import GenerationConfig

    options = {}
    if source_dir is not None and (source_dir / "generation_config.json").is_file():
        options["generation_config"] = GenerationConfig.from_pretrained(source_dir)
    config = config if config is not None else model_class.config_class.from_pretrained(source_dir)
    # A shallow copy: the loader may rename keys in the dict it is given, and the converter reads this one again.
    reference = model_class.from_pretrained(None, config=config, state_dict=dict(tensors),
                                            attn_implementation="eager", dtype=torch.float32, **options)
    return reference.eval()


def max_differences(reference: tuple, ours: tuple, mask: torch.Tensor | None) -> list[float]:
    """Per-layer max |difference|, over real tokens only (padding positions carry no meaning)."""
    diffs = []
    for ref, out in zip(reference, ours, strict=True):
        delta = (ref.float() - out.float()).abs()
        diffs.append((delta[mask.bool()] if mask is not None else delta).max().item())
    return diffs


def verification_batch(config, batch_size: int = 3, length: int = 24, seed: int = 0) -> dict:
    """Random ids, right-padded rows of different lengths, two segments when the model has token types."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, config.vocab_size, (batch_size, length), generator=generator)
    lengths = torch.tensor([length, length * 2 // 3, length // 3])[:batch_size]
    attention_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    input_ids = input_ids.masked_fill(attention_mask == 0, config.pad_token_id or 0)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if getattr(config, "type_vocab_size", 0) > 1:  # DistilBERT's config has no token types at all
        second = (torch.arange(length)[None, :] >= lengths[:, None] // 2) & (attention_mask == 1)
        batch["token_type_ids"] = second.long()
    return batch


def compare(reference, model) -> tuple[bool, str]:
    """Feed both models `verification_batch`; check every layer's hidden states and the head's outputs
    (pooler_output, logits, start/end logits) by the parity rule (`parity.check`) for `model`'s dtype, at real tokens
    only (padding positions carry no meaning). Returns (all within the rule, a one-line summary)."""
    batch = verification_batch(model.config)
    mask = batch["attention_mask"]
    if type(model).__name__.endswith("ForMultipleChoice"):  # one question, whose choices are the batch's rows
        batch = {name: tensor[None] for name, tensor in batch.items()}  # (1, C, T)
    with torch.no_grad():
        ref_out = reference(**batch, output_hidden_states=True)
        our_out = model(**batch, output_hidden_states=True)
    ok, worst = check("hidden states", ref_out.hidden_states, our_out.hidden_states, mask, model.dtype)
    summary = [f"hidden states (every layer) {worst:.1e}"]
    for name in ("pooler_output", "logits", "prediction_logits", "seq_relationship_logits", "start_logits",
                 "end_logits"):
        ref, ours = getattr(ref_out, name, None), getattr(our_out, name, None)
        if ref is None or ours is None:  # a base model without a pooler, or an output this head has not
            continue
        within, diff = check(name, ref, ours, mask, model.dtype)
        ok = ok and within
        summary.append(f"{name} {diff:.1e}")
    return ok, (f"max |diff| against {type(reference).__name__}: " + ", ".join(summary) +
                f" ({PRECISION_NAMES[model.dtype]}, eager attention, right-padded batch; {rule(model.dtype)} for "
                f"every layer and head output).")


def write_source_format(output: str, force: bool, source_dir: Path, model, verify=None) -> Path:
    """How every vanilla -> transformers converter ends: the source's tokenizer checked against the model's
    vocabulary, then inside `atomic_output` (whose `sources` guard keeps the source out of reach): the model saved
    with transformers, the source's tokenizer and side files copied, and `verify(directory)` -> (ok, summary) run on
    the written folder unless `verify` is None (--no-verify)."""
    check_tokenizer(source_dir, model.config.vocab_size)
    with atomic_output(output, force, sources=(source_dir,)) as staging:
        model.save_pretrained(staging)
        copy_side_files(source_dir, staging)
        if verify is not None:
            require_parity(*verify(staging))
    return Path(output)


# ---- BERT-family encoders: one flow for BERT, RoBERTa, DistilBERT and ELECTRA -------------------------------------


@dataclass(frozen=True)
class EncoderHead:
    """One head of a BERT-family format.

    Args:
        model_class: the vanilla model that holds it. Whether the head reads the pooler is the class's
            `uses_pooler`: then the source's pooler is converted with it, otherwise left out.
        source_suffix: the transformers class name after the family prefix ("ForMaskedLM" -> RobertaForMaskedLM).
        table: source module -> ours, for the head's own modules (outside the base model).
        tied: source key -> the key it duplicates (keys without the format's prefix). Older checkpoints store tied
            weights twice; each copy must equal its original (else the checkpoint is untied and refused) and is then
            dropped; a copy whose original is missing stands in for it.
        causal: the head reads a stack masked to the past (BERT's `BertLMHeadModel`): the converted config gets
            `is_decoder=True`.
    """

    model_class: type
    source_suffix: str
    table: tuple = ()
    tied: dict = field(default_factory=dict)
    causal: bool = False


# The encoder alone, which every format has.
BASE_HEAD = EncoderHead(VanillaEncoderModel, "Model")


def masked_lm_head(dense: str, norm: str, decoder: str, tied: dict) -> EncoderHead:
    """A format's MLM head under its own module names: dense, activation, LayerNorm, and the decoder tied to the
    word embeddings (its bias kept) -- BERT's head, which is our `VanillaLMHead`. `tied`: see `EncoderHead`."""
    return EncoderHead(VanillaEncoderForMaskedLM, "ForMaskedLM",
                       table=((dense, "lm_head.dense"), (norm, "lm_head.norm"), (decoder, "lm_head.decoder")),
                       tied=tied)


# The task heads every BERT-family format names as BERT does (`classifier`, `qa_outputs`), as ours do.
TASK_HEADS = {
    "token-classification": EncoderHead(
        VanillaEncoderForTokenClassification, "ForTokenClassification", table=(("classifier", "classifier"),)
    ),
    "question-answering": EncoderHead(
        VanillaEncoderForQuestionAnswering, "ForQuestionAnswering", table=(("qa_outputs", "qa_outputs"),)
    ),
}

# transformers' classes of the family that a format without the matching head refuses, and why (`EncoderFormat`).
UNCONVERTED_CLASSES = {
    "ForMultipleChoice": "this format's multiple-choice head is not converted",
    "ForCausalLM": "it is a decoder",
}


@dataclass(frozen=True)
class EncoderFormat:
    """A BERT-family source format as data; the methods convert it to a vanilla encoder and back, and check parity.

    A format module (conversion/bert.py, roberta.py, distilbert.py, electra.py) fills one in: its key tables, its
    heads, and how its config maps onto `VanillaEncoderConfig` and back. The flow is shared so that the formats behave
    alike: the same strictness (every source tensor mapped or dropped with a reason, every target tensor filled,
    shapes checked, errors naming the checkpoint's own keys), the same atomic output, the same layer-by-layer
    verification, and the reverse conversion built from the same table, inverted, and checked by loading what it
    wrote with transformers.

    Args:
        name: the sub-command ("roberta"); the reverse one is "to-" + name.
        title: how the format is called in messages ("RoBERTa").
        model_types: the source `model_type`s the format reads ("roberta", "xlm-roberta"); the first is what the
            reverse conversion writes by default. transformers names their classes (`class_prefix`) and where its
            head models keep the encoder (`prefix`).
        encoder_table: source module -> ours within the base model, `{i}` marking the layer. A row whose target is
            "pooler" is used only by heads that read the pooler (the base model's, when the checkpoint has one).
        heads: head name (the --head choice) -> `EncoderHead`.
        vanilla_config: (full source config dict, head) -> `VanillaEncoderConfig`; raises `ConversionError`.
        source_config: (`VanillaEncoderConfig`, head, model_type) -> the transformers config; raises
            `ConversionError` for what the format cannot express beyond `fixed_values` and what every format checks.
        fixed_values: (`VanillaEncoderConfig`) -> {field: (value, why)}: our config fields that the format computes
            with one value only; the reverse conversion refuses any other, every such field named at once.
        refused: source class suffix -> why that head cannot be expressed (the message adds the way out); merged
            over `UNCONVERTED_CLASSES` for the suffixes `heads` lacks.
        task_modules: source modules of the refused heads ("classifier" for RoBERTa's dense + out_proj): left out,
            with every other head's modules, when the encoder alone is converted (--head base).
        mislabelled: source class suffix -> (head, key): a checkpoint whose `architectures` names that class but
            that stores `key` holds `head` (bert-base-uncased says BertForMaskedLM and is BERT's whole pre-training
            model), which `--head auto` converts so that nothing it holds is thrown away.
        decoder_hint: the way out named when a decoder (cross-attention, or a causal stack where no head is
            causal) is refused.
        limitations: appended to the converted model card's parity section.
    """

    name: str
    title: str
    model_types: tuple
    encoder_table: tuple
    heads: dict
    vanilla_config: object
    source_config: object
    fixed_values: object
    refused: dict = field(default_factory=dict)
    task_modules: tuple = ()
    mislabelled: dict = field(default_factory=dict)
    decoder_hint: str = "only encoders convert."
    limitations: str = ""

    def __post_init__(self):
        """`heads` must be the heads hf_vanilla/heads.py declares for this format (what the command line offers),
        each holding the class declared for it: a head added to one and not the other fails here, on import."""
        declared = converter_heads(self.name)
        wrong = [f"{head} -> {spec.model_class.__name__}" for head, spec in self.heads.items()
                 if head in declared and spec.model_class.__name__ != class_for_head(head)]
        if set(self.heads) != set(declared) or wrong:
            raise TypeError(f"The {self.title} format's heads {sorted(self.heads)} are not those hf_vanilla/heads.py "
                            f"declares for {self.name!r}, {sorted(declared)}, or hold another class ({wrong}): "
                            f"declare each head once there, with its `formats`.")

    # ---- names and tables ----

    @staticmethod
    def class_prefix(model_type: str) -> str:
        """What transformers' classes of `model_type` start with ("xlm-roberta" -> "XLMRoberta")."""
        from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

        return MODEL_MAPPING_NAMES[model_type].removesuffix("Model")

    def source_class(self, model_type: str, head: str):
        import transformers

        return getattr(transformers, self.class_prefix(model_type) + self.heads[head].source_suffix)

    @property
    def prefix(self) -> str:
        """Where the source's head models keep the encoder ("roberta."): source keys are read without it
        (transformers' loader accepts either too), and the reverse conversion writes it for head models."""
        return self.source_class(self.model_types[0], "base").base_model_prefix + "."

    def reads_pooler(self, head: str) -> bool:
        """Whether `head` keeps the source's pooler: the base model (when it has one) and heads that read it."""
        return head == "base" or self.heads[head].model_class.uses_pooler

    def head_for(self, source_config: dict, requested: str, tensors: dict) -> str:
        """The head to build: as requested, else as the source's `architectures` says (see `mislabelled`)."""
        if requested != "auto":
            return requested
        model_type = source_config["model_type"]
        architecture = (source_config.get("architectures") or [self.class_prefix(model_type) + "Model"])[0]
        prefixes = [self.class_prefix(t) for t in self.model_types]
        prefix = max((p for p in prefixes if architecture.startswith(p)), key=len, default="")
        suffix = architecture.removeprefix(prefix)
        heads = {spec.source_suffix: head for head, spec in self.heads.items()}
        refused = {s: why for s, why in (UNCONVERTED_CLASSES | self.refused).items() if s not in heads}
        if suffix in refused:
            raise ConversionError(
                f"{architecture} cannot be converted: {refused[suffix]}. Convert the encoder alone with "
                f"--head base (its task head is then dropped)."
            )
        if suffix in self.mislabelled:
            head, key = self.mislabelled[suffix]
            if any(name.endswith(key) for name in tensors):
                return head
        if suffix not in heads:
            raise ConversionError(
                f"No vanilla head matches the source architecture {architecture!r}; pass --head with one of "
                f"{sorted(self.heads)} (e.g. --head base for the encoder alone)."
            )
        return heads[suffix]

    def key_table(self, num_layers: int, head: str, source_prefix: str = "") -> dict[str, str]:
        """Source module -> ours for every module of `head`; `source_prefix` ("roberta.") is what the source's head
        models put before the encoder's modules, as `model.` does before ours."""
        our_prefix = "" if head == "base" else "model."
        rows = [row for row in self.encoder_table if row[1] != "pooler" or self.reads_pooler(head)]
        table = {source_prefix + s: our_prefix + o for s, o in expand_table(rows, num_layers).items()}
        table.update(expand_table(list(self.heads[head].table), 0))
        return table

    def dropped_keys(self, head: str) -> dict[str, str]:
        """Source key prefixes (without the format's prefix) left out on purpose, with the reason: the buffers, an
        unread pooler, and the modules of the other heads (a pre-training checkpoint holds two)."""
        dropped = dict(BUFFERS)
        if not self.reads_pooler(head):
            dropped["pooler."] = f"the pooler, which neither {self.title}'s {head} model nor ours builds or reads"
        own = {module for module, _ in self.heads[head].table}
        others = [module for spec in self.heads.values() for module, _ in spec.table]
        for module in others + (list(self.task_modules) if head == "base" else []):
            if module not in own:
                dropped.setdefault(module + ".", f"a head other than the requested --head {head}")
        return dropped

    # ---- source -> vanilla ----

    def encoder_config(self, source_config: dict, head: str) -> VanillaEncoderConfig:
        """The source's config (a dict) as ours, refused if a vanilla encoder cannot compute what it describes."""
        from huggingface_hub.errors import StrictDataclassError

        causal = any(spec.causal for spec in self.heads.values())  # the format carries `is_decoder` over
        require_encoder(source_config, self.title, self.decoder_hint, causal=causal)
        try:
            config = self.vanilla_config(source_config, head)
            config.check_architecture()
        except (ValueError, StrictDataclassError) as error:
            raise ConversionError(f"The source's config.json describes no valid encoder: {error}") from None
        return config

    def to_vanilla(self, tensors: dict, source_config: dict, head: str):
        """In memory: source tensors and full config dict -> a vanilla model sharing their storage."""
        config = self.encoder_config(source_config, head)
        spec = self.heads[head]
        normalised = normalise_keys(tensors, self.prefix)
        checkpoint_names = dict(zip(normalised, tensors))  # for messages: the names the user's checkpoint has
        untie(normalised, spec.tied, self.title, "Convert with --head base to keep the encoder only.")
        # A base model has a pooler when saved with one (BertModel(add_pooling_layer=False) has none); a head that
        # reads it needs it (a checkpoint without one is reported as missing it); other heads never build one.
        pooler = [f"{module}.weight" for module, ours in self.encoder_table if ours == "pooler"]
        config.use_pooler = self.reads_pooler(head) and (head != "base" or any(k in normalised for k in pooler))
        if spec.causal:
            config.is_decoder = True
        table = self.key_table(config.num_hidden_layers, head)
        mapped, unknown = map_tensors(normalised, table, self.dropped_keys(head))
        unknown = [checkpoint_names.get(key, key) for key in unknown]
        model = build_model(spec.model_class, config, mapped, unknown, source_namer(table, checkpoint_names))
        model.config.architectures = [spec.model_class.__name__]
        return model

    def verify(self, source_dir: Path, tensors: dict, model, head: str, model_type: str):
        """transformers' model (loaded from the source's `tensors`) and ours on a right-padded batch, every layer's
        hidden states and every head output by the parity rule (`compare`). Returns (ok, summary)."""
        reference_class = self.source_class(model_type, head)
        print(f"Verifying against transformers' {reference_class.__name__} (eager attention, padded batch):")
        # A causal head follows ours: BertLMHeadModel masks its self-attention to the past only when told to.
        overrides = {"is_decoder": True} if self.heads[head].causal else {}
        config = reference_class.config_class.from_pretrained(source_dir, **overrides)
        reference = reference_model(reference_class, tensors, source_dir, config=config)
        return compare(reference, model)

    def convert(self, source: str, output: str, head: str = "auto", dtype: str = "float32", force: bool = False,
                verify_parity: bool = True, command: str | None = None) -> Path:
        """Source checkpoint (Hub id or directory) -> vanilla checkpoint directory. Returns the output path."""
        from transformers import AutoConfig

        source_dir, raw_config = read_source(source, self.model_types, self.name)
        # Fields left at their defaults may be missing from config.json: read them from the source's config class.
        try:
            source_config = AutoConfig.for_model(**raw_config).to_dict()
        except Exception as error:
            raise ConversionError(f"{source_dir}/config.json is not a valid {self.title} config: {error}") from None
        tensors = load_tensors(source_dir)
        head = self.head_for(source_config, head, tensors)
        model_type = source_config["model_type"]
        return write_conversion(
            output, force, source, source_dir,
            build=lambda: self.to_vanilla(tensors, source_config, head),
            verify=(lambda model: self.verify(source_dir, tensors, model, head, model_type)) if verify_parity else None,
            save=lambda model, directory: save_checkpoint(model, directory, source_dir),
            title=f"{Path(source).name} as a vanilla encoder",
            command=command or f"hf-vanilla {self.name} --source {source} --output {output}",
            notes=self.limitations,
            dtype=dtype,
        )

    # ---- vanilla -> source ----

    def to_source(self, source: str, output: str, force: bool = False, dtype: str | None = None,
                  model_type: str | None = None, verify_parity: bool = True) -> Path:
        """A vanilla encoder checkpoint -> a transformers checkpoint of this format (same head, config, tokenizer),
        the forward table inverted: the same tensors under their source names. `dtype=None` keeps the stored dtype,
        so the round trip is bit-exact. Unless `verify_parity` is False, the written folder is loaded with
        transformers alone, in the dtype it was saved in, and compared with the vanilla source (run in float32) by
        that dtype's rule (`compare`)."""
        import inspect

        from huggingface_hub.errors import StrictDataclassError

        source_dir, _ = read_source(source, ("vanilla_encoder",), f"to-{self.name}")
        try:
            config = VanillaEncoderConfig.from_pretrained(source_dir)
            config.check_architecture()
        except (ValueError, TypeError, StrictDataclassError) as error:
            raise ConversionError(f"{source_dir}/config.json is not a valid vanilla encoder config: {error}") from None
        architecture = (config.architectures or [VanillaEncoderModel.__name__])[0]
        head = next((h for h, spec in self.heads.items() if spec.model_class.__name__ == architecture), None)
        if head is None:
            raise ConversionError(
                f"{source_dir} is a {architecture!r}, which has no {self.title} counterpart; to-{self.name} converts "
                f"{sorted(spec.model_class.__name__ for spec in self.heads.values())}."
            )
        spec, model_type = self.heads[head], model_type or self.model_types[0]
        source_class = self.source_class(model_type, head)
        tied = spec.model_class._tied_weights_keys or {}
        needed = {
            "position_embedding_type": ("learned", f"{self.title} learns its position embeddings"),
            "pre_norm": (False, f"{self.title} normalises after each residual sum (post-LN)"),
            "scale_embeddings": (False, f"{self.title} does not scale its token embeddings"),
            "embedding_layer_norm": (True, f"{self.title} always LayerNorms the summed embeddings"),
        }
        if head != "base" and self.reads_pooler(head):
            needed["use_pooler"] = (True, f"{source_class.__name__} reads its pooler")
        if tied:
            needed["tie_word_embeddings"] = (True, f"{self.title}'s MLM decoder is the word embedding matrix")
        refusals = [f"{name}={getattr(config, name)!r} ({why}; needs {value!r})"
                    for name, (value, why) in (needed | self.fixed_values(config)).items()
                    if getattr(config, name) != value]
        # BERT, RoBERTa and ELECTRA always add a token type vector; DistilBERT (no such field) has none.
        if config.type_vocab_size == 0 and hasattr(source_class.config_class(), "type_vocab_size"):
            refusals.append(f"type_vocab_size=0 ({self.title} always adds a token type embedding; needs >= 1)")
        if refusals:  # every field at once, so that one fix is enough
            raise ConversionError(f"This model cannot be expressed as {self.title}:\n  " + "\n  ".join(refusals))
        target_config = self.source_config(config, head, model_type)
        target_config.architectures = [source_class.__name__]
        tensors = load_tensors(source_dir)
        ours = dict(tensors)  # `tensors` stays whole for the verification's reference
        untie(ours, tied, self.title, "Save the model again (save_pretrained re-ties it) or fix the checkpoint.")
        inverse = {o: s for s, o in self.key_table(config.num_hidden_layers, head,
                                                   "" if head == "base" else self.prefix).items()}
        # Checkpoints converted before heads stopped building an unread pooler have one.
        dropped = {} if self.reads_pooler(head) else {"model.pooler.": f"{source_class.__name__} has no pooler"}
        mapped, unknown = map_tensors(ours, inverse, dropped)
        model_class = source_class
        if "add_pooling_layer" in inspect.signature(source_class.__init__).parameters:
            model_class = partial(source_class, add_pooling_layer=config.use_pooler)
        model = build_model(model_class, target_config, mapped, unknown, source_namer(inverse))
        if dtype is not None:
            cast_for_saving(model, dtype)

        def verify(staging):  # what a user will do: load the written folder with transformers alone, as saved
            print(f"Verifying the written {source_class.__name__} against the vanilla source (padded batch, "
                  f"{PRECISION_NAMES[model.dtype]}):")
            reference = reference_model(spec.model_class, tensors, source_dir)
            written = source_class.from_pretrained(staging, attn_implementation="eager", dtype=model.dtype)
            return compare(reference, written.eval())

        return write_source_format(output, force, source_dir, model, verify if verify_parity else None)


def require_gelu_lm_head(hidden_act: str, head: str, lm_head_name: str,
                         way_out: str = "convert with --head base") -> None:
    """RoBERTa's and ELECTRA's MLM heads apply GELU whatever `hidden_act` says; ours applies `hidden_act`. Checked
    both ways: `way_out` says what converts instead."""
    if head == "masked-lm" and hidden_act != "gelu":
        raise ConversionError(
            f"{lm_head_name} applies GELU whatever hidden_act says, and the vanilla head applies hidden_act "
            f"({hidden_act!r}): {way_out}."
        )
