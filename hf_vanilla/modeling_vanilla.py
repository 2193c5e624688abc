"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017, https://arxiv.org/abs/1706.03762),
written to be read, and loadable with BERT's weights.

Contents, in the paper's order, after one building block:
    0. Linear layer ....... nn.Linear, with a faster CPU kernel for inference
    1. Embeddings ......... token + position (+ segment) embeddings                        (sections 3.4, 3.5)
    2. Attention .......... scaled dot-product attention, multi-head attention            (section 3.2)
    3. Feed-forward ....... the position-wise network                                     (section 3.3)
    4. Layers ............. encoder layer; decoder layer = encoder layer + cross-attention (section 3.1)
    5. Stack .............. embeddings + N layers, masks, and the padding-free fast path
    6. Models ............. the BERT-style encoder and its heads; the encoder-decoder

Shape key, used in every comment:
    B batch size     T query length     S key/value length     N real (non-padding) tokens in a batch
    H heads          D head size (E/H)  E model width          F feed-forward width     V vocabulary size

Masks: callers pass Hugging Face's `attention_mask` (B, S) of 1 = token, 0 = padding. It is converted once, at the
stack's boundary, into an additive mask (B, 1, 1|T, S) of 0 (attend) and the dtype's minimum (do not attend), the
one convention used inside. A query with no key to attend to (a row that is all padding) attends to every key
instead of producing NaN (see `additive_mask`).

Where BERT departs from the paper (GELU, learned positions, segment embeddings, LayerNorm on the embeddings,
epsilon 1e-12, a pooler), the config switches it; the comments say why.
"""

import itertools
import math
import platform

import torch
from torch import nn
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import ModelOutput

from .configuration_vanilla import VanillaEncoderConfig, VanillaSeq2SeqConfig

# ----------------------------------------------------------------------------------------------------------------
# 0. Linear layer: every projection in the model
# ----------------------------------------------------------------------------------------------------------------


def _is_tracing() -> bool:
    return torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.jit.is_tracing()


def _is_transformed() -> bool:
    """Inside a torch.func transform (vmap, grad, jvp) or forward-mode AD, which see through nn.Linear's own kernel
    but not through oneDNN's op (under `no_grad`, jvp's tangents would silently come out zero)."""
    return torch._C._functorch.maybe_current_level() is not None or torch.autograd.forward_ad._current_level >= 0


# x86-64 only: where torch's float32 products otherwise go to MKL, the comparison measured (docs/performance.md).
_ONEDNN = (
    platform.machine().lower() in ("x86_64", "amd64")
    and torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)
# Below this many weights, oneDNN's fixed cost per call (~12 us, against MKL's ~3) outweighs what it saves. Measured in
# the models here: MiniLM's 384 x 384 projections gain, a 32-wide model loses, 256 x 256 is even.
_ONEDNN_MIN_WEIGHTS = 2**17


class VanillaLinear(nn.Linear):
    """nn.Linear: y = x W^T + b, with W stored (out_features, in_features) as in every BERT checkpoint.

    One difference: CPU float32 inference on a large weight runs oneDNN's matmul instead of the BLAS call behind
    `F.linear` (MKL's sgemm on x86 builds of torch). The same product of the same weights in another kernel, which
    differs only in the order it sums (outputs within ~1e-6). It matters because MKL is slow on the skinny products
    of small requests and generation: measured on this project's CPU (2 cores, AVX-512), oneDNN is 1.2-3x faster
    at 1-16 rows and 1.04-1.3x at 512-1024 (docs/performance.md). Everything else takes nn.Linear's own path:
    training (oneDNN's op has no backward), torch.func transforms and forward-mode AD, autocast, GPUs, other
    dtypes, nested inputs, tracing and export (graphs keep aten::linear), and tensor subclasses (quantized or
    sharded weights). As a subclass it stays an nn.Linear to everything that looks for one: PEFT, bitsandbytes,
    torchao, Accelerate's hooks.

    The test runs on every call, so it is written out inline: in a 16-token request its cost shows.
    """

    def forward(self, x):
        weight, bias = self.weight, self.bias
        if (
            _ONEDNN
            and self.in_features * self.out_features >= _ONEDNN_MIN_WEIGHTS
            and torch.backends.mkldnn.enabled  # users may turn oneDNN off: torch.backends.mkldnn.flags(enabled=False)
            and x.dtype == torch.float32
            and weight.dtype == torch.float32
            and x.is_cpu
            and weight.is_cpu
            and type(x) is torch.Tensor
            and not x.is_nested  # torch.nested's strided layout is a plain Tensor too
            and type(weight) in (nn.Parameter, torch.Tensor)
            # no autograd through it: the op has no backward (a trainable bias alone counts, as in BitFit)
            and not (torch.is_grad_enabled()
                     and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)))
            and not torch.is_autocast_enabled("cpu")
            and not _is_tracing()
            and not _is_transformed()
        ):
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return nn.functional.linear(x, weight, bias)


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


def attention_function(implementation: str):
    """The attention kernel for `config._attn_implementation`: ours for "sdpa" and "eager", transformers' registry
    for the others (flex_attention, flash_attention_2, kernels registered with `AttentionInterface`).
    (`set_attn_implementation` only switches models whose source calls `ALL_ATTENTION_FUNCTIONS.get_interface(`.)"""
    if implementation == "sdpa":
        return sdpa_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)


class VanillaAttention(nn.Module):
    """Multi-head attention: MultiHead(Q, K, V) = Concat(head_1..head_H) W^O, head_i = Attention(Q W_i^Q, ...).

    One class serves all three uses in the paper (section 3.2.3): encoder self-attention `attn(x)`, masked decoder
    self-attention (the same, with `is_causal=True`), and cross-attention `attn(x, key_value_states=memory)`.
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

    def forward(self, hidden_states, key_value_states=None, attention_mask=None, past_key_values=None, seq_lens=None):
        """hidden_states: (B, T, E), or (N, E) packed with `seq_lens` (the length of each sequence, summing to N).
        key_value_states: (B, S, E) encoder output for cross-attention. Returns (output like hidden_states, weights).
        """
        attention_fn = attention_function(self.config._attn_implementation)
        dropout = self.dropout if self.training else 0.0
        if seq_lens is not None:
            return self._packed_forward(hidden_states, seq_lens, attention_fn, dropout), None

        B, T, E = hidden_states.shape
        H, D = self.num_heads, self.head_dim
        query = self.q_proj(hidden_states).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D): heads are slices of E
        key, value = self._key_value(hidden_states, key_value_states, past_key_values)  # (B, H, S, D) each
        context, weights = attention_fn(self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling)
        context = context.reshape(B, T, E)  # (B, T, H, D) -> (B, T, E): Concat(head_1..head_H)
        return self.o_proj(context), weights

    def _key_value(self, hidden_states, key_value_states, past_key_values):
        """Project keys and values, reusing or extending the cache when decoding step by step."""
        is_cross = key_value_states is not None
        cache = None
        if past_key_values is not None:
            cache = past_key_values.cross_attention_cache if is_cross else past_key_values.self_attention_cache
            if is_cross and past_key_values.is_updated.get(self.layer_idx):
                # The encoder output does not change while decoding: its keys and values are computed once.
                layer = cache.layers[self.layer_idx]
                return layer.keys, layer.values
        source = key_value_states if is_cross else hidden_states
        B, S, _ = source.shape
        key = self.k_proj(source).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, S, D)
        value = self.v_proj(source).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, S, D)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)  # self-attention: (B, H, past + S, D)
            if is_cross:
                past_key_values.is_updated[self.layer_idx] = True
        return key, value

    def _packed_forward(self, hidden_states, seq_lens, attention_fn, dropout):
        """Self-attention over sequences laid end to end without padding: (N, E) -> (N, E).

        The projections run once over all N real tokens; attention runs per sequence, so no score is ever computed
        for a padding position. (4-D inputs keep sdpa on its fused CPU kernels; 3-D ones fall back to plain math.)
        Neighbouring sequences of equal length are one (count, H, L, D) view of the packed tensor, without a copy:
        they share one kernel call, so a mostly full batch costs a few calls rather than one per row.
        """
        N, E = hidden_states.shape
        H, D = self.num_heads, self.head_dim
        query = self.q_proj(hidden_states).view(N, H, D)  # heads are slices of E
        key = self.k_proj(hidden_states).view(N, H, D)
        value = self.v_proj(hidden_states).view(N, H, D)
        contexts, start = [], 0
        for length, run in itertools.groupby(seq_lens):
            count = len(list(run))
            end = start + count * length
            q, k, v = (x[start:end].view(count, length, H, D).transpose(1, 2) for x in (query, key, value))
            context, _ = attention_fn(self, q, k, v, None, dropout=dropout, scaling=self.scaling)  # (count, L, H, D)
            contexts.append(context.reshape(end - start, E))  # (count * L, E): Concat(head_1..head_H)
            start = end
        context = contexts[0] if len(contexts) == 1 else torch.cat(contexts)  # (N, E)
        return self.o_proj(context)


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

    def forward(self, hidden_states, attention_mask=None, seq_lens=None):
        hidden_states, weights = self._self_attn_block(hidden_states, attention_mask, seq_lens=seq_lens)
        return self._ffn_block(hidden_states), weights

    def _residual(self, residual, sublayer_output, norm):
        if self.training:  # dropout is the identity in eval mode; not calling it saves its Python
            sublayer_output = self.dropout(sublayer_output)
        if self.pre_norm:
            return residual + sublayer_output
        return norm(residual + sublayer_output)

    def _sublayer_input(self, hidden_states, norm):
        return norm(hidden_states) if self.pre_norm else hidden_states

    def _self_attn_block(self, hidden_states, attention_mask, past_key_values=None, seq_lens=None):
        attn_input = self._sublayer_input(hidden_states, self.self_attn_norm)
        output, weights = self.self_attn(
            attn_input, attention_mask=attention_mask, past_key_values=past_key_values, seq_lens=seq_lens
        )
        return self._residual(hidden_states, output, self.self_attn_norm), weights

    def _ffn_block(self, hidden_states):
        output = self.ffn(self._sublayer_input(hidden_states, self.ffn_norm))
        return self._residual(hidden_states, output, self.ffn_norm)


class VanillaDecoderLayer(VanillaEncoderLayer):
    """The encoder layer with its self-attention masked to the past, and a third sub-layer between the two that
    attends over the encoder's output: masked self-attention -> cross-attention -> feed-forward."""

    is_causal = True

    def __init__(self, config, layer_idx: int, num_heads: int, intermediate_size: int):
        super().__init__(config, layer_idx, num_heads, intermediate_size)
        self.cross_attn = VanillaAttention(config, num_heads, is_causal=False, layer_idx=layer_idx)
        self.cross_attn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
                past_key_values=None):
        hidden_states, self_weights = self._self_attn_block(hidden_states, attention_mask, past_key_values)
        attn_input = self._sublayer_input(hidden_states, self.cross_attn_norm)
        output, cross_weights = self.cross_attn(
            attn_input, key_value_states=encoder_hidden_states, attention_mask=encoder_attention_mask,
            past_key_values=past_key_values,
        )  # (B, T, E): each target position reads the whole source sentence
        hidden_states = self._residual(hidden_states, output, self.cross_attn_norm)
        return self._ffn_block(hidden_states), self_weights, cross_weights


# ----------------------------------------------------------------------------------------------------------------
# 5. The stack: embeddings, N layers, masks, and the padding-free fast path
# ----------------------------------------------------------------------------------------------------------------


def additive_mask(mask, dtype):
    """1/0 (or bool) mask (..., S) -> 0 where attending is allowed, the dtype's minimum where it is not.

    A query that may attend to nothing (a row that is all padding) is let attend to every key instead: its output
    is meaningless either way, but a row of minima overflows to -inf in float16 (score + min < -65504) and the
    softmax of an all -inf row is NaN."""
    allowed = mask.bool()
    allowed = allowed | ~allowed.any(-1, keepdim=True)  # (..., S): fully masked rows become fully open
    return (~allowed).to(dtype) * torch.finfo(dtype).min


def _has_padding(mask) -> bool:
    """Whether a 1/0 `attention_mask` hides any token. A mask of ones needs no masking at all: attention then runs
    without a mask, bit for bit what it gives without `attention_mask`. (Always True while tracing, where the
    graph must not depend on the mask's values.)"""
    return mask is not None and (_is_tracing() or not mask.all())


class VanillaStack(nn.Module):
    """Embeddings followed by N identical layers: the encoder (section 3.1, left) or the decoder (right).

    The encoder has a fast path for padded batches: when some tokens are padding it gathers the N real tokens of
    the batch into one (N, E) tensor, runs every embedding, projection and feed-forward on those alone, attends
    within each sequence, and scatters the result back to (B, T, E) once at the end (padding positions hold
    zeros). Padded batches of natural text are often two-thirds padding; this skips that work. The padded path
    stays for attention maps (`output_attentions`), the decoder, and tracing/export, which need static shapes.
    """

    def __init__(self, config, is_decoder: bool = False):
        super().__init__()
        self.config = config
        self.is_decoder = is_decoder
        if is_decoder:
            num_layers, heads, ffn = config.decoder_layers, config.decoder_attention_heads, config.decoder_intermediate_size
            layer_class = VanillaDecoderLayer
        else:
            num_layers, heads, ffn = config.num_hidden_layers, config.num_attention_heads, config.intermediate_size
            layer_class = VanillaEncoderLayer
        self.embeddings = VanillaEmbeddings(config)
        self.layers = nn.ModuleList(layer_class(config, i, heads, ffn) for i in range(num_layers))
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
        return_dict=True,
    ):
        """Returns a `BaseModelOutputWithPastAndCrossAttentions` whatever `return_dict` says (generate needs that
        of the encoder); the public models honour `return_dict`."""
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        if output_attentions and self.config._attn_implementation != "eager":
            raise ValueError(
                f"output_attentions=True needs eager attention, but this model uses "
                f"{self.config._attn_implementation!r}, whose kernels never form the weights. Load it with "
                f"`attn_implementation='eager'` or call `model.set_attn_implementation('eager')`."
            )
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        self._check_inputs(input_ids, inputs_embeds, token_type_ids, position_ids, attention_mask, past_length,
                           encoder_hidden_states, encoder_attention_mask)
        inputs = input_ids if input_ids is not None else inputs_embeds
        B, T = inputs.shape[:2]
        if position_ids is None:
            offset = self.config.position_offset + past_length
            # On the inputs' device: with Accelerate offload the weights may sit on "meta" until their hook runs.
            position_ids = torch.arange(offset, offset + T, device=inputs.device)
        # (T,) or (1, T), shared by every row, -> (B, T): the packed path gathers them token by token.
        position_ids = position_ids.expand(B, T)
        token_type_ids = token_type_ids.expand(B, T) if token_type_ids is not None else None

        if self.is_decoder:
            return self._decode(input_ids, attention_mask, position_ids, inputs_embeds, encoder_hidden_states,
                                encoder_attention_mask, past_key_values, past_length, use_cache, output_attentions,
                                output_hidden_states)

        padded = _has_padding(attention_mask)
        packed = (
            padded and not output_attentions and not _is_tracing()
            and attention_mask.any()  # a batch of nothing but padding has no token to pack
        )
        if packed:
            return self._encode_packed(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                                       output_hidden_states)
        hidden_states = self.embeddings(input_ids, position_ids, token_type_ids, inputs_embeds)  # (B, T, E)
        mask = additive_mask(attention_mask[:, None, None, :], hidden_states.dtype) if padded else None  # (B, 1, 1, S)
        all_hidden_states, all_attentions = [hidden_states], []
        for layer in self.layers:
            hidden_states, weights = layer(hidden_states, mask)
            all_hidden_states.append(hidden_states)
            all_attentions.append(weights)
        return self._output(hidden_states, all_hidden_states, all_attentions, None, None,
                            output_hidden_states, output_attentions)

    def _encode_packed(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                       output_hidden_states):
        B, T = attention_mask.shape
        keep = attention_mask.bool()
        indices = keep.flatten().nonzero().squeeze(1)  # (N,): where the real tokens sit in the flattened batch
        seq_lens = [n for n in keep.sum(1).tolist() if n > 0]  # a row that is all padding has nothing to attend

        def pack(x):  # (B, T, ...) -> (N, ...)
            return None if x is None else x.reshape(B * T, *x.shape[2:])[indices]

        hidden_states = self.embeddings(pack(input_ids), pack(position_ids), pack(token_type_ids), pack(inputs_embeds))

        def unpack(x):  # (N, E) -> (B, T, E), zeros at padding
            return x.new_zeros(B * T, x.shape[-1]).index_copy_(0, indices, x).view(B, T, -1)

        all_hidden_states = [hidden_states]
        for layer in self.layers:
            hidden_states, _ = layer(hidden_states, seq_lens=seq_lens)  # (N, E)
            all_hidden_states.append(hidden_states)
        if output_hidden_states:
            all_hidden_states = [unpack(h) for h in all_hidden_states]
        return self._output(unpack(hidden_states), all_hidden_states, [], None, None, output_hidden_states, False)

    def _decode(self, input_ids, attention_mask, position_ids, inputs_embeds, encoder_hidden_states,
                encoder_attention_mask, past_key_values, past_length, use_cache, output_attentions,
                output_hidden_states):
        if use_cache and past_key_values is None:
            past_key_values = EncoderDecoderCache(DynamicCache(), DynamicCache())
        # The decoder has no segments: BERT-initialised decoders see segment 0, as in transformers' bert2bert.
        hidden_states = self.embeddings(input_ids, position_ids, None, inputs_embeds)  # (B, T, E)
        B, T, _ = hidden_states.shape
        S = past_length + T
        padded = _has_padding(attention_mask)
        mask = None
        if T > 1 or padded:  # one new token without padding may see every key: nothing to mask
            # Query t (at absolute position past_length + t) may see keys 0..past_length + t: never the future.
            query_pos = torch.arange(past_length, S, device=hidden_states.device)
            allowed = query_pos[:, None] >= torch.arange(S, device=hidden_states.device)[None, :]  # (T, S)
            allowed = allowed[None, None]  # (1, 1, T, S)
            if padded:
                allowed = allowed & attention_mask[:, None, None, -S:].bool()  # (B, 1, T, S)
            mask = additive_mask(allowed, hidden_states.dtype)
        cross_mask = None
        if encoder_attention_mask is not None:
            cross_mask = additive_mask(encoder_attention_mask[:, None, None, :], hidden_states.dtype)  # (B, 1, 1, S)

        all_hidden_states, all_self, all_cross = [hidden_states], [], []
        for layer in self.layers:
            # The cache by keyword: under gradient checkpointing the layer's wrapper drops it (a recomputed forward
            # would write it twice). Tensors that need gradients stay positional, as reentrant checkpointing needs.
            hidden_states, self_weights, cross_weights = layer(
                hidden_states, mask, encoder_hidden_states, cross_mask, past_key_values=past_key_values
            )
            all_hidden_states.append(hidden_states)
            all_self.append(self_weights)
            all_cross.append(cross_weights)
        return self._output(hidden_states, all_hidden_states, all_self, all_cross,
                            past_key_values if use_cache else None, output_hidden_states, output_attentions)

    def _output(self, hidden_states, all_hidden_states, all_self, all_cross, cache, output_hidden_states,
                output_attentions):
        if self.final_norm is not None:
            hidden_states = self.final_norm(hidden_states)
            all_hidden_states[-1] = hidden_states
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states,
            past_key_values=cache,
            hidden_states=tuple(all_hidden_states) if output_hidden_states else None,
            attentions=tuple(all_self) if output_attentions else None,
            cross_attentions=tuple(all_cross) if output_attentions and all_cross else None,
        )

    def _check_inputs(self, input_ids, inputs_embeds, token_type_ids, position_ids, attention_mask, past_length,
                      encoder_hidden_states=None, encoder_attention_mask=None):
        """Refuse bad input with a message naming the problem and the fix, before any kernel runs: an index kernel
        would turn it into an opaque error (on GPU a device-side assert that poisons the process).

        Shapes and dtypes are always checked; values (one min/max per tensor) are skipped while tracing."""
        prefix = "decoder_" if self.is_decoder else ""  # the decoder's inputs reach the model under these names
        ids_name, embeds_name, mask_name = f"{prefix}input_ids", f"{prefix}inputs_embeds", f"{prefix}attention_mask"
        if (input_ids is None) == (inputs_embeds is None):
            hint = " (or labels, which are shifted right into decoder_input_ids)" if self.is_decoder else ""
            raise ValueError(f"Pass exactly one of {ids_name} or {embeds_name}{hint}.")
        if input_ids is not None:
            _check_integer(ids_name, input_ids)
            if input_ids.dim() != 2:
                fix = f"add a batch dimension with {ids_name}[None]" if input_ids.dim() == 1 else "one row per sequence"
                raise ValueError(f"{ids_name} must be (batch, length), got shape {tuple(input_ids.shape)}: {fix}.")
            shape = tuple(input_ids.shape)
        else:
            width = self.config.embedding_size
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != width:
                raise ValueError(
                    f"{embeds_name} must be (batch, length, embedding_size={width}), got shape "
                    f"{tuple(inputs_embeds.shape)}."
                )
            shape = tuple(inputs_embeds.shape[:2])
        if shape[0] == 0 or shape[1] == 0:
            raise ValueError(f"Got an empty batch of shape {shape}: pass at least one sequence of one token.")
        with_cache = (shape[0], past_length + shape[1])
        if attention_mask is not None and tuple(attention_mask.shape) not in (shape, with_cache):
            expected = with_cache if past_length else shape
            raise ValueError(
                f"{mask_name} has shape {tuple(attention_mask.shape)} but should be {expected}, one 1/0 per token of "
                f"{ids_name} {shape}{' and of the cache' if past_length else ''}: pass the tokenizer's attention_mask."
            )
        for name, ids in (("token_type_ids", token_type_ids), ("position_ids", position_ids)):
            if ids is None:
                continue
            _check_integer(name, ids)
            rows = 1 if ids.dim() == 1 else ids.shape[0]
            if ids.dim() not in (1, 2) or ids.shape[-1] != shape[1] or rows not in (shape[0], 1):
                raise ValueError(
                    f"{name} has shape {tuple(ids.shape)} but {ids_name} has shape {shape}: pass one id per token, "
                    f"as {shape} (or (1, {shape[1]}) shared by every row)."
                )
        if encoder_hidden_states is not None:
            source_shape = tuple(encoder_hidden_states.shape[:2])
            if source_shape[0] != shape[0]:
                raise ValueError(
                    f"{ids_name} has {shape[0]} rows but the encoder output has {source_shape[0]}: pass one target "
                    f"row per source row."
                )
            if encoder_attention_mask is not None and tuple(encoder_attention_mask.shape) != source_shape:
                raise ValueError(
                    f"attention_mask has shape {tuple(encoder_attention_mask.shape)} but the encoder output covers "
                    f"{source_shape} source tokens: pass the attention_mask that came with the source input_ids."
                )
        if _is_tracing():
            return
        _check_mask_values(mask_name, attention_mask)
        _check_mask_values("attention_mask", encoder_attention_mask)
        config = self.config
        _check_range(ids_name, input_ids, config.vocab_size, "vocab_size",
                     "use the tokenizer saved with this checkpoint (after adding tokens, call resize_token_embeddings)")
        if self.embeddings.token_type_embeddings is not None:
            _check_range("token_type_ids", token_type_ids, config.type_vocab_size, "type_vocab_size",
                         "segment ids count sentences (BERT: 0 for the first, 1 for the second)")
        elif token_type_ids is not None and not self.is_decoder and token_type_ids.any():
            raise ValueError("This model has no token types (type_vocab_size=0); drop token_type_ids.")
        max_length = config.max_position_embeddings - config.position_offset
        if position_ids is None and past_length + shape[1] > max_length:
            what = "decoder sequence (cache included)" if self.is_decoder else "sequence"
            fix = "; when generating, lower max_new_tokens" if self.is_decoder else ""
            raise ValueError(
                f"The {what} has {past_length + shape[1]} tokens but the position table allows at most {max_length} "
                f"(max_position_embeddings={config.max_position_embeddings}, position_offset="
                f"{config.position_offset}): truncate the input, e.g. tokenizer(..., truncation=True, "
                f"max_length={max_length}){fix}."
            )
        _check_range("position_ids", position_ids, config.max_position_embeddings, "max_position_embeddings",
                     "pass positions below the table's length, or truncate the input")


def _check_integer(name, ids):
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer ids, got dtype {ids.dtype}: convert with {name}.long().")


def _check_mask_values(name, mask):
    """Masks are 1 (token) / 0 (padding); any other value would be read differently by the padded and packed paths."""
    if mask is None or mask.dtype == torch.bool:
        return
    if mask.is_floating_point():
        valid = bool(((mask == 0) | (mask == 1)).all())
    else:  # integers hold nothing but 1 and 0 when their extremes do: one reduction
        low, high = (int(x) for x in torch.aminmax(mask))
        valid = low >= 0 and high <= 1
    if not valid:
        invalid = (mask != 0) & (mask != 1)
        raise ValueError(
            f"{name} must hold 1 (token) or 0 (padding), got {mask[invalid][0].item()}: pass the tokenizer's "
            f"attention_mask (an additive or 4-D mask is not accepted)."
        )


def _check_range(name, ids, limit, limit_name, fix):
    """Every id in [0, limit), else a ValueError naming the offending value, the limit and `fix`."""
    if ids is None:
        return
    low, high = (int(x) for x in torch.aminmax(ids))
    if low < 0 or high >= limit:
        bad = high if high >= limit else low
        raise ValueError(f"{name} contains {bad}, outside [0, {limit}) set by {limit_name}={limit}: {fix}.")


IGNORE_INDEX = -100  # label value the losses skip (CrossEntropyLoss's default ignore_index)


def _check_labels(labels, num_classes, limit_name):
    """Class labels in [0, num_classes), or -100 where no label applies. Checked before the model runs: the loss
    would index its logits with them, an opaque device-side assert on GPU."""
    if labels is None or _is_tracing():
        return
    _check_integer("labels", labels)
    _check_range("labels", labels.masked_fill(labels == IGNORE_INDEX, 0), num_classes, limit_name,
                 f"labels are class ids, with {IGNORE_INDEX} where no label applies")


# ----------------------------------------------------------------------------------------------------------------
# 6. Models
# ----------------------------------------------------------------------------------------------------------------


class VanillaPreTrainedModel(PreTrainedModel):
    """Weight initialisation and the capabilities transformers and Accelerate read."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _no_split_modules = ["VanillaEmbeddings", "VanillaEncoderLayer", "VanillaDecoderLayer"]
    # Our losses are per-batch means and ignore `num_items_in_batch`. Without this, Trainer sees `**kwargs` in
    # forward, assumes the loss is already normalised for gradient accumulation and skips dividing by the number of
    # accumulated steps: every update (and logged loss) would be that many times too large.
    accepts_loss_kwargs = False

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, VanillaEmbeddings) and hasattr(module, "position_table"):
            # Non-persistent buffers come back uninitialised from `from_pretrained`: recompute the sinusoids.
            table = sinusoidal_position_table(*module.position_table.shape, self.config.sinusoidal_layout)
            module.position_table.copy_(table.to(module.position_table.device))
        elif isinstance(module, VanillaLMHead):
            module.decoder.bias.zero_()


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


class VanillaEncoderModel(VanillaPreTrainedModel):
    """The BERT-style encoder: embeddings, N encoder layers and (optionally) BERT's pooler.

    The pooler, tanh(W h_0 + b) over the first ([CLS]) token, is what BERT's next-sentence objective trained as a
    sentence representation; classification heads start from it.
    """

    config_class = VanillaEncoderConfig

    def __init__(self, config: VanillaEncoderConfig):
        super().__init__(config)
        self.encoder = VanillaStack(config)
        self.pooler = VanillaLinear(config.hidden_size, config.hidden_size) if config.use_pooler else None
        self.post_init()

    def get_input_embeddings(self):
        return self.encoder.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.encoder.embeddings.word_embeddings = value

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, output_attentions=None, output_hidden_states=None, return_dict=None, **kwargs):
        """input_ids, attention_mask, token_type_ids: (B, T). Returns last_hidden_state (B, T, E), pooler_output
        (B, E), and per layer the hidden states (B, T, E) and attention weights (B, H, T, T) when asked."""
        out = self.encoder(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                           output_attentions=output_attentions, output_hidden_states=output_hidden_states)
        pooled = torch.tanh(self.pooler(out.last_hidden_state[:, 0])) if self.pooler is not None else None
        output = BaseModelOutputWithPooling(
            last_hidden_state=out.last_hidden_state, pooler_output=pooled,
            hidden_states=out.hidden_states, attentions=out.attentions,
        )
        return output if _return_dict(self.config, return_dict) else output.to_tuple()


def _return_dict(config, return_dict):
    return config.return_dict if return_dict is None else return_dict


class VanillaEncoderForMaskedLM(VanillaPreTrainedModel):
    """The encoder with BERT's masked-language-model head: predict the token behind each [MASK]."""

    config_class = VanillaEncoderConfig
    _tied_weights_keys = {"lm_head.decoder.weight": "model.encoder.embeddings.word_embeddings.weight"}

    def __init__(self, config: VanillaEncoderConfig):
        super().__init__(config)
        self.model = VanillaEncoderModel(config)
        self.lm_head = VanillaLMHead(config, transform=True)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **kwargs):
        """labels: (B, T), the original token at masked positions and -100 elsewhere. Returns logits (B, T, V)."""
        _check_labels(labels, self.config.vocab_size, "vocab_size")
        out = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_attentions, output_hidden_states, return_dict=True)
        logits = self.lm_head(out.last_hidden_state)
        loss = None
        if labels is not None:
            loss = CrossEntropyLoss()(logits.reshape(-1, self.config.vocab_size), labels.reshape(-1).to(logits.device))
        output = MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)
        return output if _return_dict(self.config, return_dict) else output.to_tuple()


class VanillaEncoderForSequenceClassification(VanillaPreTrainedModel):
    """One label (or score) per sequence, read from the pooled [CLS] token. The loss follows `problem_type`:
    regression (MSE), single-label (cross-entropy) or multi-label (binary cross-entropy), as BERT's does."""

    config_class = VanillaEncoderConfig

    def __init__(self, config: VanillaEncoderConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = VanillaEncoderModel(config)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.classifier = VanillaLinear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **kwargs):
        """labels: (B,) class ids, (B,) floats for regression or (B, num_labels) for multi-label."""
        if labels is not None and self._problem_type(labels) == "single_label_classification":
            _check_labels(labels, self.num_labels, "num_labels")
        out = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_attentions, output_hidden_states, return_dict=True)
        # Without a pooler (DistilBERT-style checkpoints) the [CLS] hidden state is the sentence representation.
        pooled = out.pooler_output if out.pooler_output is not None else out.last_hidden_state[:, 0]
        logits = self.classifier(self.dropout(pooled))  # (B, num_labels)
        loss = None
        if labels is not None:
            loss = self._loss(logits, labels.to(logits.device))
        output = SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                          attentions=out.attentions)
        return output if _return_dict(self.config, return_dict) else output.to_tuple()

    def _problem_type(self, labels):
        """As BERT decides it, once, from the first labels seen: one output is a regression, integer labels are
        classes, anything else is a multi-label target."""
        if self.config.problem_type is None:
            if self.num_labels == 1:
                self.config.problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                self.config.problem_type = "single_label_classification"
            else:
                self.config.problem_type = "multi_label_classification"
        return self.config.problem_type

    def _loss(self, logits, labels):
        if self.config.problem_type == "regression":
            if self.num_labels == 1:
                return MSELoss()(logits.squeeze(), labels.squeeze())
            return MSELoss()(logits, labels)
        if self.config.problem_type == "single_label_classification":
            return CrossEntropyLoss()(logits.reshape(-1, self.num_labels), labels.reshape(-1))
        return BCEWithLogitsLoss()(logits, labels)


def _classifier_dropout(config):
    return config.hidden_dropout_prob if config.classifier_dropout is None else config.classifier_dropout


class VanillaEncoderForTokenClassification(VanillaPreTrainedModel):
    """One label per token (named entities, parts of speech)."""

    config_class = VanillaEncoderConfig

    def __init__(self, config: VanillaEncoderConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = VanillaEncoderModel(config)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.classifier = VanillaLinear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **kwargs):
        """labels: (B, T) with -100 where no label applies. Returns logits (B, T, num_labels)."""
        _check_labels(labels, self.num_labels, "num_labels")
        out = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_attentions, output_hidden_states, return_dict=True)
        logits = self.classifier(self.dropout(out.last_hidden_state))
        loss = None
        if labels is not None:
            loss = CrossEntropyLoss()(logits.reshape(-1, self.num_labels), labels.reshape(-1).to(logits.device))
        output = TokenClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                       attentions=out.attentions)
        return output if _return_dict(self.config, return_dict) else output.to_tuple()


class VanillaEncoderForQuestionAnswering(VanillaPreTrainedModel):
    """Extractive QA: a start score and an end score for every token; the answer is the best-scoring span."""

    config_class = VanillaEncoderConfig

    def __init__(self, config: VanillaEncoderConfig):
        super().__init__(config)
        self.model = VanillaEncoderModel(config)
        self.qa_outputs = VanillaLinear(config.hidden_size, 2)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, start_positions=None, end_positions=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, **kwargs):
        """start_positions, end_positions: (B,) token indices of the answer span. Returns two (B, T) logits."""
        out = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_attentions, output_hidden_states, return_dict=True)
        start_logits, end_logits = self.qa_outputs(out.last_hidden_state).unbind(-1)  # (B, T, 2) -> 2 x (B, T)
        loss = None
        if start_positions is not None and end_positions is not None:
            # Positions outside the input are clamped to T and ignored, as BERT does.
            ignored = start_logits.size(1)
            loss_fct = CrossEntropyLoss(ignore_index=ignored)
            start = start_positions.view(-1).clamp(0, ignored).to(start_logits.device)
            end = end_positions.view(-1).clamp(0, ignored).to(end_logits.device)
            loss = (loss_fct(start_logits, start) + loss_fct(end_logits, end)) / 2
        output = QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits.contiguous(),
                                              end_logits=end_logits.contiguous(), hidden_states=out.hidden_states,
                                              attentions=out.attentions)
        return output if _return_dict(self.config, return_dict) else output.to_tuple()


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


class VanillaEncoderForReplacedTokenDetection(VanillaPreTrainedModel):
    """ELECTRA's discriminator (Clark et al., 2020, https://arxiv.org/abs/2003.10555, section 2): for every token,
    was it replaced by a small generator?

    ELECTRA trains this objective instead of masked-LM prediction, so it learns from every token, not only the 15%
    that are masked. Loaded through `AutoModelForPreTraining`, as transformers' ElectraForPreTraining is.
    """

    config_class = VanillaEncoderConfig

    def __init__(self, config: VanillaEncoderConfig):
        super().__init__(config)
        self.model = VanillaEncoderModel(config)
        self.rtd_head = VanillaReplacedTokenHead(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **kwargs):
        """labels: (B, T), 1 where the token was replaced and 0 where it is the original. Returns logits (B, T):
        one score per token (a `TokenClassifierOutput` with a single, squeezed label)."""
        out = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_attentions, output_hidden_states, return_dict=True)
        logits = self.rtd_head(out.last_hidden_state)  # (B, T)
        loss = None
        if labels is not None:
            # Binary cross-entropy over real tokens only: padding is neither original nor replaced.
            labels = labels.to(logits.device)
            real = torch.ones_like(labels, dtype=torch.bool) if attention_mask is None else attention_mask == 1
            loss = BCEWithLogitsLoss()(logits[real], labels[real].to(logits.dtype))
        output = TokenClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                       attentions=out.attentions)
        return output if _return_dict(self.config, return_dict) else output.to_tuple()


# ---- the encoder-decoder --------------------------------------------------------------------------------------


def shift_tokens_right(labels, pad_token_id: int, decoder_start_token_id: int):
    """Teacher forcing: the decoder reads the target shifted one step right, starting from the start token, and
    learns to predict the unshifted target. -100 (ignored) label positions are read as padding."""
    shifted = labels.new_zeros(labels.shape)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == -100, pad_token_id)


class VanillaSeq2SeqModel(VanillaPreTrainedModel):
    """The encoder-decoder without an output head: source (B, S) and target (B, T) -> decoder states (B, T, E)."""

    config_class = VanillaSeq2SeqConfig
    _skip_keys_device_placement = ["past_key_values"]

    def __init__(self, config: VanillaSeq2SeqConfig):
        super().__init__(config)
        self.encoder = VanillaStack(config)
        self.decoder = VanillaStack(config, is_decoder=True)
        if config.share_encoder_decoder_embeddings:
            self._tied_weights_keys = {
                "decoder.embeddings.word_embeddings.weight": "encoder.embeddings.word_embeddings.weight"
            }
        self.post_init()

    def get_encoder(self):
        return self.encoder

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
        segments. Other keyword arguments that `generate` sends (e.g. `cache_position`) are not needed.
        `encoder_outputs` may be a tuple (last_hidden_state, hidden_states, attentions), as from `return_dict=False`."""
        if encoder_outputs is None:
            # The target is checked first, so that a bad target stops the call before the encoder's kernels run.
            past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
            self.decoder._check_inputs(decoder_input_ids, decoder_inputs_embeds, None, None, decoder_attention_mask,
                                       past_length)
            encoder_outputs = self.encoder(input_ids, attention_mask, token_type_ids, inputs_embeds=inputs_embeds,
                                           output_attentions=output_attentions,
                                           output_hidden_states=output_hidden_states)
        elif not isinstance(encoder_outputs, ModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        decoder_out = self.decoder(
            decoder_input_ids, decoder_attention_mask, inputs_embeds=decoder_inputs_embeds,
            encoder_hidden_states=encoder_outputs.last_hidden_state, encoder_attention_mask=attention_mask,
            past_key_values=past_key_values, use_cache=use_cache, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        output = Seq2SeqModelOutput(
            last_hidden_state=decoder_out.last_hidden_state,
            past_key_values=decoder_out.past_key_values,
            decoder_hidden_states=decoder_out.hidden_states,
            decoder_attentions=decoder_out.attentions,
            cross_attentions=decoder_out.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )
        return output if _return_dict(self.config, return_dict) else output.to_tuple()


class VanillaSeq2SeqForConditionalGeneration(VanillaPreTrainedModel, GenerationMixin):
    """The encoder-decoder with its output projection: P(next target token | source, target so far), trained with
    teacher forcing and sampled with `generate()` (greedy, beam search, sampling, with a key/value cache)."""

    config_class = VanillaSeq2SeqConfig
    _skip_keys_device_placement = ["past_key_values"]

    def __init__(self, config: VanillaSeq2SeqConfig):
        super().__init__(config)
        self.model = VanillaSeq2SeqModel(config)
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

    def get_encoder(self):
        return self.model.encoder

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

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
        _check_labels(labels, self.config.vocab_size, "vocab_size")
        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            decoder_input_ids = shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)
            use_cache = False
        out = self.model(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs,
                         past_key_values, token_type_ids, inputs_embeds, decoder_inputs_embeds, use_cache,
                         output_attentions, output_hidden_states, return_dict=True)
        logits = self.lm_head(out.last_hidden_state)  # (B, T, V)
        loss = None
        if labels is not None:
            loss = CrossEntropyLoss()(logits.reshape(-1, self.config.vocab_size), labels.reshape(-1).to(logits.device))
        output = Seq2SeqLMOutput(
            loss=loss, logits=logits, past_key_values=out.past_key_values,
            decoder_hidden_states=out.decoder_hidden_states, decoder_attentions=out.decoder_attentions,
            cross_attentions=out.cross_attentions, encoder_last_hidden_state=out.encoder_last_hidden_state,
            encoder_hidden_states=out.encoder_hidden_states, encoder_attentions=out.encoder_attentions,
        )
        return output if _return_dict(self.config, return_dict) else output.to_tuple()


__all__ = [
    "VanillaPreTrainedModel",
    "VanillaEncoderModel",
    "VanillaEncoderForMaskedLM",
    "VanillaEncoderForSequenceClassification",
    "VanillaEncoderForTokenClassification",
    "VanillaEncoderForQuestionAnswering",
    "VanillaEncoderForReplacedTokenDetection",
    "VanillaSeq2SeqModel",
    "VanillaSeq2SeqForConditionalGeneration",
]
