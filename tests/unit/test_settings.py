"""The preferences file: what is written, what is refused, what survives; and `kv-valet settings`."""

from __future__ import annotations

import tomllib

import pytest

from app import paths, settings
from app.cli import main
from app.core.profile import LaunchProfile
from app.server.launcher import LaunchPlan, make_supervisor
from app.settings import AutoResume, Settings


def test_defaults_without_a_file_and_only_changes_are_written(tmp_path):
    path = tmp_path / "settings.toml"
    assert settings.load(path) == Settings()
    settings.save(Settings(monitor_interval_s=0.5, auto_resume=AutoResume.ALWAYS), path)
    assert tomllib.loads(path.read_text()) == {"monitor_interval_s": 0.5, "auto_resume": "always"}
    assert settings.load(path) == Settings(monitor_interval_s=0.5, auto_resume=AutoResume.ALWAYS)


def test_a_newer_versions_keys_survive_a_save(tmp_path):
    path = tmp_path / "settings.toml"
    path.write_text('theme = "solarized"\nlog_backups = 5\n')
    assert settings.load(path).log_backups == 5
    settings.update(path, log_backups=2)
    assert tomllib.loads(path.read_text()) == {"log_backups": 2, "theme": "solarized"}


@pytest.mark.parametrize("text, key", [
    ("monitor_interval_s = 'fast'", "monitor_interval_s"),
    ("monitor_interval_s = 100", "monitor_interval_s"),
    ("auto_resume = 'sometimes'", "auto_resume"),
    ("log_backups = -1", "log_backups"),
    ("keep_in_tray = 'perhaps'", "keep_in_tray"),
    ("data_folder = 'relative'", "data_folder"),
    ("this is not toml", "file"),
])
def test_a_bad_file_is_refused_with_the_key_and_the_window_falls_back_to_defaults(tmp_path, text, key):
    path = tmp_path / "settings.toml"
    path.write_text(text + "\n")
    with pytest.raises(settings.SettingsError) as e:
        settings.load(path)
    assert [k for k, _m in e.value.errors] == [key]
    prefs, problem = settings.load_or_defaults(path)
    assert prefs == Settings() and key in problem


def test_auto_resume_rule():
    assert settings.auto_resumes(AutoResume.ALWAYS, False)
    assert settings.auto_resumes(AutoResume.OFFER, True)  # the profile's own choice still counts
    assert not settings.auto_resumes(AutoResume.OFFER, False)


def test_the_data_folder_is_read_once_per_start(tmp_path, monkeypatch):
    monkeypatch.delenv("KV_VALET_DATA_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert paths.data_dir() == tmp_path / "xdg" / "kv-valet"
    settings.update(data_folder=str(tmp_path / "elsewhere"))
    assert paths.data_dir() == tmp_path / "xdg" / "kv-valet"  # not under a running app
    assert "applies from the next start" in settings.data_folder_status(settings.load())


def test_log_limits_reach_the_servers_log_file(tmp_path):
    settings.update(log_file_mib=2, log_backups=1)
    profile = LaunchProfile(name="p", model="/m.gguf")
    plan = LaunchPlan(profile, "/bin/true", "test", None, "", "", ["/bin/true"], None, str(tmp_path), profile.url)
    sup = make_supervisor(plan, log_file=tmp_path / "p.log")
    assert (sup._log_file.max_bytes, sup._log_file.backups) == (2 * 1024 * 1024, 1)


def test_cli_settings_show_set_reset(capsys):
    assert main(["settings"]) == 0
    out = capsys.readouterr().out
    assert "monitor_interval_s = 1.0" in out and "auto_resume = \"offer\"" in out
    assert main(["settings", "set", "monitor_interval_s=0.5", "keep_in_tray=yes"]) == 0
    out = capsys.readouterr().out
    assert "monitor_interval_s = 0.5   (changed)" in out and "keep_in_tray = true   (changed)" in out
    assert main(["settings", "set", "monitor_busy_interval_s=2"]) == 1
    err = capsys.readouterr().err
    assert "settings not saved" in err and "busy rate" in err
    assert tomllib.loads(paths.settings_path().read_text()) == {"monitor_interval_s": 0.5, "keep_in_tray": True}
    assert main(["settings", "set", "colour=red"]) == 2
    assert "unknown setting 'colour'" in capsys.readouterr().err
    assert main(["settings", "set", "monitor_interval_s"]) == 2
    assert main(["settings", "reset", "keep_in_tray"]) == 0
    assert tomllib.loads(paths.settings_path().read_text()) == {"monitor_interval_s": 0.5}
    assert main(["settings", "reset"]) == 0
    assert tomllib.loads(paths.settings_path().read_text()) == {}


def test_a_users_comments_and_a_newer_versions_table_survive_save_and_update(tmp_path):
    path = tmp_path / "settings.toml"
    path.write_text('# my preferences, kept by hand\n'
                    'log_backups = 5  # five, for the long weekends\n'
                    'theme = "solarized"\n'
                    '\n'
                    '# written by a newer KV Valet\n'
                    '[future]\n'
                    'colour = "blue"  # not known here\n'
                    'sizes = [1, 2]\n')
    settings.update(path, log_backups=2, keep_in_tray=True)
    text = path.read_text()
    assert tomllib.loads(text) == {"log_backups": 2, "keep_in_tray": True, "theme": "solarized",
                                   "future": {"colour": "blue", "sizes": [1, 2]}}
    for kept in ("# my preferences, kept by hand", "# five, for the long weekends", "# written by a newer KV Valet",
                 "[future]", '# not known here'):
        assert kept in text
    assert text.index("log_backups") < text.index("theme") < text.index("[future]")  # the user's order
    assert text.index("keep_in_tray") < text.index("[future]")  # a new key is a top-level key, not the table's
    assert settings.load(path) == Settings(log_backups=2, keep_in_tray=True)

    settings.save(Settings(), path)  # every value back to its default: those keys go, the rest stays
    text = path.read_text()
    assert tomllib.loads(text) == {"theme": "solarized", "future": {"colour": "blue", "sizes": [1, 2]}}
    assert "# my preferences, kept by hand" in text and "# not known here" in text


def test_a_default_written_out_by_hand_stays_with_its_comment(tmp_path):
    path = tmp_path / "settings.toml"
    path.write_text("log_backups = 3  # the default, on purpose\nkeep_in_tray = true\n")
    settings.update(path, keep_in_tray=False)
    assert path.read_text() == "log_backups = 3  # the default, on purpose\n"


def test_a_broken_file_is_replaced_by_a_good_one_on_save(tmp_path):
    path = tmp_path / "settings.toml"
    path.write_text("this is [not toml\n")
    settings.save(Settings(log_backups=4), path)
    assert tomllib.loads(path.read_text()) == {"log_backups": 4}
    assert path.read_text().startswith("# KV Valet settings")
