"""`make demo`: execute notebooks/00_quickstart.ipynb headless on 2 CPU ranks and print what each rank computed."""

from __future__ import annotations

import os
import sys
import tempfile
import time


def main() -> int:
    import nbformat
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    from .tutorials import source

    path = source() / "00_quickstart.ipynb"
    nb = nbformat.read(path, as_version=4)
    print(f"running {path.name} on 2 CPU ranks (headless)...", flush=True)
    tic = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nbdist-demo-") as sockets:
        # the kernel talks to this process over unix sockets in a private folder, not TCP (ipykernel
        # warns that TCP without CurveZMQ keys is plain text)
        km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(sockets, "kernel"))
        try:
            NotebookClient(nb, timeout=300, km=km).execute()
        except CellExecutionError as exc:
            print(f"the notebook failed: {exc}", file=sys.stderr)
            return 1
        finally:
            if km.has_kernel:  # the client shuts down only kernels it started itself
                km.shutdown_kernel()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.outputs:
            if out.output_type == "stream":
                sys.stdout.write(out.text)
            elif out.output_type == "error":
                print(f"(expected error, shown as a user sees it) {out.ename}: {out.evalue.splitlines()[0]}")
    print(f"done in {time.perf_counter() - tic:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
