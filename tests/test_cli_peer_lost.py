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
