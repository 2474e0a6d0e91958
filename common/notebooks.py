"""Run the benchmark notebooks headless, the way CI and `make notebooks` do.

    python -m common.notebooks                     # execute every notebook, save it with its outputs
    python -m common.notebooks notebooks/02_streaming.ipynb --quick   # short run, outputs not saved

The kernel runs in the repository root's ``notebooks/`` folder with this interpreter (the
``python3`` kernel that ipykernel installs is the running Python). ``--quick`` sets QUICK=1, which
the notebooks read to shrink their measurements and run a short live sweep.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"


def execute(path: Path, quick: bool, timeout_s: int = 1800) -> nbformat.NotebookNode:
    """Run every cell of the notebook at ``path``; a cell that raises raises here (CellExecutionError)."""
    notebook = nbformat.read(path, as_version=4)
    saved = os.environ.get("QUICK")
    os.environ["QUICK"] = "1" if quick else "0"  # the kernel inherits our environment
    try:
        NotebookClient(notebook, timeout=timeout_s, kernel_name="python3",
                       resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    finally:
        if saved is None:
            del os.environ["QUICK"]
        else:
            os.environ["QUICK"] = saved
    return notebook


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m common.notebooks", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", type=Path, nargs="*", help="notebooks to run (default: all of notebooks/)")
    parser.add_argument("--quick", action="store_true", help="QUICK=1: the short version; outputs are not saved")
    args = parser.parse_args()
    for path in args.paths or sorted(NOTEBOOKS.glob("*.ipynb")):
        print(f"Running {path} ...", flush=True)
        notebook = execute(path, args.quick)
        if not args.quick:
            nbformat.write(notebook, path)
            print(f"Saved {path} with its outputs")


if __name__ == "__main__":
    main()
