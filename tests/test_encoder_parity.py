"""The encoder equals transformers' BERT: every layer, every head, eager and sdpa, random and real weights.

Checkpoints are converted with the command line (`python -m conversion bert`, called in-process through
`conversion.__main__.main`), then loaded back with `AutoModel*.from_pretrained`, as a user would.

Comparisons are made at real tokens only. Our encoder has a padding-free fast path (used whenever a batch has
padding and no attention maps are requested): it runs the layers on the real tokens alone and writes zeros at
padding positions, by design, where BERT computes numbers nobody reads.
"""

import contextlib
import io
import json
import math

import pytest
import torch
import transformers
from numerics import assert_close
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForPreTraining, AutoTokenizer, BertConfig, BertForPreTraining

import hf_vanilla  # noqa: F401  (registers the Auto classes)
from hf_vanilla.conversion.cli import main
from hf_vanilla import VanillaEncoderConfig, VanillaEncoderModel
from hf_vanilla.masks import additive_mask

pytestmark = pytest.mark.parity
SENTENCE_PAIRS = [
    ("A man is playing a guitar.", "Someone is playing an instrument on a stage in front of a large crowd."),
    ("The weather is lovely today.", "It is sunny."),
    ("How do I convert a BERT checkpoint?", "Run the converter with the source and output directories."),
]


def convert(source, output, *args):
    """Run the CLI in-process; returns what it printed (its per-layer report)."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = main(["bert", "--source", str(source), "--output", str(output), *args])
    assert status == 0, stdout.getvalue()
    return stdout.getvalue()


def padded_pair_batch(vocab_size, lengths=(16, 11, 5), seed=0):
    """[CLS] a [SEP] b [SEP] rows of different lengths, right-padded, token types 0 then 1."""
    generator = torch.Generator().manual_seed(seed)
    T = max(lengths)
    input_ids = torch.zeros(len(lengths), T, dtype=torch.long)
    token_type_ids = torch.zeros_like(input_ids)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        input_ids[row, :length] = torch.randint(1000, vocab_size, (length,), generator=generator)
        split = length // 2
        input_ids[row, 0], input_ids[row, split], input_ids[row, length - 1] = 101, 102, 102  # [CLS] a [SEP] b [SEP]
        token_type_ids[row, split + 1:length] = 1
        attention_mask[row, :length] = 1
    return {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask}


def assert_matches(reference, ours, real=None, what="output"):
    """`ours` within the float32 rule of `reference` (tests/numerics.py), at real tokens when `real` is given."""
    assert_close(ours if real is None else ours[real], reference if real is None else reference[real], msg=what)


def assert_layers_match(reference, ours, real, what="hidden states"):
    """Every layer within the float32 rule at real tokens. Attention weights (B, H, T, S) are compared on the rows
    of real query tokens, over every key column (padded keys carry weight 0 in both)."""
    if what == "attention weights":
        reference, ours = [r.transpose(1, 2) for r in reference], [o.transpose(1, 2) for o in ours]  # (B, T, H, S)
    assert len(reference) == len(ours)
    for layer, (r, o) in enumerate(zip(reference, ours)):
        assert_matches(r, o, real, f"{what} {layer}")


# ---- bert-base shape, random weights ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert_base(tmp_path_factory):
    """A randomly initialised bert-base (12 layers, 768 wide, 30522 tokens), saved as the Hub's bert-base-uncased
    is: the pretraining model (MLM head, pooler and next-sentence head) labelled `BertForMaskedLM`. The converter
    recognises it and builds the pre-training head, so everything it holds is compared.
    Converted once with the CLI (which runs its own layer-by-layer check); returns (BERT dir, vanilla dir)."""
    root = tmp_path_factory.mktemp("bert_base")
    torch.manual_seed(0)
    BertForPreTraining(BertConfig(architectures=["BertForMaskedLM"])).save_pretrained(root / "bert")
    report = convert(root / "bert", root / "vanilla")
    assert "OK: max |diff|" in report
    return root / "bert", root / "vanilla"


# The sdpa models also run under the kernel variants (tests/kernel_variants.py): they are the suite's largest, and
# one attention backend is enough there.
@pytest.fixture(scope="module", params=["eager", pytest.param("sdpa", marks=pytest.mark.numerics)])
def bert_base_models(request, bert_base):
    """(transformers' BertForPreTraining, transformers' BertModel, ours), all loaded with the same attention."""
    attn = request.param
    bert_dir, vanilla_dir = bert_base
    reference = BertForPreTraining.from_pretrained(bert_dir, attn_implementation=attn).eval()
    reference_base = AutoModel.from_pretrained(bert_dir, attn_implementation=attn).eval()  # has the pooler
    ours = AutoModelForPreTraining.from_pretrained(vanilla_dir, attn_implementation=attn).eval()
    return attn, reference, reference_base, ours


def test_bert_base_every_layer_pooler_and_logits(bert_base_models):
    attn, reference, reference_base, ours = bert_base_models
    assert type(ours).__name__ == "VanillaEncoderForPreTraining" and ours.config._attn_implementation == attn
    batch = padded_pair_batch(ours.config.vocab_size)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        ref = reference(**batch, output_hidden_states=True)
        ref_pooled = reference_base(**batch).pooler_output
        out = ours(**batch, output_hidden_states=True)  # the packed fast path: padding rows are zeros
        pooled = ours.model(**batch).pooler_output
    assert len(out.hidden_states) == 13
    assert_layers_match(ref.hidden_states, out.hidden_states, real)
    assert (out.hidden_states[-1][~real] == 0).all()  # the fast path's padding, by design
    assert_matches(ref.prediction_logits, out.prediction_logits, real, "prediction logits")
    assert_matches(ref.seq_relationship_logits, out.seq_relationship_logits, what="next-sentence logits")
    assert_matches(ref_pooled, pooled, what="pooler")


def test_bert_base_attention_maps(bert_base_models, bert_base):
    """Attention maps come from the eager function whatever the backend (fused kernels never form them); asking
    for them takes the padded path, checked here layer by layer. (transformers' BERT under sdpa returns an empty
    tuple instead, so the reference is always its eager model.)"""
    attn, reference, _, ours = bert_base_models
    if attn != "eager":
        reference = BertForPreTraining.from_pretrained(bert_base[0], attn_implementation="eager").eval()
    batch = padded_pair_batch(ours.config.vocab_size)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        ref = reference(**batch, output_hidden_states=True, output_attentions=True)
        out = ours(**batch, output_hidden_states=True, output_attentions=True)
    assert len(out.attentions) == 12 and out.attentions[0].shape == (3, 12, 16, 16)
    assert_layers_match(ref.hidden_states, out.hidden_states, real)
    assert_layers_match(ref.attentions, out.attentions, real, "attention weights")
    assert_matches(ref.prediction_logits, out.prediction_logits, real, "prediction logits")


def test_bert_base_without_padding(bert_base_models):
    """A batch with no padding runs the dense path with no mask at all."""
    _, reference, _, ours = bert_base_models
    batch = padded_pair_batch(ours.config.vocab_size, lengths=(12, 12))
    with torch.no_grad():
        ref = reference(**batch, output_hidden_states=True)
        out = ours(**batch, output_hidden_states=True)
    assert_layers_match(ref.hidden_states, out.hidden_states, None)
    assert_matches(ref.prediction_logits, out.prediction_logits, what="prediction logits")


def test_bert_base_conversion_keeps_every_tensor(bert_base):
    """bert-base-uncased's layout converts to the pre-training head: pooler and next-sentence head included."""
    bert_dir, vanilla_dir = bert_base
    source = load_file(bert_dir / "model.safetensors")
    converted = load_file(vanilla_dir / "model.safetensors")
    # Every tensor arrives unchanged (the MLM decoder weight is tied to the embeddings, so is saved once).
    assert len(converted) == len(source)
    assert torch.equal(converted["model.pooler.weight"], source["bert.pooler.dense.weight"])
    assert torch.equal(converted["seq_relationship.weight"], source["cls.seq_relationship.weight"])
    assert torch.equal(converted["lm_head.decoder.bias"], source["cls.predictions.bias"])
    assert json.loads((vanilla_dir / "config.json").read_text())["architectures"] == ["VanillaEncoderForPreTraining"]
    masked_lm = AutoModelForMaskedLM.from_pretrained(vanilla_dir)  # the MLM head alone loads from it too
    assert masked_lm.model.pooler is None and torch.equal(masked_lm.lm_head.decoder.bias, converted["lm_head.decoder.bias"])


# ---- real weights: all-MiniLM-L6-v2 ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm(minilm_path, tmp_path_factory):
    vanilla_dir = tmp_path_factory.mktemp("minilm") / "vanilla"
    report = convert(minilm_path, vanilla_dir)
    assert "OK: max |diff|" in report and "layer 6" in report
    tokenizer = AutoTokenizer.from_pretrained(vanilla_dir)  # copied next to the weights by the converter
    first, second = zip(*SENTENCE_PAIRS)
    batch = dict(tokenizer(list(first), list(second), padding=True, return_tensors="pt"))
    return minilm_path, vanilla_dir, batch


@pytest.mark.numerics
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_minilm_real_sentences(minilm, attn):
    minilm_path, vanilla_dir, batch = minilm
    assert batch["token_type_ids"].any() and not batch["attention_mask"].all()  # two segments, padded
    real = batch["attention_mask"].bool()
    reference = AutoModel.from_pretrained(minilm_path, attn_implementation=attn).eval()
    ours = AutoModel.from_pretrained(vanilla_dir, attn_implementation=attn).eval()
    assert isinstance(ours, VanillaEncoderModel)
    with torch.no_grad():
        ref = reference(**batch, output_hidden_states=True, output_attentions=attn == "eager")
        packed = ours(**batch, output_hidden_states=True)
        assert_layers_match(ref.hidden_states, packed.hidden_states, real)
        assert_matches(ref.pooler_output, packed.pooler_output, what="pooler")
        if attn == "eager":
            padded = ours(**batch, output_hidden_states=True, output_attentions=True)
            assert_layers_match(ref.hidden_states, padded.hidden_states, real)
            assert_layers_match(ref.attentions, padded.attentions, real, "attention weights")
            assert_matches(ref.pooler_output, padded.pooler_output, what="pooler")


@pytest.mark.hub
def test_bert_base_uncased_from_the_hub(tmp_path):
    """The real bert-base-uncased: TF-era gamma/beta names, a pretraining checkpoint labelled BertForMaskedLM."""
    convert("bert-base-uncased", tmp_path / "vanilla")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "vanilla")
    first, second = zip(*SENTENCE_PAIRS)
    batch = dict(tokenizer(list(first), list(second), padding=True, return_tensors="pt"))
    real = batch["attention_mask"].bool()
    reference = AutoModelForMaskedLM.from_pretrained("bert-base-uncased", attn_implementation="eager").eval()
    ours = AutoModelForMaskedLM.from_pretrained(tmp_path / "vanilla", attn_implementation="eager").eval()
    with torch.no_grad():
        ref = reference(**batch, output_hidden_states=True, output_attentions=True)
        out = ours(**batch, output_hidden_states=True, output_attentions=True)
    assert_layers_match(ref.hidden_states, out.hidden_states, real)
    assert_layers_match(ref.attentions, out.attentions, real, "attention weights")
    assert_matches(ref.logits, out.logits, real, "logits")  # over 30k tokens they reach ~20: the rule scales


# ---- the teaching contrast: attention one head at a time ---------------------------------------------------------


def naive_multi_head_attention(attention, x, mask):
    """Multi-head attention as the tutorials write it: a loop over heads, each with its own slice of W^Q, W^K,
    W^V, then concatenation and W^O. x: (B, T, E); mask: (B, T) of 1 = token, 0 = padding."""
    H, D = attention.num_heads, attention.head_dim
    heads, weights = [], []
    for h in range(H):
        rows = slice(h * D, (h + 1) * D)  # head h owns these D output features of each projection
        q = x @ attention.q_proj.weight[rows].T + attention.q_proj.bias[rows]  # (B, T, D)
        k = x @ attention.k_proj.weight[rows].T + attention.k_proj.bias[rows]  # (B, T, D)
        v = x @ attention.v_proj.weight[rows].T + attention.v_proj.bias[rows]  # (B, T, D)
        scores = q @ k.transpose(1, 2) / math.sqrt(D)  # (B, T, T)
        scores = scores.masked_fill(mask[:, None, :] == 0, float("-inf"))  # no query looks at padding
        weights.append(torch.softmax(scores, dim=-1))
        heads.append(weights[-1] @ v)  # (B, T, D)
    context = torch.cat(heads, dim=-1)  # (B, T, H*D) = (B, T, E)
    return context @ attention.o_proj.weight.T + attention.o_proj.bias, torch.stack(weights, dim=1)


@pytest.mark.numerics
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_naive_loop_over_heads_equals_batched_attention(attn):
    torch.manual_seed(0)
    config = VanillaEncoderConfig(vocab_size=50, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=128, attn_implementation=attn)
    attention = VanillaEncoderModel(config).encoder.layers[0].self_attn.eval()
    with torch.no_grad():
        # Scores of a few units, so the softmax is far from uniform, and outputs of order 1.
        for projection, std in ((attention.q_proj, 0.15), (attention.k_proj, 0.15), (attention.v_proj, 0.1),
                                (attention.o_proj, 0.1)):
            torch.nn.init.normal_(projection.weight, std=std)
            torch.nn.init.normal_(projection.bias, std=std)
    x = torch.randn(3, 7, 64)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])
    with torch.no_grad():
        expected, expected_weights = naive_multi_head_attention(attention, x, mask)
        batched, weights = attention(x, attention_mask=additive_mask(mask[:, None, None, :], x.dtype))
    assert expected.abs().max() > 1 and expected_weights.max() > 0.5  # not two near-zero or near-uniform tensors
    assert_matches(expected, batched, what="attention output")
    if attn == "eager":
        assert_matches(expected_weights, weights, what="attention weights")
    else:
        assert weights is None  # fused kernels never form the weights

    # The model's padding-free path: real tokens laid end to end, attention within each sequence.
    real = mask.bool()
    with torch.no_grad():
        packed, _ = attention(x[real], seq_lens=mask.sum(1).tolist())  # (N, E)
    assert_matches(expected[real], packed, what="packed attention output")


# ---- heads ------------------------------------------------------------------------------------------------------

TINY = dict(vocab_size=1100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
            max_position_embeddings=64)

HEAD_CASES = {
    # BERT class -> (what --head auto picks, our class, the outputs to compare)
    "BertModel": ("VanillaEncoderModel", ("last_hidden_state", "pooler_output")),
    "BertForPreTraining": ("VanillaEncoderForPreTraining", ("prediction_logits", "seq_relationship_logits")),
    "BertForMaskedLM": ("VanillaEncoderForMaskedLM", ("logits",)),
    "BertLMHeadModel": ("VanillaEncoderForCausalLM", ("logits",)),
    "BertForNextSentencePrediction": ("VanillaEncoderForNextSentencePrediction", ("logits",)),
    "BertForMultipleChoice": ("VanillaEncoderForMultipleChoice", ("logits",)),
    "BertForSequenceClassification": ("VanillaEncoderForSequenceClassification", ("logits",)),
    "BertForTokenClassification": ("VanillaEncoderForTokenClassification", ("logits",)),
    "BertForQuestionAnswering": ("VanillaEncoderForQuestionAnswering", ("start_logits", "end_logits")),
}


def tiny_bert(directory, class_name, **fields):
    torch.manual_seed(0)
    labels = {"num_labels": 3} if class_name in ("BertForSequenceClassification", "BertForTokenClassification") else {}
    causal = {"is_decoder": True} if class_name == "BertLMHeadModel" else {}  # BERT's causal LM needs it said
    model = getattr(transformers, class_name)(BertConfig(**TINY, **labels, **causal, **fields))
    model.save_pretrained(directory)
    return directory


def auto_class_for(our_class_name):
    for auto, model in hf_vanilla.AUTO_CLASSES[VanillaEncoderConfig].items():
        if model.__name__ == our_class_name:
            return auto
    raise AssertionError(our_class_name)


@pytest.mark.numerics
@pytest.mark.parametrize("bert_class", list(HEAD_CASES))
def test_head_auto_conversion_matches_reference(bert_class, tmp_path):
    our_class, outputs = HEAD_CASES[bert_class]
    tiny_bert(tmp_path / "bert", bert_class)
    convert(tmp_path / "bert", tmp_path / "vanilla")  # --head auto: read from `architectures`
    config = json.loads((tmp_path / "vanilla" / "config.json").read_text())
    assert config["architectures"] == [our_class]
    auto = auto_class_for(our_class)
    reference = getattr(transformers, bert_class).from_pretrained(tmp_path / "bert").eval()
    ours = auto.from_pretrained(tmp_path / "vanilla").eval()
    assert type(ours).__name__ == our_class
    batch = padded_pair_batch(TINY["vocab_size"])
    real = batch["attention_mask"].bool()
    if bert_class == "BertForMultipleChoice":  # one question whose three choices are the rows: (1, 3, T)
        batch = {name: tensor[None] for name, tensor in batch.items()}
    with torch.no_grad():
        ref, out = reference(**batch), ours(**batch)
    for name in outputs:
        per_token = getattr(ref, name).shape[:2] == real.shape
        assert_matches(getattr(ref, name), getattr(out, name), real if per_token else None, name)
    if bert_class == "BertLMHeadModel":  # the causal LM generates BERT's tokens, greedy and beam, with its cache
        prompt = {"input_ids": batch["input_ids"][:1, :8], "attention_mask": batch["attention_mask"][:1, :8]}
        for num_beams in (1, 3):
            options = dict(prompt, max_new_tokens=8, do_sample=False, num_beams=num_beams, pad_token_id=0)
            with torch.no_grad():
                assert torch.equal(ours.generate(**options), reference.generate(**options)), num_beams


def test_explicit_head_overrides_architectures(tmp_path):
    tiny_bert(tmp_path / "bert", "BertForSequenceClassification")
    convert(tmp_path / "bert", tmp_path / "vanilla", "--head", "base")
    ours = AutoModel.from_pretrained(tmp_path / "vanilla")
    assert type(ours).__name__ == "VanillaEncoderModel" and ours.pooler is not None


def test_unknown_architecture_needs_explicit_head(tmp_path, capsys):
    tiny_bert(tmp_path / "bert", "BertModel")
    config = json.loads((tmp_path / "bert" / "config.json").read_text())
    (tmp_path / "bert" / "config.json").write_text(json.dumps(config | {"architectures": ["BertForFancyTask"]}))
    assert main(["bert", "--source", str(tmp_path / "bert"), "--output", str(tmp_path / "vanilla")]) == 2
    assert "BertForFancyTask" in capsys.readouterr().err and not (tmp_path / "vanilla").exists()
    convert(tmp_path / "bert", tmp_path / "vanilla", "--head", "base")


# ---- dtype ------------------------------------------------------------------------------------------------------


def test_bfloat16_output(tmp_path):
    tiny_bert(tmp_path / "bert", "BertForMaskedLM")
    convert(tmp_path / "bert", tmp_path / "vanilla", "--dtype", "bfloat16")
    tensors = load_file(tmp_path / "vanilla" / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "vanilla" / "config.json").read_text())["dtype"] == "bfloat16"
    ours = AutoModelForMaskedLM.from_pretrained(tmp_path / "vanilla").eval()
    assert ours.dtype == torch.bfloat16
    reference = transformers.BertForMaskedLM.from_pretrained(tmp_path / "bert").eval()
    batch = padded_pair_batch(TINY["vocab_size"])
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        ref, out = reference(**batch).logits, ours(**batch).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert_close(out.float()[real], ref[real], dtype=torch.bfloat16)  # weights and every op rounded to bfloat16
