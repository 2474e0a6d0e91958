"""Every benchmark notebook runs end to end in its QUICK=1 version: any cell that raises fails the test."""

from __future__ import annotations

import pytest

from common.notebooks import NOTEBOOKS, execute


@pytest.mark.parametrize("name", sorted(path.name for path in NOTEBOOKS.glob("*.ipynb")))
def test_notebook_runs_quick(name):
    notebook = execute(NOTEBOOKS / name, quick=True, timeout_s=600)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.execution_count for cell in code)  # every code cell ran
    assert not [out for cell in code for out in cell.outputs if out.output_type == "error"]
