"""The example third-party tier of docs/writing-a-tier.md passes the conformance suite."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from example_tier import SqliteTier  # registers sqlite:// on import

from tiercheck.backends.base import Tier
from tiercheck.backends.registry import available_schemes, open_tier
from tiercheck.errors import InvalidURL, TierError
from tiercheck.testing.conformance import TierConformance, blob

_DOC = Path(__file__).resolve().parents[2] / "docs" / "writing-a-tier.md"


class TestSqliteTier(TierConformance):
    def make_tier(self, tmp_path: Path) -> Tier:
        return open_tier(f"sqlite://{tmp_path}/tier.db")


def test_registered_by_scheme(tmp_path: Path) -> None:
    assert "sqlite" in available_schemes()
    tier = open_tier(f"sqlite://{tmp_path}/x.db")
    assert isinstance(tier, SqliteTier)
    assert tier.capabilities.atomic_batch
    tier.close()


def test_append_is_one_transaction(tmp_path: Path) -> None:
    # A record the database refuses takes its blobs down with it.
    tier = open_tier(f"sqlite://{tmp_path}/x.db")
    assert isinstance(tier, SqliteTier)
    tier._db.execute(
        "CREATE TRIGGER refuse BEFORE INSERT ON log BEGIN SELECT RAISE(ABORT, 'refused'); END"
    )
    bid, data = blob(100)
    with pytest.raises(TierError, match="refused"):
        tier.append(b"rec", blobs=[(bid, data)])
    assert tier.read_log() == [] and tier.has([bid]) == set()
    tier._db.execute("DROP TRIGGER refuse")
    tier.append(b"rec", blobs=[(bid, data)])
    assert tier.read_log() == [b"rec"] and tier.has([bid]) == {bid}
    tier.close()


@pytest.mark.parametrize("url", ["sqlite://relative.db", "sqlite:///tmp/x.db?mode=rw"])
def test_bad_urls(url: str) -> None:
    with pytest.raises(InvalidURL):
        open_tier(url)


def test_doc_shows_the_tier_in_full() -> None:
    """The guide's listing is this very file, so the guide cannot drift from what is tested."""
    source = (Path(__file__).parent / "example_tier.py").read_text()
    listings = re.findall(r"```python\n(.*?)```", _DOC.read_text(), flags=re.DOTALL)
    assert source in listings
