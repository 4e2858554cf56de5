"""Method.AUTO: the tune cache (`cache`), the cost model (`costmodel`), AUTO's choice at plan
time (`auto`), and the tuner that measures candidates (`tuner`, used by `commgemm tune`; it
imports the benchmark toolkit, so nothing on the runtime path imports it)."""
