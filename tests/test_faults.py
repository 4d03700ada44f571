"""Faults during a real run: services killed with SIGKILL one after another while `crucible train`
runs the built-in job over real Kafka; the run restarts each and finishes its budget, and the
bookkeeping holds: every stored group has all its samples (FINAL), and the policy versions have no gap.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from crucible.cli import recipe as recipes
from crucible.cli.train import resumable, train
from crucible.local.services import SERVICES, recorded
from crucible.shared import rpc, store
from crucible.shared.procs import free_ports

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.store, pytest.mark.sandbox]
VICTIMS = ("generator", "verifier", "sandbox_executor", "learner", "reward_aggregator")


def service_pid(name: str, home) -> int | None:
    for proc in psutil.process_iter(["cmdline", "environ"]):
        try:
            cmdline = proc.info["cmdline"] or []
            if f"crucible.services.{name}" in cmdline and (proc.info["environ"] or {}).get("CRUCIBLE_HOME") == str(home):
                return proc.pid
        except (psutil.Error, TypeError):
            continue
    return None


@pytest.fixture
def own_stack(tmp_path, stack_settings):
    """A broker and a store of this test's own, which it may stop and start again (the session's are shared)."""
    from crucible.local.kafka import LocalKafka
    from tests.fixtures_store import StoreProcess, external_clickhouse_url

    if external_clickhouse_url() or os.environ.get("CRUCIBLE_TEST_KAFKA_BOOTSTRAP"):
        pytest.skip("restarts its own broker and store")
    port, controller_port = free_ports(2)
    broker = LocalKafka(tmp_path / "kafka", port=port, controller_port=controller_port, heap="512m",
                        settings=stack_settings)
    broker.start(echo=lambda *_: None)
    data = tmp_path / "store" / "data"
    holder = {"store": StoreProcess(data).wait_ready()}
    port = holder["store"].port

    def restart_broker(down_s: float) -> None:
        broker.stop()
        time.sleep(down_s)
        broker.start(echo=lambda *_: None)

    def restart_store(down_s: float) -> None:
        holder["store"].stop()
        time.sleep(down_s)
        holder["store"] = StoreProcess(data, port=port).wait_ready()

    settings = stack_settings.model_copy(update={"kafka_bootstrap": broker.bootstrap,
                                                 "clickhouse_url": holder["store"].url, "home": tmp_path / "home"})
    try:
        yield settings, restart_broker, restart_store
    finally:
        holder["store"].stop()
        broker.stop()


@pytest.mark.timeout(1200)
async def test_a_run_survives_its_services_being_killed_and_its_broker_and_store_restarted(own_stack):
    settings, restart_broker, restart_store = own_stack
    home = settings.home
    recipe = recipes.builtin()
    recipe.budget.steps, recipe.budget.minutes = 40, 16
    lines: list[str] = []
    stamps: list[float] = []  # when each line was printed
    killed: list[tuple[str, int, float]] = []

    def echo(line: str) -> None:
        lines.append(line)
        stamps.append(time.monotonic())

    def steps() -> int:
        return sum(1 for line in lines if line.lstrip().startswith("step "))

    ready: dict[str, float] = {}  # service -> seconds from SIGKILL until its new process serves

    async def back(name: str, old_pid: int, at: float) -> None:
        """Waits for the new process: gRPC health SERVING, or (the aggregator) its `ready` log line."""
        log = next(home.glob(f"runs/*/logs/{name}.log"))
        readies = log.read_text(errors="replace").count("reward-aggregator ready")
        while (pid := service_pid(name, home)) in (None, old_pid):
            await asyncio.sleep(0.05)
        port_var = {"generator": "GENERATOR", "verifier": "VERIFIER", "sandbox_executor": "SANDBOX",
                    "learner": "LEARNER"}.get(name)
        if port_var:
            port = psutil.Process(pid).environ()[f"CRUCIBLE_{port_var}_GRPC_PORT"]
            await rpc.wait_serving(f"127.0.0.1:{port}", timeout=120)
        else:
            while log.read_text(errors="replace").count("reward-aggregator ready") <= readies:
                await asyncio.sleep(0.05)
        ready[name] = time.monotonic() - at

    watchers = []

    async def killer():
        for name in VICTIMS:
            while steps() < 5 * (len(killed) + 1):
                await asyncio.sleep(0.2)
            pid = service_pid(name, home)
            assert pid, f"no {name} process found"
            os.kill(pid, signal.SIGKILL)
            killed.append((name, steps(), time.monotonic()))
            watchers.append(asyncio.create_task(back(name, pid, killed[-1][2])))
        for name, restart in (("broker", restart_broker), ("store", restart_store)):
            while steps() < 5 * (len(killed) + 1):
                await asyncio.sleep(0.2)
            at = time.monotonic()
            await asyncio.to_thread(restart, 3.0)
            killed.append((name, steps(), at))

    chaos = asyncio.create_task(killer())
    try:
        report = await train(settings, recipe, echo=echo)
    finally:
        chaos.cancel()
    assert [name for name, _, _ in killed] == [*VICTIMS, "broker", "store"], (killed, lines[-20:])
    # time to recover: from each kill to the next policy step the run printed
    recovery = {name: next((t for line, t in zip(lines, stamps) if t > at and line.lstrip().startswith("step ")),
                           float("nan")) - at for name, _, at in killed}
    print("seconds from SIGKILL (or the restart's start) to the next policy step:",
          {k: round(v, 1) for k, v in recovery.items()})
    await asyncio.wait_for(asyncio.gather(*watchers), 60)
    print("seconds from SIGKILL until the new process serves:", {k: round(v, 1) for k, v in ready.items()})
    assert report.steps == recipe.budget.steps, lines[-30:]
    for name in VICTIMS:
        assert any(f"service {name} exited" in line and "starting it again" in line for line in lines), name

    client = store.connect(settings)
    run = {"r": report.run_id}
    partial = client.query("SELECT group_id, count() FROM trajectories FINAL WHERE run_id = {r:String} "
                           "GROUP BY group_id HAVING count() != 8", parameters=run).result_rows
    assert partial == [], partial
    groups = client.query("SELECT count(DISTINCT group_id) FROM trajectories FINAL WHERE run_id = {r:String}",
                          parameters=run).result_rows[0][0]
    assert groups >= recipe.budget.steps * 16
    versions = [v for (v,) in client.query("SELECT DISTINCT version FROM policy_versions FINAL "
                                           "WHERE run_id = {r:String} ORDER BY version", parameters=run).result_rows]
    assert versions == list(range(versions[0], versions[-1] + 1)) and versions[-1] >= recipe.budget.steps, versions
    assert_trained_once(client, report.run_id, recipe.budget.steps)


def assert_trained_once(client, run_id: str, steps: int) -> None:
    """Every step 1..steps has its row, and no sample id is in two steps' rows (FINAL: a step redone
    after a crash replaced its row)."""
    run = {"r": run_id}
    recorded = [s for (s,) in client.query("SELECT step FROM train_steps FINAL WHERE run_id = {r:String} "
                                           "ORDER BY step", parameters=run).result_rows]
    assert recorded == list(range(1, recorded[-1] + 1)) and recorded[-1] >= steps, recorded
    twice = client.query("SELECT id, count() AS n FROM (SELECT arrayJoin(samples) AS id FROM train_steps FINAL "
                         "WHERE run_id = {r:String}) GROUP BY id HAVING n > 1 LIMIT 5", parameters=run).result_rows
    if twice:
        where = client.query("SELECT step, policy_version FROM train_steps FINAL WHERE run_id = {r:String} AND "
                             "has(samples, {i:String}) ORDER BY step", parameters={**run, "i": twice[0][0]}).result_rows
        rows = client.query("SELECT policy_version, reward, created_at FROM trajectories WHERE run_id = {r:String} "
                            "AND concat(group_id, '/', toString(sample_index)) = {i:String}",
                            parameters={**run, "i": twice[0][0]}).result_rows
        raise AssertionError(f"trained twice: {twice}; {twice[0][0]} in steps {where}; stored as {rows}")
    trained = client.query("SELECT sum(length(samples)) FROM train_steps FINAL WHERE run_id = {r:String}",
                           parameters=run).result_rows[0][0]
    assert trained >= steps * 16 * 8, trained


@pytest.mark.timeout(600)
async def test_a_stopped_run_resumes_where_it_stopped(stack_settings, tmp_path):
    """Stopped after 3 steps (Ctrl-C), `crucible train --resume RUN` goes on to the budget: versions
    without a gap, no sample trained twice, the task feed past what was published before."""
    settings = stack_settings.model_copy(update={"home": tmp_path})
    recipe = recipes.builtin()
    recipe.budget.steps, recipe.budget.minutes = 6, 8
    lines: list[str] = []
    first = asyncio.create_task(train(settings, recipe, echo=lines.append))
    while sum(1 for line in lines if line.lstrip().startswith("step ")) < 3:
        assert not first.done(), lines[-20:]
        await asyncio.sleep(0.2)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    hint = [line for line in lines if "--resume" in line]
    assert hint, lines[-10:]
    run_id = hint[-1].split("--resume ")[1].strip()
    client = store.connect(settings)
    stopped_at = client.query("SELECT max(version) FROM policy_versions FINAL WHERE run_id = {r:String}",
                              parameters={"r": run_id}).result_rows[0][0]
    assert 3 <= stopped_at < 6

    resumed_lines: list[str] = []
    report = await train(settings, resumable(settings, run_id), echo=resumed_lines.append, resume=run_id)
    assert report.run_id == run_id and report.steps == 6, resumed_lines[-20:]
    assert any("training tasks were published before" in line for line in resumed_lines), resumed_lines[:5]
    versions = [v for (v,) in client.query("SELECT DISTINCT version FROM policy_versions FINAL "
                                           "WHERE run_id = {r:String} ORDER BY version",
                                           parameters={"r": run_id}).result_rows]
    assert versions == list(range(1, versions[-1] + 1)) and versions[-1] >= 6, versions
    assert_trained_once(client, run_id, 6)


@pytest.mark.timeout(300)
async def test_crucible_up_runs_every_service_and_starts_a_killed_one_again(stack_settings, tmp_path):
    s = stack_settings
    served = ("control", "sandbox", "verifier", "generator", "learner")
    ports = dict(zip(served, free_ports(len(served))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRUCIBLE_")}
    env.update({
        "CRUCIBLE_HOME": str(tmp_path), "CRUCIBLE_KAFKA_BOOTSTRAP": s.kafka_bootstrap,
        "CRUCIBLE_CLICKHOUSE_URL": s.clickhouse_url, "CRUCIBLE_CLICKHOUSE_DATABASE": s.clickhouse_database,
        "CRUCIBLE_TOPIC_PREFIX": s.topic_prefix, "CRUCIBLE_CONSUMER_GROUP_PREFIX": s.consumer_group_prefix,
        "CRUCIBLE_SANDBOX_WORKERS": "1", "CRUCIBLE_VERIFIER_SANDBOX_TARGET": f"127.0.0.1:{ports['sandbox']}",
        "CRUCIBLE_EVALUATOR_VERIFIER_TARGET": f"127.0.0.1:{ports['verifier']}",
        **{f"CRUCIBLE_{name.upper()}_GRPC_PORT": str(port) for name, port in ports.items()},
    })
    up = subprocess.Popen([sys.executable, "-m", "crucible.cli.main", "up"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    serving = {"verifier": "crucible.v1.Verifier", "sandbox": "crucible.v1.Sandbox"}
    try:
        for name, service in serving.items():
            await rpc.wait_serving(f"127.0.0.1:{ports[name]}", service, timeout=120)
        deadline = time.monotonic() + 60
        while len(recorded(tmp_path / "up")) < len(SERVICES):
            assert time.monotonic() < deadline and up.poll() is None, recorded(tmp_path / "up")
            await asyncio.sleep(0.2)
        before = recorded(tmp_path / "up")
        # `crucible status` lists them, with the gRPC health of those that serve it
        from crucible.cli.status import services_view

        (whose, listed), = services_view(s.model_copy(update={"home": tmp_path}))
        assert whose == "crucible up" and set(listed) == set(SERVICES), listed
        assert "gRPC SERVING" in listed["verifier"] and listed["reward_aggregator"].startswith("pid "), listed
        os.kill(before["verifier"], signal.SIGKILL)
        killed_at = time.monotonic()
        while recorded(tmp_path / "up").get("verifier") in (None, before["verifier"]):
            assert time.monotonic() - killed_at < 60, "the verifier was not started again"
            await asyncio.sleep(0.1)
        await rpc.wait_serving(f"127.0.0.1:{ports['verifier']}", serving["verifier"], timeout=60)
        print(f"verifier serving again {time.monotonic() - killed_at:.1f}s after SIGKILL")
        assert {k: v for k, v in recorded(tmp_path / "up").items() if k != "verifier"} == \
            {k: v for k, v in before.items() if k != "verifier"}  # the others were left alone
    finally:
        up.send_signal(signal.SIGTERM)
        out = up.communicate(timeout=60)[0].decode()
    assert up.returncode == 0, out[-2000:]
    assert "starting it again" in out and "stopping the services" in out, out[-2000:]
    assert recorded(tmp_path / "up") == {}, "services outlived crucible up"


@pytest.mark.timeout(400)
async def test_a_backlog_ten_times_the_sandbox_pools_capacity_drains_with_bounded_memory(stack_settings, tmp_path):
    """Ten times as many jobs as the pool holds (its workers plus its queue) wait on crucible.rollouts,
    each printing near a 1 MiB output cap: the sandbox-executor takes them as it has room (the consumer
    pauses while the pool is full), all are executed once, and its memory does not grow with the backlog."""
    from crucible.cli.recipe import Recipe
    from crucible.cli.train import Run
    from crucible.ml.kinds import builtin_sets
    from crucible.shared import bus, integrity
    from crucible.v1 import rollout_pb2

    settings = stack_settings.model_copy(update={"home": tmp_path})
    run = Run(settings, Recipe())
    s = run.settings
    workers, queue = 2, 8
    capacity = workers + queue
    await bus.ensure_topics(["rollouts", "executions", "actions", "observations", "episodes"], settings=s)
    run.start_services("", ())
    output = 1 << 20
    run.services.env.update(CRUCIBLE_SANDBOX_WORKERS=str(workers), CRUCIBLE_SANDBOX_QUEUE_SIZE=str(queue),
                            CRUCIBLE_SANDBOX_OUTPUT_BYTES=str(output))
    run.start_service("sandbox_executor")
    waves = [builtin_sets.humaneval(group_size=8)[:2], builtin_sets.humaneval(group_size=8)[2:2 + (10 * capacity + 7) // 8]]
    secret = integrity.key(s)
    filler = f"print('x' * {output - 4096})\n"  # near the output cap: results are not small
    sampler = psutil.Process(run.processes["sandbox_executor"].pid)

    async def drain(tasks) -> float:
        """Publishes a group of 8 jobs per task at once; the peak RSS while they are executed."""
        async with bus.Producer(s) as producer:
            for task in tasks:
                integrity.sign_task(task, secret)
                group = rollout_pb2.RolloutGroup(group_id=f"backlog-{task.id}", task=task, rollouts=[
                    rollout_pb2.Rollout(id=f"backlog-{task.id}/{i}", sample_index=i, completion=filler)
                    for i in range(8)])
                await producer.send("rollouts", group, key=group.group_id)
            await producer.flush()
        peak, executed, deadline = 0, {}, time.monotonic() + 300
        wanted = {f"backlog-{t.id}" for t in tasks}
        reader = bus.Reader(["executions"], None, settings=s, offsets={"executions": {}}, dead_letters=False)
        async with reader:
            while not wanted <= set(executed) and time.monotonic() < deadline:
                peak = max(peak, sampler.memory_info().rss)
                for incoming in await reader.fetch(timeout_ms=200):
                    execution = incoming.message
                    executed[execution.group.group_id] = executed.get(execution.group.group_id, 0) + 1
                    assert len(execution.results) == 8
        assert wanted <= set(executed) and all(executed[g] == 1 for g in wanted), executed
        return peak

    try:
        await rpc.wait_serving(run.sandbox_address, "crucible.v1.Sandbox", timeout=120)
        await asyncio.sleep(2)
        before = sampler.memory_info().rss
        small = (await drain(waves[0]) - before) / 2 ** 20
        large = (await drain(waves[1]) - before) / 2 ** 20
        jobs = len(waves[1]) * 8
        print(f"RSS growth: +{small:.0f} MB for {len(waves[0]) * 8} jobs, +{large:.0f} MB for {jobs} jobs "
              f"({jobs / capacity:.1f}x the pool's capacity of {capacity}; a MB of output each)")
        assert run.services.restarts == {}
        # Memory follows what the pool holds at once, not the backlog: the large wave's peak stays near the
        # small one's, where holding its results would take {jobs} MB more.
        assert large < 3 * small + 16 and large < 0.75 * jobs, (small, large)
    finally:
        run.stop_services()
