"""The README and the docs site: what can rot without anyone building the site.

``make docs`` (run by CI) builds the site with ``mkdocs --strict``; these checks are the fast
part of that, in the suite: the README stays a front door (small, the two commands true), the
nav names pages that exist, the results page is exactly what the benchmarks' files render to
(so it cannot be edited by hand), and the tables copied from code still match the code.

The results figures are checked without drawing them: each SVG carries a digest of the data it
plots and of the code that draws it, and the check compares digests (importing matplotlib alone
takes seconds on a loaded machine). One test draws a figure twice, where the docs extra is
installed, to show the drawing is byte-for-byte deterministic and matches the committed file.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest
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
    assert len(readme) <= README_LIMIT, (
        f"README.md is {len(readme):,} bytes; move detail into docs/ (limit {README_LIMIT:,})"
    )
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
    names = [
        n
        for page in ("api/core.md", "api/recovery.md")
        for n in re.findall(r"^::: (meshpact\.[\w.]+)", (DOCS / page).read_text(), re.M)
    ]
    assert any(n.startswith("meshpact.core.") for n in names)
    assert {f"meshpact.live.recovery.{m}" for m in ("runtime", "session", "config", "consensus")} <= set(names)
    for name in names:
        parts = name.split(".")[1:]
        path = shim.joinpath(*parts)
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), (
            f"the API reference documents {name}, which griffe cannot find under {shim}"
        )


def _renderer() -> ModuleType:
    return _script(ROOT / "scripts" / "render_results.py")


def test_the_results_page_its_figures_and_json_copies_are_what_the_benchmarks_files_render_to():
    render = _renderer()
    rendered = render.render(ROOT / "bench" / "results")
    assert rendered.sources, "bench/results/ holds no benchmark result"
    assert render.problems(rendered, DOCS) == [], (
        "the results page is out of date: run python scripts/render_results.py, never edit docs/results.md"
    )
    page = (DOCS / "results.md").read_text()
    assert len(page.encode()) < 15_000, f"docs/results.md is {len(page.encode()):,} bytes; keep it under 15 KB"
    for figure in rendered.figures:
        assert f"]({figure.file})" in page, f"{figure.file} is drawn but not shown"
    for source in rendered.sources:
        assert f"## {source.stem}\n" in page and f"](figures/data/{source.name})" in page


def _results_copy(tmp_path: Path) -> tuple[Path, Path]:
    """bench/results and the generated part of docs/, copied where a test may change them."""
    results, docs = tmp_path / "results", tmp_path / "docs"
    shutil.copytree(ROOT / "bench" / "results", results)
    shutil.copytree(DOCS / "figures", docs / "figures")
    shutil.copyfile(DOCS / "results.md", docs / "results.md")
    return results, docs


def test_a_changed_result_marks_the_page_and_only_its_own_figure_out_of_date(tmp_path, capsys):
    render = _renderer()
    results, docs = _results_copy(tmp_path)
    assert render.main(["--results", str(results), "--docs", str(docs), "--check"]) == 0
    doc = json.loads((results / "launch.json").read_text())
    doc["downtime_s_runs_by_case"]["worker_kill_cold"] = [2.502, 9.0]
    (results / "launch.json").write_text(json.dumps(doc))
    (docs / "figures" / "old-bench.svg").write_text("<svg/>")
    (docs / "figures" / "data" / "planner.json").unlink()

    found = render.problems(render.render(results), docs)
    assert any(p.startswith(f"{docs / 'results.md'} differs") for p in found)
    figures = sorted(p.split()[0] for p in found if p.endswith("drawn from other data or code"))
    assert figures == [str(docs / "figures" / "launch-downtime.svg")], found
    assert any(p.startswith(f"{docs / 'figures' / 'data' / 'launch.json'} is missing or differs") for p in found)
    assert any(p.startswith(f"{docs / 'figures' / 'data' / 'planner.json'} is missing") for p in found)
    assert any(p.startswith(f"{docs / 'figures' / 'old-bench.svg'} is no longer made") for p in found)
    assert render.main(["--results", str(results), "--docs", str(docs), "--check"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == len(found) and all(line.startswith("render_results: ") for line in err)


def test_a_write_with_every_figure_current_restores_the_copies_and_removes_what_no_result_makes(tmp_path, capsys):
    render = _renderer()
    results, docs = _results_copy(tmp_path)
    (docs / "figures" / "old-bench.svg").write_text("<svg/>")
    (docs / "figures" / "data" / "planner.json").write_text("{}")
    (docs / "results.md").write_text("# Results\n\nedited by hand\n")
    assert render.main(["--results", str(results), "--docs", str(docs)]) == 0
    assert "drew 0 of " in capsys.readouterr().out
    assert render.problems(render.render(results), docs) == []
    assert not (docs / "figures" / "old-bench.svg").exists()


def test_a_results_folder_that_is_not_there_is_one_line(tmp_path, capsys):
    assert _renderer().main(["--results", str(tmp_path / "nowhere"), "--docs", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nowhere is not a folder; expected the benchmarks' results folder" in err


def test_a_new_result_file_gets_the_generic_section_with_its_date_load_machine_and_small_tables(tmp_path, capsys):
    results = _script(ROOT / "bench" / "_results.py")
    doc = {
        "bench": "gpu",
        "median_us_per_plan": 150.5,
        "goal_met": True,
        "note": "a | b",
        "load": {"before": [1.0, 2.0, 3.0]},
        "nested": {"deep": {"x": 1}},
        "rows": [{"model": "dense", "ms": 8.25}, {"model": "moe", "ms": 7.5}],
        "runs": [{f"k{i}": i for i in range(9)}],
        "samples": list(range(40)),
        "empty": {},
    }
    path = results.emit("gpu", doc, results=tmp_path)
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads(path.read_text()) == line and line["median_us_per_plan"] == 150.5
    run = line["run"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", run["date"])
    assert len(run["load_average"]) == 3 and run["machine"]["cpus"] >= 1
    (tmp_path / "capped_made_up.json").write_text(json.dumps({f"key_{i:02}": i * 1.5 for i in range(20)}))

    rendered = _renderer().render(tmp_path)
    assert rendered.figures == ()
    page = rendered.page
    section = page[page.index("## gpu") :]
    assert run["date"].replace("T", " ").removesuffix("+00:00") in section
    assert " / ".join(f"{x:.4g}" for x in run["load_average"]) in section
    assert f"{run['machine']['cpus']} × " in section
    assert "| `median_us_per_plan` | 150.5 |" in section and "| `goal_met` | yes |" in section
    assert "| `note` | a \\| b |" in section and "| `load.before` | 1, 2, 3 |" in section
    assert "| `samples` | 0, 1, 2, 3, 4, 5, … (40 in all) |" in section and "| `empty` | - |" in section
    assert "Also in the full JSON, nested too deep for this table: `nested`." in section
    assert "`nested.deep`" not in section and "x: 1" not in section
    assert "| `model` | `ms` |" in section and "| dense | 8.25 |" in section and "| moe | 7.5 |" in section
    assert "`runs` holds 1 records of 9 fields, in the full JSON." in section and "`k8`" not in section
    assert "[gpu.json](figures/data/gpu.json)" in section
    capped = page[page.index("## capped_made_up") : page.index("## gpu")]
    assert "| `key_07` | 10.5 |" in capped and "key_08" not in capped
    assert "12 more values are in the full JSON." in capped


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("gpu", "[1, 2]", "gpu.json: expected one JSON object, got list"),
        ("gpu", '{"a": ', "gpu.json: not JSON (Expecting value at line 1)"),
        ("recovery", '{"recoveries": 100}', "/recovery.json has no `recovery_ms_by_ranks`"),
        (
            "launch",
            json.dumps(
                {
                    "downtime_s_by_case": {"a": 1.0},
                    "downtime_s_runs_by_case": {"a": [1.0]},
                    "nodes": 2,
                    "ranks_per_node": 2,
                    "runs": 1,
                    "policies_by_case": 3,
                }
            ),
            "/launch.json does not have the shape the `launch` section reads (AttributeError",
        ),
        (
            "spillover-requests",
            json.dumps({"rows": [{"request": "full"}]}),
            "the `spillover` section reads (KeyError: 'throughput_tok_s')",
        ),
    ],
)
def test_a_result_file_of_the_wrong_shape_stops_the_render_with_one_line_naming_it(
    tmp_path, capsys, name, text, expected
):
    (tmp_path / f"{name}.json").write_text(text)
    assert _renderer().main(["--results", str(tmp_path), "--docs", str(tmp_path / "docs")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("render_results: ") and expected in err, err
    assert not (tmp_path / "docs").exists()


def test_every_registered_section_refuses_a_file_without_its_keys_by_name(tmp_path):
    render = _renderer()
    assert {"recovery", "launch", "launch-load", "scale", "scale-depth1", "spillover-requests"} <= set(render.SECTIONS)
    for name in render.SECTIONS:
        folder = tmp_path / name
        folder.mkdir()
        (folder / f"{name}.json").write_text(json.dumps({"bench": name, "rows": [{"other": 1}], "paths": {"a/b": 1}}))
        with pytest.raises(render.ResultShapeError, match=rf"^{re.escape(str(folder / name))}\.json "):
            render.render(folder)


def test_recovery_without_torchft_is_drawn_alone_and_says_why(tmp_path):
    doc = json.loads((ROOT / "bench" / "results" / "recovery.json").read_text())
    doc["torchft"] = {}
    doc["torchft_missing_reason"] = "torchft is not installed"
    (tmp_path / "recovery.json").write_text(json.dumps(doc))
    rendered = _renderer().render(tmp_path)
    assert "torchft was not measured: torchft is not installed." in rendered.page
    (time,) = [f for f in rendered.figures if f.name == "recovery-time"]
    assert time.data["torchft"] is None
    assert time.data["meshpact"]["p50"][0] == doc["recovery_ms_by_timeout"]["1s"]["2"]["p50_ms"]


def test_a_traffic_cut_just_under_one_is_not_rounded_to_one(tmp_path):
    doc = json.loads((ROOT / "bench" / "results" / "spillover-requests.json").read_text())
    doc["min_traffic_cut"], doc["max_abs_sim_error"] = 0.9999736, 0.1431
    (tmp_path / "spillover-requests.json").write_text(json.dumps(doc))
    page = _renderer().render(tmp_path).page
    assert "| smallest traffic cut against full results | 99.997 % |" in page
    assert "| largest simulator error | 14.3 % |" in page


@pytest.mark.slow  # importing matplotlib takes 1-5 s depending on the machine's load
def test_a_figure_drawn_twice_is_the_same_svg_bytes_carrying_its_digest_and_no_date(tmp_path):
    pytest.importorskip("matplotlib", reason="drawing needs the docs extra; make docs installs it and draws all")
    render = _renderer()
    rendered = render.render(ROOT / "bench" / "results")
    (figure,) = [f for f in rendered.figures if f.name == "launch-downtime"]
    render.draw(figure, tmp_path / "a.svg")
    render.draw(figure, tmp_path / "b.svg")
    svg = (tmp_path / "a.svg").read_bytes()
    assert svg == (tmp_path / "b.svg").read_bytes()
    assert svg == (DOCS / figure.file).read_bytes(), "docs/figures/launch-downtime.svg was not drawn by this code"
    assert figure.digest().encode() in svg and b"<dc:date>" not in svg and b"Matplotlib v" not in svg


def test_the_timeouts_page_shows_recovery_configs_own_table_at_the_defaults():
    page = (DOCS / "timeouts.md").read_text()
    for name, seconds, formula in RecoveryConfig().table():
        row = f"| {name} | {seconds:g} | `{formula}` |"
        assert row in page, f"docs/timeouts.md lacks (or has another) row: {row}"
