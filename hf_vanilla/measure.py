"""One way to choose, by measurement, between computations that give the same answer: which is faster here.

Two fast paths choose by timing their candidates on the first calls, because which is faster depends on the CPU,
the shapes, the threads and the cache, and no threshold is right on Intel and AMD alike (docs/performance.md):

    kernels.VanillaLinear    F.linear (MKL) or oneDNN's matmul, per (in, out, rows bucket, threads)
    runtimes/choice.py       an engine (ONNX Runtime, OpenVINO) or PyTorch, per request size (rows, real tokens,
                             threads)
    runtimes/auto.py         which engine a model runs on (runtime="auto"), at attach, in balanced orders

Each is a `MeasuredChoice`: an incumbent (the plain computation, which runs while nothing is decided and wherever
the measurement is not clear) and one challenger. The first calls of a key time the candidates until each has
`calls` timings that count; then the key runs the challenger only if the fastest incumbent's median time is at least
`min_gain` times the challenger's. The margin means noise can only leave a key on the incumbent, never move it to a
slower computation. Since every candidate gives the same answer (within the parity rule), the choice never shows in
the output, only in the time.

A choice may also stop early (`clear`): its first calls then time each candidate once, and as soon as the medians of
every timing so far differ by `clear` times or more, either way, the key is decided there. Each call of the slower
candidate costs what it loses; a gap that wide is beyond what the first calls' own costs (a new shape, the other
candidate's threads) make of a call on the sizes where the choice is close, and a narrower one costs little to go on
measuring. Where it goes on, each candidate is timed in blocks, the first `warmup` timings of a block not counted.

Thread-safe: a web server calls the model from many threads, and the timings and decisions of a key are read and
written under one lock (the runtime's own bookkeeping once raised `KeyError` when one thread decided a key while
another read its timings). Timings taken under concurrency are noisier, which the margin absorbs.

Every choice reads the clock through this module's `clock` (by default `time.perf_counter`), so that a test scripts
it instead of trusting wall-clock time on a busy machine: `monkeypatch.setattr(measure, "clock", scripted)`.
`decisions()` shows what every choice decided; `forget()` measures again (after changing threads or affinity).
"""

import statistics
import threading
import time
import weakref

clock = time.perf_counter  # what every choice times with: tests replace it
sleep = time.sleep  # how a measurement idles before a call (runtime='auto'): tests replace it with their clock's

_choices: "weakref.WeakSet[MeasuredChoice]" = weakref.WeakSet()
_turns: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # owner (a layer) -> its timed calls so far
_turns_lock = threading.Lock()
_timed_calls = 0  # see timed_calls


class MeasuredChoice:
    """The decision, per key, between an incumbent computation (or several equivalent ones) and a challenger.

    `candidates` names every computation timed, the challenger among them; `decision(key)` is True where the
    challenger runs, False where an incumbent does, None while the key is still being measured. `clear`: the ratio
    of medians at which a key is decided before every candidate has its `calls` (None: never early)."""

    def __init__(self, name: str, candidates: tuple, challenger: str, calls: int, min_gain: float, warmup: int = 0,
                 clear: float | None = None):
        if challenger not in candidates or len(candidates) < 2:
            raise ValueError(f"MeasuredChoice {name!r}: the challenger {challenger!r} must be one of two or more "
                             f"candidates {candidates}.")
        self.name, self.candidates, self.challenger = name, tuple(candidates), challenger
        self.calls, self.min_gain, self.warmup, self.clear = calls, min_gain, warmup, clear
        self._decided: dict = {}
        self._trials: dict = {}  # key -> its `_Trials`, until decided
        self._lock = threading.Lock()
        _choices.add(self)

    def decision(self, key):
        """True (the challenger runs), False (the incumbent does) or None (still measuring). A dict read: the hot path."""
        return self._decided.get(key)

    def turn(self, key, preferred: int | None = None) -> str:
        """The candidate to time on this call of `key`: `candidates[preferred % n]` (an owner alternating between
        them, see `owner_turn`) while that one needs timings; with `clear`, each candidate once first, in the order
        named (the early look); else the candidates in blocks: the one timed last goes on while it needs timings,
        then the next in the order named. Blocks, because a whole-model call right after another computation's pays
        for that one's threads still spinning, which traffic that runs one of them never pays: ONNX Runtime on a short
        request took several times longer right after a PyTorch call than in a row, and alternating the two decided
        for PyTorch, which then ran slower than the engine. Each block's first `warmup` calls are its warm-up."""
        with self._lock:
            if key in self._decided:  # decided meanwhile by another thread: any candidate gives the answer
                return self.candidates[0]
            trials = self._trials.setdefault(key, _Trials(self.candidates))
            needs = [name for name in self.candidates if len(trials.counted[name]) < self.calls]
            if preferred is not None:
                name = self.candidates[preferred % len(self.candidates)]
                if name in needs:
                    return name
            if self.clear is not None:
                untimed = [name for name in self.candidates if not trials.times[name]]
                if untimed:
                    return untimed[0]
            if trials.last in needs:
                return trials.last
            return needs[0] if needs else min(self.candidates, key=lambda name: len(trials.counted[name]))

    def time(self, key, candidate: str, run):
        """`run()`, timed as one call of `candidate` for `key`; returns what it returns."""
        start = clock()
        result = run()
        self.record(key, candidate, clock() - start)
        return result

    def record(self, key, candidate: str, seconds: float) -> None:
        """Add a timing; decide the key once every candidate has its `calls` counted timings (the first `warmup` of
        each block are not counted), or, with `clear`, as soon as the gap is that wide. A timing that arrives after
        the key was decided (another thread's) is dropped."""
        with self._lock:
            if key in self._decided:
                return
            trials = self._trials.setdefault(key, _Trials(self.candidates))
            trials.add(candidate, seconds, self.warmup)
            if min(map(len, trials.counted.values())) >= self.calls:
                incumbent, challenger = self._medians(trials.counted)
                self._decided[key] = incumbent >= self.min_gain * challenger
            elif self.clear is not None and all(trials.times.values()):
                incumbent, challenger = self._medians(trials.times)
                if incumbent >= self.clear * challenger or challenger >= self.clear * incumbent:
                    self._decided[key] = incumbent >= self.clear * challenger
            if key in self._decided:
                del self._trials[key]

    def _medians(self, times: dict) -> tuple[float, float]:
        """(the fastest incumbent's median seconds, the challenger's), from `times` (candidate -> seconds)."""
        medians = {name: statistics.median(seconds) for name, seconds in times.items()}
        return min(seconds for name, seconds in medians.items() if name != self.challenger), medians[self.challenger]

    def decide(self, key, challenger: bool) -> None:
        """Decide `key` without timing it here: for a decision measured elsewhere (runtime="auto"
        times the engines at attach, hf_vanilla/runtimes/auto.py, and keeps what it measured)."""
        with self._lock:
            self._trials.pop(key, None)
            self._decided[key] = bool(challenger)

    def decisions(self, pending: bool = False) -> dict:
        """key -> True (challenger) / False (incumbent); with `pending`, keys still measured too, as None."""
        with self._lock:
            return (dict.fromkeys(self._trials) if pending else {}) | self._decided

    def forget(self) -> None:
        with self._lock:
            self._decided.clear()
            self._trials.clear()

    def __getstate__(self):  # a lock cannot be pickled or deep-copied: the copy gets its own
        with self._lock:
            state = dict(vars(self), _decided=dict(self._decided), _trials={})
        del state["_lock"]
        return state

    def __setstate__(self, state):
        vars(self).update(state)
        self.__dict__.setdefault("clear", None)  # pickled before `clear` existed
        self._lock = threading.Lock()
        _choices.add(self)


class _Trials:
    """What a key's measurement has timed so far: every timing of each candidate (`times`), those that count
    (`counted`: not a block's warm-up), and the block under way (its candidate `last`, its length `run`)."""

    def __init__(self, candidates: tuple):
        self.times = {name: [] for name in candidates}
        self.counted = {name: [] for name in candidates}
        self.last, self.run = None, 0

    def add(self, candidate: str, seconds: float, warmup: int) -> None:
        self.run = self.run + 1 if candidate == self.last else 1
        self.last = candidate
        self.times[candidate].append(seconds)
        if self.run > warmup:
            self.counted[candidate].append(seconds)


def owner_turn(owner) -> int:
    """How many calls of `owner` (a layer) took part in a measurement before this one (and count this one). Its
    first call (0) is not timed: its weight's first read after loading page-faults, and oneDNN builds its primitive then; later calls
    alternate between the candidates, so that each is timed at every place in the model (inside a model the other
    layers' weights pass through the cache between two calls of one layer, as they will when the choice runs).
    Kept beside the layer, not on it: an attribute that changes on every call would change the module to whatever
    watches it (runtimes/watch.py's check that the model is as traced)."""
    global _timed_calls
    with _turns_lock:
        _timed_calls += 1
        calls = _turns.get(owner, 0)
        _turns[owner] = calls + 1
    return calls


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of 0..n-1 in which each one comes right after each other one equally often, and in each place equally
    often: a Williams design (a row-complete Latin square, `n` orders for an even `n`; with the same orders reversed,
    2n for an odd one). The orders repeat; a run of fewer rounds than one cycle is balanced as far as it goes. What
    ran just before decides much of a short call's time (benchmarks/engines.py's `time_rounds` has the figures), so
    whatever times several computations in turn (that benchmark, runtime="auto") runs them in these orders."""
    first, low, high = [0], 1, n - 1
    while low <= high:
        first.append(low)
        if low != high:
            first.append(high)
        low, high = low + 1, high - 1
    orders = [[(k + shift) % n for k in first] for shift in range(n)]
    return orders if n % 2 == 0 else orders + [order[::-1] for order in orders]


def timed_calls() -> int:
    """How many calls of any layer took part in a measurement so far (`owner_turn`): a caller timing a whole
    forward can tell whether its call also measured kernels, and was slower for it."""
    return _timed_calls


def decisions() -> dict:
    """Every choice's decisions so far: {choice name: {key: challenger?}} (keys still measured left out)."""
    merged: dict = {}
    for choice in list(_choices):
        merged.setdefault(choice.name, {}).update(choice.decisions())
    return merged


def forget() -> None:
    """Measure every choice again from its next call."""
    for choice in list(_choices):
        choice.forget()
    with _turns_lock:
        _turns.clear()


__all__ = ["MeasuredChoice", "balanced_orders", "clock", "decisions", "forget", "owner_turn", "timed_calls"]
