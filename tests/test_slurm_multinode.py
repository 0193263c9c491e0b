"""Two nodes, for real: the project's own `sbatch -N 2 slurm/tiny_cpu.sbatch` on a two-node Slurm cluster.

The cluster (tests/multinode.py) puts each node in its own network namespace with its own hostname and address, so
MASTER_ADDR, the node rank and gloo's interface are derived by slurm/launch.sh and torch as on a real cluster.
Each job is compared with the same layout on one node (torchrun on this host). Run by .ci/tiers/40-multinode.sh
(DAPO_MCORE_MULTINODE=1); skipped elsewhere, and where the machine lacks root, CAP_NET_ADMIN or CAP_SYS_ADMIN (with
that reason). One node has one CPU: every job is 2 tasks, one per node.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multinode import ClusterUnavailable, Frozen, TwoNodeCluster, freezer_root, preflight

pytestmark = pytest.mark.multinode

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "slurm" / "tiny_cpu.sbatch"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
COMPARED = ("train/loss", "train/grad_norm", "train/entropy", "rollout/reward_mean", "rollout/acc_mean")
TP_RUN = ("train.steps=2", "eval.every=0", "checkpoint.every=2")
DP_RUN = ("parallel.tensor_parallel=1", "train.steps=4", "eval.every=0", "checkpoint.every=1")
HANG_TIMEOUT = "parallel.timeout_minutes=0.5"  # 30 s: a tiny step's collectives are seconds apart


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_cache):
    if os.environ.get("DAPO_MCORE_MULTINODE") != "1":
        pytest.skip("the two-node cluster tests run in .ci/tiers/40-multinode.sh (set DAPO_MCORE_MULTINODE=1)")
    try:
        preflight()
    except ClusterUnavailable as exc:
        pytest.skip(f"two-node cluster unavailable: {exc}")
    c = TwoNodeCluster(tmp_path_factory.mktemp("mn"))
    c.start()
    c.job_env = dict(c.env, DAPO_REPO=str(REPO), OMP_NUM_THREADS="1", DAPO_MCORE_CACHE=tiny_cache,
                     PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                     PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}".rstrip(":"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME",
                "DAPO_SOCKET_IFNAME"):
        c.job_env.pop(var, None)
    try:
        yield c
    finally:
        c.stop()


def submit(c: TwoNodeCluster, out: Path, *args: str, **env: str) -> str:
    """`sbatch -N 2 slurm/tiny_cpu.sbatch ARGS` from the repo root, as a user would; returns the job id."""
    proc = subprocess.run(["sbatch", "--parsable", "-N", "2", f"--output={out}", str(TINY), *args], cwd=REPO,
                          env=dict(c.job_env, DAPO_MCORE_LOG_ALL_RANKS="1", **env), capture_output=True, text=True,
                          timeout=120)  # every rank's INFO lines: the tests read what each rank loaded, and where
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job(c: TwoNodeCluster, job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=c.env, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def wait_for(predicate, timeout: float, what: str, poll: float = 0.5) -> None:
    """Deadlines only bound a failure (minutes: at a load of ~10 on 2 cores each job start is several times slower)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)


def wait_end(c: TwoNodeCluster, job_id: str, timeout: float = 1500) -> dict[str, str]:
    wait_for(lambda: job(c, job_id)["JobState"] in ENDED, timeout, f"job {job_id} to end")
    return job(c, job_id)


def rows(run_dir: Path) -> dict[int, dict]:
    """The last metrics row of each training step (a resumed run logs the steps after its checkpoint again)."""
    path = run_dir / "metrics.jsonl"
    out: dict[int, dict] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        if "train/loss" in row:
            out[row["step"]] = row
    return out


def one_node_reference(tmp: Path, env: dict[str, str], overrides: tuple[str, ...], tp: int) -> Path:
    """The same job as 2 ranks on this host (torchrun, loopback): the single-node layout to compare with."""
    run_dir = tmp / "one-node"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "dapo_mcore.cli", "train",
           "examples/tiny_cpu.yaml", f"run.dir={run_dir}", f"parallel.tensor_parallel={tp}", *overrides]
    local = {k: v for k, v in env.items() if k != "SLURM_CONF"}
    proc = subprocess.run(cmd, cwd=REPO, env=dict(local, GLOO_SOCKET_IFNAME="lo"), capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def dp_reference(cluster, tmp_path_factory) -> dict[int, dict]:
    """The uninterrupted DP=2 run on one node (torchrun on this host), once for every interrupted run here."""
    return rows(one_node_reference(tmp_path_factory.mktemp("dp-ref"), cluster.job_env, DP_RUN, tp=1))


def assert_same_trajectory(got: dict[int, dict], want: dict[int, dict]) -> None:
    assert sorted(got) == sorted(want)
    for step in want:
        for key in COMPARED:
            assert math.isclose(got[step][key], want[step][key], rel_tol=1e-6, abs_tol=1e-9), (step, key)


def checkpoint_files(ckpt: Path) -> list[str]:
    return sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())


def test_probe_rendezvous_across_two_nodes(cluster, tmp_path):
    """launch.sh derives MASTER_ADDR=n1 from the node list; the ranks run on n1 and n2 and all-reduce across them."""
    out, run = tmp_path / "job.out", tmp_path / "run"
    info = wait_end(cluster, submit(cluster, out, "python", "slurm/probe.py", str(run), "--steps", "2"))
    log = out.read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert "2 tasks on 2 node(s), rendezvous n1:" in log, log
    done = json.loads((run / "done.json").read_text())
    assert done["hosts"] == ["n1", "n2"] and done["world"] == 2
    assert [json.loads(line)["sum"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [3.0, 3.0]


def test_tensor_parallel_across_nodes_matches_one_node(cluster, tmp_path):
    """TP=2 with one rank per node (tiny_cpu.sbatch's own layout), gloo on the interface a site names
    (DAPO_SOCKET_IFNAME=eth0): the same metrics as TP=2 on one node, one checkpoint with each shard once."""
    out, run_dir = tmp_path / "job.out", tmp_path / "run"
    info = wait_end(cluster, submit(cluster, out, *TP_RUN, RUN_DIR=str(run_dir), DAPO_SOCKET_IFNAME="eth0"))
    log = out.read_text()
    assert info["JobState"] == "COMPLETED", log[-4000:]
    reference = one_node_reference(tmp_path, cluster.job_env, TP_RUN, tp=2)
    assert_same_trajectory(rows(run_dir), rows(reference))
    ckpt, ref_ckpt = run_dir / "checkpoints" / "step_000002", reference / "checkpoints" / "step_000002"
    assert (ckpt / "COMPLETE").is_file()
    assert checkpoint_files(ckpt) == checkpoint_files(ref_ckpt), "the same files, each written once"
    assert sorted(p.name for p in (ckpt / "model").iterdir() if p.is_dir()) == ["mp_rank_00_000", "mp_rank_01_000"]
    assert not list((run_dir / "checkpoints").glob("*.partial"))


def test_run_dir_that_the_nodes_do_not_share_stops_at_start_up(cluster, tmp_path):
    """run.dir on a node-local path: each node would write its own half of every checkpoint. One line, exit 2."""
    out = tmp_path / "job.out"
    run_dir = cluster.node_local / "run"
    info = wait_end(cluster, submit(cluster, out, "train.steps=1", RUN_DIR=str(run_dir)))
    log = out.read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", (info, log[-3000:])
    lines = [line for line in log.splitlines() if "is not shared between the nodes" in line]
    assert lines and all(line == lines[0] for line in lines), log[-3000:]
    assert lines[0].startswith("dapo-mcore: ") and "n2 cannot see the file rank 0 wrote there on n1" in lines[0]
    assert "Traceback" not in log and "requeueing" not in log
    assert not (cluster.state / "node-local.n1" / "run" / "checkpoints").exists(), "nothing written"


KILL_AT = {
    # mid-step: step 2's checkpoint is complete (``latest`` names it); the kill lands in step 3
    "mid_step": lambda ckpts: (ckpts / "latest").is_file() and (ckpts / "latest").read_text().strip() == "step_000002",
    # mid-checkpoint: step 2's checkpoint is being written (its .partial directory exists, COMPLETE does not)
    "mid_checkpoint": lambda ckpts: (ckpts / "step_000002.partial").is_dir(),
}
RESUMES_FROM = {"mid_step": 2, "mid_checkpoint": 1}


@pytest.mark.parametrize("phase", list(KILL_AT))
def test_node_dies_job_is_requeued_and_resumes_the_same_trajectory(cluster, tmp_path, phase, dp_reference):
    """Data parallel over the nodes (TP=1, DP=2, a checkpoint every step). n2 dies (SIGKILL to its slurmd,
    slurmstepd and task) in step 3, or while step 2's checkpoint is written. n1's rank leaves at once (gloo:
    connection closed/reset by peer); Slurm sets n2 DOWN after SlurmdTimeout (10 s here), cancels the job "due to
    node failure" and requeues it (--requeue); launch.sh, signalled, does not requeue it a second time. n2 comes
    back, the job waits out Slurm's requeue hold and restarts on both nodes from the last intact checkpoint (both
    ranks read the same shard), and ends with exactly the trajectory of an uninterrupted one-node DP run."""
    out, run_dir = tmp_path / "job.out", tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    job_id = submit(cluster, out, *DP_RUN, RUN_DIR=str(run_dir))
    wait_for(lambda: KILL_AT[phase](ckpts) or job(cluster, job_id)["JobState"] in ENDED, 1500, phase, poll=0.01)
    killed_at = time.monotonic()
    assert cluster.kill_node("n2"), "n2 had processes"
    at_kill = sorted(p.name for p in ckpts.iterdir())
    assert job(cluster, job_id)["JobState"] == "RUNNING", out.read_text()[-3000:]
    timeline = _watch_until_requeued(cluster, job_id, killed_at)
    cluster.start_slurmd("n2")
    # The requeued job waits out Slurm's hold (BeginTime, ~2 min) on its own: released early, it raced the old
    # instance's kill that slurmctld still owed n2 (same job id), which then killed the new task on n2 (143).
    info = wait_end(cluster, job_id)
    log = out.read_text()
    record = {"phase": phase, "checkpoints_at_kill": at_kill, "timeline": timeline}
    (tmp_path / "record.json").write_text(json.dumps(record))
    print(f"node failure: {json.dumps(record)}")
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, timeline, log[-4000:])
    first, resumed = log.split("restart 1:")
    # (launch.sh may log "not requeueing" after its SIGTERM, or be killed by Slurm before it gets there)
    # Slurm's reason, from the controller: slurmstepd's "CANCELLED ... DUE TO NODE FAILURE" line in the job's output
    # races the batch script's own exit (srun hears of the node failure at the same moment) and may be missing.
    ctld = (cluster.state / "log" / "slurmctld.log").read_text()
    assert f"requeue job JobId={job_id} due to failure of node n2" in ctld, ctld[-3000:]
    assert "by peer" in first, first[-4000:]
    assert "requeueing job" not in log, "Slurm requeued it; launch.sh must not requeue it again"
    assert "restart 1: 2 tasks on 2 node(s)" in log
    step = RESUMES_FROM[phase]
    assert resumed.count(f"loaded checkpoint {ckpts}/step_{step:06d} (step {step})") == 2, resumed[-3000:]
    assert_same_trajectory(rows(run_dir), dp_reference)
    assert (ckpts / "latest").read_text().strip() == "step_000004"
    assert not list(ckpts.glob("*.partial"))


HUNG = {  # the node whose trainer hangs -> (the survivor, what the survivor's roll call says)
    "rank1": ("n2", "rank 0 on n1", "rank 1 on n2 stopped answering"),
    # rank 0's process serves the rendezvous store: the roll call finds the store silent (the tier runs rank1 only)
    "rank0": ("n1", "rank 1 on n2", "the rendezvous store on n1:{port} does not answer either: the process serving "
              "it (rank 0's) hangs"),
}


@pytest.mark.parametrize("hung", list(HUNG))
def test_a_rank_that_hangs_is_named_killed_requeued_and_resumed(cluster, tmp_path, dp_reference, hung):
    """DP=2 over the nodes, a 30 s collective timeout. One trainer hangs in step 3 (frozen: it runs nothing and
    handles no signal). The other rank times out in its next collective, names the hung one (a roll call over the
    rendezvous store), exits 75; srun's SIGTERM cannot end the frozen rank, so its task wrapper kills it and exits 1
    (below 75: srun reports 75, not the signal); launch.sh requeues the job, which resumes on both nodes from step 2's
    checkpoint with exactly the trajectory of the uninterrupted one-node run."""
    node, survivor, said = HUNG[hung]
    try:
        freezer_root()
    except ClusterUnavailable as exc:
        pytest.skip(f"cannot hang a rank here: {exc}")
    out, run_dir = tmp_path / "job.out", tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    job_id = submit(cluster, out, *DP_RUN, HANG_TIMEOUT, RUN_DIR=str(run_dir))
    wait_for(lambda: KILL_AT["mid_step"](ckpts) or job(cluster, job_id)["JobState"] in ENDED, 1500, "step 2's "
             "checkpoint", poll=0.01)
    pid = cluster.trainer_pid(node)
    assert pid is not None and job(cluster, job_id)["JobState"] == "RUNNING", out.read_text()[-3000:]
    frozen = Frozen(pid)
    hung_at = time.monotonic()
    try:
        wait_for(lambda: job(cluster, job_id)["JobState"] in ("PENDING", *ENDED), 600, "the requeue")
        requeued_after = time.monotonic() - hung_at
        assert job(cluster, job_id)["JobState"] == "PENDING", out.read_text()[-4000:]
        assert not (frozen.group / "cgroup.procs").read_text().strip(), "the hung rank was killed"
    finally:
        frozen.remove()
    time.sleep(2.0)  # past the requeue's second: slurmd refuses a credential issued in it ("credential revoked")
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=cluster.env, check=True)
    info = wait_end(cluster, job_id)
    log = out.read_text()
    first, resumed = log.split("restart 1:")
    named = [line for line in first.splitlines() if "a collective got no answer" in line]
    got = rows(run_dir)
    record = {"requeued_after_s": round(requeued_after, 1), "line": named[:1], "wrapper": [
        line for line in first.splitlines() if "did not exit within" in line], "bit_identical": sorted(got) == sorted(
        dp_reference) and all(got[s][k] == dp_reference[s][k] for s in dp_reference for k in COMPARED)}
    (tmp_path / "record.json").write_text(json.dumps(record))
    print(f"rank hang: {json.dumps(record)}")
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, log[-4000:])
    said = said.format(port=re.search(r"rendezvous n1:(\d+)", first).group(1))  # launch.sh's MASTER_PORT
    assert len(named) == 1 and named[0].startswith(f"dapo-mcore: {survivor}: a collective got no answer within "
                                                   f"parallel.timeout_minutes=0.5 (30 s): {said}"), first[-4000:]
    assert f"exiting 75 so that slurm/launch.sh requeues the job (the requeued job resumes from {ckpts}/step_000002" \
        in named[0], named[0]
    hung_rank = "rank 1 on n2" if hung == "rank1" else "rank 0 on n1"
    assert f"{hung_rank} did not exit within" in first and "step exited with 75" in first, first[-4000:]
    assert f"requeueing job {job_id} (restart 1)" in first and "Traceback" not in first, first[-4000:]
    assert resumed.count(f"loaded checkpoint {ckpts}/step_000002 (step 2)") == 2, resumed[-3000:]
    assert_same_trajectory(rows(run_dir), dp_reference)
    assert (ckpts / "latest").read_text().strip() == "step_000004" and not list(ckpts.glob("*.partial"))


ASYNC_RUN = ("rollout.pipeline.mode=async", "algo.tis_cap=2.0", "train.steps=2", "eval.every=0", "checkpoint.every=2")


def test_async_layout_engine_on_one_node_trainer_on_the_other(cluster, tmp_path):
    """The async mode across nodes: rank 0 on n1 trains, rank 1 on n2 runs the engine; the weights
    cross the nodes over the bridge's broadcast group and the batches come back over its send/recv pair. The same
    metrics as the same async layout on one node, and the same lag."""
    out, run_dir = tmp_path / "job.out", tmp_path / "run"
    info = wait_end(cluster, submit(cluster, out, *ASYNC_RUN, "parallel.tensor_parallel=1", RUN_DIR=str(run_dir)))
    log = out.read_text()
    assert info["JobState"] == "COMPLETED", log[-4000:]
    assert "rank 0 on n1 is trainer rank 0/1" in log and "rank 1 on n2 is engines rank 0/1" in log, log[-4000:]
    reference = rows(one_node_reference(tmp_path, cluster.job_env, ASYNC_RUN, tp=1))
    got = rows(run_dir)
    assert_same_trajectory(got, reference)
    assert [got[s]["async/lag_mean"] for s in sorted(got)] == [reference[s]["async/lag_mean"] for s in sorted(got)]
    assert [got[s]["async/policy_version"] for s in sorted(got)] == [0.0, 0.0]


def _watch_until_requeued(c: TwoNodeCluster, job_id: str, t0: float) -> list[tuple[float, str, str, str]]:
    """(seconds after the kill, job state, node states) at each change, until the job is requeued (PENDING)."""
    timeline: list[tuple[float, str, str, str]] = []

    def changed() -> bool:
        info = job(c, job_id)
        entry = (round(time.monotonic() - t0, 1), info["JobState"], info["Restarts"], c.sinfo().replace("\n", ", "))
        if not timeline or timeline[-1][1:] != entry[1:]:
            timeline.append(entry)
        return info["JobState"] == "PENDING" or info["JobState"] in ENDED

    wait_for(changed, 300, "the job to be requeued after the node failure")
    assert timeline[-1][1] == "PENDING" and timeline[-1][2] == "1", timeline
    return timeline
