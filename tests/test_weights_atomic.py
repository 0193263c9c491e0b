"""A conversion never leaves a half-written target nor, once its process is gone, a `.partial` directory:
SIGTERM cleans up, leftovers of dead processes are removed by the next run, a target that appears meanwhile is
never renamed over; and a converted checkpoint carries the tokenizer files back to Hugging Face."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conversion.hf_to_mcore import convert_hf_to_mcore
from conversion.mcore_to_hf import convert_mcore_to_hf
from conversion.synthetic import save_tiny_hf_model
from dapo_mcore.weights import ParallelLayout
from dapo_mcore.weights.atomic import atomic_directory, remove_stale_partials, temp_dir_for
from dapo_mcore.weights.errors import OutputPathError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]

_SLOW_CONVERT = """
import sys, time
from dapo_mcore.weights import mapping
real = mapping.ModelMapping.shard_extents
def slow(self, *a, **k):
    time.sleep(0.2)
    return real(self, *a, **k)
mapping.ModelMapping.shard_extents = slow
from conversion.hf_to_mcore import main
sys.exit(main(["--hf", sys.argv[1], "--out", sys.argv[2], "--no-progress"]))
"""


@pytest.fixture()
def hf(tmp_path):
    d = tmp_path / "hf"
    save_tiny_hf_model(d, seed=1)
    return d


def test_sigterm_removes_the_partial_dir(hf, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_CONVERT, str(hf), str(tmp_path / "out")], env=env,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".out.partial-*")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "terminated (SIGTERM)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_stale_partials_of_dead_processes_are_removed(hf, tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    target = tmp_path / "out"
    stale = temp_dir_for(target).with_name(temp_dir_for(target).name.replace(f"-{os.getpid()}-", f"-{dead.pid}-"))
    alive = temp_dir_for(target)  # this process: still running, so kept
    other_host = tmp_path / ".out.partial-otherhost-1-abcd"
    for d in (stale, alive, other_host):
        (d / "x").mkdir(parents=True)
    with caplog.at_level(logging.WARNING):
        assert remove_stale_partials(target) == [stale]
    assert not stale.exists() and alive.exists() and other_host.exists()
    assert "host otherhost" in caplog.text
    alive_name = alive.name
    import shutil

    shutil.rmtree(alive)
    (tmp_path / alive_name.replace(f"-{os.getpid()}-", f"-{dead.pid}-")).mkdir()
    convert_hf_to_mcore(hf, target, ParallelLayout())  # the next run cleans up too
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["hf", "out", other_host.name])


def test_target_created_meanwhile_is_not_renamed_over(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(OutputPathError, match="already exists"):
        with atomic_directory(target) as tmp:
            (tmp / "data").write_text("x")
            target.mkdir()  # another job took the name (an empty dir would be silently replaced by rename)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert list(target.iterdir()) == []


def test_tokenizer_files_travel_through_the_megatron_checkpoint(hf, tmp_path, caplog):
    for name, text in (("tokenizer_config.json", '{"chat_template": "x"}'), ("tokenizer.json", "{}"),
                       ("chat_template.jinja", "{{ messages }}")):
        (hf / name).write_text(text)
    assert (hf / "generation_config.json").exists()  # save_pretrained writes it
    convert_hf_to_mcore(hf, tmp_path / "m", ParallelLayout(tp=2))
    convert_mcore_to_hf(tmp_path / "m", tmp_path / "back")
    for name in ("tokenizer_config.json", "tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (tmp_path / "back" / name).read_bytes() == (hf / name).read_bytes()

    bare = tmp_path / "bare"
    save_tiny_hf_model(bare, seed=1)
    (bare / "generation_config.json").unlink()
    with caplog.at_level(logging.WARNING):
        convert_hf_to_mcore(bare, tmp_path / "m2", ParallelLayout())
        convert_mcore_to_hf(tmp_path / "m2", tmp_path / "back2")
    assert "has no tokenizer files" in caplog.text and "pass --tokenizer" in caplog.text


def _raise_in_a_callback(exc: BaseException) -> None:
    """``exc`` raised inside a weakref callback, where Python cannot propagate it (it reports it as unraisable)."""
    import weakref

    class Thing:
        pass

    def callback(_ref):
        raise exc

    thing = Thing()
    ref = weakref.ref(thing, callback)  # noqa: F841 (kept alive so that its callback runs)
    del thing


@pytest.mark.unit
@pytest.mark.parametrize("stop", ["sigint", "sigterm"])
def test_a_stop_raised_inside_a_callback_still_stops_the_command(stop):
    """A signal whose exception lands in a callback (an import lock's weakref callback, as a convert interrupted at a
    random moment met) was printed as "Exception ignored ... Traceback" and lost, the command running on to exit 0:
    it is raised again once the callback is over."""
    import signal

    from dapo_mcore.weights.atomic import _Terminated, stop_signal, terminating

    want = signal.SIGINT if stop == "sigint" else signal.SIGTERM
    with pytest.raises(BaseException) as caught:
        with terminating():
            _raise_in_a_callback(KeyboardInterrupt() if stop == "sigint" else _Terminated(signal.SIGTERM))
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # the re-delivered signal lands here, in ordinary code
                pass
    assert stop_signal(caught.value) == want


@pytest.mark.unit
def test_other_unraisable_exceptions_still_go_to_the_usual_hook(monkeypatch):
    import sys

    from dapo_mcore.weights.atomic import terminating

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(type(u.exc_value)))
    with terminating():
        _raise_in_a_callback(ValueError("not a stop"))
    assert seen == [ValueError]
