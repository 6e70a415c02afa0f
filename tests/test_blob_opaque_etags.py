"""ETags are opaque. The commit protocol and the owner lease work on a store whose ETags are
not the MD5 of the bytes (a multipart upload's ``"<hash>-N"``, SSE-KMS, some S3 servers):
they compare only the store's own ETags, for equality. A catalog ETag computed from the bytes
failed every conditional replace on such a store, so no commit could land."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from fsdp_ext.checkpoint.blob import BlobChangedError, BlobInfo
from fsdp_ext.checkpoint.blob_posix import PosixBlobStore
from fsdp_ext.checkpoint.catalog import (
    CATALOG_KEY,
    commit,
    new_version_prefix,
    read_catalog,
    remove_steps,
)
from fsdp_ext.job.blob_ownership import claim_blob


class MultipartStyleETags(PosixBlobStore):
    """The POSIX store, its ETags shown as S3 shows a one-part multipart upload's."""

    def __init__(self, root: str):
        super().__init__(root)
        self._inner: dict[str, str] = {}

    def _opaque(self, etag: str) -> str:
        shown = f'"{hashlib.sha256(etag.encode()).hexdigest()[:32]}-1"'
        self._inner[shown] = etag
        return shown

    def put(self, key, data):
        return self._opaque(super().put(key, data))

    def put_if_absent(self, key, data):
        return self._opaque(super().put_if_absent(key, data))

    def replace_if(self, key, data, etag):
        if etag not in self._inner:  # an ETag this store never gave (an MD5 made elsewhere)
            raise BlobChangedError(f"{self.where(key)}: ETag {etag} is not current")
        return self._opaque(super().replace_if(key, data, self._inner[etag]))

    def head(self, key):
        info = super().head(key)
        return None if info is None else BlobInfo(info.size, self._opaque(info.etag))


@pytest.fixture
def store(tmp_path):
    return MultipartStyleETags(str(tmp_path / "loc"))


def _publish(step: int):
    def change(catalog):
        return dataclasses.replace(
            catalog, steps={**catalog.steps, step: new_version_prefix(step, 0, f"{step:08x}")}
        )

    return change


def test_commits_and_a_prune_land_on_a_store_whose_etags_are_not_md5(store):
    for step in (1, 2, 3):
        commit(store, _publish(step), generation=None)
    catalog, etag = read_catalog(store)
    assert sorted(catalog.steps) == [1, 2, 3] and catalog.counter == 3
    assert etag == store.head(CATALOG_KEY).etag and etag.endswith('-1"')  # the store's own
    assert remove_steps(store, {1, 2}, generation=None) == [1, 2]
    assert sorted(read_catalog(store)[0].steps) == [3]


def test_an_owner_claims_commits_and_releases_on_such_a_store(store):
    owner = claim_blob(store, lease_s=5.0)
    try:
        commit(store, _publish(7), generation=owner.fence.generation)
        assert owner.fence.lost() is None
    finally:
        owner.release()
    assert sorted(read_catalog(store)[0].steps) == [7]
    claim_blob(store, lease_s=5.0).release()  # a released owner lets the next one in
