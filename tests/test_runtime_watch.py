"""The engines' check of the model at every call (hf_vanilla/runtimes/watch.py), on its own: every way torch's
nn.Module code changes a module is seen by the next check, though the check reads no module dict while nothing
changed (a count the modules' registries move when written, or asked for a name they lack); and the modules get
their own registries back when the watch is released. The engines' answers after each change are held to PyTorch's
in tests/test_conformance.py and tests/test_runtime_owned.py; this pins the mechanism under them, so that a torch
release that writes a module another way fails here, by name.
"""

import copy
import pickle
from collections import OrderedDict

import pytest
import torch
from torch import nn

from hf_vanilla import VanillaEncoderConfig, VanillaEncoderModel, transformer
from hf_vanilla.runtimes import watch
from hf_vanilla.runtimes.batches import Rules, made, module_output

CONFIG = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=64)


def _layer(model):
    return model.encoder.layers[0]


def _another_layer(model):
    return copy.deepcopy(model.encoder.layers[1])


CHANGES = {
    "a plain attribute set": lambda m: setattr(_layer(m).self_attn, "scaling", 1.0),
    "a plain attribute deleted": lambda m: delattr(_layer(m).self_attn, "scaling"),
    "a plain attribute added": lambda m: setattr(_layer(m).ffn, "act_fn", torch.relu),
    "model.train()": lambda m: m.train(),
    "one layer in training": lambda m: _layer(m).train(),
    "a forward hook": lambda m: _layer(m).register_forward_hook(lambda *args: None),
    "a forward pre-hook": lambda m: _layer(m).ffn.register_forward_pre_hook(lambda *args: None),
    "a module replaced": lambda m: setattr(m, "pooler", nn.Linear(32, 32)),
    "a Parameter assigned": lambda m: setattr(m.pooler, "weight", nn.Parameter(torch.zeros(32, 32))),
    "None in a bias's place": lambda m: setattr(m.pooler, "bias", None),
    "a tensor's memory replaced (.data =)": lambda m: setattr(m.pooler.weight, "data", torch.zeros(32, 32)),
    "a tensor laid out anew over its memory (.data = .t())": lambda m: setattr(m.pooler.weight, "data",
                                                                           m.pooler.weight.data.t()),
    "register_buffer": lambda m: _layer(m).register_buffer("extra", torch.zeros(1)),
    "register_parameter": lambda m: _layer(m).register_parameter("extra", nn.Parameter(torch.zeros(1))),
    "ModuleList.append": lambda m: m.encoder.layers.append(_another_layer(m)),
    "ModuleList.insert": lambda m: m.encoder.layers.insert(0, _another_layer(m)),
    "ModuleList item set": lambda m: m.encoder.layers.__setitem__(0, _another_layer(m)),
    "del layers[0]": lambda m: m.encoder.layers.__delitem__(0),
    "ModuleList.pop": lambda m: m.encoder.layers.pop(1),
    "__class__ reassigned": lambda m: setattr(_layer(m), "__class__", type("Sub", (type(_layer(m)),), {})),
    "a config field set": lambda m: setattr(m.config, "layer_norm_eps", 1e-5),
    "a config field asked per call": lambda m: setattr(m.config, "output_hidden_states", True),
}


@pytest.fixture
def model():
    torch.manual_seed(0)
    return VanillaEncoderModel(VanillaEncoderConfig(**CONFIG)).eval()


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_change_through_torch_is_seen_by_the_next_check(model, change):
    """Each change made through nn.Module's (or the config's) own code: the next check sees it, and until then the
    check compared no module dict (the count had not moved)."""
    seen = watch.Watch(model, [model.pooler.weight])
    try:
        assert seen.unchanged() and seen.changes == watch.CHANGES
        CHANGES[change](model)
        assert not seen.unchanged()
    finally:
        seen.release()


def test_a_patched_method_and_a_global_hook_are_seen(model, monkeypatch):
    """What no module registry sees: a method patched on a class of the model's own code, torch's global forward
    hooks."""
    seen = watch.Watch(model, [])
    try:
        monkeypatch.setattr(transformer.VanillaFeedForward, "forward", lambda self, x: x)
        assert not seen.unchanged()
        monkeypatch.undo()
        assert seen.unchanged()
        handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
        assert not seen.unchanged()
        handle.remove()
        assert seen.unchanged()
    finally:
        seen.release()


def test_a_hook_set_before_the_watch_is_seen_when_removed(model):
    """A hook registry holding hooks when the watch is made keeps its own dict (the handle that removes the hook
    holds it): every check compares everything then, and sees the hook go."""
    handle = _layer(model).register_forward_hook(lambda *args: None)
    seen = watch.Watch(model, [])
    try:
        assert seen.unchanged()
        handle.remove()
        assert not seen.unchanged()
    finally:
        seen.release()


def test_reads_move_nothing_and_registries_come_back_plain(model):
    """Reading the model (its weights, named_parameters, state_dict, a forward through it) leaves the count where it
    was, but for the reads of submodules (which ask their parent's `_parameters` for a name it lacks, and cost one
    comparison of everything); copies and pickles of a watched model hold plain registries; released, the model's
    modules have their plain registries again."""
    seen = watch.Watch(model, [])
    try:
        layer = _layer(model)
        before = watch.CHANGES
        _ = layer.ffn_norm.weight, layer.ffn_norm.bias
        [tensor.sum() for tensor in model.state_dict().values()]
        dict(model.named_parameters())
        model.get_input_embeddings()
        assert watch.CHANGES > before and seen.unchanged()  # a submodule read moved the count: compared, unchanged
        before = watch.CHANGES
        assert seen.unchanged() and watch.CHANGES == before and seen.changes == before
        for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert {type(vars(m)[name]) for m in other.modules() for name in watch._REGISTRIES} == {dict, OrderedDict}
    finally:
        seen.release()
    assert {type(vars(m)[name]) for m in model.modules() for name in watch._REGISTRIES} == {dict, OrderedDict}


def test_the_output_is_made_as_its_constructor_makes_it():
    """`batches.made` gives what the output class's constructor gives (the same objects as attributes and items, in
    order), and a class it cannot make so (one whose constructor does more) is made by its constructor."""
    hidden, pooled = torch.randn(2, 3, 4), torch.randn(2, 4)
    rules = Rules(99, 2, 64, False, False, True, True)
    for _ in range(2):  # the first call checks against the constructor, the second makes it alone
        output = module_output(rules, {"last_hidden_state": hidden.numpy(), "pooler_output": pooled.numpy()}, None)
        wanted = type(output)(last_hidden_state=output.last_hidden_state, pooler_output=output.pooler_output)
        assert watch_held(output) == watch_held(wanted) and output.to_tuple()[1] is output.pooler_output
    assert module_output(rules, {"last_hidden_state": hidden.numpy(), "pooler_output": pooled.numpy()},
                         return_dict=False)[0].data_ptr() == hidden.data_ptr()  # the engine's memory, no copy

    from dataclasses import dataclass

    from transformers.utils import ModelOutput

    @dataclass
    class Counted(ModelOutput):
        value: torch.Tensor | None = None

        def __post_init__(self):
            super().__post_init__()
            self.extra = "set by the constructor"

    assert made(Counted, {"value": hidden}).extra == made(Counted, {"value": hidden}).extra == "set by the constructor"


def watch_held(output):
    return type(output), [(k, id(v)) for k, v in vars(output).items()], [(k, id(v)) for k, v in output.items()]
