"""GPU checks (marked `gpu`: skipped with a reason where CUDA is absent; the FSDP test also needs two GPUs). Run them
on a GPU machine with `python -m pytest -m gpu -rs tests/test_gpu.py` and record the figures (with
`python benchmarks/gpu.py`) in docs/accelerate.md.

What they claim, on every GPU visible:
- `device_map="auto"` places the model on the GPU, and `device_map="balanced"` spreads it over every visible GPU,
  cutting only between layers, with the logits of a single-device run;
- on the same weights, ours equals transformers' BERT in fp32 (TF32 off; eager and sdpa attention), and in bf16 and
  fp16 stays within the rule of tests/numerics.py of BERT in fp32, as BERT's own half-precision run does;
- in bf16, a padded batch of many lengths attends in one flash-attention call per layer (packing.one_kernel_call)
  and answers as the calls per length do, forward and backward;
- `generate()` on the GPU gives the CPU's tokens (fp32, greedy and beam search) and runs in bf16;
- benchmarks/gpu.py (padded-batch speed-up in bf16 and fp32, TFLOP/s) runs and its outputs pass its checks;
- FSDP2 over NCCL on two GPUs follows the one-GPU loss curve (examples/train_accelerate.py --fsdp), and a bf16
  FSDP run trains.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from numerics import assert_close
from test_accelerate import launch
from transformers import BertConfig, BertForMaskedLM

from hf_vanilla.conversion.formats.bert import bert_to_vanilla
from hf_vanilla.conversion.parity import verification_batch
from hf_vanilla import (
    VanillaEncoderConfig,
    VanillaEncoderForMaskedLM,
    VanillaSeq2SeqConfig,
    VanillaSeq2SeqForConditionalGeneration,
)

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
INSIDE_A_LAYER = re.compile(r"layers\.\d+\.")


@pytest.fixture
def no_tf32():
    """fp32 on Ampere and later GPUs may silently run products in TF32 (10-bit mantissa); these checks mean fp32."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def bert_pair(tmp_path_factory):
    """(saved BERT folder, BERT, ours converted from the same tensors, ours saved), all on CPU in fp32."""
    torch.manual_seed(0)
    reference = BertForMaskedLM(BertConfig(num_hidden_layers=4)).eval()
    path = tmp_path_factory.mktemp("bert")
    reference.save_pretrained(path / "bert")
    ours = bert_to_vanilla(dict(reference.state_dict()), reference.config.to_dict(), "masked-lm").eval()
    ours.save_pretrained(path / "ours")
    return path / "bert", reference, ours, path / "ours"


def gpu_batch(config, device="cuda"):
    batch = {k: v.to(device) for k, v in verification_batch(config).items()}
    return batch, batch["attention_mask"].bool()


def dispatched(model) -> dict:
    """transformers' `hf_device_map`: module -> device, which it sets only where accelerate dispatched the model over
    several devices (transformers 5.17 sets none for a model all on one GPU); {} where it set none."""
    return getattr(model, "hf_device_map", {})


def test_device_map_auto_places_the_model_on_the_gpu(bert_pair):
    _, _, ours, saved = bert_pair
    loaded = type(ours).from_pretrained(saved, device_map="auto")
    assert {tensor.device for tensor in loaded.state_dict().values()} == {torch.device("cuda:0")}
    assert set(dispatched(loaded).values()) <= {0}


def test_balanced_device_map_uses_every_gpu_and_cuts_only_between_layers(bert_pair, no_tf32):
    _, _, ours, saved = bert_pair
    gpus = torch.cuda.device_count()
    loaded = type(ours).from_pretrained(saved, device_map="balanced")
    placed = {tensor.device.index for tensor in loaded.state_dict().values()}
    assert placed == set(range(gpus)), f"{gpus} GPUs visible, model placed on {placed}: {dispatched(loaded)}"
    assert not [key for key in dispatched(loaded) if INSIDE_A_LAYER.search(key)], dispatched(loaded)
    batch, mask = gpu_batch(ours.config, "cuda:0")
    single = type(ours).from_pretrained(saved).to("cuda:0").eval()
    with torch.no_grad():
        expected, actual = single(**batch).logits, loaded(**batch).logits
    assert_close(actual.to("cuda:0")[mask], expected[mask])  # the same kernels per layer; only copies in between


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_fp32_parity_with_bert_on_gpu(bert_pair, attn_implementation, no_tf32):
    path, _, ours, saved = bert_pair
    reference = BertForMaskedLM.from_pretrained(path, attn_implementation=attn_implementation).cuda().eval()
    ours = type(ours).from_pretrained(saved, attn_implementation=attn_implementation).cuda().eval()
    batch, mask = gpu_batch(ours.config)
    with torch.no_grad():
        expected = reference(**batch, output_hidden_states=True)
        actual = ours(**batch, output_hidden_states=True)
    for layer, (ref, out) in enumerate(zip(expected.hidden_states, actual.hidden_states, strict=True)):
        assert_close(out[mask], ref[mask], msg=f"hidden states {layer}")
    assert_close(actual.logits[mask], expected.logits[mask])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_parity_with_bert_on_gpu(bert_pair, dtype, no_tf32):
    path, _, _, saved = bert_pair
    reference = BertForMaskedLM.from_pretrained(path).cuda().eval()
    reference_half = BertForMaskedLM.from_pretrained(path, dtype=dtype).cuda().eval()
    ours_half = type(bert_pair[2]).from_pretrained(saved, dtype=dtype).cuda().eval()
    batch, mask = gpu_batch(ours_half.config)
    with torch.no_grad():
        expected = reference(**batch).logits[mask]
        ours_logits = ours_half(**batch).logits[mask]
        bert_logits = reference_half(**batch).logits[mask]
    assert ours_logits.dtype == dtype and torch.isfinite(ours_logits).all()
    bert_error = (bert_logits.float() - expected).abs().max().item()
    assert_close(ours_logits, expected, dtype=dtype, msg=f"ours (BERT's own {dtype} run is off by {bert_error:.1e})")


@pytest.mark.parametrize("family", ["encoder", "seq2seq"])
def test_many_lengths_attend_in_one_call_per_layer_in_half_precision(family, monkeypatch):
    """In bfloat16 under sdpa, a right-padded batch of many lengths runs flash attention's varlen kernel once per
    attention layer (`packing.one_kernel_call`), forward and backward, and answers as the calls per length do (the
    CPU's path), within the bf16 rule: an encoder's self-attention; a decoder's causal self-attention and its
    cross-attention to sources of other lengths."""
    from hf_vanilla import packing

    one_call, calls = packing.attention_in_one_call, []
    monkeypatch.setattr(packing, "attention_in_one_call",
                        lambda *args, **kwargs: calls.append(1) or one_call(*args, **kwargs))
    torch.manual_seed(0)
    if family == "encoder":
        model = small_encoder()
        layers = model.config.num_hidden_layers
    else:
        model = small_seq2seq()
        layers = model.config.num_hidden_layers + 2 * model.config.decoder_layers
    model = model.to("cuda", torch.bfloat16).eval()  # eval: no dropout; gradients still flow
    sources, targets = [5, 9, 13, 17, 7, 11], [4, 8, 6, 10, 3, 12]
    ids = torch.randint(5, model.config.vocab_size, (len(sources), max(sources)), device="cuda")
    mask = (torch.arange(max(sources), device="cuda")[None] < torch.tensor(sources, device="cuda")[:, None]).long()
    labels = ids if family == "encoder" else torch.randint(5, 300, (len(targets), max(targets)), device="cuda")
    keep = mask.bool() if family == "encoder" else (torch.arange(max(targets), device="cuda")[None]
                                                     < torch.tensor(targets, device="cuda")[:, None])
    labels = labels.masked_fill(~keep, -100)

    def step():
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        return out.logits[keep].float(), {name: p.grad.float() for name, p in model.named_parameters()
                                          if p.grad is not None}

    logits, gradients = step()
    assert len(calls) == layers, f"{len(calls)} one-call attentions for {layers} attention layers"
    monkeypatch.setattr(packing, "one_kernel_call", lambda *args: False)
    expected_logits, expected_gradients = step()
    assert_close(logits, expected_logits, dtype=torch.bfloat16, msg="logits at real tokens")
    for name, gradient in expected_gradients.items():
        assert_close(gradients[name], gradient, dtype=torch.bfloat16, msg=f"gradient of {name}")


def small_encoder():
    return VanillaEncoderForMaskedLM(VanillaEncoderConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2,
                                                          num_attention_heads=4, intermediate_size=128))


def small_seq2seq():
    torch.manual_seed(0)
    return VanillaSeq2SeqForConditionalGeneration(VanillaSeq2SeqConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, decoder_layers=2, num_attention_heads=4,
        intermediate_size=128)).eval()


@pytest.mark.parametrize("options", [{"num_beams": 1}, {"num_beams": 3}], ids=["greedy", "beam"])
def test_generate_on_gpu_matches_cpu(options, no_tf32):
    model = small_seq2seq()
    input_ids = torch.randint(3, 300, (4, 10), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0
    on_cpu = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False, **options)
    model.cuda()
    on_gpu = model.generate(input_ids.cuda(), attention_mask=attention_mask.cuda(), max_new_tokens=12,
                            do_sample=False, **options)
    assert torch.equal(on_cpu, on_gpu.cpu())


def test_generate_in_bf16_on_gpu():
    model = small_seq2seq().to("cuda", torch.bfloat16)
    input_ids = torch.randint(3, 300, (4, 10), generator=torch.Generator().manual_seed(1)).cuda()
    generated = model.generate(input_ids, max_new_tokens=12, do_sample=False, num_beams=2)
    assert generated.shape[0] == 4 and 1 < generated.shape[1] <= 13
    assert ((generated >= 0) & (generated < 300)).all()


def test_gpu_benchmark_runs_and_its_checks_pass():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--quick", "--batch", "16"],
                            capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = re.findall(r"^\| (dense|uniform|long-tail) \| (bf16|fp32) \|", result.stdout, flags=re.M)
    assert len(rows) == 6, result.stdout  # three cases in bf16 and fp32


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"FSDP across GPUs needs at least 2; {torch.cuda.device_count()} visible")
@pytest.mark.parametrize("task", ["classification", "seq2seq"])
def test_fsdp_on_two_gpus_follows_the_one_gpu_loss_curve(task, tmp_path):
    common = ["--task", task, "--steps", "6", "--grad-accum", "2", "--dropout", "0", "--mixed-precision", "no"]
    for args, processes in ((["--batch-size", "8", "--output", str(tmp_path / "one")], 1),
                            (["--batch-size", "4", "--fsdp", "sharded", "--output", str(tmp_path / "fsdp")], 2),
                            (["--batch-size", "4", "--fsdp", "sharded", "--output", str(tmp_path / "bf16"),
                              "--mixed-precision", "bf16"], 2)):
        result = launch("train_accelerate.py", *common, *args, processes=processes)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one, fsdp, bf16 = (json.loads((tmp_path / run / "losses.json").read_text()) for run in ("one", "fsdp", "bf16"))
    assert_close(torch.tensor(fsdp), torch.tensor(one), dtype=torch.float32)
    assert all(map(torch.isfinite, torch.tensor(bf16))) and len(bf16) == 6

