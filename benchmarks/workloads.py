"""The benchmarks' workloads as plain data: Poisson arrivals, chat users, documents and queries.

Token ids are drawn from seeded ``random.Random`` generators (ids 3 .. vocab-1), so every
configuration of a run, and every run with the same seed, sees the same prompts.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    """``n`` token ids in [3, vocab) (ids below 3 are left to special tokens)."""
    return [rng.randrange(3, vocab) for _ in range(n)]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """``n`` arrival times (seconds, ascending, the first at 0) of a Poisson process of ``rate``
    per second: gaps drawn from Exp(rate) by ``random.Random(seed)``. ``rate`` inf: all at 0.
    ValueError for ``n`` < 0 or ``rate`` <= 0."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"the request rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


@dataclass(frozen=True, slots=True)
class Turn:
    """User ``user`` asks question ``index`` (0-based) at ``time`` (seconds after the start)."""

    time: float
    user: int
    index: int


@dataclass(frozen=True, slots=True)
class MultiRoundSpec:
    """``users`` chat users share a system prompt of ``system_tokens``; each brings their own
    history of ``history_tokens`` and asks ``rounds`` questions of ``question_tokens``, each
    answered with ``answer_tokens`` tokens (generation runs with ``ignore_eos``)."""

    users: int
    rounds: int
    system_tokens: int
    history_tokens: int
    question_tokens: int
    answer_tokens: int
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("users", "rounds", "question_tokens", "answer_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("system_tokens", "history_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def max_request_tokens(self) -> int:
        """Prompt plus answer of a user's last round: the largest request of the workload."""
        return self.system_tokens + self.history_tokens + self.rounds * (self.question_tokens + self.answer_tokens)

    def working_set_tokens(self) -> int:
        """Distinct tokens whose KV the workload reuses: the system prompt once, plus every
        user's history, questions and answers."""
        return self.system_tokens + self.users * (self.max_request_tokens() - self.system_tokens)

    def system_prompt(self, vocab: int) -> list[int]:
        return random_tokens(random.Random(f"{self.seed}-system"), self.system_tokens, vocab)

    def user_history(self, user: int, vocab: int) -> list[int]:
        return random_tokens(random.Random(f"{self.seed}-history-{user}"), self.history_tokens, vocab)

    def question(self, user: int, index: int, vocab: int) -> list[int]:
        return random_tokens(random.Random(f"{self.seed}-q-{user}-{index}"), self.question_tokens, vocab)

    def turns(self, rate: float, warmup_rounds: int = 0) -> tuple[list[Turn], list[Turn]]:
        """(warm-up turns, measured turns). The first ``warmup_rounds`` questions of every user
        all arrive at time 0; the rest, in turn order, as a Poisson process of ``rate`` per
        second (seed ``seed``) starting at 0, dealt to the users round robin (user 0, 1, ...,
        then their next question ...). ValueError unless 0 <= ``warmup_rounds`` < ``rounds``."""
        if not 0 <= warmup_rounds < self.rounds:
            raise ValueError(f"warmup_rounds must be within [0, {self.rounds}), got {warmup_rounds}")
        warm = [Turn(0.0, u, r) for r in range(warmup_rounds) for u in range(self.users)]
        times = poisson_arrivals(self.users * (self.rounds - warmup_rounds), rate, self.seed)
        return warm, [Turn(t, i % self.users, warmup_rounds + i // self.users) for i, t in enumerate(times)]


class ChatSessions:
    """The conversations of a ``MultiRoundSpec``: each user's prompt is the system prompt, their
    history, every earlier question with the answer the engine gave, and the new question."""

    def __init__(self, spec: MultiRoundSpec, vocab: int) -> None:
        self.spec = spec
        self.vocab = vocab
        system = spec.system_prompt(vocab)
        self.history = [system + spec.user_history(u, vocab) for u in range(spec.users)]

    def prompt(self, turn: Turn) -> list[int]:
        return self.history[turn.user] + self.spec.question(turn.user, turn.index, self.vocab)

    def answered(self, turn: Turn, prompt: list[int], output: list[int]) -> None:
        self.history[turn.user] = prompt + output


@dataclass(frozen=True, slots=True)
class LongDocSpec:
    """``docs`` documents of ``doc_tokens`` tokens, each queried ``queries`` times (a fresh
    question of ``question_tokens`` after the document, answered with ``answer_tokens``)."""

    docs: int
    doc_tokens: int
    queries: int
    question_tokens: int
    answer_tokens: int
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("docs", "doc_tokens", "queries", "question_tokens", "answer_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def request_tokens(self) -> int:
        return self.doc_tokens + self.question_tokens + self.answer_tokens

    def total_doc_tokens(self) -> int:
        return self.docs * self.doc_tokens

    def document(self, doc: int, vocab: int) -> list[int]:
        return random_tokens(random.Random(f"{self.seed}-doc-{doc}"), self.doc_tokens, vocab)

    def question(self, index: int, vocab: int) -> list[int]:
        return random_tokens(random.Random(f"{self.seed}-ask-{index}"), self.question_tokens, vocab)

    def order(self) -> list[int]:
        """The document of each query: every document ``queries`` times, shuffled (seeded) so
        that no document follows itself when that is possible (up to 1000 shuffles), since a
        query right after its twin would be served by the engine's own cache."""
        order = [d for d in range(self.docs) for _ in range(self.queries)]
        rng = random.Random(self.seed)
        for _ in range(1000):
            rng.shuffle(order)
            if all(a != b for a, b in zip(order, order[1:])):
                break
        return order


class DocQueries:
    """The queries of a ``LongDocSpec`` as one user asking them in ``order()``, one at a time."""

    def __init__(self, spec: LongDocSpec, vocab: int) -> None:
        self.spec = spec
        self.vocab = vocab
        self.order = spec.order()
        self._docs = [spec.document(d, vocab) for d in range(spec.docs)]

    def turns(self) -> list[Turn]:
        return [Turn(0.0, 0, i) for i in range(len(self.order))]

    def prompt(self, turn: Turn) -> list[int]:
        return self._docs[self.order[turn.index]] + self.spec.question(turn.index, self.vocab)

    def answered(self, turn: Turn, prompt: list[int], output: list[int]) -> None:
        pass

    def repeated(self, index: int) -> bool:
        """Whether query ``index`` asks about a document an earlier query already asked about."""
        return self.order[index] in self.order[:index]
