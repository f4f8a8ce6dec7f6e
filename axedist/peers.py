"""What the ranks of a job tell each other when something is off: whether they agree, and who
did not arrive.

Ranks that disagree. ``agree(ranks, what, text)`` posts this rank's text (say, the route of a
redistribute: source and target spec) on the job's store, waits for every other rank's, and when
they differ raises the same ``RankDisagreementError`` on every rank, listing each rank's text::

    RankDisagreementError: ranks disagree on redistribute:
      rank 0: [8, 8] S[(4,2,8):(1@gpuid,8,1)] -> [8, 8] S[(8,8):(8,1)] + R[4:1@gpuid]
      ranks 1, 2, 3: [8, 8] S[(4,2,8):(1@gpuid,8,1)] -> [8, 8] S[(8,4,2):(2,1@gpuid,1)]

Callers run it once per cached plan (its first use), never per call.

Peers that do not arrive. When a collective fails (gloo's timeout, a peer's connection closed) or
an agreement check waits longer than ``collective_timeout_s()``, ``peer_error`` reports where this
rank was stuck, gives the others a short grace to report theirs, and builds a ``PeerError`` that
names the collective and the ranks that did not arrive (with what a rank that raised posted)::

    PeerError: all-gather over ('gpuid',) (redistribute ...) did not complete on rank 0: Timed out
    waiting 2000ms ... Rank 2 did not arrive (no report within 1.0 s: stalled, busy elsewhere or
    exited). Ranks 1, 3 were stuck too: rank 1 in all-gather over ('gpuid',) ...

The store is torch.distributed's default one (torchrun's, or the one ``init_process_group``
made); it carries short texts, only on first uses and failures.

Tensors that must match. ``compare_tensors`` gathers every rank's :class:`TensorReport` (dtype,
local shape, the global shape it inferred, a digest of its target) in one small all_gather, so
that ``distribute`` and ``from_local(run_check=True)`` see at once which rank differs.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from .env import read as read_environment
from .layout import LayoutError

__all__ = ["DEFAULT_TIMEOUT_S", "PeerError", "RankDisagreementError", "agree", "agree_in_group", "agreements_made",
           "announce_failure", "choose_timeout", "collective_timeout_s", "is_peer_failure", "peer_error",
           "rank_listing", "MAX_DIMS", "TensorReport", "compare_tensors", "gather_texts", "tensor_report",
           "together"]

DEFAULT_TIMEOUT_S = 600.0
_CHOSEN: list[float] = []           # the timeout init_mesh was given: it wins over the variable
_SEQUENCE: dict[tuple, int] = {}    # rank set -> agreement checks so far (the same count on every member)
_READ: dict[tuple, int] = {}        # rank set -> the last check this rank read every member's text of
_FAILURES = [0]                     # collective failures on this rank: each has its own report keys
# Texts a failure of a peer's collective may carry: gloo's timeout and closed-connection errors
# (plain RuntimeErrors), and torch's own DistError family (NCCL with blocking wait, the store).
_PEER_SIGNS = ("Timed out", "timed out", "Connection closed", "Connection reset", "connection closed",
               "Broken pipe", "gloo", "NCCL")


class RankDisagreementError(LayoutError):
    """Ranks that must agree (a redistribute's target, a from_local's shapes, a GEMM's rows) do
    not; raised on every rank with each rank's value."""


class PeerError(RuntimeError):
    """A collective or an agreement check could not complete because peer ranks did not take
    part in time: they stalled, raised elsewhere, or exited. Names the collective and the ranks."""


# -- the collective timeout ----------------------------------------------------------------------


def choose_timeout(seconds: float | None) -> float:
    """Record ``init_mesh(timeout_s=...)`` (None: keep the current choice); the timeout in force."""
    if seconds is not None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
            raise ValueError(f"timeout_s must be seconds > 0, got {seconds!r}")
        _CHOSEN[:] = [float(seconds)]
    return collective_timeout_s()


def collective_timeout_s() -> float:
    """How long a host collective or an agreement check waits for its peers: ``init_mesh``'s
    ``timeout_s`` if given, else ``AXEDIST_COLLECTIVE_TIMEOUT_S``, else the job's own (the timeout
    ``init_process_group`` got, which its store keeps), else 600 s."""
    if _CHOSEN:
        return _CHOSEN[0]
    seconds = read_environment("AXEDIST_COLLECTIVE_TIMEOUT_S")
    if seconds is not None:
        return seconds
    store = _store()
    if store is not None:
        try:
            return store.timeout.total_seconds()
        except (AttributeError, RuntimeError):
            pass
    return DEFAULT_TIMEOUT_S


def _store():
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()


# -- agreement -----------------------------------------------------------------------------------


def _tag(ranks: tuple[int, ...]) -> str:
    return hashlib.blake2b(repr(ranks).encode(), digest_size=6).hexdigest()


def agree(ranks: Sequence[int], what: str, text: str, *, failed: BaseException | None = None) -> None:
    """Every rank of ``ranks`` calls this at the same point of its program with its ``text``;
    returns when all texts are equal, else raises ``RankDisagreementError`` on every rank. The
    ranks meet as a set; the order given is part of the text (a mesh built with its ranks in
    another order on one rank is a disagreement, not a wait for a check no peer joins).

    ``failed``: this rank could not even form its text (a target invalid here only): it posts
    the error, so the others raise at once, and returns without waiting. A rank that does not
    post within ``collective_timeout_s()`` makes the others raise ``PeerError`` naming it.
    """
    order = tuple(ranks)
    ranks = tuple(sorted(order))  # the rank set: ranks that list it in other orders still meet
    store = _store()
    if len(ranks) <= 1 or store is None:
        return
    me = dist.get_rank()
    count = _SEQUENCE.get(ranks, 0) + 1
    _SEQUENCE[ranks] = count
    prefix = f"axedist/agree/{_tag(ranks)}/"
    mine = text if failed is None else f"raised {type(failed).__name__}: {failed}"
    if order != ranks:  # (a mesh whose ranks one rank lists in another order differs there)
        mine = f"{mine} [ranks in the order {list(order)}]"
    store.set(f"{prefix}{count}/{me}", f"{what}: {mine}")
    if failed is None and count > 2 and _READ.get(ranks) == count - 1:
        # every member posted check count - 1 (this rank read them all), so every member was done
        # reading check count - 2: this rank's text there is no longer needed. After a check this
        # rank only posted (it failed), a peer may still be reading: the text stays.
        store.delete_key(f"{prefix}{count - 2}/{me}")
    if failed is not None:
        announce_failure(what, failed)
        return
    keys = [f"{prefix}{count}/{r}" for r in ranks]
    timeout = collective_timeout_s()
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except RuntimeError:  # DistStoreError: some rank never posted
        raise peer_error(f"the agreement check of {what} ({text})", ranks,
                         TimeoutError(f"no answer within {timeout:g} s")) from None
    texts = [value.decode() for value in store.multi_get(keys)]
    _READ[ranks] = count
    if len(set(texts)) > 1:
        own = f"{what}: "  # a rank at another check point shows which one
        shown = [t[len(own):] if t.startswith(own) else f"(at another check) {t}" for t in texts]
        raise RankDisagreementError(f"ranks disagree on {what}:\n" + rank_listing(dict(zip(ranks, shown))))


def agreements_made() -> int:
    """How many agreement checks this rank has joined so far, over every rank set: the same
    count on every rank of a job whose ranks ran the same program (checks are collective), and
    unchanged while a compiled graph runs (its checks ran once, when it was traced)."""
    return sum(_SEQUENCE.values())


def agree_in_group(group, what: str, text: str) -> None:
    """``agree`` over the members of a process group (None: the default group); nothing to do
    without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        agree(dist.get_process_group_ranks(group or dist.group.WORLD), what, text)


def rank_listing(texts: dict[int, str]) -> str:
    """``  rank 0: a`` / ``  ranks 1, 2: b``: ranks with equal texts on one line."""
    by_text: dict[str, list[int]] = {}
    for rank, text in sorted(texts.items()):
        by_text.setdefault(text, []).append(rank)
    return "\n".join(f"  {'ranks' if len(r) > 1 else 'rank'} {', '.join(map(str, r))}: {t}" for t, r in by_text.items())


def announce_failure(what: str, error: BaseException) -> None:
    """Post that this rank raised ``error`` in ``what`` (so a peer left waiting can say why)."""
    store = _store()
    if store is None:
        return
    try:
        store.set(f"axedist/failed/{dist.get_rank()}", f"raised {type(error).__name__} in {what}: {error}"[:2000])
    except RuntimeError:
        pass  # the store is gone too: nothing to tell


# -- tensors every rank describes ----------------------------------------------------------------

MAX_DIMS = 8  # dims a report carries (the most a DTensor has)
# a report's dtype code is the index here (-1: a dtype not listed)
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)


@dataclass(frozen=True)
class TensorReport:
    """What one rank says of its tensor: ``TensorReport(True, torch.float32, (2, 3), (4, 3), 0)``
    is a rank whose ``(2, 3)`` float32 local tensor it could use, whose global shape it inferred
    as ``(4, 3)``, with no target text. ``dtype`` None: a dtype the exchange has no code for (or
    more than ``MAX_DIMS`` dims, which also reads as not ``ok``)."""

    ok: bool
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    inferred: tuple[int, ...] = ()  # the global shape this rank inferred (padded: zeros dropped)
    digest: int = 0  # 64 bits of the rank's target text

    def local_text(self) -> str:
        """``(2, 3) torch.float32``."""
        return f"{self.shape} {self.dtype if self.dtype is not None else 'an unsupported dtype'}"

    def words(self) -> list[int]:
        """``[ok, dtype code, dims, *shape, 0..., *inferred, 0..., digest]``: what is sent."""
        code = _DTYPES.index(self.dtype) if self.dtype is not None else -1
        return [int(self.ok), code, len(self.shape), *_padded(self.shape), *_padded(self.inferred), self.digest]

    @staticmethod
    def from_words(words: list[int]) -> "TensorReport":
        dims = words[2]
        inferred = tuple(v for v in words[3 + MAX_DIMS:3 + 2 * MAX_DIMS] if v)
        return TensorReport(bool(words[0]), _DTYPES[words[1]] if words[1] >= 0 else None,
                            tuple(words[3:3 + dims]), inferred, words[-1])


def _padded(shape) -> list[int]:
    return [*shape, *([0] * (MAX_DIMS - len(shape)))]


def tensor_report(tensor: torch.Tensor, ok: bool = True, inferred: Sequence[int] = (),
                  text: str | None = None) -> TensorReport:
    """This rank's report of ``tensor`` (``text``: its target, sent as a 64-bit digest)."""
    digest = 0 if text is None else int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little",
                                                   signed=True)
    if tensor.dim() > MAX_DIMS:
        return TensorReport(False, None, (), tuple(inferred), digest)
    dtype = tensor.dtype if tensor.dtype in _DTYPES else None
    return TensorReport(bool(ok), dtype, tuple(tensor.shape), tuple(inferred), digest)


def together(what: str, ranks: Sequence[int], call):
    """``call()``, a collective over ``ranks``; a peer's failure in it (timeout, lost connection)
    is raised as the ``PeerError`` naming ``what`` and the peers that did not arrive."""
    try:
        return call()
    except RuntimeError as error:
        if not is_peer_failure(error):
            raise
        raise peer_error(what, ranks, error) from error


def compare_tensors(report: TensorReport, *, group, ranks: Sequence[int], device, what: str) -> dict[int, TensorReport]:
    """``{global rank: its report}`` for every rank of ``group`` (global ``ranks``), by one small
    all_gather on ``device``; every rank calls it. A peer that does not take part makes it raise
    ``PeerError`` naming ``what`` (the collective: "distribute's check of every rank's tensor ...")."""
    mine = torch.tensor(report.words(), dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in ranks]
    together(what, ranks, lambda: dist.all_gather(rows, mine, group=group))
    return {rank: TensorReport.from_words(r.tolist()) for rank, r in zip(sorted(ranks), rows)}


def gather_texts(group, ranks: Sequence[int], text: str) -> dict[int, str]:
    """``{global rank: text}`` (every rank calls it: only after reports showed a rank differs)."""
    texts = [None] * len(ranks)
    dist.all_gather_object(texts, text, group=group)
    return dict(zip(sorted(ranks), texts))


# -- peers that did not arrive -------------------------------------------------------------------


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` from a collective looks like a peer's failure (timeout, lost connection)."""
    if isinstance(error, PeerError):  # named already
        return False
    if dist.is_available() and isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(sign in str(error) for sign in _PEER_SIGNS)


def peer_error(what: str, ranks: Sequence[int], cause: BaseException) -> PeerError:
    """The ``PeerError`` for ``what`` (a collective over ``ranks``) that failed with ``cause``.

    This rank posts where it was stuck and waits up to ``min(5 s, timeout / 2)`` for the other
    ranks' posts; those that post none "did not arrive" (with the error one of them announced)."""
    me = dist.get_rank()
    _FAILURES[0] += 1
    timeout = collective_timeout_s()
    grace = min(5.0, timeout / 2)
    stuck, failed, trouble = {}, {}, None
    others = [r for r in ranks if r != me]
    try:
        store = _store()
        key = f"axedist/stuck/{_FAILURES[0]}/"
        store.set(f"{key}{me}", what[:2000])
        deadline = time.monotonic() + grace
        while True:
            for r in others:
                if r not in stuck and store.check([f"{key}{r}"]):
                    stuck[r] = store.get(f"{key}{r}").decode()
            if len(stuck) == len(others) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for r in others:
            if r not in stuck and store.check([f"axedist/failed/{r}"]):
                failed[r] = store.get(f"axedist/failed/{r}").decode()
    except Exception as error:  # the store may be gone with the peer that hosted it
        trouble = error
    missing = [r for r in others if r not in stuck]
    # the cause's first sentence, without gloo's source-file prefix
    cause_text = re.sub(r"^\[[^\]]*\]\s*", "", str(cause).strip().split("\n")[0])
    cause_text = re.split(r"(?<=\.)\s", cause_text)[0].rstrip(".")[:300] or type(cause).__name__
    lines = [f"{what} did not complete on rank {me}: {cause_text}"]
    if trouble is not None:
        lines.append(f"(could not ask the job's store which ranks arrived: {str(trouble).splitlines()[0][:200]})")
    elif missing:
        names = ", ".join(map(str, missing))
        why = "; ".join(f"rank {r} {failed[r]}" for r in missing if r in failed)
        lines.append(f"{'Ranks' if len(missing) > 1 else 'Rank'} {names} did not arrive ("
                     + (why if why else f"no report within {grace:.1f} s: stalled, busy elsewhere or exited") + ")")
    elif all(text == what for text in stuck.values()):
        lines.append("Every peer reported it was stuck in this call too (a connection lost mid-call?)")
    else:
        lines.append("Every rank reported, but not from this call: the ranks took different paths (a rank "
                     "re-ran a checked move while another started a new one?)")
    if stuck:
        lines.append("Stuck too: " + "; ".join(f"rank {r} in {text}" for r, text in sorted(stuck.items())))
    lines.append(f"Collective timeout {timeout:g} s (init_mesh(timeout_s=...) or AXEDIST_COLLECTIVE_TIMEOUT_S)")
    return PeerError(". ".join(lines[:1]) + ".\n" + "\n".join(lines[1:]))
