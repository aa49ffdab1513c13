"""Why a proxied request re-processed more than it had to, in the order the causes are tried (pure: no I/O).

The verdict itself is the one judge's (:func:`app.core.verdict.judge`, the same words and the same
tolerance as a resume's). :func:`explain` says why a request judged PARTIAL, MISS or DISCARDED
re-processed, trying the causes in this order (the first that fits is said):

1. its park was restored without checkpoints into a slot that kept another chat's, and the server
   reused tokens all the same (said even of a HIT: the answer may be wrong);
2. the proxy did not restore its park on purpose (not its tokens, or another chat's checkpoints):
   what the messages say changed, when they say it, with that;
3. what the proxy saw happen to the slot (:class:`SlotContext`): a failed restore, a restart,
   sleep, another conversation (with the server's RAM cache that missed, when it was counted on),
   the idle-slot cache (idem), a restore without checkpoints;
4. what changed in the messages (:func:`explain_messages`);
5. else the server re-processed unchanged messages by itself (the chat template), or, with no
   record of the previous messages, not known.

DIFFERS ("output differs from a cold prefill": warm but wrong) is a check's word, not a proxied
request's: only the output check of ``kv-valet check`` compares an answer with a cold prefill
(:mod:`app.core.output_check`), and the proxy never runs it, so :func:`explain` has no cause for it
(it says nothing of a verdict outside PARTIAL/MISS/DISCARDED). Cause 1 is the proxy's own warning
that a warm answer may be wrong.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from app.core.conversation import Cause, Explanation, Message
from app.core.park_files import NOT_PARKED_FILES
from app.core.verdict import WASTEFUL, VerdictKind, tolerance


# -- the messages --------------------------------------------------------------


def _key(m: Message) -> tuple[str, str, str]:
    """What the chain hashes of a message (reasoning left out)."""
    return (m.role, m.name, m.content)


def _first_char(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _stripped_reasoning(p: Message, c: Message) -> bool:
    return p.role == "assistant" and bool(p.reasoning) and not c.reasoning


def _truncation(previous: list[Message], current: list[Message], i: int) -> int:
    """k >= 1 when ``current`` is ``previous`` with k messages dropped at ``i`` (messages
    before i equal), all of them non-system but a leading system prompt (not that alone), and
    at least one message after them kept; 0 when not."""
    for k in range(1, len(previous) - i):
        dropped = previous[i:i + k]
        if any(m.role == "system" and not (i == 0 and j == 0) for j, m in enumerate(dropped)):
            break  # a client that drops a system prompt mid-way is not truncating old turns
        if all(m.role == "system" for m in dropped):
            continue  # the system prompt alone dropped: it changed (SYSTEM_PROMPT_CHANGED)
        n = min(len(current) - i, len(previous) - i - k)
        if all(_key(current[i + j]) == _key(previous[i + k + j]) for j in range(n)):
            return k
    return 0


def _role(role: str) -> str:
    return role if role.isprintable() and role.strip() == role and role else repr(role)


def _where(i: int, p: Message, c: Message) -> str:
    """Where message i first differs, in words."""
    if p.role != c.role:
        return f"message {i} was {_role(p.role)}, now {_role(c.role)}"
    if p.name != c.name:
        return f"message {i} ({_role(c.role)}) names {c.name or 'nothing'!r} where the slot held {p.name or 'nothing'!r}"
    at = _first_char(p.content, c.content)
    return f"message {i} ({_role(c.role)}) differs from what the slot held at character {at}"


def explain_messages(previous: list[Message], current: list[Message]) -> Explanation | None:
    """Why ``current`` could not reuse what the slot held after ``previous`` (previous and its
    reply). None when one extends the other, compared as the chain compares them (role, name,
    content; reasoning left out) and no reply lost its reasoning: then re-processing was not
    the messages' doing.

    Else the first message that differs (in order) is classified:

    * CLIENT_TRUNCATION: from there ``current`` is ``previous`` with k >= 1 old non-system
      messages dropped (the system prompt kept, or dropped with them);
    * SYSTEM_PROMPT_CHANGED: it is a system message (added, removed or edited), or the
      first message;
    * REASONING_STRIPPED: an assistant message equal but for its reasoning, which the slot
      held and the client did not send back. The chain is the same, but the server renders
      what the client sends, so the prompt is not (a template that keeps past reasoning);
    * TOOL_RESULT_CHANGED: a tool message;
    * EARLIER_MESSAGE_EDITED: anything else.
    """
    for i in range(min(len(previous), len(current))):
        p, c = previous[i], current[i]
        if _key(p) == _key(c):
            if _stripped_reasoning(p, c):
                return Explanation(
                    Cause.REASONING_STRIPPED,
                    f"Message {i} (assistant) came back without its reasoning ({len(p.reasoning):,} "
                    f"characters), so the prompt differs from what the slot held from there.",
                    first_divergent_message=i)
            continue
        k = _truncation(previous, current, i)
        if k:
            return Explanation(
                Cause.CLIENT_TRUNCATION,
                f"The client dropped {k} old message{'s' if k != 1 else ''} at message {i}: "
                f"message {i} ({_role(c.role)}) is what the slot held as message {i + k}, so everything "
                f"after message {i - 1 if i else 0} was processed again." if i else
                f"The client dropped the first {k} message{'s' if k != 1 else ''}: message 0 "
                f"({_role(c.role)}) is what the slot held as message {k}, so the whole prompt was processed again.",
                first_divergent_message=i)
        where = _where(i, p, c)
        if "system" in (p.role, c.role) or i == 0:
            cause = Cause.SYSTEM_PROMPT_CHANGED
            text = f"The system prompt changed: {where}."
        elif "tool" in (p.role, c.role):
            cause = Cause.TOOL_RESULT_CHANGED
            text = f"A tool result changed: {where}."
        else:
            cause = Cause.EARLIER_MESSAGE_EDITED
            text = f"An earlier message was edited: {where}."
        return Explanation(cause, text, first_divergent_message=i)
    return None


#: prompts longer than this (characters) are not tokenized to find the first divergent token: the
#: explanation then stays by message and character (two /tokenize calls of a long prompt cost the server)
TOKEN_DIFF_MAX_CHARS = 256_000
#: tokens shown before the first divergent one, and after it on each side, for context
TOKEN_CONTEXT = 3


def wants_tokens(verdict: VerdictKind) -> bool:
    """Whether a request is worth a token-level look: only one that re-processed more than it had to."""
    return verdict in WASTEFUL


def _show(piece: str) -> str:
    return repr(piece) if piece else "nothing (the prompt ended there)"


def with_divergent_token(ex: Explanation, held: list[tuple[int, str]], sent: list[tuple[int, str]]) -> Explanation:
    """``ex`` with the first token where this request's prompt (``sent``: (id, text) pairs, as the
    server tokenises it) leaves the slot's previous prompt (``held``): its index, the two token
    texts there and a sentence added to the detail. The index is the number of tokens the two
    prompts share: what the server could have reused of the previous prompt."""
    i = first_divergent_token([t for t, _ in held], [t for t, _ in sent])
    held_piece = held[i][1] if i < len(held) else ""
    sent_piece = sent[i][1] if i < len(sent) else ""
    before = "".join(p for _, p in sent[max(0, i - TOKEN_CONTEXT):i])
    if i >= len(held):
        text = (f"By tokens, the slot's previous prompt ({len(held):,} tokens) is unchanged at the start of this one: "
                f"what differed came after it (the reply as sent back, or the server's own doing).")
    else:
        held_next = "".join(p for _, p in held[i + 1:i + 1 + TOKEN_CONTEXT])
        sent_next = "".join(p for _, p in sent[i + 1:i + 1 + TOKEN_CONTEXT])
        text = (f"By tokens, the prompt first differs from the slot's previous prompt at token {i:,} of {len(sent):,}"
                + (f", after {before!r}" if before else "")
                + f": the slot held {_show(held_piece)}" + (f" (then {held_next!r})" if held_next else "")
                + f", this request has {_show(sent_piece)}" + (f" (then {sent_next!r})" if sent_next else "") + ".")
    detail = f"{ex.detail} {text}" if ex.detail else text
    return dataclasses.replace(ex, detail=detail, first_divergent_token=i, held_token=held_piece,
                               sent_token=sent_piece)


def first_divergent_token(a: list[int], b: list[int]) -> int:
    """Index of the first token where ``a`` and ``b`` differ (the shorter's length when one is
    a prefix of the other)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


# -- the slot ------------------------------------------------------------------


#: who took a slot when a request the proxy passed through untouched (its client pinned the slot or
#: turned prompt caching off) used it: the leases record it as the slot's taker
OUTSIDE = "a request that chose its own slot or caching"


@dataclass(frozen=True)
class SlotContext:
    """What the proxy knows happened to the slot between this conversation's last request and
    this one."""

    taken_by: str | None = None  # another conversation's id (or OUTSIDE), when it used the slot meanwhile
    idle_cleared: bool = False  # the server's idle-slot cache saved and cleared it
    restarted: bool = False  # the server restarted
    slept: bool = False  # the server slept (its context destroyed)
    restored_from: str | None = None  # the parked session a restore brought back first
    restore_had_checkpoints: bool | None = None  # whether that restore brought checkpoints (None: not known)
    restore_failed: bool = False  # the restore failed, which empties the slot
    ram_tokens: int = 0  # the server's RAM cache likely held this many of its tokens (the proxy counted on it)
    parked_as: str | None = None  # its park, when the proxy did not restore it ...
    avoided: str | None = None  # ... why not (its tokens are not the request's, or another chat's checkpoints)
    hazard: str | None = None  # restored into a slot that kept another chat's checkpoints (the fork keeps them)


def _server_side(ctx: SlotContext) -> Explanation | None:
    if ctx.restore_failed:
        what = f" of {ctx.restored_from!r}" if ctx.restored_from else ""
        return Explanation(Cause.RESTORE_FAILED,
                           f"The restore{what} failed, which empties the slot, so the whole prompt was processed again.")
    if ctx.restarted:
        return Explanation(Cause.SERVER_RESTARTED,
                           "The server restarted since this conversation's last request, so its slot held nothing of it.")
    if ctx.slept:
        return Explanation(Cause.SERVER_SLEPT,
                           "The server slept since this conversation's last request and destroyed its context, "
                           "so the slot held nothing of it.")
    if ctx.taken_by == OUTSIDE:
        return Explanation(Cause.SLOT_TAKEN, "A request its client pinned to this slot (or sent with prompt caching "
                                             "off), which the proxy passed through untouched, used the slot since "
                                             "this conversation's last request, so the slot no longer held its tokens.")
    if ctx.taken_by:
        return Explanation(Cause.SLOT_TAKEN,
                           f"Conversation {ctx.taken_by} used the slot since this conversation's last request, "
                           f"so the slot no longer held its tokens.")
    if ctx.idle_cleared:
        return Explanation(Cause.IDLE_SLOT_CLEARED,
                           "The server saved and cleared the idle slot (idle-slot caching) since this "
                           "conversation's last request, so the slot no longer held its tokens.")
    if ctx.restored_from and ctx.restore_had_checkpoints is False:
        return Explanation(Cause.RESTORE_WITHOUT_CHECKPOINTS,
                           f"The restore of {ctx.restored_from!r} brought no context checkpoints back (no usable "
                           f"sidecar), so this model could not roll back to reuse the restored tokens.")
    return None


def ram_cache_missed(ex: Explanation, ram_tokens: int) -> Explanation:
    """``ex`` for a request the proxy left to the server's RAM cache (a copy of ``ram_tokens`` tokens,
    longer than the park) that the server did not find there."""
    text = (f"The proxy left the conversation to the server's RAM prompt cache, which likely held {ram_tokens:,} "
            f"of its tokens (more than its park), but the server did not load them: the cache was too small for "
            f"them (--cache-ram) or had dropped them.")
    return dataclasses.replace(ex, detail=f"{ex.detail} {text}" if ex.detail else text)


def explain(verdict: VerdictKind, previous: list[Message] | None, current: list[Message],
            ctx: SlotContext, *, cache_n: int | None = None, reusable: int = 0) -> Explanation | None:
    """Why a request re-processed more than it had to (None when it did not, or nothing is said),
    the causes tried in the module's order. ``cache_n``: what the server reused; ``reusable``: what
    the slot held that it could have reused."""
    if ctx.hazard and ctx.restore_had_checkpoints is False and (cache_n or 0) > tolerance(reusable):
        return _foreign_checkpoint(ctx.restored_from, cache_n or 0, ctx.hazard)
    if verdict not in WASTEFUL:
        return None
    why = _slot_or_messages(previous, current, ctx)
    if ctx.avoided:
        # what the messages say changed comes first: had the slot been kept, it would have cost the same
        found = explain_messages(previous, current) if previous is not None else None
        # (only they: a slot another chat took is not why a park that is not this chat's went unrestored)
        return _restore_avoided(ctx.parked_as, ctx.avoided, found)
    return why


def _slot_or_messages(previous: list[Message] | None, current: list[Message], ctx: SlotContext) -> Explanation:
    """The slot's story first (:class:`SlotContext`, in the order restore failed, restarted, slept,
    taken, idle cleared, restored without checkpoints), then the messages (:func:`explain_messages`),
    else the server re-processed unchanged messages by itself: TEMPLATE_CHANGED when the previous
    messages are known, UNKNOWN when they are not."""
    found = _server_side(ctx)
    if found is not None:
        if ctx.ram_tokens and found.cause in (Cause.IDLE_SLOT_CLEARED, Cause.SLOT_TAKEN):
            found = ram_cache_missed(found, ctx.ram_tokens)
        return found
    if previous is None:
        return Explanation(Cause.UNKNOWN,
                           "The proxy has no record of this conversation's previous messages, so it cannot "
                           "say why the server re-processed them.")
    found = explain_messages(previous, current)
    if found is not None:
        return found
    return Explanation(Cause.TEMPLATE_CHANGED,
                       "The messages the slot held were sent unchanged, so the server re-processed them by itself "
                       "(the chat template renders them differently, e.g. it drops past reasoning, or an SWA "
                       "model rolled back past its last context checkpoint).")


def tools_changed(ex: Explanation, before: object, now: object) -> Explanation:
    """A re-process the messages do not explain, of a request whose tool definitions differ from the
    conversation's previous request's: the template renders the tools into the prompt ahead of the
    messages, so the prompt changed there."""
    def names(tools) -> list[str]:
        return [str((t.get("function") or t).get("name", "?")) for t in tools or () if isinstance(t, dict)]

    text = (f"The tool definitions changed ({', '.join(names(before)) or 'none'} before, "
            f"{', '.join(names(now)) or 'none'} now): the chat template renders them into the prompt ahead of "
            f"the messages, so everything after them was processed again.")
    return Explanation(Cause.TOOLS_CHANGED, text)


#: how a park the proxy did not restore, because the resume matrix says the restore buys nothing, is said
USELESS_RESTORE = "a restore buys nothing on this server"
#: how a park the proxy did not restore, because a file of it is not the one parked (app.core.park_files), is said
FOREIGN_FILES = NOT_PARKED_FILES


def _restore_avoided(park: str | None, why: str, found: Explanation | None) -> Explanation:
    """A park not restored on purpose: its tokens are not the request's (``found``: what the messages
    say changed, kept as the cause when they say it), the resume matrix says a restore buys this server
    nothing, or it would have rolled back onto another chat's checkpoints."""
    if why.startswith(USELESS_RESTORE):
        measured = why[len(USELESS_RESTORE) + 2:]
        text = (f"The proxy did not restore {park!r}: {measured[0].upper() + measured[1:]}. Restoring would only "
                f"have added the restore's time, so the prompt was processed anew; the park stays.")
        if found is not None and found.cause is not Cause.UNKNOWN:
            return dataclasses.replace(found, detail=f"{found.detail} {text}" if found.detail else text)
        return Explanation(Cause.RESTORE_WITHOUT_CHECKPOINTS, text)
    if why.startswith(FOREIGN_FILES):
        text = (f"The proxy did not restore {park!r}: {why[len(FOREIGN_FILES) + 2:]}. Restoring it could answer from "
                f"another chat's state, so the prompt was processed anew and the park stays as it is on disk "
                f"(kv-valet sessions show names the file).")
        return Explanation(Cause.PARK_NOT_ITS_OWN, text)
    if why.startswith("the park's own tokens"):
        text = (f"The proxy did not restore {park!r}: {why}. The prompt was processed anew, and the park is "
                f"replaced at the next save.")
        if found is not None and found.cause is not Cause.UNKNOWN:
            return dataclasses.replace(found, detail=f"{found.detail} {text}" if found.detail else text)
        return Explanation(Cause.PARK_NOT_ITS_OWN, text)
    return Explanation(Cause.RESTORE_WITHOUT_CHECKPOINTS,
                       f"The park {park!r} has no context checkpoints this build loads, and {why.split(':')[0]}: "
                       f"restoring it there could answer from the wrong conversation, so the proxy did not restore "
                       f"it and the prompt was processed anew. A restart of the server, or a park with a sidecar, "
                       f"makes it safe again.")


def _foreign_checkpoint(restored_from: str | None, cache_n: int, hazard: str) -> Explanation:
    """A restore that brought no checkpoints of its own, followed by a reuse all the same: the build
    kept the slot's earlier checkpoints (the turboquant fork) and the server rolled back onto another
    chat's, whose sliding-window state now stands in for this conversation's."""
    return Explanation(Cause.RESTORE_WITHOUT_CHECKPOINTS,
                       f"The restore of {restored_from!r} brought no context checkpoints of its own (no usable "
                       f"sidecar), yet the server reused {cache_n:,} tokens: it rolled back onto a checkpoint the "
                       f"slot kept from another chat ({hazard.split(':')[0]}), so their sliding-window state is "
                       f"that chat's and the answer may be wrong. Restart the server or give the park a sidecar.")
