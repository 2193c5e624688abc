"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017, https://arxiv.org/abs/1706.03762),
written to be read, and loadable with BERT's weights.

Contents, in the order a token meets them (the paper's section numbers in brackets):
    1. Embeddings ......... token + position (+ segment) embeddings                        (sections 3.4, 3.5)
    2. Attention .......... scaled dot-product attention, multi-head attention            (section 3.2)
    3. Feed-forward ....... the position-wise network                                     (section 3.3)
    4. Layers ............. encoder layer; decoder layer = encoder layer + cross-attention (section 3.1)
    5. Stack .............. the batch's plan, embeddings, masks, then N layers             (sections 3.1, 3.2.3)

Shape key, used in every comment:
    B batch size     T query length     S key/value length     N real (non-padding) tokens in a batch
    H heads          D head size (E/H)  E model width          F feed-forward width     V vocabulary size

Masks: callers pass Hugging Face's `attention_mask` (B, S) of 1 = token, 0 = padding (or a 4-D mask, as
transformers builds them). It is converted once, at the stack's boundary, into an additive mask (B, 1, T|1, S) of
0 (attend) and the dtype's minimum (do not attend), the one convention used inside.

Where BERT departs from the paper (GELU, learned positions, segment embeddings, LayerNorm on the embeddings,
epsilon 1e-12, a pooler), the config switches it; the comments say why. This file holds the ideas and nothing else:
the Hugging Face models built on them are in `modeling_vanilla.py` (their base) and one module per family
(`modeling_encoder.py`, `modeling_seq2seq.py`, `modeling_decoder.py`), and the machinery beside it, one call each:
`masks.py` (every mask), `kernels.py` (which matmul kernel runs a projection), `packing.py` (the batch's plan, and
padded batches run without their padding), `validation.py` (bad input refused before any kernel runs) and
`compat.py` (what differs between transformers versions).
"""

import math

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .compat import CACHE_FIELD, cache_field, flex_attention_forward
from .kernels import VanillaLinear, is_tracing
from .masks import attends, has_padding, padded_path_masks
from .packing import attend_within_sequences, plan_batch, positions_within
from .validation import check_inputs, positions_counted_from_zero, self_attention_cache

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
    arithmetic as `eager_attention_forward`, without materialising the weights. transformers' own sdpa function
    wraps this kernel in cases this model never has (grouped-query heads, paged caches, causality guessed from
    `module.is_causal`); calling it directly saves that Python on every attention call, a measurable share of a
    16-token request. Masks here are always explicit: `is_causal` stays off.

    Returns: context (B, T, H, D) and None (no weights are formed).
    """
    context = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )  # (B, H, T, D)
    if attention_mask is not None and is_tracing():  # a query with no key gets zeros, as the kernel gives an -inf
        context = context.masked_fill(~attends(attention_mask), 0)  # row; a graph keeps finite minima there (masks.additive_mask)
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
    if implementation == "flex_attention":
        return flex_attention_forward  # transformers' own, on inputs torch 2.15 reads right (compat.py)
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
                seq_lens=None, key_seq_lens=None, output_attentions=False):
        """hidden_states: (B, T, E), or (N, E) packed with `seq_lens` (the length of each sequence, summing to N).
        key_value_states: (B, S, E) encoder output for cross-attention, or (M, E) packed with `key_seq_lens`
        (sequence i of the target reads sequence i of the source). Returns (output like hidden_states, weights).
        """
        attention_fn = attention_function(self.config._attn_implementation, output_attentions)
        dropout = self.dropout if self.training else 0.0
        H, D = self.num_heads, self.head_dim
        if seq_lens is not None:  # padding-free: sequences laid end to end, attention within each (packing.py)
            source = hidden_states if key_value_states is None else key_value_states
            query = self.q_proj(hidden_states).view(-1, H, D)  # (N, H, D)
            key, value = (proj(source).view(-1, H, D) for proj in (self.k_proj, self.v_proj))  # (M, H, D)
            context = attend_within_sequences(attention_fn, self, query=query, key=key, value=value, seq_lens=seq_lens,
                                              key_lens=key_seq_lens or seq_lens, causal=self.is_causal,
                                              dropout=dropout, scaling=self.scaling)
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
        hidden_states, weights = self._self_attn_block(hidden_states, attention_mask, past_key_values=None,
                                                       seq_lens=seq_lens, output_attentions=output_attentions)
        return self._ffn_block(hidden_states), weights

    def _residual(self, residual, sublayer_output, norm):
        if self.training:  # dropout is the identity in eval mode; not calling it saves its Python
            sublayer_output = self.dropout(sublayer_output)
        if self.pre_norm:
            return residual + sublayer_output
        return norm(residual + sublayer_output)

    def _sublayer_input(self, hidden_states, norm):
        return norm(hidden_states) if self.pre_norm else hidden_states

    def _self_attn_block(self, hidden_states, attention_mask, past_key_values, *, seq_lens, output_attentions):
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
                seq_lens=None, encoder_seq_lens=None, output_attentions=False, **cache):
        """Packed (packing.py): hidden_states (N, E) with `seq_lens`, encoder_hidden_states (M, E) with
        `encoder_seq_lens`. `cache`: the key/value cache, under the keyword transformers' gradient-checkpointing
        wrapper drops (a recomputed forward would write it twice): `cache` since transformers 5.24,
        `past_key_values` before."""
        past_key_values = cache.get(CACHE_FIELD)
        hidden_states, self_weights = self._self_attn_block(hidden_states, attention_mask, past_key_values,
                                                            seq_lens=seq_lens, output_attentions=output_attentions)
        cross_weights = None
        if encoder_hidden_states is not None:
            attn_input = self._sublayer_input(hidden_states, self.cross_attn_norm)
            output, cross_weights = self.cross_attn(
                attn_input, key_value_states=encoder_hidden_states, attention_mask=encoder_attention_mask,
                past_key_values=past_key_values, seq_lens=seq_lens, key_seq_lens=encoder_seq_lens,
                output_attentions=output_attentions,
            )  # (B, T, E): each target position reads the whole source sentence
            hidden_states = self._residual(hidden_states, output, self.cross_attn_norm)
        return self._ffn_block(hidden_states), self_weights, cross_weights


# ----------------------------------------------------------------------------------------------------------------
# 5. The stack: the batch's plan, embeddings, masks, then N layers
# ----------------------------------------------------------------------------------------------------------------


class VanillaStack(nn.Module):
    """Embeddings followed by N identical layers: the encoder (section 3.1, left) or the decoder (right).

    Its forward reads as BertModel's: the input checked (validation.py), the batch planned once (packing.plan_batch:
    sequences, positions, which path), embeddings, the padded path's masks (masks.py), then the layers. A batch of
    sequences of different lengths runs padding-free (packing.py): embeddings, projections and feed-forward on its
    real tokens only, attention within each sequence (causal in the decoder; cross-attention to the same sequence's
    source), for a right-padded batch and for transformers' packed format (`DataCollatorWithFlattening`). The padded
    path stays for attention maps, the cache, 4-D masks, left padding, tracing, and losses that read padding.
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
            layers = (VanillaDecoderLayer(config, i, heads, ffn, cross_attention=cross_attention)
                      for i in range(num_layers))
        else:
            layers = (VanillaEncoderLayer(config, i, heads, ffn) for i in range(num_layers))
        self.layers = nn.ModuleList(layers)
        # Pre-LN leaves the last residual stream un-normalised; post-LN already ends on a LayerNorm.
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.pre_norm else None

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None, encoder_position_ids: torch.Tensor | None = None,
                past_key_values: Cache | None = None, use_cache: bool | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                outputs_at_padding: bool = False, **kwargs: Unpack[TransformersKwargs],
                ) -> BaseModelOutputWithPastAndCrossAttentions:
        """Checks, the batch's plan, embeddings, masks, then the N layers: a ModelOutput carrying the plan as `plan`
        outside tracing. `kwargs` may hold transformers' packed-format keywords; `encoder_position_ids` tell packed
        sources apart; `outputs_at_padding`: the caller reads the padding's outputs as the padded path computes them."""
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
                     encoder_attention_mask=encoder_attention_mask, packed_format=kwargs,
                     dtype=self.layers[0].self_attn_norm.weight.dtype)  # the token table's may be int8
        plan = plan_batch(tokens=input_ids if input_ids is not None else inputs_embeds, positions=self._positions,
                          position_ids=position_ids, attention_mask=attention_mask, packed_format=kwargs,
                          past_length=past_length, cached=past_key_values is not None,
                          output_attentions=output_attentions, outputs_at_padding=outputs_at_padding,
                          encoder_hidden_states=encoder_hidden_states, encoder_attention_mask=encoder_attention_mask,
                          encoder_position_ids=encoder_position_ids)
        hidden_states = self._embed(plan, input_ids, token_type_ids, inputs_embeds, attention_mask=attention_mask)
        sdpa = not output_attentions and config._attn_implementation == "sdpa"  # the kernel the masks are made for
        mask, cross_mask = padded_path_masks(plan, attention_mask, encoder_attention_mask, past_length=past_length,
                                             cache=cache, causal=self.is_decoder, like=hidden_states, sdpa=sdpa)
        memory = plan.pack_source(encoder_hidden_states)  # (B, S, E), or (M, E) beside a packed target
        # The N layers (section 3.1): each reads the previous one's output.
        all_hidden_states, all_self, all_cross = [hidden_states], [], []
        for layer in self.layers:
            if self.is_decoder:  # the cache by keyword: under gradient checkpointing the layer's wrapper drops it
                hidden_states, self_weights, cross_weights = layer(
                    hidden_states, mask, memory, cross_mask, seq_lens=plan.seq_lens,
                    encoder_seq_lens=plan.source_seq_lens, output_attentions=output_attentions,
                    **cache_field(past_key_values))
                all_cross.append(cross_weights)
            else:
                hidden_states, self_weights = layer(hidden_states, mask, seq_lens=plan.seq_lens,
                                                    output_attentions=output_attentions)
            all_hidden_states.append(hidden_states)
            all_self.append(self_weights)
        if self.final_norm is not None:
            hidden_states = all_hidden_states[-1] = self.final_norm(hidden_states)
        output = BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=plan.unpack(hidden_states),  # (N, E) -> (B, T, E), zeros at padding, where packed
            **cache_field(past_key_values if use_cache else None),
            hidden_states=tuple(map(plan.unpack, all_hidden_states)) if output_hidden_states else None,
            attentions=tuple(all_self) if output_attentions else None,
            cross_attentions=tuple(all_cross) if output_attentions and encoder_hidden_states is not None else None,
        )
        if not is_tracing():  # not a field: no tuple or dict of the output holds it, and a graph returns tensors
            output.plan = plan
        return output

    def _positions(self, position_ids, sequences, past_length, *, shape, device):
        """Each token's row in the position table, (B, T). Without `position_ids`, tokens count from the cache's
        length, or packed sequences from their own start (the table's `position_offset` first). Explicit ones are
        counted from 0 or are the table's rows, by the stack (validation.positions_counted_from_zero)."""
        B, T = shape
        offset = self.config.position_offset
        if position_ids is None and sequences is not None:
            position_ids = positions_within(sequences) + offset
        elif position_ids is None:
            start = offset + past_length  # a tensor only for a static cache while tracing
            position_ids = (torch.arange(start, start + T, device=device) if isinstance(start, int)
                            else torch.arange(T, device=device) + start)
        elif offset and positions_counted_from_zero(self.config, self.is_decoder):
            position_ids = position_ids + offset
        return position_ids.expand(B, T)  # (T,) or (1, T), shared by every row -> (B, T)

    def _embed(self, plan, input_ids, token_type_ids, inputs_embeds, attention_mask):
        """The first layer's input: (B, T, E), or (N, E) on the padding-free path (the real tokens alone)."""
        B, T = plan.shape
        token_type_ids = token_type_ids.expand(B, T) if token_type_ids is not None else None
        hidden_states = self.embeddings(input_ids=plan.pack(input_ids), position_ids=plan.pack(plan.positions),
                                        token_type_ids=plan.pack(token_type_ids),
                                        inputs_embeds=plan.pack(inputs_embeds))  # (B, T, E) or (N, E)
        padded_embeds = plan.packed is None and inputs_embeds is not None
        if padded_embeds and has_padding(attention_mask) and attention_mask.dim() == 2:
            # 0 * NaN is NaN: a NaN (or inf) the caller left at padding would spread through the padding keys' zero
            # weights. Only those are cleared (`generate` reads the last position even where it is padding).
            hidden_states = hidden_states.masked_fill(
                ~attention_mask[:, -T:, None].bool() & ~hidden_states.isfinite(), 0)
        return hidden_states
