"""benchmarks/paper/demo.py, the README's first command (results/paper/demo.json: its committed run), at a tiny size."""

import json

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def demo(load_benchmark):
  return load_benchmark("paper.demo")


def test_tiny_run_prints_the_table_and_where_the_files_went(demo, tmp_path, capsys):
  returned = demo.main(["--depth", "2", "--epochs", "10", "--seeds", "2", "--quiet", "--out", str(tmp_path)])
  out = capsys.readouterr().out
  last = out.strip().splitlines()[-1]
  assert last.startswith("Shown in") and str(tmp_path / "demo.png") in last and str(tmp_path / "demo.json") in last
  assert "test accuracy (%)" in out and "o-CoLA-od" in out
  data = json.loads((tmp_path / "demo.json").read_text())
  assert data == json.loads(json.dumps(returned))
  assert set(data["results"]) == {"sgd", "ocola_od"}
  for entry in data["results"].values():
    assert len(entry["test_accuracy"]) == 2 and entry["history"]["epoch"][-1] == 10
  # The one hidden-to-hidden kernel of a 2-layer net stays orthonormal.
  assert max(data["results"]["ocola_od"]["max_orthogonality_defect"]) <= 1e-5
  assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_output_is_a_new_temporary_folder(demo):
  assert demo.parse_args([]).out is None
  with pytest.raises(SystemExit):
    demo.parse_args(["--depth", "1"])
