"""``python -m nbdist.tutorials DEST [--force]``: write the tutorial notebooks into DEST, then say how to open them."""

from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError
from . import copy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nbdist.tutorials", description=__doc__)
    parser.add_argument("dest", help="the folder to write the notebooks into, e.g. ~/nbdist-tutorials")
    parser.add_argument("--force", action="store_true", help="replace notebooks you edited there")
    args = parser.parse_args(argv)
    try:
        done = copy(args.dest, force=args.force)
    except ConfigError as exc:
        print(f"nbdist.tutorials: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {len(done.written)} file(s) to {done.dest}"
        + (f" ({len(done.unchanged)} already up to date)" if done.unchanged else "")
    )
    print(f"open them with: jupyter lab {done.dest}   (start with 00_quickstart.ipynb)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
