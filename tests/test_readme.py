"""Each of the README's Python snippets runs on its own (a fresh process with 8 virtual CPU
devices) and gives the reference's answer."""

import pathlib
import re
import subprocess
import sys

import pytest
from helpers import cpu_env

README = pathlib.Path(__file__).parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)

#: Run after a snippet, in its namespace: checks of what it computed, where it has that name.
CHECKS = """
import numpy as np
g = globals()
if "y" in g:
    np.testing.assert_allclose(np.asarray(y), np.ones((4096, 1024)) @ np.ones((1024, 2048)))
if "f" in g:
    rng = np.random.default_rng(0)
    x, w1, w2 = (rng.standard_normal(s).astype(np.float32) for s in [(64, 16), (16, 32), (32, 16)])
    h = x.astype(np.float64) @ w1
    gelu = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
    np.testing.assert_allclose(np.asarray(f(x, w1, w2)), gelu @ w2, rtol=1e-4, atol=1e-4)
if "grads" in g:
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(grads))
print("snippet ok")
"""


def test_readme_has_snippets():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_snippet_runs_alone(index):
    env = cpu_env(8)
    done = subprocess.run(
        [sys.executable, "-c", BLOCKS[index] + CHECKS],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=README.parent,
    )
    assert done.returncode == 0 and "snippet ok" in done.stdout, done.stderr[-3000:]
