"""A transcript's cell count is the one the page shows: the count in the kernel's execute_reply (a real
ipykernel; IPython 9 advances its own ``execution_count`` before a cell runs). A page that ran a cell
tells its own run from another page's by this count."""

from __future__ import annotations

from jupyter_client.manager import start_new_kernel


def test_the_count_a_cell_records_is_its_execute_reply_count():
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        recorded = []
        for _ in range(3):
            reply = kc.execute_interactive(
                "from nbdist.cells.pointers import this_kernel\nprint('COUNT', this_kernel()[1]['count'])",
                timeout=60,
                output_hook=lambda msg: recorded.append(msg["content"].get("text", "")),
            )
            printed = int("".join(recorded).split()[-1])
            assert printed == reply["content"]["execution_count"], (printed, reply["content"])
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
