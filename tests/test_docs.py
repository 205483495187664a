"""The README and the docs site: what can rot without anyone building the site.

``make docs`` (run by CI) builds the site with ``mkdocs --strict``; these checks are the fast
part of that, in the suite: the README stays a front door (small, the two commands true), the
nav names pages that exist, the results page is exactly what the benchmarks' files render to
(so it cannot be edited by hand), and the tables copied from code still match the code.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import yaml

from meshpact.live.recovery.config import RecoveryConfig

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README_LIMIT = 15_000


def _script(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_docs_test_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _nav_pages(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in _nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in _nav_pages(value)]
    return []


def _nav() -> list[str]:
    return _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])


def test_the_readme_is_a_front_door_under_15_kb_whose_two_commands_are_make_targets():
    readme = (ROOT / "README.md").read_bytes()
    assert len(readme) <= README_LIMIT, f"README.md is {len(readme):,} bytes; move detail into docs/ (limit {README_LIMIT:,})"
    lines = readme.decode().splitlines()
    for command in ("make app", "make test"):
        assert any(line.startswith(command + " ") or line == command for line in lines), f"README lost `{command}`"
        target = command.split()[1]
        assert re.search(rf"^{target}:", (ROOT / "Makefile").read_text(), re.M), f"Makefile has no `{target}` target"


def test_every_docs_link_in_the_readme_names_a_page_of_the_site():
    links = re.findall(r"\]\((docs/[^)#]+)", (ROOT / "README.md").read_text())
    assert links, "the README's table of where to read on links no docs page"
    nav = set(_nav())
    for link in links:
        assert (ROOT / link).is_file(), f"README links {link}, which does not exist"
        assert link.removeprefix("docs/") in nav, f"README links {link}, which mkdocs.yml's nav does not list"


def test_every_page_in_the_nav_exists_and_every_page_is_in_the_nav():
    nav = _nav()
    assert len(nav) == len(set(nav)), f"a page is listed twice in the nav: {nav}"
    missing = [p for p in nav if not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml's nav lists pages that do not exist: {missing}"
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "_griffe" not in p.parts}
    assert pages - set(nav) == set(), f"pages not in mkdocs.yml's nav: {sorted(pages - set(nav))}"


def test_the_api_reference_names_modules_that_exist_through_the_import_shim():
    shim = DOCS / "_griffe" / "meshpact"
    names = [n for page in ("api/core.md", "api/recovery.md")
             for n in re.findall(r"^::: (meshpact\.[\w.]+)", (DOCS / page).read_text(), re.M)]
    assert any(n.startswith("meshpact.core.") for n in names)
    assert {f"meshpact.live.recovery.{m}" for m in ("runtime", "session", "config", "consensus")} <= set(names)
    for name in names:
        parts = name.split(".")[1:]
        path = shim.joinpath(*parts)
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), \
            f"the API reference documents {name}, which griffe cannot find under {shim}"


def test_the_results_page_is_what_the_benchmarks_files_render_to():
    render = _script(ROOT / "scripts" / "render_results.py")
    results = sorted((ROOT / "bench" / "results").glob("*.json"))
    assert results, "bench/results/ holds no benchmark result"
    assert (DOCS / "results.md").read_text() == render.render(ROOT / "bench" / "results"), \
        "docs/results.md differs from bench/results/*.json: run python scripts/render_results.py, never edit it"


def test_a_result_file_is_rendered_with_its_date_load_machine_and_a_table_per_list_of_records(tmp_path, capsys):
    results = _script(ROOT / "bench" / "_results.py")
    doc = {"bench": "planner", "median_us_per_plan": 150.5, "goal_met": True,
           "load": {"before": [1.0, 2.0, 3.0]}, "rows": [{"model": "dense", "ms": 8.25}, {"model": "moe", "ms": 7.5}]}
    path = results.emit("planner", doc, results=tmp_path)
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads(path.read_text()) == line and line["median_us_per_plan"] == 150.5
    run = line["run"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", run["date"])
    assert len(run["load_average"]) == 3 and run["machine"]["cpus"] >= 1

    page = _script(ROOT / "scripts" / "render_results.py").render(tmp_path)
    section = page[page.index("## planner"):]
    assert run["date"].replace("T", " ").removesuffix("+00:00") in section
    assert " / ".join(f"{x:.4g}" for x in run["load_average"]) in section
    assert f"{run['machine']['cpus']} × " in section
    assert "| `median_us_per_plan` | 150.5 |" in section and "| `goal_met` | yes |" in section
    assert "| `load.before` | 1, 2, 3 |" in section
    assert "| `model` | `ms` |" in section and "| dense | 8.25 |" in section and "| moe | 7.5 |" in section


def test_the_timeouts_page_shows_recovery_configs_own_table_at_the_defaults():
    page = (DOCS / "timeouts.md").read_text()
    for name, seconds, formula in RecoveryConfig().table():
        row = f"| {name} | {seconds:g} | `{formula}` |"
        assert row in page, f"docs/timeouts.md lacks (or has another) row: {row}"
