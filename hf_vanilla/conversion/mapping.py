"""Mapping keys: a source checkpoint's tensor names -> a target model's, through a key table (source module ->
target module, written once per layer with `{i}`). Strict by construction: `map_tensors` returns every key it could
not place, unless a `dropped` prefix says why it is left out; `build_model` (building.py) refuses those."""

import re

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


def layers_held(keys, template: str) -> int:
    """How many layers the tensor names `keys` hold under `template`, a module path with `{i}` for the layer as key
    tables write it ("encoder.layer.{i}.attention.self.query": the layers under "encoder.layer."): one more than the
    highest layer index found, 0 where there is none."""
    pattern = re.compile(re.escape(template.partition("{i}")[0]) + r"(\d+)\.")
    return max((int(found.group(1)) + 1 for key in keys if (found := pattern.match(key))), default=0)


def check_layer_counts(keys, counts, config_file) -> None:
    """Refuse a config whose layer count is not what its weights hold, before a key table or a model is built for
    it: both take time in proportion to the count (a 2-layer checkpoint whose config.json said 10**6 took minutes to
    be refused, in a message listing every missing tensor). `counts`: (template as in `layers_held`, the config's
    field, its value) for each stack. A layer missing below the highest is left to `build_model`, which names its
    tensors."""
    keys = list(keys)
    for template, field, declared in counts:
        held = layers_held(keys, template)
        if held == declared:
            continue
        under = template.partition("{i}")[0]
        if held == 0:
            raise ConversionError(f"{config_file} sets {field}={declared}, but the weights hold no layer (no tensor "
                                  f"under {under}N.): they were not saved with this config. Convert a config.json "
                                  f"together with the weights saved with it.")
        raise ConversionError(f"{config_file} sets {field}={declared}, but the weights hold {held} layer"
                              f"{'s' if held > 1 else ''} ({under}0 to {under}{held - 1}): set {field} to {held} "
                              f"there, or convert the config.json saved with these weights.")


def vanilla_layer_counts(config) -> list[tuple[str, str, int]]:
    """Our checkpoints' layer counts, as `check_layer_counts` reads them (keys without a head's `model.` prefix):
    the encoder's layers under `encoder.layers.{i}`, counted by `num_hidden_layers`; the decoder's (of an
    encoder-decoder, or alone) under `decoder.layers.{i}`, by `decoder_layers`."""
    if config.model_type == "vanilla_encoder":
        return [("encoder.layers.{i}.", "num_hidden_layers", config.num_hidden_layers)]
    decoder = [("decoder.layers.{i}.", "decoder_layers", config.decoder_layers)]
    if not config.is_encoder_decoder:  # the decoder alone
        return decoder
    return [("encoder.layers.{i}.", "num_hidden_layers", config.num_hidden_layers)] + decoder


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
