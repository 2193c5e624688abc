"""sentence-transformers: the real all-MiniLM-L6-v2, converted with `python -m conversion bert`, loads as
`SentenceTransformer(converted_dir, trust_remote_code=True)` and embeds like the original.

The conversion copies modules.json, sentence_bert_config.json and 1_Pooling/ next to the weights; without them
sentence-transformers would fall back to its defaults and silently change pooling, normalisation and
max_seq_length. Everything runs offline (conftest sets HF_HUB_OFFLINE=1).
"""

import json
from pathlib import Path

import pytest
import torch
from numerics import assert_close

pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling  # noqa: E402

from hf_vanilla.conversion.cli import main  # noqa: E402

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "Two men pushed carts through the woods.",
    "Hi",
    # Longer than max_seq_length (256 word pieces): both sides must truncate at the same place.
    " ".join(["The quick brown fox jumps over the lazy dog."] * 40),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory, minilm_path):
    """(original, converted) SentenceTransformers and the converted directory."""
    converted = tmp_path_factory.mktemp("st") / "all-MiniLM-L6-v2-vanilla"
    assert main(["bert", "--source", str(minilm_path), "--output", str(converted)]) == 0
    original = SentenceTransformer(str(minilm_path), device="cpu")
    ours = SentenceTransformer(str(converted), device="cpu", trust_remote_code=True)
    return original, ours, converted


def test_converted_model_runs_the_vanilla_encoder(models):
    _, ours, converted = models
    assert type(ours[0].auto_model).__name__ == "VanillaEncoderModel"
    assert json.loads((converted / "config.json").read_text())["model_type"] == "vanilla_encoder"


def test_pooling_normalisation_and_max_seq_length_are_preserved(models, minilm_path):
    original, ours, converted = models
    assert ours.max_seq_length == original.max_seq_length == 256
    assert [type(m).__name__ for m in ours] == [type(m).__name__ for m in original] == \
        ["Transformer", "Pooling", "Normalize"]
    assert isinstance(ours[1], Pooling) and isinstance(ours[2], Normalize)
    assert ours[1].get_config_dict() == original[1].get_config_dict()
    assert ours[1].get_config_dict()["pooling_mode"] == "mean"
    for name in ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json"):
        assert json.loads((converted / name).read_text()) == json.loads((Path(minilm_path) / name).read_text())
    assert ours.tokenizer.model_max_length == original.tokenizer.model_max_length


def test_sentence_embeddings_match_the_original(models):
    original, ours, _ = models
    expected = original.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))
    actual = ours.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))  # one padded batch
    assert actual.shape == expected.shape == (len(SENTENCES), 384)
    assert_close(actual, expected)
    assert_close(actual.norm(dim=-1), torch.ones(len(SENTENCES)))  # normalised
    # one at a time (no padding) gives the same embeddings as the padded batch
    single = torch.stack([ours.encode(s, convert_to_tensor=True) for s in SENTENCES[:3]])
    assert_close(single, expected[:3])
    # and the ranking that semantic search reads off them is the same
    assert (ours.similarity(actual, actual).argsort(dim=-1) == original.similarity(expected, expected).argsort(
        dim=-1)).all()
