"""A dead rank is named in one whole line, and a peer's error text is never cut mid-word."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from dapo_mcore.cli import clip_words, lost_peer_line
from dapo_mcore.commands.launcher import dead_rank_line

pytestmark = pytest.mark.unit

GLOO = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40000 while "
        "the collective waited for a message from rank 1 of the default process group in allreduce_coalesced")


def test_a_peers_error_text_is_cut_at_a_word_boundary(tmp_path: Path):
    text = GLOO + " extra words" * 20
    line = lost_peer_line(RuntimeError(text), tmp_path, "train")
    seen = line.split("(", 1)[1].split("); this rank", 1)[0]
    assert seen.endswith("...") and len(seen) <= 160
    said = text.split("] ", 1)[1]
    assert said.startswith(seen[:-3]) and said[len(seen) - 3] == " "  # the cut falls before a space: no word is cut
    assert clip_words("short text", 160) == "short text"


def test_the_dead_rank_line_names_the_rank_and_its_signal():
    line = dead_rank_line(1, signal.SIGKILL, "train")
    assert line.startswith("dapo-mcore: rank 1 died of SIGKILL (exit 137); the other ranks were stopped")
    assert "out of memory" in line and "resumes the run from its last checkpoint" in line and "\n" not in line
    assert "run the same command again" in dead_rank_line(0, signal.SIGSEGV, "eval")
