"""Rule-based math verifier of DAPO (``math_dapo``): extract the final answer, normalize, compare as strings.

Rules (DAPO's released verifier, Minerva-style normalization, written from the definitions):

* Only the last 300 characters of the response are read. The answer is the capture of the LAST match of
  ``Answer\\s*:\\s*(.*)`` (case-insensitive; ``.`` stops at the end of the line). No match: wrong, ``pred=None``.
* Prediction and ground truth are normalized the same way (:func:`normalize_answer`) and compared as strings.
* Correct scores +1 (``acc=True``), anything else -1.
* Strict mode: the content of the last ``\\boxed{...}`` in the last 100 characters, compared verbatim.

Never evaluates model text. Every regex here is linear in its input, and inputs are sliced to 300 characters
first, so hostile responses (megabytes, nested braces, invalid UTF-8, control characters) cost bounded time.
"""

from __future__ import annotations

import functools
import re

from dapo_mcore.reward.registry import decode_tail, register_reward
from dapo_mcore.reward.result import RewardResult

TAIL_CHARS = 300
"""Characters at the end of the response the verifier reads (the longest MATH-500 answer has 159)."""

STRICT_TAIL_CHARS = 100
"""Characters at the end of the response searched for ``\\boxed{}`` in strict mode."""

MAX_GROUND_TRUTH_CHARS = TAIL_CHARS - len("Answer:")
"""A normalized ground truth longer than this can never appear in the verifier's window."""

_ANSWER_LINE = re.compile(r"Answer\s*:\s*(.*)", re.IGNORECASE)

# Applied in this order, each as a plain substring replacement (order matters: "\text{m}" -> "\text{}" must come
# before "\text{}" is dropped; words are dropped before LaTeX fragments).
_REPLACEMENTS: tuple[tuple[str, str], ...] = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_DROPPED: tuple[str, ...] = (
    # unit and filler words
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges",
    "students", "childrentickets", "multiples",
    # LaTeX leftovers, degree marks, ordinal suffix, thin spaces, quotes
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
# Per line: keep only the content of the first $...$ pair (as "$content$").
_FIRST_MATH = re.compile(r"^[^$\n]*\$([^$\n]*)\$.*", re.MULTILINE)
# Unwrap up to the first closing brace (no nesting), within a line.
_UNWRAP = tuple(re.compile(rf"\\{cmd}\{{([^}}\n]*)\}}") for cmd in ("text", "textbf", "overline"))
# \boxed{...} unwraps to the LAST closing brace of the line.
_BOXED = re.compile(r"\\boxed\{(.*)\}")
_FRAC_SHORT = re.compile(r"frac([^{])(.)")
_SQRT_SHORT = re.compile(r"sqrt([^{])")


def normalize_answer(answer: str) -> str:
    """Minerva-style normalization of a final answer (applied to both prediction and ground truth)."""
    stripped = answer.strip()
    if stripped.isdigit():  # fast path, same result: on digits the rules below only strip the ends
        return stripped
    s = answer.rpartition("=")[2]
    for old, new in _REPLACEMENTS:
        s = s.replace(old, new)
    for dropped in _DROPPED:
        s = s.replace(dropped, "")
    if "$" in s:
        s = _FIRST_MATH.sub(r"$\1$", s)
    for pattern in _UNWRAP:
        s = pattern.sub(r"\1", s)
    s = _BOXED.sub(r"\1", s)
    if "frac" in s:
        s = _FRAC_SHORT.sub(r"frac{\1}{\2}", s)
    if "sqrt" in s:
        s = _SQRT_SHORT.sub(r"sqrt{\1}", s)
    s = s.replace("$", "")
    without_commas = s.replace(",", "")
    if without_commas.isdigit():
        s = without_commas
    return s.strip()


@functools.lru_cache(maxsize=1 << 16)
def _normalized_ground_truth(ground_truth: str) -> str:
    return normalize_answer(ground_truth)


def extract_answer(response: str | bytes) -> str | None:
    """Raw text after the last ``Answer:`` in the last 300 characters, or None."""
    matches = _ANSWER_LINE.findall(decode_tail(response, TAIL_CHARS))
    return matches[-1] if matches else None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None if absent or unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + len("\\boxed{"):i]
    return None


def _check_ground_truth(ground_truth: object) -> str:
    if not isinstance(ground_truth, str):
        raise TypeError(f"ground truth must be str, got {type(ground_truth).__name__} (see validate_ground_truth)")
    return ground_truth


_WRONG_NO_ANSWER = RewardResult(-1.0, False, None, f"no 'Answer:' in the last {TAIL_CHARS} characters")
_WRONG_NO_BOX = RewardResult(-1.0, False, None, f"no closed \\boxed{{}} in the last {STRICT_TAIL_CHARS} characters")


@register_reward("math_dapo", tail_chars=TAIL_CHARS)
def compute_score(response: str | bytes, ground_truth: str, *, strict_box: bool = False) -> RewardResult:
    """Score one response against its ground truth (+1 correct, -1 wrong or no answer)."""
    ground_truth = _check_ground_truth(ground_truth)
    if strict_box:
        pred = last_boxed(decode_tail(response, TAIL_CHARS)[-STRICT_TAIL_CHARS:])
        if pred is None:
            return _WRONG_NO_BOX
        correct = pred == ground_truth
        return RewardResult(1.0 if correct else -1.0, correct, pred)
    raw = extract_answer(response)
    if raw is None:
        return _WRONG_NO_ANSWER
    pred = normalize_answer(raw)
    correct = pred == _normalized_ground_truth(ground_truth)
    return RewardResult(1.0 if correct else -1.0, correct, pred)


@register_reward("math_dapo_strict_box", tail_chars=TAIL_CHARS)
def compute_score_strict_box(response: str | bytes, ground_truth: str) -> RewardResult:
    """Strict mode of :func:`compute_score`: the last ``\\boxed{}`` content must equal the ground truth verbatim."""
    return compute_score(response, ground_truth, strict_box=True)


def validate_ground_truth(value: object) -> str | None:
    """Why ``value`` cannot serve as a math ground truth, or None if it can (for the data loader)."""
    if not isinstance(value, str):
        return f"ground truth must be a string, got {type(value).__name__}"
    if not value.strip():
        return "ground truth is empty"
    if "\n" in value:
        return "ground truth spans several lines; the verifier compares a single line"
    normalized = normalize_answer(value)
    if not normalized:
        return f"ground truth {value[:40]!r} normalizes to an empty string (only units/filler words)"
    if len(normalized) > MAX_GROUND_TRUTH_CHARS:
        return (f"ground truth normalizes to {len(normalized)} characters; the verifier reads only the last "
                f"{TAIL_CHARS} characters of a response, so it could never match")
    return None


# ---- math_dapo_strict: math_dapo's verdicts, minus the hedges it pays --------------------------------------------
_MATH_SEGMENT = re.compile(r"\$([^$\n]*)\$")
_IDENTIFIER = re.compile(r"[A-Za-z](?:_\{?\w+\}?)?(?:\([^()]*\))?")
_DIGIT_LIST = re.compile(r"[\d,\s]*\d\s*,\s*\d[\d,\s]*")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+")


def hedge_reason(raw_answer: str) -> str | None:
    """Why an ``Answer:`` line names more than one value (so a reader could not tell which is meant), or None.

    Refused: several ``$...$`` segments with different values (``$12$ or $13$``: math_dapo reads the first);
    an ``=`` chain with a side that is neither the final value nor a bare name (``13 = 12`` and ``3+9 = 12``:
    math_dapo reads the last side; ``x = 12`` and ``f(2) = 12`` stay fine); digits separated by commas that are
    not thousands groups (``1, 2, 3``: math_dapo drops the commas and reads 123).
    """
    segments = {normalize_answer(m) for m in _MATH_SEGMENT.findall(raw_answer)}
    if len(segments) > 1:
        return f"answer names several $...$ values ({', '.join(sorted(segments))[:80]})"
    sides = raw_answer.split("=")
    if len(sides) > 1:
        last = normalize_answer(sides[-1])
        for side in sides[:-1]:
            value = normalize_answer(side)
            if value != last and not _IDENTIFIER.fullmatch(value):
                return f"answer equates different values ({value[:40]} = {last[:40]})"
    bare = raw_answer.strip().strip("$").strip()
    if _DIGIT_LIST.fullmatch(bare) and not _THOUSANDS.fullmatch(bare.replace(" ", "")):
        return "answer is a comma-separated list of digits, not one number"
    return None


@register_reward("math_dapo_strict", tail_chars=TAIL_CHARS)
def compute_score_strict(response: str | bytes, ground_truth: str) -> RewardResult:
    """:func:`compute_score`, except that an answer naming several values is wrong: an ``Answer:`` line that
    hedges (see :func:`hedge_reason`), or several ``Answer:`` lines that disagree (math_dapo pays the last)."""
    ground_truth = _check_ground_truth(ground_truth)
    raw = extract_answer(response)
    if raw is None:
        return _WRONG_NO_ANSWER
    reason = hedge_reason(raw)
    lines = {normalize_answer(m) for m in _ANSWER_LINE.findall(decode_tail(response, TAIL_CHARS))}
    if reason is None and len(lines) > 1:
        reason = f"several Answer: lines with different values ({', '.join(sorted(lines))[:80]})"
    if reason is not None:
        return RewardResult(-1.0, False, normalize_answer(raw), reason)
    return compute_score(response, ground_truth)
