"""What every converter shares: find the source, read its tensors without running its code, map keys strictly,
build the target without a second copy of the weights, write the output atomically, and report parity."""

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Files copied next to converted weights when the source has them: tokenizers of every family we read, and the
# sentence-transformers configuration (pooling, normalisation, max_seq_length), which would otherwise silently change.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.txt",
    "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model", "source.spm", "target.spm",
)
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
SENTENCE_TRANSFORMERS_DIRS = ("1_Pooling", "2_Normalize", "2_Dense", "3_Normalize")


class ConversionError(Exception):
    """A problem with the source, the options or the output; the CLI prints it and exits with status 2."""


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
        return Path(snapshot_download(source, allow_patterns=patterns))
    except Exception as error:  # offline, unknown id, gated repo: all end the same way for the user
        raise ConversionError(
            f"--source {source!r} is not a local directory and could not be fetched from the Hugging Face Hub "
            f"({type(error).__name__}: {error}). Pass a local checkpoint directory, or check the id and network."
        ) from None


def read_config(source_dir: Path) -> dict:
    path = source_dir / "config.json"
    if not path.is_file():
        raise ConversionError(f"{source_dir} has no config.json: it is not a transformers checkpoint.")
    return json.loads(path.read_text())


def require_model_type(config: dict, expected: tuple[str, ...], converter: str, source_dir: Path) -> None:
    model_type = config.get("model_type")
    if model_type not in expected:
        raise ConversionError(
            f"{source_dir} holds a {model_type!r} model, but the {converter!r} converter reads "
            f"{' or '.join(repr(e) for e in expected)}. Pick the converter for {model_type!r} "
            f"(python -m conversion --help lists them)."
        )


def load_tensors(source_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, sharded or not. Safetensors first; a pickle (`.bin`) only through
    `torch.load(weights_only=True)`, which refuses anything but tensors: a checkpoint never runs code here."""
    index = source_dir / "model.safetensors.index.json"
    single = source_dir / "model.safetensors"
    if index.is_file() or single.is_file():
        from safetensors.torch import load_file

        files = _shards(index) if index.is_file() else [single.name]
        tensors = {}
        for name in files:
            tensors.update(load_file(source_dir / name))
        return tensors
    index = source_dir / "pytorch_model.bin.index.json"
    single = source_dir / "pytorch_model.bin"
    if index.is_file() or single.is_file():
        files = _shards(index) if index.is_file() else [single.name]
        tensors = {}
        for name in files:
            try:
                tensors.update(torch.load(source_dir / name, map_location="cpu", weights_only=True))
            except Exception as error:
                raise ConversionError(
                    f"Refused to load {source_dir / name}: it is a pickle holding more than tensors "
                    f"({type(error).__name__}), and unpickling it could run code. Convert it to safetensors with a "
                    f"tool you trust, or use a safetensors version of the checkpoint."
                ) from None
        return tensors
    found = sorted(p.name for p in source_dir.iterdir())
    raise ConversionError(
        f"{source_dir} has no weights (model.safetensors, its sharded index, or pytorch_model.bin); found {found}."
    )


def _shards(index: Path) -> list[str]:
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))


def check_finite(tensors: dict[str, torch.Tensor]) -> None:
    bad = [name for name, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise ConversionError(f"The source weights contain NaN or Inf in {len(bad)} tensors: {bad[:10]}.")


# ---- mapping keys -----------------------------------------------------------------------------------------------


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


def build_model(model_class, config, tensors: dict[str, torch.Tensor], unknown: list[str]):
    """Build `model_class(config)` on the meta device and give it `tensors` without copying them.

    Strict: unknown source keys, missing target tensors (other than tied ones) and shape mismatches are all
    errors listing the offending keys."""
    with torch.device("meta"):
        model = model_class(config)
    tied = set(model.get_expanded_tied_weights_keys(all_submodels=True))
    expected = {k: v.shape for k, v in model.state_dict().items()}
    missing = sorted(k for k in expected if k not in tensors and k not in tied)
    unexpected = sorted(k for k in tensors if k not in expected)
    wrong_shape = [
        f"{k}: source {tuple(t.shape)} vs target {tuple(expected[k])}"
        for k, t in tensors.items() if k in expected and t.shape != expected[k]
    ]
    problems = []
    if unknown:
        problems.append(f"source tensors with no mapping: {unknown}")
    if missing:
        problems.append(f"target tensors the source does not fill: {missing}")
    if unexpected:
        problems.append(f"mapped tensors the target does not have: {unexpected}")
    if wrong_shape:
        problems.append(f"shape mismatches: {wrong_shape}")
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


@contextmanager
def atomic_output(output: str | Path, force: bool):
    """Yield a fresh temporary directory beside `output`; move it into place only if the block succeeds.

    An existing `output` is refused without `force`, and with it is replaced only once the new one is complete.
    A failure or an interrupt (Ctrl-C) leaves no partial output behind."""
    output = Path(output).resolve()
    if output.exists() and not force:
        raise ConversionError(f"{output} already exists; pass --force to replace it, or choose another --output.")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if output.exists():
        retired = output.with_name(f".{output.name}.old-{os.getpid()}")
        output.rename(retired)
        staging.rename(output)
        shutil.rmtree(retired) if retired.is_dir() else retired.unlink()
    else:
        staging.rename(output)


def save_checkpoint(model, directory: Path, source_dir: Path | None, dtype: str = "float32") -> None:
    """Save weights (safetensors), config with a full `auto_map`, our code files for `trust_remote_code`, and
    the source's tokenizer and sentence-transformers files."""
    from hf_vanilla import AUTO_CLASSES

    config_class = type(model.config)
    auto_map = {"AutoConfig": f"configuration_vanilla.{config_class.__name__}"}
    for auto_class, model_class in AUTO_CLASSES[config_class].items():
        auto_map[auto_class.__name__] = f"modeling_vanilla.{model_class.__name__}"
    model.to(DTYPES[dtype])
    # register_for_auto_class makes save_pretrained copy configuration_vanilla.py and modeling_vanilla.py next to
    # the weights; it records only the saved class, so the full map (every task class) is set afterwards.
    model.config.register_for_auto_class()
    type(model).register_for_auto_class("AutoModel")
    model.save_pretrained(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = auto_map
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if source_dir is not None:
        copy_side_files(source_dir, directory)


def copy_side_files(source_dir: Path, directory: Path) -> None:
    for name in TOKENIZER_FILES + SENTENCE_TRANSFORMERS_FILES:
        if (source_dir / name).is_file():
            shutil.copy2(source_dir / name, directory / name)
    for name in SENTENCE_TRANSFORMERS_DIRS:
        if (source_dir / name).is_dir():
            shutil.copytree(source_dir / name, directory / name)


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


def max_differences(reference: tuple, ours: tuple, mask: torch.Tensor | None) -> list[float]:
    """Per-layer max |difference|, over real tokens only (padding positions carry no meaning)."""
    diffs = []
    for ref, out in zip(reference, ours, strict=True):
        delta = (ref.float() - out.float()).abs()
        diffs.append((delta[mask.bool()] if mask is not None else delta).max().item())
    return diffs


def report(name: str, diffs: list[float], tolerance: float) -> bool:
    """Print one line per layer; True when all are within `tolerance`."""
    for i, diff in enumerate(diffs):
        label = "embeddings" if i == 0 else f"layer {i}"
        print(f"  {name} {label:>10}: max |diff| = {diff:.3e}{'' if diff <= tolerance else '  > tolerance'}")
    return max(diffs) <= tolerance
