import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _find_examples() -> Path | None:
    for cand in (ROOT / "shared" / "fixtures" / "lingbot-examples", ROOT.parent / "shared" / "fixtures" / "lingbot-examples"):
        if cand.is_dir():
            return cand
    return None


@pytest.fixture(scope="session")
def examples_dir() -> Path:
    d = _find_examples()
    if d is None:
        pytest.skip("lingbot-examples fixtures not found (expected ../shared/fixtures/lingbot-examples)")
    return d
