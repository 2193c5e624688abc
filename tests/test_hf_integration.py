"""Hugging Face citizenship: remote-code loading without hf_vanilla installed, save/load round trips (safetensors,
shards, half precision) and resizing the vocabulary.

The remote-code test runs in a fresh interpreter (`python -I`) that cannot import hf_vanilla: what it loads is only
what `save_pretrained` wrote next to the weights (config.json's `auto_map`, configuration_vanilla.py,
modeling_encoder.py and their relative imports), exactly as a user who downloaded the checkpoint would get it.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hf_references import converted, single_thread  # noqa: F401  (fixture)
from numerics import assert_close
from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer

import hf_vanilla  # noqa: F401  (registers the Auto classes)
from hf_vanilla import VanillaEncoderForMaskedLM, VanillaEncoderModel
from hf_vanilla.conversion.parity import TOLERANCE

pytestmark = pytest.mark.usefixtures("single_thread")
HEAD_KINDS = ("masked-lm", "sentiment", "ner", "qa")

# Runs in the isolated interpreter. argv[1]: JSON list of {"kind", "vanilla", "reference"}. Prints one JSON line.
REMOTE_SCRIPT = textwrap.dedent(
    r'''
    import importlib.abc, json, sys

    class BlockRepo(importlib.abc.MetaPathFinder):
        """`python -I` already drops the working directory; this also hides the editable install of the repo."""
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ("hf_vanilla", "conversion"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, BlockRepo())
    results = {"hf_vanilla_importable": True, "checks": []}
    try:
        import hf_vanilla  # noqa: F401
    except ImportError:
        results["hf_vanilla_importable"] = False

    import torch
    import transformers
    from transformers import AutoConfig, AutoTokenizer, BertModel

    REFERENCE_CLASS = {  # our class -> transformers' BERT class with the same head, and the output compared
        "VanillaEncoderModel": ("BertModel", "last_hidden_state"),
        "VanillaEncoderForMaskedLM": ("BertForMaskedLM", "logits"),
        "VanillaEncoderForSequenceClassification": ("BertForSequenceClassification", "logits"),
        "VanillaEncoderForTokenClassification": ("BertForTokenClassification", "logits"),
        "VanillaEncoderForQuestionAnswering": ("BertForQuestionAnswering", "start_logits"),
    }
    texts = ["The capital of France is [MASK].", "A second, longer sentence that pads the first one out a little."]

    def scaled_diff(ours, theirs, mask=None):
        """max |ours - theirs| / max(1, max |theirs|), which tests/numerics.py bounds by TOLERANCE[float32]; over
        real tokens only when `mask` is given: padding positions carry no meaning."""
        ours, theirs = (ours.float(), theirs.float()) if mask is None else (ours[mask].float(), theirs[mask].float())
        return ((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1)).item()

    for item in json.loads(sys.argv[1]):
        config = AutoConfig.from_pretrained(item["vanilla"], trust_remote_code=True)
        tokenizer = AutoTokenizer.from_pretrained(item["vanilla"], trust_remote_code=True)
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        mask = batch["attention_mask"].bool()
        architecture = config.architectures[0]
        for auto_name, target in sorted(config.auto_map.items()):
            if auto_name == "AutoConfig":
                continue
            check = {"kind": item["kind"], "auto_class": auto_name}
            try:
                # Another task's head is initialised afresh; where its tensor names collide with this head's
                # (a `classifier` of another width), the checkpoint's tensor is skipped, as for any BERT.
                own_head = target.rpartition(".")[2] == architecture
                causal = auto_name == "AutoModelForCausalLM"  # BERT's causal LM: the encoder masked to the past
                model = getattr(transformers, auto_name).from_pretrained(
                    item["vanilla"], trust_remote_code=True, ignore_mismatched_sizes=not own_head,
                    **({"is_decoder": True} if causal else {})).eval()
                check["class"] = type(model).__name__
                check["module"] = type(model).__module__
                check["config_module"] = type(model.config).__module__
                choices = auto_name == "AutoModelForMultipleChoice"  # (1, C, T): the rows are one question's choices
                with torch.no_grad():
                    ours = model(**({k: v[None] for k, v in batch.items()} if choices else batch),
                                 output_hidden_states=True)
                    if own_head:  # the checkpoint's own head: compare its output
                        ref_name, field = REFERENCE_CLASS[architecture]
                        reference = getattr(transformers, ref_name).from_pretrained(item["reference"]).eval()
                        theirs = reference(**batch)
                        per_token = architecture != "VanillaEncoderForSequenceClassification"
                        token_mask = mask if per_token else None
                        check["scaled_diff"] = scaled_diff(getattr(ours, field), getattr(theirs, field), token_mask)
                        if field == "start_logits":
                            end = scaled_diff(ours.end_logits, theirs.end_logits, mask)
                            check["scaled_diff"] = max(check["scaled_diff"], end)
                        if field == "last_hidden_state" and ours.pooler_output is not None:
                            pooled = scaled_diff(ours.pooler_output, theirs.pooler_output)
                            check["scaled_diff"] = max(check["scaled_diff"], pooled)
                    else:  # another task's head, freshly initialised: the encoder it sits on must still match
                        theirs = BertModel.from_pretrained(item["reference"], is_decoder=causal).eval()(**batch)
                        check["scaled_diff"] = scaled_diff(ours.hidden_states[-1], theirs.last_hidden_state, mask)
            except Exception as error:
                check["error"] = f"{type(error).__name__}: {error}"
            results["checks"].append(check)

        if item["kind"] == "masked-lm":  # a pipeline on remote code, against the same pipeline on BERT
            from transformers import pipeline
            ours = pipeline("fill-mask", model=item["vanilla"], trust_remote_code=True)(texts[0], top_k=5)
            theirs = pipeline("fill-mask", model=item["reference"])(texts[0], top_k=5)
            results["fill_mask"] = {"ours": ours, "theirs": theirs}
        if item["kind"] == "minilm":
            try:  # the engines come with the hf_vanilla package, which is not here
                transformers.AutoModel.from_pretrained(item["vanilla"], trust_remote_code=True, runtime="onnxruntime")
            except Exception as error:
                results["runtime_error"] = f"{type(error).__name__}: {error}"
            # sentence-transformers reads the same folder through remote code
            from sentence_transformers import SentenceTransformer
            ours = SentenceTransformer(item["vanilla"], trust_remote_code=True, device="cpu").encode(texts)
            theirs = SentenceTransformer(item["reference"], device="cpu").encode(texts)
            results["sentence_transformers_scaled_diff"] = scaled_diff(torch.from_numpy(ours), torch.from_numpy(theirs))
    print("RESULTS " + json.dumps(results))
    '''
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, minilm_path):
    """kind -> (reference BERT directory, converted vanilla directory)."""
    return {kind: converted(tmp_path_factory, minilm_path, kind) for kind in ("minilm", *HEAD_KINDS)}


@pytest.fixture(scope="module")
def resaved(checkpoints, tmp_path_factory):
    """A converted checkpoint loaded and saved again in this process, as Trainer.save_model does: (reference BERT
    directory, re-saved directory)."""
    reference, vanilla = checkpoints["masked-lm"]
    directory = tmp_path_factory.mktemp("resaved")
    AutoModelForMaskedLM.from_pretrained(vanilla).save_pretrained(directory)
    AutoTokenizer.from_pretrained(vanilla).save_pretrained(directory)
    return reference, directory


@pytest.fixture(scope="module")
def remote_results(checkpoints, resaved, tmp_path_factory):
    items = [{"kind": kind, "vanilla": str(vanilla), "reference": str(reference)}
             for kind, (reference, vanilla) in {**checkpoints, "resaved": resaved}.items()]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1",
           "HF_MODULES_CACHE": str(tmp_path_factory.mktemp("hf_modules"))}  # remote code is copied here
    result = subprocess.run([sys.executable, "-I", "-c", REMOTE_SCRIPT, json.dumps(items)], env=env,
                            capture_output=True, text=True, timeout=300, cwd=tmp_path_factory.getbasetemp())
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULTS ")]
    assert result.returncode == 0 and lines, f"remote-code subprocess failed:\n{result.stdout}\n{result.stderr}"
    return json.loads(lines[-1].removeprefix("RESULTS "))


# ---- trust_remote_code, without hf_vanilla ---------------------------------------------------------------------


def test_subprocess_cannot_import_hf_vanilla(remote_results):
    assert remote_results["hf_vanilla_importable"] is False


def test_remote_code_without_hf_vanilla_names_what_the_runtime_needs(remote_results):
    """The checkpoint's own copy of runtime_registry.py knows the built-in engines, which hf_vanilla ships."""
    assert remote_results["runtime_error"] == ("ImportError: runtime='onnxruntime' comes with the hf_vanilla package, "
                                               'which is not installed here: pip install "hf_vanilla[onnx]".')


def test_every_auto_class_loads_through_remote_code_and_matches_bert(remote_results):
    checks = remote_results["checks"]
    errors = [c for c in checks if "error" in c]
    assert not errors, errors
    loaded = {(c["kind"], c["auto_class"]) for c in checks}
    for kind in ("minilm", *HEAD_KINDS, "resaved"):  # every model Auto class of the auto_map, on every checkpoint
        for auto_class in ("AutoModel", "AutoModelForMaskedLM", "AutoModelForSequenceClassification",
                           "AutoModelForTokenClassification", "AutoModelForQuestionAnswering"):
            assert (kind, auto_class) in loaded
    for check in checks:
        assert check["module"].startswith("transformers_modules."), check  # the saved file, not hf_vanilla
        assert check["config_module"].startswith("transformers_modules."), check
        assert check["scaled_diff"] <= TOLERANCE[torch.float32], check


def test_readme_lists_the_files_remote_code_carries():
    """One list of the files a checkpoint carries for trust_remote_code, README's, and it is transformers' own
    answer: the model modules (the base and each family's) and their relative imports (`get_relative_import_files`),
    no more, no fewer."""
    import re

    from transformers.dynamic_module_utils import get_relative_import_files

    package = Path(hf_vanilla.__file__).parent
    families = [package / f"modeling_{family}.py" for family in ("encoder", "seq2seq", "decoder")]
    carried = {Path(f).name for module in families for f in (module, *get_relative_import_files(module))}
    readme = (package.parent / "README.md").read_text()
    sentence = re.search(r"Files that travel with a checkpoint for `trust_remote_code`.*?imports\): (.*?)\.\s+They",
                         readme, flags=re.S).group(1)
    assert set(re.findall(r"`([a-z0-9_]+\.py)`", sentence)) == carried


def test_a_resaved_checkpoint_carries_its_code(resaved):
    """A folder saved by save_pretrained (not by the converter) keeps the full auto_map it was loaded with; the code
    files it names must be there, and each Auto class must still name its own class."""
    _, directory = resaved
    code_files = ("configuration_vanilla.py", "modeling_encoder.py", "modeling_vanilla.py", "transformer.py",
                  "compat.py", "kernels.py", "masks.py", "measure.py", "packing.py", "validation.py")
    assert all((directory / name).is_file() for name in code_files)  # the modeling file's relative imports travel
    auto_map = json.loads((directory / "config.json").read_text())["auto_map"]
    assert auto_map["AutoConfig"] == "configuration_vanilla.VanillaEncoderConfig"
    assert auto_map["AutoModel"] == "modeling_encoder.VanillaEncoderModel"
    assert auto_map["AutoModelForMaskedLM"] == "modeling_encoder.VanillaEncoderForMaskedLM"
    assert auto_map["AutoModelForSequenceClassification"] == "modeling_encoder.VanillaEncoderForSequenceClassification"


def test_remote_code_pipeline_matches_bert(remote_results):
    ours, theirs = remote_results["fill_mask"]["ours"], remote_results["fill_mask"]["theirs"]
    assert [a["token_str"] for a in ours] == [b["token_str"] for b in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert_close(a["score"], b["score"], dtype=torch.float32, msg=a["token_str"])


def test_sentence_transformers_loads_through_remote_code(remote_results):
    assert remote_results["sentence_transformers_scaled_diff"] <= TOLERANCE[torch.float32]


# ---- save / load ------------------------------------------------------------------------------------------------


def _outputs(model, tokenizer):
    batch = tokenizer(["Paris is the capital of [MASK].", "hello"], padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits


def test_save_pretrained_round_trip_is_exact(checkpoints, tmp_path):
    _, vanilla = checkpoints["masked-lm"]
    model = AutoModelForMaskedLM.from_pretrained(vanilla).eval()
    assert isinstance(model, VanillaEncoderForMaskedLM)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert not list(tmp_path.glob("*.bin")), "weights must be saved as safetensors"
    reloaded = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    ours, theirs = model.state_dict(), reloaded.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    assert reloaded.lm_head.decoder.weight is reloaded.model.get_input_embeddings().weight  # still tied
    tokenizer = AutoTokenizer.from_pretrained(vanilla)
    assert torch.equal(_outputs(model, tokenizer), _outputs(reloaded, tokenizer))


def test_sharded_save_loads_back_exactly(checkpoints, tmp_path):
    _, vanilla = checkpoints["masked-lm"]
    model = AutoModelForMaskedLM.from_pretrained(vanilla).eval()
    model.save_pretrained(tmp_path, max_shard_size="20KB")  # the embedding matrix alone, then ~8 KB layers
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    reloaded = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[key]), key
    tokenizer = AutoTokenizer.from_pretrained(vanilla)
    assert torch.equal(_outputs(model, tokenizer), _outputs(reloaded, tokenizer))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loads_in_half_precision(checkpoints, dtype):
    reference, vanilla = checkpoints["minilm"]
    tokenizer = AutoTokenizer.from_pretrained(vanilla)
    batch = tokenizer(["A sentence about cats.", "Another, longer sentence about dogs and their owners."],
                      padding=True, return_tensors="pt")
    full = AutoModel.from_pretrained(vanilla).eval()
    half = AutoModel.from_pretrained(vanilla, dtype=dtype).eval()
    assert isinstance(half, VanillaEncoderModel)
    assert {p.dtype for p in half.parameters()} == {dtype}
    assert half.config.dtype == dtype
    with torch.no_grad():
        want = full(**batch).last_hidden_state
        got = half(**batch).last_hidden_state
    assert got.dtype == dtype and torch.isfinite(got).all()
    mask = batch["attention_mask"].bool()
    assert_close(got.float()[mask], want[mask], dtype=dtype)  # the half-precision rule against the float32 run


def test_resize_token_embeddings_keeps_the_decoder_tied(checkpoints, tmp_path):
    _, vanilla = checkpoints["masked-lm"]
    model = AutoModelForMaskedLM.from_pretrained(vanilla).eval()
    old_vocab = model.config.vocab_size
    tokenizer = AutoTokenizer.from_pretrained(vanilla)
    tokenizer.add_tokens(["[NEW1]", "[NEW2]", "[NEW3]"])
    model.resize_token_embeddings(len(tokenizer))
    new_vocab = old_vocab + 3

    embeddings, decoder = model.get_input_embeddings(), model.get_output_embeddings()
    assert embeddings.weight.shape[0] == new_vocab == model.config.vocab_size
    assert decoder.weight.data_ptr() == embeddings.weight.data_ptr()  # same storage, not a copy
    assert decoder.bias.shape == (new_vocab,) and decoder.out_features == new_vocab

    batch = tokenizer(["a [NEW1] token and a [MASK]"], return_tensors="pt")
    assert batch["input_ids"].max() >= old_vocab  # the new token is read as input
    with torch.no_grad():
        logits = model(**batch).logits
        assert logits.shape[-1] == new_vocab
        # The new rows are scored: make [NEW3]'s embedding point along the masked position's output direction
        # and it wins there, which only happens if the decoder reads the (tied) resized matrix.
        mask_position = (batch["input_ids"][0] == tokenizer.mask_token_id).nonzero().item()
        transformed = model.lm_head.norm(model.lm_head.act(model.lm_head.dense(
            model.model(**batch).last_hidden_state[0, mask_position])))
        embeddings.weight[new_vocab - 1] = transformed / transformed.norm() * 50
        logits = model(**batch).logits
    assert logits[0, mask_position].argmax().item() == new_vocab - 1

    model.save_pretrained(tmp_path)
    reloaded = AutoModelForMaskedLM.from_pretrained(tmp_path)
    assert reloaded.config.vocab_size == new_vocab
    assert reloaded.get_output_embeddings().weight is reloaded.get_input_embeddings().weight
    assert torch.equal(reloaded.get_output_embeddings().bias, decoder.bias)
