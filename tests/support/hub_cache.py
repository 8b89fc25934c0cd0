"""Lay out a Hugging Face Hub cache by hand (no network): ``models--ORG--NAME/blobs/<sha256>``,
``snapshots/<commit>/<file>`` symlinks to the blobs, ``refs/<branch or tag>`` holding the commit,
as huggingface_hub's cache layout documents."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_snapshot(cache: Path, repo_id: str, src: Path, commit: str, refs: tuple[str, ...] = ("main",),
                 skip: tuple[str, ...] = ()) -> Path:
    """Copy ``src``'s files (except ``skip``) into ``cache`` as snapshot ``commit`` (40 hex digits)
    of ``repo_id``, pointed to by ``refs``; returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if not f.is_file() or f.name in skip:
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snap / f.name
        if not link.exists():
            os.symlink(os.path.relpath(blob, snap), link)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snap
