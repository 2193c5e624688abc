"""The decoder's step during generation: a decoder stack run over new tokens, with its self-attention keys and values
written into a cache allocated once for the whole generation and cross-attention's keys and values computed once
per source (hf_vanilla/decoding.py's loops call it). Its sub-layers are the paper's (section 3.2.3), written over the
cache; every step calls the stack's own modules, so it reads the live weights and keeps nothing derived from them.
"""

import torch

from .masks import additive_mask, cross_attention_mask
from .transformer import eager_attention_forward


class CachedDecoder:
    """A decoder stack stepped over new tokens, its keys and values kept in place for the whole generation.

    Rows come in groups that attend together, their queries side by side. Cross-attention's group is a source's
    `copies` rows (transformers' expansion for beams and returned sequences): its keys and values are computed once
    per source and never copied per row. Self-attention's group is a source's beams (`group`, 1 outside beam search):
    each beam writes its keys and values in its own slot of every position, (position, beam), and never moves them;
    its `lineage` says whose slot holds its token at each position and masks the others. Reordering the beams then
    rewrites the lineage, (R, length) ids, instead of copying every layer's cache. The cache is one tensor
    (layers, key|value, groups, H, length * group, D). It holds no weight: every step calls the stack's modules."""

    def __init__(self, model, stack, rows, length, positions, group, copies, mask=None, token_types=None,
                 memory=None, memory_mask=None):
        self.stack, self.lm_head, self.layers = stack, model.lm_head, list(stack.layers)
        attention = self.layers[0].self_attn
        self.heads, self.head_dim = attention.num_heads, attention.head_dim
        self.dtype = self.layers[0].self_attn_norm.weight.dtype  # the activations' (an int8 model's are float32)
        device = positions.device
        self.group, self.groups = group, rows // group
        shape = (len(self.layers), 2, self.groups, self.heads, length * group, self.head_dim)
        self.cache = _allocated(shape, self.dtype, device)  # None: `generate` takes transformers' loop
        if self.cache is None:
            return
        self.keys, self.values = list(self.cache[:, 0]), list(self.cache[:, 1])  # per layer (groups, H, slots, D)
        slots = (self.groups, self.heads, length, group, self.head_dim)  # the same, slot (position, beam) apart
        self.slots = [(key.view(slots), value.view(slots)) for key, value in zip(self.keys, self.values)]
        beams = torch.arange(group, device=device)
        self.lineage = beams[None, :, None].repeat(self.groups, 1, length)  # (groups, group, length)
        self.beams, self.first_rows = beams, torch.arange(self.groups, device=device)[:, None] * group
        self.positions, self.token_types = positions, token_types  # (R|1, length) each
        self.valid = None if mask is None else mask[::group]  # (groups, length): a group's rows share one prompt
        self.sources, self.copies = rows // copies, copies
        self.cross = None if memory is None else [self._cross_key_value(layer, memory) for layer in self.layers]
        self.memory_mask = None if memory_mask is None else cross_attention_mask(memory_mask, self.dtype)

    @classmethod
    def for_request(cls, model, stack, input_ids, length, model_kwargs, group, copies):
        """The decoder for what `generate` prepared (`model_kwargs`), or None where it holds an input the step does
        not read. The encoder-decoder reads its encoder's output and the source mask (token types go to the encoder
        alone); the decoder-only models their prompt's mask, positions and token types."""
        known = {"attention_mask", "use_cache", "cache", "past_key_values", "encoder_outputs", "token_type_ids",
                 "position_ids", "output_attentions", "output_hidden_states"}
        cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        if (set(model_kwargs) - known or model_kwargs.get("output_attentions") or model_kwargs.get("output_hidden_states")
                or (cache is not None and cache.get_seq_length() > 0) or input_ids.shape[0] % copies):
            return None
        rows, device = input_ids.shape[0], input_ids.device
        mask, offset = model_kwargs.get("attention_mask"), stack.config.position_offset
        if model.config.is_encoder_decoder:
            memory = model_kwargs["encoder_outputs"][0][::copies]  # (B, S, E), each source once (output or tuple)
            positions = torch.arange(offset, offset + length, device=device)[None]  # (1, length)
            return cls(model, stack, rows, length, positions, group, copies, memory=memory,
                       memory_mask=None if mask is None else mask[::copies])
        prompt = input_ids.shape[1]
        given = model_kwargs.get("position_ids")
        given = torch.arange(prompt, device=device)[None] if given is None else given  # (R|1, P), counted from 0
        positions = torch.cat([given, given[:, -1:] + torch.arange(1, length - prompt + 1, device=device)], 1) + offset
        if mask is not None:  # the prompt's padding, then every generated token
            mask = torch.cat([mask.bool(), mask.new_ones(rows, length - prompt, dtype=torch.bool)], 1)
        types = model_kwargs.get("token_type_ids")
        if types is not None:  # as transformers extends them: each row's last type, repeated
            types = torch.cat([types, types[:, -1:].expand(rows, length - prompt)], 1)
        return cls(model, stack, rows, length, positions, group, copies, mask=mask, token_types=types)

    def _cross_key_value(self, layer, memory):
        """A layer's cross-attention keys and values over the encoder's output (B, S, E): (B, H, S, D) each."""
        B, S, _ = memory.shape
        attention = layer.cross_attn
        key = attention.k_proj(memory).view(B, S, self.heads, self.head_dim).transpose(1, 2).contiguous()
        value = attention.v_proj(memory).view(B, S, self.heads, self.head_dim).transpose(1, 2).contiguous()
        return key, value

    def step(self, input_ids, start: int):
        """The next-token logits (R, V) after `input_ids` (R, T), the tokens at positions start..start+T-1 (T > 1 for
        a prompt), their keys and values written into the cache."""
        T = input_ids.shape[1]
        end = start + T
        types = None if self.token_types is None else self.token_types.narrow(1, start, T)
        hidden_states = self.stack.embeddings(input_ids=input_ids, position_ids=self.positions.narrow(1, start, T),
                                              token_type_ids=types)  # (R, T, E)
        mask = self._self_mask(start, end)
        for i, layer in enumerate(self.layers):
            hidden_states = self._self_attention(layer, hidden_states, i, start=start, mask=mask)
            if self.cross is not None:
                hidden_states = self._cross_attention(layer, hidden_states, i)
            if layer.pre_norm:
                hidden_states = hidden_states + layer.ffn(layer.ffn_norm(hidden_states))
            else:
                hidden_states = layer.ffn_norm(hidden_states + layer.ffn(hidden_states))
        if self.stack.final_norm is not None:
            hidden_states = self.stack.final_norm(hidden_states)
        return self.lm_head(hidden_states.select(1, -1))  # (R, V)

    def _self_mask(self, start, end):
        """The additive mask (groups, 1, group * T, end * group) of self-attention's slots: a query sees the slots
        of its lineage, up to its own position (causal), where the prompt is not padding. None where it sees all."""
        T, G = end - start, self.group
        if G == 1 and T == 1 and self.valid is None:
            return None
        allowed = self.lineage[:, :, None, :end, None] == self.beams  # (groups, G, 1, end, G)
        if T > 1:
            causal = torch.arange(end, device=allowed.device) <= torch.arange(start, end, device=allowed.device)[:, None]
            allowed = allowed & causal[:, :, None]  # (groups, G, T, end, G)
        if self.valid is not None:
            allowed = allowed & self.valid[:, None, None, :end, None]
        return additive_mask(allowed.view(self.groups, 1, G * T, end * G), self.dtype)

    def _self_attention(self, layer, hidden_states, i, *, start, mask):
        """Masked self-attention's sub-layer (section 3.2.3) over the cache, with its residual and norm."""
        attention, norm = layer.self_attn, layer.self_attn_norm
        x = norm(hidden_states) if layer.pre_norm else hidden_states
        R, T, E = x.shape
        G, H, D, end = self.group, self.heads, self.head_dim, start + T
        for slots, projection in zip(self.slots[i], (attention.k_proj, attention.v_proj)):
            new = projection(x).view(self.groups, G, T, H, D).permute(0, 3, 2, 1, 4)  # (groups, H, T, G, D)
            slots.narrow(2, start, T).copy_(new)
        query = attention.q_proj(x).view(self.groups, G * T, H, D).transpose(1, 2)  # (groups, H, G * T, D)
        key, value = self.keys[i].narrow(2, 0, end * G), self.values[i].narrow(2, 0, end * G)
        context, _ = eager_attention_forward(attention, query, key, value, attention_mask=mask, scaling=attention.scaling)
        output = attention.o_proj(context.reshape(R, T, E))  # (groups, G * T, H, D) -> (R, T, E)
        return hidden_states + output if layer.pre_norm else norm(hidden_states + output)

    def _cross_attention(self, layer, hidden_states, i):
        """Cross-attention's sub-layer over the source, with its residual and norm: a source's rows query its keys
        together, (B, H, copies * T, D) queries against (B, H, S, D) keys."""
        attention, norm = layer.cross_attn, layer.cross_attn_norm
        x = norm(hidden_states) if layer.pre_norm else hidden_states
        R, T, E = x.shape
        query = attention.q_proj(x).view(self.sources, self.copies * T, self.heads, self.head_dim).transpose(1, 2)
        key, value = self.cross[i]
        context, _ = eager_attention_forward(attention, query, key, value, attention_mask=self.memory_mask,
                                             scaling=attention.scaling)  # (B, copies * T, H, D)
        output = attention.o_proj(context.reshape(R, T, E))
        return hidden_states + output if layer.pre_norm else norm(hidden_states + output)

    def reorder(self, rows, length: int):
        """Row r continues row `rows[r]`'s sequence (beam search keeps the beams it extends): its lineage over the
        first `length` positions becomes that row's. No key or value moves."""
        parents = (rows.view(self.groups, self.group) - self.first_rows).long()  # (groups, group): within the group
        self.lineage[:, :, :length] = self.lineage[:, :, :length].gather(1, parents[..., None].expand(-1, -1, length))


def _allocated(shape, dtype, device):
    """An uninitialised tensor, or None where it cannot be allocated: the cache for the whole `max_length` at once
    may not fit where transformers' cache, grown as the sequences grow, does."""
    try:
        return torch.empty(shape, dtype=dtype, device=device)
    except (RuntimeError, torch.OutOfMemoryError):  # a CPU allocator raises a RuntimeError
        return None
