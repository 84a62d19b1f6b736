"""`python -m services.frontend`: the OpenAI HTTP API and gRPC GenerateService (see server.py)."""
from __future__ import annotations

import sys

from services.frontend.server import main

if __name__ == "__main__":
    sys.exit(main())
