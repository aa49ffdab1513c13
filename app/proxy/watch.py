"""What the conversation proxy asks the server by itself: how it caches prompts on its own, whether
it emptied an idle slot or slept, and where a re-processed prompt first differed, by tokens.

* :func:`read_caching`: the server's own caching from its binary's ``--help`` and the launch argv
  (:func:`app.core.helptext.server_caching`): idle-slot clearing, sleep, a disk prompt cache.
* :class:`ServerWatch`: the live side. :meth:`ServerWatch.check_cleared` reads ``/slots`` after a
  request and tells the leases of every idle slot the server emptied (idle-slot caching clears
  idle slots when another task starts); :meth:`ServerWatch.before_dispatch` saves the dirty idle
  slots first when the server clears them (the workaround, a setting); the sleep timer parks dirty
  conversations before ``--sleep-idle-seconds`` runs out and notices the sleep (``/props``
  ``is_sleeping``) when it came all the same.
* :func:`divergence`: the first divergent token of a request against the slot's previous prompt,
  both rendered by the server (``/apply-template`` for chat messages) and tokenised by it
  (``/tokenize``). Only for requests that re-processed, after the answer went out, bounded by
  :data:`app.proxy.explain.TOKEN_DIFF_MAX_CHARS`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable

from app.core.background import track
from app.core.conversation import ServerCaching
from app.core.helptext import server_caching
from app.proxy.explain import TOKEN_DIFF_MAX_CHARS

log = logging.getLogger(__name__)

#: seconds before the server's sleep timeout that the proxy parks its dirty conversations
SLEEP_MARGIN_S = 5.0
#: request keys /apply-template does not need (the rest renders the prompt as the request did)
_NOT_RENDERED = ("stream", "stream_options", "id_slot", "cache_prompt", "n_probs")


async def help_text(binary: str, timeout: float = 20.0) -> str:
    """The binary's ``--help`` ("" when it cannot be run)."""
    try:
        proc = await asyncio.create_subprocess_exec(binary, "--help", stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    except OSError as e:
        log.warning("cannot run %s --help to read its caching: %s", binary, e)
        return ""
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        log.warning("%s --help took over %.0f s: its caching is not known", binary, timeout)
        return ""
    return out.decode("utf-8", "replace")


async def read_caching(handle) -> ServerCaching:
    """The server's own caching, from its launch plan (binary, argv); unknown (all off) for a server
    not launched here."""
    plan = getattr(handle, "plan", None)
    if plan is None:
        return ServerCaching(notes=("the server was not launched here: its caching is not known",))
    return server_caching(list(plan.argv[1:]), await help_text(plan.binary))


ROUTER_NOTICE = ("The server is a router (started without a model): each model a request names runs in a child "
                 "server the router starts and stops. The proxy passes every request through untouched and judges "
                 "it from the child's timings; it leases and parks no slot of a router.")


def caching_notice(c: ServerCaching, save_before_clear: bool) -> str | None:
    """What the user should know of the server's own caching behind the proxy (None: nothing)."""
    if c.router:
        return ROUTER_NOTICE
    if c.steps_aside:
        return (f"The server persists prompts on disk itself ({c.disk_cache}): the conversation proxy steps aside. "
                "Requests pass through unchanged (no slot pinning, no parks); each is still judged.")
    said = []
    if c.idle_slots_cleared:
        said.append("The server clears idle slots when another task starts (--cache-idle-slots with unified KV): "
                     + ("the proxy saves a conversation's idle slot before another request runs (setting "
                        "proxy_save_before_idle_clear)." if save_before_clear else
                        "the proxy does not save them first (setting proxy_save_before_idle_clear is off).")
                     + " Remedy: start the server with --no-cache-idle-slots.")
    if c.sleep_idle_seconds:
        said.append(f"The server sleeps after {c.sleep_idle_seconds} idle seconds and loses every slot: the proxy "
                    f"parks its conversations {SLEEP_MARGIN_S:g} s before.")
    return " ".join(said) or None


class ServerWatch:
    """The live side of the server's own caching, for one proxy (see the module's doc)."""

    def __init__(self, client, leases, caching: ServerCaching, *, save_before_clear: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.client, self.leases, self.caching = client, leases, caching
        self.save_before_clear = save_before_clear
        self._clock = clock
        self._last_activity = clock()
        self._timers: list[asyncio.TimerHandle] = []
        self.cleared_seen = 0  # idle slots found emptied by the server
        self.slept_seen = 0  # sleeps noticed

    # -- idle-slot clearing
    async def before_dispatch(self) -> list[str]:
        """Before a request goes to its slot: when the server clears idle slots, save the dirty
        ones first (their conversations are parked, not lost). The conversations saved."""
        if not (self.caching.idle_slots_cleared and self.save_before_clear):
            return []
        return await self.leases.save_dirty()

    async def check_cleared(self) -> list[int]:
        """After a request: the idle slots the leases think hold a conversation that ``/slots`` shows
        empty; each is told to the leases (``note_slot_cleared``). Only when the server caches idle
        slots at all (``--cache-idle-slots``): it is what clears them."""
        if not self.caching.idle_slots_saved:
            return []
        held = {v.index: v for v in self.leases.snapshot() if v.conversation and v.n_tokens > 0
                and v.state.value in ("idle-dirty", "idle-clean")}
        outside = self.leases.outside_prompts()  # FREE slots holding a prompt passed through untouched
        held.update({v.index: v for v in self.leases.snapshot() if v.index in outside and v.state.value == "free"})
        if not held:
            return []
        try:
            rows = await self.client.slots()
        except Exception as e:  # report: the check is skipped; the next request's verdict still says it
            log.warning("cannot read /slots to see whether the server cleared idle slots: %s", e)
            return []
        now = {v.index: v for v in self.leases.snapshot()}
        cleared = []
        for row in rows:
            i = row.get("id")
            if i not in held or row.get("is_processing") or now.get(i) != held[i] \
                    or (i in outside and self.leases.outside_prompts().get(i) != outside[i]):
                continue  # in use meanwhile, or changed since: /slots may be older than the lease
            if "n_prompt_tokens" in row and int(row.get("n_prompt_tokens") or 0) == 0:
                self.leases.note_slot_cleared(i)
                cleared.append(i)
        if cleared:
            self.cleared_seen += len(cleared)
            log.info("the server cleared idle slot(s) %s (idle-slot caching)", cleared)
        return cleared

    # -- sleep
    def note_activity(self) -> None:
        """A request ended: the server's idle clock starts again; park before it runs out."""
        self._last_activity = self._clock()
        n = self.caching.sleep_idle_seconds
        if not n:
            return
        for t in self._timers:
            t.cancel()
        loop = asyncio.get_running_loop()
        self._timers = [
            loop.call_later(max(0.0, n - SLEEP_MARGIN_S) if n > SLEEP_MARGIN_S else n / 2.0,
                            lambda: track(self.park_before_sleep(), "parking the conversations before the "
                                                                    "server sleeps")),
            loop.call_later(n + 1.0, lambda: track(self.check_slept(), "checking whether the server slept")),
        ]

    async def park_before_sleep(self) -> list[str]:
        """Save every dirty slot: the server is about to destroy its context."""
        saved = await self.leases.save_dirty()
        if saved:
            log.info("parked %d conversation(s) before the server sleeps", len(saved))
        return saved

    async def check_slept(self) -> bool:
        """Whether the server sleeps now (``/props`` ``is_sleeping``); if so the leases are told (every
        slot is empty, the parks stay)."""
        if not self.caching.sleep_idle_seconds:
            return False
        try:
            props = await self.client.props()
        except Exception as e:  # report: not known; the next request's check asks again
            log.warning("cannot read /props to see whether the server slept: %s", e)
            return False
        if not props.get("is_sleeping"):
            return False
        self.slept_seen += 1
        self.leases.note_server_slept()
        return True

    async def before_request(self) -> None:
        """Before a request: when the server may have slept since the last one, ask it."""
        n = self.caching.sleep_idle_seconds
        if n and self._clock() - self._last_activity >= n:
            await self.check_slept()

    def close(self) -> None:
        for t in self._timers:
            t.cancel()
        self._timers = []


# -- the first divergent token -----------------------------------------------------------------------

async def render(client, path: str, body: dict | None) -> str | None:
    """The prompt text the server makes of a request ``body`` (None: not renderable, or too long)."""
    if not body:
        return None
    if "messages" in body:
        if len(json.dumps(body.get("messages"), ensure_ascii=False)) > TOKEN_DIFF_MAX_CHARS:
            return None
        return await client.apply_template({k: v for k, v in body.items() if k not in _NOT_RENDERED})
    prompt = body.get("prompt")
    if isinstance(prompt, str) and len(prompt) <= TOKEN_DIFF_MAX_CHARS:
        return prompt
    return None


async def divergence(client, path: str, previous: dict | None, current: dict) -> tuple[list, list] | str:
    """(the previous prompt's tokens, this one's), each as (id, text) pairs, as the server renders and
    tokenises them; or a reason (str) why not."""
    try:
        before = await render(client, path, previous)
        now = await render(client, path, current)
    except Exception as e:  # report: an older server without /apply-template: messages and characters say it
        log.info("the server cannot render the prompts for a token comparison: %s", e)
        return f"the server could not render the prompts ({e})"
    if before is None or now is None:
        return f"the prompt is over {TOKEN_DIFF_MAX_CHARS:,} characters, or not text"
    try:
        return await client.tokenize_pieces(before), await client.tokenize_pieces(now)
    except Exception as e:  # report: as above, by /tokenize
        log.info("the server cannot tokenise the prompts for a token comparison: %s", e)
        return f"the server could not tokenise the prompts ({e})"


def body_of(messages: list[Any]) -> dict:
    """A chat request body rebuilt from stored messages (after an app restart the proxy no longer has
    the previous request's own body): role, content, reasoning."""
    out = []
    for m in messages:
        d = {"role": m.role, "content": m.content}
        if m.reasoning:
            d["reasoning_content"] = m.reasoning
        if m.name and m.role == "tool":
            d["tool_call_id"] = m.name
        out.append(d)
    return {"messages": out}


def profile_caching(profile_name: str) -> ServerCaching | None:
    """The caching of the server a stored profile launches (its binary's ``--help`` and its argv), for a
    face without a running proxy (``kv-valet conversations list``); None when it cannot be told (no such
    profile, no binary)."""
    import subprocess

    from app.core.argv import to_argv
    from app.core.profile import ProfileError
    from app.server.discovery import DiscoveryError, find_server_binary
    from app.store.profiles import ProfileStore

    try:
        profile = ProfileStore().load(profile_name)
        if profile.router:
            return ServerCaching(router=True)
        binary = find_server_binary(profile.server_binary).path
        r = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=20,
                           stdin=subprocess.DEVNULL, errors="replace")
    except (DiscoveryError, ProfileError, OSError, ValueError, subprocess.SubprocessError) as e:
        log.info("the caching of profile %s's server is not known: %s", profile_name, e)
        return None
    return server_caching(to_argv(profile, binary)[1:], (r.stdout or "") + (r.stderr or ""))
