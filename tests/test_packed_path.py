"""The encoder's padding-free path equals its padded eager path.

A padded batch without attention maps runs packed: the real tokens laid end to end, attention within each sequence
(neighbours of equal length in one kernel call). Asking for attention maps (eager) runs the padded path, the one
that is bit-exact with BERT. Both must agree at every real token of every layer within the float32 rule of
tests/numerics.py, whatever the padding looks like; padding positions of the packed path hold zeros.
"""

import pytest
import torch
from numerics import assert_close

from hf_vanilla import VanillaEncoderConfig, VanillaEncoderModel

pytestmark = pytest.mark.numerics
B, T = 7, 24


def masks():
    """name -> (attention_mask (B, T), token_type_ids or None). Rows 0-2 are full and neighbours (one run)."""
    lengths = torch.tensor([T, T, T, 13, 13, 1, 20])
    right = (torch.arange(T)[None, :] < lengths[:, None]).long()
    middle = right.clone()
    middle[0, 5:9] = 0  # a gap inside a sequence
    all_padding = right.clone()
    all_padding[5] = 0
    token_types = (torch.arange(T)[None, :] >= lengths[:, None] // 2).long() * right
    return {
        "right padding": (right, None),
        "left padding": (right.flip(1), None),
        "pads in the middle": (middle, None),
        "an all-padding row": (all_padding, None),
        "token types": (right, token_types),
    }


def tiny_model():
    torch.manual_seed(0)
    config = VanillaEncoderConfig(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64)
    model = VanillaEncoderModel(config).eval()
    with torch.no_grad():  # larger weights than the default init: attention far from uniform, outputs of order 1
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(std=0.15)
    return model


@pytest.fixture(scope="module", params=["tiny", "minilm"])
def model(request):
    """A tiny random encoder, and the real all-MiniLM-L6-v2 (a BERT) converted in memory."""
    if request.param == "tiny":
        return tiny_model()
    from transformers import BertModel

    from hf_vanilla.conversion.formats.bert import bert_to_vanilla

    bert = BertModel.from_pretrained(request.getfixturevalue("minilm_path"))
    return bert_to_vanilla(bert.state_dict(), bert.config.to_dict(), "base").eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("case", list(masks()))
def test_packed_equals_padded_eager(model, attn, case, packed_batches):
    attention_mask, token_type_ids = masks()[case]
    vocab = model.config.vocab_size
    input_ids = torch.randint(5, vocab, (B, T), generator=torch.Generator().manual_seed(1))
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                  output_hidden_states=True)

    # A row that starts with padding (left padding, an all-padding row) keeps the batch on the padded path, where
    # position 0, which the pooled heads read, is computed as transformers' BERT computes it.
    packs = bool(attention_mask[:, 0].all())
    with torch.no_grad():
        model.set_attn_implementation("eager")
        padded = model(**inputs, output_attentions=True)  # attention maps: the padded path
        assert not packed_batches
        model.set_attn_implementation(attn)
        packed = model(**inputs)
    assert bool(packed_batches) == packs, "packed exactly when every row starts with a real token"

    real = attention_mask.bool()
    assert len(padded.hidden_states) == len(packed.hidden_states) == model.config.num_hidden_layers + 1
    for layer, (expected, actual) in enumerate(zip(padded.hidden_states, packed.hidden_states)):
        assert expected[real].abs().max() > 0.1  # compares real numbers, not two near-zero tensors
        assert_close(actual[real], expected[real], msg=f"layer {layer} at real tokens")
        assert not packs or not actual[~real].any(), "padding positions of the packed path hold zeros"
    # A row of nothing but padding reads what each kernel gives a query with no key, as in transformers: eager
    # attention averages every value, sdpa returns zeros (tests/test_training_parity.py compares both with BERT).
    rows = attention_mask.any(-1)
    assert_close(packed.pooler_output[rows], padded.pooler_output[rows],
                 msg="pooler, every row with a token: one answer whatever the path")


def test_dense_batch_with_mask_of_ones_is_exact():
    """A mask of ones takes the plain path (no gather), so it equals the run without a mask bit for bit."""
    model = tiny_model()
    input_ids = torch.randint(5, 300, (3, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with_mask = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).last_hidden_state
        without = model(input_ids=input_ids).last_hidden_state
    assert torch.equal(with_mask, without)
