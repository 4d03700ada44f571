"""Weights beyond one filesystem: content hashes, fetching from fsspec URIs, and the generator refusing
versions it must not load (older, tampered, another run's), each dead-lettered once with its reason."""
from __future__ import annotations

import asyncio
import shutil
import uuid

import fsspec
import pytest
from aiokafka import AIOKafkaConsumer

from crucible.ml.policy import transfer
from crucible.ml.policy.backends import create_backend
from crucible.ml.policy.checkpoint import fresh_policy, save_checkpoint
from crucible.ml.policy.sampling import SamplingParams
from crucible.services.generator.__main__ import run
from crucible.services.generator.batcher import Batcher, LagBound
from crucible.shared import bus, messages, rpc
from crucible.shared.procs import free_port
from crucible.v1 import generator_pb2, generator_pb2_grpc, policy_pb2, rollout_pb2, task_pb2
from tests.test_bus import read_raw
from tests.test_generator import LOGPROB_TOLERANCE, recompute


def checkpoint(folder, seed: int = 3, version: int = 1):
    """A real checkpoint folder, with optimizer state beside it as the learner writes it."""
    save_checkpoint(fresh_policy(seed), folder, {"version": version}, extra={"optimizer.pt": {"state": {}}})
    return folder


def flip_one_byte(path, at: int = 1000) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


# --- content_hash, fetch, publish ---------------------------------------------------------------

def test_content_hash_follows_the_bytes_not_the_place(tmp_path):
    folder = checkpoint(tmp_path / "a" / "v000001")
    digest = transfer.content_hash(folder)
    assert len(digest) == 64 and transfer.content_hash(folder.as_uri()) == digest
    copy = shutil.copytree(folder, tmp_path / "elsewhere" / "other-name")
    assert transfer.content_hash(copy) == digest  # same files, another folder
    flip_one_byte(copy / "model.safetensors")
    assert transfer.content_hash(copy) != digest  # one byte of the weights
    copy2 = shutil.copytree(folder, tmp_path / "c")
    (copy2 / "config.json").rename(copy2 / "config2.json")
    assert transfer.content_hash(copy2) != digest  # names count too
    copy3 = shutil.copytree(folder, tmp_path / "d")
    (copy3 / "extra.bin").write_bytes(b"")
    assert transfer.content_hash(copy3) != digest  # an added (even empty) file
    # The learner's optimizer state is neither read by a generator nor hashed.
    (copy3 / "extra.bin").unlink()
    (copy3 / "optimizer.pt").write_bytes(b"anything")
    (copy3 / "optimizer").mkdir()  # FSDP's shards
    (copy3 / "optimizer" / "__0_0.distcp").write_bytes(b"a shard")
    assert transfer.content_hash(copy3) == digest
    (copy3 / "optimizers.pt").write_bytes(b"")  # a name that only starts like it counts
    assert transfer.content_hash(copy3) != digest
    with pytest.raises(FileNotFoundError):
        transfer.content_hash(tmp_path / "missing")


def test_a_later_version_is_copied_into_the_sampling_model_in_place(tmp_path):
    """The torch backend copies a new version of the same policy into the model it holds (nothing
    built and initialised twice); a policy of another shape is built anew; a broken one changes nothing."""
    import torch

    from crucible.ml.policy.model import PolicyConfig

    backend = create_backend("torch", checkpoint=str(checkpoint(tmp_path / "v1", seed=1)))
    model = backend.model
    backend.load_weights(2, str(checkpoint(tmp_path / "v2", seed=2)))
    assert backend.model is model and backend.version == 2
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh_policy(2).state_dict().values()))
    other = PolicyConfig(hidden_size=64, intermediate_size=128)
    save_checkpoint(fresh_policy(4, other), tmp_path / "v3", {"version": 3})
    backend.load_weights(3, str(tmp_path / "v3"))
    assert backend.model is not model and backend.model.config == other and backend.version == 3
    broken = shutil.copytree(tmp_path / "v3", tmp_path / "v4")  # the shape held: copied in place
    (broken / "model.safetensors").write_bytes(b"not weights")
    kept = backend.model
    with pytest.raises(Exception):
        backend.load_weights(4, str(broken))
    assert backend.model is kept and backend.version == 3


def test_fetch_from_memory_uri_gives_a_local_folder_with_the_same_hash(tmp_path):
    folder = checkpoint(tmp_path / "v000002")
    digest = transfer.content_hash(folder)
    base = f"memory://ckpt-{uuid.uuid4().hex[:8]}/run"
    uri = transfer.publish(folder, base)
    assert uri == f"{base}/v000002"
    fs = fsspec.filesystem("memory")
    assert not fs.exists(f"{uri}/optimizer.pt") and fs.exists(f"{uri}/model.safetensors")

    cache = tmp_path / "cache"
    local = transfer.fetch(uri, cache, sha256=digest)
    assert local.is_dir() and local.parent == cache and local.name == digest
    assert transfer.content_hash(local) == digest
    assert transfer.verify(uri, digest, cache) == local
    # Fetched once: the cached copy is used without reading the remote again.
    fs.rm(uri, recursive=True)
    assert transfer.fetch(uri, cache, sha256=digest) == local
    # Local folders are used where they lie.
    assert transfer.fetch(folder.as_uri(), cache) == folder and transfer.fetch(str(folder), cache) == folder


def test_the_copies_a_learner_publishes_are_pruned_as_its_own_versions_are(tmp_path):
    """With checkpoint_base_uri set, every version's copy stayed in the bucket (8 versions, 8 copies,
    while the learner kept 3 of its own)."""
    from crucible.services.learner import checkpoints
    from crucible.services.learner.loop import policy_message
    from crucible.shared.settings import Settings

    base = f"memory://ckpt-{uuid.uuid4().hex[:8]}"
    settings = Settings(home=tmp_path, run_id="remote-run", learner_keep_checkpoints=2, checkpoint_base_uri=base)
    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"{base}/remote-run/README", b"not a version: left alone")
    for version in range(1, 6):
        folder = checkpoint(checkpoints.version_dir(settings, version), version=version)
        checkpoints.prune(settings)
        message = policy_message(settings, version, version, folder.as_uri(), None)
        assert message.checkpoint_uri == f"{base}/remote-run/v{version:06d}"
    names = sorted(p.rstrip("/").rsplit("/", 1)[1] for p in fs.ls(f"{base}/remote-run", detail=False))
    assert names == ["README", "v000004", "v000005"]
    assert names[1:] == sorted(p.name for p in checkpoints.checkpoints_dir(settings).iterdir())

    # storage that lets the learner write but not delete does not stop it: the version is announced
    class NoDelete(type(fs)):
        def rm(self, *args, **kwargs):
            raise PermissionError("delete not allowed")

    import crucible.ml.policy.transfer as transfer_module
    real = transfer_module._filesystem
    transfer_module._filesystem = lambda uri, options: (NoDelete(), real(uri, options)[1])
    try:
        folder = checkpoint(checkpoints.version_dir(settings, 6), version=6)
        checkpoints.prune(settings)
        assert policy_message(settings, 6, 6, folder.as_uri(), None).checkpoint_uri == f"{base}/remote-run/v000006"
    finally:
        transfer_module._filesystem = real


def test_verify_refuses_a_tampered_remote_checkpoint(tmp_path):
    folder = checkpoint(tmp_path / "v000003")
    digest = transfer.content_hash(folder)
    uri = transfer.publish(folder, f"memory://ckpt-{uuid.uuid4().hex[:8]}")
    fs = fsspec.filesystem("memory")
    data = bytearray(fs.cat_file(f"{uri}/model.safetensors"))
    data[-1] ^= 0xFF
    fs.pipe_file(f"{uri}/model.safetensors", bytes(data))
    with pytest.raises(transfer.ChecksumMismatch, match="does not match its checkpoint_sha256"):
        transfer.verify(uri, digest, tmp_path / "cache")
    assert not (tmp_path / "cache" / digest).exists()  # nothing unverified is left to be used
    with pytest.raises(FileNotFoundError):
        transfer.verify(f"memory://nowhere-{uuid.uuid4().hex[:8]}/v1", digest, tmp_path / "cache")


# --- the batcher: checked beside sampling, swapped between batches --------------------------------

async def test_batcher_falls_back_to_an_older_offer_when_the_newer_is_refused(tmp_path):
    backend = create_backend("torch", seed=1)
    batcher = Batcher(backend, max_tasks=1, wait_ms=0, lag=LagBound(max_lag=-1, groups_per_step=1))
    batcher.start()
    release = asyncio.Event()
    good = checkpoint(tmp_path / "v000005", seed=5, version=5)

    async def refuse():
        await release.wait()
        raise transfer.ChecksumMismatch("tampered")

    async def accept():
        return str(good)

    try:
        params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=2)
        assert batcher.offer_weights(6, "memory://x/v6", refuse)
        assert batcher.offer_weights(5, good.as_uri(), accept)  # kept while 6 is being checked
        assert not batcher.offer_weights(6, "memory://x/v6", refuse)  # offered before
        _, version, _ = await asyncio.wait_for(batcher.sample("a", 1, params), 10)
        assert version == 0  # sampling goes on while 6 is checked
        release.set()
        for _ in range(100):
            _, version, _ = await asyncio.wait_for(batcher.sample("b", 1, params), 10)
            if version == 5:
                break
            await asyncio.sleep(0.05)
        assert version == 5 and batcher.newest_version == 5
        assert not batcher.offer_weights(4, str(good), accept) and not batcher.offer_weights(5, str(good), accept)
    finally:
        await batcher.stop()


# --- the generator against the real broker ------------------------------------------------------

kafka = pytest.mark.kafka


def task(task_id: str) -> task_pb2.Task:
    return task_pb2.Task(id=task_id, kind="exact", prompt="Add: 3+4=", group_size=2,
                         answer=task_pb2.ExpectedAnswer(answer="7"))


def generator_settings(settings):
    # top_p 1, as every per-token log-prob comparison samples (see tests/test_hf_policy.py): under a
    # nucleus cut, a token on its edge can fall on the other side of it when the log-probs are
    # recomputed, and that position's log-prob jumps. What these tests compare is which weights sampled.
    return settings.model_copy(update={"generator_grpc_port": free_port(), "seed": 11, "max_tokens": 8,
                                       "temperature": 0.7, "top_p": 1.0, "generator_batch_wait_ms": 5.0,
                                       "run_id": "run-a", "max_policy_lag": -1})


async def start_generator(settings):
    stop = asyncio.Event()
    service = asyncio.create_task(run(settings, stop))
    await rpc.wait_serving(f"127.0.0.1:{settings.generator_grpc_port}", "crucible.v1.Generator", timeout=60)
    return stop, service


def announce(settings, folder, version: int, run_id: str | None = None, sha256: str | None = None):
    return policy_pb2.PolicyVersion(run_id=run_id or settings.run_id, version=version,
                                    checkpoint_uri=folder.as_uri(),
                                    checkpoint_sha256=sha256 or transfer.content_hash(folder))


class Rollouts:
    """Follows crucible.rollouts from the start; `sample` publishes one task and waits for its group."""

    def __init__(self, settings):
        self.settings = settings
        self.consumer = AIOKafkaConsumer(settings.topic("rollouts"), bootstrap_servers=settings.kafka_bootstrap,
                                         auto_offset_reset="earliest", enable_auto_commit=False)
        self.groups: dict[str, rollout_pb2.RolloutGroup] = {}

    async def __aenter__(self):
        await self.consumer.start()
        return self

    async def __aexit__(self, *exc):
        await self.consumer.stop()

    async def sample(self, producer, task_id: str, timeout: float = 60) -> rollout_pb2.RolloutGroup:
        await producer.send_and_wait("tasks", task(task_id), key=task_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while task_id not in self.groups:
            assert loop.time() < deadline, f"no group for task {task_id}"
            for batch in (await self.consumer.getmany(timeout_ms=500)).values():
                for r in batch:
                    g = messages.decode(r.value, rollout_pb2.RolloutGroup)
                    self.groups[g.task.id] = g
        return self.groups[task_id]


async def all_records(settings, topic: str, at_least: int, settle_s: float = 2.0, timeout: float = 60):
    """Every record of the topic once at least `at_least` are there and no more arrive for a while."""
    records = await read_raw(settings, topic, at_least, timeout=timeout)
    await asyncio.sleep(settle_s)
    try:
        return await read_raw(settings, topic, len(records) + 1, timeout=settle_s)
    except asyncio.TimeoutError:
        return records


def reasons(records) -> list[str]:
    return [dict(r.headers)["dlq-reason"].decode() for r in records]


def matches(model, group) -> bool:
    return all(max(abs(a - b) for a, b in zip(recompute(model, group, r), r.logprobs)) < LOGPROB_TOLERANCE
               for r in group.rollouts)


@kafka
async def test_generator_refuses_bad_versions_and_swaps_in_a_good_one(settings, tmp_path):
    settings = generator_settings(settings)
    await bus.ensure_topics(["tasks", "rollouts", "policy"], settings=settings)
    good = checkpoint(tmp_path / "ckpt" / "v000005", seed=99, version=5)
    older = checkpoint(tmp_path / "ckpt" / "v000003", seed=98, version=3)
    tampered = checkpoint(tmp_path / "ckpt" / "v000006", seed=97, version=6)
    tampered_sha = transfer.content_hash(tampered)
    flip_one_byte(tampered / "model.safetensors")  # after the learner hashed it
    other_run = checkpoint(tmp_path / "other" / "v000007", seed=96, version=7)
    initial = fresh_policy(11)  # the generator's weights: seed 11, version 0

    stop, service = await start_generator(settings)
    try:
        async with bus.Producer(settings) as producer, Rollouts(settings) as rollouts:
            await producer.send_and_wait("policy", announce(settings, other_run, 7, run_id="run-b"))
            await producer.send_and_wait("policy", announce(settings, tampered, 6, sha256=tampered_sha))
            dead = await read_raw(settings, "policy.dlq", 2, timeout=60)
            assert "belongs to run 'run-b', not to this generator's run 'run-a'" in reasons(dead)[0]
            assert "does not match its checkpoint_sha256" in reasons(dead)[1] and tampered_sha in reasons(dead)[1]
            # Still sampling, with the weights it had.
            g = await rollouts.sample(producer, "before")
            assert g.policy_version == 0 and matches(initial, g)

            await producer.send_and_wait("policy", announce(settings, good, 5))
            for i in range(60):  # checked beside sampling, swapped in between batches
                g = await rollouts.sample(producer, f"after-{i}")
                if g.policy_version == 5:
                    break
                await asyncio.sleep(0.5)
            assert g.policy_version == 5 and matches(fresh_policy(99), g) and not matches(initial, g)

            await producer.send_and_wait("policy", announce(settings, older, 3))
            dead = await all_records(settings, "policy.dlq", 3)
            assert len(dead) == 3, reasons(dead)  # the good version was not dead-lettered
            assert "policy version 3 is not newer than version 5" in reasons(dead)[2]
            assert all(d.headers and dict(d.headers)["dlq-source"].decode().startswith(settings.topic("policy"))
                       for d in dead)
            g = await rollouts.sample(producer, "after-older")
            assert g.policy_version == 5 and matches(fresh_policy(99), g)
    finally:
        stop.set()
        await asyncio.wait_for(service, 30)


@kafka
async def test_a_refused_version_is_dead_lettered_once_whatever_the_number_of_generators(settings, tmp_path):
    """Every generator reads every version; only the one holding the shared judge group's partition
    writes the DLQ. Both refuse the bad version and both load the good one."""
    first = generator_settings(settings)
    second = first.model_copy(update={"generator_grpc_port": free_port()})
    await bus.ensure_topics(["tasks", "rollouts", "policy"], settings=first)
    good = checkpoint(tmp_path / "v000002", seed=99, version=2)
    tampered = checkpoint(tmp_path / "v000004", seed=97, version=4)
    tampered_sha = transfer.content_hash(tampered)
    flip_one_byte(tampered / "config.json", at=5)
    generators = [await start_generator(first), await start_generator(second)]
    try:
        async with bus.Producer(first) as producer:
            await producer.send_and_wait("policy", announce(first, tampered, 4, sha256=tampered_sha))
            await producer.send_and_wait("policy", announce(first, good, 2))
            await producer.send_and_wait("policy", announce(first, good, 2, run_id="run-b"))
            dead = await all_records(first, "policy.dlq", 2, settle_s=4.0)
            assert len(dead) == 2, reasons(dead)
            assert "does not match" in reasons(dead)[0] and "belongs to run 'run-b'" in reasons(dead)[1]
            # Both generators load the good version 2 (asked directly: a gRPC Generate on each).
            for s in (first, second):
                async with rpc.channel(f"127.0.0.1:{s.generator_grpc_port}") as ch:
                    stub = generator_pb2_grpc.GeneratorStub(ch)
                    for _ in range(120):
                        reply = await stub.Generate(generator_pb2.GenerateRequest(task=task("ask"), n=1), timeout=30)
                        if reply.group.policy_version == 2:
                            break
                        await asyncio.sleep(0.5)
                    assert reply.group.policy_version == 2
    finally:
        for stop, _ in generators:
            stop.set()
        for _, service in generators:
            await asyncio.wait_for(service, 30)
