import pytest

from app.core.argv import CommandLineError, masked_argv, parse_argv, parse_command_line, preview, server_env, to_argv
from app.core.helptext import parse_help
from app.core.profile import LaunchProfile
from tests.conftest import B11434

SEED_CMD = (
    "/opt/llama.cpp/build/bin/llama-server -m '/models/My Models/Qwopus3.6-27B-Q6_K.gguf' -ngl 99 -sm layer "
    "-ts 1,1 -c 102400 -np 1 -ctk turbo4 -ctv turbo4 --cache-ram 0 --slot-save-path /data/slots/ -fa on "
    "--jinja --temp 0.6 --lora a.gguf --lora b.gguf --port 8081"
)


def test_import_seed_command_line_maps_known_flags_and_keeps_the_rest():
    p = parse_command_line(SEED_CMD, "seed")
    assert p.server_binary == "/opt/llama.cpp/build/bin/llama-server"
    assert p.model == "/models/My Models/Qwopus3.6-27B-Q6_K.gguf"
    assert (p.gpu_layers, p.split_mode, p.tensor_split) == ("99", "layer", "1,1")
    assert (p.ctx_size, p.parallel, p.cache_ram, p.port) == (102400, 1, 0, 8081)
    assert (p.cache_type_k, p.cache_type_v, p.flash_attn) == ("turbo4", "turbo4", "on")
    # Unknown flags stay, in order, repeated ones included.
    assert p.extra_args == ("--jinja", "--temp", "0.6", "--lora", "a.gguf", "--lora", "b.gguf")


def test_round_trip_is_lossless_with_spaces_repeats_and_unknown_flags():
    p = parse_command_line(SEED_CMD, "seed")
    again = parse_argv(to_argv(p, p.server_binary, include_secrets=True), "seed")
    assert again == p
    # and the argv of the re-parsed profile is identical
    assert to_argv(again, again.server_binary) == to_argv(p, p.server_binary)


@pytest.mark.parametrize("short,long_", [
    (["-c", "4096"], ["--ctx-size", "4096"]),
    (["-np", "3"], ["--parallel", "3"]),
    (["-ngl", "all"], ["--n-gpu-layers", "all"]),
    (["-ctk", "q8_0"], ["--cache-type-k", "q8_0"]),
    (["-cram", "-1"], ["--cache-ram", "-1"]),
    (["-ctxcp", "8"], ["--swa-checkpoints", "8"]),
    (["-kvu"], ["--kv-unified"]),
    (["-no-kvu"], ["--no-kv-unified"]),
    (["-lv", "4"], ["--log-verbosity=4"]),
])
def test_short_and_long_forms_mean_the_same(short, long_):
    assert parse_argv(["-m", "x.gguf", *short]) == parse_argv(["-m", "x.gguf", *long_])


def test_flash_attn_value_is_optional():
    assert parse_argv(["-fa", "-m", "x"]).flash_attn == "on"
    assert parse_argv(["-fa", "off", "-m", "x"]).flash_attn == "off"


def test_bare_program_name_means_discover():
    assert parse_command_line("llama-server -m x.gguf").server_binary == ""


def test_unknown_flag_arity_from_help():
    caps = parse_help((B11434 / "help.txt").read_text())
    # --jinja takes no value per --help, so "x" is not swallowed: it is an unknown word kept as is.
    p = parse_argv(["-m", "m.gguf", "--jinja", "--temp", "0.6"], takes_value=caps.takes_value)
    assert p.extra_args == ("--jinja", "--temp", "0.6")


def test_missing_value_and_bad_number_are_clear():
    with pytest.raises(CommandLineError, match="-c needs a value"):
        parse_argv(["-m", "x", "-c"])
    with pytest.raises(CommandLineError, match="whole number"):
        parse_argv(["-m", "x", "-np", "two"])
    with pytest.raises(CommandLineError, match="cannot split"):
        parse_command_line("llama-server -m 'unterminated")


def test_api_key_never_on_the_launch_command_line():
    p = LaunchProfile(name="k", model="m.gguf", api_key="s3cret")
    argv = to_argv(p, "/bin/llama-server")
    assert "s3cret" not in " ".join(argv)
    assert server_env(p)["LLAMA_API_KEY"] == "s3cret"
    assert "s3cret" not in preview(["llama-server", "--api-key", "s3cret"])
    assert masked_argv(["--api-key=s3cret"]) == ["--api-key=••••••"]


def test_slot_save_path_keeps_its_trailing_slash():
    p = LaunchProfile(name="k", model="m.gguf")
    argv = to_argv(p, "srv", slot_save_path="/data/slots")
    assert argv[argv.index("--slot-save-path") + 1] == "/data/slots/"


def test_default_verbosity_added_only_when_unset():
    p = LaunchProfile(name="k", model="m.gguf")
    assert to_argv(p, "srv", default_verbosity=4)[-2:] == ["-lv", "4"]
    assert "2" == to_argv(p.replace(verbosity=2), "srv", default_verbosity=4)[-1]


def test_extra_arguments_that_belong_to_a_field_move_into_it():
    """Regression: an API key typed into Extra arguments reached the server's argv (ps shows it)."""
    from app.core.argv import absorb_extra_args, to_argv
    from app.core.profile import LaunchProfile
    from app.core.profile_check import validate

    p = LaunchProfile(name="x", model="/m.gguf", extra_args=("--jinja", "--api-key", "sekret", "--temp", "0.6",
                                                             "-np", "4"))
    moved, conflicts = absorb_extra_args(p)
    assert conflicts == [] and moved.api_key == "sekret" and moved.parallel == 4
    assert moved.extra_args == ("--jinja", "--temp", "0.6")
    assert "sekret" not in to_argv(moved, "llama-server")

    clash = LaunchProfile(name="x", model="/m.gguf", port=8081, api_key="mine", extra_args=("--port", "9090",
                                                                                           "--api-key", "other"))
    assert absorb_extra_args(clash)[1] == [
        "--port 9090 in the extra arguments conflicts with the field's value 8081",
        "--api-key in the extra arguments: the profile has its own key; remove it there"]
    assert {e.field for e in validate(clash, check_files=False)} >= {"extra_args"}


def test_plan_launch_never_puts_a_key_from_extra_arguments_on_argv(tmp_path):
    from app.core.profile import LaunchProfile
    from app.server.launcher import plan_launch

    fake = tmp_path.parent  # any folder: the plan is checked against the fake server's --help
    from tests.fake_server.test_supervisor_fake import FAKE

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    plan = plan_launch(LaunchProfile(name="x", model=str(model), server_binary=FAKE,
                                     extra_args=("--api-key", "sekret", "--jinja")))
    assert "sekret" not in plan.argv and "--api-key" not in plan.argv and "--jinja" in plan.argv
    assert plan.env["LLAMA_API_KEY"] == "sekret"
    del fake


def test_a_command_line_without_a_model_is_a_router():
    """llama-server started without a model is a router (it starts a child server per model a request
    names): the import keeps that, and the argv it launches names no model."""
    p = parse_command_line("llama-server --models-dir /srv/models --models-max 2 --port 8090")
    assert p.router and p.model == ""
    assert "-m" not in to_argv(p, "llama-server")
    assert not parse_command_line("llama-server -m /m.gguf --port 8090").router
    # a model named another way (a download, a Docker image) is no router: the profile check then
    # says the model file is missing
    for other in ("-hf ggml-org/gemma-3-1b-it-GGUF", "--hf-repo=ggml-org/x", "-dr ai/smollm2"):
        assert not parse_command_line(f"llama-server {other} --port 8090").router, other
    # the round trip of a launched argv leaves the field alone
    assert parse_argv(to_argv(p, "llama-server"), "imported").router is False
