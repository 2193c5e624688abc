"""Which transformers Auto class loads which hf_vanilla model (as `heads.py` declares them), and the registration
that makes `AutoModel.from_pretrained(path)` load a converted checkpoint without `trust_remote_code`."""

import transformers

from . import modeling_decoder, modeling_encoder, modeling_seq2seq
from .configuration_vanilla import VanillaEncoderConfig, VanillaSeq2SeqConfig
from .heads import MODELS
from .pipelines import Seq2SeqGenerationPipeline  # noqa: F401  (importing registers "seq2seq-generation")

CONFIGS = {"encoder": VanillaEncoderConfig, "seq2seq": VanillaSeq2SeqConfig}

# class name -> class: every model `heads.py` declares, from the module of its family
MODEL_CLASSES = {name: getattr(module, name) for module in (modeling_encoder, modeling_seq2seq, modeling_decoder)
                 for name in module.__all__}

# config class -> {Auto class -> model class}
AUTO_CLASSES = {
    config_class: {
        getattr(transformers, declared.auto_class): MODEL_CLASSES[name]
        for name, declared in MODELS.items() if declared.config == family and declared.auto_class
    }
    for family, config_class in CONFIGS.items()
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


__all__ = ["AUTO_CLASSES", "MODEL_CLASSES"]
