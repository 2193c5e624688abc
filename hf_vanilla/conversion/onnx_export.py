"""`python -m conversion onnx --source VANILLA_DIR --output OUT_DIR [--task TASK]`: a vanilla checkpoint -> ONNX.

The command's front: which model and outputs a checkpoint exports as, the checks, the output folder. The graphs
themselves come from hf_vanilla/export.py (`torch.onnx.export(..., dynamo=True)`, dynamic batch and sequence axes,
the signatures of both graph kinds). The tokenizer is written next to the graphs, and the graphs are checked with
ONNX Runtime on a padded batch of another shape than the one traced: the max |difference| against the PyTorch model
is printed, and anything beyond the converters' parity rule (parity.py: 1e-5 x max(1, |output|) in float32) is an error
(exit status 2, nothing written).

Encoder tasks export one graph, `model.onnx`, with the task's outputs:
    feature-extraction     last_hidden_state (B, T, E)
    fill-mask              logits (B, T, V)
    text-classification    logits (B, num_labels)
    token-classification   logits (B, T, num_labels)
    question-answering     start_logits, end_logits (B, T)
`--task seq2seq` exports the encoder-decoder as two graphs: `encoder_model.onnx` (last_hidden_state (B, S, E)) and
`decoder_model.onnx` (one decoding step, the self-attention cache in and out).
"""

import importlib
from pathlib import Path

import torch

from ..auto_classes import MODEL_CLASSES
from ..export import EncoderGraph, export_decoder_step, export_encoder, past_names
from ..heads import export_tasks
from .errors import ConversionError
from .io.output import atomic_output
from .io.reading import load_tensors, read_config, read_generation_config, require_model_type, resolve_source
from .io.writing import TOKENIZER_FILES, copy_side_files
from .mapping import check_layer_counts, vanilla_layer_counts
from .parity import check, require_parity, rule, verification_batch, worse

# Which class exports as which task is declared once, in hf_vanilla/heads.py (`export_task`): class name -> task.
ARCHITECTURE_TASKS = export_tasks()
# task -> the graph's outputs. seq2seq exports two graphs, the encoder's states and one decoding step, whose outputs
# `export_decoder_step` fixes.
OUTPUTS = {
    "feature-extraction": ("last_hidden_state",),
    "fill-mask": ("logits",),
    "text-classification": ("logits",),
    "token-classification": ("logits",),
    "question-answering": ("start_logits", "end_logits"),
    "seq2seq": (),
}
SEQ2SEQ_STEPS = 4  # decoding steps checked against PyTorch


# ---- inputs -----------------------------------------------------------------------------------------------------


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


# ---- verification with ONNX Runtime -----------------------------------------------------------------------------


def _session(path: Path):
    import onnxruntime

    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _run(session, feeds: dict) -> list[torch.Tensor]:
    arrays = {name: value.numpy() for name, value in feeds.items()}
    return [torch.from_numpy(out) for out in session.run(None, arrays)]


def verify_encoder(model, path: Path, input_names: list[str], output_names: tuple[str, ...]) -> None:
    """ONNX Runtime vs PyTorch on a padded batch of another shape than the traced one, by the parity rule at real
    tokens (`parity.check`): ONNX Runtime's kernels fuse and reorder sums as another PyTorch kernel would."""
    batch = sample_inputs(model.config, input_names, batch_size=3, length=24, seed=0)
    with torch.no_grad():
        reference = EncoderGraph(model, output_names).eval()(**batch)
    outputs = _run(_session(path), batch)
    ok, worst = True, 0.0
    for name, ref, out in zip(output_names, reference, outputs, strict=True):
        if tuple(out.shape) != tuple(ref.shape):
            raise ConversionError(f"ONNX output {name} has shape {tuple(out.shape)}, PyTorch {tuple(ref.shape)}.")
        within, diff = check(f"{name} {tuple(out.shape)}", ref, out, mask=batch["attention_mask"], dtype=torch.float32)
        ok, worst = ok and within, worse(worst, diff)
    require_parity(ok, _summary(worst, "padded batch"))


def verify_seq2seq(model, encoder_path: Path, decoder_path: Path, input_names: list[str],
                   steps: int = SEQ2SEQ_STEPS) -> None:
    """Encoder output, then `steps` decoding steps fed back through the ONNX cache, against PyTorch's logits for
    the whole target at once (no cache), by the parity rule: this checks the cache handling too."""
    config = model.config
    batch = sample_inputs(config, input_names, batch_size=3, length=24, seed=0)
    generator = torch.Generator().manual_seed(0)
    targets = torch.randint(5, config.vocab_size, (3, steps), generator=generator)
    targets[:, 0] = config.decoder_start_token_id
    with torch.no_grad():
        reference_states = model.get_encoder()(**batch).last_hidden_state
        reference_logits = model(**batch, decoder_input_ids=targets, use_cache=False).logits  # (B, steps, V)
    (states,) = _run(_session(encoder_path), batch)
    encoder_ok, encoder_diff = check(f"encoder last_hidden_state {tuple(states.shape)}", reference_states, states,
                                     mask=batch["attention_mask"], dtype=torch.float32)

    decoder = _session(decoder_path)
    heads, width = config.decoder_attention_heads, config.hidden_size
    names = past_names(config.decoder_layers)
    past = {name: torch.zeros(3, heads, 0, width // heads) for name in names}
    step_logits = []
    for step in range(steps):
        logits, *present = _run(decoder, {"input_ids": targets[:, step:step + 1], "encoder_hidden_states": states,
                                          "encoder_attention_mask": batch["attention_mask"], **past})
        step_logits.append(logits)  # (B, 1, V)
        past = dict(zip(names, present))
    # Every target token is real: no mask.
    logits_ok, logits_diff = check(f"decoder logits over {steps} cached steps", reference_logits,
                                   torch.cat(step_logits, dim=1), mask=None, dtype=torch.float32)
    require_parity(encoder_ok and logits_ok, _summary(max(encoder_diff, logits_diff), "padded batch, cached steps"))


def _summary(worst: float, inputs: str) -> str:
    return f"ONNX Runtime against PyTorch: max |diff| {worst:.3e} (fp32, {inputs}; {rule(torch.float32)})"


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

    # The weights are read by the converters' loader (damaged files, NaN weights and unsafe pickles are clear errors
    # there), then placed by transformers' own loader, which takes them with the config instead of a path.
    config = transformers.AutoConfig.from_pretrained(source_dir)
    model_class = MODEL_CLASSES[next(name for name, t in ARCHITECTURE_TASKS.items() if t == task)]
    options = {}
    generation = read_generation_config(source_dir, config.vocab_size)
    if generation is not None:
        options["generation_config"] = generation
    tensors = load_tensors(source_dir)
    check_layer_counts((key.removeprefix("model.") for key in tensors), vanilla_layer_counts(config),
                       f"{source_dir}/config.json")
    model, info = model_class.from_pretrained(None, config=config, state_dict=tensors, dtype=torch.float32,
                                              output_loading_info=True, **options)
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


def convert(source: str, output: str, task: str = "auto", force: bool = False) -> Path:
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
            verify_seq2seq(model, staging / "encoder_model.onnx", staging / "decoder_model.onnx", input_names)
            model.generation_config.save_pretrained(staging)
        else:
            output_names = OUTPUTS[task]
            export_encoder(model, staging / "model.onnx", input_names, output_names)
            print("Verifying with ONNX Runtime against PyTorch (padded batch):")
            verify_encoder(model, staging / "model.onnx", input_names, output_names)
        model.config.save_pretrained(staging)
        copy_side_files(source_dir, staging, TOKENIZER_FILES, folders=())
    return Path(output)
