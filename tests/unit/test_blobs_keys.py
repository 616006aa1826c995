"""The tensor key layout (`fedhive.blobs.keys`): the server's objects, each site's uploads per
task and the checkpoint's copies never share a key, and a key says who wrote it."""

from __future__ import annotations

import pytest

from fedhive.blobs import TensorKind, TensorRef
from fedhive.blobs.keys import (
    CONTENT_KEY_TAIL,
    Upload,
    blame_uploader,
    checkpoint_copy_key,
    content_key,
    parse_upload_key,
    upload_key,
    upload_prefix,
    uploaded_by,
    uploader_of,
)
from fedhive.errors import BlobNotFound, ChecksumMismatch, InvalidArgument

PREFIX = "ns/jobs/j1/tensors/"
HEX = "ab" * 32
SUM = f"blake3:{HEX}"


def test_each_party_writes_a_place_of_its_own() -> None:
    assert content_key(PREFIX, SUM) == f"{PREFIX}blake3/{HEX}"
    assert upload_key(PREFIX, "site-1", "t1", SUM) == f"{PREFIX}sites/site-1/t1/blake3/{HEX}"
    assert upload_prefix(PREFIX, "site-1") == f"{PREFIX}sites/site-1/"
    assert checkpoint_copy_key(PREFIX, SUM) == f"{PREFIX}checkpoint/blake3/{HEX}"
    keys = {content_key(PREFIX, SUM), upload_key(PREFIX, "site-1", "t1", SUM),
            upload_key(PREFIX, "site-2", "t1", SUM), upload_key(PREFIX, "site-1", "t2", SUM),
            checkpoint_copy_key(PREFIX, SUM)}
    assert len(keys) == 5
    # every key ends with the content's name: a ref to it is recognised as a content ref
    assert all(CONTENT_KEY_TAIL.search(key).groups() == ("blake3", HEX)  # type: ignore[union-attr]
               for key in keys)
    # one site's uploads are not under another's prefix, even a longer name's
    assert not upload_key(PREFIX, "site-10", "t1", SUM).startswith(
        upload_prefix(PREFIX, "site-1"))


def test_an_upload_key_says_who_wrote_it_for_which_task_and_content() -> None:
    key = upload_key(PREFIX, "site-1", "t1", SUM)
    assert parse_upload_key(PREFIX, key) == Upload("site-1", "t1", SUM)
    assert uploader_of(key) == "site-1"
    assert uploaded_by(key) == " (uploaded by site site-1)"
    for other in (content_key(PREFIX, SUM), checkpoint_copy_key(PREFIX, SUM)):
        assert parse_upload_key(PREFIX, other) is None
        assert uploader_of(other) is None and uploaded_by(other) == ""
    # under another prefix (another job), or not quite the layout: not this job's upload
    assert parse_upload_key("ns/jobs/j2/tensors/", key) is None
    for bent in (f"{PREFIX}sites/site-1/blake3/{HEX}", f"{PREFIX}sites/site-1/t1/x/blake3/{HEX}",
                 f"{PREFIX}x/sites/site-1/t1/blake3/{HEX}", f"{PREFIX}sites/site-1/t1/md5/{HEX}"):
        assert parse_upload_key(PREFIX, bent) is None, bent


@pytest.mark.parametrize(("site", "task_id", "field"), [
    ("site/1", "t1", "site"), ("..", "t1", "site"), ("", "t1", "site"),
    ("site-1", "t/1", "task_id"), ("site-1", "", "task_id"), ("site-1", "x" * 200, "task_id"),
])
def test_an_upload_key_is_one_segment_per_name(site: str, task_id: str, field: str) -> None:
    with pytest.raises(InvalidArgument, match="cannot name an upload key") as caught:
        upload_key(PREFIX, site, task_id, SUM)
    assert caught.value.field == field


@pytest.mark.parametrize("bad", ["md5:abc", f"blake3:{HEX.upper()}", f"blake3:{HEX}0", HEX])
def test_a_key_needs_a_checksum_of_the_known_form(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="is not 'blake3:<64 hex digits>'"):
        content_key(PREFIX, bad)
    with pytest.raises(InvalidArgument, match="is not 'blake3:<64 hex digits>'"):
        checkpoint_copy_key(PREFIX, bad)
    with pytest.raises(InvalidArgument, match="is not 'blake3:<64 hex digits>'"):
        upload_key(PREFIX, "site-1", "t1", bad)


def ref_at(name: str, key: str) -> TensorRef:
    return TensorRef(name=name, dtype="float32", shape=(4,), kind=TensorKind.NUMPY, key=key,
                     length=16, checksum=SUM)


def test_an_error_about_a_site_s_upload_is_blamed_on_that_site() -> None:
    upload = upload_key(PREFIX, "site-2", "t1", SUM)
    refs = [ref_at("server", content_key(PREFIX, SUM)), ref_at("relayed", upload)]
    # the checksum check names the tensor, the fetcher the object's key
    for err in (ChecksumMismatch("tensor 'relayed': bytes differ", field="relayed"),
                BlobNotFound(f"object not found reading blob {upload}", field=upload)):
        blamed = blame_uploader(err, refs)
        assert blamed is not None and type(blamed) is type(err) and blamed.field == err.field
        assert str(blamed) == f"{err} (uploaded by site site-2)"
    # the server's object, an inline tensor, or an error about none of the refs: no one to blame
    assert blame_uploader(ChecksumMismatch("x", field="server"), refs) is None
    assert blame_uploader(ChecksumMismatch("x", field="other"), refs) is None
    assert blame_uploader(ChecksumMismatch("x", field=None), refs) is None
    inline = TensorRef(name="small", dtype="float32", shape=(1,), kind=TensorKind.NUMPY,
                       length=4, checksum=SUM, inline_data=b"1234")
    assert blame_uploader(ChecksumMismatch("x", field="small"), [inline]) is None
