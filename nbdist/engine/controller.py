"""Start the ipyparallel controller with the kernel watched (see parentwatch)."""

from __future__ import annotations


def main() -> None:
    from nbdist.engine.parentwatch import watch_parent

    watch_parent()
    from ipyparallel.controller.app import main as controller_main

    controller_main()


if __name__ == "__main__":
    main()
