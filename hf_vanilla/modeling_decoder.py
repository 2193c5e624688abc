"""The decoder alone, the third transformer family next to the encoder and the encoder-decoder: the decoder stack
without cross-attention (the shape of GPT) and its causal language model, on the base of `modeling_vanilla.py`.
Shapes follow `transformer.py`'s key (B, T, E, V).
"""

import copy

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions, CausalLMOutputWithCrossAttentions
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .compat import one_cache
from .configuration_vanilla import VanillaSeq2SeqConfig
from .decoding import VanillaGenerationMixin
from .head_layers import VanillaLMHead
from .heads import MODELS
from .modeling_vanilla import VanillaPreTrainedModel
from .packing import packed_format
from .transformer import VanillaStack


def _decoder_only(config):
    """An encoder-decoder config for its decoder used alone (a copy, unless it is one already): `generate` then
    treats it as a causal language model, not as an encoder-decoder (BART's `BartForCausalLM` does the same). The
    model and its body share that one config, so that what changes it (resizing the vocabulary) changes both."""
    if config.is_decoder and not config.is_encoder_decoder:
        return config
    config = copy.deepcopy(config)
    config.is_decoder, config.is_encoder_decoder = True, False
    return config


class VanillaDecoderModel(VanillaPreTrainedModel):
    """The decoder stack alone, without cross-attention: masked self-attention and feed-forward (the shape of GPT).
    Built from an encoder-decoder config, it reads `decoder_*` sizes; its weights are named as the encoder-decoder's
    decoder (`decoder.*`), so a decoder trained either way loads into the other."""

    config_class = VanillaSeq2SeqConfig
    input_stack = "decoder"

    def __init__(self, config: VanillaSeq2SeqConfig):
        super().__init__(_decoder_only(config))
        self.decoder = VanillaStack(self.config, is_decoder=True)
        self.post_init()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                cache: Cache | None = None, past_key_values: Cache | None = None, use_cache: bool | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, outputs_at_padding: bool = False,
                **kwargs: Unpack[TransformersKwargs]) -> BaseModelOutputWithPastAndCrossAttentions | tuple:
        """input_ids, attention_mask: (B, T). Returns last_hidden_state (B, T, E) and, when asked, the cache
        (`cache`, or `past_key_values` before transformers 5.24) and every layer's hidden states and attention
        weights. `outputs_at_padding`: as in `VanillaSeq2SeqModel`. position_ids: (B, T) counted from 0 (the
        table's `position_offset` is added here); left padding needs them, as in GPT-2 (`generate` derives them from
        `attention_mask`); without them positions count from the left edge of the input."""
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           inputs_embeds=inputs_embeds, past_key_values=one_cache(cache, past_key_values),
                           use_cache=use_cache, output_attentions=output_attentions,
                           output_hidden_states=output_hidden_states, outputs_at_padding=outputs_at_padding,
                           **packed_format(kwargs))
        return self._output(BaseModelOutputWithPastAndCrossAttentions, out, return_dict)


class VanillaDecoderForCausalLM(VanillaPreTrainedModel, VanillaGenerationMixin):
    """The decoder alone with its output projection: P(next token | tokens so far), trained on shifted labels and
    sampled with `generate()`. The third transformer family, next to the encoder and the encoder-decoder."""

    config_class = VanillaSeq2SeqConfig
    _tied_weights_keys = {"lm_head.decoder.weight": "model.decoder.embeddings.word_embeddings.weight"}

    def __init__(self, config: VanillaSeq2SeqConfig):
        super().__init__(_decoder_only(config))
        self.model = VanillaDecoderModel(self.config)
        self.lm_head = VanillaLMHead(self.config, self.config.lm_head_transform, self.config.trainable_logits_bias)
        self.post_init()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                cache: Cache | None = None, past_key_values: Cache | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                **kwargs: Unpack[TransformersKwargs]) -> CausalLMOutputWithCrossAttentions | tuple:
        """labels: (B, T), usually input_ids: position t is scored on predicting token t + 1 (the shift is here).
        position_ids: (B, T) counted from 0, as in `VanillaDecoderModel`. Returns logits (B, T, V) and, with
        `use_cache`, the key/value cache for the next step (`cache`, or `past_key_values` before transformers 5.24)."""
        return self._causal_lm_output(kwargs, labels=labels, use_cache=use_cache, return_dict=return_dict,
                                      input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                      inputs_embeds=inputs_embeds, cache=cache, past_key_values=past_key_values,
                                      output_attentions=output_attentions, output_hidden_states=output_hidden_states)


# The public classes: every model `heads.py` declares that is defined here.
__all__ = [name for name in MODELS if name in globals()]
