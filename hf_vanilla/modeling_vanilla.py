"""The Hugging Face base of hf_vanilla's models: `VanillaPreTrainedModel`, what transformers and Accelerate read
(weight initialisation, the capabilities, the input and output embeddings) and what every head shares: calling its
body by name (`_body`), building its output (`_output`), the causal language model's forward and the sequence
classification loss.

The models are in one module per family, on the Transformer of `transformer.py`:
    modeling_encoder.py ... `VanillaEncoderModel` and BERT's heads
    modeling_seq2seq.py ... `VanillaSeq2SeqModel` and BART's heads
    modeling_decoder.py ... `VanillaDecoderModel` and its causal language model

Each head is one declaration in `heads.py` (its Auto class, converter head and export task) plus its class in its
family's module: a few layers on top of a body, a forward that passes its arguments on to the body by name (`_body`)
and reads the body's output and the batch's plan (packing.BatchPlan) it carries; its losses are in `losses.py`.
Shapes follow `transformer.py`'s key (B, T, S, E, V).
"""

import torch
from transformers import PreTrainedModel, initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

from .head_layers import VanillaLMHead
from .losses import causal_lm_loss, next_tokens, no_cache_for_labels, reads_padding, token_logits
from .packing import packed_format, plan_of
from .runtime_registry import apply_runtime
from .transformer import VanillaEmbeddings, sinusoidal_position_table
from .validation import check_labels, refuse_non_tensors


class VanillaPreTrainedModel(PreTrainedModel):
    """Weight initialisation, the capabilities transformers and Accelerate read, and what every head shares: its
    losses and the building of its output."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _no_split_modules = ["VanillaEmbeddings", "VanillaEncoderLayer", "VanillaDecoderLayer"]  # narrowed in post_init
    _skip_keys_device_placement = ["past_key_values", "cache"]  # the cache's name before and since transformers 5.24
    # One graph per shape: checks of values and the padding-free path step aside while tracing, and a static cache's
    # length is read from the cache, so `generate` may compile the forward (tests/test_heads.py compiles a step).
    _can_compile_fullgraph = True
    # Our losses are per-batch means and ignore `num_items_in_batch`. Without this, Trainer (seeing `**kwargs` in
    # forward) would take the loss as normalised for gradient accumulation: every update that many times too large.
    accepts_loss_kwargs = False
    uses_pooler = False  # whether the head reads one [CLS] state per row
    input_stack: str | None = None  # a body's stack that reads the input ("encoder" or "decoder"); None on heads

    @classmethod
    def from_pretrained(cls, *args, runtime: str | None = None, runtime_options: dict | None = None, **kwargs):
        """transformers' `from_pretrained`, and `runtime`: "onnxruntime", "openvino" or "auto" (the fastest installed,
        timed here at load) runs the encoder on that engine where it gives the same answer, PyTorch elsewhere, with
        `runtime_options`; found by name in runtime_registry.py, it wraps the model from beside it (docs/deploy.md)."""
        model = super().from_pretrained(*args, **kwargs)
        return model if runtime is None else apply_runtime(model, runtime, **(runtime_options or {}))

    def __call__(self, *args, **kwargs):
        refuse_non_tensors(type(self).forward, args, kwargs)  # before a head or an engine reads them (validation.py)
        return super().__call__(*args, **kwargs)

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
            init.zeros_(module.decoder.bias)

    def get_input_embeddings(self):
        """The token embeddings of the body's stack that reads the input (`input_stack`); a head's are its body's."""
        if self.input_stack is None:
            return super().get_input_embeddings()
        return getattr(self, self.input_stack).embeddings.word_embeddings

    def set_input_embeddings(self, value):
        if self.input_stack is None:
            return super().set_input_embeddings(value)
        getattr(self, self.input_stack).embeddings.word_embeddings = value

    def get_output_embeddings(self):
        """The output projection of the heads that predict tokens (tied to the token embeddings); None elsewhere."""
        return self.lm_head.decoder if hasattr(self, "lm_head") else None

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.set_projection(new_embeddings)

    def _output(self, output_class, body_output, return_dict, **head_fields):
        """A head's output: `output_class` holding the head's own fields (loss, logits, ...) and, for every other
        field, the body's field of that name (hidden states, attentions, the cache, the encoder's states); as a
        tuple where the caller (or the config) asks for one. A body's own output (one with `last_hidden_state`)
        carries on the plan its stack ran by (`plan`, packing.BatchPlan), for the heads to read."""
        carried = {name: getattr(body_output, name, None) for name in output_class.__dataclass_fields__}
        # {**a, **b}, not a | b: torch.compile and torch.export before torch 2.8 cannot trace the union of two dicts.
        output = output_class(**{**carried, **head_fields})
        if not (self.config.return_dict if return_dict is None else return_dict):
            return output.to_tuple()
        if "last_hidden_state" in carried and plan_of(body_output) is not None:
            output.plan = body_output.plan
        return output

    def _body(self, kwargs, **inputs):
        """The body's output for the head to read, always a ModelOutput (the head returns its own as a tuple where
        asked). `inputs` are the body's inputs, each by its name (as transformers' heads call their body): the
        head's own arguments, the cache, `outputs_at_padding`; transformers' packed-format keywords come from the
        forward's `kwargs`. A head that reads one state per row (`uses_pooler`) refuses transformers' packed format:
        its labels are one per sequence, which DataCollatorWithFlattening does not carry."""
        out = self.model(**inputs, **packed_format(kwargs), return_dict=True)
        plan = plan_of(out)
        if self.uses_pooler and plan is not None:
            plan.refuse_packed_rows(type(self).__name__)
        return out

    def _causal_lm_output(self, kwargs, *, labels, use_cache, return_dict, **inputs):
        """A causal language model's forward (BERT's and the decoder's), its body's `inputs` by name as `_body` takes
        them: the body (no cache where labels train it), scores at every position, the next-token loss, the output."""
        shift_labels = kwargs.get("shift_labels")
        check_labels(labels, self.config.vocab_size, "vocab_size")
        next_labels = next_tokens(labels, shift_labels)  # (B, T): what position t is scored against
        out = self._body(kwargs, **inputs, use_cache=no_cache_for_labels(use_cache, next_labels),
                         outputs_at_padding=reads_padding(next_labels, inputs.get("attention_mask")))
        logits = token_logits(self.lm_head, out.last_hidden_state, plan_of(out))  # (B, T, V)
        loss = causal_lm_loss(self.loss_function, self.config.vocab_size, logits, labels=labels,
                              shift_labels=shift_labels)
        return self._output(CausalLMOutputWithCrossAttentions, out, return_dict, loss=loss, logits=logits.all)

    def _classification_loss(self, logits, labels):
        """Sequence classification's loss: regression (MSE), single-label (cross-entropy) or multi-label (binary
        cross-entropy), by `config.problem_type`, which transformers sets from the first labels it sees."""
        return None if labels is None else self.loss_function(labels=labels, pooled_logits=logits, config=self.config)


__all__ = ["VanillaPreTrainedModel"]
