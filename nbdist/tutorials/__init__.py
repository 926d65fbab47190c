"""The tutorial notebooks, shipped in the wheel: ``python -m nbdist.tutorials DEST`` writes them into DEST.

In the wheel they live beside this file (``notebooks/``, copied in at build time from the
repository's ``notebooks/``); in a checkout (an editable install) they are read from the
repository itself. DEST keeps a manifest (``MANIFEST``: each file's hash as written), so a
second ``copy`` updates the files the user left alone and refuses, naming them, to overwrite
the ones the user edited unless ``force``.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from dataclasses import dataclass, field

from ..errors import ConfigError

MANIFEST = ".nbdist-tutorials.json"
HERE = pathlib.Path(__file__).resolve().parent


def source() -> pathlib.Path:
    """Where the notebooks are: in the package (a wheel), or in the checkout it was installed from."""
    for folder in (HERE / "notebooks", HERE.parents[1] / "notebooks"):
        if any(folder.glob("*.ipynb")):
            return folder
    raise ConfigError(
        f"no tutorial notebooks found beside {HERE}; reinstall nbdist (pip install --force-reinstall nbdist)."
    )


@dataclass
class Copied:
    dest: pathlib.Path
    written: list[str] = field(default_factory=list)  # new, or updated because the user had not changed them
    unchanged: list[str] = field(default_factory=list)


def copy(dest: str | pathlib.Path, force: bool = False) -> Copied:
    """Write the notebooks (and their README) into dest; ConfigError, before writing anything, when a
    file there differs from what nbdist last wrote (the user edited it) and ``force`` is not given."""
    target = pathlib.Path(dest).expanduser()
    if target.exists() and not target.is_dir():
        raise ConfigError(
            f"{target} is a file; name a folder for the notebooks, e.g. python -m nbdist.tutorials ~/nbdist-tutorials."
        )
    files = sorted(p for p in source().iterdir() if p.suffix in (".ipynb", ".md"))
    manifest_path = target / MANIFEST
    written_before = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    done = Copied(target)
    edited = []
    for src in files:
        there = target / src.name
        if not there.exists():
            continue
        now = _digest(there.read_bytes())
        if now == _digest(src.read_bytes()):
            done.unchanged.append(src.name)
        elif now != written_before.get(src.name) and not force:
            edited.append(src.name)
    if edited:
        raise ConfigError(
            f"{', '.join(edited)} in {target} differ from the notebooks nbdist wrote there (your edits?); "
            "copy them elsewhere first, or pass --force to replace them."
        )
    target.mkdir(parents=True, exist_ok=True)
    for src in files:
        if src.name in done.unchanged:
            continue
        (target / src.name).write_bytes(src.read_bytes())
        done.written.append(src.name)
    manifest = {**written_before, **{src.name: _digest(src.read_bytes()) for src in files}}
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return done


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
