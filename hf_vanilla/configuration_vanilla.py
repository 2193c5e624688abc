"""Configurations for hf_vanilla's two models.

`VanillaEncoderConfig` describes a BERT-style encoder; its defaults are bert-base-uncased.
`VanillaSeq2SeqConfig` describes the encoder-decoder of "Attention Is All You Need"; its defaults are the paper's
base model (Table 3). Both share `_VanillaConfig`, which holds every field the shared modules (embeddings, attention,
feed-forward, residual blocks) read, so each field is declared and checked once.

Field names are Hugging Face's (`hidden_size`, `num_attention_heads`, ...) so that tools find them. Other names for
the same fields are aliases (transformers' `attribute_map`): the paper's `d_model`, `d_ff`, `h`, `N`, and the names
of BART and Marian configs (`encoder_layers`, `encoder_ffn_dim`, `dropout`, `activation_function`, ...), so a config
written with those names needs no translation. An alias *is* its field: at construction, in `from_dict` /
`from_pretrained`, and when assigned later (`config.d_model = 32` sets `hidden_size`).

Derived fields (`embedding_size`, the decoder's `decoder_*` sizes, `share_encoder_decoder_embeddings`) are stored as
`None` when they follow another field and read as that field's current value, so they follow an alias or a later
assignment too; set one to fix it.

Checks happen in two places, as in transformers. Each field on its own (a positive size, a known activation, a
dropout in [0, 1)) is checked when the config is built. Agreement between fields (heads dividing the width, ...) is
checked by `check_architecture()`, which every model runs before allocating a weight: a config may pass through
states no model could be built from while a tool fills it in field by field (transformers' ConfigTester, `from_dict`
followed by overrides), as BertConfig allows.
"""

from typing import ClassVar

from huggingface_hub.dataclasses import strict
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

POSITION_EMBEDDING_TYPES = ("learned", "sinusoidal")
SINUSOIDAL_LAYOUTS = ("interleaved", "concatenated")


@strict
class _VanillaConfig(PretrainedConfig):
    """Fields common to the encoder and the encoder-decoder.

    Args:
        vocab_size: number of token ids.
        hidden_size: model width E (aliases: `d_model`).
        num_hidden_layers: number of (encoder) layers N (aliases: `N`, `encoder_layers`).
        num_attention_heads: number of heads H; must divide `hidden_size` (aliases: `h`, `encoder_attention_heads`).
        intermediate_size: feed-forward width F (aliases: `d_ff`, `encoder_ffn_dim`).
        hidden_act: feed-forward activation, any key of `transformers.activations.ACT2FN` ("relu", "gelu", ...)
            (alias: `activation_function`).
        hidden_dropout_prob: dropout on embeddings and on every sub-layer output before the residual add
            (alias: `dropout`).
        attention_probs_dropout_prob: dropout on the attention weights (alias: `attention_dropout`).
        max_position_embeddings: length of the position table.
        type_vocab_size: number of segment (token type) ids; 0 means no segment embeddings (DistilBERT). RoBERTa has
            1: every token adds the same segment vector.
        layer_norm_eps: LayerNorm epsilon.
        initializer_range: standard deviation of the normal initialisation (alias: `init_std`).
        position_embedding_type: "learned" (BERT) or "sinusoidal" (the paper, section 3.5).
        sinusoidal_layout: "interleaved" puts sin on even and cos on odd features, as the paper's formula does;
            "concatenated" puts all sines first, then all cosines, as Marian checkpoints were trained.
        position_offset: the first position id. RoBERTa numbers positions from `padding_idx + 1` = 2.
        embedding_size: width of the token embeddings when it differs from `hidden_size` (ELECTRA); the sum of
            embeddings is then projected to `hidden_size`. `None` (the default) follows `hidden_size`.
        embedding_layer_norm: LayerNorm the summed embeddings (BERT) or not (the paper).
        scale_embeddings: multiply token embeddings by sqrt(hidden_size) (the paper, section 3.4) or not (BERT)
            (alias: `scale_embedding`).
        pre_norm: normalise each sub-layer's input (pre-LN) instead of its residual sum (post-LN: BERT, the paper).
        pad_token_id: the padding id; its embedding gets no gradient.
        tie_word_embeddings: share the output projection with the input embeddings (section 3.4).
        is_decoder: mask self-attention to the past (a causal language model's stack).
        use_cache: keep keys and values between generation steps (causal models).
    """

    attribute_map: ClassVar[dict[str, str]] = {
        "d_model": "hidden_size",
        "d_ff": "intermediate_size",
        "h": "num_attention_heads",
        "N": "num_hidden_layers",
        "encoder_layers": "num_hidden_layers",
        "encoder_attention_heads": "num_attention_heads",
        "encoder_ffn_dim": "intermediate_size",
        "activation_function": "hidden_act",
        "dropout": "hidden_dropout_prob",
        "attention_dropout": "attention_probs_dropout_prob",
        "init_std": "initializer_range",
        "scale_embedding": "scale_embeddings",
    }
    # Derived fields: `None` stored means "read the field named here" (see `__getattribute__`).
    _follows: ClassVar[dict[str, str]] = {"embedding_size": "hidden_size"}
    _sizes: ClassVar[tuple[str, ...]] = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                         "intermediate_size", "max_position_embeddings", "embedding_size")

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float | int = 0.1
    attention_probs_dropout_prob: float | int = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    position_embedding_type: str = "learned"
    sinusoidal_layout: str = "interleaved"
    position_offset: int = 0
    embedding_size: int | None = None
    embedding_layer_norm: bool = True
    scale_embeddings: bool = False
    pre_norm: bool = False
    pad_token_id: int | None = 0
    tie_word_embeddings: bool = True
    is_decoder: bool = False
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        # The dataclass `__init__` sets declared fields and hands every other keyword here, aliases included: apply
        # them before anything reads the fields they name.
        given = {}
        for alias, name in self.attribute_map.items():
            if alias in kwargs:
                given.setdefault(name, []).append((alias, kwargs.pop(alias)))
        for name, pairs in given.items():
            stored = self.__dict__[name]  # as given, not as followed: a derived size may still be `None`
            if len({repr(value) for _, value in pairs}) > 1 or (
                stored != self.__dataclass_fields__[name].default and stored != pairs[0][1]
            ):
                named = ", ".join(f"{alias}={value!r}" for alias, value in pairs)
                raise ValueError(f"{named} and {name}={stored!r} name the same field: pass it once.")
            setattr(self, name, pairs[0][1])  # under the field's own name, so that its type is checked
        self._check_fields()
        super().__post_init__(**kwargs)

    def __getattribute__(self, name):
        value = super().__getattribute__(name)
        if value is None:
            cls = type(self)  # not `self._follows`: that would come back here
            followed = cls._follows.get(cls.attribute_map.get(name, name))
            if followed is not None:
                return getattr(self, followed)
        return value

    def _check_fields(self):
        """Refuse, with a plain `ValueError`, a value no model could use whatever the other fields say."""
        for name in self._sizes:
            _check_positive(name, getattr(self, name))
        if self.type_vocab_size < 0:
            raise ValueError(f"type_vocab_size must be >= 0 (0 means no token types), got {self.type_vocab_size}.")
        if self.position_offset < 0:
            raise ValueError(f"position_offset must be >= 0, got {self.position_offset}.")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"Unknown hidden_act {self.hidden_act!r}; choose one of {sorted(ACT2FN)}.")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"Unknown position_embedding_type {self.position_embedding_type!r}; "
                f"choose one of {POSITION_EMBEDDING_TYPES}."
            )
        if self.sinusoidal_layout not in SINUSOIDAL_LAYOUTS:
            raise ValueError(
                f"Unknown sinusoidal_layout {self.sinusoidal_layout!r}; choose one of {SINUSOIDAL_LAYOUTS}."
            )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}.")
        if self.layer_norm_eps <= 0:
            raise ValueError(f"layer_norm_eps must be > 0, got {self.layer_norm_eps}.")

    def check_architecture(self):
        """Refuse, with a plain `ValueError`, a config no model can be built from. Models call this before
        allocating any weight. It checks every field again (one may have been assigned after construction), then
        how the fields agree with each other."""
        self._check_fields()
        _check_heads("hidden_size", self.hidden_size, "num_attention_heads", self.num_attention_heads)
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"pad_token_id ({self.pad_token_id}) is not a row of the embedding table (ids 0 to vocab_size-1="
                f"{self.vocab_size - 1}); set it to the tokenizer's padding id, or null if it has none."
            )
        if self.position_offset >= self.max_position_embeddings:
            raise ValueError(
                f"position_offset ({self.position_offset}) leaves no room in a table of max_position_embeddings="
                f"{self.max_position_embeddings} positions; raise max_position_embeddings."
            )
        if self.position_embedding_type == "sinusoidal" and self.embedding_size % 2:
            raise ValueError(
                f"Sinusoidal positions pair a sine with a cosine, so the embedding width must be even; "
                f"got {self.embedding_size}."
            )


def _check_positive(name: str, value: int) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}.")


def _check_heads(width_name: str, width: int, heads_name: str, heads: int) -> None:
    if width % heads:
        raise ValueError(
            f"{width_name} ({width}) must be divisible by {heads_name} ({heads}): each head takes an equal slice "
            f"of the model width. Try {heads_name} in {[h for h in range(1, min(width, 64) + 1) if width % h == 0]}."
        )


@strict
class VanillaEncoderConfig(_VanillaConfig):
    """A BERT-compatible encoder. The defaults are bert-base-uncased.

    Args (beyond `_VanillaConfig`):
        use_pooler: build BERT's pooler (tanh(W h_[CLS] + b)); DistilBERT and ELECTRA checkpoints have none.
        classifier_dropout: dropout before classification heads; `None` means `hidden_dropout_prob`.
        bos_token_id, eos_token_id: special ids, for code that reads them from any config (generation utilities,
            pipelines); `None`, as in BertConfig, when the tokenizer defines none.
    """

    model_type = "vanilla_encoder"

    use_pooler: bool = True
    classifier_dropout: float | int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None


@strict
class VanillaSeq2SeqConfig(_VanillaConfig):
    """The encoder-decoder of "Attention Is All You Need". The defaults are the paper's base model.

    The encoder uses the shared fields (`num_hidden_layers`, `num_attention_heads`, `intermediate_size`); the
    decoder uses `decoder_layers`, `decoder_attention_heads` and `decoder_intermediate_size`, which follow the
    encoder's values while `None`. They are read as that value everywhere, including by transformers'
    `get_text_config(decoder=True)`, which maps these `decoder_*` names onto the main fields: that is how its
    caches find the decoder's layer count.

    Args (beyond `_VanillaConfig`):
        decoder_layers, decoder_attention_heads, decoder_intermediate_size: decoder sizes (BART's
            `decoder_ffn_dim` is an alias of the last).
        share_encoder_decoder_embeddings: one token embedding matrix for source and target (section 3.4); a
            warm-started bert2bert keeps two. Needs `tie_word_embeddings`, which transformers' tying follows;
            `None` (the default) follows it, so `tie_word_embeddings=False` alone unties everything.
        lm_head_transform: apply BERT's dense + activation + LayerNorm before the output projection (bert2bert).
        trainable_logits_bias: train the output projection's bias (`lm_head.decoder.bias`, as BERT's decoder does)
            or keep it a buffer, saved and never trained, as BART and Marian keep their `final_logits_bias` (the
            BART and Marian converters set False, so that a converted model trains what transformers' class
            trains). Either way the checkpoint holds it under the same key.
        bos_token_id, eos_token_id, decoder_start_token_id: special ids used by `generate`; the sequence
            classification head reads the decoder state at the last `eos_token_id`.
    """

    model_type = "vanilla_seq2seq"
    attribute_map: ClassVar[dict[str, str]] = {
        **_VanillaConfig.attribute_map, "decoder_ffn_dim": "decoder_intermediate_size",
    }
    _follows: ClassVar[dict[str, str]] = {
        **_VanillaConfig._follows,
        "decoder_layers": "num_hidden_layers",
        "decoder_attention_heads": "num_attention_heads",
        "decoder_intermediate_size": "intermediate_size",
        "share_encoder_decoder_embeddings": "tie_word_embeddings",
    }
    _sizes: ClassVar[tuple[str, ...]] = (
        *_VanillaConfig._sizes, "decoder_layers", "decoder_attention_heads", "decoder_intermediate_size",
    )

    # The paper's base model (Table 3): a 32k vocabulary shared by source and target, E 512, N 6, H 8, F 2048.
    vocab_size: int = 32000
    hidden_size: int = 512
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    intermediate_size: int = 2048
    # And the paper's choices where BERT's defaults differ, in the paper's order:
    scale_embeddings: bool = True  # token embeddings times sqrt(E) (section 3.4)
    embedding_layer_norm: bool = False  # the embedding sum goes to the first layer as it is
    type_vocab_size: int = 0  # no segments
    position_embedding_type: str = "sinusoidal"  # section 3.5
    max_position_embeddings: int = 1024
    hidden_act: str = "relu"  # FFN(x) = max(0, x W1 + b1) W2 + b2 (section 3.3)
    attention_probs_dropout_prob: float | int = 0.0  # dropout on sub-layer outputs and embedding sums only (5.4)
    layer_norm_eps: float = 1e-5  # as Marian and BART

    decoder_layers: int | None = None
    decoder_attention_heads: int | None = None
    decoder_intermediate_size: int | None = None
    share_encoder_decoder_embeddings: bool | None = None
    lm_head_transform: bool = False
    trainable_logits_bias: bool = True
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    decoder_start_token_id: int | None = 1
    is_encoder_decoder: bool = True

    def _check_fields(self):
        super()._check_fields()
        if self.decoder_start_token_id is None:
            raise ValueError("decoder_start_token_id is required: generation starts every target with it.")

    def check_architecture(self):
        super().check_architecture()
        _check_heads("hidden_size", self.hidden_size, "decoder_attention_heads", self.decoder_attention_heads)
        if self.share_encoder_decoder_embeddings and not self.tie_word_embeddings:
            # transformers ties `_tied_weights_keys` only under tie_word_embeddings: the sharing would silently go.
            raise ValueError(
                "share_encoder_decoder_embeddings=True needs tie_word_embeddings=True: one embedding matrix serves "
                "source, target and output projection. For separate matrices set share_encoder_decoder_embeddings="
                "False (the output projection is then tied to the target embeddings only if tie_word_embeddings)."
            )


__all__ = ["VanillaEncoderConfig", "VanillaSeq2SeqConfig"]
