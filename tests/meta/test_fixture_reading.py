"""Reading fixtures fast: oracle.fixtures.npz gives numpy.load's arrays, a compact fixture's
rebuilt inputs are kept in the cache folder and checked like rebuilt ones, and judging a
passing output reads the empty rows from the forward judging part (no float64 textbook), and
validate reads the fixtures in a thread (oracle.run.prefetch)."""

from __future__ import annotations

import dataclasses
import io
import zipfile

import numpy as np
import pytest

from oracle import catalogue
from oracle.fixtures import golden, npz
from oracle.fixtures.npz import read_npz
from oracle.judging import parts
from oracle.judging.judge import check_fixture
from oracle.reading import case as case_module
from oracle.run.prefetch import Prefetched
from refattn.attention import attention

SMALL = "causal-br-H2K2-L4S7-D8E8-f32"
COMPACT = "long-decode-H2K1-L1S2048-D16E16-f32"


def _numpy_load(path):
    with np.load(path, allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def _assert_same(found, expected):
    assert sorted(found) == sorted(expected)
    for name, array in expected.items():
        assert found[name].dtype == array.dtype and found[name].shape == array.shape, name
        assert found[name].tobytes() == array.tobytes(), name
        assert found[name].flags.writeable, name


def test_read_npz_gives_numpy_loads_arrays(tmp_path):
    fixture = golden.build(catalogue.get(SMALL))
    golden.write_fixture(fixture, tmp_path)
    (path,) = tmp_path.glob("*.npz")
    _assert_same(read_npz(path), _numpy_load(path))
    arrays = {
        "a": np.arange(6, dtype=">f8").reshape(2, 3),
        "fortran": np.asfortranarray(np.ones((2, 3))),
        "flags": np.array([True, False]),
        "empty": np.zeros((0, 4), np.float32),
        "text": np.array("{}"),
    }
    np.savez(tmp_path / "plain.npz", **arrays)
    np.savez_compressed(tmp_path / "packed.npz", **arrays)  # numpy's reader for these
    for name in ("plain.npz", "packed.npz"):
        _assert_same(read_npz(tmp_path / name), _numpy_load(tmp_path / name))


def test_read_npz_reads_the_zip_directory_itself_or_leaves_it_to_zipfile(tmp_path):
    fixture = golden.build(catalogue.get(SMALL))
    golden.write_fixture(fixture, tmp_path)
    (path,) = tmp_path.glob("*.npz")
    assert (
        npz.zip_directory(path.read_bytes()) is not None
    )  # a fixture: its directory read from its bytes
    arrays = {"a": np.arange(6.0).reshape(2, 3), "text": np.array("{}")}
    np.savez(tmp_path / "plain.npz", **arrays)
    assert npz.zip_directory((tmp_path / "plain.npz").read_bytes()) is not None
    plain = (tmp_path / "plain.npz").read_bytes()
    with zipfile.ZipFile(tmp_path / "plain.npz") as source:
        members = [(info.filename, source.read(info)) for info in source.infolist()]
    with zipfile.ZipFile(tmp_path / "comment.npz", "w") as archive:  # a comment: zipfile's
        for name, member in members:
            archive.writestr(name, member)
        archive.comment = b"kept"
    (tmp_path / "prefixed.npz").write_bytes(b"#!" + plain)  # bytes before it: zipfile's
    for name in ("comment.npz", "prefixed.npz"):
        assert npz.zip_directory((tmp_path / name).read_bytes()) is None, name
        _assert_same(read_npz(tmp_path / name), arrays)
    (tmp_path / "cut.npz").write_bytes(plain[:-10])  # a broken directory: zipfile's error
    assert npz.zip_directory(plain[:-10]) is None
    with pytest.raises(zipfile.BadZipFile):
        read_npz(tmp_path / "cut.npz")


def test_read_npz_refuses_object_arrays(tmp_path):
    buffer = io.BytesIO()
    np.save(buffer, np.array([{}], dtype=object), allow_pickle=True)
    with zipfile.ZipFile(tmp_path / "obj.npz", "w") as archive:
        archive.writestr("x.npy", buffer.getvalue())
    with pytest.raises(ValueError):
        read_npz(tmp_path / "obj.npz")


@pytest.fixture(scope="module")
def compact_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compact")
    golden.generate("default", folder, cases=[catalogue.get(COMPACT)], progress=False)
    return folder


def test_compact_inputs_are_kept_and_checked(compact_dir, monkeypatch):
    monkeypatch.delenv("REFATTN_CACHE", raising=False)
    rebuilt = catalogue.make_inputs(catalogue.get(COMPACT))
    (first,) = golden.load(compact_dir)
    (kept,) = (compact_dir / ".judge-cache").glob("inputs-*.npz")
    (second,) = golden.load(compact_dir)
    for fixture in (first, second):
        _assert_same(fixture.inputs, rebuilt)
    # a cache file that differs by one bit is rebuilt from the spec, never trusted
    data = bytearray(kept.read_bytes())
    data[len(data) // 2] ^= 1  # inside an input's values
    kept.write_bytes(bytes(data))
    (third,) = golden.load(compact_dir)
    _assert_same(third.inputs, rebuilt)
    assert kept.read_bytes() != bytes(data)  # written again from the rebuilt inputs


def test_no_cache_file_when_caching_is_off(tmp_path, monkeypatch):
    monkeypatch.setenv("REFATTN_CACHE", "off")
    golden.generate("default", tmp_path, cases=[catalogue.get(COMPACT)], progress=False)
    (fixture,) = golden.load(tmp_path)
    assert fixture.inputs["q"].shape[-2] == 1
    assert not (tmp_path / ".judge-cache").exists()


def test_a_passing_output_is_judged_without_the_float64_textbook(monkeypatch, tmp_path):
    monkeypatch.setenv("REFATTN_CACHE", str(tmp_path))
    parts.clear_memory()
    fixture = golden.build(catalogue.get(SMALL))

    def exact(q, k, v, **options):
        return attention(q, k, v, **options, precision="exact")

    assert check_fixture(exact, fixture).verdict == "pass"  # computes and keeps the parts
    fresh = dataclasses.replace(fixture)  # a new view: nothing evaluated on it yet

    def refuse(*args, **kwargs):
        raise AssertionError("the float64 textbook was evaluated")

    monkeypatch.setattr(case_module, "textbook_attention", refuse)
    assert check_fixture(exact, fresh).verdict == "pass"
    parts.clear_memory()


def test_prefetched_fixtures_come_in_order_and_errors_where_they_were():
    def source():
        yield from ("a", "b")
        raise golden.FixtureError("c.npz: unreadable")

    items = Prefetched(source(), 3)
    assert len(items) == 3 and bool(items)
    seen = []
    with pytest.raises(golden.FixtureError, match="c.npz"):
        for item in items:
            seen.append(item)
    assert seen == ["a", "b"]
    assert not Prefetched(iter(()), 0)


def test_loaded_key_comes_from_the_checked_file(tmp_path):
    """A fixture read from a checked file is keyed by the file's sha256 (its arrays are not
    hashed again); the key follows the file, and an unchecked read falls back to the content."""
    from oracle.reading.case import fixture_key, loaded_key

    golden.generate("default", tmp_path, cases=[catalogue.get(SMALL)], progress=False)
    (first,) = golden.load(tmp_path)
    (again,) = golden.load(tmp_path)
    assert first.verified_sha256 and loaded_key(first) == loaded_key(again)
    assert loaded_key(first) != fixture_key(first)
    (unchecked,) = golden.load(tmp_path, check=False)
    assert loaded_key(unchecked) == fixture_key(unchecked) == fixture_key(first)
    other = tmp_path / "other"
    golden.generate("default", other, cases=[catalogue.get(COMPACT)], progress=False)
    (compact,) = golden.load(other)
    assert loaded_key(compact) not in (loaded_key(first), fixture_key(compact))


def test_npy_sha256_is_that_of_the_written_bytes():
    """The in-place hash a compact fixture's inputs are checked with is the sha256 of the npy
    bytes the fixtures are written with, for every dtype and layout they hold."""
    import hashlib

    from oracle.fixtures.npz import npy_sha256

    rng = np.random.default_rng(0)
    arrays = [
        np.array("meta"),
        np.array(3.5),
        np.arange(12.0).reshape(3, 4).T,
        rng.standard_normal((2, 3, 4)).astype(np.float32),
        np.zeros((0, 3), np.float16),
        np.arange(6, dtype=np.uint16).reshape(2, 3),
        np.arange(5, dtype=">i4"),
    ]
    for array in arrays:
        assert npy_sha256(array) == hashlib.sha256(golden._npy_bytes(array)).hexdigest()


def test_kept_inputs_are_hashed_again_only_when_their_file_changed(tmp_path, monkeypatch):
    """A kept compact input file is checked once (or written from checked inputs); a later
    load hashes it again only when its status changed, even with its times set back."""
    import os

    from oracle.fixtures import compact

    monkeypatch.delenv("REFATTN_CACHE", raising=False)
    golden.generate("default", tmp_path, cases=[catalogue.get(COMPACT)], progress=False)
    for kept in (tmp_path / ".judge-cache").glob("inputs-*"):
        kept.unlink()  # generate's own cache: start from a load that rebuilds them
    rebuilt = catalogue.make_inputs(catalogue.get(COMPACT))
    hashed = []
    real = compact.npy_sha256
    monkeypatch.setattr(compact, "npy_sha256", lambda a: hashed.append(1) or real(a))
    (first,) = golden.load(tmp_path)  # rebuilt, checked, kept, remembered
    checks = len(hashed)
    (second,) = golden.load(tmp_path)
    assert checks > 0 and len(hashed) == checks  # read back without hashing again
    (kept,) = (tmp_path / ".judge-cache").glob("inputs-*.npz")
    before = kept.stat()
    data = bytearray(kept.read_bytes())
    data[len(data) // 2] ^= 1
    kept.write_bytes(bytes(data))
    os.utime(kept, ns=(before.st_atime_ns, before.st_mtime_ns))  # times set back
    (third,) = golden.load(tmp_path)
    assert len(hashed) > checks  # its change time moved: checked, refused, rebuilt
    for fixture in (first, second, third):
        _assert_same(fixture.inputs, rebuilt)
