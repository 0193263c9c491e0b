"""A dead peer rank: the surviving rank stops with one line naming the checkpoint the same command resumes from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapo_mcore import cli

pytestmark = pytest.mark.unit

CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml")
GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:916. This is typically caused by a remote worker crashing.")


def _checkpoint(root: Path, step: int) -> None:
    d = root / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"step": step}))
    (d / "COMPLETE").write_text(str(step))


@pytest.mark.parametrize("error", [RuntimeError(GLOO), ConnectionResetError(104, "Connection reset by peer")])
def test_a_lost_peer_is_one_line_naming_the_checkpoint_to_resume_from(tmp_path, monkeypatch, capsys, error):
    from dapo_mcore import trainer

    run_dir = tmp_path / "run"
    _checkpoint(run_dir / "checkpoints", 2)
    _checkpoint(run_dir / "checkpoints", 4)
    (run_dir / "checkpoints" / "step_000006.partial").mkdir()  # an interrupted save is never named

    def dies(config, overrides):
        raise error

    monkeypatch.setattr(trainer, "train_main", dies)
    assert cli.main(["train", CONFIG, f"run.dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dapo-mcore: another rank of the job stopped (")
    assert f"the run resumes from {run_dir / 'checkpoints' / 'step_000004'}" in err[0]
    assert "pair.cc" not in err[0]


def test_no_checkpoint_yet_says_it_starts_over_and_other_errors_keep_their_traceback(tmp_path, monkeypatch):
    from dapo_mcore import trainer

    monkeypatch.setattr(trainer, "train_main", lambda c, o: (_ for _ in ()).throw(RuntimeError(GLOO)))
    line = cli.lost_peer_line(RuntimeError(GLOO), tmp_path / "none", "train")
    assert "Connection closed by peer" in line and "no checkpoint yet and starts over" in line
    monkeypatch.setattr(trainer, "train_main", lambda c, o: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["train", CONFIG, f"run.dir={tmp_path / 'run'}"])


GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "30000ms for recv operation to complete")


@pytest.fixture
def handlers():
    """The test's SIGTERM/SIGUSR1 handlers come back after it (a requeue exit ignores both from then on)."""
    import signal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def test_a_collective_timeout_names_the_hung_rank_and_exits_for_a_requeue(tmp_path, monkeypatch, capsys, handlers):
    """A rank hangs: the collective of this rank times out; the roll call names the silent rank; exit 75 (what
    slurm/launch.sh requeues on), one line, no traceback. Before: a traceback and exit 1, so the job ended FAILED."""
    from dapo_mcore import trainer
    from dapo_mcore.actor import rollcall

    run_dir = tmp_path / "run"
    _checkpoint(run_dir / "checkpoints", 2)
    monkeypatch.setattr(trainer, "train_main", lambda c, o: (_ for _ in ()).throw(RuntimeError(GLOO_TIMEOUT)))
    monkeypatch.setattr(rollcall, "call", lambda: rollcall.Silent(((1, "n2"),)))
    assert cli.main(["train", CONFIG, f"run.dir={run_dir}", "parallel.timeout_minutes=0.5"]) == 75
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert ": a collective got no answer within parallel.timeout_minutes=0.5 (30 s): rank 1 on n2 stopped " \
           "answering" in err[0]
    assert f"exiting 75 so that slurm/launch.sh requeues the job (the requeued job resumes from " \
           f"{run_dir / 'checkpoints' / 'step_000002'}" in err[0]
    import signal

    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN, "srun's SIGTERM must not turn 75 into 143"
    monkeypatch.setattr(trainer, "eval_main", lambda *a, **k: (_ for _ in ()).throw(RuntimeError(GLOO_TIMEOUT)))
    assert cli.main(["eval", CONFIG, f"run.dir={run_dir}"]) == 2  # nothing to resume: no requeue
    assert "this rank stops too" in capsys.readouterr().err


def test_what_counts_as_a_collective_timeout():
    assert cli.collective_timed_out(RuntimeError(GLOO_TIMEOUT))
    assert cli.collective_timed_out(RuntimeError("Timed out waiting 5ms for send operation to complete"))
    later = RuntimeError("Application timeout caused pair closure")  # a later collective of the same group
    assert cli.collective_timed_out(later)
    try:  # the timeout, then a collective while unwinding: the chain still says timeout
        try:
            raise RuntimeError(GLOO_TIMEOUT)
        finally:
            raise ConnectionError("Connection closed by peer")
    except ConnectionError as exc:
        assert cli.collective_timed_out(exc)
    assert not cli.collective_timed_out(RuntimeError(GLOO)) and not cli.collective_timed_out(RuntimeError("a bug"))
