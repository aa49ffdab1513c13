"""The proxy's door to one server's slots and parks through its session service: the leases' slot
operations (:class:`SessionBackend`: a park, a restore with its final checks, an erase, a park's size
and deletion) and what a slot holds after a request cut short (:func:`tokens_left`).

A conversation's park is a catalog session (``proxy-<id>``), private like every park; a host's server
is reached through the same door (its :class:`app.servers.remote_sessions.RemoteSessions`, the host's
own ``kv-valet`` over SSH).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, NamedTuple

from app.core.verdict import tolerance
from app.proxy import explain as explain_mod
from app.proxy import identity
from app.proxy.lease_parks import RestoreAvoided
from app.proxy.metrics import ProxyMetrics
from app.proxy.request_facts import CHAT_PATHS, TEXT_PATHS
from app.server.client import ServerError, ServerUnreachable
from app.server.statefile import StateFileError
from app.servers.service import ServerHandle, ServerService
from app.sessions.protocol import Sessions
from app.sessions.resume import ResumeHazard, ResumeMismatch, ResumeRefused, ResumeUseless
from app.sessions.watch import common_prefix

log = logging.getLogger(__name__)

#: After a streamed request cut short, /slots is read until the slot stops processing: this many reads
#: at most, this far apart (the server stops a stream's task when its next chunk meets the closed
#: connection, a few milliseconds)
CUT_SHORT_READS = 50
CUT_SHORT_READ_EVERY_S = 0.02
#: ... and after a non-streamed one, fewer reads, further apart. llama-server (b11434, server-queue.cpp
#: ``recv_with_timeout``) looks at a non-streamed request's connection only when no result has reached
#: its waiting handler for HTTP_POLLING_SECONDS (1 s), and every other task's result, a /slots read's
#: included, starts that second again: reads closer than a second would keep the abandoned generation
#: running (measured: still generating 8 s after the client left, polled every 0.1 s; stopped within
#: 1.1 s when polled every second). The first read waits that quiet second out.
CUT_SHORT_QUIET_READS = 6
CUT_SHORT_QUIET_EVERY_S = 1.25
#: The token check before a restore tokenises a prefix of the prompt, not all of it: the prefix's last
#: tokens are not trusted (a text cut mid-word tokenises differently near the cut) ...
PREFIX_UNTRUSTED_TOKENS = 64
#: ... and the first prefix tried is this many characters per token it needs (a longer one follows when it
#: holds too few tokens to decide)
PREFIX_CHARS_PER_TOKEN = 8


class RestoreFor(NamedTuple):
    """The request a restore of a park is for (its final check): its path and body (the chat request it
    amounts to), and whether its messages prove the park's tokens are its own: they continue the request
    whose render and answer the park holds (its hash chain extends ``Conversation.park_chain``). Then the
    server's render starts with the park's tokens and the token check is not made; a request the client's
    name alone tied to the conversation, one that changed its history, or a park of unknown content (made
    after a request cut short, or by an earlier process) is checked."""

    path: str
    body: dict
    proven: bool = False
    # takes the restore's bookkeeping to run once the request is sent (app.sessions.protocol.Sessions.resume)
    later: Callable[[Callable[[], None]], None] | None = None


class SessionBackend:
    """The leases' slot operations through the server's :class:`app.sessions.protocol.Sessions`, the
    one door to a server's slots and parks, here or on a host: a conversation's park is a session of
    that server's catalog (``proxy-<id>``), private like every park. ``sessions``: that server's
    Sessions once it is there (an async getter: a server here connects its session service on
    first use); ``sessions_now``: the same without waiting (None: not connected yet)."""

    def __init__(self, handle: ServerHandle | None, sessions: Callable[[], Awaitable[Sessions]],
                 sessions_now: Callable[[], Sessions | None]):
        self.handle = handle
        self._sessions, self._sessions_now = sessions, sessions_now
        self.checkpoints_loaded: dict[int, bool | None] = {}
        # a restore with no usable sidecar into a slot holding another chat's checkpoints, on a build
        # that keeps them across a restore (the turboquant fork): the session service's warning, or None
        self.hazards: dict[int, str | None] = {}
        # park name -> the request a restore of that park is for: the final check
        self.requests: dict[str, RestoreFor] = {}
        self.metrics: ProxyMetrics | None = None  # told of each park and restore

    @classmethod
    def here(cls, handle: ServerHandle, servers: ServerService) -> "SessionBackend":
        """A server here: its session service (:meth:`ServerService.sessions`)."""
        return cls(handle, lambda: servers.sessions(handle.id), lambda: handle.sessions)

    @classmethod
    def of(cls, handle: ServerHandle | None, sessions: Sessions) -> "SessionBackend":
        """A Sessions already made (a host's server: app.servers.remote_sessions.RemoteSessions)."""
        async def get() -> Sessions:
            return sessions
        return cls(handle, get, lambda: sessions)

    @staticmethod
    def _conv_of(name: str) -> str:
        return name[len("proxy-"):] if name.startswith("proxy-") else name

    async def _observed(self, kind: str, name: str, op):
        """Await ``op`` (a park or a restore of ``name``) and tell the metrics how it went (the park's size from
        the record it returns)."""
        t0 = time.monotonic()
        try:
            result = await op
        except ResumeRefused:
            raise  # not restored on purpose (a hazard, a restore that buys nothing): no restore to count
        except BaseException:
            if self.metrics is not None:
                getattr(self.metrics, f"observe_{kind}")(self._conv_of(name), 0.0, 0, ok=False)
            raise
        if self.metrics is not None:
            rec = result.record
            size = rec.state_size + rec.sidecar_size if rec is not None else 0
            getattr(self.metrics, f"observe_{kind}")(self._conv_of(name), time.monotonic() - t0, size, ok=True)
        return result

    #: the proxy's disk budget (bytes; None: no limit): a park predicted larger is refused before it runs
    disk_budget_bytes: int | None = None

    async def save(self, slot: int, name: str) -> int:
        result = await self._observed("park", name, (await self._sessions()).park(
            slot, name, budget_bytes=self.disk_budget_bytes))
        return result.record.n_tokens if result.record is not None else 0

    async def restore(self, slot: int, name: str) -> int:
        path = later = None
        request = self.requests.get(name)
        if request is not None:
            later = request.later
            path = request.path
            if not request.proven:
                await self._check_tokens(name, request.path, request.body)
        # the turn the restore is for: a chat client's re-rendered messages, or a prompt sent as text
        probe = "exact" if path in TEXT_PATHS else "chat"
        try:
            # never onto another chat's checkpoints (the fork keeps a slot's across a restore), and never
            # where the resume matrix measured that the restore buys the turn nothing: re-process instead
            # nor a park whose files are not the ones it wrote (another chat's sidecar copied over its own);
            # on a host its own kv-valet makes the same checks
            result = await self._observed("restore", name, (await self._sessions()).resume(
                name, slot, force=True, avoid_hazard=True, avoid_useless=probe, avoid_mismatch=True, leased=True,
                later=later))
        except ResumeMismatch as e:
            raise RestoreAvoided(f"{explain_mod.FOREIGN_FILES}: {'; '.join(e.problems)}") from None
        except ResumeUseless as e:
            raise RestoreAvoided(f"{explain_mod.USELESS_RESTORE}: {e.reasons[0]}") from None
        except ResumeHazard as e:
            raise RestoreAvoided(e.hazard) from None
        # did the restore bring context checkpoints back (a sidecar this build loads)? None: not known
        # (a host checked its own) or not needed (a dense model keeps every position)
        self.checkpoints_loaded[slot] = result.prediction.loads if result.prediction is not None else None
        self.hazards[slot] = result.hazard
        return result.n_restored

    async def _check_tokens(self, name: str, path: str, body: dict) -> None:
        """The final check before a restore: the park's own tokens (its state file) against the request's
        prompt as the server tokenises it. A park that shares next to nothing with the request is not this
        conversation's (an identity the messages got wrong): not restored (RestoreAvoided). When the check
        cannot be made (no endpoint, a park whose file is on a host, an unreadable file) the restore goes on
        as decided."""
        svc = self._sessions_now()
        if svc is None or self.handle is None:
            return
        client = self.handle.client
        chat = path in CHAT_PATHS or path in identity.ROUTED_PATHS  # (the chat request they amount to)
        if not chat and not isinstance(body.get("prompt"), str):
            return

        async def prompt() -> str:
            if chat:
                return await client.apply_template(
                    {k: v for k, v in body.items() if k in ("messages", "tools", "chat_template_kwargs")})
            return body["prompt"]
        try:
            # the park's file is read while the server renders the chat
            saved, text = await asyncio.gather(svc.parked_tokens(name), prompt())
            if saved is None:
                return
            enough = tolerance(len(saved))
            if len(saved) <= enough:
                return  # too short a park to tell
            shared = await shared_with_prompt(self.handle.client.token_ids, text, saved, enough)
        except (StateFileError, OSError, ServerError, ServerUnreachable, KeyError, TypeError, ValueError) as e:
            log.info("park %s: its tokens were not checked against the request (%s)", name, e)
            return
        if shared <= enough:
            raise RestoreAvoided(f"the park's own tokens are not this request's: they share {shared} of its "
                                 f"{len(saved):,} tokens with the prompt")

    async def erase(self, slot: int) -> None:
        if self.handle is None:
            raise RuntimeError("no server to erase a slot of")
        await self.handle.client.erase_slot(slot)

    def parked_size(self, name: str) -> int:
        svc = self._sessions_now()
        return svc.park_bytes(name) if svc is not None else 0

    def delete_park(self, name: str) -> None:
        svc = self._sessions_now()
        if svc is not None:
            svc.discard(name)


async def tokens_left(servers: ServerService, target_id: str, slot: int, *, streamed: bool = True) -> int | None:
    """What the slot holds after a request cut short. The server stops the task only when it notices
    the closed connection: while /slots still shows it processing, its count grows, so it is read
    again (``CUT_SHORT_READS`` times at most; a non-streamed request's ``CUT_SHORT_QUIET_READS``, a
    quiet second apart, so that the server gets to look at the connection) before it is taken."""
    row = None
    reads, every = (CUT_SHORT_READS, CUT_SHORT_READ_EVERY_S) if streamed else \
        (CUT_SHORT_QUIET_READS, CUT_SHORT_QUIET_EVERY_S)
    for attempt in range(reads):
        if attempt or not streamed:
            await asyncio.sleep(every)
        try:
            svc = await servers.sessions(target_id)
            rows = await svc.slot_rows()
        except Exception as e:  # report: the slot's content is unknown: the lease frees it (one line: a
            # server killed mid-request is an expected way to get here, not a bug worth a traceback)
            log.warning("cannot read /slots after a cut-short request on slot %s: %s", slot,
                        str(e) or type(e).__name__)
            return None
        row = next((r for r in rows if r.id == slot), None)
        if row is None or not row.busy:
            break
    return row.tokens_held if row is not None else None


async def shared_with_prompt(token_ids: Callable[[str], Awaitable[list[int]]], text: str, saved: list[int],
                             enough: int) -> int:
    """The tokens the prompt ``text`` shares from its start with ``saved`` (:func:`shared_prefix`), as far
    as it takes to tell whether that is more than ``enough``: from the tokens of a prefix of ``text`` when
    they tell (more than ``enough`` shared, or the two part within the prefix's trusted tokens, all but its
    last ``PREFIX_UNTRUSTED_TOKENS``), else from longer prefixes, the whole text last. A whole prompt's
    tokenisation grows with it (28,000 tokens: 52 ms at llama-server, ids only); a prefix's does not.
    ``token_ids``: the server's tokenizer (:meth:`app.server.client.LlamaClient.token_ids`)."""
    chars = (enough + 1 + PREFIX_UNTRUSTED_TOKENS) * PREFIX_CHARS_PER_TOKEN
    while chars < len(text):
        ids = await token_ids(text[:chars])
        trusted = ids[:max(0, len(ids) - PREFIX_UNTRUSTED_TOKENS)]
        shared = shared_prefix(saved, trusted)
        # told apart: more than enough shared, or they part within the trusted tokens (one token short of
        # them: a BOS on one side only shifts the comparison by one)
        if shared > enough or shared + 1 < min(len(trusted), len(saved)):
            return shared
        chars *= 4
    return shared_prefix(saved, await token_ids(text))


def shared_prefix(a: list[int], b: list[int]) -> int:
    """Tokens ``a`` and ``b`` share from the start; one leading token may be the other's BOS alone."""
    return max(common_prefix(a, b), common_prefix(a[1:], b), common_prefix(a, b[1:]))
