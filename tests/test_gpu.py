"""GPU checks (marked `gpu`: skipped with a reason where CUDA is absent). Run them on a GPU machine with
`python -m pytest -m gpu` and record the figures in docs/accelerate.md."""

import pytest
import torch
from numerics import assert_close
from transformers import BertConfig, BertForMaskedLM

from conversion.bert import bert_to_vanilla, verification_batch
from hf_vanilla import VanillaSeq2SeqConfig, VanillaSeq2SeqForConditionalGeneration

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def bert_pair(tmp_path_factory):
    torch.manual_seed(0)
    reference = BertForMaskedLM(BertConfig(num_hidden_layers=4)).eval()
    path = tmp_path_factory.mktemp("bert")
    reference.save_pretrained(path)
    config = reference.config.to_dict()
    ours = bert_to_vanilla(dict(reference.state_dict()), config, "masked-lm")
    return path, reference, ours


def test_device_map_auto_places_the_model_on_cuda(bert_pair, tmp_path):
    _, _, ours = bert_pair
    ours.save_pretrained(tmp_path)
    loaded = type(ours).from_pretrained(tmp_path, device_map="auto")
    assert set(loaded.hf_device_map.values()) == {0}
    assert loaded.lm_head.decoder.weight.device == torch.device("cuda:0")


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_fp32_parity_with_bert_on_gpu(bert_pair, attn_implementation):
    path, _, ours = bert_pair
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    reference = BertForMaskedLM.from_pretrained(path, attn_implementation=attn_implementation).cuda().eval()
    ours = ours.cuda().eval()
    ours.set_attn_implementation(attn_implementation)
    batch = {k: v.cuda() for k, v in verification_batch(ours.config).items()}
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = reference(**batch, output_hidden_states=True)
        actual = ours(**batch, output_hidden_states=True)
    for ref, out in zip(expected.hidden_states, actual.hidden_states, strict=True):
        assert_close(out[mask], ref[mask])
    assert_close(actual.logits[mask], expected.logits[mask])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_gpu_is_close_to_fp32_and_finite(bert_pair, dtype):
    _, reference, ours = bert_pair
    batch = {k: v.cuda() for k, v in verification_batch(ours.config).items()}
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        full = ours.cuda().float()(**batch).logits
        half = ours.to(dtype)(**batch).logits.float()
    ours.float()
    assert torch.isfinite(half).all()
    assert_close(half[mask], full[mask], dtype=dtype)  # the half-precision rule against fp32 on the same GPU


def test_generate_on_gpu_matches_cpu():
    torch.manual_seed(0)
    model = VanillaSeq2SeqForConditionalGeneration(VanillaSeq2SeqConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)).eval()
    input_ids = torch.randint(3, 300, (4, 10))
    on_cpu = model.generate(input_ids, max_new_tokens=12, num_beams=2)
    on_gpu = model.cuda().generate(input_ids.cuda(), max_new_tokens=12, num_beams=2)
    assert torch.equal(on_cpu, on_gpu.cpu())
