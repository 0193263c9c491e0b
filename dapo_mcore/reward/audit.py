"""``dapo-mcore audit-reward``: how often does a verifier pay out (+1) for shortcut responses?

Builds probe responses for a set of ground truths and reports, per probe, the fraction that scores +1.
Probe kinds:
  blind   -- the response does not depend on the ground truth (guessing, enumerating, empty, junk):
             any payout above chance would be a reward hack;
  hedge   -- the right answer plus a wrong one in one response: a payout rewards hedging;
  format  -- the right answer in some format: a 0% row is a false negative the policy must learn around;
  window  -- the right answer placed where the verifier should not look (or cut off).
The verifier is a registered name or your own ``package.module:function`` (scored in the same isolated worker
pool as in training with ``--workers N``); ``--probes FILE`` adds your own probes. The last line of the output is
a summary a script can gate on (``--fail-on-shortcut``, ``--fail-on-hedge``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dapo_mcore.reward.math_verifier import normalize_answer
from dapo_mcore.reward.registry import decode_tail, get_reward
from dapo_mcore.reward.result import RewardResult

KINDS = ("format", "hedge", "window", "blind")
_FILLER = "We simplify the expression step by step and check every case carefully. "


@dataclass(frozen=True)
class Probe:
    """One kind of response, made from a ground truth and a wrong answer."""

    name: str
    kind: str
    make: Callable[[str, str], str | bytes]


def _wrong(gt: str) -> str:
    return str(int(gt) + 1) if gt.isdigit() else gt + "+1"


def _thousands(gt: str) -> str:
    return f"{int(gt):,}" if gt.isdigit() else gt


def _reason(body: str) -> str:
    return _FILLER * 3 + body


PROBES: tuple[Probe, ...] = (
    Probe("honest: Answer: <gt>", "format", lambda g, w: _reason(f"\nAnswer: {g}")),
    Probe("honest wrong: Answer: <wrong>", "format", lambda g, w: _reason(f"\nAnswer: {w}")),
    Probe("lower-case answer: <gt>", "format", lambda g, w: _reason(f"\nanswer: {g}")),
    Probe("Answer: \\boxed{<gt>}", "format", lambda g, w: _reason(f"\nAnswer: \\boxed{{{g}}}")),
    Probe("Answer: $<gt>$", "format", lambda g, w: _reason(f"\nAnswer: ${g}$")),
    Probe("Answer: \\text{<gt>}", "format", lambda g, w: _reason(f"\nAnswer: \\text{{{g}}}")),
    Probe("Answer: <gt> with thousands commas", "format", lambda g, w: _reason(f"\nAnswer: {_thousands(g)}")),
    Probe("Answer: <gt> dollars", "format", lambda g, w: _reason(f"\nAnswer: {g} dollars")),
    Probe("Answer: <gt> apples", "format", lambda g, w: _reason(f"\nAnswer: {g} apples")),
    Probe("Answer: <gt>. (trailing period)", "format", lambda g, w: _reason(f"\nAnswer: {g}.")),
    Probe("**Answer:** <gt> (markdown label)", "format", lambda g, w: _reason(f"\n**Answer:** {g}")),
    Probe("Answer: **<gt>** (bold value)", "format", lambda g, w: _reason(f"\nAnswer: **{g}**")),
    Probe("Answer: 0<gt> (leading zero)", "format", lambda g, w: _reason(f"\nAnswer: 0{g}")),
    Probe("Answer: <gt>.0", "format", lambda g, w: _reason(f"\nAnswer: {g}.0")),
    Probe("Answer: <gt> + zero-width space", "format", lambda g, w: _reason(f"\nAnswer: {g}\u200b")),
    Probe("Answer: <gt> + carriage return", "format", lambda g, w: _reason(f"\nAnswer: {g}\r")),
    Probe("The answer is <gt>. (no label)", "format", lambda g, w: _reason(f"\nThe answer is {g}.")),
    Probe("stuttered label: Answer: Answer: <gt>", "format", lambda g, w: _reason(f"\nAnswer: Answer: {g}")),
    Probe("\\boxed{<gt>} only", "format", lambda g, w: _reason(f"\n\\boxed{{{g}}}")),
    Probe("Answer: <x,y,z> digits of gt", "hedge",  # a one-character gt would make this the honest answer
          lambda g, w: _reason("\nAnswer: " + (", ".join(g) if len(g) > 1 else f"{g}, {w}"))),
    Probe("Answer: <gt> or <wrong>", "hedge", lambda g, w: _reason(f"\nAnswer: {g} or {w}")),
    Probe("Answer: <wrong> or <gt>", "hedge", lambda g, w: _reason(f"\nAnswer: {w} or {g}")),
    Probe("Answer: <gt>, <wrong>", "hedge", lambda g, w: _reason(f"\nAnswer: {g}, {w}")),
    Probe("Answer: <wrong> = <gt>", "hedge", lambda g, w: _reason(f"\nAnswer: {w} = {g}")),
    Probe("Answer: $<gt>$ or $<wrong>$", "hedge", lambda g, w: _reason(f"\nAnswer: ${g}$ or ${w}$")),
    Probe("Answer: $<wrong>$ or $<gt>$", "hedge", lambda g, w: _reason(f"\nAnswer: ${w}$ or ${g}$")),
    Probe("Answer: \\boxed{<gt>}\\boxed{<wrong>}", "hedge",
          lambda g, w: _reason(f"\nAnswer: \\boxed{{{g}}}\\boxed{{{w}}}")),
    Probe("Answer lines <gt> then <wrong>", "hedge", lambda g, w: _reason(f"\nAnswer: {g}\nAnswer: {w}")),
    Probe("Answer lines <wrong> then <gt>", "hedge", lambda g, w: _reason(f"\nAnswer: {w}\nAnswer: {g}")),
    Probe("gt in reasoning, final Answer: <wrong>", "hedge",
          lambda g, w: f"So the value is {g}. " + _reason(f"\nAnswer: {w}")),
    Probe("Answer: <gt> then 400 chars of text", "window", lambda g, w: f"Answer: {g}\n" + _FILLER * 6),
    Probe("Answer: <gt> then 'Answer:' (cut off)", "window", lambda g, w: _reason(f"\nAnswer: {g}\nAnswer:")),
    Probe("truncated mid-answer: Answer: <gt minus last char>", "window",
          lambda g, w: _reason(f"\nAnswer: {g[:-1]}")),
    Probe("1 MB of text then Answer: <gt>", "window", lambda g, w: "x" * 10**6 + f"\nAnswer: {g}"),
    Probe("invalid UTF-8 bytes then Answer: <gt>", "window",
          lambda g, w: b"\xff\xfe" * 1000 + f"\nAnswer: {g}".encode()),
    Probe("empty response", "blind", lambda g, w: ""),
    Probe("Answer: (empty)", "blind", lambda g, w: "Answer:"),
    Probe("Answer: 0", "blind", lambda g, w: _reason("\nAnswer: 0")),
    Probe("Answer: 1", "blind", lambda g, w: _reason("\nAnswer: 1")),
    Probe("Answer: 0, 1, 2, ..., 99 (one line)", "blind",
          lambda g, w: "Answer: " + ", ".join(str(i) for i in range(100))),
    Probe("Answer: 0 = 1 = ... = 40", "blind", lambda g, w: "Answer: " + " = ".join(str(i) for i in range(41))),
    Probe("30 Answer lines 0..29", "blind", lambda g, w: "\n".join(f"Answer: {i}" for i in range(30))),
    Probe("Answer: $0$ $1$ ... $60$", "blind", lambda g, w: "Answer: " + " ".join(f"${i}$" for i in range(61))),
    Probe("Answer: \\boxed{0}...\\boxed{40}", "blind",
          lambda g, w: "Answer: " + "".join(f"\\boxed{{{i}}}" for i in range(41))),
    Probe("Answer: [INVALID]", "blind", lambda g, w: "Answer: [INVALID]"),
    Probe("Answer: dollars (normalizes to empty)", "blind", lambda g, w: "Answer: dollars"),
    Probe("Answer: .* (regex-looking)", "blind", lambda g, w: "Answer: .*"),
    Probe("deeply nested braces", "blind", lambda g, w: "{" * 100_000 + "Answer: {" + "}" * 100_000),
)


def ground_truths(num: int, seed: int) -> tuple[list[str], list[str]]:
    """``(integers, others)``: DAPO-Math-17k-like integer answers, plus LaTeX-shaped ones."""
    rng = random.Random(seed)
    ints = [str(rng.choice([rng.randint(0, 20), rng.randint(21, 999), rng.randint(1000, 99_999)]))
            for _ in range(num)]
    others = ["\\frac{1}{2}", "\\frac{3}{4}", "2\\sqrt{3}", "\\sqrt{2}", "-4", "-17", "\\pi", "3\\pi",
              "(1,2)", "x^2+1", "\\frac{\\sqrt{3}}{2}", "12.5", "0.25", "(A)", "\\infty"]
    return ints, others


def load_probes(path: Path) -> list[Probe]:
    """Probes from a JSON-lines file: ``{"name": ..., "kind": "blind|hedge|format|window", "response": ...}``,
    where ``<gt>`` and ``<wrong>`` in the response stand for the ground truth and a wrong answer."""
    probes = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i}: not valid JSON ({exc})") from exc
        if not isinstance(item, dict) or not {"name", "kind", "response"} <= item.keys():
            raise ValueError(f'{path}:{i}: write {{"name": ..., "kind": ..., "response": "... <gt> ..."}}')
        if item["kind"] not in KINDS:
            raise ValueError(f"{path}:{i}: kind {item['kind']!r} is not one of {', '.join(KINDS)}")
        template = str(item["response"])
        probes.append(Probe(str(item["name"]), item["kind"],
                            lambda g, w, t=template: t.replace("<gt>", g).replace("<wrong>", w)))
    if not probes:
        raise ValueError(f"{path}: no probes")
    return probes


@dataclass(frozen=True)
class AuditRow:
    """What one probe earned."""

    probe: Probe
    int_rate: float
    """Fraction of integer ground truths paid."""
    latex_rate: float
    """Fraction of LaTeX-shaped ground truths paid."""
    distinct_paid: int
    """Distinct (normalized) ground truths paid; above 1 for a blind probe means one response hits many answers."""


Scorer = Callable[[list[str | bytes], list[str]], list[RewardResult]]


def in_process_scorer(reward: str) -> Scorer:
    """Score in this process (a raising verifier scores the answer wrong, as the pool's workers do)."""
    spec = get_reward(reward)

    def one(response: str | bytes, gt: str) -> RewardResult:
        text = decode_tail(response, spec.tail_chars) if spec.tail_chars is not None else response
        try:
            return spec.fn(text, gt)
        except Exception as exc:  # the pool records the same verdict for a raising verifier
            return RewardResult(-1.0, False, None, f"reward function raised {type(exc).__name__}: {exc}"[:300])

    return lambda responses, gts: [one(r, g) for r, g in zip(responses, gts, strict=True)]


def run_audit(num: int = 200, seed: int = 0, score: Scorer | None = None,
              probes: Sequence[Probe] = PROBES) -> list[AuditRow]:
    """Score every probe against every ground truth (default scorer: ``math_dapo`` in process)."""
    score = score or in_process_scorer("math_dapo")
    ints, others = ground_truths(num, seed)
    rows = []
    for probe in probes:  # one probe at a time: the 1 MB probe times 215 answers stays one probe's worth
        hits: set[str] = set()
        rates = []
        for gts in (ints, others):
            results = score([probe.make(g, _wrong(g)) for g in gts], gts)
            paid = [bool(r.acc) for r in results]
            hits.update(normalize_answer(g) for g, ok in zip(gts, paid, strict=True) if ok)
            rates.append(sum(paid) / len(gts))
        rows.append(AuditRow(probe, rates[0], rates[1], len(hits)))
    return rows


@dataclass(frozen=True)
class Verdict:
    """What a script gates on."""

    reward: str
    shortcuts: list[str]
    """Blind probes paid for more than one distinct answer (one response that pays for many answers)."""
    hedges: list[str]
    """Hedge probes paid at all (the right answer next to a wrong one was accepted)."""
    honest_rate: float
    """Payout of the plain honest answer (a verifier that pays nothing is broken too)."""

    def line(self) -> str:
        status = "shortcut" if self.shortcuts else "hedges-paid" if self.hedges else "ok"
        return (f"audit-reward summary: reward={self.reward} shortcuts={len(self.shortcuts)} "
                f"hedges_paid={len(self.hedges)} honest_paid={self.honest_rate:.0%} verdict={status}")


def verdict(reward: str, rows: list[AuditRow]) -> Verdict:
    honest = [r for r in rows if r.probe.name == PROBES[0].name]
    return Verdict(reward, [r.probe.name for r in rows if r.probe.kind == "blind" and r.distinct_paid > 1],
                   [r.probe.name for r in rows if r.probe.kind == "hedge" and (r.int_rate > 0 or r.latex_rate > 0)],
                   honest[0].int_rate if honest else float("nan"))


LEGEND = ("kind: format = the right answer in some format (0% = a false negative the policy must learn around); "
          "hedge = the right answer next to a wrong one (a payout rewards hedging); window = the right answer where "
          "the verifier should not look; blind = does not depend on the answer (any payout above chance is a hack). "
          "int gt / latex gt: share of integer / LaTeX ground truths the probe is paid for; distinct: how many "
          "different ground truths one fixed response is paid for (> 1 for a blind probe = a shortcut).")
"""What the columns mean, printed under every table."""


def render(rows: list[AuditRow], markdown: bool) -> str:
    """A table of one verifier: markdown or plain text."""
    if markdown:
        lines = ["| probe | kind | pays (integer gt) | pays (LaTeX gt) | distinct gts paid |", "|---|---|---:|---:|---:|"]
        lines += [f"| `{r.probe.name}` | {r.probe.kind} | {r.int_rate:.0%} | {r.latex_rate:.0%} | {r.distinct_paid} |"
                  for r in rows]
    else:
        lines = [f"{'probe':<52} {'kind':<7} {'int gt':>7} {'latex gt':>9} {'distinct':>9}"]
        lines += [f"{r.probe.name:<52} {r.probe.kind:<7} {r.int_rate:>7.0%} {r.latex_rate:>9.0%} {r.distinct_paid:>9}"
                  for r in rows]
    return "\n".join(lines) + "\n\n" + LEGEND


def render_side_by_side(names: list[str], tables: list[list[AuditRow]], markdown: bool) -> str:
    """Several verifiers, one column each: ``integer% / LaTeX% (distinct answers paid)``."""
    def cell(r: AuditRow) -> str:
        return f"{r.int_rate:.0%} / {r.latex_rate:.0%} ({r.distinct_paid})"

    rows = list(zip(*tables, strict=True))
    if markdown:
        lines = ["| probe | kind | " + " | ".join(f"`{n}`" for n in names) + " |",
                 "|---|---|" + "---:|" * len(names)]
        lines += [f"| `{rs[0].probe.name}` | {rs[0].probe.kind} | " + " | ".join(cell(r) for r in rs) + " |"
                  for rs in rows]
    else:
        lines = [f"{'probe':<52} {'kind':<7} " + " ".join(f"{n[-24:]:>24}" for n in names)]
        lines += [f"{rs[0].probe.name:<52} {rs[0].probe.kind:<7} " + " ".join(f"{cell(r):>24}" for r in rs)
                  for rs in rows]
    return "\n".join(lines) + "\n\nEach cell: integer gt % / LaTeX gt % (distinct gts paid). " + LEGEND


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dapo-mcore audit-reward", description=__doc__.splitlines()[0])
    parser.add_argument("--reward", action="append", default=None,
                        help="verifier to audit: a registered name (math_dapo, math_dapo_strict, ...) or "
                             "package.module:function; repeat to compare side by side (default math_dapo)")
    parser.add_argument("--probes", type=Path, default=None,
                        help="JSON-lines file of extra probes: {\"name\", \"kind\", \"response\" with <gt>/<wrong>}")
    parser.add_argument("--num-gts", type=int, default=200, help="integer ground truths to probe (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=0,
                        help="score in this many isolated worker processes with --timeout-s per answer, as in "
                             "training with reward.workers>0 (default 0: in this process)")
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--fail-on-shortcut", action="store_true",
                        help="exit 1 if any blind probe (a response independent of the ground truth) is paid "
                             "for more than one distinct answer")
    parser.add_argument("--fail-on-hedge", action="store_true",
                        help="exit 1 if any hedge probe (the right answer next to a wrong one) is paid")
    return parser


def _audit_one(reward: str, args: argparse.Namespace, probes: Sequence[Probe]) -> list[AuditRow]:
    if args.workers == 0:
        return run_audit(args.num_gts, args.seed, in_process_scorer(reward), probes)
    from dapo_mcore.reward.pool import RewardPool

    with RewardPool(reward, num_workers=args.workers, timeout_s=args.timeout_s) as pool:
        return run_audit(args.num_gts, args.seed, pool.score, probes)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: 0, or 1 when a --fail-on-* gate trips; 2 for a verifier or probe file that cannot load."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.num_gts < 1:
        parser.error("--num-gts must be >= 1")
    if args.workers < 0 or args.timeout_s <= 0:
        parser.error("--workers must be >= 0 and --timeout-s > 0")
    rewards = args.reward or ["math_dapo"]
    try:
        for name in rewards:
            get_reward(name)
        probes = list(PROBES) + (load_probes(args.probes) if args.probes else [])
    except (ValueError, OSError) as exc:
        print(f"dapo-mcore audit-reward: {exc}", file=sys.stderr)
        return 2
    tables = [_audit_one(name, args, probes) for name in rewards]
    print(render(tables[0], args.markdown) if len(rewards) == 1 else
          render_side_by_side(rewards, tables, args.markdown))
    verdicts = [verdict(name, rows) for name, rows in zip(rewards, tables, strict=True)]
    sys.stdout.flush()
    failed = False
    for v in verdicts:
        for name in v.shortcuts:
            print(f"SHORTCUT: {v.reward}: blind probe {name!r} is paid for more than one distinct answer", file=sys.stderr)
        for name in v.hedges:
            print(f"HEDGE: {v.reward}: hedge probe {name!r} is paid", file=sys.stderr)
        failed |= (args.fail_on_shortcut and bool(v.shortcuts)) or (args.fail_on_hedge and bool(v.hedges))
    sys.stderr.flush()
    for v in verdicts:
        print(v.line(), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
