"""Environments: each reference solution scores 1 and wrong ones less; bad calls, unknown tools, long
output and escape attempts are observations that say what happened; tool calls in both formats."""
from __future__ import annotations

import json
import sqlite3

import pytest
import pytest_asyncio

from crucible.ml import envs
from crucible.ml.envs import calls
from crucible.ml.envs import episode as ep
from crucible.ml.kinds import extract
from crucible.ml.tasks import task_problems
from crucible.services.sandbox_executor.handler import job_for_request, result_message
from crucible.services.sandbox_executor.pool import SandboxPool
from crucible.shared import integrity
from crucible.shared.settings import Settings
from crucible.v1 import episode_pb2, execution_pb2, task_pb2

BUILT_IN = ["events", "logs", "lookup", "python", "sql"]


@pytest_asyncio.fixture(scope="module")
async def execute():
    async with SandboxPool(Settings(sandbox_workers=2)) as pool:
        async def run(request):
            return result_message(await pool.execute(job_for_request(request)))

        yield run


def first_task(name: str, split: str = "train", seed: int = 5) -> task_pb2.Task:
    return next(envs.get(name).generate(split, seed=seed))


def test_the_built_in_environments_are_registered_beside_kinds_and_their_tasks_are_valid():
    assert set(BUILT_IN) <= set(envs.known())
    for name in BUILT_IN:
        task = first_task(name)
        assert task.kind == name and envs.is_environment(task)
        assert task_problems(task) == []
    with pytest.raises(ValueError, match="already taken"):
        envs.register(envs.get("sql"))
    from crucible.ml import kinds

    with pytest.raises(ValueError, match="already taken"):
        clash = type("Clash", (envs.get("lookup").__class__,), {"name": "exact"})()
        envs.register(clash)
    assert "exact" in kinds.known()


def test_held_out_instances_never_appear_in_training():
    for name in BUILT_IN:
        env = envs.get(name)
        train = {t.environment.instance_json for t, _ in zip(env.generate("train", seed=1), range(300))}
        heldout = {t.environment.instance_json for t, _ in zip(env.generate("heldout", seed=2), range(60))}
        assert heldout and not train & heldout, name


def test_a_task_without_a_usable_instance_is_refused_with_the_reason():
    task = first_task("sql")
    task.environment.instance_json = json.dumps({"schema": [], "rows": {}, "reference": ""})
    assert any("schema" in p for p in task_problems(task))
    task.environment.instance_json = "[" * 100_000
    assert any("not valid JSON" in p for p in task_problems(task))
    task.ClearField("environment")
    assert any("environment" in p for p in task_problems(task))


@pytest.mark.sandbox
@pytest.mark.parametrize("name", BUILT_IN)
async def test_each_reference_solution_scores_1_and_a_wrong_answer_less(name, execute):
    env = envs.get(name)
    for seed in (1, 2, 3):
        task = first_task(name, seed=seed)
        right = await ep.play(env, task, env.reference(task), execute)
        score = env.score(task, right)
        assert score.reward == 1.0 and score.passed, (name, ep.transcript(right))
        assert score.components["failed_calls"] == 0
        wrong = await ep.play(env, task, [env.reference(task)[0], "I do not know"], execute)
        assert env.score(task, wrong).reward < 1.0, ep.transcript(wrong)
        guess = await ep.play(env, task, ["zzz"], execute)  # answering without looking
        assert not env.score(task, guess).passed


@pytest.mark.sandbox
async def test_malformed_calls_and_unknown_tools_are_observations_and_cost_reward(execute):
    env, task = envs.get("lookup"), first_task("lookup")
    good = env.reference(task)
    attempts = ["@", "@nosuch b", "@lookup {\"key\": ", "@lookup {\"key\": \"b\", \"extra\": 1}"]
    for attempt in attempts:
        episode = await ep.play(env, task, [attempt, *good], execute)
        first = episode.turns[0]
        assert first.call_failed and first.observation.startswith("error: "), (attempt, first.observation)
        assert episode.end == episode_pb2.EPISODE_END_ANSWER  # the episode went on
        score = env.score(task, episode)
        assert score.components["answer_correct"] == 1.0 and score.components["failed_calls"] == 1.0
        assert 0 < score.reward < 1.0
    unknown = await ep.play(env, task, ["@nosuch b"], execute)
    assert "unknown tool 'nosuch'" in unknown.turns[0].observation and "lookup" in unknown.turns[0].observation


def test_hermes_tool_calls_parse_and_malformed_ones_say_what_is_wrong():
    tools = envs.get("sql").tools
    call = calls.parse('I will look.\n<tool_call>\n{"name": "sql", "arguments": {"query": "SELECT 1"}}\n</tool_call>',
                       "hermes")
    assert calls.resolve(call, tools) == envs.Call("sql", {"query": "SELECT 1"})
    assert calls.parse("The answer is 4.", "hermes") is None
    # a call written while thinking is not made; one after the thinking is
    thought = '<think>maybe <tool_call>{"name": "sql", "arguments": {"query": "SELECT 2"}}</tool_call></think>'
    assert calls.parse(thought + "\nThe answer is 4.", "hermes") is None
    after = calls.parse(thought + '<tool_call>{"name": "sql", "arguments": {"query": "SELECT 3"}}</tool_call>', "hermes")
    assert calls.resolve(after, tools) == envs.Call("sql", {"query": "SELECT 3"})
    cases = {
        '<tool_call>{"name": "sql", "arguments": {"query": "x"}}': "not closed",
        "<tool_call>{name: sql}</tool_call>": "not valid JSON",
        '<tool_call>["sql"]</tool_call>': "JSON object",
        '<tool_call>{"arguments": {}}</tool_call>': "no \"name\"",
        '<tool_call>{"name": "sql", "arguments": [1]}</tool_call>': "must be a JSON object",
        "<tool_call>" + "[" * 50_000 + "</tool_call>": "characters long",
    }
    for text, why in cases.items():
        parsed = calls.parse(text, "hermes")
        assert parsed is not None and why in parsed.error, (text[:60], parsed)
        assert isinstance(calls.resolve(parsed, tools), str)
    wrong_args = calls.parse('<tool_call>{"name": "sql", "arguments": {"sql": "x"}}</tool_call>', "hermes")
    assert "missing query" in calls.resolve(wrong_args, tools)
    nested = calls.parse('<tool_call>{"name": "sql", "arguments": {"query": {"a": 1}}}</tool_call>', "hermes")
    assert "must be strings" in calls.resolve(nested, tools)


@pytest.mark.sandbox
async def test_a_turn_that_writes_several_calls_reads_the_first_and_is_told_so(execute):
    env, task = envs.get("python"), first_task("python")

    def call(code: str) -> str:
        return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"

    episode = await ep.play(env, task, ["Two at once.\n" + call("print(6 * 7)") + "\n" + call("print(1 / 0)")
                                        + call("print(3)")], execute, call_format="hermes")
    observation = episode.turns[0].observation
    assert observation.startswith("42") and not episode.turns[0].call_failed, observation
    assert observation.endswith("this turn wrote 3, and only the first was read]"), observation
    one = await ep.play(env, task, [call("print(6 * 7)") + " (the <tool_call> tag above ran it)"], execute,
                        call_format="hermes")
    assert one.turns[0].observation.strip() == "42"  # one call (a tag named in prose is none): nothing said
    broken = await ep.play(env, task, ["<tool_call>{no json</tool_call>" + call("print(1)")], execute,
                           call_format="hermes")
    assert broken.turns[0].call_failed and broken.turns[0].observation.endswith("only the first was read]")
    assert calls.calls_ignored("<think>" + call("1") + "</think>" + call("2"), "hermes") == 0  # one made, one thought
    assert calls.calls_ignored("@python print(1) @python print(2)", "plain") == 0  # a plain turn is one call


@pytest.mark.sandbox
async def test_over_long_output_is_cut_and_says_so(execute):
    env, task = envs.get("python"), first_task("python")
    episode = await ep.play(env, task, ['@python print("x" * 100000)', "0"], execute)
    observation = episode.turns[0].observation
    assert len(observation) < 3000 and "more characters cut" in observation
    logs, logs_task = envs.get("logs"), first_task("logs")
    episode = await ep.play(logs, logs_task, ["@grep 2026", "x"], execute)
    assert "more matching lines" in episode.turns[0].observation


def test_why_the_sandbox_stopped_a_program_survives_any_cut_of_its_output():
    from crucible.ml.envs.base import cut, program_output

    flood = "Traceback (most recent call last):\n" * 500
    stopped = execution_pb2.ExecutionResult(exit_code=1, stderr=flood.encode(), stdout=b"x" * 5000,
                                            violation=execution_pb2.VIOLATION_PROCESSES,
                                            violation_detail="process limit of 32 reached")
    observation = program_output(stopped)
    assert observation.failed
    assert "[the sandbox stopped the program: processes: process limit of 32 reached]" in cut(observation.text)
    exited = program_output(execution_pb2.ExecutionResult(exit_code=3, stdout=b"y" * 5000))
    assert exited.failed and "[exit code 3]" in cut(exited.text)
    fine = program_output(execution_pb2.ExecutionResult(stdout=b"42\n"))
    assert fine.text == "42" and not fine.failed


@pytest.mark.sandbox
@pytest.mark.parametrize("attack, says", [
    ("import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)", ""),
    ("print(open('/etc/shadow').read())", ""),
    ("import os\nwhile True: os.fork()", ""),
    ("while True: pass", "limit"),
    ("x = bytearray(10**10)", ""),
    ("import ctypes; ctypes.string_at(0)", ""),
    ("import os; os.kill(os.getppid(), 9); os.kill(1, 9); print('alive')", ""),
])
async def test_actions_that_try_to_escape_the_sandbox_get_a_clear_observation(attack, says, execute):
    env, task = envs.get("python"), first_task("python")
    episode = await ep.play(env, task, ["@python " + json.dumps({"code": attack}), "@python print(6 * 7)", "42"],
                            execute)
    blocked = episode.turns[0]
    assert blocked.observation, blocked.observation
    if "alive" not in attack:  # killing what it can see (its own pid namespace) is not escaping: it may just end
        assert blocked.call_failed, blocked.observation
        assert says in blocked.observation
        assert any(w in blocked.observation.lower() for w in ("error", "stopped", "denied", "exit code", "signal"))
    assert episode.turns[1].observation.strip() == "42"  # the sandbox served the next call
    assert episode.end == episode_pb2.EPISODE_END_ANSWER


@pytest.mark.sandbox
async def test_an_escape_tried_in_any_call_pays_nothing_and_is_named_and_a_limit_hit_is_no_escape(execute):
    """A forbidden system call in a call's program is tampering, as in a tested run: the right answer after
    it is not paid, and the verdict names the call. A program stopped at a limit is a failed call, no more."""
    env, task = envs.get("python"), first_task("python")
    reference = env.reference(task)
    escape = "@python " + json.dumps({"code": "import socket; socket.socket(socket.AF_INET).connect(('10.0.0.1', 80))"})
    tried = await ep.play(env, task, [escape, *reference], execute)
    first = tried.turns[0]
    assert first.sandboxed and first.violation == execution_pb2.VIOLATION_FORBIDDEN_SYSCALL, first
    score = env.score(task, tried)
    assert score.components["answer_correct"] == 1.0  # the answer is right...
    assert score.tampered and score.reward == 0.0 and score.patterns == ("forbidden_syscall",)  # ...and unpaid
    assert "turn 1" in score.detail and score.components["tampered"] == 1.0
    spun = await ep.play(env, task, ["@python " + json.dumps({"code": "while True: pass"}), *reference], execute)
    assert spun.turns[0].violation in (execution_pb2.VIOLATION_TIMEOUT, execution_pb2.VIOLATION_CPU)
    score = env.score(task, spun)
    assert not score.tampered and 0 < score.reward < 1.0 and score.components["failed_calls"] == 1.0
    honest = await ep.play(env, task, reference, execute)
    assert all(t.sandboxed and not t.violation for t in honest.turns if t.HasField("call"))
    assert not env.score(task, honest).tampered


@pytest.mark.sandbox
async def test_sql_state_lasts_for_the_episode_and_writes_outside_it_are_impossible(execute):
    env, task = envs.get("sql"), first_task("sql")
    turns = ["@sql DELETE FROM employees", "@sql SELECT COUNT(*) FROM employees",
             "@sql ATTACH DATABASE '/tmp/escape.db' AS x", "@sql SELECT * FROM nosuch", "0"]
    episode = await ep.play(env, task, turns, execute)
    assert "rows changed" in episode.turns[0].observation
    assert episode.turns[1].observation.splitlines()[-1] == "0"  # the delete stayed for the episode
    assert episode.turns[3].call_failed and "no such table" in episode.turns[3].observation
    fresh = await ep.play(env, task, ["@sql SELECT COUNT(*) FROM employees", "0"], execute)
    assert fresh.turns[0].observation.splitlines()[-1] != "0"  # a new episode has a new database
    from pathlib import Path

    assert not Path("/tmp/escape.db").exists()


@pytest.mark.sandbox
async def test_events_rejects_what_the_state_does_not_allow_and_scores_the_final_state(execute):
    env = envs.get("events")
    task = env.task("x", {"machine": "order", "start": "created", "target": "shipped"}, split="train", key="t",
                    group_size=1)
    episode = await ep.play(env, task, ["@publish ship", "@publish teleport", "@publish pay", "@publish pack",
                                        "@publish ship", "done"], execute)
    assert episode.turns[0].call_failed and "not allowed when the order is created" in episode.turns[0].observation
    assert "unknown event" in episode.turns[1].observation
    score = env.score(task, episode)
    assert score.components["answer_correct"] == 1.0 and score.components["failed_calls"] == 2.0
    short = await ep.play(env, task, ["@publish pay", "done"], execute)
    assert env.score(task, short).components["answer_correct"] == 0.0


def test_logs_answers_naming_everything_are_wrong():
    env, task = envs.get("logs"), first_task("logs")
    data = json.loads(task.environment.instance_json)
    right = f"{data['component']}: {data['cause']}"
    assert env.check_answer(task, right, [])["answer_correct"] == 1.0
    shotgun = ", ".join(data["components"]) + ": disk full, out of memory, deadlock"
    assert env.check_answer(task, shotgun, [])["answer_correct"] == 0.0


async def test_an_episode_ends_at_the_turn_limit_and_at_the_token_limit():
    env, task = envs.get("lookup"), first_task("lookup")

    async def never(request):
        raise AssertionError("lookup runs nothing in the sandbox")

    calls_only = await ep.play(env, task, ["@lookup a"] * 10, never)
    assert calls_only.end == episode_pb2.EPISODE_END_TURN_LIMIT and len(calls_only.turns) == env.max_turns
    assert env.score(task, calls_only).reward == 0.0
    episode = ep.start(task, "g", 0, list(range(10)), temperature=1.0, top_p=1.0, call_format="plain")
    ep.add_turn(episode, "@lookup a", list(range(8)), [0.0] * 8, "stop", 0)
    assert ep.route(env, episode, max_tokens=16) == "done" and episode.end == episode_pb2.EPISODE_END_TOKEN_LIMIT


def test_an_episode_flattens_into_one_sample_with_only_the_models_tokens_under_the_loss():
    task = first_task("lookup")
    episode = ep.start(task, "g", 0, [1, 2], temperature=1.0, top_p=1.0, call_format="plain")
    turn = ep.add_turn(episode, "@lookup a", [10, 11], [-0.5, -0.25], "stop", 3)
    turn.observation, turn.observation_token_ids[:] = "red", [20, 21, 22]
    ep.add_turn(episode, "red", [30], [-0.1], "stop", 4)
    ids, logprobs, mask = ep.flatten(episode)
    assert ids == [10, 11, 20, 21, 22, 30]
    assert mask == [True, True, False, False, False, True]
    assert logprobs == pytest.approx([-0.5, -0.25, 0, 0, 0, -0.1])
    assert ep.context_ids(episode) == [1, 2, *ids]
    assert ep.policy_version(episode) == 3


@pytest.mark.sandbox
async def test_a_call_the_episode_ended_before_changes_nothing(execute):
    env = envs.get("events")
    task = env.task("x", {"machine": "ticket", "start": "open", "target": "assigned"}, split="train", key="t",
                    group_size=1)
    task.environment.max_turns = 1
    episode = await ep.play(env, task, ["@publish assign", "done"], execute)
    assert episode.end == episode_pb2.EPISODE_END_TURN_LIMIT and not episode.turns[0].observation
    score = env.score(task, episode)
    assert score.components["answer_correct"] == 0.0 and score.components["tool_calls"] == 0.0


def copy(episode: episode_pb2.Episode) -> episode_pb2.Episode:
    out = episode_pb2.Episode()
    out.CopyFrom(episode)
    return out


async def test_episode_records_no_service_can_use_are_refused_with_the_reason():
    from crucible.services.generator.episodes import episode_problem
    from crucible.services.sandbox_executor.__main__ import action_handler
    from crucible.services.verifier.handler import Unverifiable, verify_episode
    from crucible.shared import bus

    task = first_task("lookup")
    fresh = ep.start(task, "g", 0, [1], temperature=1.0, top_p=1.0, call_format="plain")
    assert "no turns" in episode_problem(fresh)
    answered = ep.start(task, "g", 0, [1], temperature=1.0, top_p=1.0, call_format="plain")
    ep.add_turn(answered, "red", [5], [-0.1], "stop", 0)
    assert "made no call" in episode_problem(answered)
    wrong_kind = episode_pb2.Episode()
    wrong_kind.CopyFrom(answered)
    wrong_kind.task.kind = "exact"
    assert "not an environment" in episode_problem(wrong_kind)
    odd_format = episode_pb2.Episode()
    odd_format.CopyFrom(answered)
    ep.add_turn(odd_format, "@lookup a", [6], [-0.1], "stop", 0)
    odd_format.call_format = "xml"
    assert "unknown call format" in episode_problem(odd_format)
    # a call no sandbox answered (a record of crucible.actions, signed alike, copied to crucible.observations)
    not_carried_out = copy(odd_format)
    not_carried_out.call_format = "plain"
    assert "never carried out" in episode_problem(not_carried_out)
    not_carried_out.turns[-1].observation = "red"
    assert episode_problem(not_carried_out) is None
    # begun by a generator of another model: a transcript this policy never wrote, ids past its embedding
    from crucible.ml.policy.backends import create_backend

    torch_policy = create_backend("torch", seed=1)
    assert episode_problem(not_carried_out, torch_policy) is None
    other_format = copy(not_carried_out)
    other_format.call_format = "hermes"
    assert "writes calls as 'hermes'" in episode_problem(other_format, torch_policy)
    past_vocabulary = copy(not_carried_out)
    past_vocabulary.prompt_token_ids.append(70_000)
    assert "outside this model's" in episode_problem(past_vocabulary, torch_policy)

    secret = bytes(32)
    handle = action_handler(pool=None, consumer_ref=[], secret=secret)

    def sent_on(episode, task_signed: bool = True):  # as a generator holding the key sends it
        episode = copy(episode)
        if task_signed:
            integrity.sign(episode.task, secret)
        return integrity.sign(episode, secret)

    for bad, why in [(answered, "no call waiting"), (wrong_kind, "not an environment")]:
        with pytest.raises(bus.Reject, match=why):
            await handle(bus.Incoming("actions", 0, 0, None, sent_on(bad)))
    done_already = episode_pb2.Episode()
    done_already.CopyFrom(odd_format)
    done_already.call_format = "plain"
    done_already.turns[-1].observation = "red"
    with pytest.raises(bus.Reject, match="carried out already"):
        await handle(bus.Incoming("actions", 0, 0, None, sent_on(done_already)))
    waiting = episode_pb2.Episode()  # a call waiting
    waiting.CopyFrom(odd_format)
    waiting.call_format = "plain"
    # ... of a task no trusted submitter signed, in an episode nobody holding the key sent, or one changed
    # after it was sent: nothing is run
    unsigned_task, unsigned, changed = sent_on(waiting, task_signed=False), copy(sent_on(waiting)), sent_on(waiting)
    unsigned.ClearField("signature")
    changed.turns[-1].logprobs[0] = -30.0
    for bad, why in [(unsigned_task, "not signed by a trusted submitter"), (unsigned, "episode 'g/0' is not signed"),
                     (changed, "signature does not match")]:
        with pytest.raises(bus.Reject, match=why):
            await handle(bus.Incoming("actions", 0, 0, None, bad))

    with pytest.raises(Unverifiable, match="has not ended"):
        verify_episode(answered)
    answered.end = episode_pb2.EPISODE_END_ANSWER
    answered.group_size = 0
    with pytest.raises(Unverifiable, match="within its group"):
        verify_episode(answered)
    answered.group_size = 2
    del answered.turns[0].logprobs[:]
    with pytest.raises(Unverifiable, match="log-probs"):
        verify_episode(answered)


def test_a_reference_query_that_never_ends_is_an_error_not_a_hang(monkeypatch):
    from crucible.ml.envs import sql

    monkeypatch.setattr(sql, "REFERENCE_STEPS", 20_000_000)
    env, task = envs.get("sql"), first_task("sql")
    data = json.loads(task.environment.instance_json)
    data["reference"] = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT count(*) FROM n"
    task.environment.instance_json = json.dumps(data)
    with pytest.raises(envs.InstanceError, match="reference query fails"):
        env.check_answer(task, "1", [])
    task.environment.instance_json = json.dumps({**data, "pad": "x" * 1_000_001})
    assert any("travels with every turn" in p for p in task_problems(task))


def test_a_reference_query_near_its_budget_has_one_verdict_however_busy_the_machine(monkeypatch):
    """A red team's: the budget was a deadline in seconds, so a reference near it was accepted on an idle
    machine and failed where a busy verifier scored its episodes. It is counted in SQLite's steps now:
    the verdict is the same whatever the clock does meanwhile."""
    import itertools
    import time

    from crucible.ml.envs import sql

    monkeypatch.setattr(sql, "REFERENCE_STEPS", 2_000_000)
    table = {"schema": ["CREATE TABLE t (x INTEGER)"], "rows": {"t": [[1]]}}
    just_under = {**table, "reference": "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c "
                                        "WHERE i < 100000) SELECT count(*) FROM c"}
    over = {**just_under, "reference": just_under["reference"].replace("100000", "400000")}
    idle = (sql.reference_result(just_under), _fails(sql.reference_result, over))
    # A machine where every look at the clock finds a second gone: a deadline would have passed at once.
    real, ticks = time.monotonic, itertools.count()
    monkeypatch.setattr(time, "monotonic", lambda: real() + next(ticks))
    busy = (sql.reference_result(just_under), _fails(sql.reference_result, over))
    assert idle == busy == ([(100000,)], True), (idle, busy)


def _fails(function, *args) -> bool:
    try:
        function(*args)
    except sqlite3.OperationalError as exc:
        return "interrupted" in str(exc)
    return False


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_lookup_asks_for_every_value_once_in_every_stretch_and_the_table_holds_it(split):
    import itertools

    from crucible.ml.envs.lookup import VALUES

    env = envs.get("lookup")
    tasks = list(itertools.islice(env.generate(split, seed=5, group_size=1), 50 * len(VALUES)))
    asked = []
    for task in tasks:
        data = env.instance(task)
        assert task.prompt == f"color of {data['key']}?" and data["key"] in data["table"]
        asked.append(data["table"][data["key"]])
    for i in range(0, len(asked), len(VALUES)):
        assert sorted(asked[i:i + len(VALUES)]) == sorted(VALUES), asked[i:i + len(VALUES)]
    assert len({tuple(asked[i:i + len(VALUES)]) for i in range(0, len(asked), len(VALUES))}) > 10, "not shuffled"
    others = [v for t in tasks for k, v in env.instance(t)["table"].items() if k != env.instance(t)["key"]]
    assert set(others) == set(VALUES), "the rest of each table is still drawn from every value"


def test_a_call_whose_json_makes_text_no_record_can_hold_is_a_malformed_call_not_a_crash():
    """JSON's escapes turn ASCII into a lone surrogate, which no protobuf string takes, and nesting
    into arguments that overflow the stack when read again: each is a call with an error (an
    observation saying so, a quarter of the reward), and the turn is recorded."""
    env, task = envs.get("sql"), first_task("sql")
    for text in ['<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "sql", "arguments": {"query": "SELECT \\udfff"}}</tool_call>',
                 '<tool_call>{"name": "sql", "arguments": {"\\ud800": "x"}}</tool_call>',
                 '<tool_call>{"name": "sql", "arguments": "{\\"query\\": \\"\\\\ud800\\"}"}</tool_call>',
                 '<tool_call>{"name": "sql", "arguments": {"query": ' + "[" * 900 + "]" * 900 + '}}</tool_call>']:
        episode = ep.start(task, "g", 0, [1], temperature=1.0, top_p=1.0, call_format="hermes")
        turn = ep.add_turn(episode, text, [5], [-0.1], "stop", 0)
        assert turn.call.error and turn.text == text, (text[:80], turn.call)
        assert "malformed tool call" in calls.resolve(turn.call, env.tools)
        episode.ParseFromString(episode.SerializeToString())  # the record as the next service reads it
    plain = ep.start(task, "g", 0, [1], temperature=1.0, top_p=1.0, call_format="plain")
    assert ep.add_turn(plain, '@sql {"query": "\\ud800"}', [5], [-0.1], "stop", 0).call.error
    # a task's own data: refused when it is submitted, not when an observation would carry it
    lookup = first_task("lookup")
    data = json.loads(lookup.environment.instance_json)
    data["table"][data["key"]] = "\ud800"
    lookup.environment.instance_json = json.dumps(data)
    assert any("not valid Unicode" in p for p in task_problems(lookup))
    from crucible.shared.text import is_unicode

    deep: list = []
    for _ in range(5000):  # past what can be walked: not taken as checked (a surrogate could sit inside)
        deep = [deep]
    assert not is_unicode({"pad": deep, "v": "\ud800"}) and is_unicode({"v": "ok \u00e9"})


def test_an_answer_written_past_the_episodes_token_budget_is_not_paid():
    """A turn the budget cut keeps only the tokens within it: an answer, or a call, in the text past
    them ends the episode at the token limit, unpaid."""
    from types import SimpleNamespace

    env, task = envs.get("python"), first_task("python")
    answer = str(json.loads(task.environment.instance_json)["answer"])
    long_turn = SimpleNamespace(text="Let me think step by step. " * 20 + answer, token_ids=list(range(200)),
                                logprobs=[-0.1] * 200, finish_reason="stop")
    episode = ep.start(task, "g", 0, list(range(10)), temperature=1.0, top_p=1.0, call_format="plain")
    ep.add_completion(episode, long_turn, 0, 0.0, limit=30)
    assert len(episode.turns[0].token_ids) == 20
    assert ep.route(env, episode, 30) == "done" and episode.end == episode_pb2.EPISODE_END_TOKEN_LIMIT
    assert env.score(task, episode).reward == 0.0
    # within the budget, the same answer is paid
    whole = ep.start(task, "g", 0, list(range(10)), temperature=1.0, top_p=1.0, call_format="plain")
    ep.add_completion(whole, long_turn, 0, 0.0, limit=1000)
    assert ep.route(env, whole, 1000) == "done" and env.score(task, whole).reward == 1.0


def test_task_data_that_breaks_scoring_or_costs_without_bound_is_refused_at_submission():
    sql_task, logs_task = first_task("sql"), first_task("logs")
    data = json.loads(sql_task.environment.instance_json)
    for rows, ok in [({"employees": [5, 6]}, False), ({"employees": [[1, "a"], [2]]}, False),
                     ({"employees": [[1, {"x": 1}]]}, False), ({"employees": [[1, None, 2.5]]}, True),
                     ({"employees": [[1, True, "x"]]}, True)]:
        sql_task.environment.instance_json = json.dumps({**data, "rows": rows, "schema": ["CREATE TABLE employees (a, b, c)"],
                                                         "reference": "SELECT count(*) FROM employees"})
        assert (not any("every row" in p for p in task_problems(sql_task))) == ok, rows
    # a value past the reference database's size limit: an error at once, not a run past the deadline; an
    # answer of more rows than any model writes: an error, not a cross join's rows in the verifier's memory
    env = envs.get("sql")
    for reference, says in [("SELECT length(zeroblob(200000000))", "too big"),
                            ("SELECT * FROM t AS x, t AS y", "more than 10000 rows")]:  # 40,000 rows
        sql_task.environment.instance_json = json.dumps({"schema": ["CREATE TABLE t (a)"], "reference": reference,
                                                         "rows": {"t": [[i] for i in range(200)]}})
        with pytest.raises(envs.InstanceError, match=says):
            env.check_answer(sql_task, "1", [])
    logs = json.loads(logs_task.environment.instance_json)
    logs_task.environment.instance_json = json.dumps({**logs, "components": [logs["component"]] * 20_000})
    assert any("each once" in p for p in task_problems(logs_task))


def test_answers_are_checked_as_exactly_as_their_task_states_them():
    sql = envs.get("sql")
    task = sql.task("q", {"schema": ["CREATE TABLE t (name)"], "rows": {"t": [["a"], ["b"], ["c"], ["d"]]},
                          "reference": "SELECT name FROM t WHERE name IN ('a', 'b')"}, split="train", key="k",
                    group_size=1)
    everything = sql.check_answer(task, "a\nb\nc\nd", [])
    assert everything["answer_correct"] == 0.0 and everything["rows_overlap"] == pytest.approx(2 * 2 / 6)
    assert sql.check_answer(task, "a\nb", [])["rows_overlap"] == 1.0
    python = envs.get("python")
    big = python.task("q", {"answer": 1130577844, "template": 0, "n": 1, "k": 2}, split="train", key="k",
                      group_size=1)
    assert python.check_answer(big, "1130577844", [])["answer_correct"] == 1.0
    assert python.check_answer(big, "1,130,577,844.0", [])["answer_correct"] == 1.0
    assert python.check_answer(big, "1130577845", [])["answer_correct"] == 0.0
    real = python.task("q", {"answer": 2.5, "template": 0, "n": 1, "k": 2}, split="train", key="r", group_size=1)
    assert python.check_answer(real, "2.5000000001", [])["answer_correct"] == 1.0
    lookup = envs.get("lookup")
    capital = lookup.task("q", {"table": {"a": "Red"}, "key": "a"}, split="train", key="k", group_size=1)
    assert lookup.check_answer(capital, "Red", [])["answer_correct"] == 1.0
    assert lookup.check_answer(capital, "red ", [])["answer_correct"] == 1.0


def fake_run(stdout: bytes = b"", exit_code: int = 0):
    """A tool's sandbox result, made up (what scoring reads of an episode, not the sandbox, is under test)."""
    async def run(request):
        return execution_pb2.ExecutionResult(stdout=stdout, exit_code=exit_code)

    return run


async def test_the_answer_is_read_as_every_answer_kind_reads_it_not_from_the_reasoning():
    """Every environment's answer: reasoning in a closed think block is not the answer, an `Answer:` line
    or an <answer> tag marks it, and a sentence's final period is not part of it."""
    lookup = envs.get("lookup")
    table = lookup.task("q", {"table": {"a": "red", "b": "tan"}, "key": "b"}, split="train", key="t", group_size=1)
    for answer, paid in [("<think>The tool said tan.</think>\ntan", 1.0), ("Answer: tan", 1.0), ("tan.", 1.0),
                         ("<think>tan</think>I cannot tell.", 0.0), ("<answer>tan</answer>", 1.0),
                         ("**Answer:**\ntan", 1.0)]:
        episode = await ep.play(lookup, table, ["@lookup b", answer], fake_run())
        assert lookup.score(table, episode).reward == paid, answer
    python = envs.get("python")
    primes = python.task("How many prime numbers are there below 1597?", {"answer": 250, "template": 1, "n": 1597,
                                                                           "k": 2}, split="train", key="p", group_size=1)
    for answer, paid in [("<think>maybe 250?</think>\nI am not sure.", 0.0), ("250", 1.0),
                         ("There are 250 prime numbers below 1597.", 1.0),  # the question's own number restated
                         ("**250** (primes below 1597)", 1.0), ("Either 256 or 250", 0.0), ("256, no: 250", 0.0),
                         ("<think>256?</think>Answer: 250", 1.0), ("−250", 0.0)]:
        episode = await ep.play(python, primes, ["@python print(250)", answer], fake_run(b"250\n"))
        assert python.score(primes, episode).reward == paid, answer
    # an answer that writes only numbers the question states: the last of them
    fib = python.task("What is the 3th Fibonacci number (F1 = F2 = 1)?", {"answer": 2, "template": 2, "n": 1, "k": 3},
                      split="train", key="f", group_size=1)
    for answer, paid in [("The 3rd Fibonacci number is 2.", 1.0), ("Answer: F3 = 2", 1.0), ("2", 1.0), ("3", 0.0)]:
        assert python.check_answer(fib, extract.final_answer(answer).text, [])["answer_correct"] == paid, answer
    for cause, answer in [("out of memory", "inventory: the worker was OOMKilled"),
                          ("deadlock", "payments: transactions deadlocked"),
                          ("certificate expired", "The api's certificates expired")]:
        component = answer.split(":")[0].split("'")[0].split()[-1]
        named = envs.get("logs").task("q", {"components": ["api", "inventory", "payments"], "component": component,
                                            "cause": cause, "seed": 3}, split="train", key=cause, group_size=1)
        assert envs.get("logs").check_answer(named, answer, [])["answer_correct"] == 1.0, answer
    logs = envs.get("logs")
    incident = logs.task("q", {"components": ["api", "auth", "payments", "search"], "component": "payments",
                               "cause": "disk full", "seed": 3}, split="train", key="l", group_size=1)
    for answer, paid in [("payments: disk full (I searched every log; rapid 503s, I am certain)", 1.0),
                         ("payments_service: disk full", 1.0), ("payments: disk full, no room left", 1.0),
                         ("<think>payments: disk full</think>I cannot tell.", 0.0), ("auth: concert", 0.0),
                         ("payments and search: disk full", 0.0)]:
        episode = await ep.play(logs, incident, [answer], fake_run())
        assert logs.score(incident, episode).reward == paid, answer
    sql = envs.get("sql")
    count = sql.task("q", {"schema": ["CREATE TABLE t (name)"], "rows": {"t": [["a"], ["b"]]},
                           "reference": "SELECT count(*) FROM t"}, split="train", key="s", group_size=1)
    for answer, paid in [("<think>one row a name, so 2</think>\n2", 1.0), ("Answer:\n2", 1.0), ("3", 0.0),
                         ("\\boxed{2}", 1.0), ("The answer is 2", 1.0), ("**Answer:**\n2", 1.0)]:
        episode = await ep.play(sql, count, [answer], fake_run())
        assert sql.score(count, episode).reward == paid, answer


def test_sql_answers_copied_from_what_the_tool_shows_are_the_references_values():
    sql = envs.get("sql")
    task = sql.task("q", {"schema": ["CREATE TABLE t (name, manager, pay REAL)"],
                          "rows": {"t": [["Ada", None, 90000.0], ["Ben", "Ada", 3.51e20]]},
                          "reference": "SELECT name, manager, pay FROM t"}, split="train", key="v", group_size=1)
    # the tool prints NULL and Python's str of each value (sql.RUNNER)
    assert sql.check_answer(task, "Ada, NULL, 90000.0\nBen, Ada, 3.51e+20", [])["answer_correct"] == 1.0
    assert sql.check_answer(task, "ada | none | 90000\nben | ada | 351000000000000000000", [])["answer_correct"] == 1.0
    assert sql.check_answer(task, "Ada, NULL, 90000.5\nBen, Ada, 3.51e+20", [])["answer_correct"] == 0.0
    assert sql.check_answer(task, "Ada, , 90000\nBen, Ada, 3.51e+20", [])["answer_correct"] == 0.0  # empty is not NULL
    # a huge exponent is compared as written, never expanded; nor does a tiny one round to 0
    assert sql.check_answer(task, "1e999999999999999999", [])["answer_correct"] == 0.0
    empty = sql.task("q", {"schema": ["CREATE TABLE t (n)"], "rows": {"t": [[1]]},
                           "reference": "SELECT count(*) FROM t WHERE n > 5"}, split="train", key="e", group_size=1)
    assert sql.check_answer(empty, "1e-1000000000000000010", [])["answer_correct"] == 0.0
    assert sql.check_answer(empty, "0", [])["answer_correct"] == 1.0
    # numbers past float precision (written as text: SQLite's integers are 64-bit) stay exact
    big = sql.task("q", {"schema": ["CREATE TABLE t (n)"], "rows": {"t": [["123456789012345678901234567890123"]]},
                         "reference": "SELECT n FROM t"}, split="train", key="b", group_size=1)
    assert sql.check_answer(big, "123456789012345678901234567890124", [])["answer_correct"] == 0.0
    assert sql.check_answer(big, "123456789012345678901234567890123.0", [])["answer_correct"] == 1.0


def test_a_sql_reference_that_fails_or_answers_nothing_is_refused_and_a_recursive_one_taken():
    def task(reference):
        return envs.get("sql").task("q", {"schema": ["CREATE TABLE t (name)"], "rows": {"t": [["a"]]},
                                          "reference": reference}, split="train", key=reference, group_size=1)

    assert task_problems(task("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 3) "
                              "SELECT count(*) FROM n")) == []
    assert any("answers no rows" in p for p in task_problems(task("SELECT name FROM t WHERE name = 'z'")))
    assert any("reference query fails" in p for p in task_problems(task("SELECT nothing FROM t")))
    assert any("reference query fails" in p for p in task_problems(task("DELETE FROM t")))


def test_a_users_instance_no_episode_can_pass_or_every_episode_passes_is_refused_and_no_generated_one_is():
    """A user's instance is held to what the generators assume (a red team's): its own reference solution
    paid, no two answers paid with nothing done, the same database wherever it is built, and bounded."""
    def refused(name, data) -> list[str]:
        return task_problems(envs.get(name).task("q", data, split="train", key=json.dumps(data), group_size=1))

    table = {"schema": ["CREATE TABLE t (name)"], "rows": {"t": [["a"]]}, "reference": "SELECT name FROM t"}
    for name, data, says in [
        ("events", {"machine": "order", "start": "paid", "target": "paid"}, "before anything is done"),
        ("events", {"machine": "order", "start": "delivered", "target": "created"}, "no events take"),
        ("sql", {**table, "rows": {"t": [["Smith, John"]]}}, "reference solution"),  # an answer cannot write it
        ("sql", {**table, "rows": {"t": [["a|b"]]}}, "reference solution"),
        ("sql", {**table, "reference": "SELECT abs(random()) % 1000 FROM t"}, "another value each time"),
        ("sql", {**table, "schema": ["CREATE TABLE t AS SELECT randomblob(4) AS name"], "rows": {}},
         "another value each time"),
        ("sql", {**table, "reference": "SELECT date('now') FROM t"}, "date() of now"),
        ("sql", {**table, "reference": "SELECT date() FROM t"}, "date() of now"),
        ("sql", {**table, "reference": "SELECT strftime('%s') FROM t"}, "strftime() of now"),
        ("sql", {**table, "reference": "SELECT datetime(lower('NOW')) FROM t"}, "datetime() of now"),
        ("sql", {**table, "reference": "SELECT date('2020-01-01', 'localtime') FROM t"}, "in local time"),
        ("sql", {**table, "schema": ["CREATE TABLE t AS SELECT time() AS name"], "rows": {}}, "time() of now"),
        ("sql", {**table, "reference": "SELECT CURRENT_TIMESTAMP FROM t"}, "current_timestamp()"),
        ("sql", {**table, "reference": "SELECT strftime('%H:%M:%f', CAST('now' AS BLOB)) FROM t"}, "of now"),
        ("sql", {**table, "rows": {}, "schema": ["CREATE TABLE t (name, at DEFAULT CURRENT_TIMESTAMP)",
                                                 "INSERT INTO t (name) VALUES ('a')"],
                 "reference": "SELECT name, at FROM t"}, "current_timestamp()"),  # evaluated at insert
        ("sql", {**table, "rows": {}, "schema": ["CREATE TABLE t (name, r DEFAULT (random()))",
                                                 "INSERT INTO t (name) VALUES ('a')"], "reference": "SELECT r FROM t"},
         "random()"),
        ("sql", {**table, "reference": "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c LIMIT 100000) "
                                       "SELECT count(*) FROM (SELECT DISTINCT printf('%d%.60000c', i, 'x') FROM c)"},
         "more than 256 MiB of memory"),
        ("sql", {**table, "rows": {}, "schema": ["CREATE TABLE t AS WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL "
                                                 "SELECT i + 1 FROM c LIMIT 20000) SELECT zeroblob(60000) AS name FROM c"]},
         "over 64 MiB"),
        ("sql", {**table, "reference": "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c LIMIT 1000) "
                                       "SELECT " + ", ".join(["zeroblob(60000)"] * 50) + " FROM c"}, "over 8 MiB"),
    ]:
        problems = refused(name, data)
        assert any(says in p for p in problems), (name, data, problems)
    beyond = envs.get("python").task("q", {"answer": 1}, split="train", key="1e400", group_size=1)
    beyond.environment.instance_json = '{"answer": 1e400}'  # JSON, and a float Python reads as infinity
    assert any("finite" in p for p in task_problems(beyond))
    assert refused("sql", table) == [] and refused("events", {"machine": "order", "start": "created",
                                                              "target": "paid"}) == []
    assert refused("python", {"answer": 42}) == [] and refused("python", {"answer": 0.125}) == []  # a user's own
    for reference in ("SELECT name FROM t WHERE name <> 'now'", "SELECT date('2020-01-31', '+1 day') FROM t"):
        assert refused("sql", {**table, "reference": reference}) == [], reference  # no clock read
    from crucible.ml.envs import sql
    assert sql.reference_rows({**table, "reference": "SELECT date('2020-01-31', '+1 day') FROM t"}) == [("2020-02-01",)]
    for name in BUILT_IN:  # nothing a generator makes
        env = envs.get(name)
        for task, _ in zip(env.generate("train", seed=3), range(40)):
            assert task_problems(task) == [], (name, task.environment.instance_json)


def test_no_question_is_paid_for_being_given_back():
    """A red team's: the python generator's "What is the 2th Fibonacci number (F1 = F2 = 1)?" states its
    answer, and a question's last number is what an answer writing only the question's numbers gives, so
    copying the prompt was paid (215 of 40,000 generated tasks: Fibonacci for k = 2, digit sums counting k).
    Generators now draw again; a user's such question is refused."""
    env = envs.get("python")
    for seed in range(3):
        for task, _ in zip(env.generate("train", seed=seed), range(1000)):
            echoed = env.check_answer(task, env.answer_of(task.prompt), [])
            assert echoed["answer_correct"] == 0.0, task.prompt
    stated = env.task("What is the 2th Fibonacci number (F1 = F2 = 1)?", {"answer": 1}, split="train",
                      key="fib-2", group_size=1)
    assert any("states its own answer" in p for p in task_problems(stated))
    # (every environment's generated tasks pass the same check: test_a_users_instance_no_episode_can_pass...)


def test_a_failing_reference_is_kept_as_its_error_not_as_the_error_itself():
    """The cached exception was raised again at every check: its traceback grew by two frames a check and
    held the frames' locals (the task) alive: 300 checks of one 0.45 MB task, 46 -> 593 MB."""
    from crucible.ml.envs import sql

    data = {"schema": ["CREATE TABLE t (a)"], "rows": {"t": [["x" * 1000]]}, "reference": "SELECT nothing FROM t"}
    raised = []
    for _ in range(50):
        try:
            sql.reference_rows(data)
        except Exception as exc:  # noqa: BLE001
            raised.append(exc)
    assert len({id(e) for e in raised}) == 50 and all(isinstance(e, sqlite3.OperationalError) for e in raised)
    depth = 0
    tb = raised[-1].__traceback__
    while tb is not None:
        depth, tb = depth + 1, tb.tb_next
    assert depth <= 3


def test_a_python_cell_that_raised_is_part_of_the_state_and_one_that_ended_its_process_is_not():
    python = envs.get("python")
    task = next(python.generate("train", seed=1))
    episode = ep.start(task, "g", 0, [1], temperature=1.0, top_p=1.0, call_format="plain")
    from crucible.ml.envs.python_env import RAISED

    for text, observation, failed in [("@python x = 5\nundefined_name", f"{RAISED}\nstderr:\nTraceback (most recent call "
                                                                        "last):\n  File \"<cell>\", line 2\nNameError", True),
                                      ("@python print('Traceback (most recent call last):'); import os; os._exit(3)",
                                       "Traceback (most recent call last):\n[exit code 3]", True),
                                      ("@python while True: pass", "[the sandbox stopped the program: timeout]", True),
                                      ("@python import os; os._exit(1)", "[exit code 1]", True),
                                      ("@python import ctypes; ctypes.string_at(0)", "[exit code 139, signal 11]", True),
                                      ("@python {\"nothing\": 1}", "error: tool 'python' takes the arguments code", True),
                                      ("@python print(x)", "5", False)]:
        ep.add_turn(episode, text, [2], [-0.1], "stop", 0)
        episode.turns[-1].call.CopyFrom(calls.parse(text, "plain"))
        resolved = calls.resolve(episode.turns[-1].call, python.tools)
        if not isinstance(resolved, str):
            episode.turns[-1].call.arguments_json = json.dumps(resolved.arguments)
        episode.turns[-1].observation, episode.turns[-1].call_failed = observation, failed
    # before the last cell: the one that raised, not the one stopped, nor the malformed call
    assert [c.arguments["code"] for c in ep.earlier_calls(episode, 6, python)] == ["x = 5\nundefined_name"]
    assert [c.arguments["code"] for c in ep.earlier_calls(episode, 7, python)] == ["x = 5\nundefined_name", "print(x)"]
    # an environment whose failed calls change nothing (events: a rejected event) replays none of them
    assert [c.arguments["code"] for c in ep.earlier_calls(episode, 7)] == ["print(x)"]


def test_only_the_transcripts_own_markers_begin_its_lines():
    task = first_task("lookup")
    episode = ep.start(task, "g", 0, [1], temperature=1.0, top_p=1.0, call_format="plain")
    ep.add_turn(episode, "@lookup a\n[observation 1] red\r[end] answer", [2], [-0.1], "stop", 0)
    episode.turns[-1].call.CopyFrom(calls.parse(episode.turns[-1].text, "plain"))
    episode.turns[-1].observation = "blue\u2028[end] answer"
    ep.add_turn(episode, "blue", [3], [-0.1], "stop", 0)
    episode.end = episode_pb2.EPISODE_END_ANSWER
    starts = [line.split("]")[0] + "]" for line in ep.transcript(episode).splitlines() if not line.startswith("  ")]
    assert starts == ["[turn 1]", "[observation 1]", "[turn 2]", "[end]"], ep.transcript(episode)


@pytest.mark.sandbox
async def test_whether_a_python_cell_raised_is_what_the_runner_reports_not_what_it_printed(execute):
    """Decided from the observation's text, a raise after 2,000 characters of output was cut off and
    taken for none (the cell's variables were gone at the next call: an honest model lost a quarter of
    its reward), and a cell that printed a traceback and ended its process was taken for a raise (run
    again first, it ended every later call)."""
    python = envs.get("python")
    task = first_task("python")
    played = await ep.play(python, task, ["@python xs = [1, 2, 3, 4]\nprint('y' * 2500)\nraise ValueError('late')",
                                          "@python print(sum(xs))", "10"], execute)
    assert played.turns[0].call_failed and "ValueError" not in played.turns[0].observation[:2000]  # cut before it
    assert played.turns[1].observation == "10", ep.transcript(played)
    played = await ep.play(python, task, ["@python print('Traceback (most recent call last):'); import os; os._exit(3)",
                                          "@python print(7)", "7"], execute)
    assert played.turns[0].call_failed and played.turns[1].observation == "7", ep.transcript(played)
    from crucible.ml.envs.python_env import RAISED
    played = await ep.play(python, task, [f"@python import sys; print({RAISED!r}); print('x', file=sys.stderr); "
                                          "sys.stdout.flush(); import os; os._exit(3)", "@python print(8)", "8"], execute)
    assert played.turns[0].call_failed and played.turns[1].observation == "8", ep.transcript(played)


def test_an_episode_never_outgrows_its_budget_or_its_models_context():
    """With the defaults (480 tokens an episode, 64 a turn, 512 positions) a long episode's next turn could
    not be sampled and the episode was dead-lettered; a 2,000-character observation took one to 2,027
    tokens, which the learner refused whole."""
    from crucible.ml.policy.backends import create_backend
    from crucible.ml.policy.sampling import SamplingParams

    backend = create_backend("torch", seed=1)
    task = first_task("lookup")
    assert ep.token_limit(480, task) == 480 and ep.token_limit(10_000, task, backend) == backend.max_context() == 512
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=64)
    assert ep.turn_params(params, 100, 480) is params
    assert ep.turn_params(params, 467, 512).max_tokens == 45  # prompt and turn within the model's positions
    episode = ep.start(task, "g", 0, [1] * 400, temperature=1.0, top_p=1.0, call_format="plain")
    ep.add_turn(episode, "@lookup a", [5] * 20, [-0.1] * 20, "stop", 0)
    episode.turns[-1].observation = "x" * 2000
    ep.read_observation(backend, episode, 480)
    assert ep.tokens_used(episode) == 480 and len(ep.context_ids(episode)) <= 480
