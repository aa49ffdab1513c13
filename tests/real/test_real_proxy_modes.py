"""The proxy's server-side cases on the real llama-server (build 11434, Gemma 3 270M), each started
through the app's launcher (which runs it with --no-repack on this VM's AMX CPU, app/server/cpu.py):

* the first divergent token of a request whose earlier message was edited, against the server's own
  rendering (/apply-template) and tokenisation (/tokenize) of the unchanged prefix;
* idle-slot caching (``-kvu --cache-idle-slots --cache-ram N``). Checked by hand on 11434 first: an
  idle slot IS cleared (``/slots`` shows 0 prompt tokens) when another slot starts a task, after it was
  saved to the RAM cache; a request pinned to the emptied slot re-processes everything (cache_n 0: a
  pinned EMPTY slot never looks in the RAM cache), one pinned to a slot holding another prompt loads
  the longest match from it (cache_n 191 of 201). So: the workaround (save first) brings the
  conversation back from its park; without it the proxy leaves the conversation to the server's RAM
  cache, and when that cache is too small for it the request is explained IDLE_SLOT_CLEARED;
* sleep (``--sleep-idle-seconds N``): 11434 sleeps after N idle seconds (``/props`` ``is_sleeping``)
  and its slots and RAM cache are gone on wake. The proxy parks before; after the sleep a parked
  conversation comes back from its park, one that slept in a dirty slot is explained SERVER_SLEPT.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app import settings
from app.core.conversation import Cause
from app.core.verdict import VerdictKind, tolerance
from app.proxy.lease_table import SlotState
from app.proxy.watch import SLEEP_MARGIN_S
from tests.real.helpers import TEXT
from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)
from tests.real.test_real_proxy import SYSTEMS, Proxied, turn
from tests.real.test_real_proxy import sidecar_proxy_profile  # noqa: F401  (fixture)

pytestmark = pytest.mark.real_server

ROOT = Path(__file__).resolve().parents[2]


async def until(condition, what: str, timeout: float = 120.0, every: float = 0.05):
    """Poll ``condition()`` (sync or async) until it is true, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(every)


# -- 1. the first divergent token ----------------------------------------------------------------------


def common_prefix(a: str, b: str) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[:n]


def test_an_edited_earlier_message_gets_the_servers_first_divergent_token(real_profile):
    """A client that names its chat (``user``) edits its first question and sends the chat again: the same
    conversation, PARTIAL or MISS, EARLIER_MESSAGE_EDITED; the stored first divergent token is the
    number of tokens the server makes of the unchanged rendered prefix; ``kv-valet conversations show
    ID --json`` shows it."""
    async def go():
        async with Proxied(real_profile.replace(proxy=True)) as p:
            sys_p, q1, q1_edited = SYSTEMS["A"], "What is the first word?", "Tell me the first word."
            r1, first = await p.ask(turn(sys_p, question=q1), user="chat-7")
            previous = turn(sys_p, (q1, r1), question="And the second?")
            r2, second = await p.ask(previous, user="chat-7")
            assert second.conversation == first.conversation and second.verdict is VerdictKind.HIT, second
            edited = turn(sys_p, (q1_edited, r1), ("And the second?", r2), question="And the third?")
            _, rec = await p.ask(edited, user="chat-7")
            assert rec.conversation == first.conversation
            assert rec.verdict in (VerdictKind.PARTIAL, VerdictKind.MISS), rec
            assert rec.explanation.cause is Cause.EARLIER_MESSAGE_EDITED, rec.explanation
            await p.proxy.settle()  # the token comparison runs after the answer went out
            stored = p.proxy.store.requests(rec.conversation)[0]
            # independently: the server renders both requests, the unchanged prefix is tokenised by it
            client = p.handle.client
            before = await client.apply_template({"messages": previous})
            now = await client.apply_template({"messages": edited})
            shared = common_prefix(before, now)
            assert sys_p in shared and not shared.endswith(q1[:1])  # up to where the edited message starts
            n_shared = len(await client.tokenize_pieces(shared))
            assert n_shared > 150
            assert stored.explanation.first_divergent_token == n_shared, stored.explanation
            assert stored.explanation.sent_token and "Tell" in stored.explanation.sent_token
            assert rec.cache_n >= n_shared - 16  # the server reused the prefix it said it shared
            conv_id = rec.conversation

        out = subprocess.run([sys.executable, "-m", "app.cli", "conversations", "show", conv_id, "--json"],
                             cwd=str(ROOT), env=os.environ.copy(), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        shown = json.loads(out.stdout)
        latest = max(shown["requests_shown"], key=lambda r: r["at"])
        assert latest["first_divergent_token"] == n_shared, latest

    asyncio.run(go())


# -- 2. idle-slot caching ------------------------------------------------------------------------------


def idle_clearing(profile, cache_ram: int):
    return profile.replace(kv_unified=True, cache_idle_slots=True, cache_ram=cache_ram, proxy=True)


async def a_then_b(p: Proxied, a: str, b: str, reply_a: str | None = None):
    """A's turn, then B's on the other slot: B's task makes the server clear A's idle slot."""
    msgs = turn(SYSTEMS[a], question="What is the first word?") if reply_a is None else \
        turn(SYSTEMS[a], ("What is the first word?", reply_a), question="And the second?")
    reply, rec_a = await p.ask(msgs)
    _, rec_b = await p.ask(turn(SYSTEMS[b], question="What is the first word?"))
    assert rec_b.slot != rec_a.slot
    assert p.proxy.watch.cleared_seen >= 1, "the server did not clear the idle slot"
    return reply, rec_a


def test_idle_slot_clearing_on_the_stock_server(real_profile):
    """``-kvu --cache-idle-slots --cache-ram 64``. With the workaround, A is parked before B's task clears
    its slot; its park is not restored (the stock build restores no checkpoints, and Gemma's SWA would
    re-process it all: the resume matrix), explained RESTORE_WITHOUT_CHECKPOINTS. Without it, A used again since that park is cleared with more
    tokens than its park holds: the proxy leaves it to the server's RAM cache, pinned to the idle slot that
    holds C (a pinned empty slot never looks there), and the server loads it: HIT, no restore."""
    async def go():
        async with Proxied(idle_clearing(real_profile, 64)) as p:
            c = p.proxy.caching
            assert c.idle_slots_cleared and c.ram_cache and "--no-cache-idle-slots" in p.proxy.notice()
            reply_a, first_a = await a_then_b(p, "A", "B")
            conv_a = p.proxy.conversations[first_a.conversation]
            assert conv_a.parked_as == f"proxy-{conv_a.id}"  # saved before B's task cleared it
            reply_a2, back = await p.ask(turn(SYSTEMS["A"], ("What is the first word?", reply_a),
                                              question="And the second?"))
            assert back.conversation == conv_a.id and back.restored_from is None, back
            assert back.verdict is VerdictKind.MISS, back
            assert back.explanation.cause is Cause.RESTORE_WITHOUT_CHECKPOINTS, back.explanation
            assert "did not restore" in back.explanation.detail, back.explanation

            p.proxy.apply_settings(settings.Settings(proxy_save_before_idle_clear=False))
            _, rec_c = await p.ask(turn(SYSTEMS["C"], question="What is the first word?"))  # clears A's slot
            assert p.proxy.leases.lost_cause(conv_a.id)[0] is Cause.IDLE_SLOT_CLEARED
            assert p.proxy.leases.ram_longer(conv_a)  # its park is older than its last request
            _, again = await p.ask(turn(SYSTEMS["A"], ("What is the first word?", reply_a),
                                        ("And the second?", reply_a2), question="And the third?"))
            assert again.conversation == conv_a.id and again.restored_from is None, again
            assert again.slot == rec_c.slot and p.proxy.leases.ram_chosen == 1
            assert again.verdict is VerdictKind.HIT, again  # loaded from the server's RAM cache
            assert again.cache_n >= again.expected_reuse - tolerance(again.expected_reuse)

    asyncio.run(go())


def test_idle_slot_clearing_without_the_workaround_and_a_ram_cache_too_small(real_profile):
    """``--cache-ram 1``: a conversation's state (over 1 MiB here) does not fit the server's RAM cache, so
    the cleared slot is lost: the returning conversation re-processes, explained IDLE_SLOT_CLEARED (the
    proxy had left it to the RAM cache, and says the server did not find it there)."""
    settings.update(proxy_save_before_idle_clear=False)
    long_system = SYSTEMS["A"] + " " + TEXT[900:1800]

    async def go():
        async with Proxied(idle_clearing(real_profile, 1)) as p:
            assert p.proxy.caching.ram_cache and not p.proxy.save_before_idle_clear
            reply, first = await p.ask(turn(long_system, question="What is the first word?"))
            await p.ask(turn(SYSTEMS["B"], question="What is the first word?"))
            assert p.proxy.watch.cleared_seen >= 1
            conv = p.proxy.conversations[first.conversation]
            assert conv.parked_as is None  # never saved: the workaround is off
            _, back = await p.ask(turn(long_system, ("What is the first word?", reply), question="And the second?"))
            assert back.conversation == conv.id and back.restored_from is None
            assert back.verdict is VerdictKind.MISS, back
            assert back.explanation.cause is Cause.IDLE_SLOT_CLEARED, back.explanation
            assert "RAM prompt cache" in back.explanation.detail

    asyncio.run(go())


def test_idle_slot_clearing_with_the_workaround_on_the_sidecar_build_comes_back_warm(sidecar_proxy_profile):
    async def go():
        async with Proxied(idle_clearing(sidecar_proxy_profile, 64)) as p:
            reply_a, first_a = await a_then_b(p, "A", "B")
            park = f"proxy-{first_a.conversation}"
            _, back = await p.ask(turn(SYSTEMS["A"], ("What is the first word?", reply_a), question="And the second?"))
            assert back.conversation == first_a.conversation and back.restored_from == park, back
            assert back.verdict is VerdictKind.HIT, back  # restored with its checkpoints

    asyncio.run(go())


# -- 3. sleep ---------------------------------------------------------------------------------------------


#: the server's idle seconds before it sleeps in the sleep test: the proxy parks SLEEP_MARGIN_S before
#: (app.proxy.watch), so a second after the request; the margin is the product's own, not the 1 s a
#: 2 s sleep left (the park raced the server's sleep timer on a busy machine)
SLEEP_IDLE_S = int(SLEEP_MARGIN_S) + 1


def test_sleep_parks_first_and_a_dirty_slot_is_explained(sidecar_proxy_profile):
    """``--sleep-idle-seconds SLEEP_IDLE_S`` (6) on the v2 sidecar build. A is parked by the proxy before
    the server sleeps (1 s after its request, the server 5 s later; the server's log shows the order).
    B's slot is left dirty (the proxy's park before the sleep does nothing once A is parked, as when it
    misses the margin: no race with the timer). After the sleep (``/props`` ``is_sleeping``): A comes
    back from its park warm, B re-processes, explained SERVER_SLEPT. Whether the server also slept
    between A's park and B's request (a busy machine) changes none of it: A's request is judged by the
    one sleep it notices."""
    async def go():
        n = SLEEP_IDLE_S
        async with Proxied(sidecar_proxy_profile.replace(extra_args=("--sleep-idle-seconds", str(n)))) as p:
            assert p.proxy.caching.sleep_idle_seconds == n and f"sleeps after {n}" in p.proxy.notice()
            reply_a, first_a = await p.ask(turn(SYSTEMS["A"], question="What is the first word?"))
            leases = p.proxy.leases
            await until(lambda: leases.state(first_a.slot) is SlotState.IDLE_CLEAN, "A parked before the sleep")
            conv_a = p.proxy.conversations[first_a.conversation]
            assert conv_a.parked_as == f"proxy-{conv_a.id}"
            async def misses_the_margin():  # the timer may still fire, whenever it does: it parks nothing
                return []

            p.proxy.watch.park_before_sleep = misses_the_margin
            reply_b, first_b = await p.ask(turn(SYSTEMS["B"], question="What is the first word?"))
            p.proxy.watch.close()  # and no check of the sleep by timer: A's request is what notices it
            assert leases.state(first_b.slot) is SlotState.IDLE_DIRTY
            client = p.handle.client
            await until(lambda: _sleeping(client), "the server asleep", every=0.1)

            seen = p.proxy.watch.slept_seen
            _, back_a = await p.ask(turn(SYSTEMS["A"], ("What is the first word?", reply_a),
                                         question="And the second?"))
            assert p.proxy.watch.slept_seen == seen + 1  # asked /props before the request: it slept
            assert back_a.conversation == conv_a.id and back_a.restored_from == conv_a.parked_as, back_a
            assert back_a.verdict is VerdictKind.HIT, back_a
            _, back_b = await p.ask(turn(SYSTEMS["B"], ("What is the first word?", reply_b),
                                         question="And the second?"))
            assert back_b.conversation == first_b.conversation and back_b.restored_from is None
            assert back_b.verdict is VerdictKind.MISS, back_b
            assert back_b.explanation.cause is Cause.SERVER_SLEPT, back_b.explanation

            # the order of events as the server logged them: A's park (the first save) written, then the sleep
            log = p.handle.supervisor.log

            def first(text: str) -> int | None:
                return next((i for i, item in enumerate(log.since(0)) if text in item.event.line), None)
            await until(lambda: first(SLEEP_LINE) is not None, "the server's log line of its sleep")
            saved = first(SAVE_LINE)
            assert saved is not None and saved < first(SLEEP_LINE), log.tail(400)

    asyncio.run(go())


#: what the v2 sidecar build logs at every save, and llama-server 11434 when it goes to sleep
SAVE_LINE = "context checkpoints to sidecar"
SLEEP_LINE = "server is entering sleeping state"


async def _sleeping(client) -> bool:
    return bool((await client.props()).get("is_sleeping"))
