"""The tests never read or write the user's folders (conftest.USER_FOLDERS): every per-user location the package
and its apps use resolves into this test session's temporary folder."""
from pathlib import Path


def test_per_user_folders_are_this_sessions(tmp_path_factory):
    from apps.chat.store import default_path
    from apps.translate.fingerprint import cache_path
    from specbeam_edge import fetch
    from specbeam_edge.execution import invariance

    base = Path(tmp_path_factory.getbasetemp()).resolve()
    where = {"fetched models": fetch.data_dir(), "kept sources": fetch.sources_dir(),
             "measurement cache": invariance.cache_dir(), "chat store": default_path(),
             "translate checksum cache": cache_path()}
    outside = {what: str(path) for what, path in where.items() if base not in Path(path).resolve().parents}
    assert not outside, outside


def test_the_caches_follow_the_data_folder(tmp_path, monkeypatch):
    """Issue 66: with SPECBEAM_DATA_DIR set the measurement and checksum caches stayed in the home folder; they go
    under it now unless SPECBEAM_CACHE_DIR names their own place."""
    from apps.translate.fingerprint import cache_path
    from specbeam_edge.execution import invariance

    monkeypatch.delenv("SPECBEAM_CACHE_DIR", raising=False)
    monkeypatch.setenv("SPECBEAM_DATA_DIR", str(tmp_path / "data"))
    assert invariance.cache_dir() == tmp_path / "data" / "cache"
    assert cache_path().parent == tmp_path / "data" / "cache"
    monkeypatch.setenv("SPECBEAM_CACHE_DIR", str(tmp_path / "own"))
    assert invariance.cache_dir() == cache_path().parent == tmp_path / "own"
