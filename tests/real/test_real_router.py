"""Router mode through the proxy (issue #29): a llama-server started without a model (it starts a
child server for each model a request names, here from ``--models-dir``) behind ``kv-valet serve
--proxy``, on the real server with Gemma 3 270M under two names.

The profile comes from the user's own command line, as ``kv-valet profiles import`` reads it. The
proxy passes every request through untouched (the router's slots are its children's, which it starts
and stops) and still judges each from the child's timings: a conversation's next turn is a HIT, the
same messages to the other model are another conversation, and the answer is the one the router gives
directly. Parks and resumes are refused with the reason, and a stop takes the children down too."""

from __future__ import annotations

import asyncio
import os

import httpx
import psutil
import pytest

from app.core.argv import parse_command_line, to_argv
from app.core.conversation import Cause
from app.core.lifecycle import StopTrigger
from app.core.profile_check import validate
from app.core.verdict import VerdictKind
from app.monitor.slots import SlotsUnavailable
from app.sessions.service import ServiceError
from app.sessions.target import RouterSlots
from tests.conftest import free_port
from tests.real.test_real_proxy import SYSTEMS, Proxied

pytestmark = pytest.mark.real_server

MODELS = ("gemma-a", "gemma-b")


@pytest.fixture
def router_profile(real_binary, real_model, tmp_path):
    """The user's router command line, imported: two models in a models folder (links to Gemma 3)."""
    models = tmp_path / "models"
    models.mkdir()
    for name in MODELS:
        os.symlink(real_model, models / f"{name}.gguf")
    line = (f"{real_binary} --models-dir {models} --models-max 1 -c 2048 -np 1 --host 127.0.0.1 "
            f"--port {free_port()}")
    profile = parse_command_line(line, "router").replace(slot_save_path=str(tmp_path / "slots") + "/")
    return profile


def test_a_command_line_without_a_model_is_a_router_profile(router_profile):
    assert router_profile.router and not router_profile.model
    assert validate(router_profile) == []
    argv = to_argv(router_profile, router_profile.server_binary)
    assert "-m" not in argv and "--models-dir" in argv
    # with a model it is no router, and a profile with neither is refused with the way out
    assert [e.field for e in validate(router_profile.replace(model=router_profile.server_binary))] == ["model"]
    assert "router mode" in validate(router_profile.replace(router=False))[0].message


def test_the_proxy_passes_a_routers_requests_through_and_judges_them(router_profile):
    async def go():
        async with Proxied(router_profile.replace(proxy=True)) as p:
            assert p.proxy.router and "router" in (p.proxy.notice() or "")
            question = [{"role": "system", "content": SYSTEMS["A"]},
                        {"role": "user", "content": "What is the first word?"}]
            reply = await p.client.chat.completions.create(model="gemma-a", messages=question, max_tokens=4,
                                                           temperature=0)
            first = await asyncio.wait_for(p.judged.get(), 120)
            assert first.verdict is VerdictKind.NEW and first.prompt_n > 100, first
            assert first.explanation is not None and first.explanation.cause is Cause.ROUTER, first
            assert "'gemma-a'" in first.explanation.detail
            # the next turn: the same conversation, the child's slot reused (judged from its timings)
            answer = reply.choices[0].message.content or ""
            turn2 = question + [{"role": "assistant", "content": answer},
                                {"role": "user", "content": "And the second?"}]
            body = {"model": "gemma-a", "messages": turn2, "max_tokens": 4, "temperature": 0}
            async with httpx.AsyncClient(timeout=120) as h:
                through = (await h.post(p.proxy.http.url + "/v1/chat/completions", json=body)).json()
                second = await asyncio.wait_for(p.judged.get(), 120)
                assert second.conversation == first.conversation and second.verdict is VerdictKind.HIT, second
                assert second.cache_n >= first.prompt_n - 8, second
                assert through["model"] == "gemma-a"
                # untouched: the same request, prefilled whole both times (the proxy keeps the client's
                # cache_prompt), answered the same through the proxy as by the router itself
                cold = dict(body, cache_prompt=False)
                proxied = (await h.post(p.proxy.http.url + "/v1/chat/completions", json=cold)).json()
                again = await asyncio.wait_for(p.judged.get(), 120)
                assert again.cache_n == 0 and again.conversation == first.conversation, again
                direct = (await h.post(p.handle.url + "/v1/chat/completions", json=cold)).json()
                assert proxied["choices"][0]["message"] == direct["choices"][0]["message"]
                # the router's own routes pass through: its models, and a model's slots by ?model=
                models = (await h.get(p.proxy.http.url + "/models")).json()["data"]
                assert {m["id"]: m["status"]["value"] for m in models}["gemma-a"] == "loaded"
                slots = (await h.get(p.proxy.http.url + "/slots", params={"model": "gemma-a"})).json()
                assert [s["n_ctx"] for s in slots] == [2048]
            # bad input: no "model" at all; the router's own 400 reaches the client, and the record says why
            async with httpx.AsyncClient(timeout=120) as h:
                r = await h.post(p.proxy.http.url + "/v1/chat/completions",
                                 json={"messages": question, "max_tokens": 4})
            assert r.status_code == 400 and "model name is missing" in r.text, r.text
            nameless = await asyncio.wait_for(p.judged.get(), 120)
            assert nameless.cache_n is None and "names no model" in nameless.explanation.detail, nameless
            # the same messages to the other model are another conversation
            await p.client.chat.completions.create(model="gemma-b", messages=question, max_tokens=4,
                                                   temperature=0)
            other = await asyncio.wait_for(p.judged.get(), 120)
            assert other.conversation != first.conversation and other.verdict is VerdictKind.NEW, other
            # the router's slots are not KV Valet's to park or resume: refused with the reason
            svc = await p.servers.sessions(p.handle.id)
            with pytest.raises(ServiceError, match="router"):
                await svc.park(0, "nope")
            assert (await svc.park_all()) == []
            with pytest.raises(RouterSlots) as e:  # what the Sessions tab says instead of a failed /slots
                await svc.slot_rows()
            assert str(e.value) == SlotsUnavailable.ROUTER
            children = psutil.Process(p.handle.supervisor.pid).children(recursive=True)
            assert children, "the router started no child server"
            stopped = await p.stop()  # serve's Ctrl-C: nothing to park, the router stops
            assert stopped.stopped, stopped
            gone, alive = psutil.wait_procs(children, timeout=30)
            assert not alive, f"child servers left running: {alive}"

    asyncio.run(go())

