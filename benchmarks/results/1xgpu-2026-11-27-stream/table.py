"""The GEMM-core issue's table from calls 3 (AG) and 4 (RS): `python table.py` in this folder."""

import json
import pathlib

HERE = pathlib.Path(__file__).parent
PEAK = 989.0  # H200 dense bf16 TFLOP/s

for call in ("call3", "call4"):
    for r in json.loads((HERE / call / "fused_core.json").read_text())["rows"]:
        ms = r["ms"]
        best = min(t for n, t in ms.items() if t and not n.startswith("serial"))
        cores = {n.removeprefix("core bf16 "): t for n, t in ms.items() if n.startswith("core")}
        label, core = min(cores.items(), key=lambda kv: kv[1])
        serial = min(t for n, t in ms.items() if n.startswith("serial")) / ms["xla bf16"]
        m, k, n = r["shape"]
        tflops = 2 * m * k * n / (core * 1e-3) / 1e12
        cells = [
            r["op"], r["preset"], str(r["P"]), f"{m} x {k} x {n}", f"{ms['xla bf16']:.3f}",
            f"{ms['torch bf16 (events)'] / best:.3f}",
            f"{ms['mosaic bf16 128x128x64 s4'] / best:.3f}" if "mosaic bf16 128x128x64 s4" in ms
            else "-",
            f"{cores['plan'] / best:.3f}", f"**{core / best:.3f}** ({label})",
            f"{tflops:.0f} ({tflops / PEAK:.0%})", f"{serial:.3f}",
            f"{r['rel_error']['core bf16 ' + label]:.4f}",
            min((n for n, t in ms.items() if t == best), key=len).replace(" (events)", ""),
        ]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
