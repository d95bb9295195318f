"""Every tutorial runs end to end at the small test shapes (they assert their own numerics)."""

import importlib.util
from pathlib import Path

import pytest

TUTORIALS = sorted((Path(__file__).parent.parent / "tutorials").glob("*.py"))


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"tutorial_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_there_are_tutorials():
    assert TUTORIALS


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_runs(path):
    result = _load(path).main(size="small", repeat=1)
    assert result
