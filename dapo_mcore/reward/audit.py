"""``dapo-mcore audit-reward``: how often does the math verifier pay out (+1) for shortcut responses?

Builds probe responses for a set of ground truths and reports, per probe, the fraction that scores +1.
Probe kinds:
  blind   -- the response does not depend on the ground truth (guessing, enumerating, empty, junk):
             any payout above chance would be a reward hack;
  hedge   -- the right answer plus a wrong one in one response: a payout rewards hedging;
  format  -- the right answer in some format: a 0% row is a false negative the policy must learn around;
  window  -- the right answer placed where the verifier should not look (or cut off).
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass

from dapo_mcore.reward.math_verifier import compute_score, normalize_answer

_FILLER = "We simplify the expression step by step and check every case carefully. "


@dataclass(frozen=True)
class Probe:
    """One kind of response, made from a ground truth and a wrong answer."""

    name: str
    kind: str
    make: Callable[[str, str], str | bytes]
    strict_box: bool = False


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
    Probe("\\boxed{<gt>} only (default mode)", "format", lambda g, w: _reason(f"\n\\boxed{{{g}}}")),
    Probe("\\boxed{<gt>} only (strict mode)", "format", lambda g, w: _reason(f"\n\\boxed{{{g}}}"), True),
    Probe("Answer: <gt> (strict mode)", "format", lambda g, w: _reason(f"\nAnswer: {g}"), True),
    Probe("Answer: <x,y,z> digits of gt", "hedge", lambda g, w: _reason("\nAnswer: " + ", ".join(g))),
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


def run_audit(num: int = 200, seed: int = 0) -> list[AuditRow]:
    """Score every probe against every ground truth."""
    ints, others = ground_truths(num, seed)
    rows = []
    for probe in PROBES:
        paid: dict[str, list[bool]] = {"int": [], "latex": []}
        hits: set[str] = set()
        for kind, gts in (("int", ints), ("latex", others)):
            for g in gts:
                ok = compute_score(probe.make(g, _wrong(g)), g, strict_box=probe.strict_box).acc
                paid[kind].append(ok)
                if ok:
                    hits.add(normalize_answer(g))
        rows.append(AuditRow(probe, sum(paid["int"]) / len(ints), sum(paid["latex"]) / len(others), len(hits)))
    return rows


def render(rows: list[AuditRow], markdown: bool) -> str:
    """A table: markdown or plain text."""
    if markdown:
        lines = ["| probe | kind | pays (integer gt) | pays (LaTeX gt) | distinct gts paid |", "|---|---|---:|---:|---:|"]
        lines += [f"| `{r.probe.name}` | {r.probe.kind} | {r.int_rate:.0%} | {r.latex_rate:.0%} | {r.distinct_paid} |"
                  for r in rows]
    else:
        lines = [f"{'probe':<52} {'kind':<7} {'int gt':>7} {'latex gt':>9} {'distinct':>9}"]
        lines += [f"{r.probe.name:<52} {r.probe.kind:<7} {r.int_rate:>7.0%} {r.latex_rate:>9.0%} {r.distinct_paid:>9}"
                  for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; with --fail-on-shortcut returns 1 if one blind response is paid for several answers."""
    parser = argparse.ArgumentParser(prog="dapo-mcore audit-reward", description=__doc__.splitlines()[0])
    parser.add_argument("--num-gts", type=int, default=200, help="integer ground truths to probe (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--fail-on-shortcut", action="store_true",
                        help="exit 1 if any blind probe (a response independent of the ground truth) is paid "
                             "for more than one distinct answer")
    args = parser.parse_args(argv)
    if args.num_gts < 1:
        parser.error("--num-gts must be >= 1")
    rows = run_audit(args.num_gts, args.seed)
    print(render(rows, args.markdown))
    if args.fail_on_shortcut:
        bad = [r for r in rows if r.probe.kind == "blind" and r.distinct_paid > 1]
        for r in bad:
            print(f"SHORTCUT: blind probe {r.probe.name!r} is paid for {r.distinct_paid} distinct answers",
                  file=sys.stderr)
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
