#!/usr/bin/env python
"""Report: the largest |ours - reference| the loss parity tests saw, per (reference, quantity).

    python benchmarks/loss_errors.py                 # Liger 0.8.5 (+ TRL 1.13 if importable) and the core checks
    PYTHONPATH=.cache/trl/1.13.0 python benchmarks/loss_errors.py -k trl113   # against TRL 1.13's trl.losses

Runs tests/test_losses_parity.py (extra arguments go to pytest) and prints the errors that its ``_compare``
recorded.  The tests themselves assert the tolerances (1e-5 in fp32, see that file's docstring); this only shows
how much room is left.  (Formerly the always-passing ``test_zz_report_max_errors``.)
"""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Report:
    def pytest_sessionfinish(self, session, exitstatus):
        mod = sys.modules.get("test_losses_parity")
        errors = getattr(mod, "MAX_ERR", {})
        print("\nmax abs error per (reference, quantity):")
        for (tag, name), err in sorted(errors.items()):
            print(f"  {tag:22s} {name:22s} {err:.3g}")


def main() -> int:
    args = ["-q", "-p", "no:cacheprovider", os.path.join(ROOT, "tests", "test_losses_parity.py"), *sys.argv[1:]]
    return int(pytest.main(args, plugins=[_Report()]))


if __name__ == "__main__":
    sys.exit(main())
