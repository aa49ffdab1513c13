import os

import pytest

from app.core.hazards import hazards
from app.core.helptext import parse_help, unsupported
from app.core.profile import LaunchProfile, ProfileError, exposure_warning
from app.core.profile_check import check, validate
from app.store.profiles import ProfileStore, from_toml, to_toml
from tests.conftest import B11434


@pytest.fixture
def model(tmp_path):
    m = tmp_path / "m.gguf"
    m.write_bytes(b"GGUF" + b"\0" * 16)
    return str(m)


def fields(errors):
    return {e.field for e in errors}


def test_bad_values_name_their_field(model):
    p = LaunchProfile(name="ok", model=model, parallel=-2, cache_type_k="q9_9", port=70000, gpu_layers="lots",
                      cache_ram=-5, flash_attn="maybe", tensor_split="a,b")
    errs = validate(p)
    assert fields(errs) == {"parallel", "cache_type_k", "port", "gpu_layers", "cache_ram", "flash_attn",
                            "tensor_split"}
    msg = str(ProfileError(errs, "ok"))
    assert "profile 'ok'" in msg and "q9_9" in msg and "negative" in msg


def test_missing_model_file_is_named(tmp_path):
    errs = validate(LaunchProfile(name="x", model=str(tmp_path / "nope.gguf")))
    assert [e.field for e in errs] == ["model"] and "nope.gguf" in errs[0].message


def test_non_loopback_without_key_needs_acknowledgement(model):
    p = LaunchProfile(name="x", model=model, host="0.0.0.0")
    assert "host" in fields(validate(p))
    assert "overwrite" in exposure_warning(p)
    assert validate(p.replace(expose_acknowledged=True)) == []
    assert validate(p.replace(api_key="k")) == []
    assert validate(p.replace(host="127.0.0.1")) == []


def test_help_parsing_knows_flags_and_cache_types():
    caps = parse_help((B11434 / "help.txt").read_text())
    assert caps.has("-lv") and caps.has("--slot-save-path") and caps.has("--ctx-checkpoints")
    assert caps.cache_types == ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
    assert caps.takes_value("-c") is True and caps.takes_value("--metrics") is False
    assert caps.takes_value("--no-such-flag") is None


def test_turbo_cache_type_refused_by_stock_binary_naming_the_binary(model):
    caps = parse_help((B11434 / "help.txt").read_text())
    p = LaunchProfile(name="t", model=model, cache_type_k="turbo4", cache_type_v="turbo4")
    errs = unsupported(p, caps, "/usr/bin/llama-server")
    assert fields(errs) == {"cache_type_k", "cache_type_v"}
    assert "/usr/bin/llama-server does not support KV cache type 'turbo4'" in errs[0].message


def test_unknown_flag_refused_by_binary(model):
    caps = parse_help((B11434 / "help.txt").read_text())
    p = LaunchProfile(name="t", model=model, extra_args=("--turbo-magic", "3"))
    errs = unsupported(p, caps, "/x/llama-server")
    assert [(e.field, e.message) for e in errs] == [("extra_args", "/x/llama-server does not accept --turbo-magic")]
    assert unsupported(LaunchProfile(name="t", model=model, extra_args=("--jinja",)), caps, "b") == []


def test_a_long_flag_spelled_with_underscores_is_the_flag_llama_cpp_reads(model):
    """llama.cpp's parser reads a long flag's underscores as dashes (its server tests start the server with
    ``--backend_sampling``): accepted, and known to take a value or not, as its dashed spelling."""
    caps = parse_help((B11434 / "help.txt").read_text())
    p = LaunchProfile(name="t", model=model, extra_args=("--slot_save_path", "/tmp/x", "--no_warmup"))
    assert unsupported(p, caps, "b") == []
    assert caps.takes_value("--ctx_size") is True and caps.takes_value("--no_warmup") is False
    assert not caps.has("-c_x") and unsupported(LaunchProfile(name="t", model=model, extra_args=("--turbo_magic",)),
                                                 caps, "b")[0].message == "b does not accept --turbo_magic"


def test_profile_files_round_trip_and_refuse_bad_content(tmp_path, model):
    store = ProfileStore(tmp_path / "profiles")
    p = LaunchProfile(name="big", model=model, ctx_size=102400, kv_unified=False, extra_args=("--jinja",),
                      api_key="s3cret")
    path = store.save(p)
    assert store.load("big") == p
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"  # it holds a key
    assert "ctx_size = 102400" in path.read_text()
    with pytest.raises(ProfileError, match="a profile named 'big' exists"):
        store.save(p.replace(name="big"), previous_name="other")
    (tmp_path / "profiles" / "broken.toml").write_text("name = 'broken'\nparallel = 'two'\nfoo = 1\n")
    with pytest.raises(ProfileError) as e:
        store.load("broken")
    assert fields(e.value.errors) == {"foo"}
    with pytest.raises(ProfileError, match="not valid TOML"):
        from_toml("name = ", "x.toml")
    with pytest.raises(ProfileError) as e:
        from_toml("name = 'x'\nparallel = 'two'\n")
    assert fields(e.value.errors) == {"parallel"}
    with pytest.raises(ProfileError, match="no profile named 'ghost'"):
        store.load("ghost")
    assert from_toml(to_toml(p)) == p


def test_unreadable_profile_file(tmp_path):
    store = ProfileStore(tmp_path)
    (tmp_path / "locked.toml").mkdir()  # a folder where a file should be: unreadable
    with pytest.raises(ProfileError, match="cannot read"):
        store.load("locked")


def test_check_raises_with_all_errors(model):
    with pytest.raises(ProfileError) as e:
        check(LaunchProfile(name="", model=model, parallel=0))
    assert fields(e.value.errors) == {"name", "parallel"}


def test_seed_hazards_are_reported():
    rpc = LaunchProfile(name="r", model="m", rpc="10.0.0.2:50052", parallel=32)
    assert "rpc-prompt-cache" in {h.key for h in hazards(rpc)}
    assert "rpc-prompt-cache" not in {h.key for h in hazards(rpc.replace(cache_ram=0))}
    kvu = LaunchProfile(name="k", model="m", kv_unified=True, parallel=8)
    assert "kvu-idle-slots" in {h.key for h in hazards(kvu)}
    assert "kvu-idle-slots" not in {h.key for h in hazards(kvu.replace(cache_idle_slots=False))}


def test_api_key_file_must_be_private(tmp_path, model):
    kf = tmp_path / "key"
    kf.write_text("k\n")
    os.chmod(kf, 0o644)
    errs = validate(LaunchProfile(name="x", model=model, api_key_file=str(kf)))
    assert [e.field for e in errs] == ["api_key_file"] and "chmod 600" in errs[0].message
    os.chmod(kf, 0o600)
    assert validate(LaunchProfile(name="x", model=model, api_key_file=str(kf))) == []


def test_a_router_has_no_model_and_a_profile_needs_one_or_the_other(tmp_path, model):
    """Router mode and a model file are exclusive; with neither the check says both ways out; a router
    profile's file keeps the field."""
    assert validate(LaunchProfile(name="r", router=True)) == []
    assert fields(validate(LaunchProfile(name="r", router=True, model=model))) == {"model"}
    neither = validate(LaunchProfile(name="r"))
    assert fields(neither) == {"model"} and "router mode" in neither[0].message
    p = LaunchProfile(name="r", router=True, extra_args=("--models-dir", "/srv/models"))
    assert "router = true" in to_toml(p) and from_toml(to_toml(p)) == p
