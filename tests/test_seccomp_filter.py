"""The seccomp filter's program, run by a classic-BPF interpreter here for every syscall number: what
it returns is what the tables in seccomp.py say, whatever shape the program takes (a binary search
since it is installed in every jail). The kernel's own verdicts are test_sandbox.py's and test_trust.py's."""
from __future__ import annotations

import errno
import struct

import pytest

from crucible.services.sandbox_executor.jail import seccomp as S
from crucible.services.sandbox_executor.jail.linux import NAMESPACE_FLAGS, SYS_CLONE, SYS_CLONE3

ALLOW, ENOSYS, EPERM = S.SECCOMP_RET_ALLOW, S.SECCOMP_RET_ERRNO | errno.ENOSYS, S.SECCOMP_RET_ERRNO | errno.EPERM


def run_filter(program: bytes, nr: int, arch: int = S.AUDIT_ARCH_X86_64, arg0: int = 0) -> tuple[int, int]:
    """(what the program returns, instructions run) for one call, as the kernel's interpreter runs it:
    only the instructions the filter may use (ld [k], jeq/jge/jset #k, ret #k); anything else fails."""
    data = struct.pack("IIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    instructions = [struct.unpack("HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    assert 0 < len(instructions) <= 4096
    pc, accumulator, steps = 0, 0, 0
    while True:
        code, jt, jf, k = instructions[pc]  # an index past the end fails: a filter must end in a return
        steps += 1
        if code == S.LD_W_ABS:
            assert k % 4 == 0 and k + 4 <= len(data)
            accumulator = struct.unpack_from("I", data, k)[0]
            pc += 1
        elif code == S.RET:
            return k, steps
        else:
            taken = {S.JEQ: accumulator == k, S.JGE: accumulator >= k, S.JSET: bool(accumulator & k)}[code]
            pc += 1 + (jt if taken else jf)


def expected(nr: int, deny: int, arg0: int) -> int:
    if nr >= S.X32_BIT:
        return deny
    if nr in S.FORBIDDEN_SYSCALLS_X86_64.values():
        return deny
    if nr in S.REFUSED_SYSCALLS_X86_64.values():
        return EPERM
    if nr in S.UNIX_ONLY_X86_64.values():
        return ALLOW if arg0 == S.AF_UNIX else deny
    if nr == SYS_CLONE:
        return deny if arg0 & NAMESPACE_FLAGS else ALLOW
    if nr == S.SYS_PRCTL:
        return deny if arg0 == S.PR_SET_SECCOMP_ARG else ALLOW
    if nr == SYS_CLONE3 or nr > S.NEWEST_KNOWN_SYSCALL:
        return ENOSYS
    return ALLOW


@pytest.mark.parametrize("notify", [True, False])
def test_every_syscall_number_gets_what_the_tables_say(notify):
    deny = S.SECCOMP_RET_USER_NOTIF if notify else S.SECCOMP_RET_KILL_PROCESS
    program = S.compile_filter(notify)
    numbers = [*range(S.NEWEST_KNOWN_SYSCALL + 64), 2**31 - 1, S.X32_BIT - 1, S.X32_BIT, S.X32_BIT + 41, 2**32 - 1]
    arguments = [0, 1, 2, S.AF_UNIX, 10, S.PR_SET_SECCOMP_ARG, 0x11, *(1 << bit for bit in range(32))]
    longest = 0
    for nr in numbers:
        for arg0 in arguments:
            verdict, steps = run_filter(program, nr, arg0=arg0)
            assert verdict == expected(nr, deny, arg0), (nr, arg0, hex(verdict))
            longest = max(longest, steps)
        # Another architecture's call is refused, whatever its number.
        assert run_filter(program, nr, arch=0x40000003)[0] == deny
    # Found by search: no call runs more than a couple of dozen instructions of it (a list of
    # comparisons ran seventy-odd for every allowed call, at each install once per syscall number).
    assert longest <= 24, longest


def test_a_jump_too_far_for_classic_bpf_is_refused_not_wrapped():
    with pytest.raises(ValueError, match="does not fit"):
        S._jump(S.JEQ, 0, 256, 0)


def test_a_syscall_number_in_two_tables_is_refused_not_silently_ranked(monkeypatch):
    monkeypatch.setitem(S.REFUSED_SYSCALLS_X86_64, "ptrace", S.FORBIDDEN_SYSCALLS_X86_64["ptrace"])
    with pytest.raises(ValueError, match=r"\[101\] are in two"):
        S.compile_filter(True)
