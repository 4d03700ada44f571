"""The learner as several torch.distributed ranks (gloo on CPU, launched by torchrun).

- Two ranks take the same step as one process on the same batch (DDP and FSDP2, GRPO with uneven
  micro-batches, DPO with a rank left without a pair). Tolerance: the first step's reported figures
  agree to 1e-6 relative (observed: 2e-7). The second step starts from weights that already differ:
  Adam divides by the root of the squared gradient, so components whose gradient is at the level
  of float32 rounding move by up to lr (1e-2) in either direction, and rounding differs because a
  prompt's gradient is the sum of its rows' (a group's samples read it once, model.py), in an order
  that depends on how the rows are split into ranks and micro-batches. So the second step's figures
  agree to 1e-4 (observed: 2.3e-5), and after it 99.5% of weights agree within 1e-5 (observed:
  99.83%) and every weight within 2e-3 (observed: at most 3.3e-4).
- A two-rank learner service checkpoints, and one rank resumes from it.
- Killing one rank mid-run stops the group; started again, it loses and repeats no sample.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from crucible.cli.train import service_env
from crucible.local.services import Services
from crucible.services.learner import checkpoints
from crucible.services.learner.__main__ import run
from crucible.services.learner.ranks import launch_args
from crucible.shared import rpc, store
from crucible.shared.procs import free_port, free_ports, stop_processes
from tests.test_learner import SEED, policies, publish, trajectories_for

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 240


def env_for(**extra) -> dict[str, str]:
    # Task samples are drawn with a seed from hash(group): the same in every process.
    return {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "PYTHONPYCACHEPREFIX": "/tmp/crucible-pyc",
            **extra}


def one_step(out: Path, ranks: int, sharding: str, objective: str, micro_batch: int, groups: int) -> tuple[dict, list]:
    out.mkdir(parents=True)
    module = ["-m", "tests.learner_ranks_step", str(out), sharding, objective, str(micro_batch), str(groups)]
    args = [sys.executable, *module] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *module]
    done = subprocess.run(args, cwd=ROOT, env=env_for(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out / "state.pt"), json.loads((out / "metrics.json").read_text())


@pytest.mark.parametrize("sharding,objective,micro_batch,groups", [
    ("ddp", "grpo", 3, 3),   # 13 samples: shares of 7 and 6, micro-batches of 3
    ("fsdp", "grpo", 3, 3),
    ("ddp", "dpo", 0, 1),    # one pair: the second rank has none and joins with weight 0
])
def test_two_ranks_take_the_same_step_as_one_process(tmp_path, sharding, objective, micro_batch, groups):
    alone, alone_metrics = one_step(tmp_path / "one", 1, "ddp", objective, micro_batch, groups)
    pair, pair_metrics = one_step(tmp_path / "two", 2, sharding, objective, micro_batch, groups)
    assert sorted(alone["weights"]) == sorted(pair["weights"])
    for step, (ours, theirs) in enumerate(zip(alone_metrics, pair_metrics)):
        assert ours["samples"] == theirs["samples"]
        for name in ("loss", "grad_norm", "entropy"):
            assert theirs[name] == pytest.approx(ours[name], rel=1e-6 if step == 0 else 1e-4, abs=1e-6), name
        # kl is the mean difference of two float32 log-probs of a few units each, summed in another
        # order on two ranks: its rounding is absolute (5e-6 seen on the first step, 3e-5 on the
        # second), however small the mean itself
        assert theirs["kl"] == pytest.approx(ours["kl"], abs=2e-5 if step == 0 else 1e-4)
    assert alone_metrics[0]["grad_norm"] > 0.01  # a real step
    diffs = torch.cat([(alone["weights"][k] - pair["weights"][k]).abs().flatten() for k in alone["weights"]])
    moved = torch.cat([(alone["weights"][k]).flatten() for k in alone["weights"]])
    assert float(diffs.max()) <= 2e-3
    assert float((diffs > 1e-5).float().mean()) <= 5e-3
    assert moved.abs().max() > 0
    # The optimiser states agree too (they resume on any number of ranks).
    for name, state in alone["optimizer"]["state"].items():
        theirs = pair["optimizer"]["state"][name]
        assert torch.allclose(state["exp_avg_sq"], theirs["exp_avg_sq"], rtol=1e-3, atol=1e-9), name


# -- the service ------------------------------------------------------------------------------------


def learner_env(settings, ranks: int, **extra) -> dict[str, str]:
    run_settings = {**settings.run_config().environment(), "CRUCIBLE_TOPIC_PREFIX": settings.topic_prefix,
                    "CRUCIBLE_CONSUMER_GROUP_PREFIX": settings.consumer_group_prefix,
                    "CRUCIBLE_LEARNER_GRPC_PORT": str(free_port()), "CRUCIBLE_METRICS_PORT": "0",
                    "CRUCIBLE_LEARNER_RANKS": str(ranks), "CRUCIBLE_LEARNER_COLLECTIVE_TIMEOUT_S": "60", **extra}
    return env_for(**service_env(settings, run_settings))


def start_learner(settings, ranks: int, log: Path, max_restarts: int = 0) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(launch_args(ranks, max_restarts), cwd=ROOT, env=learner_env(settings, ranks),
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def rank_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """rank -> pid of the launcher's live worker processes."""
    found = {}
    for child in Path("/proc").iterdir():
        if not child.name.isdigit():
            continue
        try:
            stat = (child / "stat").read_text()
            environ = (child / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        rank = [e for e in environ if e.startswith(b"RANK=")]
        if ppid == launcher.pid and rank:
            found[int(rank[0].split(b"=")[1])] = int(child.name)
    return found


def trained(settings) -> list[tuple[int, list[str]]]:
    client = store.connect(settings)
    rows = client.query("SELECT policy_version, samples FROM train_steps FINAL WHERE run_id = {r:String} ORDER BY policy_version",
                        parameters={"r": settings.run_id}).result_rows
    return [(int(v), list(s)) for v, s in rows]


async def wait_for_version(settings, count: int, version: int) -> None:
    got = await policies(settings, count)
    assert got[-1].version == version, [p.version for p in got]


def service_settings(stack_settings, tmp_path):
    return stack_settings.model_copy(update={
        "groups_per_step": 2, "max_policy_lag": 4, "seed": SEED, "home": tmp_path / "home", "run_id": "ranks-run",
        "lr": 1e-2, "learner_optimizer_every": 2})  # odd versions without optimiser state, even ones with it


@pytest.mark.kafka
@pytest.mark.store
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
async def test_a_two_rank_learner_checkpoints_and_one_rank_resumes(stack_settings, tmp_path, sharding):
    settings = service_settings(stack_settings, tmp_path).model_copy(update={"learner_sharding": sharding})
    launcher = start_learner(settings, 2, tmp_path / "learner.log")
    try:
        await wait_for_version(settings, 1, 0)
        assert sorted(rank_pids(launcher)) == [0, 1]
        await publish(settings, trajectories_for("a1", 0, [1, 0, 0, 1]) + trajectories_for("a2", 0, [0, 1, 1, 1]))
        await wait_for_version(settings, 2, 1)
        await publish(settings, trajectories_for("a3", 0, [1, 0]) + trajectories_for("a4", 1, [0, 1]))
        await wait_for_version(settings, 3, 2)
    finally:
        stop_processes([launcher], timeout=30)
    log = (tmp_path / "learner.log").read_text()
    assert "rank 1 stopped with rank 0 at version 2" in log, log[-3000:]
    folder = checkpoints.latest(settings)
    assert folder.name == "v000002"
    if sharding == "fsdp":  # one optimiser shard per rank, and no whole copy
        shards = sorted(p.name for p in (folder / checkpoints.OPTIMIZER_SHARDS).iterdir())
        assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"], shards
        assert not (folder / checkpoints.OPTIMIZER_FILE).exists()
    else:
        assert (folder / checkpoints.OPTIMIZER_FILE).exists()
    assert not list(folder.parent.glob(".*"))  # nothing left beside the checkpoints

    # One process now: it resumes at version 2, from the weights and optimiser state the two wrote.
    stop = asyncio.Event()
    learner = asyncio.create_task(run(settings, stop))
    try:
        resumed = (await policies(settings, 4))[3]
        assert resumed.version == 2 and resumed.checkpoint_uri == folder.as_uri()
        await publish(settings, trajectories_for("a5", 2, [1, 0]) + trajectories_for("a6", 2, [0, 1]))
        await wait_for_version(settings, 5, 3)
    finally:
        stop.set()
        trainer = await asyncio.wait_for(learner, 60)
    # The two ranks' optimiser state was loaded (AdamW had taken 2 steps there) and stepped on once more.
    assert {int(state["step"]) for state in trainer.optimizer.state.values()} == {3}
    steps = trained(settings)
    assert [v for v, _ in steps] == [1, 2, 3]
    ids = [i for _, samples in steps for i in samples]
    assert len(ids) == len(set(ids)) == 16


@pytest.mark.kafka
@pytest.mark.store
async def test_a_rank_killed_mid_run_loses_and_repeats_nothing(stack_settings, tmp_path):
    """The learner under the supervisor `crucible train` runs it with (local/services.py): torchrun
    exits when a rank dies, and the supervisor starts the group again."""
    settings = service_settings(stack_settings, tmp_path)
    services = Services(tmp_path / "run", learner_env(settings, 2), echo=lambda *_: None, max_restarts=2)
    services.start("learner")

    async def supervise():
        while True:
            services.check()
            await asyncio.sleep(0.2)

    supervisor = asyncio.create_task(supervise())
    published = []

    async def send(*groups):
        batch = [t for g in groups for t in g]
        published.extend(t.id for t in batch)
        await publish(settings, batch)

    try:
        await wait_for_version(settings, 1, 0)
        await send(trajectories_for("k1", 0, [1, 0, 0, 1]), trajectories_for("k2", 0, [0, 1, 1, 1]))
        await wait_for_version(settings, 2, 1)
        first = services.processes["learner"]
        before = rank_pids(first)
        # Rank 1 dies while the next step's samples arrive: that step cannot be taken.
        await send(trajectories_for("k3", 1, [1, 0]))
        os.kill(before[1], signal.SIGKILL)
        await send(trajectories_for("k4", 1, [0, 1]))
        # The group is started again; it announces the last checkpoint's version, then takes the step.
        got = await policies(settings, 4)
        assert [p.version for p in got] == [0, 1, 1, 2], [p.version for p in got]
        assert first.returncode not in (None, 0) and services.restarts == {"learner": 1}
        after = rank_pids(services.processes["learner"])
        assert sorted(after) == [0, 1] and not set(after.values()) & set(before.values())
        await send(trajectories_for("k5", 2, [1, 0]), trajectories_for("k6", 2, [0, 1]))
        await wait_for_version(settings, 5, 3)
    finally:
        supervisor.cancel()
        services.stop(timeout=30)
    steps = trained(settings)
    assert [v for v, _ in steps] == [1, 2, 3]
    ids = [i for _, samples in steps for i in samples]
    assert len(ids) == len(set(ids))  # nothing trained twice
    assert sorted(ids) == sorted(published)  # nothing lost


@pytest.mark.kafka
@pytest.mark.store
async def test_a_learner_across_two_machines_steps_together_and_each_pod_is_ready(stack_settings, tmp_path):
    """The k8s layout (k8s/services.yaml): one torchrun per machine, node rank = pod index, rendezvous at
    node 0. Here two "machines" of one rank each on this host: node 1's rank answers gRPC health on its
    own learner port (its pod's readiness) and takes each step with rank 0."""
    settings = service_settings(stack_settings, tmp_path)
    master, *ports = free_ports(3)
    launchers = []
    for node in (0, 1):
        env = {**learner_env(settings, 1), "CRUCIBLE_LEARNER_GRPC_PORT": str(ports[node])}
        args = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={master}", "--max-restarts=0",
                "-m", "crucible.services.learner"]
        with open(tmp_path / f"node{node}.log", "ab") as out:
            launchers.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
    try:
        await wait_for_version(settings, 1, 0)
        assert await rpc.health_status(f"127.0.0.1:{ports[1]}") == "SERVING"
        await publish(settings, trajectories_for("m1", 0, [1, 0, 0, 1]) + trajectories_for("m2", 0, [0, 1, 1, 1]))
        await wait_for_version(settings, 2, 1)
    finally:
        stop_processes(launchers, timeout=30)
    log = (tmp_path / "node1.log").read_text()
    assert "rank 1 stopped with rank 0 at version 1" in log, log[-3000:]
