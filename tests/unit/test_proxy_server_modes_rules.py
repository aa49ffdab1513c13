"""The server's own prompt caching as the proxy meets it: read from the binary's --help and the
argv (build 11434's real help text, and forks' disk caches), the live watch over idle-slot
clearing and sleep (a stand-in client over the real slot leases), and the disk budget setting."""

from __future__ import annotations

from pathlib import Path

from app import settings
from app.core.conversation import Cause, Conversation
from app.core.helptext import descriptions, server_caching
from app.proxy.watch import ServerWatch, caching_notice
from app.proxy.lease_table import SlotState, park_name
from tests.unit.test_proxy_leases import FakeBackend, make

HELP_11434 = (Path(__file__).resolve().parents[1] / "fixtures" / "llama-server-b11434" / "help.txt").read_text()


def test_build_11434_clears_idle_slots_only_with_unified_kv():
    assert "clear them when using unified KV" in descriptions(HELP_11434)["--cache-idle-slots"]
    two = server_caching(["-np", "2"], HELP_11434)
    assert two.idle_slots_saved and not two.idle_slots_cleared  # -kvu defaults on only for -np auto
    assert server_caching(["-np", "2", "-kvu"], HELP_11434).idle_slots_cleared
    assert server_caching([], HELP_11434).idle_slots_cleared  # -np auto: unified KV
    assert not server_caching(["-kvu", "--no-cache-idle-slots"], HELP_11434).idle_slots_saved
    off = server_caching(["-kvu", "--cache-ram", "0"], HELP_11434)  # idle caching needs the RAM cache
    assert not off.idle_slots_saved and not off.idle_slots_cleared and "needs --cache-ram" in off.notes[0]
    assert server_caching(["-kvu", "-np", "2", "--cache-ram=64"], HELP_11434).idle_slots_cleared


def test_a_later_build_that_says_it_clears_always_clears():
    later = HELP_11434.replace("save idle slots to the prompt cache on new task, and clear them when\n"
                               "                                        using unified KV",
                               "save idle slots to the prompt cache and clear them when a new task\n"
                               "                                        starts")
    assert server_caching(["-np", "2", "-no-kvu"], later).idle_slots_cleared


def test_sleep_is_read_from_the_argv_when_the_binary_has_the_flag():
    assert server_caching(["--sleep-idle-seconds", "30"], HELP_11434).sleep_idle_seconds == 30
    assert server_caching(["--sleep-idle-seconds", "-1"], HELP_11434).sleep_idle_seconds is None
    no_flag = HELP_11434.replace("--sleep-idle-seconds", "--sleep-idle-secondz")
    assert server_caching(["--sleep-idle-seconds", "30"], no_flag).sleep_idle_seconds is None


def with_flag(line: str, desc: str) -> str:
    """``HELP_11434`` with one more flag, laid out as llama-server's --help lays it out."""
    return HELP_11434 + (f"\n{line:<40}{desc}\n" if len(line) < 38 else f"\n{line}\n{'':40}{desc}\n")


def test_a_disk_prompt_cache_is_read_from_its_description_not_its_name():
    path_kind = with_flag("--cache-disk PATH", "directory where the prompt cache is persisted on disk (default: "
                                               "disabled)")
    assert server_caching(["--cache-disk", "/var/cache/p"], path_kind).disk_cache == "--cache-disk"
    assert server_caching([], path_kind).disk_cache is None  # there, but not used
    quota = with_flag("--cache-disk N", "MiB of disk for saved prompts (default: 0, 0 = disabled)")
    assert server_caching(["--cache-disk", "4096"], quota).steps_aside
    assert not server_caching(["--cache-disk", "0"], quota).steps_aside
    ckpt = with_flag("--cache-disk", "memory-map the context checkpoints to disk")
    assert server_caching(["--cache-disk"], ckpt).disk_cache is None  # checkpoints, not prompts
    on_by_default = with_flag("--prompt-cache-disk, --no-prompt-cache-disk",
                              "keep prompts in a disk cache across restarts (default: enabled)")
    assert server_caching([], on_by_default).disk_cache == "--prompt-cache-disk"
    assert server_caching(["--no-prompt-cache-disk"], on_by_default).disk_cache is None
    assert server_caching(["-kvu"], HELP_11434).disk_cache is None  # the stock build has none


def test_the_notice_says_the_remedy_and_that_the_proxy_steps_aside():
    cleared = server_caching(["-kvu"], HELP_11434)
    text = caching_notice(cleared, save_before_clear=True)
    assert "--no-cache-idle-slots" in text and "saves" in text
    assert "does not save" in caching_notice(cleared, save_before_clear=False)
    disk = server_caching(["--cache-disk", "/x"], with_flag("--cache-disk PATH", "persist prompts on disk here"))
    assert "steps aside" in caching_notice(disk, True)
    assert caching_notice(server_caching(["-np", "2"], HELP_11434), True) is None


# -- the live watch ---------------------------------------------------------------------------------

class Client:
    """/slots and /props as the server answers them: a slot's n_prompt_tokens, is_sleeping."""

    def __init__(self, backend: FakeBackend):
        self.backend = backend
        self.sleeping = False
        self.slot_reads = 0

    async def slots(self) -> list[dict]:
        self.slot_reads += 1
        return [{"id": i, "is_processing": False, "id_task": 1, "n_prompt_tokens": n}
                for i, n in sorted(self.backend.slot_tokens.items())]

    async def props(self) -> dict:
        return {"is_sleeping": self.sleeping}


async def two_conversations(leases, backend):
    convs = []
    for name in ("a", "b"):
        conv = Conversation(id=name, setup="s")
        lease = await leases.acquire(conv, 100)
        backend.slot_tokens[lease.slot] = 100
        leases.release(lease, 100, ok=True)
        convs.append(conv)
    return convs


async def test_an_idle_slot_the_server_emptied_is_told_to_the_leases():
    leases = make(2)
    backend = leases.backend
    a, b = await two_conversations(leases, backend)
    w = ServerWatch(Client(backend), leases, server_caching(["-kvu"], HELP_11434))
    assert await w.check_cleared() == []  # both still hold their tokens
    backend.slot_tokens[a.slot] = 0  # idle-slot caching cleared a's slot when b's task started
    slot_a = a.slot
    assert await w.check_cleared() == [slot_a]
    assert leases.state(slot_a) is SlotState.FREE and leases.lost_cause("a")[0] is Cause.IDLE_SLOT_CLEARED
    lease = await leases.acquire(a, 100)  # its next request: explained by the clearing
    assert lease.idle_cleared


async def test_a_server_that_does_not_cache_idle_slots_is_not_asked():
    leases = make(2)
    client = Client(leases.backend)
    await two_conversations(leases, leases.backend)
    assert await ServerWatch(client, leases, server_caching(["--no-cache-idle-slots"], HELP_11434)).check_cleared() == []
    assert client.slot_reads == 0


async def test_dirty_idle_slots_are_saved_before_a_task_when_the_server_clears_them():
    leases = make(2)
    a, b = await two_conversations(leases, leases.backend)
    w = ServerWatch(Client(leases.backend), leases, server_caching(["-kvu"], HELP_11434))
    assert sorted(await w.before_dispatch()) == ["a", "b"]
    assert a.parked_as == park_name("a") and leases.state(a.slot) is SlotState.IDLE_CLEAN
    off = ServerWatch(Client(leases.backend), leases, server_caching(["-kvu"], HELP_11434), save_before_clear=False)
    lease = await leases.acquire(a, 100)
    leases.release(lease, 120, ok=True)
    assert await off.before_dispatch() == []  # the setting is off: nothing saved
    assert await ServerWatch(Client(leases.backend), leases,
                             server_caching(["-np", "2"], HELP_11434)).before_dispatch() == []  # no clearing


async def test_sleep_parks_before_the_timeout_and_is_noticed_after_it():
    leases = make(2)
    a, b = await two_conversations(leases, leases.backend)
    now = [0.0]
    client = Client(leases.backend)
    w = ServerWatch(client, leases, server_caching(["--sleep-idle-seconds", "60"], HELP_11434), clock=lambda: now[0])
    w.note_activity()
    assert len(w._timers) == 2 and all(not t.cancelled() for t in w._timers)
    assert sorted(await w.park_before_sleep()) == ["a", "b"]
    now[0] = 30.0
    await w.before_request()
    assert w.slept_seen == 0  # not idle long enough: /props is not asked
    client.sleeping = True
    now[0] = 61.0
    await w.before_request()
    assert w.slept_seen == 1
    assert leases.state(0) is SlotState.FREE and leases.lost_cause("a")[0] is Cause.SERVER_SLEPT
    assert a.parked_as == park_name("a")  # parked before: restored on its next request
    lease = await leases.acquire(a, 100)
    assert lease.restored_from == park_name("a") and lease.slept
    w.close()
    assert w._timers == []


async def test_no_sleep_no_timer():
    leases = make(1)
    w = ServerWatch(Client(leases.backend), leases, server_caching([], HELP_11434))
    w.note_activity()
    assert w._timers == [] and not await w.check_slept()


# -- the disk budget setting -----------------------------------------------------------------------

def test_the_disk_budget_is_a_setting_with_a_sane_default(tmp_path):
    assert settings.DEFAULTS.proxy_disk_budget_gib == 50
    assert settings.DEFAULTS.proxy_disk_budget_bytes() == 50 * 1024 ** 3
    path = tmp_path / "settings.toml"
    saved = settings.update(path, proxy_disk_budget_gib="0")
    assert saved.proxy_disk_budget_bytes() is None  # 0: no limit
    assert settings.load(path).proxy_disk_budget_gib == 0
    assert settings.Settings(proxy_disk_budget_gib=-1).errors()[0][0] == "proxy_disk_budget_gib"
    assert "least recently used" in settings.describe("proxy_disk_budget_gib")


async def test_a_changed_budget_takes_effect_at_the_next_save(tmp_path):
    from app.proxy.service import ProxyService

    class BigParks(FakeBackend):
        def parked_size(self, name: str) -> int:
            return 600 * 1024 ** 2 if name in self.parks else 0  # 600 MiB a park

    backend = BigParks()
    leases = make(1, backend=backend, budget=settings.DEFAULTS.proxy_disk_budget_bytes())
    proxy = ProxyService.__new__(ProxyService)  # only what apply_settings touches
    proxy.leases, proxy.watch, proxy.disk_budget_bytes = leases, None, None
    convs = [Conversation(id=name, setup="s") for name in "abcd"]
    for conv in convs[:3]:  # three conversations rotate through one slot: two parks on disk
        lease = await leases.acquire(conv, 100)
        backend.slot_tokens[lease.slot] = 100
        leases.release(lease, 100, ok=True)
    assert sorted(backend.parks) == [park_name("a"), park_name("b")]  # 1.2 GiB: within the default 50 GiB
    proxy.apply_settings(settings.Settings(proxy_disk_budget_gib=1))
    assert leases.disk_budget_bytes == 1024 ** 3 and proxy.disk_budget_bytes == 1024 ** 3
    lease = await leases.acquire(convs[3], 100)  # saves c to make room: the new budget is enforced
    assert sorted(backend.parks) == [park_name("c")]  # the least recently used parks went
    leases.release(lease, 100, ok=True)
