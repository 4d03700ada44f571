"""The learner over real Kafka and the real store: steps, stale samples, checkpoints and resume."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

from crucible.ml.policy.backends import create_backend
from crucible.ml.policy.checkpoint import fresh_policy, load_checkpoint
from crucible.ml.policy.sampling import SamplingParams
from crucible.services.learner import checkpoints
from crucible.services.learner.__main__ import run
from crucible.services.learner.trainer import Trainer
from crucible.shared import bus, messages, store
from crucible.shared.settings import RunConfig
from crucible.v1 import policy_pb2, trajectory_pb2
from tests.test_aggregator import rows_within
from tests.test_bus import read_raw


SEED = 21


def trajectories_for(group: str, policy_version: int, rewards: list[float], *, temperature: float = 1.0,
                     top_p: float = 1.0) -> list[trajectory_pb2.Trajectory]:
    """A group sampled from the learner's own initial policy, so its log-probs are real."""
    backend = create_backend("torch", seed=SEED, sample_seed=hash(group) % 1000)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=6)
    completions = backend.sample([f"{group}: 2+2="], len(rewards), params)[0]
    mean = sum(rewards) / len(rewards)
    return [trajectory_pb2.Trajectory(
        id=f"{group}/{i}", task_id=f"task-{group}", group_id=group, sample_index=i, group_size=len(rewards),
        policy_version=policy_version, prompt_token_ids=c.prompt_token_ids, completion_token_ids=c.token_ids,
        logprobs=c.logprobs, temperature=temperature, top_p=top_p, reward=r, advantage=r - mean,
        estimator="reinforce", passed=r >= 1.0, group_complete=True, group_received=len(rewards))
        for i, (c, r) in enumerate(zip(completions, rewards))]


def fresh_trainer(**config) -> Trainer:
    """A Trainer on the same initial weights the samples above were drawn from."""
    return Trainer(fresh_policy(SEED), RunConfig(seed=SEED, **config))


def test_importance_ratio_is_one_on_fresh_samples_at_their_temperature_and_top_p():
    trainer = fresh_trainer(epochs=1)
    samples = [t for g in ("a", "b", "c") for t in trajectories_for(g, 0, [1, 0, 1, 0], temperature=0.7, top_p=0.9)]
    assert any(lp < -1e-3 for t in samples for lp in t.logprobs)  # real sampling, not all certain tokens
    result = trainer.step(samples)
    assert result.stepped
    assert result.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert result.metrics["clip_fraction"] == 0.0
    assert abs(result.metrics["mismatch_kl"]) < 1e-4
    # The same samples with their sampling settings forgotten (scored at temperature 1, as before):
    # the learner no longer agrees with the sampler, and the metric says so.
    forgotten = []
    for t in samples:
        f = trajectory_pb2.Trajectory()
        f.CopyFrom(t)
        f.temperature, f.top_p = 1.0, 1.0
        forgotten.append(f)
    wrong = fresh_trainer(epochs=1).step(forgotten)
    assert abs(wrong.metrics["ratio_mean"] - 1.0) > 0.05
    assert abs(wrong.metrics["mismatch_kl"]) > 0.05


def test_reference_log_probs_read_ahead_make_the_very_step_the_step_makes_itself():
    """ReferenceAhead reads groups through the reference as they arrive (one pass for whatever is
    queued); a step given them takes the same update as one that reads the reference itself, and a
    micro-batch with a sample they lack reads its own."""
    from crucible.services.learner.reference import ReferenceAhead

    groups = {g: trajectories_for(g, 0, [1, 0, 1, 0], temperature=0.7, top_p=0.9) for g in ("a", "b", "c")}
    warm = fresh_trainer(epochs=1, kl_coef=0.5)
    warm.step([t for g in groups.values() for t in g])  # the policy now differs from its reference: KL > 0
    later = {g: trajectories_for(g, 1, [0, 1, 1, 0]) for g in ("d", "e")}
    batch = [t for g in later.values() for t in g]
    twins = []
    for _ in range(3):
        twin = Trainer(fresh_policy(SEED), RunConfig(seed=SEED, epochs=1, kl_coef=0.5, micro_batch_size=4),
                       reference=warm.reference, version=1)
        twin.model.load_state_dict(warm.model.state_dict())
        twin.optimizer.load_state_dict(warm.optimizer.state_dict())
        twins.append(twin)
    inline, ahead_trainer, partial = twins
    ahead = ReferenceAhead(ahead_trainer)
    try:
        for g, samples in later.items():
            ahead.submit(g, samples)
        ahead.submit("d", later["d"])  # given again: read once
        reference = ahead.take(list(later))
    finally:
        ahead.close()
    assert sorted(reference) == sorted(t.id for t in batch)
    assert ahead.take(["d"]) == {}  # taken: forgotten
    expected = inline.step(batch)
    assert abs(expected.metrics["kl"]) > 1e-4
    got = ahead_trainer.step(batch, reference=reference)
    lacking = partial.step(batch, reference={k: v for k, v in reference.items() if k != "e/3"})
    for result in (got, lacking):
        for key in ("loss", "kl", "grad_norm", "ratio_mean"):
            assert result.metrics[key] == pytest.approx(expected.metrics[key], rel=1e-5, abs=1e-7), key
    for twin in (ahead_trainer, partial):  # the step's gradients (Adam's update of a near-zero one is noise)
        for a, b in zip(inline.model.parameters(), twin.model.parameters()):
            assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7)
    # a reference log-prob that is not the reference's changes the step: the ones given are used
    skewed = {k: v - 1.0 for k, v in reference.items()}
    assert Trainer(fresh_policy(SEED), RunConfig(seed=SEED, epochs=1, kl_coef=0.5), reference=warm.reference,
                   version=1).step(batch, reference=skewed).metrics["kl"] != pytest.approx(expected.metrics["kl"])


def test_a_batch_lays_out_each_sample_where_the_loss_reads_it():
    """completion_batch, row by row: prompt then completion from column 0, padded after; position t
    (scoring token t + 1) holds a completion token's sampling log-prob and its loss weight (an
    episode's mask, else 1), nothing anywhere else."""
    import random

    import torch

    from crucible.services.learner.trainer import completion_batch

    rng = random.Random(5)
    for _ in range(50):
        samples = []
        for i in range(rng.randint(1, 9)):
            completion = [rng.randrange(1, 500) for _ in range(rng.randint(0, 7))]
            samples.append(trajectory_pb2.Trajectory(
                id=str(i), prompt_token_ids=[rng.randrange(1, 500) for _ in range(rng.randint(1, 6))],
                completion_token_ids=completion, logprobs=[-rng.random() - 0.01 for _ in completion],
                loss_mask=[rng.random() < 0.5 for _ in completion] if rng.random() < 0.4 else [],
                advantage=rng.gauss(0, 1), temperature=rng.uniform(0.5, 1), top_p=rng.uniform(0.5, 1)))
        batch = completion_batch(samples)
        width = max(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples)
        assert batch.ids.shape == batch.valid.shape == (len(samples), width)
        assert batch.mask.shape == batch.old_logp.shape == (len(samples), width - 1)
        for row, s in enumerate(samples):
            tokens = [*s.prompt_token_ids, *s.completion_token_ids]
            p = len(s.prompt_token_ids)
            assert batch.ids[row].tolist() == tokens + [0] * (width - len(tokens))
            assert batch.valid[row].tolist() == [True] * len(tokens) + [False] * (width - len(tokens))
            weights = [float(m) for m in s.loss_mask] if len(s.loss_mask) else [1.0] * len(s.completion_token_ids)
            assert batch.mask[row].tolist() == [0.0] * (p - 1) + weights + [0.0] * (width - len(tokens))
            assert batch.old_logp[row].tolist() == pytest.approx(
                [0.0] * (p - 1) + list(s.logprobs) + [0.0] * (width - len(tokens)))
            assert int(batch.prompt_lengths[row]) == p
        for field in ("advantage", "temperature", "top_p"):
            column = batch.advantages if field == "advantage" else getattr(batch, field)
            assert column.dtype == torch.float32
            assert column.tolist() == pytest.approx([getattr(s, field) for s in samples])
        assert batch.ids.dtype == batch.prompt_lengths.dtype == torch.long and batch.valid.dtype == torch.bool


def test_an_all_stale_batch_takes_no_step_and_counts_what_it_skipped():
    trainer = fresh_trainer(max_policy_lag=0)
    trainer.version = 3
    stale = trajectories_for("s", 1, [1, 0, 1, 0])
    empty = trajectories_for("e", 3, [1, 0])
    for t in empty:
        del t.completion_token_ids[:]
        del t.logprobs[:]
    heldout = trajectories_for("h", 3, [1, 0])
    for t in heldout:  # published by anyone: never trained on
        t.heldout = True
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = trainer.step(stale + empty + heldout)
    assert not result.stepped
    assert trainer.version == 3 and trainer.step_count == 0
    assert result.skipped == {"stale": 4, "empty_completion": 2, "heldout": 2}
    assert all((a == b).all() for a, b in zip(before, trainer.model.parameters()))


async def publish(settings, trajectories):
    async with bus.Producer(settings) as producer:
        for t in trajectories:
            await producer.send_and_wait("trajectories", t, key=t.group_id)


async def policies(settings, n: int) -> list[policy_pb2.PolicyVersion]:
    return [messages.decode(r.value, policy_pb2.PolicyVersion) for r in await read_raw(settings, "policy", n, 60)]


@pytest.mark.kafka
@pytest.mark.store
async def test_steps_drop_stale_samples_and_resume_from_checkpoint(stack_settings, tmp_path):
    settings = stack_settings.model_copy(update={
        "groups_per_step": 2, "max_policy_lag": 0, "seed": SEED, "home": tmp_path,
        "run_id": "test-run", "lr": 1e-2, "learner_optimizer_every": 2})
    stop = asyncio.Event()
    learner = asyncio.create_task(run(settings, stop))
    try:
        assert (await policies(settings, 1))[0].version == 0  # announced at start
        await publish(settings, trajectories_for("g1", 0, [1, 0, 0, 1]) + trajectories_for("g2", 0, [0, 1, 1, 1]))
        v1 = (await policies(settings, 2))[1]
        assert v1.version == 1 and v1.metrics.samples == 8 and v1.metrics.dropped_stale == 0
        assert v1.metrics.grad_norm > 0 and v1.metrics.pass_rate == pytest.approx(5 / 8)
        # Samples from version 0 are now one version behind: beyond max_policy_lag=0, so dropped and counted.
        await publish(settings, trajectories_for("g3", 0, [1, 0]) + trajectories_for("g4", 1, [1, 0]))
        v2 = (await policies(settings, 3))[2]
        assert v2.version == 2 and v2.metrics.dropped_stale == 2 and v2.metrics.samples == 4
        assert dict(v2.metrics.skipped) == {"stale": 2}
        # Two groups that are all stale: no optimiser step, so no version and no checkpoint...
        await publish(settings, trajectories_for("g3b", 0, [1, 0]) + trajectories_for("g4b", 1, [0, 1]))
        # ...and the next real step is version 3, with nothing in between.
        await publish(settings, trajectories_for("g3c", 2, [1, 0]) + trajectories_for("g4c", 2, [0, 1]))
        v3 = (await policies(settings, 4))[3]
        assert v3.version == 3 and v3.metrics.samples == 4 and v3.metrics.dropped_stale == 0
    finally:
        stop.set()
        await asyncio.wait_for(learner, 30)

    folder = checkpoints.latest(settings)
    meta = json.loads((folder / "crucible.json").read_text())
    assert folder.name == "v000003" and meta["version"] == 3 and meta["step"] == 3
    assert not (folder.parent / "v000004").exists()
    assert meta["offsets"] == {"0": 20}  # every record read so far was accounted for: resume right after them
    # The optimiser state goes with every second version: not with v3, so a resume takes v2's.
    assert not (folder / "optimizer.pt").exists() and (folder.parent / "v000002" / "optimizer.pt").exists()
    assert checkpoints.optimizer_source(folder) == folder.parent / "v000002"
    saved, _ = load_checkpoint(folder)

    # A new learner process resumes at version 3 with the same weights and reads only what is new.
    stop = asyncio.Event()
    learner = asyncio.create_task(run(settings, stop))
    try:
        announced = (await policies(settings, 5))[4]
        assert announced.version == 3 and announced.checkpoint_uri == folder.as_uri()
        await publish(settings, trajectories_for("g5", 3, [1, 0]) + trajectories_for("g6", 3, [0, 1]))
        v4 = (await policies(settings, 6))[5]
        assert v4.version == 4 and v4.metrics.samples == 4 and v4.metrics.dropped_stale == 0
    finally:
        stop.set()
        final = await asyncio.wait_for(learner, 30)
    assert final.step_count == 4
    # Adam's moments came from v2 (two steps) and took one more: the weights are v3's, the moments a step older.
    assert {int(state["step"]) for state in final.optimizer.state.values()} == {3}
    assert (folder.parent / "v000004" / "optimizer.pt").exists()
    assert not all(
        (a == b).all() for a, b in zip(saved.state_dict().values(), final.model.state_dict().values()))
    client = store.connect(settings)
    rows = client.query("SELECT step, policy_version FROM train_steps FINAL WHERE run_id = 'test-run' "
                        "ORDER BY step").result_rows
    assert rows == [(1, 1), (2, 2), (3, 3), (4, 4)]


async def test_step_rows_wait_for_company_and_a_learner_killed_first_writes_them(stack_settings, tmp_path,
                                                                                   monkeypatch):
    """Steps' rows go to the store together (loop.ROWS_EVERY_S); those not written yet ride in every
    checkpoint, and a learner killed before writing them (its task cancelled: no stop, no hand-over
    finished) leaves them to the next one, which writes them as it starts."""
    from crucible.services.learner import loop

    settings = stack_settings.model_copy(update={
        "groups_per_step": 1, "max_policy_lag": 3, "seed": SEED, "home": tmp_path, "run_id": "rows-run"})
    client = store.connect(settings)
    query = "SELECT step, policy_version FROM train_steps FINAL WHERE run_id = 'rows-run' ORDER BY step"
    monkeypatch.setattr(loop, "ROWS_EVERY_S", 3600.0)  # never due while it runs
    learner = asyncio.create_task(run(settings, asyncio.Event()))
    try:
        await policies(settings, 1)
        await publish(settings, [t for g in ("a", "b", "c") for t in trajectories_for(g, 0, [1, 0])])
        assert [v.version for v in await policies(settings, 4)] == [0, 1, 2, 3]
        await asyncio.sleep(0.5)  # the last hand-over's alerts and commit
    finally:
        learner.cancel()
        await asyncio.gather(learner, return_exceptions=True)
    assert client.query(query).result_rows == []
    meta = json.loads((checkpoints.latest(settings) / "crucible.json").read_text())
    assert [(e["version"], e["step"], len(e["samples"])) for e in meta["step_records"]] == [(1, 1, 2), (2, 2, 2), (3, 3, 2)]

    # The next learner writes them at start, and rows that become due while it waits for samples.
    monkeypatch.setattr(loop, "ROWS_EVERY_S", 0.5)
    stop = asyncio.Event()
    learner = asyncio.create_task(run(settings, stop))
    try:
        await policies(settings, 5)  # version 3 announced again
        assert await rows_within(client, query, [(1, 1), (2, 2), (3, 3)], 10) == [(1, 1), (2, 2), (3, 3)]
        await publish(settings, trajectories_for("d", 3, [1, 0]))
        await policies(settings, 6)
        expected = [(1, 1), (2, 2), (3, 3), (4, 4)]
        assert await rows_within(client, query, expected, 10) == expected  # no further step came to take it along
        uri = client.query("SELECT checkpoint_uri FROM policy_versions FINAL WHERE run_id = 'rows-run' AND "
                           "version = 4").result_rows
        assert uri == [(checkpoints.version_dir(settings, 4).as_uri(),)]
    finally:
        stop.set()
        await asyncio.wait_for(learner, 30)


@pytest.mark.kafka
@pytest.mark.store
async def test_samples_arriving_while_a_step_trains_are_taken_in_beside_it_and_its_own_not_again(
        stack_settings, tmp_path, monkeypatch):
    """The next step's groups start their reference pass while the step before trains (not once it has
    ended), and a replay of what that step is training, arriving meanwhile, is not trained again."""
    import threading

    from crucible.services.learner.reference import ReferenceAhead

    settings = stack_settings.model_copy(update={
        "groups_per_step": 1, "max_policy_lag": 3, "seed": SEED, "home": tmp_path, "run_id": "beside-run"})
    inside, go = threading.Event(), threading.Event()
    step, submit = Trainer.step, ReferenceAhead.submit

    def held_step(self, *args, **kwargs):  # the first step waits for the test, in the learner's step thread
        if self.version == 0:
            inside.set()
            go.wait(60)
        return step(self, *args, **kwargs)

    submitted: list[tuple[str, bool]] = []  # (group, whether the first step had been let go)
    monkeypatch.setattr(Trainer, "step", held_step)
    monkeypatch.setattr(ReferenceAhead, "submit",
                        lambda self, group_id, samples: (submitted.append((group_id, go.is_set())),
                                                         submit(self, group_id, samples))[1])
    stop = asyncio.Event()
    learner = asyncio.create_task(run(settings, stop))
    try:
        await policies(settings, 1)
        first = trajectories_for("a", 0, [1, 0])
        await publish(settings, first)
        assert await asyncio.to_thread(inside.wait, 60)
        await publish(settings, trajectories_for("b", 0, [0, 1]) + first)  # the next group, and a replay of "a"
        for _ in range(200):
            if ("b", False) in submitted:
                break
            await asyncio.sleep(0.05)
        assert ("b", False) in submitted, submitted  # read through the reference while step 1 was held
        go.set()
        v1, v2 = (await policies(settings, 3))[1:]
        assert (v1.version, v1.metrics.samples, v2.version, v2.metrics.samples) == (1, 2, 2, 2)
        with pytest.raises(TimeoutError):  # "a" again is not a third step
            await read_raw(settings, "policy", 4, 3)
    finally:
        go.set()
        stop.set()
        await asyncio.wait_for(learner, 30)


def test_pruning_keeps_the_newest_optimiser_state(tmp_path):
    """Old versions go, but never the newest one holding optimiser state: a resumed learner takes it."""
    from crucible.shared.settings import Settings

    settings = Settings(home=tmp_path, run_id="prune-run", learner_keep_checkpoints=2)
    folder = checkpoints.checkpoints_dir(settings)
    for version in range(8):
        v = checkpoints.version_dir(settings, version)
        v.mkdir(parents=True)
        (v / "crucible.json").write_text("{}")
        if version in (0, 3):
            (v / checkpoints.OPTIMIZER_FILE).write_bytes(b"state")
    checkpoints.prune(settings)
    assert sorted(p.name for p in folder.iterdir()) == ["v000003", "v000006", "v000007"]
    assert checkpoints.optimizer_source(folder / "v000007") == folder / "v000003"
    assert checkpoints.optimizer_source(folder / "v000003") == folder / "v000003"
    (folder / "v000003" / checkpoints.OPTIMIZER_FILE).unlink()
    assert checkpoints.optimizer_source(folder / "v000007") is None


def test_pruning_counts_versions_by_number_not_name(tmp_path):
    """By name, v1000000 sorted before v999999: the version just written was removed, and the old kept."""
    from crucible.shared.settings import Settings

    settings = Settings(home=tmp_path, run_id="big-run", learner_keep_checkpoints=2)
    for version in range(999_997, 1_000_002):
        v = checkpoints.version_dir(settings, version)
        v.mkdir(parents=True)
        (v / "crucible.json").write_text("{}")
    checkpoints.prune(settings)
    assert sorted(p.name for p in checkpoints.checkpoints_dir(settings).iterdir()) == ["v1000000", "v1000001"]
    assert checkpoints.latest(settings).name == "v1000001"


def test_a_learner_resumes_past_a_damaged_newest_version_and_clears_what_failed_writes_left(tmp_path, monkeypatch):
    """A newest version cut short (a crash, a full disk) stopped every restart; the learner now resumes at
    the version before, numbered past the damaged one (generators may hold it), and never starts afresh
    while a run has versions. A write that fails leaves nothing behind, and what a killed one left goes."""
    from crucible.ml.policy import checkpoint as checkpoint_files
    from crucible.services.learner.loop import build_trainer
    from crucible.shared.settings import Settings

    settings = Settings(home=tmp_path, run_id="damaged-run", seed=SEED)
    trainer, meta = build_trainer(settings)  # version 0
    for version in (1, 2):
        with torch.no_grad():
            next(trainer.model.parameters()).add_(1.0)
        trainer.version = trainer.step_count = version
        checkpoints.save(settings, trainer, {0: 10 * version}, [], meta["reference_uri"])
    v1 = load_checkpoint(checkpoints.version_dir(settings, 1))[0].state_dict()
    weights = checkpoints.version_dir(settings, 2) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    left = checkpoints.checkpoints_dir(settings) / ".v000003.tmp-4242-deadbeef"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"\0" * 4096)

    resumed, meta = build_trainer(settings)
    # v1's weights, written again as v3: the version announced now is newer than the v2 generators may hold,
    # and it is a folder that loads
    assert resumed.version == meta["version"] == 3 and meta["offsets"] == {"0": 10}
    assert checkpoints.latest(settings).name == "v000003"
    assert all((a == b).all() for a, b in zip(resumed.model.state_dict().values(), v1.values()))
    assert all((a == b).all() for a, b in zip(load_checkpoint(checkpoints.latest(settings))[0].state_dict().values(),
                                              v1.values()))
    assert not left.exists()

    # A write that fails part-way (the disk full as the optimiser state is written) leaves no folder.
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_files.torch, "save", full)
    resumed.version = 10  # a version written with its optimiser state
    with pytest.raises(OSError):
        checkpoints.save(settings, resumed, {}, [], meta["reference_uri"])
    assert sorted(p.name for p in checkpoints.checkpoints_dir(settings).iterdir()) == [
        "v000000", "v000001", "v000002", "v000003"]
    monkeypatch.undo()

    # Adam's moments damaged alone: that version resumes, without them
    resumed.version = 10
    checkpoints.save(settings, resumed, {0: 30}, [], meta["reference_uri"])
    moments = checkpoints.version_dir(settings, 10) / checkpoints.OPTIMIZER_FILE
    moments.write_bytes(moments.read_bytes()[:64])
    again, meta = build_trainer(settings)
    assert again.version == meta["version"] == 10 and not again.optimizer.state

    for version in (0, 1, 3, 10):  # none loads: the newest one's error, not a run started afresh
        weights = checkpoints.version_dir(settings, version) / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(Exception, match="(?i)header|safetensor|deserializ"):
        build_trainer(settings)


def test_optimiser_state_of_another_model_is_refused_at_resume_not_at_the_first_step(tmp_path):
    """Adam took moments of other shapes and failed at the first step, and the learner restarted into it
    again and again; the learner now resumes without them, saying why."""
    from crucible.ml.policy.model import PolicyConfig
    from crucible.services.learner.loop import build_trainer
    from crucible.services.learner.trainer import OptimizerStateMismatch, load_optimizer_state
    from crucible.shared.settings import Settings

    other = Trainer(fresh_policy(SEED, PolicyConfig(hidden_size=64, intermediate_size=128)), RunConfig(seed=SEED))
    loss = sum(p.sum() for p in other.model.parameters())
    loss.backward()
    other.optimizer.step()
    _, state = other.checkpoint_state(optimizer=True)
    mine = fresh_trainer()
    with pytest.raises(OptimizerStateMismatch, match="is \\(.*64"):
        load_optimizer_state(mine.model, mine.optimizer, state)

    settings = Settings(home=tmp_path, run_id="other-state", seed=SEED)
    trainer, meta = build_trainer(settings)
    torch.save(state, checkpoints.version_dir(settings, 0) / checkpoints.OPTIMIZER_FILE)
    resumed, _ = build_trainer(settings)
    assert resumed.version == 0 and not resumed.optimizer.state


def test_a_step_whose_loss_is_not_finite_changes_no_weight():
    # A NaN that reaches the optimiser makes every weight NaN, and that version would be published.
    trainer = fresh_trainer(epochs=1)
    samples = trajectories_for("a", 0, [1, 0, 1, 0], temperature=0.7, top_p=0.9)
    samples[0].logprobs[0] = float("nan")  # past the consumer's checks (groups.sample_problem refuses it)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = trainer.step(samples)
    assert not result.stepped and result.skipped["non_finite_update"] == len(samples) and trainer.version == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    samples[0].logprobs[0] = -0.5
    assert trainer.step(samples).stepped  # the next sound batch steps as ever
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_sample_that_is_not_a_sample_is_refused_with_the_reason():
    from crucible.services.learner.groups import sample_problem
    from crucible.v1 import trajectory_pb2

    good = trajectory_pb2.Trajectory(id="s", group_id="g", group_size=2, group_received=2, sample_index=1,
                                     prompt_token_ids=[1, 2], completion_token_ids=[3], logprobs=[-0.5],
                                     reward=1.0, advantage=0.5, temperature=0.8, top_p=0.9)
    assert sample_problem(good) is None and sample_problem(good, vocab_size=4, max_positions=3) is None

    def varied(**fields):
        sample = trajectory_pb2.Trajectory()
        sample.CopyFrom(good)
        for name, value in fields.items():
            if isinstance(value, list):
                del getattr(sample, name)[:]
                getattr(sample, name).extend(value)
            else:
                setattr(sample, name, value)
        return sample

    assert sample_problem(varied(temperature=0.0, top_p=0.0)) is None  # greedy
    # each broke a learner fed it: an embedding index out of range (a crash at every restart), or NaN
    # in every weight after one step
    for name, sample, limits in [
            ("token past the vocabulary", varied(completion_token_ids=[10**9]), (4, 3)),
            ("negative token", varied(prompt_token_ids=[-1, 2]), (4, 3)),
            ("longer than the positions", good, (4, 2)),
            ("nan log-prob", varied(logprobs=[float("nan")]), (None, None)),
            ("positive log-prob", varied(logprobs=[0.5]), (None, None)),
            ("top_p of 0", varied(top_p=0.0), (None, None)),
            ("infinite temperature", varied(temperature=float("inf")), (None, None)),
            # finite as doubles, but each made a whole step's update non-finite in float32 (the step was
            # skipped, and with it every good sample of the batch)
            ("advantage of 1e30", varied(advantage=1e30), (None, None)),
            ("reward of -1e30", varied(reward=-1e30), (None, None)),
            ("log-prob of -3e38", varied(logprobs=[-3e38]), (None, None)),
            ("top_p 0 in float32", varied(top_p=1e-50), (None, None)),
            ("temperature 0 in float32", varied(temperature=1e-50), (None, None))]:
        assert sample_problem(sample, *limits), name
    # a sample of a version the learner never made (one resumed behind what it had announced)
    assert sample_problem(varied(policy_version=5), version=5) is None
    assert "later than the learner's 4" in sample_problem(varied(policy_version=5), version=4)
    assert sample_problem(varied(policy_version=2**64 - 1), version=4)
    broken = {
        "empty": trajectory_pb2.Trajectory(),
        "no group": trajectory_pb2.Trajectory(id="s", group_size=1, group_received=1, prompt_token_ids=[1]),
        "index past the group": trajectory_pb2.Trajectory(id="s", group_id="g", group_size=1, group_received=1,
                                                          sample_index=3, prompt_token_ids=[1]),
        "log-probs missing": trajectory_pb2.Trajectory(id="s", group_id="g", group_size=1, group_received=1,
                                                       prompt_token_ids=[1], completion_token_ids=[2, 3]),
        "nan reward": trajectory_pb2.Trajectory(id="s", group_id="g", group_size=1, group_received=1,
                                                prompt_token_ids=[1], reward=float("nan")),
    }
    for name, sample in broken.items():
        assert sample_problem(sample), name


@pytest.mark.kafka
@pytest.mark.store
async def test_dynamic_sampling_filters_groups_with_equal_rewards_and_a_solved_set_still_advances(
        stack_settings, tmp_path):
    settings = stack_settings.model_copy(update={
        "groups_per_step": 2, "max_policy_lag": -1, "seed": SEED, "home": tmp_path, "run_id": "dyn-run",
        "lr": 1e-2, "dynamic_sampling": True, "dynamic_sampling_window": 3})
    stop = asyncio.Event()
    learner = asyncio.create_task(run(settings, stop))
    try:
        assert (await policies(settings, 1))[0].version == 0
        # Two groups with no reward spread arrive first: filtered, and the step waits for two that teach.
        await publish(settings, trajectories_for("all-right", 0, [1, 1, 1, 1]) + trajectories_for("all-wrong", 0, [0, 0])
                      + trajectories_for("mixed-1", 0, [1, 0]))
        with pytest.raises(TimeoutError):  # one informative group so far: no step yet
            await read_raw(settings, "policy", 2, 3)
        await publish(settings, trajectories_for("mixed-2", 0, [0, 1]))
        v1 = (await policies(settings, 2))[1]
        assert v1.version == 1 and dict(v1.metrics.skipped) == {"uninformative": 6}
        assert v1.metrics.samples == 10 and v1.metrics.pass_rate == pytest.approx(6 / 10)  # every sample counts
        # A solved set: nothing but equal rewards. Once 3 x 2 groups arrived, a step goes ahead on two of them.
        await publish(settings, [t for i in range(6) for t in trajectories_for(f"solved-{i}", 1, [1, 1])])
        v2 = (await policies(settings, 3))[2]
        assert v2.version == 2 and v2.metrics.samples == 12 and dict(v2.metrics.skipped) == {"uninformative": 8}
    finally:
        stop.set()
        await asyncio.wait_for(learner, 30)
    client = store.connect(settings)
    [(filtered,)] = client.query("SELECT metrics['filtered_groups'] FROM policy_versions FINAL "
                                 "WHERE run_id = 'dyn-run' AND version = 1").result_rows
    assert filtered == 2


@pytest.mark.kafka
@pytest.mark.store
async def test_a_group_with_a_refused_sample_trains_on_the_rest_and_its_position_moves_on(stack_settings, tmp_path):
    """A sample the learner cannot use is dead-lettered and never comes back: its group trains on the others.
    Waiting for it held the rest of the group, and the read position before them, for ever."""
    settings = stack_settings.model_copy(update={
        "groups_per_step": 1, "max_policy_lag": 3, "seed": SEED, "home": tmp_path, "run_id": "refused-run"})
    group = trajectories_for("one-bad", 0, [1, 0, 0, 1])
    group[2].completion_token_ids[0] = 10**6  # past the vocabulary
    stop = asyncio.Event()
    learner = asyncio.create_task(run(settings, stop))
    try:
        await policies(settings, 1)
        await publish(settings, group)
        v1 = (await policies(settings, 2))[1]
        assert v1.version == 1 and v1.metrics.samples == 3
        [dead] = await read_raw(settings, "trajectories" + bus.DLQ_SUFFIX, 1)
        assert b"vocabulary" in dict(dead.headers)[bus.H_DLQ_REASON]
    finally:
        stop.set()
        await asyncio.wait_for(learner, 30)
    meta = json.loads((checkpoints.latest(settings) / "crucible.json").read_text())
    assert meta["offsets"] == {"0": 4}  # a restart reads on after the group, not from its first sample


def test_a_captured_version_is_written_as_it_was_while_the_next_step_changes_the_model(tmp_path):
    """The step's path copies a version's state (checkpoints.capture); the checkpoint written from it
    later, after the next step changed the model in place, holds that version, not the next one."""
    from crucible.shared.settings import Settings

    settings = Settings(home=tmp_path, run_id="capture-run")
    trainer = fresh_trainer(epochs=1, learner_optimizer_every=1)
    assert trainer.step(trajectories_for("a", 0, [1, 0, 1, 0])).stepped
    captured = checkpoints.capture(trainer)
    assert captured is not None and (captured.version, captured.step) == (trainer.version, trainer.step_count)
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    moments = {k: s["exp_avg"].clone() for k, s in trainer.checkpoint_state()[1]["state"].items()}
    assert trainer.step(trajectories_for("b", 0, [0, 1, 1, 0])).stepped  # the next step, in place
    assert not all(torch.equal(weights[k], v) for k, v in trainer.model.state_dict().items())

    folder = checkpoints.save(settings, trainer, {0: 7}, [], tmp_path.as_uri(), captured=captured)
    assert folder == checkpoints.version_dir(settings, captured.version)
    model, meta = load_checkpoint(folder)
    assert (meta["version"], meta["step"], meta["offsets"]) == (captured.version, captured.step, {"0": 7})
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    written = torch.load(folder / checkpoints.OPTIMIZER_FILE, weights_only=True)["state"]
    assert written.keys() == moments.keys() and all(torch.equal(written[k]["exp_avg"], m) for k, m in moments.items())


def test_a_host_copy_keeps_views_of_one_tensor_one_tensor():
    """Tied weights (one tensor under two names) are copied once and stay tied; nothing is shared with
    the original."""
    embedding = torch.arange(6.0).reshape(2, 3)
    state = {"embed": embedding, "head": embedding, "other": embedding[1:], "step": 3, "groups": [{"lr": 0.1}]}
    copied = checkpoints._host_copy(state, {})
    assert copied["embed"] is copied["head"] and copied["embed"] is not embedding
    assert copied["other"].data_ptr() != embedding.data_ptr() and torch.equal(copied["other"], embedding[1:])
    embedding.add_(1.0)
    assert torch.equal(copied["head"], torch.arange(6.0).reshape(2, 3)) and copied["groups"] == [{"lr": 0.1}]


def test_a_trained_sample_is_remembered_for_as_long_as_it_could_be_trained_on_again():
    """The learner forgot the ids of all but its last 4 steps once they passed 8,192: at max_policy_lag 6
    and 4,096 samples a step, a signed group copied back onto the topic 4 steps later was fresh enough
    to train on, and was trained on again; with no staleness bound, 64 steps later."""
    from crucible.services.learner.loop import RecentIds

    def steps(n, first=0, size=4096):
        return [[f"s{v}-{i}" for i in range(size)] for v in range(first, first + n)]

    recent = RecentIds.for_lag([], 6)
    for version, ids in enumerate(steps(8), start=1):
        recent.add(ids, version)
    assert "s0-0" in recent and "s1-5" in recent  # 8 steps back: a sample of version 0 is 8 versions old
    recent.add(steps(1, 8)[0], 9)
    assert "s0-0" not in recent and "s1-0" in recent  # now too stale to be trained on: forgotten
    restored = RecentIds.for_lag(recent.saved(), 6)  # as a checkpoint keeps them
    assert "s1-0" in restored and "s0-0" not in restored and restored.horizon == recent.horizon

    unbounded = RecentIds.for_lag([["old-0"]], -1)  # a checkpoint of before: ids alone
    assert "old-0" in unbounded and unbounded.horizon == 0
    for version, ids in enumerate(steps(6, 1, size=2048), start=1):
        unbounded.add(ids, version)
    # Forgotten: the ids of the steps that made versions up to the horizon; every sample older than it
    # may have been trained on, and the learner refuses them (max_policy_lag < 0).
    assert "s1-0" not in unbounded and unbounded.horizon == 2 and "s3-0" in unbounded
