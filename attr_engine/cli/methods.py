"""``methods``: every attribution method the registry knows (built-ins, aliases, families, plug-ins), listed from
the registry itself, so the list can never drift from what ``explain --method`` and ``evaluate --methods`` take."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> dict[str, argparse.ArgumentParser]:
    p = subparsers.add_parser(
        "methods",
        help="list the attribution methods explain --method and evaluate --methods take",
        description="Every method of the registry with its one-line description and aliases: the built-ins, the "
        "name families (captum:<Class>, gradcam:<Class>) and the methods of installed plug-ins (entry-point group "
        "attr_engine.explainers).",
    )
    p.set_defaults(run=run_methods)
    return {"methods": p}


def run_methods(args: argparse.Namespace) -> int:
    from attr_engine.explainer import list_methods

    rows = list_methods()
    width = max(len(name) for name, _, _ in rows)
    for name, description, aliases in rows:
        also = f" (also: {', '.join(aliases)})" if aliases else ""
        print(f"{name.ljust(width)}  {description}{also}")
    return 0
