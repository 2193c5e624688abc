"""Training with transformers' Trainer: a small VanillaEncoderForSequenceClassification learns a synthetic rule,
gradient accumulation gives the update of the equivalent large batch, and gradient checkpointing gives the same
gradients as plain backpropagation."""

import pytest
import torch
from hf_references import single_thread  # noqa: F401  (fixture)
from numerics import assert_close
from transformers import Trainer, TrainingArguments

from hf_vanilla import VanillaEncoderConfig, VanillaEncoderForSequenceClassification

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    # `gradient_checkpointing` is renamed `activation_checkpointing` in 5.23, which 5.17 does not have yet
    pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning"),
]

CLS, SEP, PAD = 1, 2, 0
POSITIVE, NEGATIVE = range(3, 6), range(6, 9)  # "sentiment words"; ids 9.. are neutral filler


class MarkerDataset(torch.utils.data.Dataset):
    """Sequences of neutral tokens with a few "sentiment words" mixed in; the label says which kind.

    Learnable only by reading the words wherever they sit, through attention: a bag-of-words rule that a small
    encoder picks up in a few dozen steps. Lengths vary, so batches are padded and the attention mask matters."""

    def __init__(self, size: int, seed: int, vocab_size: int = 64, length: int = 12):
        generator = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(size):
            label = int(torch.randint(2, (1,), generator=generator))
            n = int(torch.randint(length // 2, length - 1, (1,), generator=generator))
            tokens = torch.randint(9, vocab_size, (n,), generator=generator)
            markers = POSITIVE if label else NEGATIVE
            where = torch.randperm(n, generator=generator)[:2]
            tokens[where] = torch.tensor(markers)[torch.randint(3, (2,), generator=generator)]
            ids = torch.full((length,), PAD)
            ids[: n + 2] = torch.cat([torch.tensor([CLS]), tokens, torch.tensor([SEP])])
            self.items.append({"input_ids": ids, "attention_mask": (ids != PAD).long(), "labels": torch.tensor(label)})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def tiny_model(dropout: float = 0.1, seed: int = 0):
    torch.manual_seed(seed)
    config = VanillaEncoderConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32, num_labels=2,
                                  hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return VanillaEncoderForSequenceClassification(config)


def arguments(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path), report_to="none", save_strategy="no", use_cpu=True, seed=0,
                    disable_tqdm=True, dataloader_num_workers=0, per_device_train_batch_size=16,
                    per_device_eval_batch_size=64)
    return TrainingArguments(**(settings | overrides))


def accuracy(eval_prediction):
    logits, labels = eval_prediction
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_trainer_fine_tunes_and_the_loss_falls(tmp_path, gradient_checkpointing):
    model = tiny_model()
    args = arguments(tmp_path, max_steps=40, learning_rate=5e-3, warmup_steps=5, logging_steps=5,
                     gradient_checkpointing=gradient_checkpointing)
    trainer = Trainer(model=model, args=args, train_dataset=MarkerDataset(640, seed=0),
                      eval_dataset=MarkerDataset(128, seed=1), compute_metrics=accuracy)
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) >= 5
    assert losses[-1] < 0.5 * losses[0], losses
    assert after["eval_loss"] < 0.5 * before["eval_loss"], (before, after)
    assert after["eval_accuracy"] >= 0.9, after
    if gradient_checkpointing:
        assert all(layer.gradient_checkpointing for layer in model.model.encoder.layers)


def test_gradient_accumulation_matches_the_large_batch(tmp_path):
    """Two accumulated batches of 8 must make the same update as one batch of 16.

    Trainer assumes that a model whose forward takes **kwargs normalises its loss by `num_items_in_batch` and
    then skips dividing by the accumulation steps; ours averages per batch, so it says `accepts_loss_kwargs =
    False` (without it this update was twice as large)."""
    data = MarkerDataset(16, seed=0)
    params = {}
    for name, batch, steps in (("large", 16, 1), ("accumulated", 8, 2)):
        model = tiny_model(dropout=0.0)
        args = arguments(tmp_path / name, max_steps=1, per_device_train_batch_size=batch,
                         gradient_accumulation_steps=steps, optim="sgd", learning_rate=1.0, max_grad_norm=0.0,
                         lr_scheduler_type="constant", logging_steps=1)
        Trainer(model=model, args=args, train_dataset=data).train()
        params[name] = dict(model.named_parameters())
    initial = dict(tiny_model(dropout=0.0).named_parameters())
    for key, value in params["large"].items():
        update, accumulated = value - initial[key], params["accumulated"][key] - initial[key]
        assert_close(accumulated, update, msg=key)


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_gradient_checkpointing_gives_the_same_gradients(padded):
    batch = torch.utils.data.default_collate([MarkerDataset(8, seed=2)[i] for i in range(8)])
    if not padded:
        batch["attention_mask"] = torch.ones_like(batch["attention_mask"])

    def gradients(model):
        calls = []
        # a hook inside the layer: it runs again when checkpointing recomputes the layer during backward
        hook = model.model.encoder.layers[0].ffn.register_forward_hook(lambda *_: calls.append(1))
        model.zero_grad()
        model(**batch).loss.backward()
        hook.remove()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}, len(calls)

    model = tiny_model(dropout=0.0).train()
    plain, plain_calls = gradients(model)
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    checkpointed, checkpointed_calls = gradients(model)

    assert plain_calls == 1 and checkpointed_calls == 2  # the layer really is recomputed during backward
    assert plain.keys() == checkpointed.keys() and len(plain) > 10
    for key in plain:
        assert_close(checkpointed[key], plain[key], msg=key)


def test_gradient_checkpointing_in_the_decoder_leaves_the_cache_out():
    """A checkpointed decoder layer runs twice (forward, then again during backward): given the cache it would write
    its keys and values twice. The layer's wrapper drops a cache passed by keyword, as transformers' layers do, so
    the gradients equal plain backpropagation's even when the caller asks for `use_cache=True`."""
    from hf_vanilla import VanillaSeq2SeqConfig, VanillaSeq2SeqForConditionalGeneration

    torch.manual_seed(0)
    config = VanillaSeq2SeqConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, hidden_dropout_prob=0.0, max_position_embeddings=16)
    model = VanillaSeq2SeqForConditionalGeneration(config).train()
    source, target = torch.randint(3, 32, (2, 6)), torch.randint(3, 32, (2, 5))

    def gradients():
        model.zero_grad()
        out = model(input_ids=source, decoder_input_ids=target, use_cache=True)
        out.logits.square().mean().backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}, out.past_key_values

    plain, cache = gradients()
    assert cache.get_seq_length() == 5  # without checkpointing the cache is kept
    model.gradient_checkpointing_enable()
    checkpointed, _ = gradients()
    assert plain.keys() == checkpointed.keys() and len(plain) > 10
    for key in plain:
        assert_close(checkpointed[key], plain[key], msg=key)
