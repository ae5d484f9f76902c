"""The README's examples run as written."""
import runpy
from pathlib import Path


def _run_readme_block(start: str, end: str | None = None, cuda_to_cpu: bool = False) -> None:
    """Runs the first ```python block after ``start`` (and before ``end``) in the README."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    section = text[text.index(start):text.index(end) if end else None]
    code = section[section.index("```python") + len("```python"):]
    code = code[:code.index("```")]
    if cuda_to_cpu:
        code = code.replace('"cuda"', '"cpu"').replace(".cuda()", "")
    exec(compile(code, "README.md", "exec"), {})


def test_seed_readme_example_runs(capsys):
    runpy.run_path(str(Path(__file__).parents[1] / "examples" / "seed_readme.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "y (64, 4096), dW (" in out


def test_readme_op_library_example_runs():
    """The op-library block of the README runs as written (on CPU)."""
    _run_readme_block("## The op library", "### Which ops have kernels")


def test_readme_compile_example_runs(capsys):
    """The torch.compile block of the README, with the device changed to the CPU: no graph break."""
    _run_readme_block("## torch.compile, custom ops", "### Measured (benchmarks/eager.md", cuda_to_cpu=True)
    assert capsys.readouterr().out.split()[-1] == "0"


def test_readme_attention_layout_example_runs(capsys):
    _run_readme_block("**Attention layouts**")
    assert capsys.readouterr().out.strip() == "(64, 64) 0.266"


def test_readme_attention_example_runs(capsys):
    _run_readme_block("### Block-sparse attention: `BlocksparseTransformer`")
    assert capsys.readouterr().out.strip() == "True"


def test_readme_conv_example_runs():
    _run_readme_block("### Block-sparse convolution: `bstrain.ops.conv`")
