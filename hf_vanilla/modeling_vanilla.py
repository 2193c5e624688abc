"""The Hugging Face catalogue of hf_vanilla: the `PreTrainedModel` base, the three bodies (the BERT-style encoder,
the encoder-decoder, the decoder alone) and every head BERT and BART have, on the Transformer of `transformer.py`.

    1. The base ........... weight initialisation, what transformers and Accelerate read, what every head shares
    2. The encoder ........ `VanillaEncoderModel` and BERT's heads (masked LM, causal LM, pre-training, next
                            sentence, sequence / token classification, multiple choice, QA, ELECTRA's detector)
    3. The encoder-decoder  `VanillaSeq2SeqModel` and BART's heads (generation, sequence classification, QA)
    4. The decoder alone .. `VanillaDecoderModel` and its causal language model

Each head is one declaration in `heads.py` (its Auto class, converter head and export task) plus its class here:
a few layers on top of a body, a forward that passes its arguments on to the body by name (`_body`) and reads the
body's output and the batch's plan (packing.BatchPlan) it carries; its losses are in `losses.py`. Shapes follow
`transformer.py`'s key (B, T, S, E, V).
"""

import copy
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel, initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput, BaseModelOutputWithPastAndCrossAttentions, BaseModelOutputWithPoolingAndCrossAttentions,
    CausalLMOutputWithCrossAttentions, MaskedLMOutput, ModelOutput, MultipleChoiceModelOutput,
    NextSentencePredictorOutput, QuestionAnsweringModelOutput, Seq2SeqLMOutput, Seq2SeqModelOutput,
    Seq2SeqQuestionAnsweringModelOutput, Seq2SeqSequenceClassifierOutput, SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .compat import one_cache, resized_embeddings
from .configuration_vanilla import VanillaEncoderConfig, VanillaSeq2SeqConfig
from .decoding import VanillaGenerationMixin
from .head_layers import VanillaLMHead, VanillaReplacedTokenHead, classifier_layers
from .heads import MODELS
from .kernels import VanillaLinear, is_tracing
from .losses import (
    causal_lm_loss, cross_entropy, labelled_prefix, next_tokens, no_cache_for_labels, reads_padding,
    replaced_token_loss, shift_tokens_right, span_logits, token_cross_entropy, token_logits,
)
from .packing import packed_format, plan_of
from .runtime_registry import apply_runtime
from .transformer import VanillaEmbeddings, VanillaStack, sinusoidal_position_table
from .validation import (
    check_choices, check_eos_tokens, check_labels, check_sequence_labels, check_span_positions, check_target,
    check_token_labels, refuse_non_tensors, refuse_packed_pairs, refuse_unpaired_boundaries,
)

# ----------------------------------------------------------------------------------------------------------------
# 1. The base
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
    _skip_keys_device_placement = ["past_key_values", "cache"]  # the cache's name before and since transformers 5.24
    # One graph per shape: checks of values and the padding-free path step aside while tracing, and a static cache's
    # length is read from the cache, so `generate` may compile the forward (tests/test_heads.py compiles a step).
    _can_compile_fullgraph = True
    # Our losses are per-batch means and ignore `num_items_in_batch`. Without this, Trainer (seeing `**kwargs` in
    # forward) would take the loss as normalised for gradient accumulation: every update that many times too large.
    accepts_loss_kwargs = False
    body_inputs: tuple[str, ...] = ()  # the body's inputs a head passes on by name (`_body`)
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

    def _body(self, kwargs, *inputs, **named):
        """The body's output for the head to read, always a ModelOutput (the head returns its own as a tuple where
        asked). `inputs` are the body's inputs in the order `body_inputs` names them, `named` any others (the cache,
        `outputs_at_padding`); transformers' packed-format keywords come from the forward's `kwargs`. A head that
        reads one state per row (`uses_pooler`) refuses transformers' packed format: its labels are one per
        sequence, which DataCollatorWithFlattening does not carry."""
        out = self.model(**dict(zip(self.body_inputs, inputs)), **named, **packed_format(kwargs), return_dict=True)
        plan = plan_of(out)
        if self.uses_pooler and plan is not None:
            plan.refuse_packed_rows(type(self).__name__)
        return out

    def _causal_lm_output(self, labels, use_cache, return_dict, kwargs, *inputs, **named):
        """A causal language model's forward (BERT's and the decoder's), its body's inputs as `_body` takes them: the
        body (no cache where labels train it), scores at every position, the next-token loss, the output."""
        shift_labels = kwargs.get("shift_labels")
        check_labels(labels, self.config.vocab_size, "vocab_size")
        next_labels = next_tokens(labels, shift_labels)  # (B, T): what position t is scored against
        attention_mask = inputs[self.body_inputs.index("attention_mask")]
        out = self._body(kwargs, *inputs, **named, use_cache=no_cache_for_labels(use_cache, next_labels),
                         outputs_at_padding=reads_padding(next_labels, attention_mask))
        logits = token_logits(self.lm_head, out.last_hidden_state, plan_of(out))  # (B, T, V)
        loss = causal_lm_loss(self.loss_function, self.config.vocab_size, logits, labels, shift_labels)
        return self._output(CausalLMOutputWithCrossAttentions, out, return_dict, loss=loss, logits=logits.all)

    def _classification_loss(self, logits, labels):
        """Sequence classification's loss: regression (MSE), single-label (cross-entropy) or multi-label (binary
        cross-entropy), by `config.problem_type`, which transformers sets from the first labels it sees."""
        return None if labels is None else self.loss_function(labels=labels, pooled_logits=logits, config=self.config)


# ----------------------------------------------------------------------------------------------------------------
# 2. The BERT-style encoder and its heads
# ----------------------------------------------------------------------------------------------------------------


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
    body_inputs = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds",
                   "output_attentions", "output_hidden_states")

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
        out = self._body(kwargs, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_attentions, output_hidden_states,
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
        return self._causal_lm_output(labels, use_cache, return_dict, kwargs, input_ids, attention_mask,
                                      token_type_ids, position_ids, inputs_embeds, output_attentions,
                                      output_hidden_states, cache=cache, past_key_values=past_key_values)


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
        out = self._body(kwargs, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_attentions, output_hidden_states,
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
        out = self._body(kwargs, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_attentions, output_hidden_states)
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
        out = self._body(kwargs, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_attentions, output_hidden_states)
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

        out = self._body(kwargs, flat(input_ids), flat(attention_mask), flat(token_type_ids), flat(position_ids),
                         flat(inputs_embeds), output_attentions, output_hidden_states)
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
        out = self._body(kwargs, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_attentions, output_hidden_states,
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
        out = self._body(kwargs, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_attentions, output_hidden_states,
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
        out = self._body(kwargs, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         output_attentions, output_hidden_states)
        logits = self.rtd_head(out.last_hidden_state)  # (B, T)
        loss = replaced_token_loss(logits, labels, attention_mask)
        return self._output(TokenClassifierOutput, out, return_dict, loss=loss, logits=logits)


# ----------------------------------------------------------------------------------------------------------------
# 3. The encoder-decoder and its heads
# ----------------------------------------------------------------------------------------------------------------


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
            check_target(self.config, decoder_input_ids, decoder_inputs_embeds, decoder_attention_mask, past_key_values)
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
    body_inputs = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask", "encoder_outputs",
                   "token_type_ids", "inputs_embeds", "decoder_inputs_embeds", "output_attentions",
                   "output_hidden_states", "position_ids", "decoder_position_ids")

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
                self, target.word_embeddings, new_num_tokens, pad_to_multiple_of, mean_resizing
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
        out = self._body(kwargs, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs,
                         token_type_ids, inputs_embeds, decoder_inputs_embeds, output_attentions, output_hidden_states,
                         position_ids, decoder_position_ids, cache=cache, past_key_values=past_key_values,
                         use_cache=use_cache, outputs_at_padding=reads_padding(labels, decoder_attention_mask))
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
        out = self._body(kwargs, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs,
                         token_type_ids, output_attentions=output_attentions,
                         output_hidden_states=output_hidden_states, use_cache=False)
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
        out = self._body(kwargs, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs,
                         token_type_ids, inputs_embeds, decoder_inputs_embeds, output_attentions, output_hidden_states,
                         use_cache=False, outputs_at_padding=start_positions is not None or end_positions is not None)
        start_logits, end_logits = span_logits(self.qa_outputs, out.last_hidden_state)
        loss = self.loss_function(start_logits, end_logits, start_positions, end_positions)
        return self._output(Seq2SeqQuestionAnsweringModelOutput, out, return_dict, loss=loss,
                            start_logits=start_logits, end_logits=end_logits)


# ----------------------------------------------------------------------------------------------------------------
# 4. The decoder alone: a causal language model
# ----------------------------------------------------------------------------------------------------------------


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
    body_inputs = ("input_ids", "attention_mask", "position_ids", "inputs_embeds", "output_attentions",
                   "output_hidden_states")

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
        return self._causal_lm_output(labels, use_cache, return_dict, kwargs, input_ids, attention_mask,
                                      position_ids, inputs_embeds, output_attentions, output_hidden_states,
                                      cache=cache, past_key_values=past_key_values)


# The public classes: the base, and every model `heads.py` declares (each defined above).
__all__ = ["VanillaPreTrainedModel", *MODELS]
