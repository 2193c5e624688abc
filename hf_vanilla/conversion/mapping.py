"""Mapping keys: a source checkpoint's tensor names -> a target model's, through a key table (source module ->
target module, written once per layer with `{i}`). Strict by construction: `map_tensors` returns every key it could
not place, unless a `dropped` prefix says why it is left out; `build_model` (building.py) refuses those."""

import torch

from .errors import ConversionError


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
