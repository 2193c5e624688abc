"""The BERT-style encoder and every head BERT has (masked LM, causal LM, pre-training, next sentence, sequence /
token classification, multiple choice, question answering) and ELECTRA's replaced-token detector, on the base of
`modeling_vanilla.py`. Shapes follow `transformer.py`'s key (B, T, E, V).
"""

import copy
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import (
    BaseModelOutputWithPoolingAndCrossAttentions, CausalLMOutputWithCrossAttentions, MaskedLMOutput, ModelOutput,
    MultipleChoiceModelOutput, NextSentencePredictorOutput, QuestionAnsweringModelOutput, SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .compat import one_cache
from .configuration_vanilla import VanillaEncoderConfig
from .decoding import VanillaGenerationMixin
from .head_layers import VanillaLMHead, VanillaReplacedTokenHead, classifier_layers
from .heads import MODELS
from .kernels import VanillaLinear
from .losses import (
    cross_entropy, reads_padding, replaced_token_loss, span_logits, token_cross_entropy, token_logits,
)
from .modeling_vanilla import VanillaPreTrainedModel
from .packing import packed_format, plan_of
from .transformer import VanillaStack
from .validation import check_choices, check_labels, check_sequence_labels, check_span_positions, check_token_labels


class VanillaEncoderModel(VanillaPreTrainedModel):
    """The BERT-style encoder: embeddings, N encoder layers and (optionally) BERT's pooler.

    The pooler, tanh(W h_0 + b) over the first ([CLS]) token, is what BERT's next-sentence objective trained as a
    sentence representation; the heads that classify whole sequences read it, the others are built without it.
    With `config.is_decoder` the layers are masked to the past: BERT's causal language model.
    """

    config_class = VanillaEncoderConfig
    input_stack = "encoder"

    def __init__(self, config: VanillaEncoderConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.encoder = VanillaStack(config, is_decoder=config.is_decoder)
        use_pooler = add_pooling_layer and config.use_pooler
        self.pooler = VanillaLinear(config.hidden_size, config.hidden_size) if use_pooler else None
        self.post_init()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, cache: Cache | None = None,
                past_key_values: Cache | None = None, use_cache: bool | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, outputs_at_padding: bool = False,
                **kwargs: Unpack[TransformersKwargs]) -> BaseModelOutputWithPoolingAndCrossAttentions | tuple:
        """input_ids, attention_mask, token_type_ids: (B, T). Returns last_hidden_state (B, T, E), pooler_output
        (B, E), and per layer the hidden states (B, T, E) and attention weights (B, H, T, T) when asked.
        `cache` (`past_key_values` before transformers 5.24): the causal LM's key/value cache.
        A right-padded batch runs padding-free, its padding positions' states left at zero; `outputs_at_padding`
        computes them as the padded computation does (BertModel's states there), for a loss that reads them."""
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                           position_ids=position_ids, inputs_embeds=inputs_embeds,
                           past_key_values=one_cache(cache, past_key_values), use_cache=use_cache,
                           output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                           outputs_at_padding=outputs_at_padding, **packed_format(kwargs))
        pooled = None
        if self.pooler is not None:  # one state per sequence: (B, E), or (count, E) in transformers' packed format
            plan = plan_of(out)
            first = out.last_hidden_state[:, 0] if plan is None else plan.first_states(out.last_hidden_state)
            pooled = torch.tanh(self.pooler(first))
        return self._output(BaseModelOutputWithPoolingAndCrossAttentions, out, return_dict, pooler_output=pooled)


class VanillaEncoderPreTrainedModel(VanillaPreTrainedModel):
    """What every encoder head shares: the encoder as `self.model`, with BERT's pooler only when the head reads it
    (`uses_pooler`): a pooler nobody reads would be computed on every forward and never trained."""

    config_class = VanillaEncoderConfig

    def __init__(self, config: VanillaEncoderConfig):
        super().__init__(config)
        self.model = VanillaEncoderModel(config, add_pooling_layer=self.uses_pooler)

    def _sentence(self, out):
        """The sentence representation (B, E): the pooled [CLS] token, or its hidden state when the checkpoint has
        no pooler (DistilBERT, ELECTRA)."""
        return out.pooler_output if out.pooler_output is not None else out.last_hidden_state[:, 0]


class VanillaEncoderForMaskedLM(VanillaEncoderPreTrainedModel):
    """The encoder with BERT's masked-language-model head: predict the token behind each [MASK]."""

    _tied_weights_keys = {"lm_head.decoder.weight": "model.encoder.embeddings.word_embeddings.weight"}

    def __init__(self, config: VanillaEncoderConfig):
        super().__init__(config)
        self.lm_head = VanillaLMHead(config, transform=True)
        self.post_init()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, **kwargs: Unpack[TransformersKwargs]) -> MaskedLMOutput | tuple:
        """labels: (B, T), the original token at masked positions and -100 elsewhere. Returns logits (B, T, V)."""
        check_labels(labels, self.config.vocab_size, "vocab_size")
        out = self._body(kwargs, input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                         position_ids=position_ids, inputs_embeds=inputs_embeds, output_attentions=output_attentions,
                         output_hidden_states=output_hidden_states,
                         outputs_at_padding=reads_padding(labels, attention_mask))
        logits = token_logits(self.lm_head, out.last_hidden_state, plan_of(out))  # (B, T, V)
        return self._output(MaskedLMOutput, out, return_dict, loss=token_cross_entropy(logits, labels),
                            logits=logits.all)


class VanillaEncoderForCausalLM(VanillaEncoderPreTrainedModel, VanillaGenerationMixin):
    """BERT's causal language model (transformers' `BertLMHeadModel`): the encoder masked to the past, with the
    masked-LM head predicting the next token, and `generate()` with a key/value cache. It is causal whatever the
    config says (its copy has `is_decoder=True`): BERT's own class runs bidirectionally without the flag."""

    _tied_weights_keys = VanillaEncoderForMaskedLM._tied_weights_keys

    def __init__(self, config: VanillaEncoderConfig):
        if not config.is_decoder:
            config = copy.deepcopy(config)
            config.is_decoder = True
        super().__init__(config)
        self.lm_head = VanillaLMHead(config, transform=True)
        self.post_init()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, cache: Cache | None = None,
                past_key_values: Cache | None = None, labels: torch.Tensor | None = None, use_cache: bool | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None,
                **kwargs: Unpack[TransformersKwargs]) -> CausalLMOutputWithCrossAttentions | tuple:
        """labels: (B, T), usually input_ids: position t is scored on predicting token t + 1 (the shift is here).
        position_ids: (B, T) counted from 0 (`generate` derives them from a left-padded mask).
        Returns logits (B, T, V) and, with `use_cache`, the key/value cache for the next step (`cache`, or
        `past_key_values` before transformers 5.24)."""
        return self._causal_lm_output(kwargs, labels=labels, use_cache=use_cache, return_dict=return_dict,
                                      input_ids=input_ids, attention_mask=attention_mask,
                                      token_type_ids=token_type_ids, position_ids=position_ids,
                                      inputs_embeds=inputs_embeds, cache=cache, past_key_values=past_key_values,
                                      output_attentions=output_attentions, output_hidden_states=output_hidden_states)


@dataclass
class VanillaForPreTrainingOutput(ModelOutput):
    """Output of `VanillaEncoderForPreTraining`: the masked-LM and next-sentence logits (BERT's two objectives)."""

    loss: torch.FloatTensor | None = None
    prediction_logits: torch.FloatTensor | None = None
    seq_relationship_logits: torch.FloatTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None


class VanillaEncoderForPreTraining(VanillaEncoderPreTrainedModel):
    """BERT as it was pre-trained: the masked-LM head on every token and the next-sentence head on [CLS]."""

    uses_pooler = True
    _tied_weights_keys = VanillaEncoderForMaskedLM._tied_weights_keys

    def __init__(self, config: VanillaEncoderConfig):
        super().__init__(config)
        self.lm_head = VanillaLMHead(config, transform=True)
        self.seq_relationship = VanillaLinear(config.hidden_size, 2)
        self.post_init()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                next_sentence_label: torch.Tensor | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                **kwargs: Unpack[TransformersKwargs]) -> VanillaForPreTrainingOutput | tuple:
        """labels: (B, T) masked-LM targets (-100 elsewhere); next_sentence_label: (B,). The loss is their sum,
        when both are given. Returns prediction_logits (B, T, V) and seq_relationship_logits (B, 2)."""
        check_labels(labels, self.config.vocab_size, "vocab_size")
        check_labels(next_sentence_label, 2, "the two next-sentence classes")
        out = self._body(kwargs, input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                         position_ids=position_ids, inputs_embeds=inputs_embeds, output_attentions=output_attentions,
                         output_hidden_states=output_hidden_states,
                         outputs_at_padding=reads_padding(labels, attention_mask))
        prediction_logits = self.lm_head(out.last_hidden_state)  # (B, T, V)
        seq_relationship_logits = self.seq_relationship(self._sentence(out))  # (B, 2)
        loss = None if labels is None or next_sentence_label is None else (
            cross_entropy(prediction_logits, labels) + cross_entropy(seq_relationship_logits, next_sentence_label))
        return self._output(VanillaForPreTrainingOutput, out, return_dict, loss=loss,
                            prediction_logits=prediction_logits, seq_relationship_logits=seq_relationship_logits)


class VanillaEncoderForNextSentencePrediction(VanillaEncoderPreTrainedModel):
    """Does sentence B follow sentence A? Two logits (is next, is random) from the pooled [CLS] token, the second
    objective BERT was pre-trained with (Devlin et al., 2019, section 3.1)."""

    uses_pooler = True

    def __init__(self, config: VanillaEncoderConfig):
        super().__init__(config)
        self.seq_relationship = VanillaLinear(config.hidden_size, 2)
        self.post_init()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None,
                **kwargs: Unpack[TransformersKwargs]) -> NextSentencePredictorOutput | tuple:
        """labels: (B,), 0 where B follows A, 1 where B is random. Returns logits (B, 2)."""
        check_labels(labels, 2, "the two next-sentence classes")
        out = self._body(kwargs, input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                         position_ids=position_ids, inputs_embeds=inputs_embeds, output_attentions=output_attentions,
                         output_hidden_states=output_hidden_states)
        logits = self.seq_relationship(self._sentence(out))  # (B, 2)
        loss = cross_entropy(logits, labels)
        return self._output(NextSentencePredictorOutput, out, return_dict, loss=loss, logits=logits)


class VanillaEncoderForSequenceClassification(VanillaEncoderPreTrainedModel):
    """One label (or score) per sequence, read from the pooled [CLS] token. The loss follows `problem_type`:
    regression (MSE), single-label (cross-entropy) or multi-label (binary cross-entropy), as BERT's does."""

    uses_pooler = True

    def __init__(self, config: VanillaEncoderConfig):
        super().__init__(config)
        self.num_labels = config.num_labels  # as on BERT's head; the loss reads config.num_labels
        self.dropout, self.classifier = classifier_layers(config, config.num_labels)
        self.post_init()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None,
                **kwargs: Unpack[TransformersKwargs]) -> SequenceClassifierOutput | tuple:
        """labels: (B,) class ids, (B,) floats for regression or (B, num_labels) for multi-label. Returns logits
        (B, num_labels)."""
        check_sequence_labels(self.config, labels)
        out = self._body(kwargs, input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                         position_ids=position_ids, inputs_embeds=inputs_embeds, output_attentions=output_attentions,
                         output_hidden_states=output_hidden_states)
        logits = self.classifier(self.dropout(self._sentence(out)))  # (B, num_labels)
        loss = self._classification_loss(logits, labels)
        return self._output(SequenceClassifierOutput, out, return_dict, loss=loss, logits=logits)


class VanillaEncoderForMultipleChoice(VanillaEncoderPreTrainedModel):
    """Pick one of C candidate continuations (SWAG): each (context, choice) pair is encoded as its own sequence and
    scored from its pooled [CLS] token; the C scores of a question compete in one softmax."""

    uses_pooler = True

    def __init__(self, config: VanillaEncoderConfig):
        super().__init__(config)
        self.dropout, self.classifier = classifier_layers(config, 1)
        self.post_init()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None,
                **kwargs: Unpack[TransformersKwargs]) -> MultipleChoiceModelOutput | tuple:
        """input_ids, attention_mask, token_type_ids: (B, C, T); labels: (B,) the index of the right choice.
        Returns logits (B, C)."""
        B, C = check_choices(input_ids, inputs_embeds, attention_mask=attention_mask, token_type_ids=token_type_ids,
                             position_ids=position_ids)
        check_labels(labels, C, "the number of choices")

        def flat(x):  # (B, C, T, ...) -> (B * C, T, ...): every choice is a sequence of its own
            return None if x is None else x.reshape(B * C, *x.shape[2:])

        out = self._body(kwargs, input_ids=flat(input_ids), attention_mask=flat(attention_mask),
                         token_type_ids=flat(token_type_ids), position_ids=flat(position_ids),
                         inputs_embeds=flat(inputs_embeds), output_attentions=output_attentions,
                         output_hidden_states=output_hidden_states)
        logits = self.classifier(self.dropout(self._sentence(out))).view(B, C)  # (B * C, 1) -> (B, C)
        return self._output(MultipleChoiceModelOutput, out, return_dict, loss=cross_entropy(logits, labels),
                            logits=logits)


class VanillaEncoderForTokenClassification(VanillaEncoderPreTrainedModel):
    """One label per token (named entities, parts of speech), from the token's own hidden state."""

    def __init__(self, config: VanillaEncoderConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.dropout, self.classifier = classifier_layers(config, config.num_labels)
        self.post_init()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, **kwargs: Unpack[TransformersKwargs]) -> TokenClassifierOutput | tuple:
        """labels: (B, T) with -100 where no label applies. Returns logits (B, T, num_labels)."""
        check_labels(labels, self.num_labels, "num_labels")
        out = self._body(kwargs, input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                         position_ids=position_ids, inputs_embeds=inputs_embeds, output_attentions=output_attentions,
                         output_hidden_states=output_hidden_states,
                         outputs_at_padding=reads_padding(labels, attention_mask))
        logits = self.classifier(self.dropout(out.last_hidden_state))  # (B, T, num_labels)
        return self._output(TokenClassifierOutput, out, return_dict, loss=cross_entropy(logits, labels), logits=logits)


class VanillaEncoderForQuestionAnswering(VanillaEncoderPreTrainedModel):
    """Extractive QA: a start score and an end score for every token; the answer is the best-scoring span."""

    def __init__(self, config: VanillaEncoderConfig):
        super().__init__(config)
        self.qa_outputs = VanillaLinear(config.hidden_size, 2)
        self.post_init()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, start_positions: torch.Tensor | None = None,
                end_positions: torch.Tensor | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                **kwargs: Unpack[TransformersKwargs]) -> QuestionAnsweringModelOutput | tuple:
        """start_positions, end_positions: (B,) token indices of the answer span (outside the input: ignored).
        Returns start_logits and end_logits, (B, T) each.

        The loss is a softmax over every position, padding included, as BertForQuestionAnswering's: with positions
        given, a padded batch runs padded; without them, padding-free (padding positions score the head's bias)."""
        check_span_positions(start_positions, end_positions, input_ids if input_ids is not None else inputs_embeds)
        out = self._body(kwargs, input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                         position_ids=position_ids, inputs_embeds=inputs_embeds, output_attentions=output_attentions,
                         output_hidden_states=output_hidden_states,
                         outputs_at_padding=start_positions is not None or end_positions is not None)
        start_logits, end_logits = span_logits(self.qa_outputs, out.last_hidden_state)
        loss = self.loss_function(start_logits, end_logits, start_positions, end_positions)
        return self._output(QuestionAnsweringModelOutput, out, return_dict, loss=loss, start_logits=start_logits,
                            end_logits=end_logits)


class VanillaEncoderForReplacedTokenDetection(VanillaEncoderPreTrainedModel):
    """ELECTRA's discriminator (Clark et al., 2020, https://arxiv.org/abs/2003.10555, section 2): for every token,
    was it replaced by a small generator?

    ELECTRA trains this objective instead of masked-LM prediction, so it learns from every token, not only the 15%
    that are masked. (transformers calls it `ElectraForPreTraining`; here `AutoModelForPreTraining` is BERT's.)
    """

    def __init__(self, config: VanillaEncoderConfig):
        super().__init__(config)
        self.rtd_head = VanillaReplacedTokenHead(config)
        self.post_init()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, **kwargs: Unpack[TransformersKwargs]) -> TokenClassifierOutput | tuple:
        """labels: (B, T), 1 where the token was replaced and 0 where it is the original. Returns logits (B, T):
        one score per token (a `TokenClassifierOutput` with a single, squeezed label)."""
        inputs = input_ids if input_ids is not None else inputs_embeds
        if inputs is not None:
            check_token_labels(labels, inputs.shape[:2], attention_mask, "1 where replaced, 0 where original")
        out = self._body(kwargs, input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                         position_ids=position_ids, inputs_embeds=inputs_embeds, output_attentions=output_attentions,
                         output_hidden_states=output_hidden_states)
        logits = self.rtd_head(out.last_hidden_state)  # (B, T)
        loss = replaced_token_loss(logits, labels, attention_mask)
        return self._output(TokenClassifierOutput, out, return_dict, loss=loss, logits=logits)


# The public classes: every model `heads.py` declares that is defined here.
__all__ = [name for name in MODELS if name in globals()]
