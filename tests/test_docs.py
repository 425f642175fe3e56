"""docs/architecture.md stays true: every module has its one-line job in the table."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_is_in_the_architecture_table() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    src = ROOT / "src" / "kvbaton"
    missing = [str(p.relative_to(src)) for p in sorted(src.rglob("*.py")) if f"`{p.relative_to(src)}`" not in text]
    assert not missing, f"add these modules to docs/architecture.md: {missing}"


def test_readme_opens_with_the_two_commands() -> None:
    head = (ROOT / "README.md").read_text()[:1500]
    assert "make serve" in head and "make test" in head
