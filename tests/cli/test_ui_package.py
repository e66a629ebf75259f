"""The page's assets ship with the package: a built wheel contains them, and the installed
package (editable here) serves them from ``probe.cli.ui``'s package data."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from conftest import ROOT

ASSETS = {"index.html", "draw.js", "app.js", "style.css"}


def test_installed_package_serves_the_assets():
    from probe.cli.ui.server import _static_files

    files = _static_files()
    assert ASSETS <= set(files)
    html = files["index.html"].decode()
    # offline: no asset names another host (the SVG namespace is a name, not a request)
    for name in ASSETS:
        text = files[name].decode().replace('"http://www.w3.org/2000/svg"', "")
        assert "http:" not in text and "https:" not in text and "@import" not in text, name
    assert 'src="draw.js"' in html and 'src="app.js"' in html and 'href="style.css"' in html


def test_wheel_contains_the_assets(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next(tmp_path.glob("probe-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"probe/cli/ui/static/{a}" for a in ASSETS} <= names, sorted(n for n in names if "/ui/" in n)
    assert "probe/cli/ui/server.py" in names and "probe/cli/commands/serve.py" in names
    assert "probe/cli/mcp/tables.json" in names  # the MCP server's table catalog ships with it
