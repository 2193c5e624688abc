"""hf_vanilla: a from-scratch, readable Transformer that is a first-class Hugging Face model.

`import hf_vanilla` registers the configs and models with transformers' Auto classes, so a converted checkpoint
loads with `AutoModel.from_pretrained(path)` without `trust_remote_code`.
"""

__version__ = "0.2.0"

import os as _os
import sys as _sys

if _sys.argv and _os.path.basename(_sys.argv[0]).removesuffix(".exe") == "hf-vanilla":
    # The `hf-vanilla` command: Python imports this package before the command's module, and with it transformers
    # (seconds). --help and usage errors are answered here first, with argparse alone (they exit); a sub-command
    # that runs goes on to the full import below.
    from .conversion.cli import answer_without_models

    answer_without_models()

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForNextSentencePrediction,
    AutoModelForPreTraining,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from . import configuration_vanilla, modeling_vanilla
from .configuration_vanilla import VanillaEncoderConfig, VanillaSeq2SeqConfig
from .modeling_vanilla import (
    VanillaDecoderForCausalLM,
    VanillaDecoderModel,
    VanillaEncoderForCausalLM,
    VanillaEncoderForMaskedLM,
    VanillaEncoderForMultipleChoice,
    VanillaEncoderForNextSentencePrediction,
    VanillaEncoderForPreTraining,
    VanillaEncoderForQuestionAnswering,
    VanillaEncoderForReplacedTokenDetection,
    VanillaEncoderForSequenceClassification,
    VanillaEncoderForTokenClassification,
    VanillaEncoderModel,
    VanillaPreTrainedModel,
    VanillaSeq2SeqForConditionalGeneration,
    VanillaSeq2SeqForQuestionAnswering,
    VanillaSeq2SeqForSequenceClassification,
    VanillaSeq2SeqModel,
)
from .pipelines import Seq2SeqGenerationPipeline  # noqa: F401  (importing registers "seq2seq-generation")

# Which Auto class loads which model: also the `auto_map` written next to remote-code checkpoints. Each mirrors
# transformers' BERT (encoder) and BART (encoder-decoder, and its decoder alone as AutoModelForCausalLM).
# ELECTRA's discriminator (VanillaEncoderForReplacedTokenDetection) has no Auto class of its own here:
# AutoModelForPreTraining is BERT's pre-training model; load it with its class.
AUTO_CLASSES = {
    VanillaEncoderConfig: {
        AutoModel: VanillaEncoderModel,
        AutoModelForPreTraining: VanillaEncoderForPreTraining,
        AutoModelForMaskedLM: VanillaEncoderForMaskedLM,
        AutoModelForCausalLM: VanillaEncoderForCausalLM,
        AutoModelForNextSentencePrediction: VanillaEncoderForNextSentencePrediction,
        AutoModelForSequenceClassification: VanillaEncoderForSequenceClassification,
        AutoModelForMultipleChoice: VanillaEncoderForMultipleChoice,
        AutoModelForTokenClassification: VanillaEncoderForTokenClassification,
        AutoModelForQuestionAnswering: VanillaEncoderForQuestionAnswering,
    },
    VanillaSeq2SeqConfig: {
        AutoModel: VanillaSeq2SeqModel,
        AutoModelForSeq2SeqLM: VanillaSeq2SeqForConditionalGeneration,
        AutoModelForSequenceClassification: VanillaSeq2SeqForSequenceClassification,
        AutoModelForQuestionAnswering: VanillaSeq2SeqForQuestionAnswering,
        AutoModelForCausalLM: VanillaDecoderForCausalLM,
    },
}

# `register_for_auto_class` makes every `save_pretrained` copy configuration_vanilla.py and modeling_vanilla.py next
# to the weights and name the class in config.json's `auto_map`. A re-saved checkpoint (Trainer.save_model, a resized
# vocabulary) keeps the `auto_map` it was loaded with, so without this its files would be missing and
# `trust_remote_code` loading would fail.
for _config_class, _models in AUTO_CLASSES.items():
    AutoConfig.register(_config_class.model_type, _config_class, exist_ok=True)
    _config_class.register_for_auto_class()
    for _auto_class, _model_class in _models.items():
        _auto_class.register(_config_class, _model_class, exist_ok=True)
        _model_class.register_for_auto_class(_auto_class.__name__)

# The public names: the Auto-class table, and each module's own `__all__` (the classes are listed once, where they are
# defined).
__all__ = ["AUTO_CLASSES"]
__all__ += configuration_vanilla.__all__
__all__ += modeling_vanilla.__all__
