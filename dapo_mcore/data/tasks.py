"""Registry of synthetic verifiable tasks for the tiny CPU default.

A task enumerates a finite universe of problems, renders each as a short prompt the tiny tokenizer
can spell, and knows the correct answer plus a few systematic *distractor rules* (plausible wrong
procedures). The distractors are what make a useful base model: pre-training on answers drawn from a
mixture "correct rule with probability p, a distractor otherwise" gives a model that is uncertain per
prompt, so DAPO groups have mixed outcomes, and RL can shift the mixture weight globally.

Splits are honest: one seeded permutation of the universe, the first ``heldout_fraction`` of it is
the held-out set and the rest the training set, so the two are disjoint prompt sets drawn from the
same distribution. Every prompt of the fixed-format tasks has the same token length; ``sumchain`` varies in prompt and
response length (its responses carry a worked chain before the answer).
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Literal

from dapo_mcore.data.records import PromptRecord

Problem = tuple[int, ...]
Rule = Callable[[Problem], str]
Split = Literal["train", "heldout"]


class SyntheticTask(ABC):
    """A finite set of problems with a correct rule and distractor rules (all deterministic)."""

    name: str
    description: str

    @abstractmethod
    def problems(self) -> list[Problem]:
        """Every problem of the universe, in a fixed canonical order."""

    @abstractmethod
    def render(self, problem: Problem) -> str:
        """The user-turn prompt text."""

    @abstractmethod
    def answer(self, problem: Problem) -> str:
        """The ground-truth answer string (what the verifier compares against)."""

    @abstractmethod
    def distractors(self) -> dict[str, Rule]:
        """Named wrong procedures, used only to build the base model's pre-training corpus."""

    def corpus_rules(self) -> list[Rule]:
        """Rules writing the pre-training corpus's assistant text: the correct one first, then the distractors.

        Default: ``Answer: <the rule's answer>``. Tasks that reason before answering return full responses.
        """
        return [lambda p, rule=rule: f"Answer: {rule(p)}" for rule in (self.answer, *self.distractors().values())]


class OrderStatTask(SyntheticTask):
    """``max(3,9,1,4)`` (or ``min``) over 4 distinct digits: 5040 problems.

    Distractors are the opposite extreme and the correct extreme off by one either way. With 4
    distinct digits max - min >= 3, so the four rules always give four different answers and chance
    accuracy equals the correct rule's weight. (A mixture over the four *order statistics* would be
    useless: with equal weights it is just "copy a random prompt digit", which carries no signal.)
    """

    def __init__(self, op: Literal["max", "min"]) -> None:
        self.op = op
        self.name = f"{op}4"
        self.description = f"{op} of 4 distinct digits, e.g. {op}(3,9,1,4)"

    def problems(self) -> list[Problem]:
        return list(itertools.permutations(range(10), 4))

    def render(self, problem: Problem) -> str:
        return f"{self.op}({','.join(str(d) for d in problem)})"

    def answer(self, problem: Problem) -> str:
        return str(max(problem) if self.op == "max" else min(problem))

    def distractors(self) -> dict[str, Rule]:
        other, extreme = (min, max) if self.op == "max" else (max, min)
        return {
            f"{other.__name__}_instead": lambda p: str(other(p)),
            "off_by_minus_one": lambda p: str(extreme(p) - 1),
            "off_by_plus_one": lambda p: str(extreme(p) + 1),
        }


class AddTask(SyntheticTask):
    """``07+45`` with zero-padded two-digit operands: 10000 problems (a harder, non-default task).

    Distractors are classic slips: dropping the carry, and being off by ten either way.
    """

    name = "add2"
    description = "sum of two zero-padded two-digit numbers, e.g. 07+45"

    def problems(self) -> list[Problem]:
        return [(a, b) for a in range(100) for b in range(100)]

    def render(self, problem: Problem) -> str:
        return f"{problem[0]:02d}+{problem[1]:02d}"

    def answer(self, problem: Problem) -> str:
        return str(problem[0] + problem[1])

    def distractors(self) -> dict[str, Rule]:
        def no_carry(p: Problem) -> str:
            return str(((p[0] // 10 + p[1] // 10) % 10) * 10 + (p[0] + p[1]) % 10)

        return {
            "no_carry": no_carry,
            "plus_ten": lambda p: str(p[0] + p[1] + 10),
            "minus_ten": lambda p: str(abs(p[0] + p[1] - 10)),
        }


class SumChainTask(SyntheticTask):
    """``3+5+2+7`` with 2..6 digits 1..9, answered by a worked chain: ``3+5=8+2=10+7=17`` then ``Answer: 17``.

    The universe holds every 2- and 3-digit sequence (81 + 729) and a fixed seeded sample of 1000 sequences for
    each of 4, 5 and 6 terms (3810 problems, prompts of 3..11 tokens), so no length dominates. The correct
    response grows with the number of terms, from 9 tokens (2 terms) to about 31 (6 terms), so token-level
    and sample-level loss weighting differ. Distractors (each names the rule its text follows):

    * ``stop_early``: the chain misses the last term and answers its partial sum (shorter, wrong);
    * ``last_slip``: the last partial sum is off by one (same length, wrong);
    * ``ramble``: the chain, then the final sum repeated ``=S`` without ever answering, to at least 44 tokens:
      past any ``rollout.max_new_tokens`` up to 44, so an untrained policy gets truncated (overlong shaping acts).

    Rule outputs here are full responses: :meth:`answer` is only the ground truth the verifier compares with.
    """

    name = "sumchain"
    description = "sum of 2-6 digits with a worked chain of partial sums, e.g. 3+5+2+7"
    MIN_TERMS, MAX_TERMS = 2, 6
    PER_LENGTH = 1000
    RAMBLE_TOKENS = 44

    def problems(self) -> list[Problem]:
        out: list[Problem] = []
        for n in range(self.MIN_TERMS, self.MAX_TERMS + 1):
            every = list(itertools.product(range(1, 10), repeat=n))
            out += every if len(every) <= self.PER_LENGTH else random.Random(f"sumchain:{n}").sample(every, self.PER_LENGTH)
        return out

    def render(self, problem: Problem) -> str:
        return "+".join(str(d) for d in problem)

    def answer(self, problem: Problem) -> str:
        return str(sum(problem))

    @staticmethod
    def chain(problem: Problem, slip: int = 0) -> tuple[str, int]:
        """``a+b=s+c=s'...`` over all terms (``slip`` added to the last sum) and its final sum."""
        total, text = problem[0], str(problem[0])
        for i, d in enumerate(problem[1:]):
            total += d + (slip if i == len(problem) - 2 else 0)
            text += f"+{d}={total}"
        return text, total

    def worked(self, problem: Problem) -> str:
        """The correct response."""
        text, total = self.chain(problem)
        return f"{text}\nAnswer: {total}"

    def distractors(self) -> dict[str, Rule]:
        def stop_early(p: Problem) -> str:
            if len(p) == 2:  # nothing to chain: answer the first term
                return f"{p[0]}\nAnswer: {p[0]}"
            text, total = self.chain(p[:-1])
            return f"{text}\nAnswer: {total}"

        def last_slip(p: Problem) -> str:
            text, total = self.chain(p, slip=1)
            return f"{text}\nAnswer: {total}"

        def ramble(p: Problem) -> str:
            text, total = self.chain(p)
            while len(text) < self.RAMBLE_TOKENS:  # one token per character (digits, "+", "=")
                text += f"={total}"
            return text

        return {"stop_early": stop_early, "last_slip": last_slip, "ramble": ramble}

    def corpus_rules(self) -> list[Rule]:
        return [self.worked, *self.distractors().values()]


class MulToolTask(SyntheticTask):
    """``37*48``, two two-digit factors (8100 problems): too hard for the tiny model's head, one line of Python with
    the tool. Its vocabulary is the tool task's (``tiny_base.preset: tiny-tools``); with ``rollout.tools.enabled`` the
    ``<code>`` block really runs and the model reads the result back (ReTool's format).

    Corpus (ReTool's cold start in miniature: tool-call demonstrations mixed with wrong procedures):

    * correct: ``<code>print(37*48)</code><interpreter>1776\n</interpreter>Answer: 1776``;
    * ``wrong_op``: the same with ``+``: the tool computes the wrong thing exactly;
    * ``no_tool``: ``Answer: 1200``, a guess from the tens digits alone (no call);
    * ``copy_slip``: the right call, then the answer without its last digit.

    In the corpus the interpreter's text is what ``print`` would write, so a model run without tools writes its own
    (wrong, for most products): the same base, with and without tools, is the comparison.
    """

    name = "mul2tool"
    description = "product of two two-digit numbers, with a Python tool, e.g. 37*48"

    def problems(self) -> list[Problem]:
        return [(a, b) for a in range(10, 100) for b in range(10, 100)]

    def render(self, problem: Problem) -> str:
        return f"{problem[0]}*{problem[1]}"

    def answer(self, problem: Problem) -> str:
        return str(problem[0] * problem[1])

    @staticmethod
    def called(expr: str, value: int, answer: str) -> str:
        """A response that calls the tool on ``expr`` (which prints ``value``) and answers ``answer``."""
        return f"<code>print({expr})</code><interpreter>{value}\n</interpreter>Answer: {answer}"

    def worked(self, p: Problem) -> str:
        """The correct response."""
        return self.called(f"{p[0]}*{p[1]}", p[0] * p[1], str(p[0] * p[1]))

    def distractors(self) -> dict[str, Rule]:
        return {
            "wrong_op": lambda p: self.called(f"{p[0]}+{p[1]}", p[0] + p[1], str(p[0] + p[1])),
            "no_tool": lambda p: f"Answer: {(p[0] // 10) * (p[1] // 10) * 100}",
            "copy_slip": lambda p: self.called(f"{p[0]}*{p[1]}", p[0] * p[1], str(p[0] * p[1])[:-1]),
        }

    def corpus_rules(self) -> list[Rule]:
        return [self.worked, *self.distractors().values()]


_REGISTRY: dict[str, SyntheticTask] = {}


def register_task(task: SyntheticTask) -> SyntheticTask:
    """Add a task to the registry; a second task with the same name is an error."""
    if task.name in _REGISTRY:
        raise ValueError(f"task {task.name!r} is already registered; pick another name")
    _REGISTRY[task.name] = task
    return task


def task_names() -> list[str]:
    """Names of all registered tasks, sorted."""
    return sorted(_REGISTRY)


def get_task(name: str) -> SyntheticTask:
    """Look up a registered task by name."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; registered tasks: {', '.join(task_names())}")
    return _REGISTRY[name]


def split_problems(task: SyntheticTask, split: Split, seed: int = 0,
                   heldout_fraction: float = 0.2) -> list[Problem]:
    """The problems of one split: a seeded permutation, held-out first, train the rest (disjoint)."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction={heldout_fraction} must lie strictly between 0 and 1, e.g. 0.2")
    if split not in ("train", "heldout"):
        raise ValueError(f"split={split!r}; use 'train' or 'heldout'")
    problems = task.problems()
    random.Random(f"{task.name}:{seed}").shuffle(problems)
    n_heldout = max(1, round(len(problems) * heldout_fraction))
    return problems[:n_heldout] if split == "heldout" else problems[n_heldout:]


def task_records(name: str, split: Split, seed: int = 0, heldout_fraction: float = 0.2) -> list[PromptRecord]:
    """The prompts and ground truths of one split of a registered task, deterministic in ``seed``."""
    task = get_task(name)
    return [
        PromptRecord(prompt=task.render(p), ground_truth=task.answer(p), data_source=f"synthetic/{name}", index=i)
        for i, p in enumerate(split_problems(task, split, seed, heldout_fraction))
    ]


register_task(OrderStatTask("max"))
register_task(OrderStatTask("min"))
register_task(AddTask())
register_task(SumChainTask())
register_task(MulToolTask())
