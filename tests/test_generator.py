"""The generator against a real Kafka broker: groups, log-probs, weight hot-swap, bad tasks, gRPC."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from aiokafka import AIOKafkaProducer

from crucible.services.control.__main__ import run as control_run
from crucible.ml.policy import transfer
from crucible.shared import store
from crucible.v1 import generator_pb2, generator_pb2_grpc, policy_pb2, rollout_pb2, task_pb2
from crucible.services.generator.__main__ import run
from crucible.shared import bus, messages, rpc
from crucible.shared.procs import free_port
from crucible.ml.policy.checkpoint import fresh_policy, save_checkpoint
from crucible.ml.policy.model import sequence_logprobs
from tests.bus_helpers import publish_unsigned
from tests.test_bus import read_raw

pytestmark = pytest.mark.kafka

# Sampling and recomputation run the same float32 kernels on the same weights; the only
# differences are padding and KV-cache summation order, far below this bound.
LOGPROB_TOLERANCE = 1e-4


def recompute(model, group: rollout_pb2.RolloutGroup, rollout: rollout_pb2.Rollout) -> list[float]:
    """The learner's view: log-probs at the temperature and top_p the group records."""
    ids = torch.tensor([list(group.prompt_token_ids) + list(rollout.token_ids)])
    logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids, dtype=torch.bool), group.temperature, group.top_p)
    return logp[0, len(group.prompt_token_ids) - 1:].tolist()


def task(task_id: str, group_size: int = 4, prompt: str = "Add: 3+4=") -> task_pb2.Task:
    return task_pb2.Task(id=task_id, kind="exact", prompt=prompt, group_size=group_size,
                         answer=task_pb2.ExpectedAnswer(answer="7"))


@pytest.fixture
async def generator(settings):
    settings = settings.model_copy(update={"generator_grpc_port": free_port(), "seed": 11, "max_tokens": 12,
                                           "temperature": 0.7, "top_p": 1.0, "generator_batch_wait_ms": 5.0})
    await bus.ensure_topics(["tasks", "rollouts", "policy"], settings=settings)
    stop = asyncio.Event()
    service = asyncio.create_task(run(settings, stop))
    await rpc.wait_serving(f"127.0.0.1:{settings.generator_grpc_port}", "crucible.v1.Generator", timeout=60)
    yield settings
    stop.set()
    await asyncio.wait_for(service, 30)


async def test_task_yields_exactly_group_size_rollouts_with_matching_logprobs(generator):
    settings = generator
    async with bus.Producer(settings) as producer:
        await producer.send_and_wait("tasks", task("t1", group_size=5), key="t1")
        await producer.send_and_wait("tasks", task("t2", group_size=3, prompt="Add: 1+1="), key="t2")
    records = await read_raw(settings, "rollouts", 2, timeout=60)
    groups = {g.task.id: g for g in (messages.decode(r.value, rollout_pb2.RolloutGroup) for r in records)}
    assert {k: len(g.rollouts) for k, g in groups.items()} == {"t1": 5, "t2": 3}  # one message per group
    assert [r.sample_index for r in groups["t1"].rollouts] == list(range(5))
    model = fresh_policy(11)  # the generator's weights: same seed, fresh init
    for g in groups.values():
        assert g.policy_version == 0 and g.backend == "torch"
        assert g.temperature == pytest.approx(0.7) and g.top_p == pytest.approx(1.0)
        for r in g.rollouts:
            assert len(r.token_ids) == len(r.logprobs) >= 1
            assert max(abs(a - b) for a, b in zip(recompute(model, g, r), r.logprobs)) < LOGPROB_TOLERANCE
    # Nothing beyond the groups was produced.
    await asyncio.sleep(0.5)
    assert len(await read_raw(settings, "rollouts", 2, timeout=5)) == 2


async def test_policy_version_event_swaps_weights(generator, tmp_path):
    settings = generator
    new_model = fresh_policy(99)
    uri = save_checkpoint(new_model, tmp_path / "v7", {"version": 7}).as_uri()
    # A version nobody holding the key published (a real checkpoint, a huge number) is refused and
    # does not hold back the learner's real ones.
    old_uri = save_checkpoint(fresh_policy(3), tmp_path / "v0", {"version": 0}).as_uri()
    forged = policy_pb2.PolicyVersion(run_id=settings.run_id, version=1_000_000, checkpoint_uri=old_uri,
                                      checkpoint_sha256=transfer.content_hash(tmp_path / "v0"))
    raw = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap)
    await raw.start()
    try:
        await raw.send_and_wait(settings.topic("policy"), forged.SerializeToString())
    finally:
        await raw.stop()
    dead = await read_raw(settings, "policy.dlq", 1, timeout=30)
    assert "not signed by the run's learner" in dict(dead[0].headers)["dlq-reason"].decode()
    async with bus.Producer(settings) as producer:
        await producer.send_and_wait("policy", policy_pb2.PolicyVersion(
            run_id=settings.run_id, version=7, checkpoint_uri=uri,
            checkpoint_sha256=transfer.content_hash(tmp_path / "v7")))
        await asyncio.sleep(1.0)  # the policy consumer records it; the swap happens before the next batch
        await producer.send_and_wait("tasks", task("after-swap", group_size=3), key="after-swap")
    records = await read_raw(settings, "rollouts", 1, timeout=60)
    g = messages.decode(records[0].value, rollout_pb2.RolloutGroup)
    old_model = fresh_policy(11)
    assert g.policy_version == 7 and len(g.rollouts) == 3
    for r in g.rollouts:
        assert max(abs(a - b) for a, b in zip(recompute(new_model, g, r), r.logprobs)) < LOGPROB_TOLERANCE
        assert max(abs(a - b) for a, b in zip(recompute(old_model, g, r), r.logprobs)) > 1e-3


@pytest.mark.parametrize("bad,reason", [
    (task_pb2.Task(id="no-prompt", kind="exact", group_size=2, answer=task_pb2.ExpectedAnswer(answer="1")),
     "prompt is empty"),
    (task_pb2.Task(id="zero", kind="exact", prompt="p", group_size=0, answer=task_pb2.ExpectedAnswer(answer="1")),
     "group_size must be at least 1"),
    (task_pb2.Task(id="huge", kind="exact", prompt="p", group_size=100_000,
                   answer=task_pb2.ExpectedAnswer(answer="1")), "above the limit"),
    (task_pb2.Task(id="odd", kind="poetry", prompt="p", group_size=2), "unknown kind 'poetry'"),
    (task_pb2.Task(id="held", kind="exact", prompt="p", group_size=2, split="heldout",
                   answer=task_pb2.ExpectedAnswer(answer="1")), "is held out"),
    (task_pb2.Task(id="long", kind="exact", prompt="x" * 600, group_size=2, metadata={"prompt_format": "raw"},
                   answer=task_pb2.ExpectedAnswer(answer="1")), "passes the model's context of 512"),
])
async def test_bad_tasks_land_in_dlq_with_reason(generator, bad, reason):
    settings = generator
    async with bus.Producer(settings) as producer:
        await producer.send_and_wait("tasks", bad)
        await producer.send_and_wait("tasks", task("fine", group_size=1))
    dead = await read_raw(settings, "tasks.dlq", 1, timeout=30)
    assert reason in dict(dead[0].headers)["dlq-reason"].decode()
    # ...and the generator went on to the next task.
    ok = await read_raw(settings, "rollouts", 1, timeout=60)
    assert messages.decode(ok[0].value, rollout_pb2.RolloutGroup).task.id == "fine"


async def test_grpc_generate_and_invalid_argument(generator):
    settings = generator
    async with rpc.channel(f"127.0.0.1:{settings.generator_grpc_port}") as ch:
        stub = generator_pb2_grpc.GeneratorStub(ch)
        reply = await stub.Generate(generator_pb2.GenerateRequest(
            task=task("interactive", group_size=2), n=3,
            sampling=generator_pb2.SamplingParams(temperature=0.0, max_tokens=5)), timeout=30)
        assert len(reply.group.rollouts) == 3 and reply.group.temperature == 0.0
        assert all(len(r.token_ids) <= 5 for r in reply.group.rollouts)
        # Greedy decoding: every sample is the same.
        assert len({tuple(r.token_ids) for r in reply.group.rollouts}) == 1
        for request, reason in [
            (generator_pb2.GenerateRequest(task=task("x", group_size=0)), "group_size must be at least 1"),
            (generator_pb2.GenerateRequest(task=task("x"), sampling=generator_pb2.SamplingParams(top_p=2.0)),
             "top_p"),
            (generator_pb2.GenerateRequest(task=task("x"), sampling=generator_pb2.SamplingParams(max_tokens=10**6)),
             "max_tokens"),
            # each stop string is compared with every completion at every token (20,000 made a call 5x slower);
            # "" ended every completion at its first token
            (generator_pb2.GenerateRequest(task=task("x"), sampling=generator_pb2.SamplingParams(
                stop=[f"s{i}" for i in range(20_000)])), "20000 stop strings"),
            (generator_pb2.GenerateRequest(task=task("x"), sampling=generator_pb2.SamplingParams(stop=[""])),
             "stop string of 0 characters"),
            (generator_pb2.GenerateRequest(task=task("x"), sampling=generator_pb2.SamplingParams(stop=["x" * 10**6])),
             "stop string of 1000000 characters"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in err.value.details()


@pytest.mark.store
async def test_a_bad_task_is_dead_lettered_once_with_the_task_log_running(generator, store_url, store_database):
    """Two consumers read crucible.tasks (the generator and control's task log); only the generator
    decides whether a task is acceptable, so a bad task reaches the DLQ exactly once."""
    settings = generator.model_copy(update={"clickhouse_url": store_url, "clickhouse_database": store_database,
                                            "control_grpc_port": free_port()})
    stop = asyncio.Event()
    control = asyncio.create_task(control_run(settings, stop))
    try:
        async with bus.Producer(settings) as producer:
            await producer.send_and_wait("tasks", task_pb2.Task(id="bad", kind="exact", prompt="p", group_size=2))
            raw = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap)
            await raw.start()
            await raw.send_and_wait(settings.topic("tasks"), b'{"id": "typo", "kind": "exact", "group_sizee": 2}',
                                    headers=[("content-type", b"application/json")])
            await raw.stop()
            # A task nobody holding the key published: not logged either (the log is what `crucible
            # rescore --grade-as` signs anew: a forged row there was graded, and paid, as a trusted task).
            await publish_unsigned(settings, "tasks", task("forged", group_size=1), b"forged")
            await producer.send_and_wait("tasks", task("good", group_size=1))
        await read_raw(settings, "rollouts", 1, timeout=60)
        client = store.connect(settings)
        store.migrate(client)  # idempotent: the table exists whichever of us migrates first
        logged = f"SELECT task_id FROM {store.TASKS_TABLE} FINAL ORDER BY task_id"
        for _ in range(100):  # the task log has caught up with both records
            if len(client.query(logged).result_rows) >= 2:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)
        assert client.query(logged).result_rows == [("bad",), ("good",)]
        dead = await read_raw(settings, "tasks.dlq", 3, timeout=10)
        reasons = sorted(dict(d.headers)["dlq-reason"].decode() for d in dead)
        for said in ("needs a 'answer' payload", "JSON does not match", "not signed by a trusted submitter"):
            assert sum(said in r for r in reasons) == 1, (said, reasons)
        with pytest.raises(asyncio.TimeoutError):  # and nothing else: each bad record once
            await read_raw(settings, "tasks.dlq", 4, timeout=3)
    finally:
        stop.set()
        await asyncio.wait_for(control, 30)


async def test_records_nobody_trusted_or_nobody_can_decode_are_dead_lettered_and_the_partition_moves_on(generator):
    settings = generator
    raw = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap)
    await raw.start()
    try:
        for value in (b'{"id": "unsigned", "kind": "exact", "prompt": "p", "group_size": 1, "answer": {"answer": "1"}}',
                      b'{"metadata": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
                      b'{"id": ' + b'{"a": ' * 20_000 + b"1" + b"}" * 20_001):
            await raw.send_and_wait(settings.topic("tasks"), value, headers=[("content-type", b"application/json")])
    finally:
        await raw.stop()
    async with bus.Producer(settings) as producer:
        await producer.send_and_wait("tasks", task("after-the-poison", group_size=1))
    reasons = [dict(r.headers)["dlq-reason"].decode() for r in await read_raw(settings, "tasks.dlq", 3, timeout=30)]
    assert "not signed by a trusted submitter" in reasons[0], reasons
    assert all("undecodable" in r for r in reasons[1:]), reasons
    ok = await read_raw(settings, "rollouts", 1, timeout=60)
    assert messages.decode(ok[0].value, rollout_pb2.RolloutGroup).task.id == "after-the-poison"


def test_torch_services_share_the_cores():
    """On one machine the generator and evaluator take half the cores for their OpenMP threads and the
    learner the other half (torch's default, one a core each in every process, oversubscribes the
    CPU); at least one each; an operator's own setting stands, and other services are left alone."""
    from crucible.local.services import torch_threads

    assert torch_threads("generator", {}, cores=2) == {"OMP_NUM_THREADS": "1"}
    assert torch_threads("evaluator", {}, cores=16) == {"OMP_NUM_THREADS": "8"}
    assert torch_threads("generator", {}, cores=1) == {"OMP_NUM_THREADS": "1"}
    assert torch_threads("learner", {}, cores=2) == {"OMP_NUM_THREADS": "1"}
    assert torch_threads("learner", {}, cores=5) == {"OMP_NUM_THREADS": "3"}
    assert torch_threads("learner", {}, cores=1) == {"OMP_NUM_THREADS": "1"}
    assert torch_threads("learner", {"OMP_NUM_THREADS": "2"}, cores=2) == {}
    assert torch_threads("verifier", {}, cores=2) == {}
    assert torch_threads("generator", {"OMP_NUM_THREADS": "3"}, cores=2) == {}


def test_background_services_yield_the_cpu():
    """The evaluator, whose work no policy step waits for, starts below normal CPU priority on one
    machine (an operator's own setting stands; services on a step's path are left alone), and the
    priority holds for every thread the service starts afterwards, not its first thread alone."""
    import os
    import subprocess
    import sys

    from crucible.local.services import cpu_priority

    assert cpu_priority("evaluator", {}) == {"CRUCIBLE_CPU_NICE": "15"}
    assert cpu_priority("evaluator", {"CRUCIBLE_CPU_NICE": "3"}) == {}
    for name in ("generator", "learner", "verifier", "reward_aggregator", "sandbox_executor", "control"):
        assert cpu_priority(name, {}) == {}

    probe = ("import os, threading\n"
             "from crucible.shared import service\n"
             "service.setup('probe')\n"
             "seen = []\n"
             "t = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, 0)))\n"
             "t.start(); t.join()\n"
             "print(os.getpriority(os.PRIO_PROCESS, 0), seen[0])\n")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    env = {**os.environ, "CRUCIBLE_CPU_NICE": "7", "CRUCIBLE_METRICS_PORT": "0"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    main, thread = map(int, out.stdout.split()[-2:])
    assert main == thread == min(base + 7, 19), out.stdout
    bad = subprocess.run([sys.executable, "-c", probe], env={**env, "CRUCIBLE_CPU_NICE": "-5"},
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "cpu_nice" in bad.stderr, bad.stderr[-2000:]


def test_service_processes_collect_young_objects_less_often():
    """Every service's process runs with the collector's youngest generation at GC_YOUNG_THRESHOLD (a
    consumer's fetched batch is not traversed again and again while it is handled), not CPython's 700."""
    import os
    import subprocess
    import sys

    from crucible.shared import service

    probe = "import gc\nfrom crucible.shared import service\nservice.setup('probe')\nprint(*gc.get_threshold())\n"
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "CRUCIBLE_METRICS_PORT": "0"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    young, *older = map(int, out.stdout.split()[-3:])
    assert young == service.GC_YOUNG_THRESHOLD > 700 and older == [10, 10], out.stdout
