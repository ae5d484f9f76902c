"""The README's examples run as written."""
import runpy
from pathlib import Path


def test_seed_readme_example_runs(capsys):
    runpy.run_path(str(Path(__file__).parents[1] / "examples" / "seed_readme.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "y (64, 4096), dW (" in out
