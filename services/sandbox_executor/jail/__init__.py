"""The sandbox worker: a pre-forked, standard-library-only process that runs each job in a fresh jail.

The pool (pool.py) starts it as `python -I -S -B jail/__main__.py CONFIG_JSON`
with an empty environment, so it never holds a secret of the service. `-S`
means no site-packages: everything here, and what it imports (harness.py,
candidate.py, plain.py, crucible.shared.framing), uses the standard library only.

    __main__.py    the entry point: makes those modules importable, starts the worker
    worker.py      start-up: builds what every jail inherits, forks the zygote, supervises
    zygote.py      the fork server: forks each jail into fresh namespaces, reaps it; never holds a job
    supervisor.py  takes each job, runs it in a prepared jail (on a runner thread), enforces the wall
                   clock and the output cap, sends the result
    jailed.py      the jail's pid 1, and a tested job's candidate process beside it
    rootfs.py      the read-only template root, and a job's entry into it
    cgroups.py     a cgroup slot: join it, read its counters, empty it
    seccomp.py     the syscall filter
    outcome.py     the harness's report and the limit a job ran into, read into its result
    linux.py       the flag numbers and libc calls the standard library lacks

The protocol on the worker's stdin and stdout (crucible.shared.framing): the
pool writes a job as two JSON frames, a header (job id, main file, limits) and a
body (files, tests, stdin). The supervisor reads both; job code and tests never
enter the zygote's memory, which every jail inherits (a later job cannot dig
them out of its own). Exactly one frame comes back per job: its result, or
{"job_id", "error"} when the job could not be run.
"""
