"""The README's examples run as written."""
import runpy
from pathlib import Path


def test_seed_readme_example_runs(capsys):
    runpy.run_path(str(Path(__file__).parents[1] / "examples" / "seed_readme.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "y (64, 4096), dW (" in out


def test_readme_op_library_example_runs():
    """The op-library block of the README runs as written (on CPU)."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    section = text[text.index("## The op library"):text.index("### Which ops have kernels")]
    code = section[section.index("```python") + len("```python"):]
    code = code[:code.index("```")]
    exec(compile(code, "README.md", "exec"), {})


def test_readme_compile_example_runs(capsys):
    """The torch.compile block of the README, with the device changed to the CPU: no graph break."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    section = text[text.index("## torch.compile, custom ops"):text.index("### Measured (benchmarks/eager.md")]
    code = section[section.index("```python") + len("```python"):]
    code = code[:code.index("```")].replace('"cuda"', '"cpu"').replace(".cuda()", "")
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.split()[-1] == "0"


def test_readme_attention_layout_example_runs(capsys):
    text = (Path(__file__).parents[1] / "README.md").read_text()
    section = text[text.index("**Attention layouts**"):]
    code = section[section.index("```python") + len("```python"):]
    code = code[:code.index("```")]
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "(64, 64) 0.266"


def test_readme_attention_example_runs(capsys):
    text = (Path(__file__).parents[1] / "README.md").read_text()
    section = text[text.index("### Block-sparse attention: `BlocksparseTransformer`"):]
    code = section[section.index("```python") + len("```python"):]
    code = code[:code.index("```")]
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "True"
