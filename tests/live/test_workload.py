"""Workload files: every shipped one loads; a bad one is one clear line before any rank starts."""

from __future__ import annotations

import textwrap
import time

import pytest

from meshpact.cli import main
from meshpact.live.recovery.workload import WorkloadError, check_workload, shipped_workloads

GOOD = textwrap.dedent("""
    import torch

    def build(mesh):
        model = torch.nn.Linear(4, 4)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def batch(step, rank):
        return torch.full((2, 4), float(step + rank))

    def train_step(model, optimizer, batch):
        loss = model(batch).sum()
        loss.backward()
        optimizer.step()
        return loss
""")


def _file(tmp_path, text: str, name: str = "w.py"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_workloads_include_the_decoder_an_hsdp_llama_and_a_compiled_one():
    assert {"decoder", "llama_hsdp", "compiled"} <= set(shipped_workloads())
    assert check_workload("llama_hsdp", 4).mesh.shape == (2, 2)
    assert check_workload("llama_hsdp", 4).mesh.names == ("replicate", "shard")
    assert check_workload("decoder", 3).mesh.shape == (3,)  # no MESH: 1-D over every rank


def test_a_good_user_file_loads_with_the_default_mesh(tmp_path):
    w = check_workload(_file(tmp_path, GOOD), 2)
    assert w.mesh.shape == (2,) and float(w.batch(3, 1)[0, 0]) == 4.0


@pytest.mark.parametrize(
    "text, message",
    [
        (GOOD.replace("def batch(step, rank)", "def make_batch(step, rank)"), "missing function batch(step, rank)"),
        (
            GOOD.replace("def train_step(model, optimizer, batch)", "def train_step(model, batch)"),
            "train_step takes (model, batch); expected train_step(model, optimizer, batch)",
        ),
        (GOOD.replace("import torch", "import torch\nimport not_a_module_here"), "cannot import 'not_a_module_here'"),
        (
            GOOD.replace("import torch", "import torch\nraise ValueError('broken on purpose')"),
            "importing it failed: ValueError: broken on purpose",
        ),
        (
            GOOD + "\nMESH = {'shape': [2, 3], 'names': ['a', 'b']}\n",
            "MESH shape [2, 3] holds 6 ranks but --ranks is 4",
        ),
        (GOOD + "\nMESH = {'shape': [2, 2], 'names': ['a']}\n", "MESH names must be 2 distinct non-empty strings"),
        (GOOD + "\nMESH = [2, 2]\n", "MESH must be a dict"),
        (GOOD.replace("return torch.full((2, 4), float(step + rank))", "pass"), "batch(0, 0) returned None"),
        (GOOD.replace("def build(mesh):", "def build(mesh:"), "syntax error"),
    ],
)
def test_a_bad_workload_is_one_line_naming_what_is_wrong(tmp_path, text, message):
    with pytest.raises(WorkloadError) as err:
        check_workload(_file(tmp_path, text), 4)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_missing_file_names_the_shipped_workloads(tmp_path):
    with pytest.raises(WorkloadError, match="no such file.*decoder"):
        check_workload(tmp_path / "nope.py", 2)


@pytest.mark.parametrize(
    "text, message",
    [
        (GOOD.replace("def batch(step, rank)", "def make_batch(step, rank)"), "missing function batch"),
        (GOOD + "\nMESH = {'shape': [2, 2]}\n", "MESH shape [2, 2] holds 4 ranks but --ranks is 2"),
        (GOOD.replace("import torch", "import torch\nimport not_a_module_here"), "cannot import"),
    ],
)
def test_the_cli_refuses_a_bad_workload_with_exit_2_before_any_rank_starts(tmp_path, capsys, text, message):
    path = _file(tmp_path, text)
    t0 = time.monotonic()
    code = main(
        [
            "live",
            "recover",
            "--ranks",
            "2",
            "--steps",
            "4",
            "--faults",
            "1",
            "--checkpoint-every",
            "2",
            "--workload",
            str(path),
            "--record",
            str(tmp_path / "r.jsonl"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert time.monotonic() - t0 < 30  # refused in the parent: no rank was started
    assert not (tmp_path / "r.jsonl").exists() and not (tmp_path / "r.jsonl.partial").exists()


def test_a_build_that_returns_something_else_is_named_with_what_was_expected(tmp_path):
    from meshpact.live.recovery.workload import built, load_workload

    w = load_workload(
        _file(tmp_path, GOOD.replace("return model, torch.optim.SGD(model.parameters(), lr=0.1)", "return model")), 2
    )
    with pytest.raises(WorkloadError, match=r"build\(mesh\) returned Linear; expected \(model, optimizer\)"):
        built(w, mesh=None)
