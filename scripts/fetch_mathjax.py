#!/usr/bin/env python3
"""Fetch MathJax 3 from the npm registry into _vendor/mathjax so the book renders math offline.

The npm package `mathjax` ships the browser build in `es5/`; that folder is unpacked to
_vendor/mathjax/ and copied by Sphinx to _build/html/_static/mathjax/ (see `html_static_path`
and `mathjax_path` in _config.yml). The tarball is checked against the registry's sha512
integrity value pinned below. `npm pack` is used when npm is installed; otherwise the
tarball is downloaded directly from the registry.
"""
from __future__ import annotations

import base64
import hashlib
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

VERSION = "3.2.2"
INTEGRITY = (
    "sha512-Bt+SSVU8eBG27zChVewOicYs7Xsdt40qm4+UpHyX7k0/O9NliPc+x77k1/FEsPsjKPZGJvtRZM1vO+geW0OhGw=="
)
TARBALL_URL = f"https://registry.npmjs.org/mathjax/-/mathjax-{VERSION}.tgz"

ROOT = Path(__file__).resolve().parent.parent
DEST = ROOT / "_vendor" / "mathjax"
MARKER = DEST / "VERSION"


def fetch_tarball() -> bytes:
    npm = shutil.which("npm")
    if npm:
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run(
                [npm, "pack", "--silent", f"mathjax@{VERSION}"],
                cwd=tmp, capture_output=True, text=True,
            )
            tgz = Path(tmp) / f"mathjax-{VERSION}.tgz"
            if proc.returncode == 0 and tgz.is_file():
                return tgz.read_bytes()
            print(f"fetch_mathjax: npm pack failed ({proc.stderr.strip()[-300:]}); "
                  "downloading the tarball directly", file=sys.stderr)
    with urllib.request.urlopen(TARBALL_URL, timeout=120) as resp:
        return resp.read()


def check_integrity(data: bytes) -> None:
    algo, _, expected = INTEGRITY.partition("-")
    got = base64.b64encode(hashlib.new(algo, data).digest()).decode()
    if got != expected:
        sys.exit(f"fetch_mathjax: integrity mismatch for mathjax@{VERSION}: {algo}-{got}")


def main() -> int:
    if MARKER.is_file() and MARKER.read_text().strip() == VERSION and (DEST / "tex-chtml.js").is_file():
        return 0
    print(f"fetch_mathjax: fetching mathjax@{VERSION} into {DEST.relative_to(ROOT)}/")
    data = fetch_tarball()
    check_integrity(data)
    tmp = DEST.with_name("mathjax.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    prefix = "package/es5/"
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            if not member.isfile() or not member.name.startswith(prefix):
                continue
            rel = Path(member.name[len(prefix):])
            if rel.is_absolute() or ".." in rel.parts:
                continue
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(member).read())
    if not (tmp / "tex-chtml.js").is_file():
        sys.exit("fetch_mathjax: tex-chtml.js missing from the package")
    (tmp / "VERSION").write_text(VERSION + "\n")
    shutil.rmtree(DEST, ignore_errors=True)
    tmp.rename(DEST)
    return 0


if __name__ == "__main__":
    sys.exit(main())
