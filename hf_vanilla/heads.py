"""Every model class hf_vanilla ships, declared once, with what follows from it elsewhere.

A row names the class (defined in its family's module: `modeling_encoder.py`, `modeling_seq2seq.py` or
`modeling_decoder.py`) and:
    config ....... which config it takes: the encoder's or the encoder-decoder's
    auto_class ... the transformers Auto class that loads it (`auto.py` registers it; None: load it by its class)
    head ......... its name as a converter's `--head` choice (BERT-family formats), where a converter writes it
    export_task .. its `python -m conversion onnx --task`, where it exports
    formats ...... the BERT-family converters that write it (`--head` is `head`), and whose `to-<format>` reads it

Those modules' `__all__`, the Auto registration, the converters' `--head` choices (the command line's listing, and
the set each format module's heads table is checked against when it is imported) and the ONNX export tasks are read
from here, so adding a head is this one row plus its class (and, for a converter, its key table). This module
imports nothing: the command line reads it to list choices without loading torch.
"""

from typing import NamedTuple


class Declared(NamedTuple):
    config: str  # "encoder" (VanillaEncoderConfig) or "seq2seq" (VanillaSeq2SeqConfig)
    auto_class: str | None
    head: str | None = None
    export_task: str | None = None
    formats: tuple[str, ...] = ()


# Each mirrors transformers' BERT (encoder) and BART (encoder-decoder, and its decoder alone as a causal LM).
# ELECTRA's discriminator has no Auto class of its own: AutoModelForPreTraining is BERT's pre-training model.
ALL_FORMATS = ("bert", "roberta", "distilbert", "electra")
MODELS = {
    "VanillaEncoderModel": Declared("encoder", "AutoModel", "base", export_task="feature-extraction",
                                    formats=ALL_FORMATS),
    "VanillaEncoderForPreTraining": Declared("encoder", "AutoModelForPreTraining", "pretraining", formats=("bert",)),
    "VanillaEncoderForMaskedLM": Declared("encoder", "AutoModelForMaskedLM", "masked-lm", export_task="fill-mask",
                                          formats=ALL_FORMATS),
    "VanillaEncoderForCausalLM": Declared("encoder", "AutoModelForCausalLM", "causal-lm", formats=("bert",)),
    "VanillaEncoderForNextSentencePrediction": Declared("encoder", "AutoModelForNextSentencePrediction",
                                                        "next-sentence-prediction", formats=("bert",)),
    "VanillaEncoderForSequenceClassification": Declared("encoder", "AutoModelForSequenceClassification",
                                                        "sequence-classification", export_task="text-classification",
                                                        formats=("bert",)),
    "VanillaEncoderForMultipleChoice": Declared("encoder", "AutoModelForMultipleChoice", "multiple-choice",
                                                formats=("bert",)),
    "VanillaEncoderForTokenClassification": Declared("encoder", "AutoModelForTokenClassification",
                                                     "token-classification", export_task="token-classification",
                                                     formats=ALL_FORMATS),
    "VanillaEncoderForQuestionAnswering": Declared("encoder", "AutoModelForQuestionAnswering", "question-answering",
                                                   export_task="question-answering", formats=ALL_FORMATS),
    "VanillaEncoderForReplacedTokenDetection": Declared("encoder", None, "replaced-token-detection",
                                                        formats=("electra",)),
    "VanillaSeq2SeqModel": Declared("seq2seq", "AutoModel"),
    "VanillaSeq2SeqForConditionalGeneration": Declared("seq2seq", "AutoModelForSeq2SeqLM", export_task="seq2seq"),
    "VanillaSeq2SeqForSequenceClassification": Declared("seq2seq", "AutoModelForSequenceClassification"),
    "VanillaSeq2SeqForQuestionAnswering": Declared("seq2seq", "AutoModelForQuestionAnswering"),
    "VanillaDecoderModel": Declared("seq2seq", None),
    "VanillaDecoderForCausalLM": Declared("seq2seq", "AutoModelForCausalLM"),
}


def class_for_head(head: str) -> str:
    """The encoder class a converter's `--head` choice writes."""
    return next(name for name, declared in MODELS.items() if declared.head == head)


def converter_heads(format: str) -> tuple[str, ...]:
    """The `--head` choices of the BERT-family converter `format` ("roberta"), in this table's order."""
    return tuple(declared.head for declared in MODELS.values() if format in declared.formats)


def export_tasks() -> dict[str, str]:
    """Class name -> its ONNX export task, for the classes that export."""
    return {name: declared.export_task for name, declared in MODELS.items() if declared.export_task}


__all__ = ["ALL_FORMATS", "MODELS", "Declared", "class_for_head", "converter_heads", "export_tasks"]
