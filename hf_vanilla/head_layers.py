"""The layers a head puts on its body's states: BERT's language-model head, whose output projection is tied to the
token embeddings, BERT's classification layer, and ELECTRA's replaced-token detector. Their attribute names are
those of BERT's and ELECTRA's checkpoints' keys. Shapes follow `transformer.py`'s key (E, V)."""

from torch import nn
from transformers.activations import ACT2FN

from .kernels import VanillaLinear


def classifier_layers(config, num_outputs: int):
    """BERT's classification layer: dropout (`classifier_dropout`, or the hidden dropout when unset), then a linear
    map (..., E) -> (..., num_outputs), held as `dropout` and `classifier`, the names BERT's checkpoints' keys use."""
    rate = config.hidden_dropout_prob if config.classifier_dropout is None else config.classifier_dropout
    return nn.Dropout(rate), VanillaLinear(config.hidden_size, num_outputs)


class VanillaLMHead(nn.Module):
    """Scores every vocabulary entry at every position: (..., E) -> (..., V).

    The output projection is the token embedding matrix (section 3.4), tied by `_tied_weights_keys`. BERT first
    applies dense + activation + LayerNorm (`transform`); the paper projects directly. Its bias (`decoder.bias`) is
    trained, as BERT's is, or, with `trainable_bias=False`, a buffer saved under the same name and never trained, as
    BART's and Marian's `final_logits_bias` is (and BartForCausalLM, which has none, keeps zeros there): a converted
    model then trains the parameters the source's class trains.
    """

    def __init__(self, config, transform: bool, trainable_bias: bool = True):
        super().__init__()
        if transform:
            self.dense = VanillaLinear(config.hidden_size, config.embedding_size)
            self.act = ACT2FN[config.hidden_act]
            self.norm = nn.LayerNorm(config.embedding_size, eps=config.layer_norm_eps)
        self.transform = transform
        self.trainable_bias = trainable_bias
        self.set_projection(VanillaLinear(config.embedding_size if transform else config.hidden_size,
                                          config.vocab_size))

    def set_projection(self, linear: nn.Linear):
        """Make `linear` the output projection `decoder` (resizing the vocabulary builds a new one), its bias turned
        into a buffer unless `trainable_bias`."""
        if not self.trainable_bias and isinstance(linear.bias, nn.Parameter):
            bias = linear.bias.detach()
            del linear.bias  # a parameter, until registered as a buffer of the same name (and state-dict key)
            linear.register_buffer("bias", bias)
        self.decoder = linear

    def forward(self, hidden_states):
        if self.transform:
            hidden_states = self.norm(self.act(self.dense(hidden_states)))
        return self.decoder(hidden_states)


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
