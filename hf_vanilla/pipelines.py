"""The `seq2seq-generation` pipeline: text in, generated text out, for any `AutoModelForSeq2SeqLM`.

transformers 5 removed `text2text-generation`, `summarization` and `translation`, and refuses to register a custom
pipeline under those names. This one takes their place under a new name; importing `hf_vanilla` registers it:

    import hf_vanilla
    from transformers import pipeline

    generator = pipeline("seq2seq-generation", model="path/to/checkpoint")
    generator("a source sentence", max_new_tokens=32)
    # [{"generated_text": "..."}]
    generator(["one", "two", "three"], num_beams=4, batch_size=2)
    # [[{"generated_text": "..."}], [{"generated_text": "..."}], [{"generated_text": "..."}]]

Generation options (`max_new_tokens`, `num_beams`, `do_sample`, `num_return_sequences`, a `generation_config`, ...)
go to `model.generate` unchanged, whether given when the pipeline is built or when it is called (the call's win).
The pipeline calls `generate` itself: the base class's generation helpers differ between transformers 5.17 and 5.23.
"""

import torch
from transformers import AutoModelForSeq2SeqLM, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

TASK = "seq2seq-generation"


class Seq2SeqGenerationPipeline(Pipeline):
    """Tokenize each input text, `generate` from it, and decode every returned sequence without special tokens.

    Pipeline options (everything else is a generation option):
        truncation: passed to the tokenizer, e.g. `True` to cut inputs to the model's maximum length.
        clean_up_tokenization_spaces: passed to `tokenizer.decode`.

    Returns, for each input, a list with one `{"generated_text": str}` per returned sequence.
    """

    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not (self.model.config.is_encoder_decoder and self.model.can_generate()):
            raise ValueError(
                f"{TASK!r} needs an encoder-decoder that can generate (an AutoModelForSeq2SeqLM); "
                f"{type(self.model).__name__} is not one."
            )

    def _sanitize_parameters(self, truncation=None, clean_up_tokenization_spaces=None, **generate_kwargs):
        preprocess_params = {} if truncation is None else {"truncation": truncation}
        postprocess_params = (
            {} if clean_up_tokenization_spaces is None
            else {"clean_up_tokenization_spaces": clean_up_tokenization_spaces}
        )
        # Kept flat, so that options given at call time override those given at construction one by one.
        return preprocess_params, generate_kwargs, postprocess_params

    def preprocess(self, text, truncation=False):
        if not isinstance(text, str):
            raise TypeError(f"{TASK!r} takes a string or a list of strings, got {type(text).__name__}.")
        # No token_type_ids: a single text is all segment 0, which is every model's default, and models without
        # segments (Marian, BART) would refuse them in `generate`.
        return self.tokenizer(text, return_tensors="pt", truncation=truncation, return_token_type_ids=False)

    def _forward(self, model_inputs, **generate_kwargs):
        B = model_inputs["input_ids"].shape[0]
        output = self.model.generate(**model_inputs, **generate_kwargs)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences  # (B * n, L)
        # (B, n, L): n returned sequences per input, so that batches split back into inputs along the first axis.
        return {"output_ids": sequences.reshape(B, -1, sequences.shape[-1])}

    def postprocess(self, model_outputs, clean_up_tokenization_spaces=None):
        decode_kwargs = {"skip_special_tokens": True}
        if clean_up_tokenization_spaces is not None:
            decode_kwargs["clean_up_tokenization_spaces"] = clean_up_tokenization_spaces
        return [
            {"generated_text": self.tokenizer.decode(ids, **decode_kwargs)}
            for ids in model_outputs["output_ids"][0]  # (1, n, L): one input's sequences
        ]


PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=Seq2SeqGenerationPipeline, pt_model=AutoModelForSeq2SeqLM)

__all__ = ["TASK", "Seq2SeqGenerationPipeline"]
