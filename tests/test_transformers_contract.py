"""transformers' own common model tests, run against our classes: the contract every model in transformers meets.

`ModelTesterMixin` (save/load, tied weights, attention and hidden-state outputs, gradient checkpointing, resizing
embeddings, initialisation, attention backends, ...) and `ConfigTester` come from transformers' test suite for the
installed version (see transformers_tests.py: fetched from the PyPI sdist once, or a source checkout named by
HF_VANILLA_TRANSFORMERS_SRC, which adds `GenerationTesterMixin`). The testers below build tiny configs and inputs for
them, as BertModelTester and BartModelTester do for BERT and BART.

Every known failure is listed in KNOWN_FAILURES with the work item that fixes it, as a strict xfail: when the item
is done the test passes, the xfail turns into a failure (XPASS), and the line is deleted. The table is the remaining
contract. Tests that take longer than a few seconds on 2 CPU cores are listed in SLOW.

    python -m pytest tests/test_transformers_contract.py -rsx                   # the contract, with reasons
    HF_VANILLA_SLOW=1 python -m pytest tests/test_transformers_contract.py    # and the slow ones
"""

import contextlib
import functools
import unittest

import pytest
import torch
import transformers_tests

import hf_vanilla
from hf_vanilla import (
    VanillaDecoderForCausalLM,
    VanillaEncoderConfig,
    VanillaEncoderForPreTraining,
    VanillaEncoderForReplacedTokenDetection,
    VanillaSeq2SeqConfig,
)

try:
    modeling_common, configuration_common, FROM_SOURCE = transformers_tests.load()
except transformers_tests.Unavailable as error:
    pytest.skip(str(error), allow_module_level=True)

ModelTesterMixin = modeling_common.ModelTesterMixin
GenerationTesterMixin = modeling_common.GenerationTesterMixin
ConfigTester = configuration_common.ConfigTester
ids_tensor = modeling_common.ids_tensor
random_attention_mask = modeling_common.random_attention_mask
pytestmark = pytest.mark.parity

# (test class, test name) -> the work item whose absence makes it fail, as a strict xfail: delete a line when it
# XPASSes. Empty: the six failures it listed (attention maps under sdpa, heads building a pooler they never read)
# were fixed when every head was built.
KNOWN_FAILURES = {}

# Tests of a choice we make differently from transformers' own models, with the reason and where the behaviour we
# chose instead is tested. They are skipped, saying so.
DEVIATIONS = {
    "test_bc_cache_name_forward": (
        "transformers 5.24 deprecates forward(past_key_values=) with a warning; hf_vanilla takes it without one, "
        "since it supports transformers versions where that is the only name. Both names giving the "
        "same cache is tests/test_generation.py::test_the_cache_comes_back_under_the_installed_name_and_is_taken_"
        "under_both"
    ),
}

# Slow on 2 CPU cores; run with HF_VANILLA_SLOW=1 (and RUN_SLOW=1 for the tests transformers itself marks slow).
# Of the 26 eager-vs-sdpa variants (dtype x padding side x mask x kernel choice), one fp32 case runs by default.
SLOW_TESTS = (
    "test_training_gradient_checkpointing_use_reentrant_false",
    "test_training_gradient_checkpointing_use_reentrant_true",
    "test_bc_torch_dtype",
)
SLOW_FAMILY, DEFAULT_OF_FAMILY = "test_eager_matches_sdpa_inference_", "test_eager_matches_sdpa_inference_09_fp32_pad_left"


@pytest.fixture(scope="module", autouse=True)
def library_model_names():
    """Give transformers the names of our classes the way a model shipped in the library has them.

    The common tests find a class's task by its name in transformers' name tables (`MODEL_FOR_*_MAPPING_NAMES`):
    which labels `_prepare_for_class` makes, which classes `test_training` treats as heads. `Auto*.register`
    fills a separate table, so without this every head would be treated as a class without labels."""
    with pytest.MonkeyPatch.context() as patch:
        for config_class, models in hf_vanilla.AUTO_CLASSES.items():
            for auto_class, model_class in models.items():
                names = auto_class._model_mapping._model_mapping  # e.g. MODEL_FOR_MASKED_LM_MAPPING_NAMES
                patch.setitem(names, config_class.model_type, model_class.__name__)
        yield


class VanillaEncoderModelTester:
    """A tiny encoder config (2 layers, width 32, 4 heads) and a batch of 13 sequences of 7 tokens, padded at
    random positions (first token always real), with token types and every kind of label."""

    def __init__(self, parent, batch_size=13, seq_length=7, is_training=True):
        self.parent = parent
        self.batch_size, self.seq_length, self.is_training = batch_size, seq_length, is_training
        self.vocab_size, self.hidden_size, self.num_hidden_layers, self.num_attention_heads = 99, 32, 2, 4
        self.type_vocab_size, self.num_labels, self.num_choices = 3, 3, 4

    def get_config(self):
        return VanillaEncoderConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, intermediate_size=37, max_position_embeddings=64,
            type_vocab_size=self.type_vocab_size, num_labels=self.num_labels,
        )

    def prepare_config_and_inputs_for_common(self):
        shape = [self.batch_size, self.seq_length]
        inputs = {
            "input_ids": ids_tensor(shape, self.vocab_size),
            "token_type_ids": ids_tensor(shape, self.type_vocab_size),
            "attention_mask": random_attention_mask(shape),
        }
        return self.get_config(), inputs


class VanillaSeq2SeqModelTester:
    """A tiny encoder-decoder (2 + 2 layers, width 32, 4 heads) and 13 pairs of 7-token sources and targets;
    sources end in the end-of-sequence id. Sources and targets have the same length because the common tests
    reuse the source's attention mask for the target (as BartModelTester, whose targets are its sources)."""

    def __init__(self, parent, batch_size=13, seq_length=7, is_training=True):
        self.parent = parent
        self.batch_size, self.seq_length, self.is_training = batch_size, seq_length, is_training
        self.encoder_seq_length = self.decoder_seq_length = seq_length
        self.vocab_size, self.hidden_size, self.num_hidden_layers, self.num_attention_heads = 99, 32, 2, 4
        self.pad_token_id, self.eos_token_id, self.num_labels = 1, 2, 3

    def get_config(self):
        # In BART's field names, as a user of BART/Marian configs writes them (they are aliases of ours).
        return VanillaSeq2SeqConfig(
            vocab_size=self.vocab_size, d_model=self.hidden_size, encoder_layers=self.num_hidden_layers,
            decoder_layers=self.num_hidden_layers, encoder_attention_heads=self.num_attention_heads,
            decoder_attention_heads=self.num_attention_heads, encoder_ffn_dim=37, decoder_ffn_dim=37,
            max_position_embeddings=64, pad_token_id=self.pad_token_id, bos_token_id=0,
            eos_token_id=self.eos_token_id, decoder_start_token_id=0, num_labels=self.num_labels,
        )

    def prepare_config_and_inputs_for_common(self):
        # Ids from 3 up are ordinary tokens; every source ends in </s>.
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size).clamp(3)
        input_ids[:, -1] = self.eos_token_id
        decoder_input_ids = ids_tensor([self.batch_size, self.decoder_seq_length], self.vocab_size).clamp(3)
        inputs = {
            "input_ids": input_ids,
            "attention_mask": input_ids.ne(self.pad_token_id),
            "decoder_input_ids": decoder_input_ids,
            "decoder_attention_mask": decoder_input_ids.ne(self.pad_token_id),
        }
        return self.get_config(), inputs


class _OneOutcomePerTest:
    """The common tests loop over model classes in `subTest`s. A strict xfail marks a whole test, so each test
    must have one outcome: the first failing class fails it (and its passing classes do not read as XPASS)."""

    def subTest(self, *args, **kwargs):
        return contextlib.nullcontext()


class VanillaEncoderContractTest(_OneOutcomePerTest, ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = tuple(hf_vanilla.AUTO_CLASSES[VanillaEncoderConfig].values())  # every class we ship
    # transformers runs this check only on models whose config file names a year from 2023 on; ours names none.
    test_can_init_all_missing_weights_before_2023 = True

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        """The replaced-token detector (ELECTRA's discriminator, loaded by AutoModelForPreTraining) takes a 0/1 label
        per token. The common tests make no labels for pretraining classes; ElectraModelTest adds them the same way."""
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels)
        shape = (self.model_tester.batch_size, self.model_tester.seq_length)
        if return_labels and model_class is VanillaEncoderForReplacedTokenDetection:
            inputs_dict["labels"] = torch.zeros(shape, dtype=torch.long, device=modeling_common.torch_device)
        if return_labels and model_class is VanillaEncoderForPreTraining:  # BertModelTest adds both the same way
            inputs_dict["labels"] = torch.zeros(shape, dtype=torch.long, device=modeling_common.torch_device)
            inputs_dict["next_sentence_label"] = torch.zeros(shape[:1], dtype=torch.long,
                                                             device=modeling_common.torch_device)
        return inputs_dict

    def setUp(self):
        self.model_tester = VanillaEncoderModelTester(self)
        # hidden_size=37 with the default 12 heads: a config is built field by field, as BertModelTest does.
        self.config_tester = ConfigTester(self, config_class=VanillaEncoderConfig, hidden_size=37)

    def test_config(self):
        self.config_tester.run_common_tests()


class VanillaSeq2SeqContractTest(_OneOutcomePerTest, ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    # The decoder alone has its own tester below, as BART's (BartStandaloneDecoderModelTest).
    all_model_classes = tuple(model for model in hf_vanilla.AUTO_CLASSES[VanillaSeq2SeqConfig].values()
                              if model is not VanillaDecoderForCausalLM)
    test_can_init_all_missing_weights_before_2023 = True
    is_encoder_decoder = True

    def setUp(self):
        self.model_tester = VanillaSeq2SeqModelTester(self)
        self.config_tester = ConfigTester(self, config_class=VanillaSeq2SeqConfig, hidden_size=37)

    def test_config(self):
        self.config_tester.run_common_tests()


class VanillaDecoderModelTester(VanillaSeq2SeqModelTester):
    """The encoder-decoder's tiny config as its decoder alone: no encoder, so no source; one causal stream."""

    def get_config(self):
        config = super().get_config()
        config.is_decoder, config.is_encoder_decoder = True, False
        return config

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size).clamp(3)
        return self.get_config(), {"input_ids": input_ids, "attention_mask": random_attention_mask(input_ids.shape)}


class VanillaDecoderContractTest(_OneOutcomePerTest, ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = (VanillaDecoderForCausalLM,)
    test_can_init_all_missing_weights_before_2023 = True

    def setUp(self):
        self.model_tester = VanillaDecoderModelTester(self)


def _marked(test_class, name, mark):
    """Put `mark` on `test_class.name` without touching the function the mixin shares with the other class."""
    inherited = getattr(test_class, name)

    @functools.wraps(inherited)
    def test(self, *args, **kwargs):
        return inherited(self, *args, **kwargs)

    setattr(test_class, name, mark(test))


def _apply_marks():
    for test_class in (VanillaEncoderContractTest, VanillaSeq2SeqContractTest, VanillaDecoderContractTest):
        for (owner, name), item in KNOWN_FAILURES.items():
            if owner == test_class.__name__:
                _marked(test_class, name, pytest.mark.xfail(strict=True, reason=item))
        for name, reason in DEVIATIONS.items():
            if hasattr(test_class, name):
                _marked(test_class, name, pytest.mark.skip(reason=reason))
        for name in dir(test_class):
            if name in SLOW_TESTS or (name.startswith(SLOW_FAMILY) and name != DEFAULT_OF_FAMILY):
                _marked(test_class, name, pytest.mark.slow)


_apply_marks()  # a function, so that no module-level name holds a TestCase class for pytest to collect twice
