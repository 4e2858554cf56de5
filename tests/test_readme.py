"""The README's examples run and give the reference's answer."""

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README has python examples"
    scope: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), scope)  # noqa: S102
    ref = np.ones((4096, 1024)) @ np.ones((1024, 2048))
    np.testing.assert_allclose(np.asarray(scope["y"]), ref)
    rng = np.random.default_rng(0)
    x, w1, w2 = (rng.standard_normal(s).astype(np.float32) for s in [(64, 16), (16, 32), (32, 16)])
    h = x.astype(np.float64) @ w1
    gelu = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
    np.testing.assert_allclose(np.asarray(scope["f"](x, w1, w2)), gelu @ w2, rtol=1e-4, atol=1e-4)
