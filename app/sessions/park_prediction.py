"""The size a park will take, before it runs: from the model's metadata (the layouts
:mod:`app.core.park_size` knows), else this model's earlier parks in the catalog, else the session's
previous copy; and its wording for a refusal.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from app.sessions.target import ServerTarget
from app.store.catalog import Catalog

log = logging.getLogger(__name__)

_SHAPES: dict[tuple[str, int, int], object] = {}


def _model_shape(model_path: str):
    """app.server.gguf_info.read_model_shape, remembered per (path, size, mtime) in this process; None
    when the file is not readable here or its layout is not known."""
    from app.server.gguf_info import ModelFileError, read_model_shape

    try:
        st = os.stat(model_path)
    except (OSError, TypeError, ValueError):
        return None
    key = (os.path.abspath(model_path), st.st_size, st.st_mtime_ns)
    if key not in _SHAPES:
        try:
            _SHAPES[key] = read_model_shape(model_path)
        except (ModelFileError, OSError, ValueError) as e:
            log.info("park size: the model %s gives no shape (%s): earlier parks are used instead", model_path, e)
            _SHAPES[key] = None
    return _SHAPES[key]


def _park_samples(catalog: Catalog, target: ServerTarget, quick_id: str) -> list:
    """This model's earlier parks with these KV types (any profile): what calibrates a prediction."""
    from app.core.park_size import ParkSample

    out = []
    for r in catalog.list():
        same_model = (quick_id and r.model_quick_id == quick_id) or \
            (not quick_id and target.model_path and r.model_path == target.model_path)
        if same_model and (r.cache_type_k or "f16") == (target.cache_type_k or "f16") and \
                (r.cache_type_v or "f16") == (target.cache_type_v or "f16") and r.state_size > 0:
            out.append(ParkSample(r.n_tokens, r.state_size, r.sidecar_size or 0, r.sidecar_count or 0))
    return out


def predict_park_size(target: ServerTarget, n_tokens: int, *, name: str | None = None, quick_id: str = ""):
    """The predicted size of a park of a slot holding ``n_tokens`` on ``target``
    (:class:`app.core.park_size.ParkSize`), or None when nothing tells. The model's metadata first
    (exact for the layouts app.core.park_size knows), else this model's earlier parks (catalog), else the
    session's previous copy; the checkpoint count is the previous copy's when it had more than one
    prompt makes. The source is in ``.source``."""
    from app.core import park_size as ps
    from app.core.sidecar_behaviour import Behaviour

    behaviour = target.behaviour
    writes = behaviour is not Behaviour.NONE  # not known yet: as if it wrote them (the larger figure)
    version = 1 if behaviour in (Behaviour.FORK, Behaviour.PORT) else 2
    prev = target.catalog.get(target.profile_name, name) if name else None
    shape = _model_shape(target.model_path) if target.model_path else None
    size = None
    if shape is not None:
        # --swa-full: the server makes no checkpoints of a sliding-window model (app.core.restore_needs)
        none_made = target.swa_full and not shape.recurrent
        size = ps.predict(shape, n_tokens, ctk=target.cache_type_k, ctv=target.cache_type_v,
                          ctx_checkpoints=target.ctx_checkpoints, writes_sidecar=writes,
                          n_checkpoints=0 if none_made else None, sidecar_version=version)
        if size is not None and none_made:
            size = replace(size, sidecar_max=size.sidecar)
    if size is None:
        size = ps.calibrate(_park_samples(target.catalog, target, quick_id), n_tokens,
                            ctx_checkpoints=target.ctx_checkpoints)
    if size is None and prev is not None and prev.n_tokens > 0 and prev.state_size > 0:
        size = ps.calibrate([ps.ParkSample(prev.n_tokens, prev.state_size, prev.sidecar_size or 0,
                                           prev.sidecar_count or 0)], n_tokens,
                            ctx_checkpoints=target.ctx_checkpoints, source=ps.SOURCE_PREVIOUS)
    if size is not None and prev is not None and writes:
        size = ps.with_previous(size, prev.sidecar_count)
    return size


def describe_size(size) -> str:
    """``about 1.2 MiB (state 1.0 MiB + sidecar 0.2 MiB: 2 checkpoints of 100.0 KiB), from the model metadata``"""
    from app.core.units import fmt_bytes

    side = ""
    if size.sidecar:
        side = f" + sidecar {fmt_bytes(size.sidecar)}"
        if size.n_checkpoints:
            side += f": {size.n_checkpoints} checkpoint{'' if size.n_checkpoints == 1 else 's'} of " \
                    f"{fmt_bytes(size.per_checkpoint)}"
    return f"about {fmt_bytes(size.total)} (state {fmt_bytes(size.state)}{side}), from {size.source}"
