"""What a reward may be computed from, authenticated: tasks from a trusted submitter, results from a sandbox.

Anyone who can write to a topic or reach a port could otherwise mint rewards: publish a task whose
tests pass anything, or hand the verifier an execution result that says every test passed. Two keyed
MACs (HMAC-SHA256 with the deployment's integrity key) close that:

- a **task** (and a **policy version**, which only the run's learner publishes) is signed where trusted code publishes it (`crucible train`, the Control service;
  `bus.Producer` signs every Task it sends), and the generator and the verifier refuse a task whose
  signature does not match: its tests, expected answer and instance are the submitter's;
- an **execution result** is sealed by the sandbox that produced it, over the result and a digest of
  the job it ran (code, tests, prelude, limits); the verifier rebuilds the job from the signed task
  and the completion, and refuses a result that is not sealed, was changed, or belongs to another job;
- the **samples**: a rollout group (crucible.rollouts, and inside crucible.executions) is signed by the
  generator that sampled it, and an episode (crucible.actions, .observations, .episodes) by whichever
  service sent it on: the generator after each turn, the sandbox after each observation. The sandbox,
  the verifier and the generator refuse one nobody holding the key sent (`check_sampled`). Otherwise a
  record on those topics would put tokens the policy never sampled, with log-probs of the writer's
  choosing, into training: a correct answer carrying a payload would be paid, and learned;
- the **rewards** themselves: a group's verdicts (crucible.verdicts) are signed by the verifier and the
  aggregator refuses any it did not sign; each trajectory (crucible.trajectories, reward and advantage
  in it) is signed by the aggregator and the learner refuses any it did not sign. Otherwise a record
  on either topic would set a reward directly.

The key is `CRUCIBLE_INTEGRITY_KEY` (hex, at least 32 bytes: a k8s Secret), or else a key file under
CRUCIBLE_HOME (`secrets/integrity.key`, 0600) that the first process to need it creates; every process
of one deployment on one machine shares it. Holding the key is what makes a process trusted. What is
signed is signed with the run's own key, derived from it (`key`): a record of one run is refused by
every other (each run of `crucible train` has its own run id; a long-lived stack's services share
theirs, CRUCIBLE_RUN_ID, "local" by default).
"""
from __future__ import annotations

import functools
import hashlib
import hmac
from pathlib import Path

from crucible.shared import files, messages
from crucible.v1 import (alert_pb2, episode_pb2, evaluation_pb2, execution_pb2, policy_pb2, rollout_pb2, task_pb2,
                         trajectory_pb2, verdict_pb2)

KEY_BYTES = 32
# Said where a signature does not match: the likeliest honest cause.
ANOTHER_KEY = ("the key of another deployment or another run: every service of a run, and whoever submits to "
               "it, signs with the run's key (CRUCIBLE_RUN_ID names the run)")


class IntegrityError(ValueError):
    """A task or result that cannot be trusted; the text says which and why (never the key)."""


_cache: dict[str, bytes] = {}  # CRUCIBLE_HOME -> the key read from under it


def key(settings) -> bytes:
    """The run's integrity key: the deployment's (`deployment_key`) made the run's own. Every record and
    result is signed with it, so a record of one run is refused by every other run of the deployment,
    which shares the deployment's key and, on one machine, its topics' broker: one run's signed tasks,
    verdicts and trajectories, copied onto another run's topics, were paid and trained on there (the
    planted-hack recipe's lenient grader brought into a production run)."""
    return run_key(deployment_key(settings), settings.run_id)


@functools.lru_cache(maxsize=64)
def run_key(deployment: bytes, run_id: str) -> bytes:
    """The key of run `run_id`, derived from the deployment's key (HMAC-SHA256 of its name)."""
    return hmac.new(deployment, b"crucible.run\0" + run_id.encode(), hashlib.sha256).digest()


def deployment_key(settings) -> bytes:
    """The deployment's integrity key (see the module's text); what is signed uses its run's (`key`)."""
    configured = settings.integrity_key.get_secret_value() if settings.integrity_key else ""
    if configured:
        try:
            value = bytes.fromhex(configured)
        except ValueError:
            raise IntegrityError("CRUCIBLE_INTEGRITY_KEY must be hex") from None
        if len(value) < KEY_BYTES:
            raise IntegrityError(f"CRUCIBLE_INTEGRITY_KEY must hold at least {KEY_BYTES} bytes")
        return value
    cached = _cache.get(str(settings.home))  # asked for every task published: no path worked out then
    if cached:
        return cached
    try:  # whoever reads it can mint rewards: files.secret refuses one others may read
        value = bytes.fromhex(files.secret(Path(settings.home) / "secrets" / "integrity.key", KEY_BYTES))
    except files.SecretError as exc:
        raise IntegrityError(str(exc)) from None
    _cache[str(settings.home)] = value
    return value


def _mac(secret: bytes, domain: bytes, body: bytes) -> bytes:
    keyed = _keyed(secret).copy()  # HMAC-SHA256 of domain, NUL, body: the key's two padded blocks hashed once
    keyed.update(domain)
    keyed.update(b"\0")
    keyed.update(body)
    return keyed.digest()


@functools.lru_cache(maxsize=8)
def _keyed(secret: bytes) -> hmac.HMAC:
    return hmac.new(secret, digestmod=hashlib.sha256)


# --- signed messages: tasks, policy versions, samples, rewards ---------------------------------------

# Messages with a `signature` field, signed by whoever publishes them (bus.Producer, as it sends).
SIGNED = (task_pb2.Task, policy_pb2.PolicyVersion, rollout_pb2.RolloutGroup, episode_pb2.Episode,
          verdict_pb2.VerdictGroup, trajectory_pb2.Trajectory, evaluation_pb2.Evaluation, alert_pb2.Alert)


def _body(message) -> bytes:
    """What a message's MAC covers: the message serialized (deterministically) without its signature.

    Fields are written in field-number order, so where `signature` is the type's highest field (every
    SIGNED type but Task), a signed message's bytes are those of the unsigned one followed by the
    signature field's: cut off, they are the body without a copy of the message (test_integrity checks
    it against the copy, type by type). Bytes that do not end so (unknown fields after it) are copied."""
    whole = message.SerializeToString(deterministic=True)
    signature = message.signature
    if not signature:
        return whole
    prefix = _signature_prefix(type(message), len(signature))
    if prefix is not None and whole.endswith(prefix + signature):
        return whole[:-len(prefix) - len(signature)]
    unsigned = type(message)()
    unsigned.CopyFrom(message)
    unsigned.ClearField("signature")
    return unsigned.SerializeToString(deterministic=True)


@functools.lru_cache(maxsize=256)
def _signature_prefix(kind, length: int) -> bytes | None:
    """The tag and length that begin a serialized `signature` field of `length` bytes, where it is the
    type's last field (else None)."""
    number = kind.DESCRIPTOR.fields_by_name["signature"].number
    if number != max(f.number for f in kind.DESCRIPTOR.fields):
        return None
    return messages.varint(number << 3 | 2) + messages.varint(length)


def _domain(message) -> bytes:
    return message.DESCRIPTOR.full_name.encode()


def sign(message, secret: bytes):
    """Signs a message of SIGNED in place (and returns it)."""
    message.signature = _mac(secret, _domain(message), _body(message))
    return message


def signed_correctly(message, secret: bytes) -> bool:
    return bool(message.signature) and hmac.compare_digest(message.signature,
                                                           _mac(secret, _domain(message), _body(message)))


def sign_task(task: task_pb2.Task, secret: bytes) -> task_pb2.Task:
    return sign(task, secret)


def check_task(task: task_pb2.Task, secret: bytes) -> None:
    """IntegrityError unless the task is exactly as a trusted submitter signed it."""
    if not task.signature:
        raise IntegrityError(f"task {task.id!r} is not signed by a trusted submitter (publish it through "
                             "Control.Submit or `crucible train`)")
    if not signed_correctly(task, secret):
        raise IntegrityError(f"task {task.id!r}: its signature does not match (changed after signing, or "
                             f"signed with {ANOTHER_KEY})")


def check_sampled(message: rollout_pb2.RolloutGroup | episode_pb2.Episode, secret: bytes) -> None:
    """IntegrityError unless a rollout group or episode is exactly as a service holding the key sent it
    (its samples a generator's, an episode's observations a sandbox's), and its task a trusted submitter's."""
    if isinstance(message, rollout_pb2.RolloutGroup):
        what, by = f"rollout group {message.group_id[:200]!r}", "a generator"
    else:
        what, by = f"episode {message.id[:200]!r}", "a generator or sandbox"
    if not message.signature:
        raise IntegrityError(f"{what} is not signed: only {by} holding the deployment's key makes samples")
    if not signed_correctly(message, secret):
        raise IntegrityError(f"{what}: its signature does not match (changed after it was sent, or signed "
                             f"with {ANOTHER_KEY})")
    try:
        check_task(message.task, secret)
    except IntegrityError as exc:
        raise IntegrityError(f"{what}: {exc}") from None


def check_policy(policy: policy_pb2.PolicyVersion, secret: bytes) -> None:
    """IntegrityError unless the version was published by the run's learner (a holder of the key)."""
    if not signed_correctly(policy, secret):
        raise IntegrityError(f"policy version {policy.version} of run {policy.run_id!r} is not signed by the "
                             "run's learner" + (" (its signature does not match)" if policy.signature else ""))


# --- execution results -----------------------------------------------------------------------------

def job_digest(request: execution_pb2.ExecuteRequest) -> bytes:
    """What a job is, whoever asked for it: everything of the request but its id."""
    job = execution_pb2.ExecuteRequest()
    job.CopyFrom(request)
    job.ClearField("request_id")
    return hashlib.sha256(job.SerializeToString(deterministic=True)).digest()


def _result_body(result: execution_pb2.ExecutionResult) -> bytes:
    unsealed = execution_pb2.ExecutionResult()
    unsealed.CopyFrom(result)
    unsealed.ClearField("seal")
    return unsealed.SerializeToString(deterministic=True)


def _sealed_for(rollout_id: str | None) -> bytes:
    """The seal's domain. A result made for a sampled rollout (the sandbox's run of a group it consumed,
    the verifier's own run of one it was asked to score) is bound to that rollout; one made for whoever
    called Sandbox.Execute is bound to nothing, and is never taken for a rollout's: a caller may run a
    program as often as it likes and keep the run it prefers (a flaky program's one pass in four)."""
    if rollout_id is None:
        return b"crucible.execution/call"
    return b"crucible.execution/rollout\0" + hashlib.sha256(rollout_id.encode("utf-8", "surrogatepass")).digest()


def seal(result: execution_pb2.ExecutionResult, request: execution_pb2.ExecuteRequest,
         secret: bytes, rollout_id: str | None = None) -> execution_pb2.ExecutionResult:
    """The seal on a result produced for `request` (in place; returns it): for the sampled rollout
    `rollout_id`, or (None) for a call of Sandbox.Execute."""
    result.job_digest = job_digest(request)
    result.seal = _mac(secret, _sealed_for(rollout_id), _result_body(result))
    return result


def check_execution(result: execution_pb2.ExecutionResult, request: execution_pb2.ExecuteRequest,
                    secret: bytes, rollout_id: str | None = None) -> None:
    """IntegrityError unless a holder of the key produced this result for exactly this job, and for the
    rollout `rollout_id` (None: for a call of Sandbox.Execute)."""
    if not result.seal:
        raise IntegrityError("the execution result is not sealed by a sandbox")
    body = _result_body(result)
    if not hmac.compare_digest(result.seal, _mac(secret, _sealed_for(rollout_id), body)):
        if rollout_id is not None and hmac.compare_digest(result.seal, _mac(secret, _sealed_for(None), body)):
            raise IntegrityError("the execution result was sealed for a call of Sandbox.Execute, not for this "
                                 "rollout's run: a caller may run a program as often as it likes")
        raise IntegrityError("the execution result's seal does not match: it was changed, made for another "
                             "rollout, or not made by a sandbox")
    if not hmac.compare_digest(result.job_digest, job_digest(request)):
        raise IntegrityError("the execution result is for another job (other code, tests or limits)")
