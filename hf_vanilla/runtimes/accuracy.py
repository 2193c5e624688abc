"""The text `runtime="auto"` checks a reduced precision on, and what it reads there: `precision="fastest"` runs an
int8 or bf16 path only where the lowest per-token cosine against float32 PyTorch that it is expected to reach over
`REFERENCE_TOKENS` tokens of real text (`expected_lowest`), predicted from the model's own weights run on a sample of
such text, reaches the floor (`hf_vanilla.runtimes.auto.ACCURACY_FLOOR`).

Why real text. A reduced precision's error depends on the weights and on the tokens: a model whose activations have
an outlier channel loses most at some tokens of real text, which ids spread over the vocabulary (as the timed
requests are) do not reach.

Why a prediction, not the sample's own lowest. The lowest cosine of N tokens is a tail statistic that falls as N
grows, and where precision is lost it falls fast: MiniLM with its embedding LayerNorm's weight of channel 308
multiplied by 50 keeps a lowest of 0.997 under OpenVINO's bf16 on the 2,581 tokens of the sentences below, and falls
to 0.915 over 93,665 tokens of gensim's test corpora, where about one token in 10,000 is under the floor. A sample
large enough to hold such tokens costs more than a load can spend (it runs once in float32 and once per reduced
path). Its largest errors show the tail's shape, though: the errors 1 - cosine of the `TAIL` share of its tokens
that lose most are fitted as the tail of a power law (Hill's estimator, the standard fit of a heavy tail), read at
one token in `REFERENCE_TOKENS`. For the model above that predicts 0.877 from the 2,581 tokens; for the int8 engines
on MiniLM as shipped it is within 0.003 of the lowest measured over the 93,665. The floor is on the same scale: what
CTranslate2's int8 reaches over some 100,000 real tokens. The sample's own lowest counts where it is lower.

What it promises: the prediction holds for text like the sample, with the spread of an estimate from a few thousand
tokens (tests/test_precision.py measures it). A loss that sets in only beyond the largest errors of such a sample
does not show in it: with channel 308 multiplied by 12, ONNX Runtime's and OpenVINO's int8 on a CPU with AVX-512
VNNI predict 0.987 and 0.994 from the sentences below, and put 57 and 59 of the 78,329 tokens of gensim's Lee corpus
under the floor (the lowest 0.53 and 0.58; CTranslate2's int8 70, and 0.57): some 7 in 10,000, in one sentence in
100, which a sample of a few thousand tokens does not hold reliably. Text of another kind (another language, code,
informal prose) reaches further into the tail: a user whose text is of such a kind passes a sample of it, the larger
the better.

The sample:
- `sample=None` (the default): `SENTENCES` below, 128 sentences of plain English of the kinds an embedding service
  sees (news, notices, questions, instructions, quoted speech, figures and dates), tokenized by the model's own
  tokenizer: the one saved where the model was loaded from (`model.name_or_path`; the converters copy it beside the
  weights; a Hub name is read from the local cache, never downloaded). A model without one (built in code, or saved
  without its tokenizer) has no text to be checked on: its reduced paths are left out, with a warning naming the fix.
- `sample=[text, ...]`: the user's own text, tokenized by that tokenizer (an error where there is none).
- `sample={"input_ids": ..., "attention_mask": ...}`, or a list of them: batches already tokenized (what a tokenizer
  returns with `return_tensors="pt"`), used as they are. `token_type_ids` may come with them.

Texts are truncated to the model's positions and run in batches of `ROWS`.
"""

import collections.abc
import hashlib
import math

import torch

ROWS = 16  # rows per batch of the sample
TAIL = 0.02  # the share of the sample's tokens, those that lose most, whose errors the tail is fitted on
TAIL_TOKENS = 10  # and at least this many
REFERENCE_TOKENS = 100_000  # the tail is read as the lowest expected over this many tokens
KEYS = ("input_ids", "attention_mask", "token_type_ids")


def sample_batches(model, sample) -> tuple[list | None, str]:
    """(the sample as batches of the encoder's inputs, what they are), or (None, why there is none) for the built-in
    sentences without a tokenizer. Raises ValueError, naming the fix, for a sample that cannot be read."""
    if sample is None:
        tokenizer, source = tokenizer_of(model)
        if tokenizer is None:
            return None, (f"no tokenizer saved with the model ({source}) to read the built-in sample with: pass "
                          f"runtime_options={{'sample': ...}}, texts or tokenized batches")
        try:
            batches = _tokenized(tokenizer, list(SENTENCES), model.config)
        except ValueError as error:
            return None, f"the tokenizer saved with the model ({source}) cannot read the built-in sample: {error}"
        return batches, f"{len(SENTENCES)} built-in English sentences, tokenized by the tokenizer in {source}"
    if isinstance(sample, collections.abc.Mapping):
        sample = [sample]
    if isinstance(sample, (str, bytes)) or not isinstance(sample, (list, tuple)) or not sample:
        raise ValueError(f"runtime='auto': sample={_short(sample)} is not accepted; it takes a non-empty list of "
                         f"texts, or tokenized batches (a dict of input_ids and attention_mask, or a list of them).")
    if all(isinstance(text, str) for text in sample):
        tokenizer, source = tokenizer_of(model)
        if tokenizer is None:
            raise ValueError(f"runtime='auto': sample texts are tokenized by the model's own tokenizer, and none is "
                             f"saved with it ({source}): save it beside the weights (tokenizer.save_pretrained), or "
                             f"pass tokenized batches: sample=[tokenizer(texts, padding=True, return_tensors='pt')].")
        return _tokenized(tokenizer, list(sample), model.config), f"{len(sample)} texts given, tokenized by the " \
            f"tokenizer in {source}"
    if all(isinstance(batch, collections.abc.Mapping) for batch in sample):
        batches = [_checked(batch, model.config, index) for index, batch in enumerate(sample)]
        tokens = sum(int(batch["attention_mask"].sum()) for batch in batches)
        return batches, f"{len(batches)} tokenized batch{'es' if len(batches) > 1 else ''} given ({tokens} tokens)"
    raise ValueError("runtime='auto': sample mixes texts and other things; it takes a list of texts, or tokenized "
                     "batches (a dict of input_ids and attention_mask, or a list of them).")


def tokenizer_of(model):
    """(the tokenizer saved where `model` was loaded from, or None; where that is, in words)."""
    source = getattr(model, "name_or_path", "") or ""
    if not source:
        return None, "the model was not loaded from a folder or the Hub"
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source, local_files_only=True), repr(source)
    except Exception:  # noqa: BLE001  (no tokenizer there: transformers raises OSError, ValueError, KeyError, ...)
        return None, repr(source)


def _tokenized(tokenizer, texts: list, config) -> list:
    limit = config.max_position_embeddings - getattr(config, "position_offset", 0)
    batches = []
    for start in range(0, len(texts), ROWS):
        batch = dict(tokenizer(texts[start:start + ROWS], padding=True, truncation=True, max_length=limit,
                               return_tensors="pt"))
        if not getattr(config, "type_vocab_size", 0):  # a BERT tokenizer in front of a model without token types
            batch.pop("token_type_ids", None)
        batches.append(_checked(batch, config, start // ROWS))
    return batches


def _checked(batch, config, index: int) -> dict:
    """`batch` as the encoder's inputs: int64 tensors (B, T), an attention mask of ones and zeros (default all ones),
    ids within the vocabulary, T within the positions, a real token in every row; ValueError otherwise."""
    where = f"runtime='auto': sample batch {index}"
    unknown = sorted(set(batch) - set(KEYS))
    if "input_ids" not in batch or unknown:
        raise ValueError(f"{where} has keys {sorted(batch)}: it takes input_ids, and attention_mask and "
                         f"token_type_ids where the model reads them.")
    try:
        found = {key: torch.as_tensor(batch[key]) for key in KEYS if batch.get(key) is not None}
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{where}: {error}") from None
    ids = found["input_ids"]
    found.setdefault("attention_mask", torch.ones_like(ids))
    limit = config.max_position_embeddings - getattr(config, "position_offset", 0)
    for key, tensor in found.items():
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool \
                or tensor.shape != ids.shape or tensor.dim() != 2:
            raise ValueError(f"{where}: {key} is {tensor.dtype} of shape {tuple(tensor.shape)}; each takes whole "
                             f"numbers of one shape (rows, tokens).")
    mask = found["attention_mask"]
    if ids.numel() == 0 or ids.shape[1] > limit or not ((mask == 0) | (mask == 1)).all() or (mask.sum(1) == 0).any():
        raise ValueError(f"{where}: shape {tuple(ids.shape)}; it takes 1 to {limit} tokens a row, an attention mask "
                         f"of ones and zeros and a real token in every row.")
    if ids.min() < 0 or ids.max() >= config.vocab_size:
        raise ValueError(f"{where}: ids from {int(ids.min())} to {int(ids.max())}, where the model's vocabulary has "
                         f"{config.vocab_size}: tokenized by another tokenizer?")
    if "token_type_ids" in found and not getattr(config, "type_vocab_size", 0):
        raise ValueError(f"{where}: token_type_ids given to a model without token types.")
    return {key: tensor.long() for key, tensor in found.items()}


def digest(batches: list) -> str:
    """The sample's tokens and the rule read on them, hashed (the kept decision depends on both)."""
    found = hashlib.sha256(f"tail {TAIL} {TAIL_TOKENS} {REFERENCE_TOKENS}".encode())
    for batch in batches:
        for key in KEYS:
            if key in batch:
                found.update(f"{key}{tuple(batch[key].shape)}".encode() + batch[key].numpy().tobytes())
    return found.hexdigest()[:32]


def token_cosines(actual: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The cosine between `actual` and `expected` (B, T, E) at each real token of `mask` (B, T), in float64."""
    real = mask.bool()
    return torch.nn.functional.cosine_similarity(actual[real].double(), expected[real].double(), dim=-1)


def lowest_cosine(actual: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor) -> float:
    """The lowest of `token_cosines` (NaN where either is NaN)."""
    found = token_cosines(actual, expected, mask)
    return found.min().item() if not found.isnan().any() else float("nan")


def expected_lowest(cosines: torch.Tensor) -> float:
    """The lowest cosine expected over REFERENCE_TOKENS tokens of text like the sample whose token `cosines` these
    are, or their own lowest where that is lower (the module docstring); NaN where one is NaN. The errors 1 - cosine
    of the TAIL share of tokens that lose most (TAIL_TOKENS at least) are taken as a power law's tail, its exponent
    by Hill's estimator (the mean log ratio of each of them to the largest error below them), and read at one token
    in REFERENCE_TOKENS."""
    cosines = cosines.double().flatten()
    if cosines.isnan().any():
        return float("nan")
    lowest = cosines.min().item()
    errors = (1 - cosines).clamp_min(1e-12).sort(descending=True).values  # a cosine rounded above 1: no error
    count = len(errors)
    fitted = min(count - 1, max(math.ceil(TAIL * count), TAIL_TOKENS))
    if fitted < 1:  # one token: nothing to fit
        return lowest
    exponent = (errors[:fitted].log() - errors[fitted].log()).mean().item()
    predicted = 1 - errors[fitted].item() * (fitted * REFERENCE_TOKENS / count) ** exponent
    return max(-1.0, min(lowest, predicted))


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Written for this check: plain English of the kinds an embedding service is sent, each sentence whole.
SENTENCES = (
    'The council voted on Tuesday to close the old bridge until repairs are finished next spring.',
    'She poured the coffee, opened the window and read the letter twice before calling her brother.',
    'Heavy rain is expected across the north of the country, with flooding possible in low-lying areas.',
    'How many people live in the city, and how many of them travel to work by train?',
    'The company reported a profit of $4.2 million for the quarter, up 12% on the same period last year.',
    'Please remove the batteries before cleaning the device with a dry cloth.',
    'After the match, the coach said his team had played well but made too many mistakes in defence.',
    'Scientists have found that the bees return to the same flowers at the same time each morning.',
    "I don't think we'll finish the report today; can we meet again on Friday at 10:30?",
    'The museum, which opened in 1887, holds more than forty thousand paintings, maps and drawings.',
    'Prices for wheat and corn rose sharply after the drought damaged crops in several regions.',
    'He forgot his umbrella at the station, so he arrived at the interview soaked to the skin.',
    'The new law requires every landlord to register with the local authority by the end of June.',
    'Our function returns an empty list when the input file contains no valid records.',
    'Thousands of fans waited outside the stadium for hours, singing and waving flags in the cold.',
    'The doctor advised her to rest for a week, drink plenty of water and avoid lifting anything heavy.',
    'Negotiations between the two governments broke down late last night without an agreement.',
    'Mix the flour and butter until the dough is smooth, then leave it in the fridge for thirty minutes.',
    'A small earthquake shook the coastal town early this morning, but no injuries were reported.',
    'Why did the lights go out in the whole building when only one fuse had blown?',
    'The children built a tree house from old planks, rope and a door they found in the garage.',
    'Shares in the airline fell by almost a third after it warned that fuel costs would cut its earnings.',
    'The orchestra will perform works by Mozart, Brahms and a young composer from Lisbon.',
    'Firefighters spent the night bringing the blaze under control as strong winds fanned the flames.',
    'You can change your password at any time from the settings page of your account.',
    'The river rose by two metres overnight, and the road to the village is now closed.',
    'Police are asking anyone who saw the accident on Main Street to contact them.',
    'The hospital has hired forty new nurses to cope with the rising number of patients this winter.',
    'My grandmother kept every letter she ever received in a wooden box under her bed.',
    'The prime minister said the government would not raise taxes before the next election.',
    'Astronomers observed a comet passing close to the Sun, its tail stretching millions of kilometres.',
    'It was the first time in twenty years that the festival had been cancelled because of the weather.',
    'The train to Edinburgh was delayed by forty minutes because of a signal failure near York.',
    'Researchers tested the vaccine on 3,000 volunteers, and none of them had serious side effects.',
    'Turn left at the church, go past the school, and the bakery is on your right.',
    'The union has called a strike for next Monday after talks over pay and hours failed.',
    'Although the house was small, it had a large garden with apple trees and a vegetable patch.',
    'Officials confirmed that the missing climbers had been found safe on the northern slope.',
    'The software update fixes a bug that caused the application to crash when saving large files.',
    "Farmers in the valley say the late frost destroyed most of this year's cherry harvest.",
    'Do you know whether the library is open on Sundays, or only during the week?',
    'The court ruled that the contract was invalid because one of the parties had been misled.',
    "Wind turbines now supply almost a fifth of the country's electricity, according to new figures.",
    'He spent three years sailing around the world alone in a boat he had built himself.',
    'The exhibition explores how ordinary families lived during the war, through photographs and diaries.',
    'Teachers warned that cuts to the budget would mean larger classes and fewer books.',
    'The bank lowered its interest rate to 3.5 per cent, the first cut in more than two years.',
    'Birds began to sing as the first light appeared over the hills.',
    '"We have done everything we can," the mayor told reporters, "and now we must wait for the water to fall."',
    'The airport will stay closed until at least midday while crews clear snow from the runways.',
    'Three men have been charged with robbery after a jewellery shop was raided on Saturday afternoon.',
    'The minister, who has held the post for six years, is expected to announce her retirement next week.',
    'Unemployment fell to 5.1 per cent in March, its lowest level since the start of the decade.',
    'The two leaders shook hands, smiled for the cameras and then spent four hours in private talks.',
    'A spokesman for the company said the recall affected about 80,000 cars sold in Europe and Asia.',
    'Rescue teams used dogs and thermal cameras to search the collapsed building for survivors.',
    'The report found that one in four children in the region does not have access to clean water.',
    'Hundreds of volunteers helped to fill sandbags, clear drains and move furniture to higher floors.',
    'The striker scored twice in the second half, and his team moved up to third place in the league.',
    'Parents have complained that the new timetable means their children must leave home before seven.',
    'The fire started in the kitchen of a restaurant and spread quickly to the flats above it.',
    'Doctors say the patient is in a stable condition and is expected to make a full recovery.',
    'The treaty, signed by forty-two countries, commits each of them to halving emissions by 2030.',
    'Sales of electric bicycles have doubled in the past year, according to the industry association.',
    'The ship ran aground in thick fog, and its crew of nineteen was taken off by helicopter.',
    'Critics say the plan will raise rents, push out small shops and do little to ease traffic.',
    'The prisoner escaped by climbing over a wall while guards were changing shifts.',
    'Share prices in London, Paris and Frankfurt closed lower after a day of heavy trading.',
    "The author's first novel, written while she worked as a nurse, has been translated into thirty languages.",
    'Workers at the plant have been told that two hundred jobs will go when production moves abroad.',
    'The storm cut power to more than 60,000 homes, and some may be without electricity for days.',
    'Engineers believe a crack in one of the turbine blades caused the engine to fail shortly after take-off.',
    'The opposition leader accused the government of hiding the true cost of the new hospital.',
    'Tickets for the concert sold out within minutes, and some were later offered online at ten times the price.',
    'Police said the driver had been travelling at more than twice the speed limit when the car left the road.',
    'Local residents have collected over 5,000 signatures calling for the park to be protected.',
    'The central bank warned that inflation would stay high for longer than it had expected.',
    'A rare white whale was spotted off the coast, attracting crowds of people with binoculars and cameras.',
    'The trial heard that the accused had sent more than a hundred threatening messages to his neighbour.',
    'Under the agreement, the soldiers will withdraw from the border and be replaced by international observers.',
    'The chef grows most of the vegetables for his restaurant in a garden behind the kitchen.',
    'Climbers reached the summit on the third attempt, after storms had forced them back twice.',
    'The government has promised to build 300,000 new homes a year, but builders say the target is unrealistic.',
    "The library's oldest book, a prayer book from the fourteenth century, was damaged by the flood.",
    'Voters in the north of the state will choose a new senator in a special election on Saturday.',
    'Testing showed that the water in several wells contained high levels of arsenic and lead.',
    'The film, shot in just eighteen days on a tiny budget, won the top prize at the festival.',
    'Hospitals are preparing for a busy weekend as temperatures are forecast to reach forty degrees.',
    'The peace talks resumed in Geneva after a break of almost two months.',
    'Farmers blocked the main roads into the capital with tractors, protesting against lower milk prices.',
    'The students designed a small satellite that will measure the temperature of the upper atmosphere.',
    'Insurance companies expect claims from the floods to exceed two billion dollars.',
    'The bridge, closed for repairs since January, reopened to traffic on Monday morning.',
    'A jury found the former director guilty of fraud, and he will be sentenced next month.',
    'Firefighters rescued a family of five from the roof of their house as the water kept rising.',
    'The company plans to open twelve new stores and hire about 1,500 staff over the next two years.',
    'Some of the paintings had not been seen in public for more than a century.',
    'The coach was sacked after his team lost seven games in a row, the worst run in its history.',
    'Experts warned that the disease could spread quickly among cattle if it was not contained.',
    'She said the hardest part of the job was telling families that their relatives had not survived.',
    'Thousands of people marched through the city centre, calling for better pay for teachers and nurses.',
    'The satellite images show that the glacier has retreated by almost a kilometre in ten years.',
    'The minister said the cuts were painful but necessary, and that the economy would recover next year.',
    'Residents were told to boil their drinking water after bacteria were found in the supply.',
    'The airline apologised to passengers whose luggage had been left behind in Singapore.',
    'Two climbers were killed and three others injured when an avalanche swept down the mountain.',
    "The team's captain, who broke his leg in October, is expected to return for the final.",
    'Lawyers for the newspaper argued that the story was true and in the public interest.',
    'The price of petrol has risen by 20 cents a litre in a month, the sharpest increase in a decade.',
    'Archaeologists have uncovered the remains of a Roman villa beneath a car park in the town centre.',
    'Negotiators worked through the night, and a deal was finally announced shortly before dawn.',
    'He said that he had never seen so much damage in thirty years of working as a police officer.',
    'The school will remain closed for a week while the roof, damaged in the storm, is repaired.',
    'Investors are worried that the dispute could delay the merger of the two banks.',
    "The orchestra's tour of Japan, planned for the autumn, has been postponed until next year.",
    'More than half of those questioned said they would support a ban on smoking in public places.',
    'The search for the missing fishermen was called off at dusk and will resume at first light.',
    'Builders discovered an unexploded bomb from the Second World War on the construction site.',
    'The report recommends that the speed limit near schools be cut to thirty kilometres an hour.',
    'Across the country, people lit candles and held a minute of silence for the victims.',
    'The president arrived in the capital late on Sunday for a three-day visit.',
    'The new stadium will seat 60,000 people and is due to be finished in time for the world cup.',
    'Officials said the outbreak had been traced to a batch of contaminated lettuce.',
    'A court in the capital has ordered the release of the journalist, who had been held for eleven months.',
    'The charity says the number of people sleeping on the streets has risen by a third since last winter.',
    'Scientists at the university have developed a test that can detect the disease in minutes.',
    'The tanker was carrying 80,000 tonnes of crude oil when it struck rocks off the coast.',
    'Several ministers have threatened to resign if the government goes ahead with the plan.',
)
