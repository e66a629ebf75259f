"""The documentation stays true: docs/reference.md is what the registries generate (so no
command, setting, rule, table or column exists undocumented), the generator catches a stale
file, the README stays a newcomer's page, and every relative link in the docs resolves."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT

GENERATE = ROOT / "docs" / "generate.py"
REFERENCE = ROOT / "docs" / "reference.md"


def _generate(*args):
    return subprocess.run([sys.executable, str(GENERATE), *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_reference_is_generated_and_current():
    r = _generate("--check")
    assert r.returncode == 0, r.stderr


def test_a_stale_reference_is_named_and_rewritten(tmp_path):
    # given: a copy of the reference with one command's row gone, as after adding a command
    stale = tmp_path / "reference.md"
    text = REFERENCE.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `backtrace`"))
    stale.write_text(text.replace(row + "\n", ""))
    # when / then: --check refuses it in one sentence that says how to fix it
    r = _generate("--check", "--output", str(stale))
    assert r.returncode == 1
    assert r.stderr.strip() == f"{stale} is stale: run `python docs/generate.py --write --output {stale}`."
    assert "Traceback" not in r.stderr
    # when / then: --write puts the row back, and the check passes
    assert _generate("--write", "--output", str(stale)).returncode == 0
    assert stale.read_text() == text
    assert _generate("--check", "--output", str(stale)).returncode == 0


def test_the_reference_names_every_table_column_and_command():
    # the generator reads the registries; this reads them again, apart from it
    from probe.cli.commands import COMMANDS, load_all
    from probe.tables.registry import all_tables

    text = REFERENCE.read_text()
    load_all()
    for name, cls in COMMANDS.items():
        assert f"| `{cls.name}`" in text, name
    for t in all_tables():
        section = text.split(f"### `{t.name}`\n", 1)[1].split("\n### ", 1)[0]
        for c in t.columns:
            assert f"| `{c.name}` | {c.type} |" in section, (t.name, c.name)


def test_readme_is_a_newcomers_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split()[0] for line in first_block[:2]] == ["./run-demo", "./run-tests"]
    assert "docs/reference.md" in readme and "docs/architecture.md" in readme


def test_relative_links_in_the_docs_resolve():
    pages = [
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        ROOT / "benchmarks" / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
    ]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links only, not code
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)
