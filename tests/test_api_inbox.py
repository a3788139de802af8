"""serve.api.Inbox: a request's engine events, taken whole by its stream."""

import asyncio

from openk3.serve.api import Inbox


def test_inbox_takes_everything_queued_in_order_and_waits_while_empty():
    async def main():
        inbox = Inbox()
        for i in range(3):
            inbox.put(i)
        assert await inbox.take() == [0, 1, 2]
        waiting = asyncio.create_task(inbox.take())
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing has arrived: it waits
        inbox.put(3)
        inbox.put(4)
        assert await waiting == [3, 4]

    asyncio.run(main())


def test_inbox_survives_a_cancelled_take():
    """A stream cancelled while waiting (its client left) leaves the inbox usable: a later put is not lost."""
    async def main():
        inbox = Inbox()
        waiting = asyncio.create_task(inbox.take())
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.sleep(0)
        inbox.put("late")
        assert await asyncio.wait_for(inbox.take(), 1) == ["late"]

    asyncio.run(main())
