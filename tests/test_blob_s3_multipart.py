"""A large put goes to S3 in parts (one PutObject takes at most 5 GB), on the real SeaweedFS
server of the session: the object reads back whole and byte for byte, ranges across a part
boundary included; its ETag (not an MD5) serves conditional replaces as any other; a part that
fails aborts the upload, leaving the old object and no incomplete upload behind."""

from __future__ import annotations

import random
import uuid

import pytest

from fsdp_ext.checkpoint.blob import BlobChangedError
from fsdp_ext.checkpoint.location import blob_store_for

PART = 5 << 20  # S3's smallest part


@pytest.fixture
def store(s3_env):
    store = blob_store_for(f"s3://{s3_env.bucket}/multipart-{uuid.uuid4().hex[:12]}")
    store.multipart_bytes = store.part_bytes = PART  # parts in a test-sized object
    return store


DATA = random.Random(0).randbytes(2 * PART + 1234)  # three parts, the last one short


def test_a_large_put_goes_up_in_parts_and_reads_back_whole(store):
    etag = store.put("big", DATA)
    assert etag.endswith('-3"'), etag  # S3's ETag of a three-part upload, not an MD5
    assert store.head("big") == (len(DATA), etag)
    assert store.get("big") == DATA
    assert store.get("big", PART - 3, PART + 3) == DATA[PART - 3 : PART + 3]  # across parts
    assert store.get("big", 2 * PART, None) == DATA[2 * PART :]
    new = store.replace_if("big", b"small", etag)  # the part ETag is current: it lands
    with pytest.raises(BlobChangedError):
        store.replace_if("big", b"stale", etag)
    assert store.get("big") == b"small" and store.head("big").etag == new


def test_a_failed_part_aborts_the_upload_and_keeps_the_old_object(store):
    store.put("big", b"old")
    client = store._s3()  # the client every store of this process shares
    sent = []

    def second_part_fails(params, **_):
        sent.append(params["PartNumber"])
        if params["PartNumber"] == 2:
            raise ConnectionResetError("the link dropped in part 2")

    event = "before-parameter-build.s3.UploadPart"
    client.meta.events.register(event, second_part_fails, unique_id="part-2-fails")
    try:
        with pytest.raises(ConnectionResetError):
            store.put("big", DATA)
    finally:
        client.meta.events.unregister(event, unique_id="part-2-fails")
    assert sent == [1, 2]
    assert store.get("big") == b"old"  # the old object, whole
    name = f"{store.prefix}/big"
    left = client.list_multipart_uploads(Bucket=store.bucket, Prefix=name).get("Uploads", [])
    assert left == []  # aborted: no part of it stays stored
