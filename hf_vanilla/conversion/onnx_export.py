"""`python -m conversion onnx --source VANILLA_DIR --output OUT_DIR [--task TASK]`: a vanilla checkpoint -> ONNX.

Exported with `torch.onnx.export(..., dynamo=True)` (torch.export in non-strict mode, then translated to ONNX), with
dynamic batch and sequence axes (`torch.export.Dim`). The tokenizer is written next to the graphs, and the graphs are
checked with ONNX Runtime on a padded batch of another shape than the one traced: the max |difference| against the
PyTorch model is printed, and anything over the tolerance (1e-4) is an error (exit status 2, nothing written).

Under export the model takes its padded path with a static additive mask (see `_is_tracing()` in
modeling_vanilla.py): the packed fast path and the input value checks branch on data, which a graph cannot.

Encoder tasks export one graph, `model.onnx`:
    inputs   input_ids, attention_mask (B, T) [, token_type_ids (B, T)], named as the tokenizer names them
    outputs  feature-extraction     last_hidden_state (B, T, E)
             fill-mask              logits (B, T, V)
             text-classification    logits (B, num_labels)
             token-classification   logits (B, T, num_labels)
             question-answering     start_logits, end_logits (B, T)
Positions that are padding hold values without meaning (PyTorch's packed path writes zeros there).

`--task seq2seq` exports the encoder-decoder as two graphs:
    encoder_model.onnx   input_ids, attention_mask (B, S) [, token_type_ids] -> last_hidden_state (B, S, E)
    decoder_model.onnx   one decoding step:
        inputs   input_ids (B, 1)                          the newest target token
                 encoder_hidden_states (B, S, E), encoder_attention_mask (B, S)
                 past_key_values.{i}.key, .value (B, H, P, D)   layer i's self-attention cache; P = 0 at the start
        outputs  logits (B, 1, V)
                 present.{i}.key, .value (B, H, P + 1, D)      the cache for the next step

Design of the decoder step: only the self-attention keys and values, which grow by one position per step, travel
in and out of the graph. Cross-attention keys and values are recomputed inside every step from
`encoder_hidden_states`. That costs 2 projections of the S source states per layer and step (small next to the
rest for short outputs), and buys one graph for every step, the first included (P = 0), with no separate
first-step graph and no control flow. `examples/onnx_greedy_decode.py` drives the pair.
"""

import importlib
import logging
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from .common import (
    TOKENIZER_FILES,
    ConversionError,
    atomic_output,
    copy_side_files,
    load_tensors,
    max_differences,
    read_config,
    require_model_type,
    resolve_source,
    verification_batch,
)

TOLERANCE = 1e-4  # fp32, ONNX Runtime's kernels against PyTorch's: fused and reordered sums round differently

# task -> (Auto class name, graph outputs)
TASKS = {
    "feature-extraction": ("AutoModel", ("last_hidden_state",)),
    "fill-mask": ("AutoModelForMaskedLM", ("logits",)),
    "text-classification": ("AutoModelForSequenceClassification", ("logits",)),
    "token-classification": ("AutoModelForTokenClassification", ("logits",)),
    "question-answering": ("AutoModelForQuestionAnswering", ("start_logits", "end_logits")),
    "seq2seq": ("AutoModelForSeq2SeqLM", ()),
}
ARCHITECTURE_TASKS = {
    "VanillaEncoderModel": "feature-extraction",
    "VanillaEncoderForMaskedLM": "fill-mask",
    "VanillaEncoderForSequenceClassification": "text-classification",
    "VanillaEncoderForTokenClassification": "token-classification",
    "VanillaEncoderForQuestionAnswering": "question-answering",
    "VanillaSeq2SeqForConditionalGeneration": "seq2seq",
}
SEQ2SEQ_STEPS = 4  # decoding steps checked against PyTorch


# ---- graph signatures -------------------------------------------------------------------------------------------


class EncoderGraph(nn.Module):
    """Tensors in, a tuple of named outputs out: the signature an ONNX graph has.

    `model` is a `VanillaEncoder*` model, or the encoder stack of an encoder-decoder (which returns
    `last_hidden_state`)."""

    def __init__(self, model, output_names: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.output_names = output_names

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return tuple(getattr(out, name) for name in self.output_names)


class DecoderStepGraph(nn.Module):
    """One decoding step of a `VanillaSeq2SeqForConditionalGeneration` with the cache as plain tensors.

    The model reads its cache from an `EncoderDecoderCache`; this builds one from the past tensors (self-attention)
    and an empty cross-attention cache, which the step fills from `encoder_hidden_states` and then drops.

    past_key_values: (key_0, value_0, key_1, value_1, ...), each (B, H, P, D).
    Returns: logits (B, 1, V) and the grown cache (key_0, value_0, ...), each (B, H, P + 1, D).
    """

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.num_layers = model.config.decoder_layers

    def forward(self, input_ids, encoder_hidden_states, encoder_attention_mask, past_key_values):
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache
        from transformers.modeling_outputs import BaseModelOutput

        pairs = [(past_key_values[2 * i], past_key_values[2 * i + 1]) for i in range(self.num_layers)]
        cache = EncoderDecoderCache(DynamicCache(ddp_cache_data=pairs), DynamicCache())
        out = self.model(
            decoder_input_ids=input_ids, attention_mask=encoder_attention_mask,
            encoder_outputs=BaseModelOutput(last_hidden_state=encoder_hidden_states),
            past_key_values=cache, use_cache=True, return_dict=True,
        )
        present = out.past_key_values.self_attention_cache.layers
        return (out.logits, *(t for layer in present for t in (layer.keys, layer.values)))


def past_names(num_layers: int, prefix: str = "past_key_values") -> list[str]:
    return [f"{prefix}.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]


# ---- export -----------------------------------------------------------------------------------------------------


def encoder_input_names(config, source_dir: Path | None = None) -> list[str]:
    """input_ids, attention_mask, and token_type_ids when the model has token types and the tokenizer emits them
    (a RoBERTa tokenizer does not, though its model has one token type). Without a tokenizer: when the model can
    tell two segments apart."""
    names = ["input_ids", "attention_mask"]
    if config.type_vocab_size == 0:
        return names
    emits = config.type_vocab_size > 1
    if source_dir is not None and (source_dir / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        emits = "token_type_ids" in AutoTokenizer.from_pretrained(source_dir).model_input_names
    return names + ["token_type_ids"] if emits else names


def sample_inputs(config, input_names: list[str], batch_size: int, length: int, seed: int) -> dict:
    """A right-padded batch of random ids (rows of different lengths) with exactly the graph's inputs."""
    batch = verification_batch(config, batch_size, length, seed)
    if "token_type_ids" in input_names and "token_type_ids" not in batch:
        batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    return {name: batch[name] for name in input_names}


@contextmanager
def _quiet_exporter():
    """Silence the exporter's notes that say nothing about this model: torchvision ops it skips, and one rename
    warning per input that shares a `Dim` with another (sharing is the point: every input has the same batch)."""
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"# The axis name: .* will not be used")
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
            yield
    finally:
        logger.setLevel(level)


def export_encoder(model, path: Path, input_names: list[str], output_names: tuple[str, ...]) -> None:
    """A `VanillaEncoder*` model (or an encoder stack) -> one ONNX graph, dynamic in batch and sequence."""
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    example = sample_inputs(model.config, input_names, batch_size=2, length=16, seed=1)
    with _quiet_exporter():
        program = torch.onnx.export(
            EncoderGraph(model, output_names).eval(), (), kwargs=example, dynamo=True,
            input_names=input_names, output_names=list(output_names),
            dynamic_shapes={name: {0: batch, 1: sequence} for name in input_names}, verbose=False,
        )
    program.save(str(path))


def export_decoder_step(model, path: Path) -> None:
    """The decoder of a `VanillaSeq2SeqForConditionalGeneration` -> one ONNX graph of one decoding step."""
    config = model.config
    heads, width = config.decoder_attention_heads, config.hidden_size
    layers = config.decoder_layers
    batch, source = torch.export.Dim("batch"), torch.export.Dim("encoder_sequence")
    past = torch.export.Dim("past_sequence", min=0)  # 0 on the first step
    B, S, P = 2, 7, 3  # example sizes: distinct, and above 1 so that none is specialised to a constant
    example = (
        torch.full((B, 1), config.decoder_start_token_id),
        torch.randn(B, S, width),
        torch.tensor([[1] * S, [1] * (S - 2) + [0] * 2]),
        tuple(torch.randn(B, heads, P, width // heads) for _ in range(2 * layers)),
    )
    dynamic_shapes = ({0: batch}, {0: batch, 1: source}, {0: batch, 1: source},
                      tuple({0: batch, 2: past} for _ in range(2 * layers)))
    with _quiet_exporter():
        program = torch.onnx.export(
            DecoderStepGraph(model).eval(), example, dynamo=True,
            input_names=["input_ids", "encoder_hidden_states", "encoder_attention_mask", *past_names(layers)],
            output_names=["logits", *past_names(layers, "present")],
            dynamic_shapes=dynamic_shapes, verbose=False,
        )
    program.save(str(path))


# ---- verification with ONNX Runtime -----------------------------------------------------------------------------


def _session(path: Path):
    import onnxruntime

    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _run(session, feeds: dict) -> list[torch.Tensor]:
    arrays = {name: value.numpy() for name, value in feeds.items()}
    return [torch.from_numpy(out) for out in session.run(None, arrays)]


def verify_encoder(model, path: Path, input_names: list[str], output_names: tuple[str, ...],
                   tolerance: float = TOLERANCE) -> float:
    """ONNX Runtime vs PyTorch on a padded batch of another shape than the traced one; real tokens only."""
    batch = sample_inputs(model.config, input_names, batch_size=3, length=24, seed=0)
    with torch.no_grad():
        reference = EncoderGraph(model, output_names).eval()(**batch)
    outputs = _run(_session(path), batch)
    worst = 0.0
    for name, ref, out in zip(output_names, reference, outputs, strict=True):
        if tuple(out.shape) != tuple(ref.shape):
            raise ConversionError(f"ONNX output {name} has shape {tuple(out.shape)}, PyTorch {tuple(ref.shape)}.")
        per_token = ref.dim() >= 2 and ref.shape[1] == batch["input_ids"].shape[1]
        diff = max_differences((ref,), (out,), batch["attention_mask"] if per_token else None)[0]
        print(f"  {name} {tuple(out.shape)}: max |diff| = {diff:.3e}")
        worst = max(worst, diff)
    _check(worst, tolerance)
    return worst


def verify_seq2seq(model, encoder_path: Path, decoder_path: Path, input_names: list[str],
                   tolerance: float = TOLERANCE, steps: int = SEQ2SEQ_STEPS) -> float:
    """Encoder output, then `steps` decoding steps fed back through the ONNX cache, against PyTorch's logits for
    the whole target at once (no cache): this checks the cache handling too."""
    config = model.config
    batch = sample_inputs(config, input_names, batch_size=3, length=24, seed=0)
    generator = torch.Generator().manual_seed(0)
    targets = torch.randint(5, config.vocab_size, (3, steps), generator=generator)
    targets[:, 0] = config.decoder_start_token_id
    with torch.no_grad():
        reference_states = model.get_encoder()(**batch).last_hidden_state
        reference_logits = model(**batch, decoder_input_ids=targets, use_cache=False).logits  # (B, steps, V)
    (states,) = _run(_session(encoder_path), batch)
    encoder_diff = max_differences((reference_states,), (states,), batch["attention_mask"])[0]
    print(f"  encoder last_hidden_state {tuple(states.shape)}: max |diff| = {encoder_diff:.3e}")

    decoder = _session(decoder_path)
    heads, width = config.decoder_attention_heads, config.hidden_size
    names = past_names(config.decoder_layers)
    past = {name: torch.zeros(3, heads, 0, width // heads) for name in names}
    logits_diff = 0.0
    for step in range(steps):
        logits, *present = _run(decoder, {"input_ids": targets[:, step:step + 1], "encoder_hidden_states": states,
                                          "encoder_attention_mask": batch["attention_mask"], **past})
        logits_diff = max(logits_diff, (logits[:, 0] - reference_logits[:, step]).abs().max().item())
        past = dict(zip(names, present))
    print(f"  decoder logits over {steps} cached steps: max |diff| = {logits_diff:.3e}")
    worst = max(encoder_diff, logits_diff)
    _check(worst, tolerance)
    return worst


def _check(worst: float, tolerance: float) -> None:
    if not worst <= tolerance:  # also catches NaN
        raise ConversionError(
            f"ONNX Runtime differs from PyTorch by {worst:.3e} > {tolerance:g}; nothing was written."
        )
    print(f"  OK: max |diff| {worst:.3e} <= {tolerance:g}")


# ---- the command ------------------------------------------------------------------------------------------------


def require_exporter() -> None:
    """The export needs onnx and onnxscript (torch.onnx's dynamo exporter) and onnxruntime (the check), which are
    the `onnx` extra, not dependencies of the package: say so before any work, not as a ModuleNotFoundError."""
    missing = []
    for name in ("onnx", "onnxscript", "onnxruntime"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ConversionError(f"The ONNX export needs {', '.join(missing)}, which is not installed: "
                              f"pip install \"hf_vanilla[onnx]\" (onnx, onnxscript and onnxruntime).")


def load_model(source_dir: Path, task: str):
    """The checkpoint as the task's model, in float32 and eval mode; a head the checkpoint lacks is an error
    (transformers would initialise it randomly and the export would be meaningless)."""
    import transformers

    from hf_vanilla import AUTO_CLASSES

    # The weights are read by the converters' loader (damaged files, NaN weights and unsafe pickles are clear errors
    # there), then placed by transformers' own loader, which takes them with the config instead of a path.
    config = transformers.AutoConfig.from_pretrained(source_dir)
    model_class = AUTO_CLASSES[type(config)][getattr(transformers, TASKS[task][0])]
    options = {}
    if (source_dir / "generation_config.json").is_file():
        options["generation_config"] = transformers.GenerationConfig.from_pretrained(source_dir)
    model, info = model_class.from_pretrained(None, config=config, state_dict=load_tensors(source_dir),
                                              dtype=torch.float32, output_loading_info=True, **options)
    if info["missing_keys"]:
        raise ConversionError(
            f"{source_dir} has no weights for the {task!r} head (missing {sorted(info['missing_keys'])[:5]}); pick "
            f"the task the checkpoint was trained for, or feature-extraction for the encoder alone."
        )
    return model.eval()


def task_for(config: dict, requested: str, source_dir: Path) -> str:
    """The checkpoint's own task (from `architectures`), or `requested`: that one, or feature-extraction (the
    encoder under any head). Another head would reuse the wrong weights (a sequence classifier's `classifier`
    loads into a token classifier without complaint) or random ones."""
    require_model_type(config, ("vanilla_encoder", "vanilla_seq2seq"), "onnx", source_dir)
    architecture = (config.get("architectures") or ["?"])[0]
    own = ARCHITECTURE_TASKS.get(architecture)
    if requested == "auto":
        if own is None:
            raise ConversionError(f"No ONNX task matches the architecture {architecture!r}; pass --task.")
        return own
    allowed = {own, "feature-extraction"} if config["model_type"] == "vanilla_encoder" else {"seq2seq"}
    if requested not in allowed:
        raise ConversionError(
            f"{source_dir} holds a {architecture}, which has no {requested!r} head; export it as "
            f"{' or '.join(sorted(t for t in allowed if t))}."
        )
    return requested


def convert(source: str, output: str, task: str = "auto", force: bool = False, tolerance: float = TOLERANCE) -> Path:
    """Vanilla checkpoint directory -> a directory of ONNX graph(s), config, tokenizer. Returns the output path."""
    require_exporter()
    source_dir = resolve_source(source)
    config = read_config(source_dir)
    task = task_for(config, task, source_dir)
    model = load_model(source_dir, task)
    input_names = encoder_input_names(model.config, source_dir)
    print(f"Exporting {type(model).__name__} ({task}) with inputs {input_names}")
    with atomic_output(output, force, sources=(source_dir,)) as staging:
        if task == "seq2seq":
            export_encoder(model.get_encoder(), staging / "encoder_model.onnx", input_names, ("last_hidden_state",))
            export_decoder_step(model, staging / "decoder_model.onnx")
            print("Verifying with ONNX Runtime against PyTorch (padded batch, cached decoding steps):")
            verify_seq2seq(model, staging / "encoder_model.onnx", staging / "decoder_model.onnx", input_names,
                           tolerance)
            model.generation_config.save_pretrained(staging)
        else:
            output_names = TASKS[task][1]
            export_encoder(model, staging / "model.onnx", input_names, output_names)
            print("Verifying with ONNX Runtime against PyTorch (padded batch):")
            verify_encoder(model, staging / "model.onnx", input_names, output_names, tolerance)
        model.config.save_pretrained(staging)
        copy_side_files(source_dir, staging, TOKENIZER_FILES, folders=())
    return Path(output)
