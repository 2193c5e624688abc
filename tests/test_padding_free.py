"""Padding-free for all three families: transformers' packed format, and padded batches in training.

1. transformers' padding-free format (`DataCollatorWithFlattening`: sequences end to end in one row, `position_ids`
   restarting, optionally `cu_seq_lens_q/k` + `max_length_q/k` or `seq_idx`) gives every sequence the answer it
   gets alone, forward and training step (loss and every gradient), for the encoder (base model, a token-level
   head), the decoder-only LM and the encoder-decoder (packed pairs), in every attention implementation, on the
   padding-free path and on the masked path that attention maps take. transformers' own sdpa `BertModel` fails the
   same check on the same weights: the check can fail.
2. A padded batch trains padding-free in the decoder-only LM and the encoder-decoder too (causal within each target,
   cross-attention to its own source), with the padded computation's loss and gradients.
3. transformers' own models on the same weights (BERT's heads, BART) give the same loss and gradients whatever the
   labelling: a loss that reads padding positions (extractive QA, labels at padding), packed pairs with BART's
   position offset, position_ids that are positions and not boundaries, packed sequences longer together than the
   position table.
All comparisons at the float32 rule of tests/numerics.py.
"""

import pytest
import torch
from numerics import assert_close
import transformers
from transformers import BartConfig, BertConfig, BertModel, DataCollatorWithFlattening

from hf_vanilla import (
    VanillaDecoderForCausalLM, VanillaEncoderConfig, VanillaEncoderForMaskedLM, VanillaEncoderForSequenceClassification,
    VanillaEncoderForTokenClassification, VanillaEncoderModel, VanillaSeq2SeqConfig,
    VanillaSeq2SeqForConditionalGeneration, VanillaSeq2SeqForQuestionAnswering, VanillaSeq2SeqForSequenceClassification,
)
from hf_vanilla.conversion.formats import bart
from hf_vanilla.conversion.formats.bert import bert_to_vanilla
from hf_vanilla.losses import shift_tokens_right

pytestmark = pytest.mark.numerics
ATTENTION = ["sdpa", "eager", "flex_attention"]
FORMATS = {"position_ids": {}, "flash kwargs": {"return_flash_attn_kwargs": True}, "seq_idx": {"return_seq_idx": True}}
LENGTHS = (5, 9, 3, 9, 1, 6)  # two of equal length (one kernel call), one of a single token
VOCAB = 300


def randomised(model):
    """Larger weights than the default init: attention far from uniform, outputs of order 1."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name.lower():  # ours and BART's "...norm...", BERT's "LayerNorm"
                parameter.normal_(std=0.15)
    return model


def encoder_config(**extra):
    return VanillaEncoderConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0, **extra)


def seq2seq_config():
    return VanillaSeq2SeqConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=128, decoder_layers=2, decoder_attention_heads=4,
                                decoder_intermediate_size=96, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                decoder_start_token_id=1)


def sequences(seed, lengths=LENGTHS):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(5, VOCAB, (n,), generator=generator) for n in lengths]


def restarting(rows):
    """(1, N) position_ids of `rows` laid end to end, each counting from 0 (packed pairs' layout)."""
    return torch.cat([torch.arange(len(row)) for row in rows])[None]


def flattened(rows, **collator_options):
    """`DataCollatorWithFlattening`'s batch of `rows`: (1, N) input_ids, labels, position_ids (and its options)."""
    return DataCollatorWithFlattening(**collator_options)([{"input_ids": row.tolist()} for row in rows])


def alone(model, attn, run):
    """`run()` (the sequences one at a time) under `attn`, or sdpa for flex_attention: transformers' flex function
    crashes on CPU with the (1, 1, T, T) causal mask of the padded decoder path (torch 2.13, before this change too)."""
    model.set_attn_implementation("sdpa" if attn == "flex_attention" else attn)
    try:
        return run()
    finally:
        model.set_attn_implementation(attn)


def trains(attn):
    """torch's FlexAttention has no backward on CPU ("FlexAttention does not support backward on CPU", torch 2.13):
    there the forward alone is checked."""
    return attn != "flex_attention" or torch.cuda.is_available()


def gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(actual, expected):
    assert actual.keys() == expected.keys()
    for name in expected:
        assert_close(actual[name], expected[name], msg=f"gradient of {name}")


def token_loss(logits, labels, causal):
    """Cross-entropy over the labelled positions, next-token (shifted) for a causal LM."""
    if causal:
        logits, labels = logits[:-1], labels[1:]
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100)


# ---- 1. transformers' packed format ------------------------------------------------------------------------------


def packed_model(family, attn):
    if family == "encoder":
        model = VanillaEncoderForTokenClassification(encoder_config(num_labels=VOCAB))
    else:
        model = VanillaDecoderForCausalLM(seq2seq_config())
    model = randomised(model).train()  # dropout 0: training mode, the mode a training step runs in
    model.set_attn_implementation(attn)
    return model


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("form", list(FORMATS))
@pytest.mark.parametrize("family", ["encoder", "decoder-only"])
def test_packed_format_gives_each_sequence_its_own_answer(family, form, attn):
    """Forward (logits at every token) and a training step (loss, every gradient) of the collator's batch equal the
    sequences run alone; the attention-maps path (masks instead of packing) agrees too."""
    model = packed_model(family, attn)
    rows = sequences(1)
    batch = flattened(rows, **FORMATS[form])
    labels = batch["labels"][0]  # -100 at each sequence's first token, as the collator separates them
    causal = family == "decoder-only"

    with torch.set_grad_enabled(trains(attn)):
        logits = alone(model, attn, lambda: torch.cat([model(input_ids=row[None]).logits[0] for row in rows]))
        out = model(**batch)
    assert_close(out.logits[0], logits.detach(), msg="packed logits against each sequence alone")
    assert_close(out.loss, token_loss(logits, labels, causal).detach(), msg="loss")
    if trains(attn):
        token_loss(logits, labels, causal).backward()
        expected_gradients = gradients(model)
        model.zero_grad()
        out.loss.backward()
        assert_same_gradients(gradients(model), expected_gradients)

    with torch.no_grad():  # attention maps: the padded path, each sequence kept to itself by its mask
        maps = model(**batch, output_attentions=True)
    assert_close(maps.logits[0], logits.detach(), msg="attention-maps path")
    starts = torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0)[:-1].tolist()])
    weights = maps.attentions[0][0, 0]  # (N, N): no weight across sequences
    for start, row in zip(starts.tolist(), rows):
        inside = weights[start:start + len(row)]
        assert torch.allclose(inside[:, start:start + len(row)].sum(-1), torch.ones(len(row)))


def test_packed_format_pools_each_sequence():
    """The base encoder's pooler_output holds one row per packed sequence, each its sequence's own."""
    model = randomised(VanillaEncoderModel(encoder_config())).eval()
    rows = sequences(2)
    batch = flattened(rows, return_flash_attn_kwargs=True)
    batch.pop("labels")
    with torch.no_grad():
        out = model(**batch)
        alone = [model(input_ids=row[None]) for row in rows]
    assert_close(out.last_hidden_state[0], torch.cat([a.last_hidden_state[0] for a in alone]))
    assert_close(out.pooler_output, torch.cat([a.pooler_output for a in alone]), msg="one pooled row per sequence")


@pytest.mark.parametrize("attn", ATTENTION)
def test_packed_pairs_train_each_pair_alone(attn):
    """The encoder-decoder on packed pairs (sources with position_ids restarting, targets with
    decoder_position_ids): logits, loss and gradients of each pair alone; target i reads source i only."""
    model = randomised(VanillaSeq2SeqForConditionalGeneration(seq2seq_config())).train()
    model.set_attn_implementation(attn)
    sources, targets = sequences(3), sequences(4, (4, 2, 7, 7, 3, 1))
    labels = torch.cat(targets)
    packed = dict(input_ids=torch.cat(sources)[None], position_ids=restarting(sources), labels=labels[None],
                  decoder_position_ids=restarting(targets))
    with torch.set_grad_enabled(trains(attn)):
        logits = alone(model, attn, lambda: torch.cat([model(input_ids=s[None], labels=t[None]).logits[0]
                                                       for s, t in zip(sources, targets)]))
        out = model(**packed)
    assert_close(out.logits[0], logits.detach(), msg="packed pairs against each pair alone")
    assert_close(out.loss, torch.nn.functional.cross_entropy(logits, labels).detach(), msg="loss")
    if trains(attn):
        torch.nn.functional.cross_entropy(logits, labels).backward()
        expected_gradients = gradients(model)
        model.zero_grad()
        out.loss.backward()
        assert_same_gradients(gradients(model), expected_gradients)
    with torch.no_grad():  # attention maps: masks keep each target to its own source
        maps = model(**packed, output_attentions=True)
    assert_close(maps.logits[0], logits.detach(), msg="attention-maps path")


def test_flex_attention_at_one_length_after_another():
    """Each call under flex_attention, at a new length each time, equals sdpa. Compilation starts afresh, so the
    second length recompiles with dynamic shapes: there torch 2.15's CPU kernel read the (B, H, T, D) views that
    attention hands it wrongly (max |diff| 1.6; hf_vanilla.compat.flex_attention_forward copies them)."""
    torch._dynamo.reset()
    model = randomised(VanillaEncoderModel(encoder_config())).eval()
    with torch.no_grad():
        for row in sequences(2, lengths=(5, 9, 3, 17)):
            model.set_attn_implementation("sdpa")
            expected = model(input_ids=row[None]).last_hidden_state
            model.set_attn_implementation("flex_attention")
            assert_close(model(input_ids=row[None]).last_hidden_state, expected, msg=f"length {len(row)}")


def test_transformers_sdpa_bert_fails_the_same_check():
    """The check above can fail: transformers' sdpa BertModel, given the collator's batch, lets the sequences attend
    to each other (it honours the format only with flash-attention); ours, on the same weights, does not."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, attn_implementation="sdpa")
    bert = randomised(BertModel(config)).eval()
    ours = bert_to_vanilla(bert.state_dict(), config.to_dict(), "base").eval()
    rows = sequences(5)
    batch = flattened(rows, return_flash_attn_kwargs=True)
    batch.pop("labels")
    with torch.no_grad():
        alone = torch.cat([bert(input_ids=row[None]).last_hidden_state[0] for row in rows])
        assert_close(torch.cat([ours(input_ids=row[None]).last_hidden_state[0] for row in rows]), alone)
        theirs = bert(**batch).last_hidden_state[0]
        assert_close(ours(**batch).last_hidden_state[0], alone, msg="ours: each sequence its own answer")
    with pytest.raises(AssertionError):
        assert_close(theirs, alone)


@pytest.mark.parametrize("head", [VanillaSeq2SeqForSequenceClassification, VanillaSeq2SeqForQuestionAnswering])
@pytest.mark.parametrize("given", ["position_ids", "cu_seq_lens_q"])
def test_encoder_decoder_heads_that_read_a_row_as_one_sequence_refuse_the_packed_format(head, given):
    """BART's classification and QA heads read each row as one sequence: a packed row is refused naming the padded
    batch, rather than classified (or searched for a span) as one sequence whose parts attend to each other."""
    batch = flattened(sequences(6), return_flash_attn_kwargs=True)
    model = head(seq2seq_config()).eval()
    ids = batch["input_ids"].clone()
    ids[0, -1] = model.config.eos_token_id
    refusal = f"reads each row as one sequence and takes no {given}.*DataCollatorWithPadding"
    with pytest.raises(ValueError, match=refusal):
        model(input_ids=ids, **{given: batch[given]})


def test_packed_format_refusals():
    """What cannot be honoured is refused, naming the fix; never attention across sequences."""
    rows = sequences(6)
    batch = flattened(rows, return_flash_attn_kwargs=True)
    classifier = VanillaEncoderForSequenceClassification(encoder_config(num_labels=2)).eval()
    with pytest.raises(ValueError, match="one \\[CLS\\] state per row.*DataCollatorWithPadding"):
        classifier(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    encoder = VanillaEncoderModel(encoder_config()).eval()
    with pytest.raises(ValueError, match="attention_mask and cu_seq_lens_q"):
        encoder(input_ids=batch["input_ids"], attention_mask=torch.ones_like(batch["input_ids"]),
                cu_seq_lens_q=batch["cu_seq_lens_q"])
    wrong = batch["cu_seq_lens_q"].clone()
    wrong[1] += 1
    with pytest.raises(ValueError, match="cu_seq_lens and position_ids mark different sequence boundaries"):
        encoder(input_ids=batch["input_ids"], position_ids=batch["position_ids"], cu_seq_lens_q=wrong)
    with pytest.raises(ValueError, match="cu_seq_lens must run from 0 up to the"):
        encoder(input_ids=batch["input_ids"], cu_seq_lens_q=batch["cu_seq_lens_q"][:-1])
    seq2seq = VanillaSeq2SeqForConditionalGeneration(seq2seq_config()).eval()
    with pytest.raises(ValueError, match="position_ids \\(sources\\) and decoder_position_ids"):
        seq2seq(input_ids=batch["input_ids"], labels=batch["input_ids"], cu_seq_lens_q=batch["cu_seq_lens_q"])
    with pytest.raises(ValueError, match="Packed sequences on one side only"):
        seq2seq(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["input_ids"][:, :4])


def test_cu_seq_lens_alone_give_positions():
    """With only the flash keywords (no position_ids), each packed sequence counts its positions from 0."""
    model = randomised(VanillaEncoderModel(encoder_config())).eval()
    rows = sequences(7)
    batch = flattened(rows, return_flash_attn_kwargs=True)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], cu_seq_lens_q=batch["cu_seq_lens_q"],
                    cu_seq_lens_k=batch["cu_seq_lens_k"], max_length_q=batch["max_length_q"])
        alone = torch.cat([model(input_ids=row[None]).last_hidden_state[0] for row in rows])
    assert_close(out.last_hidden_state[0], alone)


# ---- 2. padded batches train padding-free ------------------------------------------------------------------------


def padded(rows, pad, side_value=None):
    """(B, T) right-padded ids and 1/0 mask; `side_value` fills the padding instead of `pad` (labels: -100)."""
    T = max(len(row) for row in rows)
    ids = torch.full((len(rows), T), pad if side_value is None else side_value)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = row
    mask = (torch.arange(T)[None] < torch.tensor([len(row) for row in rows])[:, None]).long()
    return ids, mask


def training_step(model, attn, **inputs):
    """The outputs, and every gradient of the loss (None where `trains` says the backward cannot run)."""
    model.zero_grad()
    with torch.set_grad_enabled(trains(attn)):
        out = model(**inputs)
    if not trains(attn):
        return out, None
    out.loss.backward()
    return out, gradients(model)


@pytest.mark.parametrize("attn", ATTENTION)
def test_decoder_only_trains_padding_free_on_padded_batches(attn, packed_batches):
    model = randomised(VanillaDecoderForCausalLM(seq2seq_config())).train()
    model.set_attn_implementation(attn)
    input_ids, mask = padded(sequences(8), pad=0)
    labels = input_ids.masked_fill(mask == 0, -100)  # as DataCollatorForLanguageModeling(mlm=False) labels them
    expected, expected_gradients = training_step(model, attn, input_ids=input_ids, attention_mask=mask,
                                                 labels=labels, output_attentions=True)  # maps: the padded path
    assert not packed_batches
    out, actual_gradients = training_step(model, attn, input_ids=input_ids, attention_mask=mask, labels=labels)
    assert packed_batches, "a padded batch with labels runs padding-free"
    real = mask.bool()
    assert_close(out.logits[real], expected.logits[real].detach(), msg="logits at real tokens")
    assert_close(out.loss, expected.loss.detach(), msg="loss")
    if trains(attn):
        assert_same_gradients(actual_gradients, expected_gradients)


@pytest.mark.parametrize("attn", ATTENTION)
def test_seq2seq_trains_padding_free_on_padded_batches(attn, packed_batches):
    """Sources right-padded (attention_mask), targets padded with -100 (DataCollatorForSeq2Seq, no decoder mask):
    each target attends causally within itself and to its own source's real tokens; the loss and gradients are the
    padded computation's."""
    model = randomised(VanillaSeq2SeqForConditionalGeneration(seq2seq_config())).train()
    model.set_attn_implementation(attn)
    source, source_mask = padded(sequences(9), pad=0)
    labels, _ = padded(sequences(10, (4, 2, 7, 7, 3, 1)), pad=0, side_value=-100)
    decoder_input_ids = shift_tokens_right(labels, 0, 1)
    expected, expected_gradients = training_step(  # the padded computation: every target position, no decoder mask
        model, attn, input_ids=source, attention_mask=source_mask, decoder_input_ids=decoder_input_ids,
        labels=labels, output_attentions=True)
    assert not packed_batches
    out, actual_gradients = training_step(model, attn, input_ids=source, attention_mask=source_mask, labels=labels)
    assert len(packed_batches) == 3, "the encoder, and the decoder's targets and sources, run padding-free"
    labelled = labels != -100
    assert_close(out.logits[labelled], expected.logits[labelled].detach(), msg="logits at labelled positions")
    assert_close(out.loss, expected.loss.detach(), msg="loss")
    if trains(attn):
        assert_same_gradients(actual_gradients, expected_gradients)


def test_masked_lm_scores_the_real_tokens_alone(packed_batches):
    """The output projection runs on the real tokens alone where the body ran padding-free (token_logits), and the
    loss reads them: the padded path's logits at real tokens, its loss and every gradient."""
    model = randomised(VanillaEncoderForMaskedLM(encoder_config())).train()
    input_ids, mask = padded(sequences(11), pad=0)
    labels = input_ids.masked_fill((mask == 0) | (torch.arange(input_ids.shape[1]) % 3 != 1), -100)
    expected, expected_gradients = training_step(model, "sdpa", input_ids=input_ids, attention_mask=mask,
                                                 labels=labels, output_attentions=True)
    assert not packed_batches
    out, actual_gradients = training_step(model, "sdpa", input_ids=input_ids, attention_mask=mask, labels=labels)
    assert packed_batches
    real = mask.bool()
    assert_close(out.logits[real], expected.logits[real].detach(), msg="logits at real tokens")
    assert_close(out.loss, expected.loss.detach(), msg="loss")
    assert_same_gradients(actual_gradients, expected_gradients)


# ---- 3. transformers' answer, on the same weights ----------------------------------------------------------------


def bert_pair(head, model_class, attn="sdpa", **fields):
    """A randomised transformers BERT `model_class` and ours converted from it (`head`), sharing its tensors; both in
    training mode (dropout 0), the mode a training step runs in."""
    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation=attn, **fields)
    reference = randomised(model_class(config)).train()
    ours = bert_to_vanilla(reference.state_dict(), config.to_dict(), head).train()
    ours.set_attn_implementation(attn)
    return reference, ours


def bart_pair(class_name, attn="sdpa", **fields):
    """A randomised transformers BART `class_name` (BART's ids: padding 1, decoder start 2; positions offset by 2)
    and ours converted from it, sharing its tensors; both in training mode (dropout 0)."""
    config = BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=96, max_position_embeddings=64,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, attn_implementation=attn, **fields)
    reference = randomised(getattr(transformers, class_name)(config)).train()
    ours = bart.FORMAT.to_vanilla(reference.state_dict(), config.to_dict(), class_name).train()
    ours.set_attn_implementation(attn)
    return reference, ours


def backward(model, **inputs):
    """A training step's forward and backward, from zeroed gradients; returns the outputs."""
    model.zero_grad()
    out = model(**inputs)
    out.loss.backward()
    return out


def assert_reference_gradients(ours, reference, renamed=None):
    """Every gradient of ours equals the reference's for the same parameter. The conversion shares the reference's
    tensors, so each of ours is found by its storage; `renamed` names the counterparts of the few it copies (ours ->
    reference name). Every reference parameter with a gradient is compared."""
    theirs = {p.data_ptr(): name for name, p in reference.named_parameters()}
    reference_parameters = dict(reference.named_parameters())
    compared = set()
    for name, parameter in ours.named_parameters():
        if parameter.grad is None:
            continue
        counterpart = (renamed or {}).get(name) or theirs[parameter.data_ptr()]
        assert_close(parameter.grad, reference_parameters[counterpart].grad, msg=f"gradient of {name} ({counterpart})")
        compared.add(counterpart)
    assert compared == {name for name, p in reference.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_question_answering_trains_on_bert_loss(attn, packed_batches):
    """Extractive QA's loss is a softmax over every position, padding included, each scored from its own state (a
    padding position attends to its row's real tokens): with positions to score, a right-padded batch runs padded,
    to BertForQuestionAnswering's loss, logits at every position and gradients. Without them it runs padding-free."""
    reference, ours = bert_pair("question-answering", transformers.BertForQuestionAnswering, attn)
    input_ids, mask = padded(sequences(12), pad=0)
    spans = dict(start_positions=torch.tensor([1, 0, 2, 5, 0, 3]), end_positions=torch.tensor([3, 8, 2, 8, 0, 5]))
    expected = backward(reference, input_ids=input_ids, attention_mask=mask, **spans)
    out = backward(ours, input_ids=input_ids, attention_mask=mask, **spans)
    assert not packed_batches
    assert_close(out.loss, expected.loss.detach(), msg="loss")
    for name in ("start_logits", "end_logits"):  # padding included: the loss's softmax reads every position
        assert_close(getattr(out, name), getattr(expected, name).detach(), msg=name)
    assert_reference_gradients(ours, reference)
    with torch.no_grad():
        ours(input_ids=input_ids, attention_mask=mask)
    assert packed_batches, "without positions to score, a padded batch runs padding-free"


MLM_BIAS = {"lm_head.decoder.bias": "cls.predictions.bias"}  # the one tensor the conversion copies (untied)
ENCODER_HEADS = {  # converter head -> (transformers class, its config fields, our copied tensors, more inputs)
    "token-classification": ("BertForTokenClassification", {"num_labels": 5}, {}, {}),
    "masked-lm": ("BertForMaskedLM", {}, MLM_BIAS, {}),
    "causal-lm": ("BertLMHeadModel", {"is_decoder": True}, MLM_BIAS, {}),
    "pretraining": ("BertForPreTraining", {}, MLM_BIAS, {"next_sentence_label": torch.tensor([0, 1, 1, 0, 1, 0])}),
}


@pytest.mark.parametrize("head", list(ENCODER_HEADS))
def test_labelled_padding_is_scored_as_bert_scores_it(head, packed_batches):
    """Labels at padding positions that are not -100 (labels=input_ids; a class at every position) are scored as
    transformers scores them, from the states the padded computation gives padding positions: such a batch runs
    padded. With -100 at padding it runs padding-free, to the same loss and gradients as transformers."""
    class_name, fields, renamed, more = ENCODER_HEADS[head]
    reference, ours = bert_pair(head, getattr(transformers, class_name), **fields)
    input_ids, mask = padded(sequences(13), pad=0)
    labels = input_ids
    if head == "token-classification":
        labels = torch.randint(0, fields["num_labels"], input_ids.shape, generator=torch.Generator().manual_seed(0))
    for labels, packs in ((labels, False), (labels.masked_fill(mask == 0, -100), True)):
        packed_batches.clear()
        expected = backward(reference, input_ids=input_ids, attention_mask=mask, labels=labels, **more)
        out = backward(ours, input_ids=input_ids, attention_mask=mask, labels=labels, **more)
        assert bool(packed_batches) == packs
        assert_close(out.loss, expected.loss.detach(), msg=f"loss ({'padding-free' if packs else 'padded'})")
        assert_reference_gradients(ours, reference, renamed)


def test_seq2seq_scores_labelled_padding_as_bart(packed_batches):
    """Targets padded with the padding id (not -100) beside a decoder_attention_mask: BartForConditionalGeneration
    scores the padding too, so the decoder runs padded (the encoder stays padding-free: the decoder reads its real
    tokens alone). With -100 at padding the decoder runs padding-free too. Loss and gradients are BART's."""
    reference, ours = bart_pair("BartForConditionalGeneration")
    source, source_mask = padded(sequences(14), pad=1)
    labels, target_mask = padded(sequences(15, (4, 2, 7, 7, 3, 1)), pad=1)
    for labels, packed in ((labels, 1), (labels.masked_fill(target_mask == 0, -100), 3)):
        packed_batches.clear()
        inputs = dict(input_ids=source, attention_mask=source_mask, labels=labels, decoder_attention_mask=target_mask)
        expected, out = backward(reference, **inputs), backward(ours, **inputs)
        assert len(packed_batches) == packed
        assert_close(out.loss, expected.loss.detach(), msg="loss")
        assert_reference_gradients(ours, reference)


def test_decoder_only_scores_as_bart_for_causal_lm():
    """BartForCausalLM scores logits[t] against labels[t] (its labels come shifted); ours shifts `labels` inside, as
    GPT-2 and BertLMHeadModel do, and takes BART's labelling as `shift_labels`. Either way the loss and gradients are
    BART's, the padding's next tokens included."""
    reference, ours = bart_pair("BartForCausalLM", is_decoder=True, is_encoder_decoder=False)
    input_ids, mask = padded(sequences(16), pad=1)
    next_ids = torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=-100)  # BART's labels for the same targets
    expected = backward(reference, input_ids=input_ids, attention_mask=mask, labels=next_ids)
    for labels in (dict(labels=input_ids), dict(shift_labels=next_ids)):
        out = backward(ours, input_ids=input_ids, attention_mask=mask, **labels)
        assert_close(out.loss, expected.loss.detach(), msg=f"loss with {next(iter(labels))}")
        assert_reference_gradients(ours, reference)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_pairs_with_bart_positions_match_bart_pair_by_pair(attn):
    """Packed pairs of a BART checkpoint (learned positions offset by 2) in the documented layout, position_ids and
    decoder_position_ids counting from 0: both stacks add the offset, so every pair gets BartForConditionalGeneration's
    answer for it alone: encoder states, logits, loss and gradients."""
    reference, ours = bart_pair("BartForConditionalGeneration", attn)
    sources, targets = sequences(17), sequences(18, (4, 2, 7, 7, 3, 1))
    labels = torch.cat(targets)
    reference.zero_grad()
    alone = [reference(input_ids=s[None], labels=t[None]) for s, t in zip(sources, targets)]
    logits = torch.cat([a.logits[0] for a in alone])
    loss = torch.nn.functional.cross_entropy(logits, labels)
    loss.backward()
    out = backward(ours, input_ids=torch.cat(sources)[None], position_ids=restarting(sources), labels=labels[None],
                   decoder_position_ids=restarting(targets))
    encoder_states = torch.cat([a.encoder_last_hidden_state[0] for a in alone])
    assert_close(out.encoder_last_hidden_state[0], encoder_states.detach(), msg="encoder states")
    assert_close(out.logits[0], logits.detach(), msg="logits")
    assert_close(out.loss, loss.detach(), msg="loss")
    assert_reference_gradients(ours, reference)


@pytest.mark.parametrize("positions", [[0, 2, 4, 6, 8, 10], [0, 0, 1, 1, 2, 2], [0, 1, 2, 3, 3, 3]])
def test_explicit_positions_are_positions_not_boundaries(positions, packed_batches):
    """position_ids out of DataCollatorWithFlattening's layout (counting up by one, starting again from the first
    position) are each token's position, as BertModel reads them: without an attention mask as with a mask of
    ones."""
    reference, ours = bert_pair("base", BertModel)
    input_ids, position_ids = sequences(19, (6,))[0][None], torch.tensor([positions])
    with torch.no_grad():
        expected = reference(input_ids=input_ids, position_ids=position_ids).last_hidden_state
        for mask in (None, torch.ones_like(input_ids)):
            got = ours(input_ids=input_ids, attention_mask=mask, position_ids=position_ids).last_hidden_state
            assert_close(got, expected, msg=f"attention_mask {'of ones' if mask is not None else 'None'}")
    assert not packed_batches


def test_packed_sequences_longer_together_than_the_position_table():
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False): five sequences of 20
    tokens, 100 together, on a 64-position table. Each counts its positions from its own start and fits: every
    sequence gets BertModel's answer for it alone."""
    reference, ours = bert_pair("base", BertModel)
    rows = sequences(20, (20,) * 5)
    batch = flattened(rows, return_flash_attn_kwargs=True, return_position_ids=False)
    batch.pop("labels")
    with torch.no_grad():
        expected = torch.cat([reference(input_ids=row[None]).last_hidden_state[0] for row in rows])
        assert_close(ours(**batch).last_hidden_state[0], expected)


def test_packed_positions_may_start_at_two():
    """DataCollatorWithFlattening(position_ids_start=2), as a RoBERTa table needs (its first position is row 2):
    sequences start again at 2, and each packed sequence gets its answer alone."""
    model = randomised(VanillaEncoderModel(encoder_config(position_offset=2))).eval()
    rows = sequences(21)
    batch = flattened(rows, position_ids_start=2)
    batch.pop("labels")
    with torch.no_grad():
        alone = torch.cat([model(input_ids=row[None]).last_hidden_state[0] for row in rows])
        assert_close(model(**batch).last_hidden_state[0], alone)
