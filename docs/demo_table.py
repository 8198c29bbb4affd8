"""Write the README's demo tables from a real demo run.

    python docs/demo_table.py                  # runs `attr-engine demo --quick` (seed 0): the quick table + record
    python docs/demo_table.py --full           # runs `attr-engine demo` (minutes): the full demo's table
    python docs/demo_table.py --from DIR       # reads a finished run's DIR/results.json instead of running

The quick run's record goes to tests/data/demo_quick.json; tests/test_readme.py checks that the README's quick table
is that record and (marked slow) that `attr-engine demo --quick` still gives its scores. Run it from the repository
root after any change that moves the demo's numbers, and commit the README and the record together.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "tests" / "data" / "demo_quick.json"


def main() -> int:
    sys.path.insert(0, str(REPO))
    from attr_engine.cli import main as cli
    from attr_engine.cli.demo import DEFAULT, QUICK, README_COMMANDS, readme_record, readme_table, replace_readme_block

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the full demo's table (default: the quick one)")
    parser.add_argument("--from", dest="source", metavar="DIR", help="a finished demo run of the same kind")
    args = parser.parse_args()
    kind = "full" if args.full else "quick"
    if args.source is None:
        out = Path(tempfile.mkdtemp(prefix="attr-engine-demo-"))
        argv = ["demo", "--seed", "0", "--no-progress", "--out", str(out), *([] if args.full else ["--quick"])]
        if cli(argv) != 0:
            return 1
    else:
        out = Path(args.source)
    results = json.loads((out / "results.json").read_text())
    if results["sizes"] != asdict(QUICK if kind == "quick" else DEFAULT) or results["seed"] != 0:
        raise SystemExit(f"{out} is not a seed-0 {kind} demo run with the preset sizes")
    record = readme_record(results, f"{README_COMMANDS[kind]} --seed 0")
    readme = REPO / "README.md"
    readme.write_text(replace_readme_block(readme.read_text(), kind, readme_table(record)))
    if kind == "quick":
        RECORD.write_text(json.dumps(record, indent=1) + "\n")
    print(f"README.md: the {kind} demo table from {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
