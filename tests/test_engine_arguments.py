"""What a user passes an engine, and a model on one, checked the same on every path.

- `runtime_options` (and the same arguments of `use_onnx_runtime` / `use_openvino`): a wrong value is refused with
  one line naming the option, the value and what is accepted, the same from the Python call and from
  `from_pretrained(runtime=..., runtime_options=...)`, before the model is touched; an option the runtime does not
  take is refused naming those it does.
- `input_ids`, `attention_mask`, `token_type_ids` that are not tensors (a numpy array, a list of lists, a list of
  ints) are refused naming `torch.as_tensor` on every path: the plain model, torch.compile, ONNX Runtime fed its
  weights, ONNX Runtime holding them, OpenVINO; a tensor of the same ids answers.
"""

import copy
import re

import numpy as np
import pytest
import torch
from numerics import assert_close

from hf_vanilla import VanillaEncoderConfig, VanillaEncoderForSequenceClassification
from hf_vanilla.runtime_registry import apply_runtime

pytest.importorskip("onnxruntime")

CONFIG = dict(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=64, num_labels=3)


def classifier():
    torch.manual_seed(0)
    return VanillaEncoderForSequenceClassification(VanillaEncoderConfig(**CONFIG)).eval()


def engine_call(runtime: str, owned: bool):
    """The engine's Python call and its runtime_options apart from the one under test."""
    if runtime == "openvino":
        pytest.importorskip("openvino")
        from hf_vanilla.runtimes.openvino import use_openvino
        return use_openvino, {}
    from hf_vanilla.runtimes.onnxruntime import use_onnx_runtime
    return use_onnx_runtime, {"owned": True} if owned else {}


RUNTIMES = [("openvino", False), ("onnxruntime", True), ("onnxruntime", False)]


WRONG = [
    ("precision", ["f32"], r"one of \["),
    ("precision", "fp8", r"one of \["),
    ("precision", None, r"one of \["),
    ("threads", -1, "a whole number of threads, 1 or more"),
    ("threads", 0, "a whole number of threads, 1 or more"),
    ("threads", 2.5, "a whole number of threads, 1 or more"),
    ("threads", "2", "a whole number of threads, 1 or more"),
    ("threads", True, "a whole number of threads, 1 or more"),
    ("cache_dir", 5, "a folder's path"),
    ("owned", "yes", "True or False"),
    ("static_shapes", -1, "a whole number of request shapes, 0 or more"),
    ("static_shapes", 1.5, "a whole number of request shapes, 0 or more"),
]
ONLY = {"owned": "onnxruntime", "static_shapes": "openvino"}  # the options one runtime alone takes


@pytest.mark.parametrize("runtime, owned, option, value, accepted", [
    (runtime, owned, *wrong) for runtime, owned in RUNTIMES for wrong in WRONG
    if ONLY.get(wrong[0], runtime) == runtime and not (wrong[0] == "owned" and owned)])
def test_a_wrong_option_is_refused_the_same_from_python_and_runtime_options(runtime, owned, option, value, accepted,
                                                                           tmp_path):
    use, base = engine_call(runtime, owned)
    options = {**base, "cache_dir": str(tmp_path), option: value}
    expected = "^" + re.escape(f"{use.__name__}: {option}={value!r} is not accepted; it takes ") + accepted
    model = classifier()
    before = model.state_dict()
    for call in (lambda: use(model, **options), lambda: apply_runtime(model, runtime, **options)):
        with pytest.raises(ValueError, match=expected) as refused:
            call()
        assert "\n" not in str(refused.value)
    assert vars(model).get("forward") is None and all(  # refused before anything was attached or taken
        vars(module).get("forward") is None for module in model.modules())
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())


@pytest.mark.parametrize("runtime", ["openvino", "onnxruntime"])
def test_an_option_the_runtime_does_not_take_is_refused_naming_those_it_does(runtime):
    use, _ = engine_call(runtime, False)
    with pytest.raises(ValueError, match=rf"^runtime='{runtime}' takes no option 'precison': runtime_options takes "
                                         rf"\[.*\]\.$") as refused:
        apply_runtime(classifier(), runtime, precison="bf16")
    assert {"'precision'", "'threads'", "'cache_dir'"} <= set(str(refused.value).split("[")[1][:-2].split(", "))


PATHS = ["plain", "compiled", "onnxruntime fed", "onnxruntime owned", "openvino"]


def on_path(model, path: str, graphs):
    if path == "plain":
        return model
    if path == "compiled":
        return torch.compile(model, backend="aot_eager")
    runtime, _, how = path.partition(" ")
    use, options = engine_call(runtime, how == "owned")
    return use(model, cache_dir=graphs, **options)


@pytest.mark.parametrize("path", PATHS)
def test_inputs_that_are_not_tensors_are_refused_by_name_on_every_path(path, tmp_path_factory):
    graphs = tmp_path_factory.getbasetemp() / "graphs"  # one export for every path of this test
    plain = classifier()
    model = on_path(copy.deepcopy(plain), path, graphs)
    ids = [[5, 6, 7, 8], [9, 10, 11, 12]]
    tensors = {"input_ids": torch.tensor(ids), "attention_mask": torch.ones(2, 4, dtype=torch.long),
               "token_type_ids": torch.zeros(2, 4, dtype=torch.long)}
    with torch.inference_mode():
        assert_close(model(**tensors).logits, plain(**tensors).logits)
        for name in tensors:
            for kind, value in [("numpy.ndarray", tensors[name].numpy()), ("list", tensors[name].tolist()),
                                ("list", tensors[name][0].tolist())]:
                with pytest.raises(ValueError, match=rf"^{name} is a {kind}, and the model takes torch tensors: "
                                                     rf"pass torch\.as_tensor\({name}\), or tokenize with "
                                                     r'return_tensors="pt"\.$'):
                    model(**{**tensors, name: value})
        with pytest.raises(ValueError, match=r"^input_ids is a numpy\.ndarray"):
            model(np.array(ids))  # by place
