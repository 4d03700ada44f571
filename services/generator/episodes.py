"""The generator's part of multi-turn episodes: first turns from a task, next turns from observations.

    crucible.tasks (an environment's task) -> G first turns  -> crucible.actions | crucible.episodes
    crucible.observations                  -> the next turn  -> crucible.actions | crucible.episodes

A turn that calls a tool goes to the sandbox-executor (crucible.actions); an episode that ended
goes to the verifier (crucible.episodes). The next turn continues the transcript's token ids as
they are (never re-tokenised text), so what the learner trains on is exactly what was sampled.
"""
from __future__ import annotations

from crucible.ml import envs
from crucible.ml.envs import calls
from crucible.ml.envs import episode as ep
from crucible.services.generator.batcher import Batcher
from crucible.shared import bus, integrity
from crucible.shared.settings import Settings
from crucible.v1 import episode_pb2, task_pb2


def next_hop(episode: episode_pb2.Episode, limit: int) -> bus.Outgoing:
    """Where an episode goes after a turn: to the verifier once it ended, else to have its call carried out."""
    where = ep.route(envs.get(episode.task.kind), episode, limit)
    return bus.Outgoing("episodes" if where == "done" else "actions", episode, key=episode.group_id)


async def start(task: task_pb2.Task, group_id: str, batcher: Batcher, params, *, settings: Settings,
                generator_id: str) -> list[bus.Outgoing]:
    """The task's G episodes, each after its first turn."""
    limit = ep.token_limit(settings.max_episode_tokens, task, batcher.backend)
    ids = ep.prompt_ids(batcher.backend, task)
    if len(ids) >= limit:
        raise bus.Reject(f"task {task.id!r}: its prompt is {len(ids)} tokens, more than the episode's "
                         f"limit of {limit} (max_episode_tokens, environment.max_tokens, or the model's context)")
    completions, version, ms = await batcher.sample(ids, task.group_size, ep.turn_params(params, len(ids), limit),
                                                    min_version=task.min_policy_version)
    out = []
    for index, completion in enumerate(completions):
        episode = ep.start(task, group_id, index, ids, temperature=params.temperature, top_p=params.top_p,
                           call_format=batcher.backend.call_format, generator_id=generator_id,
                           backend=batcher.backend.name)
        ep.add_completion(episode, completion, version, ms, limit)
        out.append(next_hop(episode, limit))
    return out


def episode_problem(episode: episode_pb2.Episode, backend=None) -> str | None:
    """Why an observation record cannot be continued (by `backend`'s policy, where given); None when it can."""
    if not envs.is_environment(episode.task):
        return f"episode {episode.id!r}: task kind {episode.task.kind!r} is not an environment"
    if not episode.turns:
        return f"episode {episode.id!r} has no turns"
    if episode.end:
        return f"episode {episode.id!r} has ended already"
    if not episode.turns[-1].HasField("call"):
        return f"episode {episode.id!r}: its last turn made no call to observe"
    if episode.call_format not in calls.FORMATS:
        return f"episode {episode.id!r}: unknown call format {episode.call_format!r}"
    if not ep.carried_out(episode.turns[-1]):  # (a record of crucible.actions, copied here: signed alike)
        return f"episode {episode.id!r}: its last call was never carried out (no observation): nothing to continue"
    if backend is not None:
        # Begun by a generator of another model (a restart onto other weights, a mixed deployment): this one
        # would sample on a transcript its policy never wrote, or index past its embedding.
        if episode.call_format != backend.call_format:
            return (f"episode {episode.id!r} writes calls as {episode.call_format!r}; this generator's policy "
                    f"writes them as {backend.call_format!r}")
        vocab = backend.vocab_size()
        ids = [*episode.prompt_token_ids, *(i for t in episode.turns for i in (*t.token_ids, *t.observation_token_ids))]
        if vocab and ids and not (0 <= min(ids) and max(ids) < vocab):
            return f"episode {episode.id!r} holds token ids {min(ids)}..{max(ids)}, outside this model's {vocab}"
    return None


def continue_handler(settings: Settings, batcher: Batcher, params):
    """crucible.observations -> the next turn. Turns of running episodes never wait for the lag bound:
    the episode was admitted when its task was. Only an episode a sandbox sent on (its observation)
    is continued: no turn is sampled after, nor trained on, transcripts someone else wrote."""
    secret = integrity.key(settings)

    async def handle(incoming: bus.Incoming):
        episode = incoming.message
        try:
            integrity.check_sampled(episode, secret)
        except integrity.IntegrityError as exc:
            raise bus.Reject(str(exc)) from None
        problem = episode_problem(episode, batcher.backend)
        if problem:
            raise bus.Reject(problem)
        limit = ep.token_limit(settings.max_episode_tokens, episode.task, batcher.backend)
        ep.read_observation(batcher.backend, episode, limit)
        context = ep.context_ids(episode)
        if len(context) >= limit:
            episode.end = episode_pb2.EPISODE_END_TOKEN_LIMIT
            return [bus.Outgoing("episodes", episode, key=episode.group_id)]
        completions, version, ms = await batcher.sample(context, 1, ep.turn_params(params, len(context), limit),
                                                        counts_for_lag=False)
        ep.add_completion(episode, completions[0], version, ms, limit)
        return [next_hop(episode, limit)]

    return handle
