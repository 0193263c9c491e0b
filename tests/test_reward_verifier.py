"""The math verifier against hand-derived expectations from DAPO's rules (extraction, normalization, strict)."""

from __future__ import annotations

import random

import pytest

from dapo_mcore.reward import (
    compute_score,
    decode_tail,
    extract_answer,
    get_reward,
    normalize_answer,
    register_reward,
    reward_names,
    validate_ground_truth,
)

pytestmark = pytest.mark.unit

X = "x"
# (response, ground truth, expected acc); each derived by hand from the rules in math_verifier's docstring.
CASES = [
    # integers and the extraction regex
    ("Answer: 540", "540", True),
    ("answer: 540", "540", True),
    ("ANSWER:540", "540", True),
    ("Answer : 540", "540", True),
    ("Answer:\t540", "540", True),
    ("Answer: 541", "540", False),
    ("Answer: 540.", "540", False),
    ("Answer: -4", "-4", True),
    ("Answer: - 4", "-4", True),
    ("Answer: 0540", "540", False),
    ("Answer: 540.0", "540", False),
    ("Answer: +540", "540", False),
    ("Answer: 540 ", "540", True),
    ("Answer: 540\r", "540", True),
    ("Answer: 5 4 0", "540", True),
    ("Answer: 1e3", "1000", False),
    # thousands separators
    ("Answer: 1,000", "1000", True),
    ("Answer: 1000", "1,000", True),
    ("Answer: 1,000,000", "1000000", True),
    ("Answer: 10,00", "1000", True),
    ("Answer: 1{,}000", "1000", True),
    ("Answer: 1,000.5", "1000.5", False),
    ("Answer: 1\\,000", "1000", False),
    ("Answer: 1,\\!000", "1000", True),
    ("Answer: 1 000", "1000", True),
    ("Answer: 1\\ 000", "1000", True),
    ("Answer: 1;000", "1000", False),
    ("Answer: 2, 3", "2,3", True),
    ("Answer: 23", "2,3", True),
    # LaTeX fractions and roots
    ("Answer: \\frac{1}{2}", "\\frac{1}{2}", True),
    ("Answer: \\frac12", "\\frac{1}{2}", True),
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", False),
    ("Answer: 1/2", "\\frac{1}{2}", False),
    ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}", True),
    ("Answer: \\frac{3}{4}", "\\frac{1}{2}", False),
    ("Answer: \\frac 1 2", "\\frac{1}{2}", True),
    ("Answer: \\sqrt2", "\\sqrt{2}", True),
    ("Answer: 2\\sqrt3", "2\\sqrt{3}", True),
    ("Answer: \\sqrt{2}", "\\sqrt2", True),
    ("Answer: \\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt{3}}{2}", True),
    ("Answer: \\tfrac{1}{2}", "\\frac{1}{2}", False),
    ("Answer: \\frac{540}{1}", "540", False),
    # \boxed
    ("Answer: \\boxed{540}", "540", True),
    ("Answer: $\\boxed{540}$", "540", True),
    ("The final result is \\boxed{540}", "540", False),
    ("Answer: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True),
    ("Answer: \\boxed{540} \\boxed{17}", "540", False),
    ("Answer: \\boxed{540} \\boxed{17}", "17", False),
    ("Answer: \\boxed 540", "540", False),
    ("Answer: \\fbox{540}", "540", False),
    # units and filler words
    ("Answer: 540 dollars", "540", True),
    ("Answer: \\$540", "540", True),
    ("Answer: $540", "540", True),
    ("Answer: 540 cm", "540", True),
    ("Answer: 540 cm^2", "540", False),
    ("Answer: 540 square feet", "540", True),
    ("Answer: 540\\text{ cm}", "540", True),
    ("Answer: 540 meters", "540", True),
    ("Answer: 540 kg", "540", False),
    ("Answer: 540 students", "540", True),
    ("Answer: 540^\\circ", "540", True),
    ("Answer: 540^{\\circ}", "540", True),
    ("Answer: 540 degrees", "540", True),
    ("Answer: 540\\%", "540", False),
    ("Answer: 540 mph", "540", True),
    ("Answer: 540\\text{ m}", "540", True),
    ("Answer: 540 m", "540", False),
    ("Answer: 21\\mathrm{th}", "21", True),
    ("Answer: 5 ways", "5", True),
    ("Answer: 5 sue", "5", True),
    ("Answer: 540 integers", "540", True),
    ("Answer: 540\\ldots", "540", True),
    ("Answer: 540\\dots", "540", True),
    # text around the answer
    ("Let me think.\nThe sum is 12.\nAnswer: 540", "540", True),
    ("Answer: The answer is 540", "540", False),
    ("Answer: x = 540", "540", True),
    ("Answer: x=5, y=540", "540", True),
    ("Answer: 540 = x", "540", False),
    ("Answer: a 540", "540", True),
    ("Answer: an integer 540", "540", False),
    ("Answer: **540**", "540", False),
    ("**Answer:** 540", "540", False),
    ("Final Answer: 540", "540", True),
    ("The answer: 540", "540", True),
    ("Answer: \\text{540}", "540", True),
    ("Answer: \\textbf{540}", "540", True),
    ("Answer: \\overline{540}", "540", True),
    ("Answer: 540 (mod 1000)", "540", False),
    ("Answer: $540$ (after simplification)", "540", True),
    ("Answer: 1,2,3,\\ldots,540", "540", False),
    # several Answer lines: the last match wins
    ("Answer: 17\nAnswer: 540", "540", True),
    ("Answer: 540\nAnswer: 17", "540", False),
    ("Answer: 540\nSo Answer: 17", "540", False),
    ("Answer: 540\nanswer:17", "540", False),
    ("Answer: 17\nanswer: 540", "540", True),
    ("Answer:\n540", "540", True),
    ("Answer: 540\nAnswer:", "540", False),
    ("Answer:\nAnswer: 540", "540", False),
    ("Answer: 540 Answer: 17", "540", False),
    # missing or out-of-window answers
    ("", "540", False),
    ("540", "540", False),
    ("The answer is 540.", "540", False),
    ("Answer 540", "540", False),
    ("Answer: ", "540", False),
    ("Answer: 540\n" + X * 300, "540", False),
    ("Answer: 540\n" + X * 288, "540", True),  # exactly 300 characters
    ("Answer: 540\n" + X * 289, "540", False),  # the "A" falls out of the window
    ("Answer: 540\n" + "y" * 250, "540", True),
    # dollar pairs and lists
    ("Answer: $540$ or $17$", "540", True),
    ("Answer: $17$ or $540$", "540", False),
    ("Answer: 5 or 6", "5", False),
    ("Answer: 540, 17", "540", False),
    ("Answer: 5, 4, 0", "540", True),
    ("Answer: \\{540\\}", "540", False),
    ("Answer: (540)", "540", False),
    ("Answer: \\left(540\\right)", "540", False),
    # control characters and unicode
    ("Answer: 540\x00", "540", False),
    ("Answer: \uff15\uff14\uff10", "540", False),
    ("Answer: \u22124", "-4", False),
    ("\x1b[31mAnswer: 540\x1b[0m", "540", False),
    ("Answer:\u00a0540", "540", True),
    ("Answer: 540\u200b", "540", False),
    # ground-truth forms
    ("Answer: 540", "$540$", True),
    ("Answer: 540", "\\boxed{540}", True),
    ("Answer: 540", "540 dollars", True),
    ("Answer: (A)", "\\text{(A)}", True),
    ("Answer: A", "\\text{(A)}", False),
    ("Answer: \\text{(A)}", "(A)", True),
    ("Answer: a", "a", True),
    ("Answer: x^2+1", "x^2+1", True),
    ("Answer: x^2 + 1", "x^2+1", True),
    ("Answer: (1,2)", "(1,2)", True),
    ("Answer: (1, 2)", "(1,2)", True),
    ("Answer: 3\\text{ and }4", "3,4", True),
    ("Answer: \\pi", "\\pi", True),
    ("Answer: 2\\pi", "\\pi", False),
    ("Answer: \\infty", "\\infty", True),
]


def test_case_count():
    assert len(CASES) >= 100


@pytest.mark.parametrize(("response", "gt", "acc"), CASES)
def test_minerva_mode(response, gt, acc):
    r = compute_score(response, gt)
    assert r.acc is acc
    assert r.score == (1.0 if acc else -1.0)


@pytest.mark.parametrize(("response", "pred"), [
    ("Answer: 1,000 dollars", "1000"),
    ("Answer: $\\boxed{\\frac12}$", "\\frac{1}{2}"),
    ("Answer: \\boxed{540} \\boxed{17}", "540}\\boxed{17"),
    ("Answer: 5, 4, 0", "540"),
    ("**Answer:** 540", "**540"),
    ("Answer: 540\nAnswer:", ""),
    ("Answer:\nAnswer: 540", "Answer:540"),
])
def test_normalized_prediction(response, pred):
    assert compute_score(response, "0").pred == pred


def test_no_answer_has_reason_and_no_pred():
    r = compute_score("I give up", "540")
    assert (r.pred, r.acc, r.score) == (None, False, -1.0) and "Answer:" in r.reason


@pytest.mark.parametrize(("response", "gt", "acc"), [
    ("so \\boxed{540}", "540", True),
    ("\\boxed{540} then \\boxed{17}", "540", False),
    ("\\boxed{540} then \\boxed{17}", "17", True),
    ("\\boxed{540}" + X * 100, "540", False),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True),
    ("\\boxed{ 540 }", "540", False),
    ("\\boxed{540", "540", False),
    ("Answer: 540", "540", False),
    ("\\boxed{" * 50, "540", False),
])
def test_strict_box_mode(response, gt, acc):
    assert compute_score(response, gt, strict_box=True).acc is acc
    assert get_reward("math_dapo_strict_box").fn(response, gt).acc is acc


def test_bytes_and_decode_tail_equivalence():
    assert compute_score(b"Answer: 540", "540").acc
    assert compute_score(b"\xff" * 1000 + b"Answer: 540", "540").acc
    assert compute_score(b"Answer: 540\xff\xfe", "540").pred == "540\ufffd\ufffd"
    rng = random.Random(0)
    pieces = [b"\xff", b"\xe2\x82", b"\xe2\x82\xac", b"\xf0\x9f\x98\x80", b"a", b"\n", b"\x80\x80\x80", b"Answer: 5"]
    for _ in range(300):
        data = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 900)))
        for chars in (1, 7, 300):
            assert decode_tail(data, chars) == data.decode("utf-8", "replace")[-chars:]
    with pytest.raises(TypeError):
        decode_tail(None, 3)  # type: ignore[arg-type]


def test_non_string_ground_truth_raises():
    with pytest.raises(TypeError, match="ground truth must be str"):
        compute_score("Answer: 5", 5)  # type: ignore[arg-type]


def test_extract_and_normalize_helpers():
    assert extract_answer("blah\nAnswer: 42 apples\nmore") == "42 apples"
    assert extract_answer("nothing") is None
    assert normalize_answer("x = \\$1,234") == "1234"
    assert normalize_answer("  17  ") == "17"


@pytest.mark.parametrize(("value", "fragment"), [
    (None, "must be a string"), (540, "got int"), (b"540", "got bytes"), ("", "empty"), ("   ", "empty"),
    ("5\n6", "several lines"), ("dollars", "normalizes to an empty string"), ("9" * 400, "could never match"),
])
def test_validate_ground_truth_rejects(value, fragment):
    reason = validate_ground_truth(value)
    assert reason is not None and fragment in reason


def test_validate_ground_truth_accepts():
    for ok in ("540", "\\frac{1}{2}", "(A)", "-4", "1,000"):
        assert validate_ground_truth(ok) is None


def test_registry():
    assert {"math_dapo", "math_dapo_strict_box"} <= set(reward_names())
    assert get_reward("math_dapo").fn is compute_score and get_reward("math_dapo").tail_chars == 300
    with pytest.raises(ValueError, match="already registered"):
        register_reward("math_dapo")(compute_score)
    with pytest.raises(ValueError, match="registered: math_dapo"):
        get_reward("math")


def test_hostile_inputs_in_process_are_fast():
    # bounded work: these would take seconds with quadratic or backtracking code paths
    hostile = ["x" * 10**6 + "Answer: 540", "{" * 10**6, "\\boxed{" * 10**5, "Answer:" * 10**5,
               "$" * 10**5 + "Answer: 5", "\x00\x01\x1b" * 10**5, "\ud800" * 1000 + "Answer: 540",
               b"\xff\xfe" * 10**6, "Answer: " + "frac" * 70]
    for h in hostile:
        for strict in (False, True):
            r = compute_score(h, "540", strict_box=strict)
            assert r.score in (1.0, -1.0)
    assert compute_score("x" * 10**6 + "Answer: 540", "540").acc
