"""The encoder-decoder and BART's heads (generation, sequence classification, question answering), on the base of
`modeling_vanilla.py`. Shapes follow `transformer.py`'s key (B, T, S, E, V).
"""

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import (
    BaseModelOutput, ModelOutput, Seq2SeqLMOutput, Seq2SeqModelOutput, Seq2SeqQuestionAnsweringModelOutput,
    Seq2SeqSequenceClassifierOutput,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .compat import one_cache, resized_embeddings
from .configuration_vanilla import VanillaSeq2SeqConfig
from .decoding import VanillaGenerationMixin
from .head_layers import VanillaLMHead
from .heads import MODELS
from .kernels import VanillaLinear, is_tracing
from .losses import labelled_prefix, reads_padding, shift_tokens_right, span_logits, token_cross_entropy, token_logits
from .modeling_vanilla import VanillaPreTrainedModel
from .packing import plan_of
from .transformer import VanillaStack
from .validation import (
    check_eos_tokens, check_labels, check_sequence_labels, check_span_positions, check_target, refuse_packed_pairs,
    refuse_unpaired_boundaries,
)


class VanillaSeq2SeqModel(VanillaPreTrainedModel):
    """The encoder-decoder without an output head: source (B, S) and target (B, T) -> decoder states (B, T, E).

    Without a target, the decoder reads the source shifted right (BART's convention, which its sequence
    classification and question-answering heads rely on)."""

    config_class = VanillaSeq2SeqConfig
    input_stack = "encoder"

    def __init__(self, config: VanillaSeq2SeqConfig):
        super().__init__(config)
        self.encoder = VanillaStack(config)
        self.decoder = VanillaStack(config, is_decoder=True, cross_attention=True)
        if config.share_encoder_decoder_embeddings:
            self._tied_weights_keys = {
                "decoder.embeddings.word_embeddings.weight": "encoder.embeddings.word_embeddings.weight"
            }
        self.post_init()

    def set_input_embeddings(self, value):  # the source's, and the target's where they are one matrix
        self.encoder.embeddings.word_embeddings = value
        if self.config.share_encoder_decoder_embeddings:
            self.decoder.embeddings.word_embeddings = value

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.Tensor | None = None, decoder_attention_mask: torch.Tensor | None = None,
                encoder_outputs: BaseModelOutput | tuple | None = None, past_key_values: Cache | None = None,
                token_type_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                decoder_inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, cache: Cache | None = None, position_ids: torch.Tensor | None = None,
                decoder_position_ids: torch.Tensor | None = None, outputs_at_padding: bool = False,
                **kwargs: Unpack[TransformersKwargs]) -> Seq2SeqModelOutput | tuple:
        """`token_type_ids` reach the encoder only (`generate` passes them to every step). `encoder_outputs` may be
        a tuple (last_hidden_state, hidden_states, attentions). Returns the decoder's last_hidden_state (B, T, E),
        the encoder's (B, S, E), and both stacks' cache, hidden states and attention weights when asked.
        `outputs_at_padding`: compute the decoder's padding positions as the padded path does, for a loss that reads
        them (a padded target otherwise runs padding-free, its padding positions left at zero).

        `position_ids` and `decoder_position_ids` count from 0 in both stacks (the table's `position_offset` is added
        inside). Packed pairs (transformers' padding-free format, without masks): sources end to end with
        `position_ids` restarting at 0 at each, targets likewise with `decoder_position_ids`; target i reads source
        i. (`cu_seq_lens_*` cannot say which boundaries are whose here, and are refused.)"""
        refuse_unpaired_boundaries(kwargs)
        past_key_values = one_cache(cache, past_key_values)  # `cache` since transformers 5.24
        if decoder_input_ids is None and decoder_inputs_embeds is None and input_ids is not None:
            decoder_input_ids = shift_tokens_right(input_ids, self.config.pad_token_id,
                                                   self.config.decoder_start_token_id, position_ids)
            decoder_position_ids = position_ids if decoder_position_ids is None else decoder_position_ids
        if encoder_outputs is None:
            # The target is checked first, so that a bad target stops the call before the encoder's kernels run.
            check_target(self.config, decoder_input_ids, decoder_inputs_embeds, decoder_attention_mask=decoder_attention_mask, past_key_values=past_key_values)
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                                           token_type_ids=token_type_ids, position_ids=position_ids,
                                           inputs_embeds=inputs_embeds, output_attentions=output_attentions,
                                           output_hidden_states=output_hidden_states)
        elif not isinstance(encoder_outputs, ModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        decoder_out = self.decoder(
            input_ids=decoder_input_ids, attention_mask=decoder_attention_mask, inputs_embeds=decoder_inputs_embeds,
            position_ids=decoder_position_ids, encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask, encoder_position_ids=position_ids, past_key_values=past_key_values,
            use_cache=use_cache, output_attentions=output_attentions, output_hidden_states=output_hidden_states,
            outputs_at_padding=outputs_at_padding,
        )
        # The decoder's last_hidden_state, past_key_values and cross_attentions carry over by name; the rest:
        return self._output(Seq2SeqModelOutput, decoder_out, return_dict,
                            decoder_hidden_states=decoder_out.hidden_states, decoder_attentions=decoder_out.attentions,
                            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
                            encoder_hidden_states=encoder_outputs.hidden_states,
                            encoder_attentions=encoder_outputs.attentions)


class VanillaSeq2SeqPreTrainedModel(VanillaPreTrainedModel):
    """What every encoder-decoder head shares: the encoder-decoder as `self.model`, whose `encoder` and `decoder`
    transformers' `get_encoder()` and `get_decoder()` find by name."""

    config_class = VanillaSeq2SeqConfig

    def __init__(self, config: VanillaSeq2SeqConfig):
        super().__init__(config)
        self.model = VanillaSeq2SeqModel(config)


class VanillaSeq2SeqForConditionalGeneration(VanillaSeq2SeqPreTrainedModel, VanillaGenerationMixin):
    """The encoder-decoder with its output projection: P(next target token | source, target so far), trained with
    teacher forcing and sampled with `generate()` (greedy, beam search, sampling, with a key/value cache)."""

    def __init__(self, config: VanillaSeq2SeqConfig):
        super().__init__(config)
        self.lm_head = VanillaLMHead(config, config.lm_head_transform, config.trainable_logits_bias)
        # The output projection reads the target embedding matrix (section 3.4), itself shared with the source
        # when `share_encoder_decoder_embeddings`; tie both directly to their one source.
        embedding = "model.encoder" if config.share_encoder_decoder_embeddings else "model.decoder"
        self._tied_weights_keys = {"lm_head.decoder.weight": f"{embedding}.embeddings.word_embeddings.weight"}
        if config.share_encoder_decoder_embeddings:
            self._tied_weights_keys["model.decoder.embeddings.word_embeddings.weight"] = (
                "model.encoder.embeddings.word_embeddings.weight"
            )
        self.post_init()

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
        """Source and target share one vocabulary. transformers resizes the source embeddings and the output
        projection; separate target embeddings are resized here first, or the output projection would be re-tied
        to their old size."""
        if not self.config.share_encoder_decoder_embeddings:
            target = self.model.decoder.embeddings
            target.word_embeddings = resized_embeddings(
                self, target.word_embeddings, new_num_tokens, pad_to_multiple_of=pad_to_multiple_of, mean_resizing=mean_resizing
            )
        return super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.Tensor | None = None, decoder_attention_mask: torch.Tensor | None = None,
                encoder_outputs: BaseModelOutput | tuple | None = None, past_key_values: Cache | None = None,
                token_type_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                decoder_inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None, cache: Cache | None = None,
                position_ids: torch.Tensor | None = None, decoder_position_ids: torch.Tensor | None = None,
                **kwargs: Unpack[TransformersKwargs]) -> Seq2SeqLMOutput | tuple:
        """labels: (B, T) target ids, -100 where ignored; the decoder input is `labels` shifted right (each packed
        target's from its start, with `decoder_position_ids`: `VanillaSeq2SeqModel` says how pairs pack).
        Returns logits (B, T, V) and, with `use_cache`, the key/value cache for the next step (`cache`, or
        `past_key_values` before transformers 5.24)."""
        check_labels(labels, self.config.vocab_size, "vocab_size")
        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            decoder_input_ids = shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id,
                                                   decoder_position_ids)
            if decoder_attention_mask is None and decoder_position_ids is None and not is_tracing():
                decoder_attention_mask = labelled_prefix(labels)  # targets padded with -100 run padding-free
            use_cache = False
        out = self._body(kwargs, input_ids=input_ids, attention_mask=attention_mask,
                         decoder_input_ids=decoder_input_ids, decoder_attention_mask=decoder_attention_mask,
                         encoder_outputs=encoder_outputs, token_type_ids=token_type_ids,
                         inputs_embeds=inputs_embeds, decoder_inputs_embeds=decoder_inputs_embeds,
                         position_ids=position_ids, decoder_position_ids=decoder_position_ids, cache=cache,
                         past_key_values=past_key_values, use_cache=use_cache, output_attentions=output_attentions,
                         output_hidden_states=output_hidden_states,
                         outputs_at_padding=reads_padding(labels, decoder_attention_mask))
        logits = token_logits(self.lm_head, out.last_hidden_state, plan_of(out))  # (B, T, V)
        return self._output(Seq2SeqLMOutput, out, return_dict, loss=token_cross_entropy(logits, labels),
                            logits=logits.all)


class VanillaSeq2SeqForSequenceClassification(VanillaSeq2SeqPreTrainedModel):
    """One label per sequence from the encoder-decoder (BART's recipe): the source is also the decoder's input,
    shifted right, and the decoder state at the last end-of-sequence token, which has read the whole sequence
    through both stacks, is pooled (dense + tanh) and classified."""

    def __init__(self, config: VanillaSeq2SeqConfig):
        super().__init__(config)
        self.pooler = VanillaLinear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = VanillaLinear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.Tensor | None = None, decoder_attention_mask: torch.Tensor | None = None,
                encoder_outputs: BaseModelOutput | tuple | None = None, token_type_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                **kwargs: Unpack[TransformersKwargs]) -> Seq2SeqSequenceClassifierOutput | tuple:
        """input_ids: (B, S), each row with the same number of `eos_token_id`s. Returns logits (B, num_labels)."""
        check_eos_tokens(input_ids, self.config.eos_token_id, decoder_input_ids)
        check_sequence_labels(self.config, labels)
        refuse_packed_pairs(kwargs, type(self).__name__)
        out = self._body(kwargs, input_ids=input_ids, attention_mask=attention_mask,
                         decoder_input_ids=decoder_input_ids, decoder_attention_mask=decoder_attention_mask,
                         encoder_outputs=encoder_outputs, token_type_ids=token_type_ids,
                         use_cache=False, output_attentions=output_attentions,
                         output_hidden_states=output_hidden_states)
        B, _, E = out.last_hidden_state.shape
        eos = input_ids == self.config.eos_token_id  # (B, S), the same count in every row
        last_eos = out.last_hidden_state[eos].view(B, -1, E)[:, -1]  # (B, E): the state at each row's last eos
        logits = self.classifier(self.dropout(torch.tanh(self.pooler(self.dropout(last_eos)))))  # (B, num_labels)
        loss = self._classification_loss(logits, labels)
        return self._output(Seq2SeqSequenceClassifierOutput, out, return_dict, loss=loss, logits=logits)


class VanillaSeq2SeqForQuestionAnswering(VanillaSeq2SeqPreTrainedModel):
    """Extractive QA from the encoder-decoder (BART's recipe): the decoder reads the source shifted right, and each
    decoder state scores its token as the answer's start and end."""

    def __init__(self, config: VanillaSeq2SeqConfig):
        super().__init__(config)
        self.qa_outputs = VanillaLinear(config.hidden_size, 2)
        self.post_init()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.Tensor | None = None, decoder_attention_mask: torch.Tensor | None = None,
                encoder_outputs: BaseModelOutput | tuple | None = None, token_type_ids: torch.Tensor | None = None,
                start_positions: torch.Tensor | None = None, end_positions: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, decoder_inputs_embeds: torch.Tensor | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None,
                **kwargs: Unpack[TransformersKwargs]) -> Seq2SeqQuestionAnsweringModelOutput | tuple:
        """start_positions, end_positions: (B,), the answer span's token indices. Returns (B, T) start/end logits."""
        check_span_positions(start_positions, end_positions, input_ids if input_ids is not None else inputs_embeds)
        refuse_packed_pairs(kwargs, type(self).__name__)
        out = self._body(kwargs, input_ids=input_ids, attention_mask=attention_mask,
                         decoder_input_ids=decoder_input_ids, decoder_attention_mask=decoder_attention_mask,
                         encoder_outputs=encoder_outputs, token_type_ids=token_type_ids,
                         inputs_embeds=inputs_embeds, decoder_inputs_embeds=decoder_inputs_embeds, use_cache=False,
                         output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                         outputs_at_padding=start_positions is not None or end_positions is not None)
        start_logits, end_logits = span_logits(self.qa_outputs, out.last_hidden_state)
        loss = self.loss_function(start_logits, end_logits, start_positions, end_positions)
        return self._output(Seq2SeqQuestionAnsweringModelOutput, out, return_dict, loss=loss,
                            start_logits=start_logits, end_logits=end_logits)


# The public classes: every model `heads.py` declares that is defined here.
__all__ = [name for name in MODELS if name in globals()]
