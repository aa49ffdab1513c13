"""What a request and its answer say on their own, before the proxy's state is consulted: the routes
it reads (chat, text), a client's own choices that make it pass a request through untouched
(:func:`client_choice`), what an answer says of its prompt (:func:`answer_timings`), and whether a
profile lets clients use the slot actions through it (:func:`slot_actions_on`).
"""

from __future__ import annotations

from app.core.timings import Timings

CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
TEXT_PATHS = ("/v1/completions", "/completions", "/completion")


def answer_timings(final: dict | None) -> Timings | None:
    """What an answer says of its prompt: llama-server's ``timings``, else the route's usage: Anthropic's
    (``cache_read_input_tokens``, and ``input_tokens`` the ones processed) or the Responses API's
    (``input_tokens`` all of them, ``input_tokens_details.cached_tokens`` the ones reused); a stream's
    usage is in its ``message_start`` / ``response.completed`` event. None when it says neither."""
    if not final:
        return None
    t = Timings.from_json(final.get("timings"))
    if t is not None:
        return t
    usage = final.get("usage")
    for outer in ("message", "response"):  # a stream's event wraps the answer
        if not isinstance(usage, dict) and isinstance(final.get(outer), dict):
            usage = final[outer].get("usage")
    if not isinstance(usage, dict):
        return None
    n_in, out_n = usage.get("input_tokens"), usage.get("output_tokens")
    if not isinstance(n_in, int):
        return None
    if isinstance(usage.get("cache_read_input_tokens"), int):
        cache_n, prompt_n = usage["cache_read_input_tokens"], n_in
    elif isinstance(usage.get("input_tokens_details"), dict) and isinstance(
            usage["input_tokens_details"].get("cached_tokens"), int):
        cache_n = usage["input_tokens_details"]["cached_tokens"]
        prompt_n = max(0, n_in - cache_n)
    else:
        return None
    return Timings(cache_n=cache_n, prompt_n=prompt_n, predicted_n=out_n if isinstance(out_n, int) and out_n else None)


def client_choice(path: str, body: dict) -> str | None:
    """Why a completion request must pass through untouched (the client asked for something the
    proxy's pinning would change), or None: its own ``id_slot`` (>= 0), ``cache_prompt: false``, or a
    batch of prompts (``"prompt": [..., ...]``, each answered in a slot of the server's choice)."""
    slot = body.get("id_slot")
    if isinstance(slot, int) and not isinstance(slot, bool) and slot >= 0:
        return f"it asked for slot {slot} itself (\"id_slot\": {slot})"
    if body.get("cache_prompt") is False:
        return "it turned prompt caching off (\"cache_prompt\": false)"
    prompt = body.get("prompt")
    if path in TEXT_PATHS and isinstance(prompt, list) and len(prompt) > 1 \
            and not all(isinstance(t, int) for t in prompt):
        return f"it sent a batch of {len(prompt)} prompts, each answered in a slot of the server's choice"
    return None


def slot_actions_on(profile) -> bool:
    """Whether the user turned llama-server's slot actions on themselves (their profile names a
    ``--slot-save-path``): only then may the proxy's clients save, restore and erase slots through it.
    The folder the proxy needs for its own parks must not give them that."""
    if profile is None:
        return False
    extra = tuple(profile.extra_args or ())
    return bool(profile.slot_save_path) or any(a == "--slot-save-path" or a.startswith("--slot-save-path=")
                                               for a in extra)
