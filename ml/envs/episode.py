"""One episode's life, as pure steps every service (and the local evaluator) shares.

    generator:         episode = start(...)            -> route(episode): "act" or "done"
    sandbox-executor:  await act(env, episode, execute) (the last turn's call gets its observation)
    generator:         context_ids(episode) + observation ids -> next turn -> add_turn -> route
    verifier:          env.score(task, episode); flatten(episode) is the trainer's sample

An episode ends at an answer (a turn with no call), at the environment's turn limit, at the token
limit (the whole transcript), or when the environment says its state is final.
"""
from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Awaitable, Callable

from crucible.ml.envs import calls as call_parser
from crucible.ml.envs.base import Call, Environment, Observation, cut
from crucible.shared.text import valid_text
from crucible.v1 import episode_pb2, execution_pb2, rollout_pb2, task_pb2

Execute = Callable[[execution_pb2.ExecuteRequest], Awaitable[execution_pb2.ExecutionResult]]
FINISH = {"stop": rollout_pb2.FINISH_REASON_STOP, "length": rollout_pb2.FINISH_REASON_LENGTH}
VIOLATION_DETAIL_CHARS = 300


def start(task: task_pb2.Task, group_id: str, index: int, prompt_ids: list[int], *, temperature: float,
          top_p: float, call_format: str, generator_id: str = "", backend: str = "") -> episode_pb2.Episode:
    episode = episode_pb2.Episode(
        id=f"{group_id}/{index}", group_id=group_id, index=index, group_size=task.group_size, task=task,
        prompt_token_ids=prompt_ids, temperature=temperature, top_p=top_p, call_format=call_format,
        generator_id=generator_id, backend=backend)
    episode.created_at.FromDatetime(dt.datetime.now(dt.timezone.utc))
    return episode


def add_turn(episode: episode_pb2.Episode, text: str, token_ids: list[int], logprobs: list[float],
             finish_reason: str, policy_version: int, sample_ms: float = 0.0) -> episode_pb2.Turn:
    """Appends the model's turn, with the call it makes (None: an answer)."""
    text = valid_text(text)
    call = call_parser.parse(text, episode.call_format)  # before the turn is added: a raise leaves the episode as it was
    turn = episode.turns.add(token_ids=token_ids, logprobs=logprobs, text=text, policy_version=policy_version,
                             finish_reason=FINISH.get(finish_reason, 0))
    if call is not None:
        turn.call.CopyFrom(call)
    episode.sample_ms += sample_ms
    return turn


def token_limit(max_episode_tokens: int, task: task_pb2.Task, backend=None) -> int:
    """The episode's token budget: the run's, or the task's own when it asks for fewer; never more than
    `backend`'s model attends to (with the defaults, 480 tokens and 64 a turn on 512 positions, a long
    episode's next turn could not be sampled, and the episode was dead-lettered)."""
    own = task.environment.max_tokens
    limit = min(max_episode_tokens, own) if own else max_episode_tokens
    context = backend.max_context() if backend is not None else None
    return min(limit, context) if context else limit


def turn_params(params, context_tokens: int, limit: int):
    """`params` for the next turn of an episode holding `context_tokens`: as many new tokens as the budget
    leaves at most (a turn past it is cut anyway, and the model cannot sample past its context)."""
    import dataclasses

    room = limit - context_tokens
    return params if params.max_tokens <= room else dataclasses.replace(params, max_tokens=max(1, room))


def prompt_ids(backend, task: task_pb2.Task) -> list[int]:
    """The ids an episode of `task` starts from, as `backend`'s policy expects tools to be presented."""
    from crucible.ml import envs

    env = envs.get(task.kind)
    return backend.episode_prompt_ids(env.instructions(task, backend.call_format), [t.schema() for t in env.tools],
                                      call_parser.describe_hermes(env.tools))


def add_completion(episode: episode_pb2.Episode, completion, policy_version: int, sample_ms: float,
                   limit: int) -> episode_pb2.Turn:
    """Adds a sampled completion as the next turn, cut where the episode's token budget ends."""
    room = max(0, limit - tokens_used(episode))
    cut = len(completion.token_ids) > room
    return add_turn(episode, completion.text, completion.token_ids[:room], completion.logprobs[:room],
                    "length" if cut else completion.finish_reason, policy_version, sample_ms)


def read_observation(backend, episode: episode_pb2.Episode, limit: int) -> None:
    """Tokenises the last observation as the model will read it (the generator does this, not the executor),
    as much of it as the episode's token budget `limit` leaves (a 2,000-character observation took an
    episode to 2,027 tokens of a budget of 480, and the learner refused it whole); a cut one ends it."""
    last = episode.turns[-1]
    room = max(0, limit - tokens_used(episode) + len(last.observation_token_ids))
    last.observation_token_ids[:] = backend.observation_ids(last.observation, list(last.token_ids))[:room]


def tokens_used(episode: episode_pb2.Episode) -> int:
    return len(episode.prompt_token_ids) + sum(len(t.token_ids) + len(t.observation_token_ids) for t in episode.turns)


def route(env: Environment, episode: episode_pb2.Episode, max_tokens: int) -> str:
    """After a turn: "act" (its call goes to the environment) or "done" (episode.end is set).

    A turn the episode's token budget cut (add_completion) ends it at the token limit: its text runs
    past the tokens kept, so neither an answer nor a call written there counts (the trainer's sample
    holds only the kept tokens)."""
    last = episode.turns[-1]
    if last.finish_reason == rollout_pb2.FINISH_REASON_LENGTH and tokens_used(episode) >= max_tokens:
        episode.end = episode_pb2.EPISODE_END_TOKEN_LIMIT
    elif not last.HasField("call"):
        episode.end = episode_pb2.EPISODE_END_ANSWER
    elif len(episode.turns) >= env.turn_limit(episode.task):
        episode.end = episode_pb2.EPISODE_END_TURN_LIMIT
    elif tokens_used(episode) >= max_tokens:
        episode.end = episode_pb2.EPISODE_END_TOKEN_LIMIT
    return "done" if episode.end else "act"


def carried_out(turn: episode_pb2.Turn) -> bool:
    """Whether the turn's call reached the environment (it answered, or said why not)."""
    return turn.HasField("call") and bool(turn.observation or turn.call_failed)


def earlier_calls(episode: episode_pb2.Episode, before: int, env: Environment | None = None) -> list[Call]:
    """The calls of turns before `before` that the environment carried out (its state is built from them):
    those that succeeded, and those whose tool ran and failed where `env` keeps them (keeps_failed)."""
    out = []
    for turn in episode.turns[:before]:
        if not carried_out(turn) or turn.call.error:
            continue
        if turn.call_failed and not (env is not None and env.keeps_failed(turn)
                                     and isinstance(call_parser.resolve(turn.call, env.tools), Call)):
            continue  # a rejected call changed nothing; a malformed one never reached the tool
        out.append(Call(turn.call.name, json.loads(turn.call.arguments_json or "{}")))
    return out


async def act(env: Environment, episode: episode_pb2.Episode, execute: Execute) -> Observation:
    """Carries out the last turn's call (through `execute` for sandboxed tools) and records the observation.
    A bad call, and a tool that fails, are observations saying what went wrong, never errors."""
    turn = episode.turns[-1]
    started = time.perf_counter()
    resolved = call_parser.resolve(turn.call, env.tools)
    if isinstance(resolved, str):
        observation = Observation(f"error: {resolved}", failed=True)
    else:
        # the arguments as the tool reads them (a plain call's one argument named)
        turn.call.arguments_json = json.dumps(resolved.arguments)
        earlier = earlier_calls(episode, len(episode.turns) - 1, env)
        tool = next(t for t in env.tools if t.name == resolved.name)
        result = await execute(env.job(episode.task, earlier, resolved)) if tool.sandboxed else None
        if result is not None and not result.not_run:  # what the sandbox said of the run, for the verdict
            turn.sandboxed = True
            turn.violation = result.violation
            turn.violation_detail = result.violation_detail[:VIOLATION_DETAIL_CHARS]
        observation = env.observe(episode.task, earlier, resolved, result)
    turn.observation = cut(observation.text) or "(nothing)"  # never empty: an empty one is a call not carried out
    ignored = call_parser.calls_ignored(turn.text, episode.call_format)
    if ignored:  # said last: an environment may read the observation's start (python_env.RAISED)
        turn.observation += f"\n[one call a turn: this turn wrote {ignored + 1}, and only the first was read]"
    turn.call_failed = observation.failed
    turn.execution_ms = (time.perf_counter() - started) * 1000
    if observation.done:
        episode.end = episode_pb2.EPISODE_END_DONE
    return observation


def context_ids(episode: episode_pb2.Episode) -> list[int]:
    """Everything the model has read and written so far, as token ids (observations included)."""
    ids = list(episode.prompt_token_ids)
    for turn in episode.turns:
        ids += turn.token_ids
        ids += turn.observation_token_ids
    return ids


def flatten(episode: episode_pb2.Episode) -> tuple[list[int], list[float], list[bool]]:
    """The episode as one sample: completion ids (turns and observations in order), sampling log-probs
    (0 for observation tokens) and the loss mask (True for the model's own tokens)."""
    ids, logprobs, mask = [], [], []
    for turn in episode.turns:
        ids += turn.token_ids
        logprobs += turn.logprobs
        mask += [True] * len(turn.token_ids)
        ids += turn.observation_token_ids
        logprobs += [0.0] * len(turn.observation_token_ids)
        mask += [False] * len(turn.observation_token_ids)
    return ids, logprobs, mask


def transcript(episode: episode_pb2.Episode) -> str:
    """The episode as text, for people and stored rows. A turn's or an observation's later lines are
    indented: only the transcript's own markers begin a line (a turn wrote a fake observation and end,
    and the reader took them for the episode's)."""
    lines = []
    for i, turn in enumerate(episode.turns, 1):
        lines.append(f"[turn {i}] {_continued(turn.text)}")
        if turn.HasField("call") and (turn.observation or turn.call_failed):
            lines.append(f"[observation {i}] {_continued(turn.observation)}")
    end = episode_pb2.EpisodeEnd.Name(episode.end).removeprefix("EPISODE_END_").lower()
    lines.append(f"[end] {end}")
    return "\n".join(lines)


def _continued(text: str) -> str:
    return "\n  ".join(text.splitlines())


def policy_version(episode: episode_pb2.Episode) -> int:
    """The oldest policy that sampled a turn: what staleness is measured from."""
    return min((t.policy_version for t in episode.turns), default=0)


async def play(env: Environment, task: task_pb2.Task, turns: list[str], execute: Execute, *,
               call_format: str = "plain", max_tokens: int = 1 << 30) -> episode_pb2.Episode:
    """An episode whose model turns are given (a reference solution, a test's attack): each turn is
    added, routed and acted on as in the pipeline; turns left over once it ends are dropped."""
    episode = start(task, "play", 0, [], temperature=1.0, top_p=1.0, call_format=call_format)
    for text in turns:
        add_turn(episode, text, [], [], "stop", 0)
        if route(env, episode, max_tokens) == "done":
            break
        await act(env, episode, execute)
        if episode.end:
            break
    else:
        if not episode.end:
            episode.end = episode_pb2.EPISODE_END_TURN_LIMIT
    return episode


async def drive(backend, tasks: list[task_pb2.Task], execute: Execute, params, *,
                max_episode_tokens: int) -> list[episode_pb2.Episode]:
    """One episode per task, every turn sampled in one batch across the episodes still running, the
    tools carried out through `execute`: the local twin of the pipeline's episode hops (held-out
    evaluation uses it; the pipeline runs the same steps across services)."""
    import asyncio

    from crucible.ml import envs

    episodes, active = [], []
    for task in tasks:
        e = start(task, f"eval/{task.id}", 0, prompt_ids(backend, task), temperature=params.temperature,
                  top_p=params.top_p, call_format=backend.call_format, backend=backend.name)
        episodes.append(e)
        active.append(e)
    while active:
        # one call for the episodes whose next turn is drawn alike (near its budget, a turn draws fewer tokens)
        by_params: dict = {}
        for e in active:
            limit = token_limit(max_episode_tokens, e.task, backend)
            by_params.setdefault(turn_params(params, len(context_ids(e)), limit), []).append(e)
        sampled = {}
        for these_params, these in by_params.items():
            groups = await asyncio.to_thread(backend.sample, [context_ids(e) for e in these], 1, these_params)
            sampled.update((id(e), group[0]) for e, group in zip(these, groups))
        still = []
        for e in active:
            env, limit = envs.get(e.task.kind), token_limit(max_episode_tokens, e.task, backend)
            add_completion(e, sampled[id(e)], backend.version, 0.0, limit)
            if route(env, e, limit) == "done":
                continue
            await act(env, e, execute)
            if e.end:
                continue
            read_observation(backend, e, limit)
            if len(context_ids(e)) >= limit:
                e.end = episode_pb2.EPISODE_END_TOKEN_LIMIT
                continue
            still.append(e)
        active = still
    return episodes
