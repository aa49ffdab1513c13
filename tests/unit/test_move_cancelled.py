"""What the window says when the user cancels a move (app.servers.server_list.move_cancelled)."""

from __future__ import annotations

from types import SimpleNamespace

from app.core.states import ServerState
from app.servers.server_list import ServerRow, move_cancelled

HERE = ServerRow("profile:here", "here", ServerState.READY, profile="here")
THERE = ServerRow("gpu-box:big", "big", ServerState.READY, kind="remote", host="gpu-box", profile="big")
LISTED = SimpleNamespace(record=SimpleNamespace(name="chat 2"))  # what on_committed was given


def test_cancelled_before_the_target_listed_it_leaves_the_source_only():
    assert move_cancelled("chat", HERE, copy=False) == (
        False, "Not moved 'chat' to 'here': cancelled. The session is where it was; nothing was added there.")
    assert move_cancelled("chat", THERE, copy=True)[1].startswith("Not copied 'chat' to 'big' on gpu-box: cancelled.")


def test_cancelled_after_the_target_listed_it_says_both_copies_remain():
    ok, text = move_cancelled("chat", THERE, copy=False, committed=LISTED)
    assert not ok and text == ("The move of 'chat' was cancelled after it was copied to 'big' on gpu-box as "
                               "'chat 2' (listed there, SHA-256 checked): both copies remain (delete one from the "
                               "Sessions tab).")
    ok, text = move_cancelled("chat", HERE, copy=True, committed=LISTED)
    assert ok and text.endswith("the copy is complete.") and "both copies" not in text
