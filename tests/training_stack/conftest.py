"""Training-stack tests import their shared pieces from tests/training_stack/training_common.py (`from training_common import ...`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
