"""Which transformers Auto class loads which hf_vanilla model, and the registration that makes
`AutoModel.from_pretrained(path)` load a converted checkpoint without `trust_remote_code`.

Each table mirrors transformers' BERT (encoder) and BART (encoder-decoder, and its decoder alone as
AutoModelForCausalLM). ELECTRA's discriminator (VanillaEncoderForReplacedTokenDetection) has no Auto class of its
own: AutoModelForPreTraining is BERT's pre-training model; load it with its class.
"""

import transformers

from .configuration_vanilla import VanillaEncoderConfig, VanillaSeq2SeqConfig
from .modeling_vanilla import (
    VanillaDecoderForCausalLM,
    VanillaEncoderForCausalLM,
    VanillaEncoderForMaskedLM,
    VanillaEncoderForMultipleChoice,
    VanillaEncoderForNextSentencePrediction,
    VanillaEncoderForPreTraining,
    VanillaEncoderForQuestionAnswering,
    VanillaEncoderForSequenceClassification,
    VanillaEncoderForTokenClassification,
    VanillaEncoderModel,
    VanillaSeq2SeqForConditionalGeneration,
    VanillaSeq2SeqForQuestionAnswering,
    VanillaSeq2SeqForSequenceClassification,
    VanillaSeq2SeqModel,
)
from .pipelines import Seq2SeqGenerationPipeline  # noqa: F401  (importing registers "seq2seq-generation")

AUTO_CLASSES = {
    VanillaEncoderConfig: {
        transformers.AutoModel: VanillaEncoderModel,
        transformers.AutoModelForPreTraining: VanillaEncoderForPreTraining,
        transformers.AutoModelForMaskedLM: VanillaEncoderForMaskedLM,
        transformers.AutoModelForCausalLM: VanillaEncoderForCausalLM,
        transformers.AutoModelForNextSentencePrediction: VanillaEncoderForNextSentencePrediction,
        transformers.AutoModelForSequenceClassification: VanillaEncoderForSequenceClassification,
        transformers.AutoModelForMultipleChoice: VanillaEncoderForMultipleChoice,
        transformers.AutoModelForTokenClassification: VanillaEncoderForTokenClassification,
        transformers.AutoModelForQuestionAnswering: VanillaEncoderForQuestionAnswering,
    },
    VanillaSeq2SeqConfig: {
        transformers.AutoModel: VanillaSeq2SeqModel,
        transformers.AutoModelForSeq2SeqLM: VanillaSeq2SeqForConditionalGeneration,
        transformers.AutoModelForSequenceClassification: VanillaSeq2SeqForSequenceClassification,
        transformers.AutoModelForQuestionAnswering: VanillaSeq2SeqForQuestionAnswering,
        transformers.AutoModelForCausalLM: VanillaDecoderForCausalLM,
    },
}


def register() -> None:
    """Register every config and model with its Auto classes (idempotent).

    `register_for_auto_class` also makes every `save_pretrained` copy the model's source files next to the weights
    and name the class in config.json's `auto_map`. A re-saved checkpoint (Trainer.save_model, a resized vocabulary)
    keeps the `auto_map` it was loaded with, so without this its files would be missing and `trust_remote_code`
    loading would fail."""
    for config_class, models in AUTO_CLASSES.items():
        transformers.AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        config_class.register_for_auto_class()
        for auto_class, model_class in models.items():
            auto_class.register(config_class, model_class, exist_ok=True)
            model_class.register_for_auto_class(auto_class.__name__)

__all__ = ["AUTO_CLASSES"]
