"""tests/e2e: real processes on loopback. The kmock helpers live with the operator tests."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
