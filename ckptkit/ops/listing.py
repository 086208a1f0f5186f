"""Report models for CLI JSON output that are not owned by another module (their schemas are published)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from ..io.catalog import Listing


class ListedCheckpoint(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    step: int | None


class Leftover(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    reason: str


class ListingReport(BaseModel):
    """What ``ckptkit ls --json`` prints."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    root: str
    latest: str
    checkpoints: list[ListedCheckpoint]
    leftovers: list[Leftover]


def listing_report(listing: Listing) -> ListingReport:
    return ListingReport(
        root=listing.root,
        latest=listing.latest,
        checkpoints=[ListedCheckpoint(name=e.name, step=e.step) for e in listing.checkpoints],
        leftovers=[Leftover(name=e.name, reason=e.reason) for e in listing.leftovers],
    )
