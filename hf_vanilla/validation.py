"""Input checks, and their messages.

A bad id reaches an index kernel as an opaque error (on a GPU, a device-side assert that poisons the process), a
mask of the wrong shape broadcasts silently, and a label outside the classes indexes past the logits. So every
public forward refuses such input *before any kernel runs*, with a `ValueError` that names the argument, the
offending value or shape, the limit, and the fix.

What is checked: which of ids/embeddings is given; integer dtypes (int64 or int32, what `nn.Embedding` takes);
shapes of every id tensor and mask (2-D padding masks of 1/0, or 4-D masks as transformers builds them); the range
of token, segment and position ids; sequence length against the position table; mask values; labels against the
number of classes; what a head needs of its input (multiple choice's (batch, choices, length) ids, the
end-of-sequence tokens the encoder-decoder's classifier reads) and the encoder-decoder's target, before its encoder
runs. Shapes and dtypes are always checked; values cost one min/max reduction per tensor and are skipped while
tracing, where a graph must not depend on them.

Inputs that are not tensors (a numpy array, a Python list) are refused by name at the model's door
(`refuse_non_tensors`, called by every vanilla model's `__call__`), before a head or an engine touches them: so the
plain model, torch.compile and every engine (hf_vanilla/runtimes/) give one answer, where each used to fail on its
own first attribute (`is_meta`, `dim`, `dtype`). They are refused, not converted, as transformers' own models take
tensors only (BertModel fails on `.size()` of a numpy array).
"""

import inspect

import torch

from .kernels import is_tracing
from .masks import check_mask_shape, check_mask_values
from .packing import FORMAT_KEYWORDS, positions_within, sequence_ids

IGNORE_INDEX = -100  # label value the losses skip (CrossEntropyLoss's default ignore_index)
ID_DTYPES = (torch.int64, torch.int32)
# A forward's arguments that must be tensors when given (encoder_outputs and caches may be tuples).
TENSOR_INPUTS = frozenset({
    "input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds", "decoder_input_ids",
    "decoder_attention_mask", "decoder_inputs_embeds", "labels", "next_sentence_label", "start_positions",
    "end_positions",
})


def refuse_non_tensors(forward, args: tuple, kwargs: dict) -> None:
    """Refuse a TENSOR_INPUTS argument of a call to `forward` (the model class's, whose first parameter is `self`)
    that is given but is not a torch tensor, naming it and the fix. `args` are matched to its parameters by place."""
    given = kwargs.items() if not args else [*zip(inspect.unwrap(forward).__code__.co_varnames[1:], args),
                                             *kwargs.items()]
    for name, value in given:
        if value is not None and not isinstance(value, torch.Tensor) and name in TENSOR_INPUTS:
            kind = type(value).__qualname__ if type(value).__module__ == "builtins" else \
                f"{type(value).__module__}.{type(value).__qualname__}"
            raise ValueError(f"{name} is a {kind}, and the model takes torch tensors: pass torch.as_tensor({name}), "
                             f"or tokenize with return_tensors=\"pt\".")


def check_inputs(config, *, is_decoder, input_ids, inputs_embeds, token_type_ids, position_ids, attention_mask,
                 past_length=0, cache=None, encoder_hidden_states=None, encoder_attention_mask=None, dtype=None,
                 packed_format=None):
    """Refuse bad input to a stack with a message naming the problem and the fix, before anything runs: which
    input is given, the shapes, then (outside tracing, where values cannot be read) the values.

    `past_length` counts the tokens already in the key/value `cache`, whose size also sets how many keys a 4-D
    mask must cover (past + new tokens, or a static cache's full length). `dtype`: the stack's weights', which
    `inputs_embeds` must match (a float64 embedding would meet float32 weights in the first LayerNorm).
    `packed_format`: transformers' packed-format keywords (packing.FORMAT_KEYWORDS); sequences packed in a row by
    them each count their positions from their own start, so the position table must cover the longest of them."""
    prefix = "decoder_" if is_decoder and getattr(config, "is_encoder_decoder", False) else ""  # names the caller used
    ids_name, embeds_name, mask_name = f"{prefix}input_ids", f"{prefix}inputs_embeds", f"{prefix}attention_mask"
    if (input_ids is None) == (inputs_embeds is None):
        hint = " (or labels, which are shifted right into decoder_input_ids)" if prefix else ""
        raise ValueError(f"Pass exactly one of {ids_name} or {embeds_name}{hint}.")
    for name, tensor in ((ids_name, input_ids), (embeds_name, inputs_embeds), (mask_name, attention_mask),
                         ("token_type_ids", token_type_ids), ("position_ids", position_ids),
                         ("encoder_outputs", encoder_hidden_states), ("attention_mask", encoder_attention_mask)):
        if tensor is not None and tensor.is_meta:
            raise ValueError(f"{name} is on the meta device, which holds shapes but no values: pass a tensor "
                             f"with its values (e.g. on the model's device, {name}.to(model.device) from real data).")
    shape = _tokens_shape(config, ids_name, input_ids, embeds_name=embeds_name, inputs_embeds=inputs_embeds,
                          dtype=dtype)
    check_mask_shape(mask_name, attention_mask, shape, past_length=past_length, cache=cache, ids_name=ids_name)
    for name, ids in (("token_type_ids", token_type_ids), ("position_ids", position_ids)):
        _check_per_token_ids(name, ids, ids_name, shape)
    if encoder_hidden_states is not None:
        _check_encoder_output(config, encoder_hidden_states, encoder_attention_mask, ids_name=ids_name, shape=shape)
    if is_tracing():
        return
    check_mask_values(mask_name, attention_mask)
    check_mask_values("attention_mask", encoder_attention_mask)
    length = past_length + shape[1]
    if position_ids is None and packed_format:
        sequences = sequence_ids(shape, None, attention_mask, packed_format)  # None for an ordinary batch
        length = length if sequences is None else int(positions_within(sequences).max()) + 1  # the longest
    _check_id_values(config, is_decoder, ids_name, input_ids=input_ids, token_type_ids=token_type_ids,
                     position_ids=position_ids, total_length=length)


def positions_counted_from_zero(config, is_decoder) -> bool:
    """Whether a stack reads explicit `position_ids` counted from 0 and adds its table's `position_offset` itself:
    a causal stack (as `generate` derives them from a mask, GPT-2's convention) and both stacks of the
    encoder-decoder (BART's learned positions add their offset to every position); an encoder alone takes them as
    rows of its table, as BERT and RoBERTa do."""
    return is_decoder or getattr(config, "is_encoder_decoder", False)


def _tokens_shape(config, ids_name, input_ids, *, embeds_name, inputs_embeds, dtype) -> tuple[int, int]:
    """(batch, length) of the ids or embeddings given, once they are (B, T) integers or (B, T, embedding_size)
    vectors of the weights' dtype, and not empty."""
    if input_ids is not None:
        _check_integer(ids_name, input_ids)
        if input_ids.dim() != 2:
            fix = f"add a batch dimension with {ids_name}[None]" if input_ids.dim() == 1 else "one row per sequence"
            raise ValueError(f"{ids_name} must be (batch, length), got shape {tuple(input_ids.shape)}: {fix}.")
        shape = tuple(input_ids.shape)
    else:
        width = config.embedding_size
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != width:
            raise ValueError(
                f"{embeds_name} must be (batch, length, embedding_size={width}), got shape "
                f"{tuple(inputs_embeds.shape)}."
            )
        if dtype is not None and inputs_embeds.dtype != dtype:
            raise ValueError(f"{embeds_name} has dtype {inputs_embeds.dtype} but the model's weights are {dtype}: "
                             f"pass {embeds_name}.to({dtype}).")
        shape = tuple(inputs_embeds.shape[:2])
    if shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"Got an empty batch of shape {shape}: pass at least one sequence of one token.")
    return shape


def _check_per_token_ids(name, ids, ids_name, shape) -> None:
    """Segment or position ids: integers, one per token, (B, T) or (T,) / (1, T) shared by every row."""
    if ids is None:
        return
    _check_integer(name, ids)
    rows = 1 if ids.dim() == 1 else ids.shape[0]
    if ids.dim() not in (1, 2) or ids.shape[-1] != shape[1] or rows not in (shape[0], 1):
        raise ValueError(
            f"{name} has shape {tuple(ids.shape)} but {ids_name} has shape {shape}: pass one id per token, "
            f"as {shape} (or (1, {shape[1]}) shared by every row)."
        )


def _check_encoder_output(config, encoder_hidden_states, encoder_attention_mask, *, ids_name, shape) -> None:
    """What cross-attention reads: (B, S, hidden_size) from this model's encoder, one row per target row, and the
    source mask that came with it."""
    source_shape = tuple(encoder_hidden_states.shape[:2])
    if encoder_hidden_states.dim() != 3 or encoder_hidden_states.shape[-1] != config.hidden_size:
        raise ValueError(
            f"The encoder output has shape {tuple(encoder_hidden_states.shape)} but the decoder reads (batch, "
            f"source length, hidden_size={config.hidden_size}): pass encoder_outputs from this model's own "
            f"encoder (model.get_encoder()(input_ids, attention_mask))."
        )
    if source_shape[0] != shape[0]:
        raise ValueError(
            f"{ids_name} has {shape[0]} rows but the encoder output has {source_shape[0]}: pass one target "
            f"row per source row."
        )
    if encoder_attention_mask is None:
        return
    mask_shape = tuple(encoder_attention_mask.shape)
    if encoder_attention_mask.dim() == 4:
        # A custom 4-D mask (packed sequences with their own block-diagonal mask, as transformers' models take):
        # cross-attention reads it as given, target position t its row t (masks.cross_attention_mask).
        batch, heads, queries, keys = mask_shape
        if batch not in (1, shape[0]) or heads != 1 or queries not in (1, shape[1]) or keys != source_shape[1]:
            raise ValueError(
                f"A 4-D attention_mask of shape {mask_shape} reaches cross-attention, which reads it as (batch, 1, "
                f"target length, source length) = ({shape[0]}, 1, {shape[1]}, {source_shape[1]}) (batch and target "
                f"length may be 1, to broadcast): pass a target of the source's length, a 4-D mask of that shape, or "
                f"the source's 2-D padding mask."
            )
    elif mask_shape != source_shape:
        raise ValueError(
            f"attention_mask has shape {mask_shape} but the encoder output covers {source_shape} source tokens: "
            f"pass the attention_mask that came with the source input_ids."
        )


def _check_id_values(config, is_decoder, ids_name, *, input_ids, token_type_ids, position_ids, total_length) -> None:
    """Token, segment and position ids inside their tables, and a sequence (`total_length`: cache included) the
    position table covers."""
    _check_range(ids_name, input_ids, config.vocab_size, limit_name="vocab_size",
                 fix="use the tokenizer saved with this checkpoint (after adding tokens, call resize_token_embeddings)")
    if config.type_vocab_size > 0:
        _check_range("token_type_ids", token_type_ids, config.type_vocab_size, limit_name="type_vocab_size",
                     fix="segment ids count sentences (BERT: 0 for the first, 1 for the second)")
    elif token_type_ids is not None and not is_decoder and token_type_ids.any():
        raise ValueError("This model has no token types (type_vocab_size=0); drop token_type_ids.")
    max_length = config.max_position_embeddings - config.position_offset
    if position_ids is None and total_length > max_length:
        what = "decoder sequence (cache included)" if is_decoder else "sequence"
        fix = "; when generating, lower max_new_tokens" if is_decoder else ""
        raise ValueError(
            f"The {what} has {total_length} tokens but the position table allows at most {max_length} "
            f"(max_position_embeddings={config.max_position_embeddings}, position_offset="
            f"{config.position_offset}): truncate the input, e.g. tokenizer(..., truncation=True, "
            f"max_length={max_length}){fix}."
        )
    if positions_counted_from_zero(config, is_decoder) and config.position_offset:  # the offset is added inside
        _check_range("position_ids", position_ids, max_length, limit_name="max_position_embeddings - position_offset",
                     fix="pass positions counted from 0 below that, or truncate the input")
    else:
        _check_range("position_ids", position_ids, config.max_position_embeddings, limit_name="max_position_embeddings",
                     fix="pass positions below the table's length, or truncate the input")


def self_attention_cache(past_key_values):
    """(cache, past length): the key/value cache a stack's self-attention extends (an encoder-decoder cache holds it
    beside the cross-attention one) and how many tokens it holds already, an int (a tensor only for a static cache
    while tracing, where a graph must not read values)."""
    cache = getattr(past_key_values, "self_attention_cache", past_key_values)
    past_length = cache.get_seq_length() if cache is not None else 0
    if torch.is_tensor(past_length) and not is_tracing():  # a static cache counts in a tensor
        past_length = int(past_length)
    return cache, past_length


def check_target(config, decoder_input_ids, decoder_inputs_embeds, decoder_attention_mask, past_key_values):
    """The encoder-decoder's target, checked as its decoder will check it but before the encoder runs: a bad target
    then stops the call before the encoder's kernels have run for nothing."""
    cache, past_length = self_attention_cache(past_key_values)
    check_inputs(config, is_decoder=True, input_ids=decoder_input_ids, inputs_embeds=decoder_inputs_embeds,
                 token_type_ids=None, position_ids=None, attention_mask=decoder_attention_mask, cache=cache,
                 past_length=past_length)


def check_choices(input_ids, inputs_embeds, **per_choice):
    """Multiple choice encodes each (context, choice) pair as its own row: (B, C, T) ids, and every other per-token
    input (`per_choice`: the mask, token types, positions) of that very shape. A (B * C, T) or (C, B, T) mask would
    otherwise be reshaped without complaint onto the wrong rows. Returns (B, C)."""
    inputs = input_ids if input_ids is not None else inputs_embeds
    if inputs is None or inputs.dim() < 3:
        raise ValueError("Multiple choice takes input_ids of shape (batch, choices, length): one row per choice.")
    shape = tuple(inputs.shape[:3])
    for name, tensor in per_choice.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but the choices are {shape} (batch, choices, length): pass "
                f"one row per choice, shaped as input_ids (stack each example's choices along dimension 1)."
            )
    return shape[:2]


def check_span_positions(start_positions, end_positions, inputs):
    """Extractive QA's targets: one integer token index per sequence of `inputs` (the ids or embeddings), (B,)
    (transformers also takes (B, 1))."""
    for name, positions in (("start_positions", start_positions), ("end_positions", end_positions)):
        if positions is None or inputs is None:
            continue
        batch_size = inputs.shape[0]
        _check_integer(name, positions)
        if positions.squeeze(-1).shape != (batch_size,):
            raise ValueError(f"{name} has shape {tuple(positions.shape)}: pass one token index per sequence, "
                             f"({batch_size},).")


def check_token_labels(labels, shape, attention_mask, what):
    """Per-token binary labels (ELECTRA's replaced-token detection): shape (B, T), each 0 or 1 at the real tokens;
    at padding (`attention_mask` 0) anything, -100 as collators write it, since the loss reads real tokens only."""
    if labels is None:
        return
    if tuple(labels.shape) != tuple(shape):
        raise ValueError(f"labels has shape {tuple(labels.shape)} but should be {tuple(shape)}, one label per token: "
                         f"{what}.")
    wrong = (labels != 0) & (labels != 1)
    if attention_mask is not None and tuple(attention_mask.shape) == tuple(shape):
        wrong = wrong & (attention_mask == 1)
    if not is_tracing() and bool(wrong.any()):
        raise ValueError(f"labels must hold 0 or 1 at every real token, got {labels[wrong][0].item()}: {what}.")


def check_eos_tokens(input_ids, eos_token_id, decoder_inputs=None):
    """The encoder-decoder's sequence classifier reads the decoder state at each row's last end-of-sequence token,
    gathered as one (B, count) block: every row needs one, and the same number of them; and the decoder must read
    as many positions as the source has (`decoder_inputs`: the ids or embeddings the caller gave the decoder)."""
    if input_ids is None:
        raise ValueError("Sequence classification reads the decoder state at the last eos token: pass input_ids.")
    if decoder_inputs is not None and tuple(decoder_inputs.shape[:2]) != tuple(input_ids.shape):
        raise ValueError(
            f"The decoder input has shape {tuple(decoder_inputs.shape[:2])} but input_ids {tuple(input_ids.shape)}: "
            f"the classifier reads the decoder state where input_ids holds its eos, so leave decoder_input_ids out "
            f"(the source shifted right is used) or pass one of the source's shape."
        )
    counts = (input_ids == eos_token_id).sum(1)
    if not (counts > 0).all() or (counts != counts[0]).any():
        raise ValueError(
            f"Every row must hold the same, non-zero number of eos tokens (id {eos_token_id}), got "
            f"{counts.tolist()}: let the tokenizer add them (add_special_tokens=True)."
        )


def check_labels(labels, num_classes, limit_name):
    """Class labels in [0, num_classes), or -100 where no label applies. Checked before the model runs: the loss
    would index its logits with them, an opaque device-side assert on GPU."""
    if labels is None or is_tracing():
        return
    _check_integer("labels", labels)
    _check_range("labels", labels.masked_fill(labels == IGNORE_INDEX, 0), num_classes, limit_name=limit_name,
                 fix=f"labels are class ids, with {IGNORE_INDEX} where no label applies")


def check_sequence_labels(config, labels):
    """Sequence classification's labels are class ids where its loss will be single-label cross-entropy, which
    transformers decides from `config.problem_type` or, unset, from num_labels and the labels' dtype (as BERT
    does); regression and multi-label targets are not class ids."""
    if labels is None:
        return
    problem = config.problem_type
    if problem == "single_label_classification" or (
        problem is None and config.num_labels > 1 and labels.dtype in ID_DTYPES
    ):
        check_labels(labels, config.num_labels, "num_labels")


def _check_integer(name, ids):
    if ids.dtype not in ID_DTYPES:
        raise ValueError(
            f"{name} must hold integer ids, got dtype {ids.dtype}: convert with {name}.long() (int64 or int32 is "
            f"what an embedding or a loss indexes with)."
        )


def _check_range(name, ids, limit, *, limit_name, fix):
    """Every id in [0, limit), else a ValueError naming the offending value, the limit and `fix`."""
    if ids is None:
        return
    low, high = (int(x) for x in torch.aminmax(ids))
    if low < 0 or high >= limit:
        bad = high if high >= limit else low
        raise ValueError(f"{name} contains {bad}, outside [0, {limit}) set by {limit_name}={limit}: {fix}.")


def refuse_packed_pairs(kwargs: dict, reader: str) -> None:
    """Refuse transformers' packed format (`position_ids` restarting, `cu_seq_lens_*`, `seq_idx`) for `reader`, an
    encoder-decoder head that reads each row as one sequence: a packed row would be classified, or searched for a
    span, as one sequence whose parts attend to each other."""
    given = [name for name in ("position_ids", *FORMAT_KEYWORDS) if kwargs.get(name) is not None]
    if given:
        raise ValueError(
            f"{reader} reads each row as one sequence and takes no {', '.join(given)} (transformers' "
            "DataCollatorWithFlattening packs several sequences in a row). Pass a padded batch "
            "(DataCollatorWithPadding): it runs padding-free here already."
        )


def refuse_unpaired_boundaries(kwargs: dict) -> None:
    """Refuse `cu_seq_lens_*` and `seq_idx` for the encoder-decoder: they cannot say which boundaries are the
    sources' and which the targets'. Packed pairs come as `position_ids` and `decoder_position_ids`."""
    given = [name for name in FORMAT_KEYWORDS if kwargs.get(name) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} cannot tell source boundaries from target ones: pass packed pairs as "
                         "position_ids (sources) and decoder_position_ids (targets), each restarting at 0.")


__all__ = [
    "IGNORE_INDEX", "check_choices", "check_eos_tokens", "check_inputs", "check_labels", "check_sequence_labels",
    "check_span_positions", "check_target", "check_token_labels", "positions_counted_from_zero", "refuse_packed_pairs",
    "refuse_unpaired_boundaries", "self_attention_cache",
]
