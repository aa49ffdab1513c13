"""Does a park's files on disk match what the park wrote? The one decision, and its words.

A state file and its checkpoint sidecar are tied by nothing a v1 (turboquant PR #206) loader
checks: a user who copies files, a sync tool or a restore from a backup can put another chat's
``.ckpt`` next to this session's state file, and the fork loads it and rolls back onto that
chat's checkpoint positions (issue #36: "last checkpoint at 1,923" where the park had 2,185). So
the catalog keeps, per park, what it wrote (:class:`ParkedFiles`: each file's size and SHA-256,
and the sidecar's checkpoint positions as parked), and before a resume, a check, an A/B or a move
:func:`compare` says whether the files found now are those (:class:`FilesCheck`).

Pure: the reading of the files (stat, headers, hashes) is :mod:`app.sessions.files_check`'s. This
module decides and words; every caller (resume, check, A/B, move, the proxy, ``sessions show``,
the Sessions tab, ``doctor``) shows its sentences, none words its own.

A park from before the catalog kept digests is "not recorded": never refused.
"""

from __future__ import annotations

import enum
import functools
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

#: The suffix of the state file itself among a park's files ("" ) and of its sidecars.
STATE = ""

#: (n_tokens, pos_min, pos_max) of one checkpoint, as a sidecar's header says.
Position = tuple[int, int, int]


@dataclass(frozen=True)
class ParkedFile:
    """One file of a park: the state file (``suffix`` "") or a sidecar (``.ckpt``, ``.checkpoints``)."""

    suffix: str
    size: int
    sha256: str
    #: a sidecar's checkpoints as its header gave them at the park; None: not read (a state file,
    #: a format whose header KV Valet does not read)
    checkpoints: tuple[Position, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"size": self.size, "sha256": self.sha256}
        if self.checkpoints is not None:
            d["checkpoints"] = [list(p) for p in self.checkpoints]
        return d


@dataclass(frozen=True)
class ParkedFiles:
    """What a park wrote: its state file and each sidecar, by suffix."""

    files: tuple[ParkedFile, ...]

    def get(self, suffix: str) -> ParkedFile | None:
        return next((f for f in self.files if f.suffix == suffix), None)

    @property
    def sidecars(self) -> tuple[ParkedFile, ...]:
        return tuple(f for f in self.files if f.suffix != STATE)

    def positions(self) -> tuple[Position, ...] | None:
        """Every checkpoint position the park's sidecars held: () for a park without a sidecar; None
        when a sidecar's positions were not read (a format whose header KV Valet does not read)."""
        if any(f.checkpoints is None for f in self.sidecars):
            return None
        return tuple(p for f in self.sidecars for p in (f.checkpoints or ()))

    def to_json(self) -> str:
        return json.dumps({f.suffix: f.to_dict() for f in self.files}, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | None) -> "ParkedFiles | None":
        """The catalog's text; None for "" (a park from before the catalog kept digests) or text
        this version cannot read (treated the same: not recorded, never refused)."""
        if not text:
            return None
        files = _parked_files(text)  # (immutable: the same text read once, a restore's check reads it per request)
        return cls(files) if files is not None else None


#: how a park whose files are not the ones it wrote is named when something leaves it parked (the
#: proxy, here or through a host's ``kv-valet resume --unless-files-changed``)
NOT_PARKED_FILES = "its files are not the ones parked"


def parked_positions(parked_files: str | None) -> tuple[Position, ...] | None:
    """The checkpoint positions a park wrote, from the catalog's record of it (None: not recorded),
    so a restore the server answers by rolling back to another position is called out."""
    parked = ParkedFiles.from_json(parked_files)
    return parked.positions() if parked is not None else None


def _position(p: Iterable[Any]) -> Position:
    n_tokens, pos_min, pos_max = (int(x) for x in p)
    return n_tokens, pos_min, pos_max


@dataclass(frozen=True)
class FoundFile:
    """A park's file as it is on disk now. ``sha256`` None: not hashed (the caller did not
    afford it); ``checkpoints``: the sidecar header's positions now (None: not read)."""

    suffix: str
    name: str  # the file's name, for the sentences
    size: int
    sha256: str | None = None
    checkpoints: tuple[Position, ...] | None = None


class FilesStatus(enum.StrEnum):
    AS_PARKED = "as parked"
    NOT_RECORDED = "not recorded"
    NOT_VERIFIED = "not verified yet"
    CHANGED = "not as parked"


@dataclass(frozen=True)
class FilesCheck:
    """The answer: ``problems`` (a file that is not the one parked: refused without ``--yes``),
    ``notes`` (a parked sidecar that is gone: said, not refused; the resume's own sidecar warnings
    cover what it costs), ``unverified`` (a file changed on disk whose hash was not computed)."""

    status: FilesStatus
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    unverified: tuple[str, ...] = ()
    verified: tuple[str, ...] = field(default=(), compare=False)  # suffixes whose bytes were hashed now

    @property
    def refuses(self) -> bool:
        """A file is not the one parked: the step goes on only when the user says so (``--yes``)."""
        return bool(self.problems)

    @property
    def sentence(self) -> str:
        """One line for ``sessions show``, the Sessions tab and ``doctor``."""
        if self.status is FilesStatus.NOT_RECORDED:
            return NOT_RECORDED
        if self.status is FilesStatus.NOT_VERIFIED:
            return "; ".join(self.unverified + self.notes)
        if self.status is FilesStatus.AS_PARKED:
            return "as parked" + (f" ({'; '.join(self.notes)})" if self.notes else
                                  " (size, SHA-256 and checkpoint positions)")
        return "; ".join(self.problems + self.notes)

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status.value, "refuses": self.refuses, "sentence": self.sentence,
                "problems": list(self.problems), "notes": list(self.notes)}


NOT_RECORDED = ("not recorded: parked before KV Valet kept a digest of each file, so a file replaced since "
                "cannot be told apart")


def _what(suffix: str) -> str:
    return "state file" if suffix == STATE else "sidecar"


def _last(cps: tuple[Position, ...]) -> int | None:
    return max((p[2] for p in cps), default=None)


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _positions_differ(name: str, now: tuple[Position, ...], then: tuple[Position, ...]) -> str:
    head = f"not the sidecar this session parked ({name})"
    last_now, last_then = _last(now), _last(then)
    if last_now is not None and last_then is not None and last_now != last_then:
        return f"{head}: last checkpoint at {last_now:,}, parked with {last_then:,}"
    if len(now) != len(then):
        return f"{head}: {_plural(len(now), 'checkpoint')}, parked with {len(then):,}"
    if not now:
        return f"{head}: no checkpoints, parked with none either but other bytes"
    return f"{head}: checkpoints at other positions than parked (the last at {last_now:,} in both)"


def _differs(found: FoundFile, parked: ParkedFile) -> str | None:
    """Why ``found`` is not ``parked`` (None: it is, as far as was looked)."""
    if found.suffix != STATE and found.checkpoints is not None and parked.checkpoints is not None \
            and tuple(found.checkpoints) != tuple(parked.checkpoints):
        return _positions_differ(found.name, tuple(found.checkpoints), tuple(parked.checkpoints))
    head = f"not the {_what(found.suffix)} this session parked ({found.name})"
    if found.size != parked.size:
        return f"{head}: {found.size:,} bytes, parked with {parked.size:,}"
    if found.sha256 is not None and found.sha256 != parked.sha256:
        return (f"{head}: the same size but other bytes (SHA-256 {found.sha256[:12]}…, parked with "
                f"{parked.sha256[:12]}…)")
    return None


def compare(parked: ParkedFiles | None, found: Mapping[str, FoundFile], *, state_name: str = "") -> FilesCheck:
    """``found`` (suffix -> the file now; a suffix absent: no such file) against ``parked``.

    * not recorded (``parked`` None): never refused;
    * a file of the park that differs (checkpoint positions, size, or SHA-256 when hashed): refused;
    * a sidecar where the park had none: refused (a stale or foreign sidecar the fork would load);
    * the park's state file gone: refused (nothing to restore); a parked sidecar gone: a note only;
    * a file whose size and positions match but whose hash was not computed: not verified yet.
    """
    if parked is None:
        return FilesCheck(FilesStatus.NOT_RECORDED)
    problems: list[str] = []
    notes: list[str] = []
    unverified: list[str] = []
    for pf in parked.files:
        now = found.get(pf.suffix)
        if now is None:
            if pf.suffix == STATE:
                problems.append(f"the state file this session parked is gone ({state_name or 'its file'})")
            else:
                last = _last(pf.checkpoints or ())
                notes.append(f"the sidecar this session parked is gone ({state_name + pf.suffix if state_name else pf.suffix}"
                             + (f"; parked with its last checkpoint at {last:,}" if last is not None else "") + ")")
            continue
        why = _differs(now, pf)
        if why:
            problems.append(why)
        elif now.sha256 is None:
            unverified.append(f"the {_what(pf.suffix)} {now.name} changed on disk since it was last verified "
                              "(same size" + (", same checkpoint positions" if pf.checkpoints is not None else "")
                              + "): its SHA-256 is not checked yet")
    for suffix, now in sorted(found.items()):
        if parked.get(suffix) is None:
            last = _last(now.checkpoints or ())
            problems.append(f"not the sidecar this session parked ({now.name}): the park had no sidecar"
                            + (f", this one's last checkpoint is at {last:,}" if last is not None else ""))
    verified = tuple(s for s, f in found.items() if f.sha256 is not None)
    if problems:
        return FilesCheck(FilesStatus.CHANGED, tuple(problems), tuple(notes), tuple(unverified), verified)
    if unverified:
        return FilesCheck(FilesStatus.NOT_VERIFIED, (), tuple(notes), tuple(unverified), verified)
    return FilesCheck(FilesStatus.AS_PARKED, (), tuple(notes), (), verified)


# --------------------------------------------------------------------------- the rollback a restore got


def foreign_rollback(pos_min: int | None, pos_max: int | None, n_restored: int | None,
                     parked: tuple[Position, ...] | None) -> str | None:
    """The verdict's words for a restore the server answered by rolling back to a checkpoint
    (``pos_min``..``pos_max`` of the log's "restored context checkpoint") this park never had: not
    one of its sidecar's checkpoints (``parked``, as the park wrote them) and not the tip of its
    ``n_restored`` tokens (the fork's fallback checkpoint). None when it was the park's own, or when
    the park's positions are not recorded."""
    if pos_max is None or parked is None:
        return None
    if n_restored and pos_max == n_restored - 1:
        return None  # the tip of the restored tokens: the build's fallback checkpoint over them
    if any(p[2] == pos_max and (pos_min is None or p[1] == pos_min) for p in parked):
        return None
    had = (f"its sidecar's checkpoints end at {', '.join(f'{p[2]:,}' for p in sorted(parked)[-3:])}"
           if parked else "it was parked without checkpoints")
    return (f"the server rolled back to a checkpoint at token {pos_max:,}, a position this park never had "
            f"({had}): that checkpoint is another save's, so the reused state may be another chat's")


@functools.lru_cache(maxsize=1024)
def _parked_files(text: str) -> tuple[ParkedFile, ...] | None:
    try:
        data = json.loads(text)
        files = []
        for suffix, d in sorted(data.items()):
            cps = d.get("checkpoints")
            files.append(ParkedFile(str(suffix), int(d["size"]), str(d["sha256"]),
                                    None if cps is None else tuple(_position(p) for p in cps)))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return tuple(files) if any(f.suffix == STATE for f in files) else None
