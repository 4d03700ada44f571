"""Saved queries over a run's rows: what `crucible query NAME` prints (and what dashboards can reuse).

Each query names the parameters it takes ({name:Type}, ClickHouse query parameters: values are
never pasted into SQL). `run(client, name, **params)` returns (column names, rows); `table` lays them out
for a terminal, every value passed through `shown`, which the CLI's other reports of stored text use too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from crucible.shared.text import shown


@dataclass(frozen=True)
class Query:
    name: str
    about: str
    sql: str

    @property
    def parameters(self) -> list[str]:
        return sorted(set(re.findall(r"\{(\w+):\w+\}", self.sql)))


QUERIES = {q.name: q for q in [
    Query("reward-by-version", "samples, reward mean and spread, and solved share per policy version",
          "SELECT policy_version AS version, count() AS samples, round(avg(reward), 4) AS reward_mean, "
          "round(stddevPop(reward), 4) AS reward_std, round(avg(reward >= 1), 4) AS solved "
          "FROM trajectories FINAL GROUP BY policy_version ORDER BY policy_version"),
    Query("pass-rate-by-kind", "training samples and solved share per task kind (and environment)",
          "SELECT task_kind, count() AS samples, round(avg(reward >= 1), 4) AS solved, "
          "round(avg(reward), 4) AS reward_mean, round(avg(turns), 2) AS mean_turns FROM trajectories FINAL GROUP BY task_kind ORDER BY task_kind"),
    Query("heldout", "the evaluator's held-out pass rate per policy version and task kind ('*': all)",
          "SELECT run_id, policy_version AS version, task_kind, tasks, passed, round(pass_rate, 4) AS pass_rate "
          "FROM evaluations FINAL ORDER BY run_id, policy_version, task_kind"),
    Query("steps", "the learner's steps: reward, pass rate, KL, entropy, gradient norm, step time",
          "SELECT run_id, step, round(reward_mean, 4) AS reward, round(pass_rate, 4) AS passed, round(kl, 5) AS kl_to_ref, "
          "round(entropy, 4) AS entropy_mean, round(grad_norm, 4) AS grad_l2, round(step_time_ms) AS step_ms "
          "FROM train_steps FINAL ORDER BY run_id, step"),
    Query("step-time", "where a step's time goes, per policy step (the version it made; medians over the groups "
          "it trained on, from the spans): sampling, the hops between services and the work in each, then the "
          "learner's step, its checkpoint and publication. A group belongs to the step whose trained samples name it "
          "(train_steps.samples), or, for rows written before those were recorded, to the version after the one it "
          "was sampled with; sampled_with is the oldest version among the step's groups",
          "SELECT g.step AS version, min(g.version) AS sampled_with, count() AS groups, "
          "round(quantile(0.5)(sample_ms)) AS sample_ms, "
          "round(quantile(0.5)(to_verifier_ms)) AS to_verifier_ms, round(quantile(0.5)(verify_ms)) AS verify_ms, "
          "round(quantile(0.5)(to_aggregator_ms)) AS to_aggregator_ms, "
          "round(quantile(0.5)(to_learner_ms)) AS to_learner_ms, round(any(p.metrics['step_ms'])) AS learner_step_ms, "
          "round(any(p.metrics['checkpoint_ms'])) AS checkpoint_ms, round(any(p.metrics['publish_ms'])) AS publish_ms "
          "FROM ("
          "SELECT t.version AS version, if(any(t.trained) > 0, any(t.trained), t.version + 1) AS step, o.TraceId, "
          "minIf(ts, o.ServiceName = 'generator' AND endsWith(o.SpanName, '.tasks process')) AS gen_start, "
          "maxIf(ts + o.Duration / 1e6, o.ServiceName = 'generator' AND endsWith(o.SpanName, '.tasks process')) "
          "AS gen_end, minIf(ts, o.ServiceName = 'verifier' AND endsWith(o.SpanName, ' process')) AS ver_start, "
          "maxIf(ts + o.Duration / 1e6, o.ServiceName = 'verifier' AND endsWith(o.SpanName, ' process')) AS ver_end, "
          "maxIf(ts, o.ServiceName = 'reward-aggregator' AND endsWith(o.SpanName, '.verdicts process')) AS agg_start, "
          "maxIf(ts, o.ServiceName = 'reward-aggregator' AND endsWith(o.SpanName, '.trajectories publish')) AS agg_end, "
          "minIf(ts, o.ServiceName = 'learner' AND o.SpanName = 'learner step') AS step_start, "
          "gen_end - gen_start AS sample_ms, ver_start - gen_end AS to_verifier_ms, ver_end - ver_start AS verify_ms, "
          "agg_start - ver_end AS to_aggregator_ms, step_start - agg_end AS to_learner_ms "
          "FROM (SELECT *, toUnixTimestamp64Micro(Timestamp) / 1000 AS ts FROM otel_traces) AS o INNER JOIN "
          "(SELECT tr.trace_id AS trace_id, tr.policy_version AS version, max(s.trained) AS trained FROM "
          "(SELECT trajectory_id, trace_id, policy_version FROM trajectories FINAL WHERE run_id = {run:String}) AS tr "
          "LEFT JOIN (SELECT arrayJoin(samples) AS trajectory_id, policy_version AS trained FROM train_steps FINAL "
          "WHERE run_id = {run:String}) AS s ON tr.trajectory_id = s.trajectory_id GROUP BY trace_id, version) "
          "AS t ON o.TraceId = t.trace_id GROUP BY version, o.TraceId HAVING gen_start > 0 AND step_start > 0) AS g "
          "LEFT JOIN (SELECT version, metrics FROM policy_versions FINAL WHERE run_id = {run:String}) AS p "
          "ON p.version = g.step GROUP BY version ORDER BY version"),
    Query("slowest-sandbox-jobs", "the sandbox runs (and episodes' tool calls) that took longest, and how they ended",
          "SELECT trajectory_id, task_kind, turn, ms, cpu_s, rss_mb, exit_code, violation FROM ("
          "SELECT trajectory_id, task_kind, 0 AS turn, round(duration_ms, 1) AS ms, round(cpu_s, 3) AS cpu_s, "
          "round(max_rss_bytes / 1048576, 1) AS rss_mb, exit_code, violation "
          "FROM trajectories FINAL WHERE duration_ms > 0 UNION ALL "
          "SELECT trajectory_id, task_kind, turn, round(execution_ms, 1) AS ms, 0 AS cpu_s, 0 AS rss_mb, 0 AS exit_code, "
          "if(violation != '', violation, if(call_failed, 'call_failed', '')) AS violation FROM episode_turns FINAL "
          "WHERE execution_ms > 0"
          ") ORDER BY ms DESC LIMIT 20"),
    Query("task", "every sample of one task: groups, rewards, advantages",
          "SELECT group_id, sample_index, trajectory_id, policy_version AS version, round(reward, 4) AS reward, "
          "round(advantage, 4) AS advantage, turns, substring(replaceAll(completion, '\\n', ' '), 1, 60) AS completion "
          "FROM trajectories FINAL WHERE task_id = {task:String} ORDER BY group_id, sample_index"),
    Query("episode", "one episode's transcript, turn by turn",
          "SELECT turn, tool, call_failed AS failed, substring(replaceAll(action, '\\n', ' '), 1, 60) AS action, "
          "substring(replaceAll(observation, '\\n', ' '), 1, 60) AS observation "
          "FROM episode_turns FINAL WHERE trajectory_id = {trajectory:String} ORDER BY turn"),
    Query("trace", "the trace of one trajectory: every span, in time order",
          "SELECT ServiceName AS service, SpanName AS span, round(Duration / 1e6, 2) AS ms, SpanId AS span_id, "
          "ParentSpanId AS parent FROM otel_traces WHERE TraceId = (SELECT any(trace_id) FROM trajectories FINAL "
          "WHERE trajectory_id = {trajectory:String}) ORDER BY Timestamp"),
    Query("rescores", "every `crucible rescore`: its run, verifier version, and how many rewards changed",
          "SELECT rescore_id, run_id, any(verifier_version) AS verifier, count() AS samples, "
          "countIf(abs(new_reward - old_reward) > 1e-9) AS changed, round(avg(old_reward), 4) AS reward_trained, "
          "round(avg(new_reward), 4) AS reward_now, min(ts) AS at FROM rescores FINAL "
          "GROUP BY rescore_id, run_id ORDER BY at DESC"),
    Query("rescore", "one rescore, per task: the rewards trained on against the rewards now",
          "SELECT task_id, any(task_kind) AS kind, any(graded_as) AS graded_as, count() AS samples, "
          "countIf(abs(new_reward - old_reward) > 1e-9) AS changed, round(avg(old_reward), 4) AS reward_trained, "
          "round(avg(new_reward), 4) AS reward_now FROM rescores FINAL WHERE rescore_id = {rescore:String} "
          "GROUP BY task_id ORDER BY changed DESC, task_id LIMIT 100"),
    Query("rescore-by-version", "one rescore, per policy version: reward trained on, reward now, and the share "
          "of the trained reward the current verifier takes back",
          "SELECT policy_version AS version, count() AS samples, round(avg(old_reward), 4) AS reward_trained, "
          "round(avg(new_reward), 4) AS reward_now, round(if(sum(old_reward) > 0, "
          "greatest(sum(old_reward) - sum(new_reward), 0) / sum(old_reward), 0), 4) AS unearned_share "
          "FROM rescores FINAL WHERE rescore_id = {rescore:String} GROUP BY policy_version ORDER BY policy_version"),
    Query("alerts", "the newest alerts",
          "SELECT ts, kind, severity, message FROM alerts FINAL ORDER BY ts DESC LIMIT 50"),
]}


PARAMETERS = sorted({p for q in QUERIES.values() for p in q.parameters})  # every --NAME `crucible query` takes


class QueryError(ValueError):
    """An unknown query or a missing parameter; the text says what is known or needed."""


def run(client, name: str, **params: str) -> tuple[list[str], list[tuple]]:
    query = QUERIES.get(name)
    if query is None:
        raise QueryError(f"no saved query {name!r}: the saved queries are {', '.join(QUERIES)}")
    missing = [p for p in query.parameters if p not in params]
    if missing:
        raise QueryError(f"query {name!r} needs {', '.join('--' + p + ' VALUE' for p in missing)}")
    unused = [p for p in params if p not in query.parameters]
    if unused:  # a filter dropped in silence would show every run's rows as if they were one run's
        raise QueryError(f"query {name!r} takes {', '.join('--' + p for p in query.parameters) or 'no parameters'}, "
                         f"not {', '.join('--' + p for p in unused)}")
    result = client.query(query.sql, parameters={p: params[p] for p in query.parameters})
    return list(result.column_names), list(result.result_rows)


def table(columns: list[str], rows: list[tuple], limit: int = 200) -> str:
    """Rows as an aligned text table, each cell `shown`."""
    cells = [[shown(c) for c in columns]] + [[shown(v) for v in row] for row in rows[:limit]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more rows")
    return "\n".join(lines)
