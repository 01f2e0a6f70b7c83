"""Training-stack tests import their shared pieces from this folder (`from training_common import ...`,
`from convergence import ...`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
