"""The reference in docs/ builds with `mkdocs build --strict` (mkdocs.yml: a link to a page or an
anchor that does not exist, or a page outside the navigation, fails it), and README.md's links into
docs/ name pages and anchors the built site has."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    built = tmp_path_factory.mktemp("site")
    # Material's notice of its end of life is not a warning about the docs.
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(built)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stdout + done.stderr, done.stdout + done.stderr
    return built


def test_the_docs_build_strict_with_every_page_in_the_navigation(site):
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = {page for entry in config["nav"] for page in entry.values()}
    assert listed == {p.name for p in (ROOT / "docs").glob("*.md")}
    assert (site / "cli" / "index.html").is_file() and (site / "screenshots" / "oncemore-page.png").is_file()


def test_the_readmes_links_into_docs_name_pages_and_anchors_that_exist(site):
    links = re.findall(r"\]\((docs/[^)#\s]*)(?:#([^)\s]+))?\)", (ROOT / "README.md").read_text())
    assert len(links) >= 10, links
    pages = set()
    for target, anchor in links:
        assert (ROOT / target).is_file(), target
        page = site / target.removeprefix("docs/").removesuffix(".md").removesuffix("index") / "index.html"
        if anchor:
            assert f'id="{anchor}"' in page.read_text(), f"{target} has no anchor #{anchor}"
        pages.add(target)
    # The README's reference list reaches every page.
    assert pages >= {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
