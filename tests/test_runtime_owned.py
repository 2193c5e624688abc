"""The engines that hold the encoder's weights (hf_vanilla/runtimes/owned.py), `runtime="openvino"` and
`runtime="onnxruntime"` with `owned=True`, beyond the conformance battery (tests/test_conformance.py, rows
`openvino*` and `onnxruntime owned*`, holds them to every edit, threads, saving, copies and moves): the heads around
the body, what they refuse and how (their choice per request size: tests/test_runtime_choice.py). Each test runs
on both engines.

- the body's own memory taken, not copied; a memory-mapped checkpoint resident after attach only where read again, a
  page written before attach kept; that checkpoint written in place under the model: every call refused, naming it;
- a tensor kept from before attach (an optimizer's) refuses writes while held, also from another thread during the
  attach, and is the model's weight again once given back;
- a classification head on the engine: the same logits as PyTorch, the head's own weights still trainable, the
  model saved and loaded back through `from_pretrained(runtime=...)`;
- refused at attach with a one-line error naming the fix: a masked LM whose decoder is tied to the body's word
  embeddings, an encoder-decoder, a model in training mode, a float16 model, an unknown precision; and int8 asked of
  ONNX Runtime fed its weights;
- refused at attach with the fix named: a precision OpenVINO has no kernel for on this machine, and bf16 where it
  would compute float32 (a CPU without bf16 products, scripted);
- refused at the call, naming the engine's remove_* call: training, a forward hook inside the body; that call gives
  the weights back and the model trains again; gradients of the held weights, until the encoder is frozen;
- refused where it happens, the model (state_dict, answers) left as it was: a write through parameters() (in place,
  .data, an optimizer's step), vector_to_parameters, to_empty, a write into a state_dict() tensor, a move to meta;
  state_dict()'s views copy out as plain tensors;
- a Parameter or None assigned in a held tensor's place: followed, the module's other tensors kept, saved whole; a
  plain tensor there: PyTorch's TypeError; what cannot be compiled (a wrong shape, a tie): every tensor kept, an
  error naming the change at each call until repaired;
- a head in another dtype than the engine holds the body in: refused at attach;
- one engine at a time: another attached to a held model takes it over, the weights given back first;
- what the user sets on `model.config` reaches the engine (`output_hidden_states`: the private copy answers);
- ONNX Runtime's int8 weights: 8 bits where the CPU has VNNI or AMX, 7 elsewhere (CPU flags scripted); a token of
  zeros beside others gives zeros;
- OpenVINO at precision "bf16" computes in bf16 from the model's own weights: a float32 model keeps and saves them;
- OpenVINO's compilations of short dense shapes of their own: PyTorch's answers from any thread, dropped with new
  weights, copies and pickles, bounded by `static_shapes`;
- every request sent to OpenVINO shares its inputs (a copying one writes into freed memory in OpenVINO 2026.4).
"""

import copy
import importlib
import os
import re
import warnings

import pytest
import torch
from numerics import assert_close

from hf_vanilla import (
    VanillaEncoderConfig,
    VanillaEncoderForMaskedLM,
    VanillaEncoderForSequenceClassification,
    VanillaEncoderModel,
    VanillaSeq2SeqConfig,
    VanillaSeq2SeqModel,
)
from hf_vanilla.precision import quantize_int8
from hf_vanilla.runtime_registry import apply_runtime
from hf_vanilla.runtimes import choice

CONFIG = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=64, num_labels=3)


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """One graph folder for the module: each architecture is exported once (test_a_second_model_finds_its_graph)."""
    return tmp_path_factory.mktemp("graphs")


@pytest.fixture(params=["openvino", "onnxruntime"])
def held(request):
    """The runtime= name of an engine that holds the weights."""
    pytest.importorskip(request.param, reason=f"runtime={request.param!r} needs its extra: pip install -e "
                                              f"'.[openvino]'")
    return request.param


def options(held, **more):
    """runtime_options for `held` (ONNX Runtime holds the weights only when asked)."""
    return {"owned": True, **more} if held == "onnxruntime" else more


def hold(model, held, graphs, **more):
    return apply_runtime(model, held, cache_dir=graphs, **options(held, **more))


def remove(held):
    """The call that gives `held`'s weights back, and its name in messages."""
    name = {"openvino": "remove_openvino", "onnxruntime": "remove_onnx_runtime"}[held]
    return getattr(importlib.import_module(f"hf_vanilla.runtimes.{held}"), name), name


@pytest.fixture
def engine_only(monkeypatch):
    monkeypatch.setattr(choice, "CHOICE", "engine")


def batch(B=3, T=9):
    generator = torch.Generator().manual_seed(B * T)
    input_ids = torch.randint(1, CONFIG["vocab_size"], (B, T), generator=generator)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[-1, T // 2:] = 0
    return {"input_ids": input_ids, "attention_mask": mask}


def test_a_head_around_the_body(held, graphs, engine_only, tmp_path):
    torch.manual_seed(0)
    plain = VanillaEncoderForSequenceClassification(VanillaEncoderConfig(**CONFIG)).eval()
    model = hold(copy.deepcopy(plain), held, graphs)
    inputs = batch()
    with torch.inference_mode():
        assert_close(model(**inputs).logits, plain(**inputs).logits)
    # The body's weights are trainable as the plain model's: named_parameters() says so of each (requires_grad), the
    # marker in their place too, an optimizer made of model.parameters() is not empty, and a gradient of them is
    # refused at backward, by name.
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {name for name, p in plain.named_parameters() if p.requires_grad}
    assert model.get_parameter(f"model._{held}_marker").requires_grad
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with pytest.raises(RuntimeError, match=rf"Computing gradients of the encoder's weights is refused: "
                                           rf"runtime='{held}' holds .*{remove(held)[1]}\(model\).*"
                                           rf"requires_grad_\(False\)"):
        model(**inputs).logits.sum().backward()
    model.model.requires_grad_(False)  # frozen, the encoder is a fixed function: the head around it trains
    model(**inputs).logits.sum().backward()
    optimizer.step()
    assert model.classifier.weight.grad is not None
    with torch.no_grad():
        plain.classifier.weight.sub_(0.1 * model.classifier.weight.grad)
        plain.classifier.bias.sub_(0.1 * model.classifier.bias.grad)
        assert_close(model(**inputs).logits, plain(**inputs).logits)
    model.save_pretrained(tmp_path)
    reloaded = VanillaEncoderForSequenceClassification.from_pretrained(
        tmp_path, runtime=held, runtime_options=options(held, cache_dir=str(graphs)))
    with torch.inference_mode():
        assert_close(reloaded(**inputs).logits, plain(**inputs).logits)


def test_the_weights_are_taken_not_copied(held, graphs):
    """The engine's copy of the body holds the body's own memory (a memory-mapped checkpoint is not materialised a
    second time), and the body keeps no weight of its own; given back, they are the same memory again."""
    model = VanillaEncoderForSequenceClassification(VanillaEncoderConfig(**CONFIG)).eval()
    before = {name: tensor.data_ptr() for name, tensor in model.model.state_dict().items()}
    hold(model, held, graphs)
    assert [tensor.numel() for tensor in model.model.parameters()] == [0]  # the marker, empty
    assert {name: tensor.data_ptr() for name, tensor in model.model.state_dict().items()} == before
    remove(held)[0](model)
    assert {name: tensor.data_ptr() for name, tensor in model.model.state_dict().items()} == before


def _mapped_pages(tensors) -> tuple[int, int]:
    """(pages a file backs, pages the process wrote) of `tensors`' memory mapped in this process."""
    page, counts = os.sysconf("SC_PAGE_SIZE"), [0, 0]
    with open("/proc/self/pagemap", "rb") as pagemap:
        for tensor in tensors:
            start, end = -(-tensor.data_ptr() // page), (tensor.data_ptr() + tensor.nbytes) // page
            if end <= start:  # no whole page
                continue
            pagemap.seek(start * 8)
            for flags in torch.frombuffer(bytearray(pagemap.read((end - start) * 8)), dtype=torch.int64).tolist():
                if flags < 0:  # bit 63: present
                    counts[0 if flags >> 61 & 1 else 1] += 1
    return tuple(counts)


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="reads which pages are mapped from "
                                                                      "/proc/self/pagemap (Linux)")
def test_a_memory_mapped_checkpoint_is_resident_only_where_read(held, graphs, tmp_path):
    """Compiling reads the whole checkpoint, and the check at attach runs PyTorch over it; the engine then unmaps the
    pages a file backs (they stay in the page cache, mapped again when read), and keeps those written since they were
    mapped."""
    torch.manual_seed(0)
    plain = VanillaEncoderModel(VanillaEncoderConfig(**{**CONFIG, "vocab_size": 4096})).eval()
    plain.save_pretrained(tmp_path)
    model = VanillaEncoderModel.from_pretrained(tmp_path).eval()
    rows = slice(0, 1024)  # 1024 x 32 floats: the first 32 pages of the word embeddings
    for each in (plain, model):
        each.get_input_embeddings().weight.data[rows] += 1  # written before attach
    inputs = {"input_ids": torch.tensor([[5, 2000, 4000, 1023]])}
    for tensor in model.state_dict().values():
        tensor.sum()  # every page of the checkpoint read, as compiling an engine reads it
    read, written = _mapped_pages(model.state_dict().values())
    assert read > 64 and written >= 32, "the checkpoint is not memory-mapped: nothing to test"
    hold(model, held, graphs)
    assert _mapped_pages(model.state_dict().values()) == (0, written)
    with torch.inference_mode():
        assert_close(model(**inputs).last_hidden_state, plain(**inputs).last_hidden_state)
    assert torch.equal(model.get_input_embeddings().weight, plain.get_input_embeddings().weight)


@pytest.mark.parametrize("write", ["in place", ".data", "an optimizer's step"])
def test_a_tensor_kept_from_before_attach_refuses_writes_until_given_back(held, graphs, engine_only, write):
    """What an optimizer, an EMA or a tied module outside the model holds: the body's own Parameter, taken before
    attach. While the engine holds the weights a write through it is refused by name (the engine's copy and PyTorch's
    path would part), and the model answers as before on every path; given back, that very tensor is the model's
    weight again, and the same write changes the model as it changes a plain one."""
    torch.manual_seed(0)
    plain = VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval()
    model = copy.deepcopy(plain)
    name = "encoder.layers.0.ffn.up_proj.weight"
    kept = model.get_parameter(name)
    optimizer = torch.optim.SGD([kept], lr=1.0)
    kept.grad = torch.ones_like(kept)

    def apply():
        with torch.no_grad():
            if write == "in place":
                kept.mul_(0.5)
            elif write == ".data":
                kept.data.mul_(0.5)
            else:
                optimizer.step()

    hold(model, held, graphs)
    with pytest.raises(RuntimeError, match=rf"Writing a weight through a reference taken before the engine held it "
                                           rf".*runtime={held!r}.*{remove(held)[1]}\(model\)"):
        apply()
    optimizer.zero_grad()  # setting .grad writes no weight
    for inputs in (batch(), batch(B=1, T=4)):  # the engine's request and PyTorch's alike
        _assert_answers(model, plain, inputs)
    assert torch.equal(model.state_dict()[name], plain.state_dict()[name])

    remove(held)[0](model)
    assert model.get_parameter(name) is kept and type(kept) is torch.nn.Parameter
    kept.grad = torch.ones_like(kept)
    apply()
    with torch.no_grad():
        plain.get_parameter(name).mul_(0.5) if write != "an optimizer's step" else plain.get_parameter(name).sub_(1.0)
    assert torch.equal(model.get_parameter(name), plain.get_parameter(name))


def test_an_edit_loop_over_named_parameters_finds_the_weights_and_is_refused(held, graphs, engine_only):
    """`for name, p in model.named_parameters(): if "up_proj" in name: p.mul_(1.5)`: the loop finds every name the
    plain model lists, in its order, with its values, and the write is refused by name, where it would otherwise edit
    nothing and say nothing. `parameters()` still yields the marker, through which `requires_grad_()` acts."""
    torch.manual_seed(0)
    plain = VanillaEncoderForSequenceClassification(VanillaEncoderConfig(**CONFIG)).eval()
    model = hold(copy.deepcopy(plain), held, graphs)
    listed = dict(model.named_parameters())
    assert list(listed) == [name for name, _ in plain.named_parameters()]
    for name, tensor in plain.named_parameters():
        assert torch.equal(listed[name], tensor), name
    with pytest.raises(RuntimeError, match=rf"Writing a weight \(mul_\) is refused: runtime={held!r}.*{remove(held)[1]}"):
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "up_proj" in name:
                    parameter.mul_(1.5)
    assert [name for name, _ in model.base_model.named_parameters()] == \
        [name for name, _ in plain.base_model.named_parameters()]
    model.base_model.requires_grad_(False)
    assert model.num_parameters(only_trainable=True) == plain.num_parameters() - plain.base_model.num_parameters()
    inputs = batch()
    with torch.inference_mode():
        assert_close(model(**inputs).logits, plain(**inputs).logits)


def test_a_write_from_another_thread_during_attach_is_refused_by_name(held, graphs, engine_only, monkeypatch):
    """A thread writing a weight while the engine is compiled: refused where it writes, naming the engine (not
    found later as a graph that differs from PyTorch)."""
    import threading

    from hf_vanilla.runtimes import owned

    torch.manual_seed(0)
    model = VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval()
    kept, errors, graph = model.get_parameter("encoder.layers.1.ffn.down_proj.weight"), [], owned.OwnedEncoder._graph

    def writer():
        try:
            with torch.no_grad():
                kept.add_(1.0)
        except RuntimeError as error:
            errors.append(str(error))

    def graph_with_a_write(self):  # the other thread writes while the engine is being compiled
        thread = threading.Thread(target=writer)
        thread.start()
        thread.join()
        return graph(self)

    monkeypatch.setattr(owned.OwnedEncoder, "_graph", graph_with_a_write)
    hold(model, held, graphs)
    assert len(errors) == 1 and "reference taken before the engine held it" in errors[0], errors


@pytest.mark.parametrize("how", ["written in place", "copied over", "saved beside and renamed into place"])
def test_a_checkpoint_written_under_the_loaded_model(held, graphs, engine_only, tmp_path, how):
    """A model loaded memory-mapped shares the checkpoint file's pages. Written in place (as `cp` writes), the file
    changes the weights under the engine's copy: every call of the held model is refused, naming the file and the
    fix, never answered half old, half new; loaded again, the model answers the new weights. Renamed into place (as
    save_pretrained writes), the mapped file is untouched and the model answers as before."""
    import shutil

    torch.manual_seed(0)
    old = VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval()
    new = VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval()
    old.save_pretrained(tmp_path / "model")
    new.save_pretrained(tmp_path / "new")
    model = hold(VanillaEncoderModel.from_pretrained(tmp_path / "model").eval(), held, graphs)
    inputs = batch()
    _assert_answers(model, old, inputs)
    target, source = tmp_path / "model" / "model.safetensors", tmp_path / "new" / "model.safetensors"
    if how == "written in place":
        with open(target, "r+b") as file:
            file.write(source.read_bytes())
    elif how == "copied over":
        shutil.copyfile(source, target)
    else:
        shutil.copyfile(source, tmp_path / "model" / "incoming")
        os.replace(tmp_path / "model" / "incoming", target)
    if how == "saved beside and renamed into place":
        _assert_answers(model, old, inputs)
    else:
        for each in (inputs, batch(B=1, T=4)):  # the engine's request and PyTorch's alike
            with pytest.raises(RuntimeError, match=rf"checkpoint file {re.escape(str(target))} was written while "
                                                   rf"this model was loaded.*Load the model again"):
                _answers(model, each)
    again = hold(VanillaEncoderModel.from_pretrained(tmp_path / "model").eval(), held, graphs)
    _assert_answers(again, new, inputs)


def test_a_second_model_finds_its_graph(held, tmp_path, engine_only, monkeypatch):
    """The graph is kept per architecture, not per model: holding a second model of the same shape exports nothing,
    and the kept graph computes with the second model's own weights."""
    from hf_vanilla.runtimes import owned  # after `held` has skipped where the engine's packages are missing

    exported, export = [], owned.export_graph
    monkeypatch.setattr(owned, "export_graph", lambda *args: exported.append(args[-1]) or export(*args))
    inputs = batch()
    real = inputs["attention_mask"].bool()
    for seed in (0, 1):
        torch.manual_seed(seed)
        plain = VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval()
        model = hold(copy.deepcopy(plain), held, tmp_path)
        with torch.inference_mode():
            assert_close(model(**inputs).last_hidden_state[real], plain(**inputs).last_hidden_state[real])
    assert len(exported) == 1


@pytest.mark.parametrize("case, error", [
    ("tied masked LM", r"lm_head\.decoder\.weight is shared.*runtime='onnxruntime'"),
    ("encoder-decoder", r"no vanilla encoder body.*runtime='onnxruntime'"),
    ("training", r"model\.eval\(\)"),
    ("float16", r"float32 or bfloat16 model on the CPU.*model\.float\(\)\.cpu\(\)"),
    ("precision", r"precision='fp8' is not accepted; it takes one of \[.*'f32', 'int8'\]"),
    ("quantize_int8", r"takes a float32 model, and encoder\.layers\.0\..* is int8 \(quantize_int8\).*"
                      r"precision='int8'"),
])
def test_what_it_refuses_at_attach(held, graphs, case, error):
    config = VanillaEncoderConfig(**CONFIG)
    model, more = VanillaEncoderModel(config).eval(), {}
    if case == "tied masked LM":
        model = VanillaEncoderForMaskedLM(config).eval()
    elif case == "encoder-decoder":
        model = VanillaSeq2SeqModel(VanillaSeq2SeqConfig(vocab_size=99, d_model=32, encoder_layers=1,
                                                         decoder_layers=1, encoder_attention_heads=4,
                                                         decoder_attention_heads=4, encoder_ffn_dim=64,
                                                         decoder_ffn_dim=64)).eval()
    elif case == "training":
        model.train()
    elif case == "float16":
        model.to(torch.float16)
    elif case == "quantize_int8":  # no float32 weights left to export (torch.export failed on it, unexplained)
        model = quantize_int8(model)
    else:
        more["precision"] = "fp8"
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match=error):
        hold(model, held, graphs, **more)
    after = model.state_dict()  # refused before taking anything
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_onnx_runtime_fed_refuses_a_quantized_model(graphs):
    pytest.importorskip("onnxruntime", reason="runtime='onnxruntime' needs the onnx extra")
    from hf_vanilla.runtimes.onnxruntime import use_onnx_runtime

    model = quantize_int8(VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval())
    with pytest.raises(ValueError, match=r"use_onnx_runtime takes a float32 model, .* is int8 \(quantize_int8\)"):
        use_onnx_runtime(model, cache_dir=graphs)


def test_what_it_refuses_at_the_call_and_remove(held, graphs, engine_only):
    give_back, name = remove(held)
    torch.manual_seed(0)
    plain = VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval()
    model = hold(copy.deepcopy(plain), held, graphs)
    inputs = batch()
    model.train()
    with pytest.raises(RuntimeError, match=rf"Training \(model\.train\(\)\) is refused.*{name}\(model\)"):
        model(**inputs)
    model.eval()
    handle = model.encoder.layers[0].register_forward_hook(lambda *args: None)
    with pytest.raises(RuntimeError, match=rf"forward hook inside the encoder.*is refused.*{name}\(model\)"):
        model(**inputs)
    handle.remove()
    model(**inputs)
    give_back(model)
    assert all(p.requires_grad for p in model.parameters())
    model.train()
    loss = model(**inputs).last_hidden_state.square().mean()
    loss.backward()  # the weights are the model's again: it trains
    assert model.encoder.layers[0].self_attn.q_proj.weight.grad is not None
    for name, tensor in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.parametrize("then", ["openvino", "onnxruntime owned", "onnxruntime fed"])
def test_one_engine_at_a_time(held, then, graphs, engine_only):
    """An engine attached to a model another engine holds takes it over: the first gives the weights back, and the
    second answers as PyTorch does (an OpenVINO-held model handed to use_onnx_runtime used to fail in
    torch.export: the body had no tensor left)."""
    pytest.importorskip("openvino", reason="runtime='openvino' needs the openvino extra: pip install -e '.[openvino]'")
    torch.manual_seed(0)
    plain = VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval()
    model = hold(copy.deepcopy(plain), held, graphs)
    runtime, _, how = then.partition(" ")
    apply_runtime(model, runtime, cache_dir=graphs, **({"owned": how == "owned"} if runtime == "onnxruntime" else {}))
    inputs = batch()
    with torch.inference_mode():
        got, want = model(**inputs).last_hidden_state, plain(**inputs).last_hidden_state
    real = inputs["attention_mask"].bool()
    assert_close(got[real], want[real])
    engines = [type(vars(module)["forward"]).__name__ for module in model.modules() if "forward" in vars(module)]
    assert len(engines) == 1, engines
    remove(runtime)[0](model)
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in plain.state_dict().items())


def _state(model) -> dict:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def _assert_state(model, expected: dict):
    state = model.state_dict()
    assert list(state) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


def _answers(model, inputs):
    with torch.inference_mode():
        output = model(**inputs)
    real = inputs["attention_mask"].bool()
    return output.last_hidden_state[real], output.pooler_output


def _held_pair(held, graphs):
    """(a plain model, a copy held by `held`, a batch), the held copy having answered the batch once."""
    torch.manual_seed(0)
    plain = VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval()
    model = hold(copy.deepcopy(plain), held, graphs)
    inputs = batch()
    _answers(model, inputs)
    return plain, model, inputs


def _assert_answers(model, plain, inputs):
    for got, want in zip(_answers(model, inputs), _answers(plain, inputs)):
        assert_close(got, want)


def _up_proj(model):
    return model.encoder.layers[0].ffn.up_proj


ASSIGNED = {  # the same assignment on a held model and the plain one: followed, as PyTorch takes it
    "a Parameter in a weight's place": lambda m: setattr(_up_proj(m), "weight", torch.nn.Parameter(
        torch.full((64, 32), 0.01))),
    "a Parameter in a bias's place": lambda m: setattr(_up_proj(m), "bias", torch.nn.Parameter(torch.ones(64))),
    "None in a bias's place": lambda m: setattr(m.encoder.layers[1].ffn.down_proj, "bias", None),
}


@pytest.mark.parametrize("assignment", list(ASSIGNED))
def test_an_assigned_tensor_is_followed_and_nothing_is_lost(held, graphs, engine_only, tmp_path, assignment):
    """What a user assigns in a held tensor's place is followed: the body is traced and compiled again with it, and
    the module's other tensors stay (a Parameter assigned as `up_proj.weight` once dropped `up_proj.bias` from the
    model, its state_dict and its checkpoint, and every call after raised). The answers, the state_dict (keys, in
    PyTorch's order, and values) and what save_pretrained writes are the plain model's after the same assignment."""
    plain, model, inputs = _held_pair(held, graphs)
    for target in (model, plain):
        ASSIGNED[assignment](target)
    _assert_answers(model, plain, inputs)
    _assert_state(model, _state(plain))
    model.save_pretrained(tmp_path / "held")
    plain.save_pretrained(tmp_path / "plain")
    loaded = [VanillaEncoderModel.from_pretrained(tmp_path / which, output_loading_info=True) for which in ("held",
                                                                                                           "plain")]
    assert loaded[0][1] == loaded[1][1]  # a bias set to None is missing from both (the config says it has one)
    if not loaded[0][1]["missing_keys"]:
        _assert_answers(loaded[0][0].eval(), plain, inputs)


def test_an_assignment_torch_refuses_is_refused_as_torch_does(held, graphs, engine_only):
    """A plain tensor assigned in a parameter's place: PyTorch raises TypeError at the assignment; held, the body
    cannot see it until the next call, which raises PyTorch's TypeError and puts the weight back, so the model is
    then as PyTorch leaves it."""
    torch.manual_seed(0)
    plain = VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval()
    model = hold(copy.deepcopy(plain), held, graphs)
    inputs = batch()
    before = _state(model)
    with pytest.raises(TypeError) as theirs:
        _up_proj(plain).weight = torch.zeros(64, 32)
    _up_proj(model).weight = torch.zeros(64, 32)
    with pytest.raises(TypeError) as ours:
        _answers(model, inputs)
    assert str(ours.value) == str(theirs.value)
    _assert_state(model, before)
    _assert_answers(model, plain, inputs)


CANNOT_RUN = {  # assignments a held engine cannot run: (the assignment, what changed, what failed), as it says them
    # The plain model's calls fail too.
    "a Parameter of the wrong shape": (lambda m: setattr(_up_proj(m), "weight", torch.nn.Parameter(torch.zeros(3, 3))),
                                       r"encoder\.layers\.0\.ffn\.up_proj\.weight",
                                       r"RuntimeError: a and b must have same reduction dim"),
    # The plain model runs it; the graphs the engines run read each weight once (hf_vanilla.export): refused by
    # name, as runtime="onnxruntime" fed the weights refuses a body with a tie at attach.
    "one layer's weight tied to another's": (lambda m: setattr(m.encoder.layers[1].ffn.up_proj, "weight",
                                                               _up_proj(m).weight),
                                             r"encoder\.layers\.1\.ffn\.up_proj\.weight",
                                             r"ValueError: encoder\.layers\.1\.ffn\.up_proj\.weight is "
                                             r"encoder\.layers\.0\.ffn\.up_proj\.weight \(one tensor under two names"),
}


@pytest.mark.parametrize("change", list(CANNOT_RUN))
def test_a_change_that_cannot_run_keeps_every_weight(held, graphs, engine_only, change):
    """An assignment the engine cannot compile: the call fails with an error saying what changed, what failed and
    the fixes, at every call until it is repaired; the model keeps every tensor (its state_dict is the plain
    model's after the same assignment: nothing dropped, nothing re-initialised), and once repaired it is held and
    answers again."""
    _, name = remove(held)
    assign, what, said = CANNOT_RUN[change]
    plain, model, inputs = _held_pair(held, graphs)
    for target in (model, plain):
        assign(target)
    for _ in range(2):  # tried again at every call
        with pytest.raises(RuntimeError, match=rf"^The encoder as changed \({what}\) cannot run on "
                                               rf"runtime='{held}': {said}.*repair the change.*{name}\(model\)"):
            _answers(model, inputs)
        _assert_state(model, _state(plain))
    for target in (model, plain):
        _up_proj(target).weight = torch.nn.Parameter(torch.full((64, 32), 0.02))
    _assert_answers(model, plain, inputs)
    _assert_state(model, _state(plain))
    assert [p.numel() for p in model.parameters()] == [0]  # held again


def _write_through_a_state_dict(model):
    model.state_dict()["encoder.layers.0.ffn.up_proj.weight"].zero_()


def _step(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()


REFUSED = {  # what would change nothing of a held model's weights, or could not: refused where it happens
    "p.mul_() over parameters()": (lambda m: [p.mul_(1.5) for p in m.parameters()], RuntimeError,
                                   r"Writing the model's parameters \(mul_: model\.parameters\(\) yields an empty "
                                   r"marker"),
    "p.data.zero_() over parameters()": (lambda m: [p.data.zero_() for p in m.parameters()], RuntimeError,
                                         r"Writing the model's parameters \(zero_"),
    "an optimizer's step": (_step, RuntimeError, r"Writing the model's parameters \(add_"),
    "vector_to_parameters": (lambda m: torch.nn.utils.vector_to_parameters(torch.ones(10_000), m.parameters()),
                             RuntimeError, r"Replacing the model's parameters \(\.data = \.\.\., as "
                                           r"vector_to_parameters"),
    "to_empty": (lambda m: m.to_empty(device="cpu"), RuntimeError, r"Replacing the model's parameters"),
    "a write into a state_dict() tensor": (_write_through_a_state_dict, RuntimeError,
                                           r"Writing a weight \(zero_\) .*state_dict\(\) gives read-only views"),
    "a numpy write into a state_dict() tensor": (
        lambda m: m.state_dict()["pooler.weight"].numpy().__setitem__(0, 1.0), ValueError, "read-only"),
    "model.to('meta')": (lambda m: m.to("meta"), RuntimeError, r"Moving the model to meta is refused"),
}


@pytest.mark.parametrize("write", list(REFUSED))
def test_what_would_change_nothing_is_refused_where_it_happens(held, graphs, engine_only, write):
    """parameters() yields an empty marker where the held weights were, and state_dict() read-only views of them: a
    write through either, a replacement of the marker's memory and a move to another device are refused at once,
    naming the engine and the call that gives the weights back, and the model is as it was (its state_dict, keys
    and values, and its answers). Each once passed without a word, and the model answered the weights as they
    were; model.to('meta') was refused at the next call, advising model.cpu(), which then failed inside torch."""
    _, name = remove(held)
    call, error, message = REFUSED[write]
    torch.manual_seed(0)
    plain = VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval()
    model = hold(copy.deepcopy(plain), held, graphs)
    inputs = batch()
    before = _state(model)
    with pytest.raises(error, match=message) as refused:
        with torch.no_grad():
            call(model)
    if error is RuntimeError:
        assert re.search(rf"is refused: runtime='{held}' holds this encoder's weights.*{name}\(model\)",
                         str(refused.value))
    _assert_state(model, before)
    _assert_answers(model, plain, inputs)
    assert model.device.type == "cpu"


def test_a_state_dict_reads_and_copies_as_the_weights(held, graphs, engine_only, tmp_path):
    """state_dict() shares the engine's memory (no copy of the weights to save them), and every way out of it is a
    plain tensor: torch.save, a deep copy, .clone(), another model's load_state_dict. A changed copy loaded with
    load_state_dict is followed."""
    import io

    torch.manual_seed(0)
    plain = VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval()
    model = hold(copy.deepcopy(plain), held, graphs)
    inputs = batch()
    state = model.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    for copied in (torch.load(buffer), copy.deepcopy(state), {k: v.clone() for k, v in state.items()}):
        assert all(type(tensor) is torch.Tensor for tensor in copied.values())
        assert all(torch.equal(copied[k], v) for k, v in plain.state_dict().items())
    other = VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval()
    other.load_state_dict(state)
    _assert_answers(other, plain, inputs)
    changed = {k: v.clone() for k, v in state.items()}
    changed["encoder.layers.0.ffn.up_proj.weight"].mul_(-1)
    model.load_state_dict(changed)
    plain.load_state_dict(changed)
    _assert_answers(model, plain, inputs)


def test_a_model_around_the_encoder_in_another_dtype_is_refused_at_attach(held, graphs, tmp_path):
    """A bfloat16 model with a head, held at a precision the engine computes in float32: the encoder's float32
    output would meet the bfloat16 head ("mat1 and mat2 must have the same dtype" at every call). Refused at attach
    (and so at from_pretrained(..., runtime=...)), naming the fixes; the model is left as it was."""
    torch.manual_seed(0)
    plain = VanillaEncoderForSequenceClassification(VanillaEncoderConfig(**CONFIG)).eval().to(torch.bfloat16)
    before = _state(plain)
    keeps = r", or ask for precision='bf16', which keeps the model's dtype" if held == "openvino" else ""
    refusal = (rf"at precision 'f32' holds the encoder in torch\.float32, and classifier\.weight after it is "
               rf"torch\.bfloat16: load the model in torch\.float32 \(from_pretrained\(\.\.\., "
               rf"dtype=torch\.float32\), or model\.to\(torch\.float32\)\) first{keeps}\.$")
    with pytest.raises(ValueError, match=refusal):
        hold(plain, held, graphs)
    _assert_state(plain, before)
    plain.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=refusal):
        VanillaEncoderForSequenceClassification.from_pretrained(tmp_path, dtype=torch.bfloat16, runtime=held,
                                                                runtime_options=options(held, cache_dir=str(graphs)))


def test_the_config_reaches_the_engine(held, graphs, engine_only):
    torch.manual_seed(0)
    plain = VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval()
    model = hold(copy.deepcopy(plain), held, graphs)
    inputs = batch()
    model.config.output_hidden_states = True
    plain.config.output_hidden_states = True
    with torch.inference_mode():
        got, want = model(**inputs).hidden_states, plain(**inputs).hidden_states
    assert got is not None and len(got) == len(want)
    real = inputs["attention_mask"].bool()
    for have, expected in zip(got, want):
        assert_close(have[real], expected[real])


def test_a_call_checks_the_model_without_reading_it(held, graphs, engine_only, monkeypatch):
    """While nothing changes, a call of a held model (a head around the body; padded and dense) moves no count and
    compares none of the body's module dicts (hf_vanilla/runtimes/watch.py), so the check costs the same whatever the
    model's size; the next change is still seen at the next call, and given back, the body's modules have their
    plain registries again."""
    from hf_vanilla.runtimes import watch

    torch.manual_seed(0)
    plain = VanillaEncoderForSequenceClassification(VanillaEncoderConfig(**CONFIG)).eval()
    model = hold(copy.deepcopy(plain), held, graphs)
    requests = [batch(), {"input_ids": batch()["input_ids"]}]
    compared, everything = [], watch.Watch._unchanged_everywhere
    with torch.inference_mode():
        for inputs in requests:
            model(**inputs)  # warm: the sizes compiled, the check made once after the attach's own reads
        monkeypatch.setattr(watch.Watch, "_unchanged_everywhere", lambda self: compared.append(self) or everything(self))
        before = watch.CHANGES
        for inputs in requests * 2:
            assert_close(model(**inputs).logits, plain(**inputs).logits)
        assert watch.CHANGES == before and not compared
        model.config.output_hidden_states = plain.config.output_hidden_states = True
        assert len(model(**batch()).hidden_states) == len(plain(**batch()).hidden_states)
    remove(held)[0](model)
    assert not [m for m in model.modules() for name in watch._REGISTRIES if isinstance(vars(m)[name], watch._Counting)]


def test_int8_needs_onnx_runtime_to_hold_the_weights(graphs):
    """Fed the model's weights on every call, ONNX Runtime computes in float32: int8 is refused there, naming
    owned=True, before anything is attached."""
    from hf_vanilla.runtimes.onnxruntime import use_onnx_runtime

    model = VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval()
    with pytest.raises(ValueError, match=r"precision='int8'.*owned=True"):
        use_onnx_runtime(model, cache_dir=graphs, precision="int8")
    assert "forward" not in vars(model) and len(list(model.parameters())) > 1


@pytest.mark.parametrize("flags, bits", [({"avx2", "avx512f", "avx512bw"}, 7), ({"avx2", "avx512_vnni"}, 8),
                                         ({"avx2", "avx_vnni"}, 8), ({"avx2", "amx_int8"}, 8)])
def test_onnx_runtime_int8_weights_fit_the_cpus_int8_product(monkeypatch, flags, bits):
    """ONNX Runtime's int8 weights get 8 bits where the CPU accumulates u8 x s8 in int32 (VNNI, AMX), and 7 where
    its kernel adds pairs of products into a saturating int16 (vpmaddubsw), which 8-bit weights can overflow."""
    pytest.importorskip("onnxruntime", reason="runtime='onnxruntime' needs the onnx extra")
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from hf_vanilla.runtimes.onnxruntime import held

    monkeypatch.setattr(held, "cpu_flags", lambda: flags)
    weight = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    quantized = held.quantized(_projection(weight))
    weights = [numpy_helper.to_array(t) for t in quantized.graph.initializer if t.data_type == onnx.TensorProto.INT8
               and t.dims == [16, 8]]
    assert len(weights) == 1
    assert np.abs(weights[0].astype(int)).max() == (127 if bits == 8 else 64)


def test_onnx_runtime_int8_takes_a_token_of_zeros():
    """Each token is divided by its own largest |x| before ONNX Runtime's int8 product: a token of zeros beside
    others gives zeros, not a NaN that sets the one scale of the whole tensor (every row NaN, as it did)."""
    pytest.importorskip("onnxruntime", reason="runtime='onnxruntime' needs the onnx extra")
    import numpy as np
    import onnxruntime

    from hf_vanilla.runtimes.onnxruntime import held

    weight = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    session = onnxruntime.InferenceSession(held.quantized(_projection(weight)).SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32)
    x[1] = 0
    y = session.run(None, {"x": x})[0]
    assert np.array_equal(y[1], np.zeros(8, np.float32))
    assert_close(torch.from_numpy(y[0]), torch.from_numpy(x[0] @ weight), dtype=torch.bfloat16)


def _projection(weight):
    """A graph of one projection, y = x W with W (16, 8) a constant: what every layer's are to the quantizer."""
    from onnx import TensorProto, helper, numpy_helper

    return helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "projection",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], [numpy_helper.from_array(weight, "w")]),
        opset_imports=[helper.make_opsetid("", 20)])


def test_a_precision_openvino_cannot_run_is_refused_at_attach(graphs, monkeypatch):
    """Where OpenVINO's plugin has no kernel for a precision on this machine (seen under ONEDNN_MAX_CPU_ISA=AVX2 on
    an AVX-512 CPU), use_openvino says so and names precision='f32', and the model keeps its weights."""
    pytest.importorskip("openvino", reason="runtime='openvino' needs the openvino extra: pip install -e '.[openvino]'")
    from hf_vanilla.runtimes.openvino import engine, use_openvino

    compile_graph = engine.compile_graph

    def no_int8_kernel(graph, tensors, precision, threads):
        if precision == "int8":
            raise RuntimeError("Check '!getSupportedPrimitiveDescriptors().empty()' failed")
        return compile_graph(graph, tensors, precision, threads)

    monkeypatch.setattr(engine, "compile_graph", no_int8_kernel)
    model = VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"cannot run precision 'int8'.*getSupportedPrimitiveDescriptors.*"
                                         r"precision='f32'"):
        use_openvino(model, precision="int8", cache_dir=graphs)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_bf16_on_a_cpu_without_bf16_products_is_refused_not_run_in_float32(graphs, monkeypatch):
    """OpenVINO's CPU plugin, asked for bf16 on a CPU that does not multiply bf16 (AVX2 only), keeps float32 and says
    so only in the compiled model's INFERENCE_PRECISION_HINT: use_openvino and a later model.to(torch.bfloat16)
    (at the next call, and every call until model.float()) refuse, naming precision='f32', and the model keeps its
    weights. The plugin is scripted as on such a CPU: its
    capabilities without BF16, and a bf16 hint compiled as float32 (what it does there)."""
    openvino = pytest.importorskip("openvino", reason="runtime='openvino' needs the openvino extra")
    from hf_vanilla.runtimes.openvino import runs_bf16, use_openvino

    class AVX2Plugin(openvino.Core):
        def get_property(self, device, name):
            found = super().get_property(device, name)
            return [c for c in found if c != "BF16"] if name == "OPTIMIZATION_CAPABILITIES" else found

        def compile_model(self, model, device, config):
            return super().compile_model(model, device, {**config, "INFERENCE_PRECISION_HINT": "f32"})

    model = VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval()
    held = use_openvino(copy.deepcopy(model), cache_dir=graphs)  # float32, before the plugin is scripted
    monkeypatch.setattr(openvino, "Core", AVX2Plugin)
    assert not runs_bf16()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    refusal = (r"^OpenVINO would run precision 'bf16' in f32 on this CPU: .* lists \[(?!.*BF16).*\]: hold a "
               r"float32 model \(model\.float\(\)\) at precision='f32', what it would compute, or 'int8' "
               r"\(hf_vanilla\.runtimes\.openvino\.runs_bf16\(\) tells beforehand\)\.$")
    with pytest.raises(ValueError, match=refusal):
        use_openvino(model, precision="bf16", cache_dir=graphs)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    with torch.inference_mode():
        before = held(**batch()).last_hidden_state
    saved = {name: tensor.clone() for name, tensor in held.state_dict().items()}
    held.to(torch.bfloat16)  # followed at the next call, where it cannot be: refused there and at every call after
    moved = (r"^Moving the model to torch\.bfloat16 is refused: runtime='openvino' holds .*remove_openvino\(model\) "
             r".*model\.float\(\) to go on here\): " + refusal[1:])
    for _ in range(2):
        with pytest.raises(RuntimeError, match=moved), torch.inference_mode():
            held(**batch())
    state = held.state_dict()  # the weights as they were, never rounded to bfloat16
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
    with torch.inference_mode():
        assert_close(held.float()(**batch()).last_hidden_state, before)


def test_openvino_bf16_computes_in_bf16_from_the_models_own_weights(graphs, engine_only):
    """precision="bf16" is what OpenVINO computes in, not what the weights become: a float32 model keeps (and
    saves) its float32 weights and answers in float32 within bfloat16's rule of float32; a bfloat16 model stays
    bfloat16, and a later model.to(torch.bfloat16) moves the weights too."""
    pytest.importorskip("openvino", reason="runtime='openvino' needs the openvino extra: pip install -e '.[openvino]'")
    from hf_vanilla.runtimes.openvino import runs_bf16, use_openvino

    if not runs_bf16():
        pytest.skip("this CPU does not multiply bf16, and OpenVINO refuses precision='bf16' here (tested above)")
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        pytest.skip("under ONEDNN_MAX_CPU_ISA OpenVINO's plugin has no bf16 kernel for the CPU it believes it is on "
                    "(tests/test_conformance.py says why)")
    torch.manual_seed(0)
    plain = VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval()
    inputs = batch()
    with torch.inference_mode():
        want = plain(**inputs).last_hidden_state
    model = use_openvino(copy.deepcopy(plain), precision="bf16", cache_dir=graphs)
    assert model.forward.compiled.get_property("INFERENCE_PRECISION_HINT").to_string() == "bf16"  # OpenVINO's word
    saved = model.state_dict()
    assert model.dtype == torch.float32
    assert all(torch.equal(saved[name], tensor) for name, tensor in plain.state_dict().items())
    with torch.inference_mode():
        got = model(**inputs).last_hidden_state
    assert got.dtype == torch.float32
    assert_close(got, want, dtype=torch.bfloat16)

    for held in (use_openvino(copy.deepcopy(plain).to(torch.bfloat16), precision="bf16", cache_dir=graphs),
                 model.to(torch.bfloat16)):
        with torch.inference_mode():
            got = held(**inputs).last_hidden_state
        assert held.dtype == got.dtype == torch.bfloat16
        assert {tensor.dtype for tensor in held.state_dict().values() if tensor.is_floating_point()} == {
            torch.bfloat16}
        assert_close(got, want, dtype=torch.bfloat16)


def test_openvino_compiles_a_short_dense_shape_of_its_own_and_drops_it_with_the_weights(graphs, engine_only):
    """A dense request of at most STATIC_TOKENS tokens gets a compilation of its own (B, T) at the second request of
    that shape, for up to `static_shapes` shapes: its answers are PyTorch's within the float32 rule, from any
    thread; new weights (load_state_dict) drop it with the engine's own compilation, and the next ones answer the new
    weights; a copy or a pickle starts without; by default (static_shapes=0) it compiles none, so no request waits
    for a compilation, and a bad value is refused."""
    pytest.importorskip("openvino", reason="runtime='openvino' needs the openvino extra: pip install -e '.[openvino]'")
    import pickle
    from concurrent.futures import ThreadPoolExecutor

    from hf_vanilla.runtimes.openvino import use_openvino
    from hf_vanilla.runtimes.openvino.engine import STATIC_TOKENS

    torch.manual_seed(0)
    plain = VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval()
    model = use_openvino(copy.deepcopy(plain), cache_dir=graphs, static_shapes=2)
    engine = model.forward
    short, other, third = (batch(1, 9), batch(2, 5), batch(1, 4))
    for inputs in (short, other, third):
        inputs["attention_mask"].fill_(1)
    long = {"input_ids": torch.randint(1, CONFIG["vocab_size"], (3, STATIC_TOKENS // 3 + 1))}

    def check(model, reference, inputs, times=1):
        with torch.inference_mode():
            want = reference(**inputs)
            for _ in range(times):
                got = model(**inputs)
                assert_close(got.last_hidden_state, want.last_hidden_state)
                assert_close(got.pooler_output, want.pooler_output)

    check(model, plain, short)
    assert engine.static == {}  # the first request of a shape runs on the compilation for any shape
    check(model, plain, short, times=2)
    check(model, plain, long, times=3)  # too long to get its own
    assert list(engine.static) == [(1, 9)]
    with ThreadPoolExecutor(4) as pool:  # the second shape compiled while other threads ask for it
        list(pool.map(lambda _: check(model, plain, other), range(8)))
    check(model, plain, third, times=3)  # two shapes kept at most: the third runs on the engine's own
    assert set(engine.static) == {(1, 9), (2, 5)}

    for how in (copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))):
        clone = how(model)
        check(clone, plain, short)
        assert clone.forward.static == {}

    new = {name: tensor * 1.1 for name, tensor in plain.state_dict().items()}
    plain.load_state_dict(new)
    model.load_state_dict(new)
    assert engine.static == {}
    check(model, plain, short, times=3)
    assert list(engine.static) == [(1, 9)]

    none = use_openvino(copy.deepcopy(plain), cache_dir=graphs)
    check(none, plain, short, times=3)
    assert none.forward.static == {}
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=rf"static_shapes={bad!r} is not accepted; it takes a whole number"):
            use_openvino(copy.deepcopy(plain), cache_dir=graphs, static_shapes=bad)


def test_openvino_shares_the_inputs_of_every_request_it_sends(graphs, engine_only, monkeypatch):
    """Every request the engine sends OpenVINO shares its inputs' memory, the probe of a reduced precision's
    compilation included: OpenVINO 2026.4 writes a copying request's inputs into the memory the last sharing request
    was given, which here is freed (engine.OpenVinoEncoder.run)."""
    openvino = pytest.importorskip("openvino", reason="runtime='openvino' needs the openvino extra: pip install -e "
                                                      "'.[openvino]'")
    import inspect

    from hf_vanilla.runtimes.openvino import use_openvino

    shared = []
    for name in ("infer", "start_async"):
        original = getattr(openvino.InferRequest, name)
        signature = inspect.signature(original)

        def spy(*args, _original=original, _signature=signature, **kwargs):
            shared.append(_signature.bind(*args, **kwargs).arguments.get("share_inputs", False))
            return _original(*args, **kwargs)

        monkeypatch.setattr(openvino.InferRequest, name, spy)
    precisions = ["f32"] if os.environ.get("ONEDNN_MAX_CPU_ISA") else ["f32", "int8"]  # why: test_conformance.py
    dense = {"input_ids": batch(2, 5)["input_ids"]}
    for precision in precisions:
        model = use_openvino(VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval(), precision=precision,
                             cache_dir=graphs, static_shapes=1)
        with torch.inference_mode():
            for inputs in (batch(), dense, dense, dense):
                model(**inputs)
        assert model.forward.static  # the dense shape's own compilation ran too
    assert len(shared) > 8 and all(shared)


# ---- every public attribute and method of a held model: the plain model's answer, or a refusal by name ------------

WEIGHT = "model.encoder.layers.0.ffn.up_proj.weight"
# Public methods called with arguments (the rest take none): each on a held model and on the plain one.
CALLED_WITH = {
    "add_model_tags": lambda m: m.add_model_tags(["held"]),
    "add_module": lambda m: m.add_module("extra", torch.nn.Identity()),
    "register_module": lambda m: m.register_module("extra", torch.nn.Identity()),
    "apply": lambda m: m.apply(lambda module: None),
    "smart_apply": lambda m: m.smart_apply(lambda module, init: None, False),
    "get_buffer": lambda m: m.get_buffer(WEIGHT),
    "get_parameter": lambda m: m.get_parameter(WEIGHT),
    "get_parameter_or_buffer": lambda m: m.get_parameter_or_buffer(WEIGHT),
    "get_submodule": lambda m: m.get_submodule("model.encoder.layers.0.ffn.up_proj"),
    "set_submodule": lambda m: m.set_submodule("model.pooler", _seeded(torch.nn.Linear, 32, 32)),
    "load_state_dict": lambda m: m.load_state_dict({k: v * 1.1 for k, v in m.state_dict().items()}),
    "register_buffer": lambda m: m.register_buffer("extra", torch.zeros(1)),
    "register_parameter": lambda m: m.register_parameter("extra", torch.nn.Parameter(torch.zeros(1))),
    **{name: (lambda name: lambda m: getattr(m, name)(lambda *args, **kwargs: None))(name) for name in (
        "register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
        "register_full_backward_pre_hook", "register_backward_hook", "register_load_state_dict_post_hook",
        "register_load_state_dict_pre_hook", "register_state_dict_post_hook", "register_state_dict_pre_hook")},
    "resize_token_embeddings": lambda m: m.resize_token_embeddings(104),
    "resize_position_embeddings": lambda m: m.resize_position_embeddings(80),
    "set_attn_implementation": lambda m: m.set_attn_implementation("eager"),
    "get_correct_attn_implementation": lambda m: m.get_correct_attn_implementation("sdpa"),
    "get_correct_experts_implementation": lambda m: m.get_correct_experts_implementation(None),
    "set_experts_implementation": lambda m: m.set_experts_implementation("eager"),
    "set_input_embeddings": lambda m: m.set_input_embeddings(_seeded(torch.nn.Embedding, 99, 32)),
    "set_output_embeddings": lambda m: m.set_output_embeddings(_seeded(torch.nn.Linear, 32, 99)),
    "set_decoder": lambda m: m.set_decoder(torch.nn.Identity()),
    "set_encoder": lambda m: m.set_encoder(torch.nn.Identity()),
    "set_extra_state": lambda m: m.set_extra_state({}),
    "set_use_kernels": lambda m: m.set_use_kernels(False),
    "to": lambda m: m.to(torch.float16),
    "type": lambda m: m.type(torch.float64),
    "retrieve_modules_from_names": lambda m: m.retrieve_modules_from_names(["model.pooler.weight"]),
    "mark_tied_weights_as_initialized": lambda m: m.mark_tied_weights_as_initialized(None),
    "get_compiled_call": lambda m: m.get_compiled_call(None),
    "warn_if_padding_and_no_attention_mask": lambda m: m.warn_if_padding_and_no_attention_mask(
        torch.ones(1, 4, dtype=torch.long), None),
    "forward": lambda m: m.forward(**batch()),
}
# Public methods not called here, and why.
NOT_CALLED = {
    **dict.fromkeys(("push_to_hub", "save_pretrained", "from_pretrained", "save_distributed_checkpoint"),
                    "files and the Hub: saving and loading a held model is in tests/test_conformance.py"),
    **dict.fromkeys(("init_parallel_plans", "maybe_distribute_model", "prepare_distribute_model",
                     "gather_sharded_state_dict_for_save", "barrier_after_gathered_checkpoint_save",
                     "should_save_on_this_rank", "get_init_context"),
                    "tensor-parallel and distributed loading: a process group, never a held CPU model"),
    **dict.fromkeys(("load_adapter", "add_adapter", "set_adapter", "delete_adapter", "enable_adapters",
                     "disable_adapters", "active_adapters", "get_adapter_state_dict", "enable_peft_hotswap"),
                    "PEFT adapters: the peft package (not a test dependency); an adapter replaces modules, a change "
                    "the conformance battery holds every path to"),
    "to_empty": "leaves uninitialised memory: no answer to compare",
    "compile": "torch.compile of the whole model: the conformance battery's 'compiled' row",
    "loss_function": "the loss of outputs and labels, no state of the model",
}


def _seeded(cls, *shape):
    torch.manual_seed(3)
    return cls(*shape)


def _outcome_of(call, model):
    """(what `call(model)` returned, or the exception it raised; the model's answer after it, or its exception)."""
    try:
        returned = call(model)
    except Exception as error:  # noqa: BLE001  (whatever it raises is the finding)
        returned = error
    try:
        with torch.inference_mode():
            answered = model(**batch()).logits
    except Exception as error:  # noqa: BLE001
        answered = error
    return returned, answered


def _assert_same(got, want, where: str):
    """`got` (the held model's) as `want` (the plain one's), where both are plain values or tensors; other objects
    (modules, generators, bound methods) are the same kind of thing."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert_close(got.float(), want.float(), dtype=want.dtype if want.is_floating_point() else None, msg=where)
    elif isinstance(want, dict) and all(isinstance(value, torch.Tensor) for value in want.values()):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_same(got[key], want[key], f"{where}[{key}]")
    elif want is None or isinstance(want, (bool, int, float, str, torch.dtype, torch.device)):
        assert got == want, f"{where}: {got!r} != {want!r}"
    else:
        assert isinstance(got, type(want)) or isinstance(want, type(got)), f"{where}: {got!r} / {want!r}"


def test_every_public_attribute_and_method_answers_or_refuses_by_name(held, graphs, engine_only):
    """What a user or a library asks of a model whose body an engine holds: each public attribute reads as the
    plain model's, and each public method either does what it does to the plain model (its return value and the
    model's answers after it the same) or refuses, there or at the next call, naming the engine and the call that
    gives the weights back. A method transformers or torch adds must be listed here (called with arguments, or not
    called, and why)."""
    _, name = remove(held)
    torch.manual_seed(0)
    plain = VanillaEncoderForSequenceClassification(VanillaEncoderConfig(**CONFIG)).eval()
    model = hold(copy.deepcopy(plain), held, graphs)
    public = sorted(attribute for attribute in dir(plain) if not attribute.startswith("_"))
    methods = [attribute for attribute in public if callable(getattr(type(plain), attribute, None))
               and not isinstance(getattr(type(plain), attribute), type)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # is_gradient_checkpointing: deprecated in transformers 5
        for attribute in set(public) - set(methods):
            _assert_same(getattr(model, attribute), getattr(plain, attribute), attribute)
    for method in methods:
        if method in NOT_CALLED:
            continue
        call = CALLED_WITH.get(method, lambda m, method=method: getattr(m, method)())
        ours, theirs = copy.deepcopy(model), copy.deepcopy(plain)
        (returned, answered), (returned_plain, answered_plain) = _outcome_of(call, ours), _outcome_of(call, theirs)
        for got, want, when in ((returned, returned_plain, "returned"), (answered, answered_plain, "answer after")):
            where = f"{method}(): {when}"
            if isinstance(got, Exception) and not isinstance(want, Exception):
                assert re.search(rf"is refused: runtime='{held}' holds .*{name}\(model\)", str(got)), \
                    f"{where}: {got!r}"
            elif isinstance(want, Exception):
                assert isinstance(got, Exception), f"{where}: {got!r} where the plain model raised {want!r}"
            else:
                _assert_same(got, want, where)
