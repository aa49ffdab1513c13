"""The llama-server log-line parser (app.server.logparse.parse_line) under random text and
under lines built from every rule it knows, with random numbers (up to thousands of digits),
slot and task prefixes, and random text around them; plus long lines built to make a regular
expression backtrack.

parse_line never refuses: an unknown line is a RAW event. So the property is no exception at
all, an event that keeps the line, and time linear in the line's length.
"""

from __future__ import annotations

import time

from hypothesis import given, strategies as st

from app.server.logparse import Kind, LogEvent, parse_line
from tests.fuzz.fuzzkit import outcome

NUM = st.one_of(st.integers(-(10**6), 10**6).map(str), st.integers(0, 10**30).map(str),
                st.integers(1, 6000).map(lambda n: "9" * n), st.floats(allow_nan=False, allow_infinity=False).map(str))
TEXT = st.text(max_size=30)
TEMPLATES = [
    "prompt eval time = {n} ms / {n} tokens", "       eval time = {n} ms / {n} tokens",
    "total time = {n} ms / {n} tokens",
    "prompt processing, n_tokens = {n}, progress = {n}", "forcing full prompt re-processing due to {t}",
    "restored context checkpoint ({t}={n}, {t} = {n})", "created context checkpoint {n} of {n} ({t} = {n})",
    "saved {n} context checkpoints to sidecar", "restored {n} context checkpoint from sidecar",
    "failed to write checkpoint sidecar {t}", "ignoring checkpoint sidecar: {t} ({t})", "checkpoint sidecars: {t}",
    "saving idle slot to prompt cache", "prompt cache update took {n} ms", "stop processing: n_tokens = {n}",
    "selected slot by {t}", "processing task", "new prompt, n_ctx_slot = {n}, n_keep = {n}, task.n_tokens = {n}",
    "new slot, n_ctx = {n}", "model loaded", "listening on {t}", "all slots are idle",
    "couldn't bind HTTP server socket, hostname: {t}, port: {n}", "failed to load model{t}", "out of memory {t}",
    "build {n} {t}", "GGML_ASSERT({t}) failed", "terminate called after throwing {t}", "error: {t}", "{t}",
]


@st.composite
def log_lines(draw):
    body = draw(st.sampled_from(TEMPLATES))
    while "{n}" in body or "{t}" in body:
        body = body.replace("{n}", draw(NUM), 1).replace("{t}", draw(TEXT), 1)
    if draw(st.booleans()):
        body = f"id {draw(NUM)} | task {draw(NUM)} | {body}"
    if draw(st.booleans()):
        level, comp = draw(st.sampled_from("IWED")), draw(st.sampled_from(["slot", "srv", "cmn", "main", "x"]))
        body = f"{draw(st.sampled_from(['0.56.866.079', '1.5', '12.0.0.1']))} {level} {comp} {draw(TEXT)}: {body}"
    return body + draw(st.sampled_from(["", "\n", "\r\n", "\r"]))


def check(line: str) -> None:
    kind, event = outcome("log line", lambda: parse_line(line))
    assert kind == "parsed" and isinstance(event, LogEvent) and isinstance(event.kind, Kind)
    assert event.line == line.rstrip("\r\n")


@given(st.text(max_size=300))
def test_random_text(line):
    check(line)


@given(log_lines())
def test_lines_of_every_rule(line):
    check(line)


# Lines that make a backtracking regular expression quadratic: a 20,000-character word where
# a `\w+\s*=` is looked for took 2.6 s, 100,000 characters a minute.
PATHOLOGICAL = [
    lambda n: "restored context checkpoint (" + "a" * n + ")",
    lambda n: "created context checkpoint 1 of 2 (" + "a" * n + ")",
    lambda n: "0.1.2.3 I slot restore: id 1 | task 2 | restored context checkpoint (" + "x_" * (n // 2) + ")",
    lambda n: "ignoring checkpoint sidecar: " + " (" * (n // 2) + ")",
    lambda n: "ignoring checkpoint sidecar: " + "a (b" * (n // 4) + ")",
    lambda n: "0.1 I " + "a " * (n // 2),
    lambda n: "1.1 I x " + "y" * n + ":",
    lambda n: "GGML_ABORT(" * (n // 11),
    lambda n: "id " + "1" * n + " | task 1 | x",
    lambda n: "prompt eval time = " + "1" * n + " ms / " + "2" * n + " tokens",
]


@given(st.sampled_from(range(len(PATHOLOGICAL))))
def test_long_lines_take_linear_time(which):
    """A 200,000-character line parses about as fast, per character, as a 20,000-character one."""
    make = PATHOLOGICAL[which]

    def seconds(n):
        line = make(n)
        t = time.process_time()
        check(line)
        return time.process_time() - t

    small, big = seconds(20_000), seconds(200_000)
    assert big < 0.5 or big < 30 * max(small, 0.002), f"{small:.3f} s for 20,000 characters, {big:.3f} s for 200,000"
