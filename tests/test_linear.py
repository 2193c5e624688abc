"""`VanillaLinear`: nn.Linear, whose CPU float32 inference may run oneDNN's matmul.

Where oneDNN runs, the output must equal nn.Linear's within the float32 rule of tests/numerics.py (two kernels
summing in other orders); everywhere else (autograd, torch.func transforms and forward-mode AD, autocast, small
weights, other dtypes, tracing, deterministic mode) nn.Linear's own path must run, bit for bit. Which of the two
runs an eligible product is measured per shape (the "measure" policy): while it measures, the output is
F.linear's; then the faster kernel by at least MIN_GAIN runs, and a kernel that loses is never chosen.
The model-level proof is the bert-base parity tests (tests/test_encoder_parity.py): their 768-wide projections and
30522-word output layer run here, under `no_grad`, within the same rule of transformers' BERT.
"""

import pytest
import torch
from numerics import assert_close
from torch.nn import functional as F
from torch.profiler import profile

from hf_vanilla import kernels
from hf_vanilla.kernels import _ONEDNN, VanillaLinear

ONEDNN_OP = "mkldnn::_linear_pointwise"

pytestmark = [pytest.mark.skipif(not _ONEDNN, reason="this torch build has no oneDNN"), pytest.mark.numerics]
needs_onednn_on = pytest.mark.skipif(not torch.backends.mkldnn.enabled,
                                     reason="oneDNN is turned off (HF_VANILLA_ONEDNN=0, see tests/conftest.py)")


@pytest.fixture(autouse=True)
def fresh_decisions():
    kernels.forget_decisions()
    yield
    kernels.forget_decisions()


@pytest.fixture
def always_onednn(monkeypatch):
    monkeypatch.setattr(kernels, "POLICY", "onednn")


def layer(in_features=768, out_features=3072, bias=True):
    torch.manual_seed(0)
    linear = VanillaLinear(in_features, out_features, bias=bias)
    torch.nn.init.normal_(linear.weight, std=0.02)  # BERT's initialiser: outputs of order 1
    return linear


def ops_of(run):
    with profile() as prof:
        output = run()
    return output, {event.key for event in prof.key_averages()}


@needs_onednn_on
@pytest.mark.parametrize("shape", [(16, 768), (2, 9, 768), (1, 768), (0, 768)], ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_runs_inference_and_matches_nn_linear(shape, bias, always_onednn):
    linear = layer(bias=bias)
    x = torch.randn(shape)
    with torch.inference_mode():
        output, ops = ops_of(lambda: linear(x))
        expected = F.linear(x, linear.weight, linear.bias)
    assert ONEDNN_OP in ops
    assert output.shape == expected.shape == (*shape[:-1], 3072)
    assert_close(output, expected)


def test_onednn_is_deterministic(always_onednn):
    linear, x = layer(), torch.randn(37, 768)
    with torch.inference_mode():
        assert torch.equal(linear(x), linear(x))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_input_takes_nn_linears_own_path():
    """torch.nested's strided tensors are plain Tensors that oneDNN's op refuses; F.linear takes them."""
    linear = layer()
    x = torch.nested.nested_tensor([torch.randn(3, 768), torch.randn(5, 768)])
    with torch.no_grad():
        output, ops = ops_of(lambda: linear(x))
        expected = F.linear(x, linear.weight, linear.bias)
    assert ONEDNN_OP not in ops
    for ours, theirs in zip(output.unbind(), expected.unbind(), strict=True):
        assert torch.equal(ours, theirs)


@needs_onednn_on
def test_transposed_input_and_tied_weight(always_onednn):
    """A non-contiguous input, and a weight shared with an embedding (the tied output layer), as in the models."""
    embedding = torch.nn.Embedding(30522, 768)
    torch.nn.init.normal_(embedding.weight, std=0.02)
    linear = VanillaLinear(768, 30522)
    linear.weight = embedding.weight
    x = torch.randn(768, 8).t()
    with torch.no_grad():
        output, ops = ops_of(lambda: linear(x))
    assert ONEDNN_OP in ops
    assert_close(output, F.linear(x, embedding.weight, linear.bias))


def autocast(linear, x):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return linear(x)


def onednn_off(linear, x):
    with torch.no_grad(), torch.backends.mkldnn.flags(enabled=False):
        return linear(x)


def bias_alone(linear, x):
    """Training the biases of a frozen model (BitFit): the input and the weight need no gradient, the bias does."""
    linear.weight.requires_grad_(False)
    return linear(x)


def forward_mode(linear, x):
    """A Jacobian-vector product under no_grad: the tangent must be nn.Linear's, not silently zero."""
    tangent = torch.randn_like(x)
    with torch.no_grad():
        output, jvp = torch.func.jvp(linear, (x,), (tangent,))
    assert_close(jvp, F.linear(tangent, linear.weight))
    return output


def vmapped(linear, x):
    with torch.no_grad():
        return torch.func.vmap(linear)(x)


def traced(linear, x):
    """What the TorchScript-based ONNX export records: the graph must hold aten::linear."""
    with torch.no_grad():
        graph = torch.jit.trace(linear, x, check_trace=False)
    assert "aten::linear" in str(graph.graph) and "mkldnn" not in str(graph.graph)
    return graph(x)


def deterministic(linear, x):
    """A measured choice may differ between runs; deterministic mode wants the same bits every run."""
    with torch.no_grad():
        previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            return linear(x)
        finally:
            torch.use_deterministic_algorithms(previous)


def blas(linear, x):
    kernels.POLICY = "blas"  # restored by the always_onednn fixture's monkeypatch
    with torch.no_grad():
        return linear(x)


@pytest.mark.parametrize(
    "case, run",
    [
        ("autograd", lambda linear, x: linear(x)),
        ("autograd, bias alone", bias_alone),
        ("autocast", autocast),
        ("forward-mode AD (jvp)", forward_mode),
        ("vmap", vmapped),
        ("small weight", lambda linear, x: VanillaLinear(64, 64)(x[:, :64])),
        ("bfloat16", lambda linear, x: linear.bfloat16()(x.bfloat16())),
        ("tracing (ONNX export)", traced),
        ("oneDNN turned off", onednn_off),
        ("deterministic algorithms", deterministic),
        ("policy blas", blas),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_everything_else_takes_nn_linears_own_path(case, run, always_onednn):
    linear, x = layer(), torch.randn(4, 768)
    output, ops = ops_of(lambda: run(linear, x))
    assert ONEDNN_OP not in ops, case
    reference = torch.nn.Linear(linear.in_features, linear.out_features, dtype=linear.weight.dtype)
    reference.load_state_dict(linear.state_dict())
    if case.startswith("autograd"):  # the gradients nn.Linear gives, of every parameter that asks for one
        reference.requires_grad_(False)
        for ours, theirs in zip(linear.parameters(), reference.parameters(), strict=True):
            theirs.requires_grad_(ours.requires_grad)
        output.sum().backward()
        reference(x).sum().backward()
        for ours, theirs in zip(linear.parameters(), reference.parameters(), strict=True):
            assert (ours.grad is None) == (theirs.grad is None)
            assert ours.grad is None or torch.equal(ours.grad, theirs.grad)
        assert linear.bias.grad is not None
    elif case == "autocast":
        assert output.dtype == torch.bfloat16
    elif case == "bfloat16":
        assert torch.equal(output, reference(x.bfloat16()))
    elif case == "vmap":
        assert torch.equal(output, vmapped(reference, x))
    elif case in ("tracing (ONNX export)", "oneDNN turned off", "forward-mode AD (jvp)", "deterministic algorithms",
                  "policy blas"):
        assert torch.equal(output, reference(x))


@needs_onednn_on
@pytest.mark.parametrize("faster", ["oneDNN", "F.linear"])
def test_measured_choice_keeps_the_faster_kernel(faster, monkeypatch, scripted_clock):
    """Under the default policy, a layer's first call (untimed: first reads of a weight and oneDNN's primitive
    creation are not the kernel's speed) and the next 2 x CALIBRATION_CALLS calls of a shape return F.linear's output
    bit for bit while both kernels are timed, alternately; then only the faster one runs. The clock is scripted
    (tests/conftest.py): the loser costs 11 ms a call on it, the winner 1 ms, whatever this machine is doing."""
    monkeypatch.setattr(kernels, "POLICY", "measure")  # the default, whatever HF_VANILLA_LINEAR_KERNEL says
    fast, slow = 1e-3, 11e-3
    monkeypatch.setattr(F, "linear", scripted_clock.costing(F.linear, fast if faster == "F.linear" else slow))
    monkeypatch.setattr(kernels, "_onednn_linear", scripted_clock.costing(kernels._onednn_linear,
                                                                         fast if faster == "oneDNN" else slow))
    linear, x = layer(), torch.randn(12, 768)
    key = (768, 3072, 16, torch.get_num_threads())
    with torch.inference_mode():
        expected = torch.ops.aten.linear(x, linear.weight, linear.bias)
        for _ in range(1 + 2 * kernels.CALIBRATION_CALLS):
            assert key not in kernels.decisions()
            assert torch.equal(linear(x), expected)
        assert kernels.decisions() == {key: faster == "oneDNN"}
        output, ops = ops_of(lambda: linear(x))
    assert (ONEDNN_OP in ops) == (faster == "oneDNN")
    assert_close(output, expected)


@needs_onednn_on
def test_calibration_leaves_the_layer_as_it_was(monkeypatch):
    """What calibration counts is kept beside the layer, not in it: runtimes/watch.py's check sees a module's
    attributes change after tracing (the ONNX Runtime engine then runs PyTorch, OpenVINO's compiles again), and a
    counter on the layer did that on every call."""
    monkeypatch.setattr(kernels, "POLICY", "measure")
    linear = layer()
    before = dict(vars(linear))
    with torch.inference_mode():
        for _ in range(1 + 2 * kernels.CALIBRATION_CALLS):
            linear(torch.randn(12, 768))
    assert kernels.decisions() and dict(vars(linear)) == before


def test_shapes_are_measured_apart(monkeypatch):
    """One decision per (in, out, rows rounded up to a power of two and capped, threads); tiny weights are never
    measured (oneDNN cannot win there)."""
    monkeypatch.setattr(kernels, "POLICY", "measure")
    with torch.inference_mode():
        for rows in (1, 9, 16, 5000):
            linear = layer(768, 64)
            for _ in range(1 + 2 * kernels.CALIBRATION_CALLS):
                linear(torch.randn(rows, 768))
        VanillaLinear(32, 32)(torch.randn(4, 32))
    threads = torch.get_num_threads()
    measured = {(768, 64, rows, threads) for rows in (1, 16, kernels.MAX_ROWS_BUCKET)}
    assert set(kernels.decisions()) == (measured if torch.backends.mkldnn.enabled else set())


@needs_onednn_on
def test_pinned_products_are_not_measured(monkeypatch):
    """Inside `kernels.pinned()` a product whose shape is still measured runs F.linear, bit for bit, untimed: no turn
    of the layer is taken, nothing is decided; a decided shape runs its decision there too; another thread is not
    pinned. (The engines time PyTorch's calls pinned: tests/test_runtime_choice.py.)"""
    import threading

    from hf_vanilla import measure

    monkeypatch.setattr(kernels, "POLICY", "measure")
    linear, x = layer(), torch.randn(12, 768)
    key = (768, 3072, 16, torch.get_num_threads())
    with torch.inference_mode():
        expected = torch.ops.aten.linear(x, linear.weight, linear.bias)
        timed = measure.timed_calls()
        with kernels.pinned():
            for _ in range(1 + 2 * kernels.CALIBRATION_CALLS):
                assert torch.equal(linear(x), expected)
            elsewhere = threading.Thread(target=torch.inference_mode()(linear), args=(x,))
            elsewhere.start()
            elsewhere.join()
        assert measure.timed_calls() == timed + 1 and not kernels.decisions()  # the other thread's call
        kernels.CHOICE.decide(key, True)
        with kernels.pinned():
            output, ops = ops_of(lambda: linear(x))
    assert ONEDNN_OP in ops
    assert_close(output, expected)
