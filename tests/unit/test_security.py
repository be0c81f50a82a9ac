"""Archives from elsewhere (SageMaker's output.tar.gz) are unpacked safely: a member that climbs out
with `..`, an absolute path or a link leaving the folder is refused, and nothing lands outside."""

import io
import tarfile

import pytest

from trnflow.errors import FatalError
from trnflow.safetar import extract, read_member, unpack


def _tar(*members: tarfile.TarInfo, data: bytes = b"payload") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for member in members:
            if member.isreg():
                member.size = len(data)
                archive.addfile(member, io.BytesIO(data))
            else:
                archive.addfile(member)
    return buffer.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize("member", [
    _member("../escaped.txt"),
    _member("nested/../../escaped.txt"),
    _member("/tmp/trnflow-absolute-escape.txt"),
    _member("link", tarfile.SYMTYPE, "../../escaped.txt"),
    _member("hard", tarfile.LNKTYPE, "/etc/passwd"),
], ids=["dotdot", "nested-dotdot", "absolute", "symlink-out", "hardlink-out"])
def test_an_archive_that_climbs_out_of_its_folder_is_refused_before_anything_is_written(tmp_path, member):
    dest = tmp_path / "out" / "inner"
    with pytest.raises(FatalError, match="refused to unpack") as caught:
        extract(_tar(_member("model/first.pt"), member), dest, "s3://bucket/job/output/output.tar.gz")
    assert "s3://bucket/job/output/output.tar.gz" in str(caught.value)
    assert not (tmp_path / "out" / "escaped.txt").exists() and not (tmp_path / "escaped.txt").exists()
    assert not dest.exists()  # not even the safe member before it


def test_a_compile_artifact_with_an_unsafe_member_is_a_corrupt_entry_that_writes_nothing(tmp_path):
    from trnflow.device.cache import CorruptEntry
    from trnflow.emulator.compiler import unpack_into

    inductor = tmp_path / "inductor"
    inductor.mkdir()
    with pytest.raises(CorruptEntry, match=r"unsafe member, refused: '\.\./escaped\.py'"):
        unpack_into(_tar(_member("fx/graph.py"), _member("../escaped.py")), inductor)
    assert list(inductor.iterdir()) == [] and not (tmp_path / "escaped.py").exists()
    with pytest.raises(CorruptEntry, match="'b': not a file or folder"):  # links: none of ours
        unpack_into(_tar(_member("fx/graph.py"), _member("b", tarfile.SYMTYPE, "c"), _member("c", tarfile.SYMTYPE,
                                                                                            ".")), inductor)
    assert list(inductor.iterdir()) == []
    unpack_into(_tar(_member("fx/graph.py"), data=b"code"), inductor)
    assert (inductor / "fx" / "graph.py").read_bytes() == b"code"


def test_a_plain_archive_unpacks_and_garbage_is_a_clear_error(tmp_path):
    extract(_tar(_member("model/weights.pt"), data=b"w"), tmp_path / "ok", "model.tar.gz")
    assert (tmp_path / "ok" / "model" / "weights.pt").read_bytes() == b"w"
    with pytest.raises(FatalError, match=r"model\.tar\.gz: not a readable tar archive"):
        extract(b"not a tar at all", tmp_path / "bad", "model.tar.gz")


def _cve_2025_4517(tmp_path) -> bytes:
    """The shape of CVE-2025-4517's archive: a chain of symlinks whose names, once resolved one after
    another, climb out of the folder (past `tarfile`'s data filter on unpatched Pythons), then a
    regular file written through the chain, and a hard link to a file outside."""
    deep = "d" * 200
    members = [_member(deep, tarfile.DIRTYPE)]
    members += [_member(f"{deep}/l{i}", tarfile.SYMTYPE, "../" * 3) for i in range(4)]
    members += [_member("escape", tarfile.SYMTYPE, f"{deep}/l0/l1/l2/l3/" + "../" * 8 + str(tmp_path)),
                _member("escape/planted.txt"),
                _member("hard", tarfile.LNKTYPE, "escape/planted.txt")]
    return _tar(*members)


def test_the_cve_2025_4517_archive_writes_nothing_anywhere(tmp_path):
    """Links are never unpacked, whatever the interpreter's tarfile filter lets through, and the
    archive is refused before its first member is written."""
    dest = tmp_path / "out"
    with pytest.raises(FatalError, match=r"refused to unpack '.+': not a file or folder"):
        extract(_cve_2025_4517(tmp_path), dest, "s3://staging/job/output/output.tar.gz")
    assert not dest.exists() and not (tmp_path / "planted.txt").exists()


def test_an_archive_that_unpacks_past_its_cap_is_refused_before_writing(tmp_path):
    from trnflow.safetar import Refused

    data = _tar(_member("a.bin"), _member("b.bin"), data=b"x" * 600)
    with tarfile.open(fileobj=io.BytesIO(data)) as archive, pytest.raises(Refused, match="more than 1,000 bytes"):
        unpack(archive, tmp_path / "capped", limit=1000)
    assert not (tmp_path / "capped").exists()


def test_a_jobs_result_is_read_in_memory_and_nothing_else_is_touched(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = _tar(_member("./result.json"), _member("other/notes.txt"), data=b'{"phase": "promote"}')
    assert read_member(data, "result.json", "output.tar.gz") == b'{"phase": "promote"}'
    assert read_member(data, "missing.json", "output.tar.gz") is None
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FatalError, match="refused to read 'link'"):
        read_member(_tar(_member("link", tarfile.SYMTYPE, "/etc/passwd")), "link", "output.tar.gz")


def test_unpacking_over_a_file_replaces_it_and_never_rewrites_the_one_in_use(tmp_path):
    """A compile-cache entry may be unpacked again into a folder whose kernels are loaded (an
    Inductor .so, mapped by the process): the file is replaced by a new one, never truncated and
    rewritten in place, which would pull the pages from under the loaded library (a SIGSEGV at the
    next call). A reader holding the old file still reads the old bytes."""
    kernel = tmp_path / "kernels" / "k.so"
    kernel.parent.mkdir()
    kernel.write_bytes(b"loaded kernel")
    with kernel.open("rb") as loaded:
        with tarfile.open(fileobj=io.BytesIO(_tar(_member("k.so"), data=b"the same kernel, packed again"))) as a:
            unpack(a, kernel.parent)
        assert loaded.read() == b"loaded kernel"  # the loaded file's bytes are untouched
    assert kernel.read_bytes() == b"the same kernel, packed again"
    assert sorted(p.name for p in kernel.parent.iterdir()) == ["k.so"]  # no temporary file left
