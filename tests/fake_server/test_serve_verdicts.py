"""Headless verdicts on the fake server: `kv-valet serve` judges what `kv-valet resume` restored,
HIT with a sidecar build (and the time it saved), DISCARDED without. The real-server twin is
tests/real/test_real_serve_verdicts.py; the flow is the same helper."""

from __future__ import annotations

import pytest

from app.core.profile import LaunchProfile
from tests.fake_server.test_supervisor_fake import FAKE, free_port
from tests.real.test_real_serve_verdicts import headless_resume

PROMPT = " ".join(f"word{i}" for i in range(700))


@pytest.mark.parametrize("sidecar", [True, False])
def test_serve_judges_a_cli_resume(tmp_path, monkeypatch, sidecar):
    from app import paths
    from app.store.catalog import Catalog

    if sidecar:
        monkeypatch.setenv("FAKE_SIDECAR", "1")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    profile = LaunchProfile(name="fk", model=str(model), server_binary=FAKE, port=free_port(), ctx_size=4096,
                            parallel=2)
    line, rec, serve, rest = headless_resume(profile, PROMPT, " and one more")
    kind = "HIT" if sidecar else "DISCARDED"
    assert f"verdict {kind} for 'chat' (slot 0)" in line, line
    assert rec["last_verdict"] == kind and rec["last_verdict_reason"]
    with Catalog(paths.catalog_path()) as cat:
        rate = cat.prefill_rate("fk")
        assert cat.pending_verdicts("fk") == []
    assert rate  # sampled by serve from the fill
    if sidecar:
        assert rec["last_time_saved_s"] > 0 and rec["time_saved_s"] == rec["last_time_saved_s"]
    else:
        assert rec["last_time_saved_s"] == 0.0
    assert "server stopped" in rest
