"""Regenerate the README coverage table from the harness: ``python tests/update_coverage.py``.
tests/test_zoo.py fails when the README table differs from what the harness produces."""
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # the same kernels the tests run
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from fxfuse.zoo import markdown  # noqa: E402
from zoo_entries import BEGIN, END, ENTRIES  # noqa: E402


def main() -> None:
    results = []
    for name, run in ENTRIES.items():
        torch._dynamo.reset()
        results.append(run())
        print(name, "passed" if results[-1].passed else "NOT passed", file=sys.stderr, flush=True)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")
    text = open(path).read()
    head, rest = text.split(BEGIN)
    tail = rest.split(END)[1]
    open(path, "w").write(f"{head}{BEGIN}\n{markdown(results)}\n{END}{tail}")


if __name__ == "__main__":
    main()
