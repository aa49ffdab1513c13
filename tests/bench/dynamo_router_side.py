"""NVIDIA Dynamo's KV router in front of KV Valet proxies' KV events: the Dynamo half of
tests/bench/bench_kv_router.py, run by an interpreter that has Dynamo's runtime (``ai-dynamo-runtime``,
in a scratch venv: never the project's), not by the project's own.

One Dynamo worker per endpoint given (``--zmq tcp://127.0.0.1:P``, once per KV Valet server), each a
``DistributedRuntime`` (file discovery in ``DYN_FILE_KV``, ZMQ event plane: no etcd, no NATS) that
serves a placeholder endpoint, registers a model card (a block size of 16, nothing else loaded) and
relays the proxy's events with Dynamo's own ``KvEventPublisher(zmq_endpoint=...)``, the path Dynamo
uses for vLLM's events; and one ``KvRouter`` over them. It prints ``ready {"workers": [id, ...]}``,
then reads JSON token lists, one a line, and answers each with the router's
``best_worker(tokens)``: ``{"worker": index of the endpoint, "overlap_blocks": n}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from dynamo._core import (DistributedRuntime, KvEventPublisher, KvRouter, KvRouterConfig, ModelInput,
                          ModelRuntimeConfig, ModelType, WorkerType, register_model)

BLOCK_SIZE = 16


async def placeholder(_request):
    yield {"token_ids": [], "finish_reason": "stop"}  # never asked: only best_worker is


async def main(args) -> None:
    loop = asyncio.get_running_loop()
    runtimes, endpoints, relays = [], [], []
    for zmq_endpoint in args.zmq:
        rt = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
        ep = rt.endpoint("kvvalet.llamaserver.generate")
        asyncio.ensure_future(ep.serve_endpoint(placeholder))
        config = ModelRuntimeConfig()
        config.total_kv_blocks = 100_000
        await register_model(ModelInput.Tokens, ModelType.Chat, ep, args.model_dir, "kv-valet",
                             worker_type=WorkerType.Aggregated, kv_cache_block_size=BLOCK_SIZE,
                             runtime_config=config, skip_model_assets=True, ignore_weights=True)
        relays.append(KvEventPublisher(ep, kv_block_size=BLOCK_SIZE, zmq_endpoint=zmq_endpoint))
        runtimes.append(rt)
        endpoints.append(ep)
    router = KvRouter(endpoints[0], BLOCK_SIZE, KvRouterConfig())
    ids = [ep.connection_id() for ep in endpoints]
    print("ready " + json.dumps({"workers": ids}), flush=True)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        tokens = json.loads(line)
        worker, _dp_rank, overlap = await router.best_worker(tokens)
        print(json.dumps({"worker": ids.index(worker), "overlap_blocks": overlap}), flush=True)
    for rt in runtimes:
        rt.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--zmq", action="append", required=True)
    p.add_argument("--model-dir", required=True)
    asyncio.run(main(p.parse_args()))
