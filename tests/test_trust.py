"""Rewards that cannot be bought, tried for real in the sandbox and scored by the python_tests kind:
runs cut short are paid only for the tests they completed, honest code that imports widely is paid
in full, a forbidden call in any process of the job is named, and the job sees nothing of the host."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import pytest_asyncio

from crucible.ml import kinds
from crucible.ml.kinds import python_tests
from crucible.services.sandbox_executor.handler import job_for_request, result_message
from crucible.services.sandbox_executor.pool import Job, SandboxPool
from crucible.shared.settings import Settings
from crucible.v1 import execution_pb2, task_pb2

pytestmark = pytest.mark.sandbox
ROOT = Path(__file__).resolve().parent.parent

# Four tests; a candidate that handles the first input and misbehaves on the others.
FOUR_TESTS = """
def test_small():
    assert double(2) == 4

def test_negative():
    assert double(-3) == -6

def test_zero():
    assert double(0) == 0

def test_large():
    assert double(10 ** 6) == 2 * 10 ** 6
"""
DOUBLE = task_pb2.Task(id="double", kind="python_tests", prompt="Write double(x).", group_size=1,
                       python_tests=task_pb2.PythonTests(entry_point="double", test_code=FOUR_TESTS))

# name -> what double() does on any input but 2
CUT_SHORT = {
    "hangs": "import time\n        time.sleep(3600)",
    "loops_forever": "while True:\n            pass",
    "floods_output": "import sys\n        while True:\n            sys.stdout.write('x' * 65536)",
    "kills_itself": "import os, signal\n        os.kill(os.getpid(), signal.SIGKILL)",
    "stops_itself": "import os, signal\n        os.kill(os.getpid(), signal.SIGSTOP)",
    "exits_quietly": "import os\n        os._exit(0)",
    "kills_its_process_group": "import os, signal\n        os.killpg(0, signal.SIGKILL)",
}


def cut_short(behaviour: str) -> str:
    return f"def double(x):\n    if x != 2:\n        {behaviour}\n    return 4\n"


@pytest_asyncio.fixture(scope="module")
async def pool():
    async with SandboxPool(Settings(sandbox_workers=2, sandbox_wall_s=3.0, sandbox_cpu_s=2,
                                    sandbox_queue_size=64)) as p:
        yield p


async def score(pool, task, completion):
    kind = kinds.get(task.kind)
    result = await pool.execute(job_for_request(kind.execution(task, completion)))
    return kind.score(task, completion, result_message(result)), result


def test_the_declared_tests_are_read_from_the_task_outside_the_sandbox():
    assert python_tests.declared_tests(DOUBLE) == ["test_small", "test_negative", "test_zero", "test_large"]
    humaneval_style = task_pb2.Task(kind="python_tests", python_tests=task_pb2.PythonTests(
        entry_point="f", test_code="def check(candidate):\n    assert candidate() == 1\n"))
    assert python_tests.declared_tests(humaneval_style) == ["check"]


def test_a_result_reporting_fewer_tests_or_strange_names_is_paid_for_what_the_task_declares():
    kind = kinds.get("python_tests")
    one_of_four = execution_pb2.ExecutionResult(tests=[execution_pb2.TestOutcome(name="test_small", passed=True)])
    assert kind.score(DOUBLE, "def double(x):\n    return 2 * x\n", one_of_four).reward == 0.25
    # outcomes for tests the task does not declare, or twice for one, pay nothing more
    padded = execution_pb2.ExecutionResult(tests=[execution_pb2.TestOutcome(name=n, passed=True) for n in
                                                  ["test_small", "test_small", "test_extra", "check"]])
    assert kind.score(DOUBLE, "def double(x):\n    return 2 * x\n", padded).reward == 0.25
    # a result naming its own tamper pattern is passed on as unknown_signal, the name in the detail
    odd = execution_pb2.ExecutionResult(tamper=[execution_pb2.TamperSignal(pattern="<img src=x>", detail="hi")])
    verdict = kind.score(DOUBLE, "def double(x):\n    return 2 * x\n", odd)
    assert verdict.patterns == ("unknown_signal",) and verdict.reward == 0.0


async def test_the_honest_solution_of_the_four_test_task_is_paid_in_full(pool):
    verdict, result = await score(pool, DOUBLE, "def double(x):\n    return 2 * x\n")
    assert verdict.reward == 1.0 and not verdict.tampered, verdict.detail
    assert list(result.tests_declared) == python_tests.declared_tests(DOUBLE)


@pytest.mark.parametrize("name", sorted(CUT_SHORT))
async def test_a_run_cut_short_is_paid_only_for_the_tests_it_completed(pool, name):
    verdict, result = await score(pool, DOUBLE, cut_short(CUT_SHORT[name]))
    assert verdict.reward <= 0.25, (name, verdict.detail, result.tests)
    assert verdict.components["tests_total"] == 4.0, verdict.detail
    # and the pool serves the next job
    again, _ = await score(pool, DOUBLE, "def double(x):\n    return x + x\n")
    assert again.reward == 1.0, again.detail


# Honest solutions that import widely from the standard library, several modules the worker has
# not preloaded among them (importing them makes the import system list the work folder).
IMPORTS = ["cmath", "array", "threading", "unicodedata", "decimal", "fractions", "statistics", "heapq",
           "bisect", "itertools", "functools", "collections", "re", "string", "math", "datetime", "json",
           "textwrap", "operator", "copy", "random", "hashlib", "struct", "zlib", "base64", "difflib",
           "calendar", "enum", "dataclasses", "typing", "numbers", "queue", "contextlib", "abc", "time",
           "weakref", "pprint", "io", "csv", "binascii", "colorsys", "graphlib", "secrets", "uuid", "html",
           "shlex", "fnmatch", "glob", "pathlib", "tempfile", "sched", "locale", "codecs", "gettext",
           "concurrent.futures", "multiprocessing", "asyncio", "email", "xml.etree.ElementTree", "sqlite3",
           "urllib.parse", "ipaddress", "zoneinfo", "array", "mmap", "select", "signal", "errno", "platform"]


def honest_corpus() -> list[tuple[str, str]]:
    corpus = []
    for i, module in enumerate(dict.fromkeys(IMPORTS)):
        corpus.append((module, f"import {module}\n\ndef double(x):\n    return x * 2\n"))
        corpus.append((module + " (inside)", f"def double(x):\n    import {module}\n    return x + x\n"))
    corpus.append(("from-imports", "from cmath import sqrt\nfrom array import array\nfrom threading import Lock\n"
                                   "from unicodedata import name\n\ndef double(x):\n    with Lock():\n"
                                   "        return int(sqrt(x * x).real) * 2 if x >= 0 else -double(-x)\n"))
    corpus.append(("threads", "import threading\n\ndef double(x):\n    out = []\n"
                              "    t = threading.Thread(target=lambda: out.append(2 * x))\n    t.start(); t.join()\n"
                              "    return out[0]\n"))
    corpus += [(f"uses {name}", code) for name, code in USES.items()]
    return corpus


# Honest solutions that use what they import: processes and their locks, queues and shared memory,
# files and descriptors of their own.
USES = {
    "multiprocessing.Pool": "import multiprocessing as mp\n\ndef _twice(x):\n    return 2 * x\n\n"
                            "def double(x):\n    with mp.Pool(2) as pool:\n        return pool.map(_twice, [x])[0]\n",
    "multiprocessing.Process": "import multiprocessing as mp\n\ndef _put(q, x):\n    q.put(2 * x)\n\n"
                               "def double(x):\n    q = mp.Queue()\n    p = mp.Process(target=_put, args=(q, x))\n"
                               "    p.start()\n    value = q.get()\n    p.join()\n    return value\n",
    "multiprocessing spawn": "import multiprocessing as mp\n\ndef _twice(x):\n    return 2 * x\n\n"
                             "def double(x):\n    with mp.get_context('spawn').Pool(1) as pool:\n"
                             "        return pool.apply(_twice, (x,))\n",
    "ProcessPoolExecutor": "from concurrent.futures import ProcessPoolExecutor\n\ndef _twice(x):\n    return 2 * x\n\n"
                           "def double(x):\n    with ProcessPoolExecutor(1) as ex:\n        return ex.submit(_twice, x).result()\n",
    "shared_memory": "from multiprocessing import shared_memory\n\ndef double(x):\n"
                     "    m = shared_memory.SharedMemory(create=True, size=8)\n    m.buf[0] = 2\n    y = m.buf[0] * x\n"
                     "    m.close()\n    m.unlink()\n    return y\n",
    "subprocess": "import subprocess, sys\n\ndef double(x):\n"
                  "    run = subprocess.run([sys.executable, '-c', 'print(2 * int(input()))'], input=str(x),\n"
                  "                         capture_output=True, text=True, check=True)\n    return int(run.stdout)\n",
    "tempfile and descriptors": "import os, tempfile\n\ndef double(x):\n    fd, path = tempfile.mkstemp()\n"
                                "    with os.fdopen(fd, 'w') as f:\n        f.write(str(2 * x))\n"
                                "    with open(path) as f:\n        return int(f.read())\n",
    "multiprocessing.Value": "import multiprocessing as mp\n\ndef double(x):\n    v = mp.Value('i', x)\n"
                             "    a = mp.Array('i', [x, x])\n    with v.get_lock():\n        v.value += a[1]\n"
                             "    return v.value\n",
    "its own function's arity": "def double(x):\n    assert double.__code__.co_argcount == 1\n    return 2 * x\n",
    "sqlite3 on a file": "import sqlite3\n\ndef double(x):\n    db = sqlite3.connect('results.db')\n    with db:\n"
                         "        db.execute('create table if not exists t (v)')\n"
                         "        db.execute('insert into t values (?)', (2 * x,))\n"
                         "    value = db.execute('select v from t order by rowid desc').fetchone()[0]\n"
                         "    db.close()\n    return value\n",
}


@pytest.mark.timeout(600)
async def test_honest_code_importing_the_standard_library_is_paid_in_full(pool):
    corpus = honest_corpus()
    slots = asyncio.Semaphore(8)

    async def one(code):
        async with slots:
            return await score(pool, DOUBLE, code)

    results = await asyncio.gather(*(one(code) for _, code in corpus))
    unpaid = [(name, v.patterns, v.detail[:200]) for (name, _), (v, _) in zip(corpus, results)
              if v.reward != 1.0 or v.tampered]
    assert unpaid == [], f"{len(unpaid)} of {len(corpus)} honest solutions were not paid in full"


async def test_a_forbidden_call_in_a_forked_child_is_named_and_pays_nothing(pool):
    completion = ("import os, socket\n\ndef double(x):\n    pid = os.fork()\n    if pid == 0:\n"
                  "        socket.socket()\n        os._exit(0)\n    os.waitpid(pid, 0)\n    return 2 * x\n")
    verdict, result = await score(pool, DOUBLE, completion)
    assert result.violation == "forbidden_syscall" and "socket" in result.violation_detail, \
        (result.violation, result.violation_detail)
    assert verdict.reward == 0.0 and "forbidden_syscall" in verdict.patterns, verdict.detail
    # an untested program too: the job ends at the call, whichever process made it
    plain = await pool.execute(Job(code="import os, socket\nprint('before', flush=True)\nif os.fork() == 0:\n"
                                        "    socket.socket()\n    os._exit(0)\nos.wait()\nprint('after')\n"))
    assert plain.violation == "forbidden_syscall" and "socket" in plain.violation_detail, plain.violation_detail
    assert plain.stdout == b"before\n"
    # a flood of forbidden calls from many children, then one more: every job is named, none is lost
    flood = ("import os, socket\nfor _ in range(20):\n    if os.fork() == 0:\n        socket.socket()\n"
             "        os._exit(0)\n")
    results = await asyncio.gather(*(pool.execute(Job(code=flood)) for _ in range(6)))
    assert [r.violation for r in results] == ["forbidden_syscall"] * 6
    late = await pool.execute(Job(code="import os, socket\nif os.fork() == 0:\n"
                                       "    socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\n    os._exit(0)\n"
                                       "os.wait()\n"))
    assert late.violation == "forbidden_syscall" and "family 10" in late.violation_detail, late.violation_detail


async def test_no_process_of_the_job_holds_the_listener_that_names_its_forbidden_calls(pool):
    # A process holding its own filter's listener could answer for the supervisor and let a
    # forbidden call through: look for one among every descriptor, then make a forbidden call.
    hunt = ("import fcntl, os, socket\nfound = []\nfor fd in range(1024):\n    try:\n"
            "        fcntl.ioctl(fd, 0xC0502100, bytearray(80), True)\n        found.append(fd)\n"
            "    except OSError:\n        pass\nprint('found', found, flush=True)\nsocket.socket()\n")
    result = await pool.execute(Job(code=hunt))
    assert result.stdout == b"found []\n" and result.violation == "forbidden_syscall", (result.stdout, result.violation)


async def test_a_forbidden_call_after_the_job_closed_its_output_is_still_named(pool):
    # With every pipe to the supervisor closed, the job is still watched until it exits.
    close_all = "import os\nfor fd in range(256):\n    try:\n        os.close(fd)\n    except OSError:\n        pass\n"
    result = await pool.execute(Job(code=close_all + "import socket\nsocket.socket()\n"))
    assert result.violation == "forbidden_syscall" and "socket" in result.violation_detail, \
        (result.violation, result.violation_detail)
    hang = close_all + "import time\ntime.sleep(60)\n"
    result = await pool.execute(Job(code=hang))
    assert result.violation == "timeout", (result.violation, result.violation_detail)


async def test_a_job_cannot_install_a_seccomp_filter_of_its_own(pool):
    # Its own filter could answer a forbidden call before the jail's listener hears of it.
    for call, named in (("libc.prctl(22, 2, 0, 0, 0)", "prctl(PR_SET_SECCOMP)"), ("libc.syscall(317, 1, 0, 0)", ": seccomp")):
        code = f"import ctypes\nlibc = ctypes.CDLL(None)\nprint({call})\n"
        result = await pool.execute(Job(code=code))
        assert result.violation == "forbidden_syscall" and named in result.violation_detail, \
            (call, result.violation, result.violation_detail, result.stdout)


async def test_a_thread_bomb_that_swallows_the_error_is_still_a_process_limit_violation(pool):
    code = ("import threading, time\nn = 0\ntry:\n    while True:\n"
            "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n        n += 1\n"
            "except BaseException:\n    pass\nprint('started', n > 0)\n")
    result = await pool.execute(Job(code=code))
    assert result.violation == "processes", (result.violation, result.exit_code, result.stderr[-200:])


LOOK_AROUND = """
import os, sys, traceback
seen = [repr(sys.orig_argv), repr(sys.argv), repr(dict(os.environ)), repr(sys.path),
        repr(sorted(k for k in sys.modules if 'crucible' in k)), ''.join(traceback.format_stack()),
        repr(getattr(sys.modules.get('__main__'), '__dict__', {}).keys())]
for name, module in list(sys.modules.items()):
    seen.append(str(getattr(module, '__file__', '')))
try:
    seen.append(open('/proc/self/cmdline', 'rb').read().decode(errors='replace'))
except OSError as exc:
    seen.append(str(exc))
print('\\n'.join(seen))
"""


# Every string the job's process holds that contains one of HOST (hex-encoded here, so that the job's
# own source holds none of them): everything the collector tracks, frozen objects included, the stack's
# frames and the import system's state, followed through every reference.
DEEP_SCAN = """
import gc, sys, types
HOST = [bytes.fromhex(h).decode() for h in {hexes!r}]
ours = {{id(h) for h in HOST}}
gc.unfreeze()
keep, seen, hits = [], set(), set()
stack = list(gc.get_objects())
frame = sys._getframe()
while frame is not None:
    stack.append(frame)
    frame = frame.f_back
stack += [sys.modules, sys.meta_path, sys.path_hooks, sys.path_importer_cache, vars(sys)]
while stack:
    o = stack.pop()
    if id(o) in seen:
        continue
    seen.add(id(o))
    keep.append(o)
    if isinstance(o, (str, bytes)):
        text = o if isinstance(o, str) else o.decode('latin-1')
        hits.update(text[:200] for h in HOST if h in text and id(o) not in ours)
        continue
    if isinstance(o, types.FrameType):
        stack += [o.f_locals, o.f_globals]
    stack.extend(gc.get_referents(o))
print('scanned', len(seen), 'objects; host strings held:', sorted(hits)[:20])
"""


async def test_the_job_sees_nothing_of_the_host(pool):
    host_strings = [str(ROOT) + "/", pool.runtime_dir.name, "/sys/fs/cgroup", "ro_binds", "uid_base",
                    f"-{os.getpid()}-"]
    plain = await pool.execute(Job(code=LOOK_AROUND))
    assert plain.exit_code == 0, plain.stderr[-500:]
    shown = plain.stdout.decode()
    assert "python3" in shown
    assert [s for s in host_strings if s in shown] == [], shown[:3000]
    # in a tested job, from the candidate's side, through a function the tests call
    probe = ("def double(x):\n    import os, sys, traceback\n"
             "    print(repr(sys.orig_argv), ''.join(traceback.format_stack()), sorted(sys.modules))\n"
             "    return 2 * x\n")
    verdict, result = await score(pool, DOUBLE, probe)
    shown = result.stdout.decode()
    assert shown and [s for s in host_strings if s in shown] == [], shown[:3000]
    # Nothing of the host in the memory of the job's process either (the worker's configuration once
    # was: its import finder's folders, the zygote's and the jail's frames), in a plain job and in a
    # tested job's candidate process.
    scan = DEEP_SCAN.format(hexes=[s.encode().hex() for s in host_strings])
    plain = await pool.execute(Job(code=scan))
    assert plain.exit_code == 0 and "host strings held: []" in plain.stdout.decode(), \
        (plain.stdout[-3000:], plain.stderr[-500:])
    verdict, result = await score(pool, DOUBLE, scan + "\ndef double(x):\n    return 2 * x\n")
    shown = result.stdout.decode()
    assert "host strings held: []" in shown, (shown[-3000:], result.stderr[-500:])


@pytest.mark.slow
@pytest.mark.kafka
async def test_a_service_with_secrets_guards_its_port_seals_results_and_never_shows_a_secret(settings, tmp_path):
    import subprocess
    import sys

    import grpc

    from crucible.shared import integrity, rpc
    from crucible.shared.procs import free_port, stop_processes
    from crucible.v1 import execution_pb2_grpc

    token, key, store_pw, sasl_pw = "tok-5e3f9a1b", "ab" * 32, "store-pw-77c2", "sasl-pw-19d4"
    port, spans = free_port(), tmp_path / "spans.jsonl"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CRUCIBLE_")},
           "CRUCIBLE_HOME": str(tmp_path / "home"), "CRUCIBLE_SANDBOX_GRPC_PORT": str(port),
           "CRUCIBLE_SANDBOX_WORKERS": "1", "CRUCIBLE_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
           "CRUCIBLE_TOPIC_PREFIX": settings.topic_prefix, "CRUCIBLE_CONSUMER_GROUP_PREFIX": settings.consumer_group_prefix,
           "CRUCIBLE_OTEL_STORE_SPANS": "false", "CRUCIBLE_OTEL_SPAN_FILE": str(spans), "CRUCIBLE_METRICS_PORT": "0",
           "CRUCIBLE_RPC_TOKEN": token, "CRUCIBLE_INTEGRITY_KEY": key, "CRUCIBLE_CLICKHOUSE_PASSWORD": store_pw,
           "CRUCIBLE_KAFKA_SASL_PASSWORD": sasl_pw, "CRUCIBLE_LOG_LEVEL": "DEBUG"}
    log = tmp_path / "service.log"
    service = subprocess.Popen([sys.executable, "-m", "crucible.services.sandbox_executor"], env=env,
                               stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    target = f"127.0.0.1:{port}"
    try:
        await rpc.wait_serving(target, "crucible.v1.Sandbox", timeout=60)  # health checks need no token
        job = execution_pb2.ExecuteRequest(code="import os\nprint(sorted(os.environ.items()))")
        for sent in (rpc.Security(), rpc.Security(token="guess")):
            async with rpc.channel(target, sent) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await execution_pb2_grpc.SandboxStub(channel).Execute(job, timeout=30)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        async with rpc.channel(target, rpc.Security(token=token)) as channel:
            reply = await execution_pb2_grpc.SandboxStub(channel).Execute(job, timeout=60)
        # sealed with its run's key ("local"), made from the deployment's
        integrity.check_execution(reply.result, job, integrity.run_key(bytes.fromhex(key), "local"))
        with pytest.raises(integrity.IntegrityError):
            integrity.check_execution(reply.result, job, bytes(32))
        shown = reply.result.SerializeToString()
    finally:
        stop_processes([service], timeout=15)
    everything = shown + log.read_bytes() + (spans.read_bytes() if spans.exists() else b"")
    assert spans.exists() and log.read_bytes()
    for secret in (token, key, store_pw, sasl_pw):
        assert secret.encode() not in everything, secret


def test_a_password_written_in_the_store_url_is_never_shown():
    """The store takes credentials in its URL (http://user:password@host); every place that shows the URL
    (readiness logs, errors, the CLI) shows it masked."""
    from crucible.shared.settings import shown_url
    from crucible.shared.store.client import _endpoint

    for url, masked in [("http://admin:pw-77c2@db:8123", "http://admin:***@db:8123"),
                        ("https://a:p@ss@[::1]:8443/proxy", "https://a:***@[::1]:8443/proxy"),
                        ("http://a:@h", "http://a:***@h"), ("http://user@h:1", "http://user@h:1"),
                        # however malformed: a password with an unescaped /, no scheme; and on the safe side
                        ("http://default:s3cr/t+Q==@db:8123", "http://default:***@db:8123"),
                        ("default:s3cret@db:8123", "default:***@db:8123"),
                        ("http://127.0.0.1:8123/x:y@z", "http://127.0.0.1:***@z"),
                        ("http://127.0.0.1:8123/proxy", "http://127.0.0.1:8123/proxy")]:
        assert shown_url(url) == masked, url
    with pytest.raises(ValueError) as refused:
        _endpoint("http://admin:pw-77c2@db:99999")
    assert "pw-77c2" not in str(refused.value) and "invalid port" in str(refused.value)
    assert _endpoint("http://admin:pw-77c2@db:8123")["password"] == "pw-77c2"  # what connects still has it


async def test_a_trusted_reader_refuses_what_no_service_of_the_deployment_signed(settings):
    """The run's driver and the learner's health monitor act on what they read (a policy version ends a
    run; an evaluation silences reward_without_heldout): they read trusted, and a record of a signed type
    published by anyone without the key (a forged evaluation, a forged version) never reaches them."""
    from crucible.shared import bus
    from crucible.shared import integrity
    from crucible.v1 import alert_pb2, evaluation_pb2, policy_pb2
    from tests.bus_helpers import publish_unsigned

    await bus.ensure_topics(["evaluations", "policy"], settings=settings)
    genuine = evaluation_pb2.Evaluation(run_id="r", policy_version=1, tasks=4, passed=1, pass_rate=0.25)
    forged = evaluation_pb2.Evaluation(run_id="r", policy_version=2, tasks=4, passed=4, pass_rate=1.0)
    await publish_unsigned(settings, "evaluations", forged, b"r")
    await publish_unsigned(settings, "policy", policy_pb2.PolicyVersion(version=150), b"p")
    async with bus.Producer(settings) as producer:
        await producer.send_and_wait("evaluations", genuine, key="r")
        await producer.send_and_wait("policy", policy_pb2.PolicyVersion(version=1), key="p")

    async def versions(topic: str, trusted: bool) -> list[int]:
        got = []
        async with bus.Reader([topic], None, settings=settings, offsets={topic: {}}, dead_letters=False,
                              trusted=trusted) as reader:
            for _ in range(20):
                got += [(m.message.policy_version if topic == "evaluations" else m.message.version)
                        for m in await reader.fetch(timeout_ms=200)]
                if reader.skipped + len(got) >= 2:
                    break
            return got, reader.skipped

    assert await versions("evaluations", trusted=False) == ([2, 1], 0)
    assert await versions("evaluations", trusted=True) == ([1], 1)
    assert await versions("policy", trusted=True) == ([1], 1)
    assert alert_pb2.Alert in integrity.SIGNED  # the run's report lists the alerts its services raised, no others


async def test_a_record_one_run_signed_is_refused_by_every_other_run_of_the_deployment(settings):
    """Every run of a deployment shares its key; one run's signed records (tasks, verdicts, trajectories)
    copied onto another run's topics were paid and trained on there: the planted-hack recipe's lenient
    grader, brought into a production run, paid garbage answers. What is signed is signed with the run's
    own key, derived from the deployment's."""
    from crucible.shared import bus, integrity
    from crucible.v1 import trajectory_pb2

    run_a, run_b = (settings.model_copy(update={"run_id": r}) for r in ("run-a", "run-b"))
    assert integrity.key(run_a) != integrity.key(run_b)
    assert integrity.deployment_key(run_a) == integrity.deployment_key(run_b)
    assert integrity.key(run_a) == integrity.key(settings.model_copy(update={"run_id": "run-a"}))  # every process of a run
    await bus.ensure_topics(["trajectories"], settings=settings)
    async with bus.Producer(run_a) as producer:  # run A's aggregator; its record, copied onto run B's topic
        await producer.send_and_wait("trajectories", trajectory_pb2.Trajectory(id="a/0", reward=1.0, advantage=3.0),
                                     key="a")

    async def read(run) -> tuple[list[str], int]:
        async with bus.Reader(["trajectories"], None, settings=run, offsets={"trajectories": {}}, dead_letters=False,
                              trusted=True) as reader:
            got = []
            for _ in range(20):
                got += [m.message.id for m in await reader.fetch(timeout_ms=200)]
                if got or reader.skipped:
                    break
            return got, reader.skipped

    assert await read(run_a) == (["a/0"], 0)
    assert await read(run_b) == ([], 1)
