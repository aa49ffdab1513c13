"""Profile files edited by hand (docs/guide/profiles.md invites it) survive a save from the app: the
user's comments and key order stay, the changed values are written, cleared ones removed."""

from __future__ import annotations

import os
import tomllib

from app.core.profile import LaunchProfile
from app.store.profiles import ProfileStore, from_toml, to_toml

HAND_EDITED = """\
# My 7B for long chats. Edited by hand, see the README.
name = "chat"
model = "/models/chat.gguf"

# 32K: the longest chat I keep
ctx_size = 32768  # do not lower, the parked sessions need it
parallel = 2
port = 8080  # the usual one, written out on purpose
extra_args = ["--jinja"]
"""


def test_a_hand_edited_profile_keeps_its_comments_through_a_save_from_the_app(tmp_path):
    store = ProfileStore(tmp_path / "profiles")
    path = tmp_path / "profiles" / "chat.toml"
    path.parent.mkdir()
    path.write_text(HAND_EDITED)
    profile = store.load("chat")
    assert (profile.ctx_size, profile.parallel, profile.port) == (32768, 2, 8080)

    store.save(profile.replace(parallel=4, metrics=True))  # what the profile form does on Save

    text = path.read_text()
    for comment in ("# My 7B for long chats. Edited by hand, see the README.", "# 32K: the longest chat I keep",
                    "# do not lower, the parked sessions need it", "# the usual one, written out on purpose"):
        assert comment in text
    assert "parallel = 4" in text and "parallel = 2" not in text
    assert "metrics = true" in text
    assert text.index("name") < text.index("model") < text.index("ctx_size") < text.index("parallel") \
        < text.index("port") < text.index("extra_args")  # the user's order; the new key comes last
    assert text.index("extra_args") < text.index("metrics")
    assert store.load("chat") == profile.replace(parallel=4, metrics=True)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"


def test_a_cleared_value_is_removed_and_only_the_changed_line_changes(tmp_path):
    store = ProfileStore(tmp_path)
    (tmp_path / "chat.toml").write_text(HAND_EDITED)
    profile = store.load("chat")
    store.save(profile.replace(ctx_size=None))  # "use the server's default" in the form
    after = (tmp_path / "chat.toml").read_text()
    assert "ctx_size" not in after
    assert [line for line in HAND_EDITED.splitlines() if not line.startswith("ctx_size")] == after.splitlines()


def test_a_rename_keeps_the_comments_and_removes_the_old_file(tmp_path):
    store = ProfileStore(tmp_path)
    (tmp_path / "chat.toml").write_text(HAND_EDITED)
    profile = store.load("chat")
    store.save(profile.replace(name="talk"), previous_name="chat")
    assert not (tmp_path / "chat.toml").exists()
    text = (tmp_path / "talk.toml").read_text()
    assert 'name = "talk"' in text and "# 32K: the longest chat I keep" in text
    assert store.load("talk") == profile.replace(name="talk")


def test_a_new_profile_file_reads_like_its_command_line(tmp_path):
    p = LaunchProfile(name="new", model="/m.gguf", ctx_size=8192, kv_unified=False, extra_args=("--jinja",),
                      gpu_layers="all", host="h\x7fost")
    text = to_toml(p)
    assert text.startswith("# KV Valet launch profile.")
    assert tomllib.loads(text) == {"name": "new", "model": "/m.gguf", "host": "h\x7fost", "ctx_size": 8192,
                                   "gpu_layers": "all", "kv_unified": False, "extra_args": ["--jinja"]}
    assert from_toml(text) == p
    path = ProfileStore(tmp_path).save(p)
    assert path.read_text() == text


def test_a_number_written_where_text_is_read_stays_as_the_user_wrote_it(tmp_path):
    (tmp_path / "g.toml").write_text('name = "g"\ngpu_layers = 99  # all of them\n')
    store = ProfileStore(tmp_path)
    profile = store.load("g")
    assert profile.gpu_layers == "99"
    store.save(profile.replace(parallel=2))
    assert (tmp_path / "g.toml").read_text() == 'name = "g"\ngpu_layers = 99  # all of them\nparallel = 2\n'
