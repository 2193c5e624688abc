"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017, https://arxiv.org/abs/1706.03762),
written to be read, and loadable with BERT's weights.

Contents, in the paper's order:
    1. Embeddings ......... token + position (+ segment) embeddings                        (sections 3.4, 3.5)
    2. Attention .......... scaled dot-product attention, multi-head attention            (section 3.2)
    3. Feed-forward ....... the position-wise network                                     (section 3.3)
    4. Layers ............. encoder layer; decoder layer = encoder layer + cross-attention (section 3.1)
    5. Stack .............. masks, then embeddings + N layers                              (sections 3.1, 3.2.3)
    6. Models ............. the BERT-style encoder and its heads; the encoder-decoder and its heads; the decoder
                            alone as a causal language model

Shape key, used in every comment:
    B batch size     T query length     S key/value length     N real (non-padding) tokens in a batch
    H heads          D head size (E/H)  E model width          F feed-forward width     V vocabulary size

Masks: callers pass Hugging Face's `attention_mask` (B, S) of 1 = token, 0 = padding (or a 4-D mask, as
transformers builds them). It is converted once, at the stack's boundary, into an additive mask (B, 1, T|1, S) of
0 (attend) and the dtype's minimum (do not attend), the one convention used inside.

Where BERT departs from the paper (GELU, learned positions, segment embeddings, LayerNorm on the embeddings,
epsilon 1e-12, a pooler), the config switches it; the comments say why. The machinery that makes this fast and safe
lives beside this file, one call each: `kernels.py` (which matmul kernel runs a projection), `packing.py` (padded
batches run without their padding) and `validation.py` (bad input refused before any kernel runs).
"""

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput, BaseModelOutputWithPastAndCrossAttentions, BaseModelOutputWithPoolingAndCrossAttentions,
    CausalLMOutputWithCrossAttentions, MaskedLMOutput, ModelOutput, MultipleChoiceModelOutput,
    NextSentencePredictorOutput, QuestionAnsweringModelOutput, Seq2SeqLMOutput, Seq2SeqModelOutput,
    Seq2SeqQuestionAnsweringModelOutput, Seq2SeqSequenceClassifierOutput, SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_vanilla import VanillaEncoderConfig, VanillaSeq2SeqConfig
from .kernels import VanillaLinear
from .packing import PackedBatch, attend_within_sequences, can_pack, has_padding
from .runtime_registry import apply_runtime
from .validation import (
    check_choices, check_eos_tokens, check_inputs, check_labels, check_sequence_labels, check_target,
    self_attention_cache,
)

# ----------------------------------------------------------------------------------------------------------------
# 1. Embeddings (sections 3.4 and 3.5)
# ----------------------------------------------------------------------------------------------------------------


def sinusoidal_position_table(num_positions: int, dim: int, layout: str = "interleaved") -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/E)), PE(pos, 2i+1) = cos(pos / 10000^(2i/E))  (section 3.5).

    Computed in float64 and rounded once to float32, as Marian's checkpoints were. "interleaved" follows the formula
    (sin, cos, sin, cos, ...); "concatenated" stores all sines, then all cosines.

    Returns: (num_positions, dim)
    """
    position = torch.arange(num_positions, dtype=torch.float64)[:, None]  # (P, 1)
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (E/2,)
    angles = position * inv_freq  # (P, E/2)
    if layout == "interleaved":
        table = torch.stack([angles.sin(), angles.cos()], dim=-1).view(num_positions, dim)  # (P, E/2, 2) -> (P, E)
    else:
        table = torch.cat([angles.sin(), angles.cos()], dim=-1)  # (P, E)
    return table.float()


class VanillaEmbeddings(nn.Module):
    """Token embedding + position embedding (+ segment embedding), then dropout.

    The paper scales token embeddings by sqrt(E) and adds sinusoids. BERT learns its positions, adds a segment
    embedding to tell sentence A from sentence B, and LayerNorms the sum (its deep stack trained more stably so).
    ELECTRA embeds in a narrower width and projects up.
    """

    def __init__(self, config):
        super().__init__()
        width = config.embedding_size
        self.word_embeddings = nn.Embedding(config.vocab_size, width, padding_idx=config.pad_token_id)
        if config.position_embedding_type == "learned":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, width)
        else:
            # Not saved: it is a function of the config, rebuilt by `_init_weights` after loading.
            table = sinusoidal_position_table(config.max_position_embeddings, width, config.sinusoidal_layout)
            self.register_buffer("position_table", table, persistent=False)
        self.token_type_embeddings = (
            nn.Embedding(config.type_vocab_size, width) if config.type_vocab_size > 0 else None
        )
        self.scale = math.sqrt(width) if config.scale_embeddings else None
        self.norm = nn.LayerNorm(width, eps=config.layer_norm_eps) if config.embedding_layer_norm else None
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.projection = VanillaLinear(width, config.hidden_size) if width != config.hidden_size else None

    def forward(self, input_ids, position_ids, token_type_ids=None, inputs_embeds=None):
        """input_ids, position_ids, token_type_ids: (B, T), or (N,) when packed. Returns (..., E)."""
        embeddings = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        if self.scale is not None:
            embeddings = embeddings * self.scale
        if self.token_type_embeddings is not None:
            # BERT adds word + segment first, then positions; the same order keeps us bit-close to it.
            if token_type_ids is None:
                embeddings = embeddings + self.token_type_embeddings.weight[0]
            else:
                embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        if hasattr(self, "position_embeddings"):
            embeddings = embeddings + self.position_embeddings(position_ids)
        else:
            embeddings = embeddings + self.position_table[position_ids].to(embeddings.dtype)
        if self.norm is not None:
            embeddings = self.norm(embeddings)
        if self.training:  # dropout is the identity in eval mode; not calling it saves its Python
            embeddings = self.dropout(embeddings)
        if self.projection is not None:
            embeddings = self.projection(embeddings)
        return embeddings


# ----------------------------------------------------------------------------------------------------------------
# 2. Attention (section 3.2)
# ----------------------------------------------------------------------------------------------------------------


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(D)) V  (equation 1), written out in full.

    This is the explanation; `sdpa` and `flex_attention` compute the same thing with fused kernels and are chosen
    through `config._attn_implementation` with this very signature.

    query: (B, H, T, D); key, value: (B, H, S, D); attention_mask: additive (B, 1, 1|T, S) or None.
    Returns: context (B, T, H, D) and the attention weights (B, H, T, S).
    """
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, T, S): how well each query matches each key
    if attention_mask is not None:
        scores = scores + attention_mask  # padding (and, in the decoder, the future) gets the dtype's minimum
    weights = nn.functional.softmax(scores, dim=-1)  # (B, H, T, S): each row is a distribution over the S keys
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    context = torch.matmul(weights, value)  # (B, H, T, D): a weighted average of the values
    return context.transpose(1, 2).contiguous(), weights  # (B, T, H, D)


def sdpa_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Equation 1 in one fused torch kernel, for `config._attn_implementation == "sdpa"` (the default): the same
    arithmetic as `eager_attention_forward`, without materialising the weights.

    transformers' own sdpa function wraps this kernel in cases this model never has (grouped-query heads, paged
    caches, causality guessed from `module.is_causal`); calling the kernel directly saves that Python on every
    attention call, a measurable share of a 16-token request. Masks here are always explicit: `is_causal` stays off.

    Returns: context (B, T, H, D) and None (no weights are formed).
    """
    context = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )  # (B, H, T, D)
    return context.transpose(1, 2), None


def attention_function(implementation: str, output_attentions: bool = False):
    """The attention kernel for `config._attn_implementation`: ours for "sdpa" and "eager", transformers' registry
    for the others (flex_attention, flash_attention_2, kernels registered with `AttentionInterface`). A call that
    asks for the attention maps runs the eager function, whatever the backend: fused kernels never form them.
    (`set_attn_implementation` only switches models whose source calls `ALL_ATTENTION_FUNCTIONS.get_interface(`.)"""
    if output_attentions:
        return eager_attention_forward
    if implementation == "sdpa":
        return sdpa_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)


class VanillaAttention(nn.Module):
    """Multi-head attention: MultiHead(Q, K, V) = Concat(head_1..head_H) W^O, head_i = Attention(Q W_i^Q, ...).

    One class serves all three uses in the paper (section 3.2.3): encoder self-attention `attn(x)`, masked decoder
    self-attention (the same, with a causal mask), and cross-attention `attn(x, key_value_states=memory)`.
    The H heads are not H layers: one projection per Q, K, V computes all heads at once, and a head is a D-wide
    slice of its output, separated by a view + transpose.
    """

    def __init__(self, config, num_heads: int, is_causal: bool, layer_idx: int):
        super().__init__()
        self.config = config  # the attention backends read `config._attn_implementation`
        self.layer_idx = layer_idx  # the key/value cache is indexed by layer
        self.is_causal = is_causal  # stated explicitly: sdpa treats a missing `is_causal` as True
        self.num_heads = num_heads
        self.head_dim = config.hidden_size // num_heads
        self.scaling = self.head_dim**-0.5  # the 1/sqrt(D) of equation 1
        self.dropout = config.attention_probs_dropout_prob
        self.q_proj = VanillaLinear(config.hidden_size, config.hidden_size)  # W^Q for all heads: (E, H*D)
        self.k_proj = VanillaLinear(config.hidden_size, config.hidden_size)  # W^K
        self.v_proj = VanillaLinear(config.hidden_size, config.hidden_size)  # W^V
        self.o_proj = VanillaLinear(config.hidden_size, config.hidden_size)  # W^O

    def forward(self, hidden_states, key_value_states=None, attention_mask=None, past_key_values=None,
                seq_lens=None, output_attentions=False):
        """hidden_states: (B, T, E), or (N, E) packed with `seq_lens` (the length of each sequence, summing to N).
        key_value_states: (B, S, E) encoder output for cross-attention. Returns (output like hidden_states, weights).
        """
        attention_fn = attention_function(self.config._attn_implementation, output_attentions)
        dropout = self.dropout if self.training else 0.0
        H, D = self.num_heads, self.head_dim
        if seq_lens is not None:  # padding-free: sequences laid end to end, attention within each (packing.py)
            query, key, value = (proj(hidden_states).view(-1, H, D) for proj in (self.q_proj, self.k_proj, self.v_proj))
            context = attend_within_sequences(attention_fn, self, query, key, value, seq_lens, dropout, self.scaling)
            return self.o_proj(context), None  # (N, E)

        B, T, E = hidden_states.shape
        query = self.q_proj(hidden_states).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D): heads are slices of E
        key, value = self._key_value(hidden_states, key_value_states, past_key_values)  # (B, H, S, D) each
        context, weights = attention_fn(self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling)
        context = context.reshape(B, T, E)  # (B, T, H, D) -> (B, T, E): Concat(head_1..head_H)
        return self.o_proj(context), weights

    def _key_value(self, hidden_states, key_value_states, past_key_values):
        """Project keys and values. When decoding step by step, new keys and values extend the self-attention cache,
        and the encoder's are computed once: the source sentence does not change while decoding."""
        is_cross = key_value_states is not None
        cache = past_key_values
        if isinstance(cache, EncoderDecoderCache):
            if is_cross and cache.is_updated.get(self.layer_idx):
                layer = cache.cross_attention_cache.layers[self.layer_idx]
                return layer.keys, layer.values
            cache = cache.cross_attention_cache if is_cross else cache.self_attention_cache
        elif is_cross:
            cache = None  # a decoder-only cache holds self-attention alone
        source = key_value_states if is_cross else hidden_states
        B, S, _ = source.shape
        key = self.k_proj(source).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, S, D)
        value = self.v_proj(source).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, S, D)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)  # self-attention: (B, H, past + S, D)
            if is_cross:
                past_key_values.is_updated[self.layer_idx] = True
        return key, value


# ----------------------------------------------------------------------------------------------------------------
# 3. Position-wise feed-forward network (section 3.3)
# ----------------------------------------------------------------------------------------------------------------


class VanillaFeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2, applied to every position alone: (..., E) -> (..., F) -> (..., E).

    BERT swaps ReLU for GELU, a smooth ReLU that trained better for it.
    """

    def __init__(self, config, intermediate_size: int):
        super().__init__()
        self.up_proj = VanillaLinear(config.hidden_size, intermediate_size)  # W1: (E, F)
        self.act = ACT2FN[config.hidden_act]
        self.down_proj = VanillaLinear(intermediate_size, config.hidden_size)  # W2: (F, E)

    def forward(self, hidden_states):
        return self.down_proj(self.act(self.up_proj(hidden_states)))


# ----------------------------------------------------------------------------------------------------------------
# 4. Layers (section 3.1)
# ----------------------------------------------------------------------------------------------------------------


class VanillaEncoderLayer(GradientCheckpointingLayer):
    """Self-attention, then feed-forward, each wrapped as LayerNorm(x + Dropout(Sublayer(x)))  (section 5.4).

    With `pre_norm` each sub-layer sees LayerNorm(x) and the residual stays un-normalised: x + Sublayer(LN(x)),
    the arrangement later deep models train with.
    """

    is_causal = False

    def __init__(self, config, layer_idx: int, num_heads: int, intermediate_size: int):
        super().__init__()
        self.pre_norm = config.pre_norm
        self.self_attn = VanillaAttention(config, num_heads, is_causal=self.is_causal, layer_idx=layer_idx)
        self.self_attn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.ffn = VanillaFeedForward(config, intermediate_size)
        self.ffn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, attention_mask=None, seq_lens=None, output_attentions=False):
        hidden_states, weights = self._self_attn_block(hidden_states, attention_mask, None, seq_lens, output_attentions)
        return self._ffn_block(hidden_states), weights

    def _residual(self, residual, sublayer_output, norm):
        if self.training:  # dropout is the identity in eval mode; not calling it saves its Python
            sublayer_output = self.dropout(sublayer_output)
        if self.pre_norm:
            return residual + sublayer_output
        return norm(residual + sublayer_output)

    def _sublayer_input(self, hidden_states, norm):
        return norm(hidden_states) if self.pre_norm else hidden_states

    def _self_attn_block(self, hidden_states, attention_mask, past_key_values, seq_lens, output_attentions):
        attn_input = self._sublayer_input(hidden_states, self.self_attn_norm)
        output, weights = self.self_attn(attn_input, attention_mask=attention_mask, past_key_values=past_key_values,
                                         seq_lens=seq_lens, output_attentions=output_attentions)
        return self._residual(hidden_states, output, self.self_attn_norm), weights

    def _ffn_block(self, hidden_states):
        output = self.ffn(self._sublayer_input(hidden_states, self.ffn_norm))
        return self._residual(hidden_states, output, self.ffn_norm)


class VanillaDecoderLayer(VanillaEncoderLayer):
    """The encoder layer with its self-attention masked to the past, and a third sub-layer between the two that
    attends over the encoder's output: masked self-attention -> cross-attention -> feed-forward.

    A decoder used alone (a causal language model, or `get_decoder()` called without encoder states) has no
    memory to attend to and skips the cross-attention sub-layer, as BART's decoder does."""

    is_causal = True

    def __init__(self, config, layer_idx: int, num_heads: int, intermediate_size: int, cross_attention: bool):
        super().__init__(config, layer_idx, num_heads, intermediate_size)
        if cross_attention:
            self.cross_attn = VanillaAttention(config, num_heads, is_causal=False, layer_idx=layer_idx)
            self.cross_attn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask, encoder_hidden_states=None, encoder_attention_mask=None,
                past_key_values=None, output_attentions=False):
        hidden_states, self_weights = self._self_attn_block(hidden_states, attention_mask, past_key_values, None,
                                                            output_attentions)
        cross_weights = None
        if encoder_hidden_states is not None:
            attn_input = self._sublayer_input(hidden_states, self.cross_attn_norm)
            output, cross_weights = self.cross_attn(
                attn_input, key_value_states=encoder_hidden_states, attention_mask=encoder_attention_mask,
                past_key_values=past_key_values, output_attentions=output_attentions,
            )  # (B, T, E): each target position reads the whole source sentence
            hidden_states = self._residual(hidden_states, output, self.cross_attn_norm)
        return self._ffn_block(hidden_states), self_weights, cross_weights


# ----------------------------------------------------------------------------------------------------------------
# 5. The stack: masks, then embeddings and N layers
# ----------------------------------------------------------------------------------------------------------------


def additive_mask(mask, dtype):
    """1/0 (or bool) mask (..., S) -> 0 where attending is allowed, the dtype's minimum where it is not.

    A query that may attend to nothing (a row that is all padding) is let attend to every key instead: its output
    is meaningless either way, but a row of minima overflows to -inf in float16 (score + min < -65504) and the
    softmax of an all -inf row is NaN."""
    allowed = mask.bool()
    allowed = allowed | ~allowed.any(-1, keepdim=True)  # (..., S): fully masked rows become fully open
    return (~allowed).to(dtype) * torch.finfo(dtype).min


def self_attention_mask(attention_mask, query_length, past_length, key_length, causal: bool, dtype, device):
    """The additive mask (B|1, 1, T|1, S) self-attention adds to its scores, or None when nothing is hidden.

    - A 4-D mask is the caller's final word: used as given (True/1 = attend, or already additive).
    - A 2-D padding mask (B, S) hides padding keys.
    - Causal (the decoder, section 3.2.3): query t, at absolute position past_length + t, sees keys
      0..past_length + t and never the future. A static cache holds `key_length` slots, the unused ones in the
      future of every query, so causality hides them too.
    """
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask.to(dtype) if attention_mask.is_floating_point() else additive_mask(attention_mask, dtype)
    padded = has_padding(attention_mask)
    if not causal:
        return additive_mask(attention_mask[:, None, None, :], dtype) if padded else None  # (B, 1, 1, S)
    if query_length == 1 and not padded and isinstance(past_length, int) and key_length == past_length + 1:
        return None  # one new token may see every key: nothing to mask
    query_pos = torch.arange(query_length, device=device) + past_length  # (T,)
    allowed = torch.arange(key_length, device=device)[None, :] <= query_pos[:, None]  # (T, S)
    allowed = allowed[None, None]  # (1, 1, T, S)
    if padded:
        keys = attention_mask.bool()  # (B, past + T)
        keys = nn.functional.pad(keys, (0, key_length - keys.shape[-1]))  # a static cache's unused slots
        allowed = allowed & keys[:, None, None, :]  # (B, 1, T, S)
    return additive_mask(allowed, dtype)


class VanillaStack(nn.Module):
    """Embeddings followed by N identical layers: the encoder (section 3.1, left) or the decoder (right).

    A padded encoder batch runs padding-free (packing.py): embeddings, projections and feed-forward on its real
    tokens only, attention within each sequence. The padded path stays for attention maps, decoders, 4-D masks
    and tracing/export, which need static shapes.
    """

    def __init__(self, config, is_decoder: bool = False, cross_attention: bool = False):
        super().__init__()
        self.config = config
        self.is_decoder = is_decoder
        self.cross_attention = cross_attention
        self.embeddings = VanillaEmbeddings(config)
        if is_decoder and hasattr(config, "decoder_layers"):  # the encoder-decoder's decoder has sizes of its own
            num_layers, heads, ffn = config.decoder_layers, config.decoder_attention_heads, config.decoder_intermediate_size
        else:
            num_layers, heads, ffn = config.num_hidden_layers, config.num_attention_heads, config.intermediate_size
        if is_decoder:
            layers = (VanillaDecoderLayer(config, i, heads, ffn, cross_attention) for i in range(num_layers))
        else:
            layers = (VanillaEncoderLayer(config, i, heads, ffn) for i in range(num_layers))
        self.layers = nn.ModuleList(layers)
        # Pre-LN leaves the last residual stream un-normalised; post-LN already ends on a LayerNorm.
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.pre_norm else None

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        past_key_values=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        **kwargs,
    ):
        """Returns a `BaseModelOutputWithPastAndCrossAttentions` (generate needs a ModelOutput of the encoder);
        the public models honour `return_dict`."""
        config = self.config
        output_attentions = config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = config.output_hidden_states if output_hidden_states is None else output_hidden_states
        use_cache = self.is_decoder and (config.use_cache if use_cache is None else use_cache)
        if use_cache and past_key_values is None:
            past_key_values = EncoderDecoderCache(DynamicCache(), DynamicCache()) if self.cross_attention else DynamicCache()
        cache, past_length = self_attention_cache(past_key_values)  # this stack's own keys and values, and their count
        check_inputs(config, is_decoder=self.is_decoder, input_ids=input_ids, inputs_embeds=inputs_embeds,
                     token_type_ids=token_type_ids, position_ids=position_ids, attention_mask=attention_mask,
                     past_length=past_length, cache=cache, encoder_hidden_states=encoder_hidden_states,
                     encoder_attention_mask=encoder_attention_mask)
        inputs = input_ids if input_ids is not None else inputs_embeds
        B, T = inputs.shape[:2]
        key_length = cache.get_mask_sizes(T, 0)[0] if cache is not None else T
        if position_ids is None:
            start = config.position_offset + past_length  # a tensor only for a static cache while tracing
            position_ids = (torch.arange(start, start + T, device=inputs.device) if isinstance(start, int)
                            else torch.arange(T, device=inputs.device) + start)
        # (T,) or (1, T), shared by every row, -> (B, T): the packed path gathers them token by token.
        position_ids = position_ids.expand(B, T)
        token_type_ids = token_type_ids.expand(B, T) if token_type_ids is not None else None

        packed = PackedBatch(attention_mask) if not self.is_decoder and can_pack(attention_mask, output_attentions) else None
        if packed is not None:  # (B, T) -> (N,): the real tokens alone
            input_ids, position_ids, token_type_ids, inputs_embeds = map(
                packed.pack, (input_ids, position_ids, token_type_ids, inputs_embeds))
        hidden_states = self.embeddings(input_ids, position_ids, token_type_ids, inputs_embeds)  # (B, T, E) or (N, E)
        if packed is None:
            mask = self_attention_mask(attention_mask, T, past_length, key_length, self.is_decoder,
                                       hidden_states.dtype, hidden_states.device)
            if inputs_embeds is not None and has_padding(attention_mask) and attention_mask.dim() == 2:
                # Padding keys get zero weight, but 0 * NaN is NaN: a NaN the caller left at padding would spread.
                hidden_states = hidden_states.masked_fill(~attention_mask[:, -T:, None].bool(), 0)
        cross_mask = None
        if encoder_attention_mask is not None:
            cross_mask = additive_mask(encoder_attention_mask[:, None, None, :], hidden_states.dtype)  # (B, 1, 1, S)

        all_hidden_states, all_self, all_cross = [hidden_states], [], []
        for layer in self.layers:
            if self.is_decoder:
                # The cache by keyword: under gradient checkpointing the layer's wrapper drops it (a recomputed
                # forward would write it twice). Tensors that need gradients stay positional, as reentrant
                # checkpointing needs.
                hidden_states, self_weights, cross_weights = layer(
                    hidden_states, mask, encoder_hidden_states, cross_mask, past_key_values=past_key_values,
                    output_attentions=output_attentions,
                )
                all_cross.append(cross_weights)
            else:
                hidden_states, self_weights = layer(
                    hidden_states, None if packed else mask, seq_lens=packed.seq_lens if packed else None,
                    output_attentions=output_attentions,
                )
            all_hidden_states.append(hidden_states)
            all_self.append(self_weights)
        if self.final_norm is not None:
            hidden_states = all_hidden_states[-1] = self.final_norm(hidden_states)
        if packed is not None:  # (N, E) -> (B, T, E), zeros at padding
            hidden_states = packed.unpack(hidden_states)
            all_hidden_states = list(map(packed.unpack, all_hidden_states)) if output_hidden_states else None
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values if use_cache else None,
            hidden_states=tuple(all_hidden_states) if output_hidden_states else None,
            attentions=tuple(all_self) if output_attentions else None,
            cross_attentions=tuple(all_cross) if output_attentions and encoder_hidden_states is not None else None,
        )


# ----------------------------------------------------------------------------------------------------------------
# 6. Models: the shared base, then each family's body and its heads
# ----------------------------------------------------------------------------------------------------------------


class VanillaPreTrainedModel(PreTrainedModel):
    """Weight initialisation, the capabilities transformers and Accelerate read, and what every head shares: its
    losses and the building of its output."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _no_split_modules = ["VanillaEmbeddings", "VanillaEncoderLayer", "VanillaDecoderLayer"]  # narrowed in post_init
    _skip_keys_device_placement = ["past_key_values"]
    # One graph per shape: checks of values and the padding-free path step aside while tracing, and a static cache's
    # length is read from the cache, so `generate` may compile the forward (tests/test_heads.py compiles a step).
    _can_compile_fullgraph = True
    # Our losses are per-batch means and ignore `num_items_in_batch`. Without this, Trainer sees `**kwargs` in
    # forward, assumes the loss is already normalised for gradient accumulation and skips dividing by the number of
    # accumulated steps: every update (and logged loss) would be that many times too large.
    accepts_loss_kwargs = False

    @classmethod
    def from_pretrained(cls, *args, runtime: str | None = None, runtime_options: dict | None = None, **kwargs):
        """transformers' `from_pretrained`, with one more option: `runtime="onnxruntime"` runs the encoder on ONNX
        Runtime wherever that gives the same answer, and PyTorch elsewhere; `runtime_options` go to the engine (ONNX
        Runtime's: `cache_dir`, `threads`). The engine is found by name in runtime_registry.py and wraps the loaded
        model from beside it (hf_vanilla/runtimes/, docs/deploy.md; it needs the onnx extra). For small requests on
        small models."""
        model = super().from_pretrained(*args, **kwargs)
        return model if runtime is None else apply_runtime(model, runtime, **(runtime_options or {}))

    def __init__(self, config, *inputs, **kwargs):
        # A config may be inconsistent while it is filled in field by field (as BertConfig allows); a model needs a
        # consistent one, checked here before any weight is allocated.
        config.check_architecture()
        super().__init__(config, *inputs, **kwargs)

    def post_init(self):
        # The units device maps and FSDP must not cut are the blocks this model holds: Accelerate's FSDP auto-wrap
        # refuses a listed class the model lacks (an encoder has no decoder layer; BERT's causal LM no encoder one).
        self._no_split_modules = sorted({type(m).__name__ for m in self.modules()
                                         if isinstance(m, (VanillaEmbeddings, GradientCheckpointingLayer))})
        super().post_init()

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, VanillaEmbeddings) and hasattr(module, "position_table"):
            # Non-persistent buffers come back uninitialised from `from_pretrained`: recompute the sinusoids.
            table = sinusoidal_position_table(*module.position_table.shape, self.config.sinusoidal_layout)
            module.position_table.copy_(table.to(module.position_table.device))
        elif isinstance(module, VanillaLMHead):
            module.decoder.bias.zero_()

    def get_output_embeddings(self):
        """The output projection of the heads that predict tokens (tied to the token embeddings); None elsewhere."""
        return self.lm_head.decoder if hasattr(self, "lm_head") else None

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    def _output(self, output_class, body_output, return_dict, **head_fields):
        """A head's output: `output_class` holding the head's own fields (loss, logits, ...) and, for every other
        field, the body's field of that name (hidden states, attentions, the cache, the encoder's states); as a
        tuple where the caller (or the config) asks for one."""
        carried = {name: getattr(body_output, name, None) for name in output_class.__dataclass_fields__}
        output = output_class(**(carried | head_fields))
        return output if (self.config.return_dict if return_dict is None else return_dict) else output.to_tuple()

    def _causal_lm_loss(self, logits, labels, shift_labels=None):
        """Next-token cross-entropy: position t against labels[t + 1], or against `shift_labels[t]` when the caller
        shifted them already (as sequence and context parallelism must, each process holding a slice)."""
        if labels is None and shift_labels is None:
            return None
        check_labels(shift_labels, self.config.vocab_size, "vocab_size")
        return self.loss_function(logits, labels, vocab_size=self.config.vocab_size, shift_labels=shift_labels)

    def _classification_loss(self, logits, labels):
        """Sequence classification's loss: regression (MSE), single-label (cross-entropy) or multi-label (binary
        cross-entropy), by `config.problem_type`, which transformers sets from the first labels it sees."""
        return None if labels is None else self.loss_function(labels=labels, pooled_logits=logits, config=self.config)


def cross_entropy(logits, labels):
    """Cross-entropy of (..., C) logits against (...) class ids, -100 skipped: the loss of every head that picks
    one class per position or per sequence (masked and generated tokens, entities, next sentence, choices)."""
    if labels is None:
        return None
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device))


def span_logits(qa_outputs, hidden_states):
    """Extractive QA: a start and an end score per token, (B, T, E) -> two (B, T); the answer is the best span."""
    start_logits, end_logits = qa_outputs(hidden_states).unbind(-1)  # (B, T, 2) -> 2 x (B, T)
    return start_logits.contiguous(), end_logits.contiguous()


def classifier_layers(config, num_outputs: int):
    """BERT's classification layer: dropout (`classifier_dropout`, or the hidden dropout when unset), then a linear
    map (..., E) -> (..., num_outputs). A head holds the two as `dropout` and `classifier`, BERT's names, which its
    checkpoints' keys follow."""
    rate = config.hidden_dropout_prob if config.classifier_dropout is None else config.classifier_dropout
    return nn.Dropout(rate), VanillaLinear(config.hidden_size, num_outputs)


class VanillaLMHead(nn.Module):
    """Scores every vocabulary entry at every position: (..., E) -> (..., V).

    The output projection is the token embedding matrix (section 3.4), tied by `_tied_weights_keys`. BERT first
    applies dense + activation + LayerNorm (`transform`); the paper projects directly.
    """

    def __init__(self, config, transform: bool):
        super().__init__()
        if transform:
            self.dense = VanillaLinear(config.hidden_size, config.embedding_size)
            self.act = ACT2FN[config.hidden_act]
            self.norm = nn.LayerNorm(config.embedding_size, eps=config.layer_norm_eps)
        self.transform = transform
        self.decoder = VanillaLinear(config.embedding_size if transform else config.hidden_size, config.vocab_size)

    def forward(self, hidden_states):
        if self.transform:
            hidden_states = self.norm(self.act(self.dense(hidden_states)))
        return self.decoder(hidden_states)


# ---- the BERT-style encoder and its heads ----------------------------------------------------------------------


class VanillaEncoderModel(VanillaPreTrainedModel):
    """The BERT-style encoder: embeddings, N encoder layers and (optionally) BERT's pooler.

    The pooler, tanh(W h_0 + b) over the first ([CLS]) token, is what BERT's next-sentence objective trained as a
    sentence representation; the heads that classify whole sequences read it, the others are built without it.
    With `config.is_decoder` the layers are masked to the past: BERT's causal language model.
    """

    config_class = VanillaEncoderConfig

    def __init__(self, config: VanillaEncoderConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.encoder = VanillaStack(config, is_decoder=config.is_decoder)
        use_pooler = add_pooling_layer and config.use_pooler
        self.pooler = VanillaLinear(config.hidden_size, config.hidden_size) if use_pooler else None
        self.post_init()

    def get_input_embeddings(self):
        return self.encoder.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.encoder.embeddings.word_embeddings = value

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, past_key_values=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, **kwargs):
        """input_ids, attention_mask, token_type_ids: (B, T). Returns last_hidden_state (B, T, E), pooler_output
        (B, E), and per layer the hidden states (B, T, E) and attention weights (B, H, T, T) when asked."""
        out = self.encoder(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                           past_key_values=past_key_values, use_cache=use_cache, output_attentions=output_attentions,
                           output_hidden_states=output_hidden_states)
        pooled = torch.tanh(self.pooler(out.last_hidden_state[:, 0])) if self.pooler is not None else None  # (B, E)
        return self._output(BaseModelOutputWithPoolingAndCrossAttentions, out, return_dict, pooler_output=pooled)


class VanillaEncoderPreTrainedModel(VanillaPreTrainedModel):
    """What every encoder head shares: the encoder as `self.model`, with BERT's pooler only when the head reads it
    (`uses_pooler`): a pooler nobody reads would be computed on every forward and never trained."""

    config_class = VanillaEncoderConfig
    uses_pooler = False

    def __init__(self, config: VanillaEncoderConfig):
        super().__init__(config)
        self.model = VanillaEncoderModel(config, add_pooling_layer=self.uses_pooler)

    def _encode(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions,
                output_hidden_states, **cache):
        """The encoder's output for the head to read, always a ModelOutput (the head returns its own as a tuple
        where asked). `cache`: the causal LM's `past_key_values` and `use_cache`."""
        return self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **cache,
                          output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                          return_dict=True)

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

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, output_attentions=None, output_hidden_states=None, return_dict=None, **kwargs):
        """labels: (B, T), the original token at masked positions and -100 elsewhere. Returns logits (B, T, V)."""
        check_labels(labels, self.config.vocab_size, "vocab_size")
        out = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions,
                           output_hidden_states)
        logits = self.lm_head(out.last_hidden_state)  # (B, T, V)
        return self._output(MaskedLMOutput, out, return_dict, loss=cross_entropy(logits, labels), logits=logits)


class VanillaEncoderForCausalLM(VanillaEncoderPreTrainedModel, GenerationMixin):
    """BERT's causal language model (transformers' `BertLMHeadModel`): the encoder masked to the past, with the
    masked-LM head predicting the next token, and `generate()` with a key/value cache.

    It is causal whatever the config says (its copy has `is_decoder=True`): BERT's own class runs bidirectionally
    without the flag, a language model that reads the tokens it predicts."""

    _tied_weights_keys = VanillaEncoderForMaskedLM._tied_weights_keys

    def __init__(self, config: VanillaEncoderConfig):
        if not config.is_decoder:
            config = copy.deepcopy(config)
            config.is_decoder = True
        super().__init__(config)
        self.lm_head = VanillaLMHead(config, transform=True)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                past_key_values=None, labels=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **kwargs):
        """labels: (B, T), usually input_ids: position t is scored on predicting token t + 1 (the shift is here).
        Returns logits (B, T, V) and, with `use_cache`, the key/value cache for the next step."""
        check_labels(labels, self.config.vocab_size, "vocab_size")
        out = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions,
                           output_hidden_states, past_key_values=past_key_values, use_cache=use_cache)
        logits = self.lm_head(out.last_hidden_state)  # (B, T, V)
        loss = self._causal_lm_loss(logits, labels, kwargs.get("shift_labels"))
        return self._output(CausalLMOutputWithCrossAttentions, out, return_dict, loss=loss, logits=logits)


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

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, next_sentence_label=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **kwargs):
        """labels: (B, T) masked-LM targets (-100 elsewhere); next_sentence_label: (B,). The loss is their sum,
        when both are given. Returns prediction_logits (B, T, V) and seq_relationship_logits (B, 2)."""
        check_labels(labels, self.config.vocab_size, "vocab_size")
        check_labels(next_sentence_label, 2, "the two next-sentence classes")
        out = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions,
                           output_hidden_states)
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

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, output_attentions=None, output_hidden_states=None, return_dict=None, **kwargs):
        """labels: (B,), 0 where B follows A, 1 where B is random. Returns logits (B, 2)."""
        check_labels(labels, 2, "the two next-sentence classes")
        out = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions,
                           output_hidden_states)
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

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, output_attentions=None, output_hidden_states=None, return_dict=None, **kwargs):
        """labels: (B,) class ids, (B,) floats for regression or (B, num_labels) for multi-label. Returns logits
        (B, num_labels)."""
        check_sequence_labels(self.config, labels)
        out = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions,
                           output_hidden_states)
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

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, output_attentions=None, output_hidden_states=None, return_dict=None, **kwargs):
        """input_ids, attention_mask, token_type_ids: (B, C, T); labels: (B,) the index of the right choice.
        Returns logits (B, C)."""
        B, C = check_choices(input_ids, inputs_embeds)
        check_labels(labels, C, "the number of choices")

        def flat(x):  # (B, C, T, ...) -> (B * C, T, ...): every choice is a sequence of its own
            return None if x is None else x.reshape(B * C, *x.shape[2:])

        out = self._encode(*map(flat, (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)),
                           output_attentions, output_hidden_states)
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

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, output_attentions=None, output_hidden_states=None, return_dict=None, **kwargs):
        """labels: (B, T) with -100 where no label applies. Returns logits (B, T, num_labels)."""
        check_labels(labels, self.num_labels, "num_labels")
        out = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions,
                           output_hidden_states)
        logits = self.classifier(self.dropout(out.last_hidden_state))  # (B, T, num_labels)
        return self._output(TokenClassifierOutput, out, return_dict, loss=cross_entropy(logits, labels), logits=logits)


class VanillaEncoderForQuestionAnswering(VanillaEncoderPreTrainedModel):
    """Extractive QA: a start score and an end score for every token; the answer is the best-scoring span."""

    def __init__(self, config: VanillaEncoderConfig):
        super().__init__(config)
        self.qa_outputs = VanillaLinear(config.hidden_size, 2)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                start_positions=None, end_positions=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **kwargs):
        """start_positions, end_positions: (B,) token indices of the answer span (outside the input: ignored).
        Returns start_logits and end_logits, (B, T) each."""
        out = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions,
                           output_hidden_states)
        start_logits, end_logits = span_logits(self.qa_outputs, out.last_hidden_state)
        loss = self.loss_function(start_logits, end_logits, start_positions, end_positions)
        return self._output(QuestionAnsweringModelOutput, out, return_dict, loss=loss, start_logits=start_logits,
                            end_logits=end_logits)


class VanillaReplacedTokenHead(nn.Module):
    """One logit per token, "was this token replaced?": dense + activation + a dense to one output, (..., E) -> (...).
    Its own module, so that its weights (`rtd_head.*`) never pass for a classification head's `classifier`."""

    def __init__(self, config):
        super().__init__()
        self.dense = VanillaLinear(config.hidden_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]
        self.prediction = VanillaLinear(config.hidden_size, 1)

    def forward(self, hidden_states):
        return self.prediction(self.act(self.dense(hidden_states))).squeeze(-1)  # (..., 1) -> (...)


def replaced_token_loss(logits, labels, attention_mask):
    """ELECTRA's loss: binary cross-entropy of the (B, T) logits against 1 (replaced) / 0 (original), over real
    tokens only: padding is neither original nor replaced."""
    if labels is None:
        return None
    labels = labels.to(logits.device)
    real = torch.ones_like(labels, dtype=torch.bool) if attention_mask is None else attention_mask == 1
    return nn.functional.binary_cross_entropy_with_logits(logits[real], labels[real].to(logits.dtype))


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

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, output_attentions=None, output_hidden_states=None, return_dict=None, **kwargs):
        """labels: (B, T), 1 where the token was replaced and 0 where it is the original. Returns logits (B, T):
        one score per token (a `TokenClassifierOutput` with a single, squeezed label)."""
        out = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions,
                           output_hidden_states)
        logits = self.rtd_head(out.last_hidden_state)  # (B, T)
        loss = replaced_token_loss(logits, labels, attention_mask)
        return self._output(TokenClassifierOutput, out, return_dict, loss=loss, logits=logits)


# ---- the encoder-decoder and its heads -------------------------------------------------------------------------


def shift_tokens_right(labels, pad_token_id: int, decoder_start_token_id: int):
    """Teacher forcing: the decoder reads the target shifted one step right, starting from the start token, and
    learns to predict the unshifted target. -100 (ignored) label positions are read as padding."""
    shifted = labels.new_zeros(labels.shape)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == -100, pad_token_id)


class VanillaSeq2SeqModel(VanillaPreTrainedModel):
    """The encoder-decoder without an output head: source (B, S) and target (B, T) -> decoder states (B, T, E).

    Without a target, the decoder reads the source shifted right (BART's convention, which its sequence
    classification and question-answering heads rely on)."""

    config_class = VanillaSeq2SeqConfig

    def __init__(self, config: VanillaSeq2SeqConfig):
        super().__init__(config)
        self.encoder = VanillaStack(config)
        self.decoder = VanillaStack(config, is_decoder=True, cross_attention=True)
        if config.share_encoder_decoder_embeddings:
            self._tied_weights_keys = {
                "decoder.embeddings.word_embeddings.weight": "encoder.embeddings.word_embeddings.weight"
            }
        self.post_init()

    def get_input_embeddings(self):
        return self.encoder.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.encoder.embeddings.word_embeddings = value
        if self.config.share_encoder_decoder_embeddings:
            self.decoder.embeddings.word_embeddings = value

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, past_key_values=None, token_type_ids=None, inputs_embeds=None,
                decoder_inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **kwargs):
        """`token_type_ids` reach the encoder only: `generate` passes them to every step, and the decoder has no
        segments. `encoder_outputs` may be a tuple (last_hidden_state, hidden_states, attentions), as from
        `return_dict=False`. Returns the decoder's last_hidden_state (B, T, E), the encoder's (B, S, E), and the
        cache, hidden states and attention weights of both stacks when asked."""
        if decoder_input_ids is None and decoder_inputs_embeds is None and input_ids is not None:
            decoder_input_ids = shift_tokens_right(input_ids, self.config.pad_token_id,
                                                   self.config.decoder_start_token_id)
        if encoder_outputs is None:
            # The target is checked first, so that a bad target stops the call before the encoder's kernels run.
            check_target(self.config, decoder_input_ids, decoder_inputs_embeds, decoder_attention_mask, past_key_values)
            encoder_outputs = self.encoder(input_ids, attention_mask, token_type_ids, inputs_embeds=inputs_embeds,
                                           output_attentions=output_attentions,
                                           output_hidden_states=output_hidden_states)
        elif not isinstance(encoder_outputs, ModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        decoder_out = self.decoder(
            decoder_input_ids, decoder_attention_mask, inputs_embeds=decoder_inputs_embeds,
            encoder_hidden_states=encoder_outputs.last_hidden_state, encoder_attention_mask=attention_mask,
            past_key_values=past_key_values, use_cache=use_cache, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
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


class VanillaSeq2SeqForConditionalGeneration(VanillaSeq2SeqPreTrainedModel, GenerationMixin):
    """The encoder-decoder with its output projection: P(next target token | source, target so far), trained with
    teacher forcing and sampled with `generate()` (greedy, beam search, sampling, with a key/value cache)."""

    def __init__(self, config: VanillaSeq2SeqConfig):
        super().__init__(config)
        self.lm_head = VanillaLMHead(config, transform=config.lm_head_transform)
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
            target.word_embeddings = self._get_resized_embeddings(
                target.word_embeddings, new_num_tokens, pad_to_multiple_of, mean_resizing
            )
        return super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, past_key_values=None, token_type_ids=None, inputs_embeds=None,
                decoder_inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, **kwargs):
        """labels: (B, T) target ids, -100 where ignored; the decoder input is `labels` shifted right.
        Returns logits (B, T, V) and, with `use_cache`, the key/value cache for the next step."""
        check_labels(labels, self.config.vocab_size, "vocab_size")
        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            decoder_input_ids = shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)
            use_cache = False
        out = self.model(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs,
                         past_key_values, token_type_ids, inputs_embeds, decoder_inputs_embeds, use_cache,
                         output_attentions, output_hidden_states, return_dict=True)
        logits = self.lm_head(out.last_hidden_state)  # (B, T, V)
        return self._output(Seq2SeqLMOutput, out, return_dict, loss=cross_entropy(logits, labels), logits=logits)


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

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, token_type_ids=None, labels=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, **kwargs):
        """input_ids: (B, S), each row with the same number of `eos_token_id`s. Returns logits (B, num_labels)."""
        check_eos_tokens(input_ids, self.config.eos_token_id)
        check_sequence_labels(self.config, labels)
        out = self.model(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs,
                         token_type_ids=token_type_ids, use_cache=False, output_attentions=output_attentions,
                         output_hidden_states=output_hidden_states, return_dict=True)
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

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, token_type_ids=None, start_positions=None, end_positions=None,
                inputs_embeds=None, decoder_inputs_embeds=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **kwargs):
        """start_positions, end_positions: (B,) token indices of the answer span. Returns start_logits and
        end_logits, (B, T) each."""
        out = self.model(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs,
                         token_type_ids=token_type_ids, inputs_embeds=inputs_embeds, use_cache=False,
                         decoder_inputs_embeds=decoder_inputs_embeds, output_attentions=output_attentions,
                         output_hidden_states=output_hidden_states, return_dict=True)
        start_logits, end_logits = span_logits(self.qa_outputs, out.last_hidden_state)
        loss = self.loss_function(start_logits, end_logits, start_positions, end_positions)
        return self._output(Seq2SeqQuestionAnsweringModelOutput, out, return_dict, loss=loss,
                            start_logits=start_logits, end_logits=end_logits)


# ---- the decoder alone: a causal language model ----------------------------------------------------------------


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

    def __init__(self, config: VanillaSeq2SeqConfig):
        super().__init__(_decoder_only(config))
        self.decoder = VanillaStack(self.config, is_decoder=True)
        self.post_init()

    def get_input_embeddings(self):
        return self.decoder.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.decoder.embeddings.word_embeddings = value

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, past_key_values=None, use_cache=None,
                output_attentions=None, output_hidden_states=None, return_dict=None, **kwargs):
        """input_ids, attention_mask: (B, T). Returns last_hidden_state (B, T, E) and, when asked, the cache and
        the hidden states and attention weights of every layer. Positions count from the start of the input,
        padding included, as BartForCausalLM's do (it takes no `position_ids`, so neither does this: `generate`
        would pass positions without the table's offset)."""
        out = self.decoder(input_ids, attention_mask, inputs_embeds=inputs_embeds,
                           past_key_values=past_key_values, use_cache=use_cache, output_attentions=output_attentions,
                           output_hidden_states=output_hidden_states)
        return self._output(BaseModelOutputWithPastAndCrossAttentions, out, return_dict)


class VanillaDecoderForCausalLM(VanillaPreTrainedModel, GenerationMixin):
    """The decoder alone with its output projection: P(next token | tokens so far), trained on shifted labels and
    sampled with `generate()`. The third transformer family, next to the encoder and the encoder-decoder."""

    config_class = VanillaSeq2SeqConfig
    _tied_weights_keys = {"lm_head.decoder.weight": "model.decoder.embeddings.word_embeddings.weight"}

    def __init__(self, config: VanillaSeq2SeqConfig):
        super().__init__(_decoder_only(config))
        self.model = VanillaDecoderModel(self.config)
        self.lm_head = VanillaLMHead(self.config, transform=self.config.lm_head_transform)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, past_key_values=None, labels=None,
                use_cache=None, output_attentions=None, output_hidden_states=None, return_dict=None, **kwargs):
        """labels: (B, T), usually input_ids: position t is scored on predicting token t + 1 (the shift is here).
        Returns logits (B, T, V) and, with `use_cache`, the key/value cache for the next step."""
        check_labels(labels, self.config.vocab_size, "vocab_size")
        out = self.model(input_ids, attention_mask, inputs_embeds, past_key_values, use_cache,
                         output_attentions, output_hidden_states, return_dict=True)
        logits = self.lm_head(out.last_hidden_state)  # (B, T, V)
        loss = self._causal_lm_loss(logits, labels, kwargs.get("shift_labels"))
        return self._output(CausalLMOutputWithCrossAttentions, out, return_dict, loss=loss, logits=logits)


__all__ = [
    "VanillaPreTrainedModel",
    "VanillaEncoderModel",
    "VanillaEncoderForMaskedLM",
    "VanillaEncoderForCausalLM",
    "VanillaEncoderForPreTraining",
    "VanillaEncoderForNextSentencePrediction",
    "VanillaEncoderForSequenceClassification",
    "VanillaEncoderForMultipleChoice",
    "VanillaEncoderForTokenClassification",
    "VanillaEncoderForQuestionAnswering",
    "VanillaEncoderForReplacedTokenDetection",
    "VanillaSeq2SeqModel",
    "VanillaSeq2SeqForConditionalGeneration",
    "VanillaSeq2SeqForSequenceClassification",
    "VanillaSeq2SeqForQuestionAnswering",
    "VanillaDecoderModel",
    "VanillaDecoderForCausalLM",
]
