"""Helpers of the fuzzed-parser tests: run a parser, count and check its refusals, bound
its time and memory (see conftest.py for the profiles)."""

from __future__ import annotations

import collections
import contextlib
import signal
import tracemalloc

#: a parser that takes longer than this (CPU time) on one input is hanging
HANG_CPU_S = 5.0

#: parser -> Counter(examples=..., refusals=..., parsed=...)
TALLY: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


class Hang(Exception):
    """A parser ran past HANG_CPU_S of CPU time on one input."""


@contextlib.contextmanager
def cpu_limit(seconds: float = HANG_CPU_S):
    """Raise Hang inside the block once it used ``seconds`` of CPU time. ITIMER_VIRTUAL, so
    pytest-timeout's SIGALRM (wall clock) is left alone."""

    def fire(signum, frame):
        raise Hang(f"still running after {seconds:g} s of CPU time")

    old = signal.signal(signal.SIGVTALRM, fire)
    signal.setitimer(signal.ITIMER_VIRTUAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, old)


def outcome(parser: str, call, refusal: type[BaseException] | tuple = (), *, names=None, rejects=None,
            one_line=True):
    """Run ``call()``; return ("parsed", value) or ("refused", exception).

    ``refusal``: the parser's own refusal type(s); any other exception propagates (a crash).
    ``names``: a file name the refusal must mention (the sentence names the file).
    ``rejects(value)``: for a parser that answers with a report instead of raising (a sidecar
    report "invalid"), whether that answer is a refusal, for the summary's count.
    ``one_line``: False where the refusal quotes the input, and the input has line breaks.
    """
    TALLY[parser]["examples"] += 1
    try:
        with cpu_limit():
            value = call()
    except refusal as exc:  # type: ignore[misc]
        TALLY[parser]["refusals"] += 1
        check_sentence(exc, names, one_line)
        return "refused", exc
    TALLY[parser]["refusals" if rejects is not None and rejects(value) else "parsed"] += 1
    return "parsed", value


def check_sentence(exc: BaseException, names=None, one_line=True) -> None:
    """A refusal is one non-empty line of text that names the file it is about."""
    text = str(exc)
    assert text.strip(), f"{type(exc).__name__} with no message"
    assert not one_line or "\n" not in text.strip(), f"a refusal over several lines: {text!r}"
    if names is not None:
        assert str(names) in text, f"the refusal does not name {names}: {text!r}"


@contextlib.contextmanager
def bounded_memory(limit_bytes: int = 4 * 1024 * 1024):
    """Fail when the block's Python allocations peak above ``limit_bytes`` (a header that
    claims 2^40 tokens must be refused, not believed)."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        yield
    finally:
        peak = tracemalloc.get_traced_memory()[1] - base
        if started:
            tracemalloc.stop()
    assert peak < limit_bytes, f"allocated {peak:,} bytes (limit {limit_bytes:,})"


class FileMaker:
    """Writes each example's bytes to a fresh file under one folder per test module
    (function-scoped fixtures do not mix with @given)."""

    def __init__(self, root):
        self.root = root
        self.n = 0

    def folder(self):
        self.n += 1
        d = self.root / f"ex{self.n}"
        d.mkdir()
        return d

    def write(self, name: str, data: bytes | str):
        path = self.folder() / name
        if isinstance(data, str):
            path.write_text(data, encoding="utf-8", errors="surrogatepass")
        else:
            path.write_bytes(data)
        return path
