"""The load check's bounds (app.tools.loadcheck), in a module that imports nothing: the CLI's parser
states them in its help and checks its arguments against them without importing the HTTP clients
(aiohttp, httpx: about a third of a second of every ``kv-valet`` start, a host's included)."""

MAX_STREAMS = 64
MAX_SECONDS = 600.0
MIN_SECONDS = 1.0
MAX_N_PREDICT = 4096
