"""The ``--smoke`` runs of the paper's benchmark scripts: one run per module, and the fields every report has."""

import json

# What benchmarks.harness.records writes into every report, beside each script's own fields.
REPORT_FIELDS = (
  "schema_version",
  "config",
  "methods",
  "seeds",
  "results",
  "summary",
  "command",
  "argv",
  "date",
  "machine",
  "versions",
  "wall_time_s",
)


def run(script, name: str, tmp_path_factory, *flags: str) -> tuple:
  """``script.main`` with ``--smoke``, ``flags`` and ``--quiet`` into a new folder: the folder and what it returned."""
  out = tmp_path_factory.mktemp(name)
  return out, script.main(["--smoke", *flags, "--out", str(out), "--quiet"])


def report(out, returned, name: str, *fields: str) -> dict:
  """``out/name.json``, checked to be what ``main`` returned and to hold the common fields and ``fields``."""
  data = json.loads((out / f"{name}.json").read_text())
  assert data == json.loads(json.dumps(returned))
  assert [key for key in (*REPORT_FIELDS, *fields) if key not in data] == []
  assert data["argv"][0] == "--smoke" and data["wall_time_s"] > 0
  return data
