"""app.core.background.TaskGroup: the one task set of the app, beside track()."""

import asyncio
import logging

from app.core.background import TaskGroup


def test_a_failure_is_logged_with_its_owner_and_told_and_the_group_forgets_ended_tasks(caplog):
    told = []

    async def boom():
        raise RuntimeError("disk gone")

    async def fine():
        return 1

    async def go():
        group = TaskGroup("the Monitor", on_failure=told.append)
        group.start(boom(), "sampling")
        group.start(fine(), "reading the slots")
        assert len(group) == 2
        await group.wait()
        await asyncio.sleep(0)  # the done callbacks run
        return len(group)

    with caplog.at_level(logging.ERROR):
        assert asyncio.run(go()) == 0
    assert [str(e) for e in told] == ["disk gone"]
    [rec] = [r for r in caplog.records if "background work failed" in r.getMessage()]
    assert "the Monitor: sampling" in rec.getMessage()


def test_cancel_all_cancels_and_waits_also_held_tasks_and_never_itself():
    async def go():
        group = TaskGroup("the proxy")
        started = asyncio.Event()
        cancelled = []

        async def forever(name):
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(name)
                raise

        group.start(forever("started"), "a comparison")

        async def handler():
            with group.holding(asyncio.current_task()):
                await forever("held")

        other = asyncio.get_running_loop().create_task(handler())
        await started.wait()
        await asyncio.sleep(0)

        async def closer():  # the owner closed from one of its own tasks: no wait on itself
            await group.cancel_all()

        with group.holding(asyncio.current_task()):
            await closer()
        await other if not other.done() else None
        return sorted(cancelled), len(group), other.cancelled()

    assert asyncio.run(go()) == (["held", "started"], 0, True)
