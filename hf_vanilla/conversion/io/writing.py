"""Writing a converted model, the last step of the flow (conversion/flow.py), inside `atomic_output` (output.py):
the model cast to the saved dtype (refused if a weight overflows it), saved with a full `auto_map` and our code
files, the source's tokenizer and side files copied next to it, and a model card that records the command and the
parity summary.
"""

import inspect
import json
import shutil
from pathlib import Path

import torch
from transformers.dynamic_module_utils import get_relative_import_files

from ...auto_classes import AUTO_CLASSES
from ..errors import ConversionError
from .reading import all_finite

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Files copied next to converted weights when the source has them: tokenizers of every family we read, and the
# sentence-transformers configuration (pooling, normalisation, max_seq_length), which would otherwise silently change.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.txt",
    "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model", "source.spm", "target.spm",
    "target_vocab.json",  # Marian models with separate source and target vocabularies
)
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
SENTENCE_TRANSFORMERS_DIRS = ("1_Pooling", "2_Normalize", "2_Dense", "3_Normalize")


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


def save_checkpoint(model, directory: Path) -> None:
    """Save weights (safetensors, in the model's dtype: `cast_for_saving`), config with a full `auto_map`, and our
    code files for `trust_remote_code`. The source's side files follow (`copy_side_files`)."""
    config_class = type(model.config)
    carried = carried_modules(type(model))
    auto_map = {"AutoConfig": f"configuration_vanilla.{config_class.__name__}"}
    for auto_class, model_class in AUTO_CLASSES[config_class].items():
        module = model_class.__module__.rpartition(".")[2]
        if module in carried:
            auto_map[auto_class.__name__] = f"{module}.{model_class.__name__}"
    # `import hf_vanilla` registered every class for its Auto class, so save_pretrained copies configuration_vanilla.py
    # and the model's module (with their relative imports) next to the weights; it records only the saved class, so
    # the full map (every task class whose module travels) is set afterwards.
    model.save_pretrained(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = auto_map
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def carried_modules(model_class: type) -> set[str]:
    """The names of the code files `save_pretrained` copies next to `model_class`'s weights: its module and the
    modules it imports relatively (transformers' `custom_object_save`). `auto_map` names only classes defined in
    them: a checkpoint re-saved by `save_pretrained` keeps the map it was loaded with and copies these files alone,
    so a class of another family's module (the decoder alone, beside the encoder-decoder) would name a file the
    folder lacks."""
    module_file = inspect.getfile(model_class)
    return {Path(name).stem for name in (module_file, *get_relative_import_files(module_file))}


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
