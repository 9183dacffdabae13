"""`execute_notebook` shuts down the kernel it started: a test run executes the chapters several times over,
and kernels left running held 11.5 GB on the 24 GiB CI machine until the run was OOM-killed (2026-12-01)."""
import os

import nbformat

from nanovllm_course.release import execute_notebook


def _kernel_children() -> list[int]:
    me, found = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == me and b"ipykernel" in cmd:
            found.append(int(pid))
    return found


def test_execute_notebook_leaves_no_kernel_running(tmp_path):
    before = set(_kernel_children())
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 6 * 7\nprint(x)")])
    done, errors = execute_notebook(nb, tmp_path, timeout=60)
    assert errors == [] and done.cells[0].outputs[0]["text"] == "42\n"
    assert set(_kernel_children()) - before == set()
