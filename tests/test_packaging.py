"""pyproject.toml's package list against setuptools' rule: a folder inside a listed package is importable (a
namespace package), so setuptools warns "Package would be ignored" for each one not listed, even when the parent's
package-data takes its files (issue 66: models/smollm2's ahead/ and draft/ printed it on every wheel build).
tests/test_app_install.py (slow) checks what the wheel installs."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def source_folder(package: str, package_dir: dict) -> Path:
    """Where a dotted package's files are, by setuptools' package-dir (the longest mapped prefix wins)."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in package_dir:
            return ROOT / package_dir[prefix] / Path(*parts[n:])
    return ROOT / Path(*parts)


def test_every_folder_inside_a_listed_package_is_listed():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages, mapping = set(tool["packages"]), tool.get("package-dir", {})
    unlisted = []
    for package in packages:
        folder = source_folder(package, mapping)
        assert folder.is_dir(), f"{package}: {folder} is not a folder"
        for sub in folder.iterdir():
            if sub.is_dir() and sub.name.isidentifier() and sub.name != "__pycache__" \
                    and any(f.is_file() for f in sub.rglob("*") if "__pycache__" not in f.parts):
                if f"{package}.{sub.name}" not in packages:
                    unlisted.append(f"{package}.{sub.name}")
    assert not unlisted, f"listed nowhere in pyproject.toml's packages (setuptools would warn): {unlisted}"


def test_the_trained_files_are_package_data():
    """The lookahead head and the draft that specbeam fetch attaches are in the wheel as before the listing."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for part in ("ahead", "draft"):
        folder = ROOT / "models" / "smollm2" / part
        for pattern in data[f"specbeam_models.smollm2.{part}"]:
            assert any(folder.glob(pattern)), f"{pattern} takes no file of {folder}"
        assert (folder / f"{part}.safetensors").is_file()
