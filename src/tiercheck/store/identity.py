"""Store identity: which store owns a tier, and what an open does when a tier names another.

A store has an id, drawn when its ``tiercheck.toml`` is first written (``store_id``), and
the file records the root it was last opened at (``root``). Every tier the store owns
records the owner in its own way (formats/SPEC.md, "Store identity"): the shm segment's
``owner.json``, the key ``tiercheck.owner`` of an LMDB environment, the claims
``owner/<seq>.json`` under an fsspec prefix. A writable open records itself with an atomic
compare-and-swap (:meth:`~tiercheck.backends.base.Tier.claim_owner`, :func:`claim`): of
two stores opened at the same moment on one tier, one owns it and the other finds it
``foreign``. Opening the store compares each record with the store (:func:`relation`):

- ``own``: the record names this store at this root;
- ``unowned``: no record yet (a new tier, or one written before tiers had owners): a
  writable open records this store, unless the tier lies inside another store's root;
- ``moved``: this store's id at another root that no longer holds this store: the root
  was moved; a writable open records the new root;
- ``copy``: this store's id at another root that still holds a store with this id: the
  root was copied (``cp -r``, or its ``tiercheck.toml`` copied to a new root). A writable
  open raises :class:`~tiercheck.errors.StoreCopied`; a read-only one reads;
  ``tiercheck adopt ROOT`` (:func:`tiercheck.store.lifecycle.adopt_store`) makes the copy a
  store of its own;
- ``foreign``: another store's id: :class:`~tiercheck.errors.ForeignTier`, naming both
  roots, when writing; the tier is unavailable to a read-only open. Two stores never read
  each other's versions.

A store whose root lost its ``tiercheck.toml`` (the node that held it was replaced, or
the root was wiped) draws a new id when it is opened again at the same root. Its tiers
that survived (a shared remote, a peer daemon) still record the old id *at this root*: a
writable open then takes that id back (:func:`recreated_id`) instead of refusing its own
tiers as another store's. Only the same root counts, and only one recorded id: a copy or
a move is at another root, and two ids at one root cannot be told apart.

A tier declared shared by stores (option ``shared_by_stores = true``) is opened in a
namespace of this store's own (:func:`namespaced`): a segment, an LMDB environment or a
prefix named after the store id, which this store then owns as above.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlsplit

from tiercheck.backends.base import StoreOwner, Tier
from tiercheck.errors import ConfigError, ForeignTier, StoreCopied, TierError
from tiercheck.store.config import (
    CONFIG_NAME,
    TierSpec,
    expand_root,
    load_config,
    new_store_id,
    read_store_id,
    relative_defaults,
    rewrite_store_file,
    without_userinfo,
)

__all__ = [
    "SHARED_OPTION",
    "Relation",
    "local_path",
    "namespaced",
    "open_identity",
    "recreated_id",
    "relation",
    "resolve_spec",
    "store_at",
    "take_back_id",
]

log = logging.getLogger("tiercheck")

SHARED_OPTION = "shared_by_stores"

Relation = Literal["own", "unowned", "moved", "copy", "foreign"]


def _same_path(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def store_at(root: str | os.PathLike[str]) -> str | None:
    """The id of the store at ``root`` (None: no store there, or one without an id)."""
    return read_store_id(Path(root) / CONFIG_NAME)


def relation(owner: StoreOwner | None, store_id: str, root: Path) -> Relation:
    """How the tier whose owner record is ``owner`` stands to the store ``store_id`` at
    ``root`` (module docstring)."""
    if owner is None or (owner.store_id is None and owner.root is None):
        return "unowned"
    if owner.store_id is None:
        # written before stores had ids: the record names a root only
        assert owner.root is not None
        if _same_path(owner.root, root):
            return "own"
        return "moved" if not (Path(owner.root) / CONFIG_NAME).exists() else "foreign"
    if owner.store_id != store_id:
        return "foreign"
    if owner.root is None or _same_path(owner.root, root):
        return "own"
    return "copy" if store_at(owner.root) == store_id else "moved"


def recreated_id(owners: Iterable[StoreOwner | None], store_id: str, root: Path) -> str | None:
    """The id the store at ``root`` had before its file was lost: the one other id that
    ``owners`` (the records of the store's tiers) record at this very root; None if they
    record none, or more than one."""
    ids = {
        o.store_id
        for o in owners
        if o is not None
        and o.store_id is not None
        and o.store_id != store_id
        and o.root is not None
        and _same_path(o.root, root)
    }
    return ids.pop() if len(ids) == 1 else None


def take_back_id(root: Path, old_id: str, new_id: str) -> str:
    """Give the store file at ``root`` its lost id ``old_id`` back in place of ``new_id``,
    the id it drew when it was made again; returns the file's id afterwards (another
    process of the store may have done it first)."""
    log.warning(
        "store %s: its tiers record it as store %s, at this root; its file was made again "
        "(the node or disk that held it was lost) with the new id %s: it takes %s back",
        root,
        old_id,
        new_id,
        old_id,
    )
    found = rewrite_store_file(root / CONFIG_NAME, store_id=old_id)
    return found or old_id


def open_identity(root: Path, *, read_only: bool) -> str | None:
    """The id of the store at ``root``, checked against the root its file records.

    A writable open gives a file without an id (written before stores had ids) one, and
    records the new root of a moved store; it raises ``StoreCopied`` when the file records
    another root that still holds a store with the same id. None: no file, or a read-only
    open of a file without an id.
    """
    path = root / CONFIG_NAME
    if not path.exists():
        return None
    config = load_config(path)
    store_id = config.store_id
    if store_id is None:
        if read_only:
            return None
        adopted = rewrite_store_file(
            path,
            store_id=new_store_id(),
            root=str(root),
            urls=relative_defaults(config.tiers, root),
            only_without_id=True,
        )
        log.info("store %s has no id (written by an older tiercheck): it is now %s", root, adopted)
        return adopted
    recorded = config.recorded_root
    if recorded is not None and _same_path(recorded, root):
        return store_id
    if recorded is not None and store_at(recorded) == store_id:
        if not read_only:
            raise StoreCopied(
                f"{root} is a copy of the store at {recorded} (same store id {store_id}, "
                f"and {recorded} is still there): writing here would write into that store's "
                f"tiers. Open it with read_only=True, or run `tiercheck adopt {root}` to make "
                "it a store of its own",
                tier=str(path),
                owner_root=recorded,
                root=str(root),
            )
        return store_id
    if not read_only:
        if recorded is not None:
            log.info("store %s was moved from %s", root, recorded)
        rewrite_store_file(path, root=str(root))
    return store_id


def namespaced(spec: TierSpec, store_id: str) -> TierSpec:
    """The spec of this store's own namespace in a tier shared by stores: ``shm://NAME``
    becomes ``shm://NAME.ID16``, ``lmdb:///PATH`` ``lmdb:///PATH/stores/ID`` and an fsspec
    URL gets ``/stores/ID`` after its path. ``ConfigError`` for other tiers."""
    options = {k: v for k, v in spec.options.items() if k != SHARED_OPTION}
    url = spec.url
    if url.startswith("shm://"):
        return TierSpec(spec.name, f"{url.rstrip('/')}.{store_id[:16]}", options)
    if url.startswith(("peer://", "memory://", "collective://")) or "://" not in url:
        raise ConfigError(
            f"tier {spec.name} ({_shown(spec)}) cannot be shared by stores: shm, LMDB and "
            "fsspec tiers keep a namespace per store (a peer daemon keeps one per token)"
        )
    parts = urlsplit(url)
    path = f"{parts.path.rstrip('/')}/stores/{store_id}"
    rebuilt = f"{parts.scheme}://{parts.netloc}{path}"  # urlunsplit drops an empty host's //
    rebuilt += f"?{parts.query}" if parts.query else ""
    rebuilt += f"#{parts.fragment}" if parts.fragment else ""
    return TierSpec(spec.name, rebuilt, options)


def resolve_spec(spec: TierSpec, root: Path | None, store_id: str | None) -> TierSpec:
    """``spec`` as this store opens it: ``{root}`` filled in, and a tier shared by stores
    narrowed to this store's namespace. ``ConfigError`` for a shared tier of a store
    without an id (an older store opened read-only: open it for writing once)."""
    if root is not None:
        spec = expand_root(spec, root)
    if not spec.options.get(SHARED_OPTION):
        if SHARED_OPTION in spec.options:
            return TierSpec(
                spec.name, spec.url, {k: v for k, v in spec.options.items() if k != SHARED_OPTION}
            )
        return spec
    if store_id is None:
        raise ConfigError(
            f"tier {spec.name} is shared by stores, and this store has no id yet (it was "
            "written by an older tiercheck): open it for writing once to give it one"
        )
    return namespaced(spec, store_id)


def local_path(url: str) -> str | None:
    """The directory of a local tier (``lmdb://``, ``file://``), else None."""
    if url.startswith(("lmdb://", "file://")):
        path = unquote(urlsplit(url).path)
        return path if path.startswith("/") else None
    return None


def _enclosing_store(path: str) -> Path | None:
    """The nearest directory above ``path`` that holds a store file."""
    here = Path(os.path.realpath(path))
    for parent in here.parents:
        if (parent / CONFIG_NAME).is_file():
            return parent
    return None


_CLAIM_ROUNDS = 16


def claim(
    tier: Tier,
    spec: TierSpec,
    store_id: str,
    root: Path,
    *,
    read_only: bool,
    owner: StoreOwner | Literal["unread"] | None = "unread",
) -> None:
    """Check the owner record of ``tier`` (opened from ``spec``; ``owner``, if it was read
    already) against this store and, when writing, record this store in it. Raises
    ``ForeignTier`` / ``StoreCopied`` (module docstring).

    The record is written with :meth:`~tiercheck.backends.base.Tier.claim_owner`, a
    compare-and-swap against the record judged: when another store's open changed it in
    between (two stores opened at the same moment on one new tier), this claim loses,
    writes nothing, and the record that won is judged in turn, so exactly one of them
    owns the tier and the other gets ``ForeignTier``."""
    if owner == "unread":
        owner = tier.read_owner()
    mine = StoreOwner(store_id, str(root), socket.gethostname())
    for _ in range(_CLAIM_ROUNDS):
        if not _needs_record(owner, spec, store_id, root, read_only=read_only):
            return
        won = tier.claim_owner(mine, replacing=owner)
        if won == mine:
            return
        owner = won
    raise TierError(
        f"tier {spec.name} ({_shown(spec)}): its owner record changed {_CLAIM_ROUNDS} times while "
        f"the store at {root} claimed it (other stores are claiming it at the same moment): "
        "open the store again",
        url=_shown(spec),
    )


def _needs_record(
    owner: StoreOwner | None, spec: TierSpec, store_id: str, root: Path, *, read_only: bool
) -> bool:
    """Judge the record ``owner`` of the tier opened from ``spec``: raise for a copy or a
    foreign tier, True if a writable open must record this store."""
    verdict = relation(owner, store_id, root)
    if verdict == "unowned":
        local = local_path(spec.url)
        other = _enclosing_store(local) if local is not None else None
        if other is not None and not _same_path(other, root):
            verdict = "copy" if store_at(other) == store_id else "foreign"
            owner = StoreOwner(store_at(other), str(other), None)
    if verdict == "copy" and not read_only:
        assert owner is not None
        raise StoreCopied(
            f"tier {spec.name} ({_shown(spec)}) belongs to the store at {owner.root}, of which "
            f"{root} is a copy (same store id {store_id}): open {root} with read_only=True, "
            f"or run `tiercheck adopt {root}` to make it a store of its own",
            tier=_shown(spec),
            owner_root=owner.root or "",
            root=str(root),
        )
    if verdict == "foreign":
        assert owner is not None
        raise ForeignTier(
            f"tier {spec.name} ({_shown(spec)}) is owned by another store "
            f"({owner.store_id or 'no id'} at {owner.root}"
            f"{' on ' + owner.host if owner.host else ''}), not by the store at {root}: give "
            "this store a tier of its own, or declare the tier shared "
            f"({SHARED_OPTION} = true) so that each store keeps its own namespace in it",
            tier=_shown(spec),
            owner_root=owner.root or "",
            root=str(root),
        )
    if read_only or verdict == "copy":
        return False
    if verdict == "own" and owner is not None and owner.store_id == store_id:
        return False
    if verdict == "moved" and owner is not None:
        log.info("tier %s: its store moved from %s to %s", spec.name, owner.root, root)
    return True


def _shown(spec: TierSpec) -> str:
    """``spec``'s URL as an error shows it: without the credentials it may hold."""
    return without_userinfo(spec.url)
