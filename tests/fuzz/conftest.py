"""Hypothesis profiles and shared checks for the fuzzed parsers (issue #21, part 2).

Two profiles, both registered here:

* ``kvv-ci`` (the default): about 200 examples per test, the whole folder in well under a
  minute on two cores.
* ``kvv-long`` (``KVV_FUZZ=long``): at least 10,000 examples per test, on demand:
  ``KVV_FUZZ=long .venv/bin/python -m pytest tests/fuzz -q``. The figures in docs/survives.md's
  "What KV Valet survives" table come from this run (the terminal summary prints them; with
  ``KVV_FUZZ_REPORT=FILE`` they are also written there as JSON).

Every parser call goes through :func:`tests.fuzz.fuzzkit.outcome`, which runs it under a CPU-time limit (a hang
fails the example instead of the whole run), counts what it did (parsed, refused) for the
summary, and lets any exception other than the parser's own refusal type through: that is a
crash, and Hypothesis shrinks it to the smallest input that shows it.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, settings

from tests.fuzz.fuzzkit import TALLY, FileMaker

LONG = os.environ.get("KVV_FUZZ", "").lower() == "long"
CI_EXAMPLES = 200
LONG_EXAMPLES = 10_000

_common = dict(
    # A slow shared CI core can take a few hundred ms for one example; a hang takes forever
    # (and fuzzkit.outcome()'s CPU-time limit stops it first).
    deadline=timedelta(seconds=3),
    # the autouse per-test folders (tests/conftest.py) are harmless across examples: every
    # example writes its own files under a tmp_path_factory folder
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("kvv-ci", max_examples=CI_EXAMPLES, **_common)
settings.register_profile("kvv-long", max_examples=LONG_EXAMPLES, **_common)
settings.load_profile("kvv-long" if LONG else "kvv-ci")


@pytest.fixture(scope="module")
def files(tmp_path_factory, request):
    return FileMaker(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]))


def pytest_collection_modifyitems(config, items):
    if LONG:  # 10,000 examples of one test may run past pytest.ini's 300 s
        for item in items:
            if "tests/fuzz/" in str(item.fspath).replace(os.sep, "/"):
                item.add_marker(pytest.mark.timeout(3600))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not TALLY:
        return
    tr = terminalreporter
    tr.section(f"fuzzed parsers ({'long' if LONG else 'ci'} profile)")
    tr.write_line(f"{'parser':<28} {'examples':>9} {'parsed':>9} {'refusals':>9}")
    for name in sorted(TALLY):
        c = TALLY[name]
        tr.write_line(f"{name:<28} {c['examples']:>9,} {c['parsed']:>9,} {c['refusals']:>9,}")
    out = os.environ.get("KVV_FUZZ_REPORT")
    if out:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"profile": "long" if LONG else "ci", "exit": int(exitstatus),
                       "parsers": {k: dict(v) for k, v in sorted(TALLY.items())}}, f, indent=1)
