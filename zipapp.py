"""Build ``dist/thunderproxy.pyz``: the whole proxy, Datasette included, in one file.

    python zipapp.py            # -> dist/thunderproxy.pyz
    python dist/thunderproxy.pyz serve --backends http://127.0.0.1:8000
    python zipapp.py --out /somewhere/thunderproxy.pyz --build-dir /somewhere/staging

The archive is written beside its target and then renamed over it, so a copy that is running
while another is built keeps reading the file it started from.

The archive runs on a plain ``python3.11`` with no virtualenv. Some dependencies cannot run from
inside a zip (greenlet is a compiled module; Datasette reads its templates through file paths),
so on first run the archive unpacks itself once into ``$XDG_CACHE_HOME/thunderproxy/<build id>/``
(``~/.cache`` by default; override with ``THUNDERPROXY_PYZ_CACHE``) and runs from there. The build
is tied to the CPython version and platform that built it, because of those compiled wheels.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# This file is named like the stdlib module it uses: drop our folder from the path first.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import argparse  # noqa: E402
import hashlib  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tomllib  # noqa: E402
import zipapp  # noqa: E402

STAGING = HERE / "build" / "pyz"
TARGET = HERE / "dist" / "thunderproxy.pyz"
#: Installed only because datasette and sqlite-utils declare them for their plugin installers.
UNNEEDED = ("pip", "setuptools", "_distutils_hack", "pkg_resources", "greenlet/tests")

BOOTSTRAP = '''\
"""thunderproxy single-file entry point: unpack once to a cache folder, then run from there."""
import os, sys, zipfile
from pathlib import Path

BUILD_ID = "{build_id}"


def _unpacked():
    archive = Path(sys.argv[0]).resolve()
    base = os.environ.get("THUNDERPROXY_PYZ_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "thunderproxy")
    target = Path(base) / BUILD_ID
    if not (target / ".complete").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / (BUILD_ID + ".tmp." + str(os.getpid()))
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)
        (tmp / ".complete").touch()
        try:
            os.rename(tmp, target)  # atomic: concurrent first runs never see half a tree
        except OSError:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)  # another run unpacked it first
    return target


sys.path.insert(0, str(_unpacked()))
from thunderproxy.cli import main

main()
'''


def dependencies() -> list[str]:
    with open(HERE / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def build_id(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file():
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def shown(path: Path) -> str:
    return str(path.relative_to(HERE)) if path.is_relative_to(HERE) else str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the single-file thunderproxy.pyz.")
    parser.add_argument("--out", type=Path, default=TARGET, help=f"default: {shown(TARGET)}")
    parser.add_argument(
        "--build-dir", type=Path, default=STAGING, help=f"staging folder; default: {shown(STAGING)}"
    )
    args = parser.parse_args()
    build(args.out.resolve(), args.build_dir.resolve())


def build(target: Path, staging: Path) -> None:
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    print(f"installing {len(dependencies())} dependencies into {shown(staging)} ...")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            # The target folder is all the archive holds: conflicts with packages installed
            # elsewhere on this machine, and pip's warning about root, do not concern it.
            "--no-warn-conflicts",
            "--root-user-action=ignore",
            "--no-compile",
            "--target",
            str(staging),
            *dependencies(),
        ],
        check=True,
    )
    for name in UNNEEDED:
        shutil.rmtree(staging / name, ignore_errors=True)
    for info in staging.glob("*.dist-info"):
        if info.name.split("-")[0].lower() in {"pip", "setuptools"}:
            shutil.rmtree(info)
    shutil.copytree(
        HERE / "thunderproxy",
        staging / "thunderproxy",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    shutil.copytree(HERE / "migrations", staging / "thunderproxy" / "migrations")
    for cache in staging.rglob("__pycache__"):
        shutil.rmtree(cache, ignore_errors=True)
    (staging / "__main__.py").write_text(BOOTSTRAP.format(build_id=build_id(staging)))
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        zipapp.create_archive(staging, partial, interpreter="/usr/bin/env python3", compressed=True)
        os.replace(partial, target)  # a running copy keeps its own (now unlinked) file
    finally:
        partial.unlink(missing_ok=True)
    size_mb = target.stat().st_size / 1e6
    print(f"built {shown(target)} ({size_mb:.1f} MB)")


if __name__ == "__main__":
    main()
