"""Building the target: a model class instantiated on the meta device and given the mapped tensors without a copy,
refused (every problem listed at once) unless every source tensor is mapped, every target tensor filled, and every
shape and dtype fits. `map_and_build` is the map -> build step every format runs, both ways."""

import torch

from .errors import ConversionError
from .mapping import map_tensors, source_namer


def map_and_build(model_class, config, tensors: dict, table: dict[str, str], dropped: dict[str, str] | None = None,
                  extra: dict | None = None, unprefix: str = "", checkpoint_names: dict[str, str] | None = None):
    """The map -> build step, written once: `tensors` renamed through `table` (source module -> target module; a key
    under a `dropped` prefix is left out for its reason, any other unmapped key refused), `extra` added (what a
    format computes outside its table: token embeddings, position tables), `unprefix` taken off every target key
    (a base model's keys have no `model.`), then `build_model`. `checkpoint_names` spells a source key as the user's
    checkpoint does, for messages."""
    mapped, unknown = map_tensors(tensors, table, dropped or {})
    mapped.update(extra or {})
    if unprefix:
        mapped = {key.removeprefix(unprefix): tensor for key, tensor in mapped.items()}
    names = checkpoint_names or {}
    return build_model(model_class, config, mapped, unknown=[names.get(key, key) for key in unknown],
                       source_name=source_namer(table, names))


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
    stacks = ("encoder.", "decoder.", "model.encoder.", "model.decoder.")
    head_only = missing and not any(key.startswith(stacks) for key in missing)  # the head's weights (its pooler too)
    problems = [problem for problem, found in (
        (f"source tensors with no mapping: {unknown}", unknown),
        (f"target tensors the source does not fill: {missing}", missing),
        (f"the source has no trained {type(model).__name__} head: convert the encoder alone (--head base) and "
         f"fine-tune it (examples/finetune_classification.py), or start from a checkpoint fine-tuned for this task",
         head_only),
        (f"mapped tensors the target does not have: {unexpected}", unexpected),
        (f"shape mismatches: {wrong_shape}", wrong_shape),
        (f"weights of an integer or bool dtype (a model's weights are floating point: float32, float16 or bfloat16; "
         f"the checkpoint is damaged or not a model's weights): {wrong_dtype}", wrong_dtype),
    ) if found]
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
