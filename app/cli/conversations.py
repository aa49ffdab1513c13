"""``kv-valet conversations list|show|forget``: what the proxy (``serve --proxy``) knows of the
conversations that went through it, each request's verdict and, when it re-processed, why."""

from __future__ import annotations

import json
import time

from app.cli.errors import CliError, Exit
from app.core.units import fmt_duration


def add_commands(sub) -> None:
    cv = sub.add_parser("conversations", help="the conversations the proxy (serve --proxy) brought back, and "
                                              "each request's cache reuse")
    cs = cv.add_subparsers(dest="conversations_command", required=True)
    ls = cs.add_parser("list", help="the conversations, most recent first, with their last verdict")
    ls.add_argument("profile", nargs="?", help="only this profile's")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(run=cmd_list)
    sh = cs.add_parser("show", help="one conversation: its slot, its park, its requests and why they re-processed")
    sh.add_argument("id")
    sh.add_argument("--json", action="store_true")
    sh.add_argument("--last", type=int, default=20, metavar="N", help="the last N requests (default 20)")
    sh.set_defaults(run=cmd_show)
    fg = cs.add_parser("forget", help="forget a conversation and delete its park")
    fg.add_argument("id")
    fg.set_defaults(run=cmd_forget)


def _store():
    from app.store.conversations import ConversationStore

    return ConversationStore()  # read only here: the proxy (serve --proxy) writes it


def _ago(ts: float) -> str:
    return f"{fmt_duration(max(0.0, time.time() - ts))} ago" if ts else "-"


def conversation_dict(conv) -> dict:
    return {"id": conv.id, "slot": conv.slot, "tokens": conv.n_tokens, "parked_as": conv.parked_as,
            "last_used": conv.last_used, "last_verdict": conv.last_verdict.value if conv.last_verdict else None,
            "requests": conv.requests, "time_saved_s": round(conv.time_saved_s, 3), "hint": conv.hint}


def request_dict(rec) -> dict:
    why = rec.explanation
    return {"at": rec.at, "slot": rec.slot, "path": rec.path, "stream": rec.stream, "cache_n": rec.cache_n,
            "prompt_n": rec.prompt_n, "prompt_ms": rec.prompt_ms, "expected_reuse": rec.expected_reuse,
            "verdict": rec.verdict.value, "cause": why.cause.name if why else None,
            "client_words": why.cause.client_words if why else None, "why": why.detail if why else None,
            "first_divergent_token": why.first_divergent_token if why else None,
            "held_token": why.held_token if why else None, "sent_token": why.sent_token if why else None, "restored_from": rec.restored_from, "wasted_ms": rec.wasted_ms}


def cmd_list(args) -> int:
    store = _store()
    try:
        convs = store.list(args.profile)
        profiles = [args.profile] if args.profile else sorted({store.profile_of(c.id) or "" for c in convs} - {""})
    finally:
        store.close()
    if args.json:
        print(json.dumps([conversation_dict(c) for c in convs], indent=2))
        return Exit.OK
    if not convs:
        print("no conversation has gone through the proxy yet (kv-valet serve PROFILE --proxy)")
        return Exit.OK
    for profile in profiles:
        _print_caching(profile)
    for c in convs:
        where = f"slot {c.slot}" if c.slot is not None else (f"parked as '{c.parked_as}'" if c.parked_as else "gone")
        print(f"{c.id}  {c.last_verdict.value if c.last_verdict else '-':<8} {c.n_tokens:>8,} tokens  {where:<28} "
              f"{c.requests:>4} requests  saved {fmt_duration(c.time_saved_s)}  {_ago(c.last_used)}"
              + (f"  (client id {c.hint})" if c.hint else ""))
    return Exit.OK


def _print_caching(profile: str) -> None:
    """A header line when the profile's server caches prompts by itself in a way the proxy minds
    (it steps aside for a disk prompt cache; idle-slot clearing; sleep)."""
    from app.proxy.watch import caching_notice, profile_caching
    from app.settings import load_or_defaults

    caching = profile_caching(profile)
    notice = caching_notice(caching, load_or_defaults()[0].proxy_save_before_idle_clear) if caching else None
    if notice:
        print(f"{profile}: {notice}")


def cmd_show(args) -> int:
    store = _store()
    try:
        conv = store.get(args.id)
        if conv is None:
            raise CliError(f"no conversation '{args.id}' (kv-valet conversations list)")
        recs = store.requests(conv.id, limit=args.last)
    finally:
        store.close()
    if args.json:
        print(json.dumps(conversation_dict(conv) | {"requests_shown": [request_dict(r) for r in recs]}, indent=2))
        return Exit.OK
    print(f"conversation {conv.id}: {conv.n_tokens:,} tokens, "
          + (f"in slot {conv.slot}" if conv.slot is not None else "in no slot")
          + (f", parked as '{conv.parked_as}'" if conv.parked_as else "")
          + f"; {conv.requests} requests, time saved {fmt_duration(conv.time_saved_s)}")
    for r in recs:
        figures = f"cache_n {r.cache_n:,}, prompt_n {r.prompt_n:,}" if r.cache_n is not None and r.prompt_n is not None \
            else "no timings"
        line = f"  {time.strftime('%H:%M:%S', time.localtime(r.at))} slot {r.slot} {r.verdict.value:<7} {figures}"
        if r.restored_from:
            line += f" (restored from '{r.restored_from}' first)"
        print(line)
        if r.explanation is not None:
            print(f"      why: {r.explanation.cause.value} [{r.explanation.cause.client_words}]: "
                  f"{r.explanation.detail}"
                  + (f" (cost {fmt_duration(r.wasted_ms / 1000.0)})" if r.wasted_ms else ""))
            if r.explanation.first_divergent_token is not None:
                print(f"      first divergent token: {r.explanation.first_divergent_token:,} (the slot held "
                      f"{r.explanation.held_token or ''!r}, the request had {r.explanation.sent_token or ''!r})")
    return Exit.OK


def cmd_forget(args) -> int:
    from app.proxy.front import forget_stored

    conv, removed = forget_stored(args.id)
    if conv is None:
        raise CliError(f"no conversation '{args.id}' (kv-valet conversations list)")
    print(f"forgot conversation {conv.id}" + (f" and deleted its park ({len(removed)} files)" if removed else ""))
    return Exit.OK
