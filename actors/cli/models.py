"""`q4k models`: the models known by name, whether each is installed, and where its file is."""

from __future__ import annotations

import argparse

from actors.model.packaged import CHAT_MODEL, DEFAULT_MODEL, PACKAGED_MODELS

# What each default is for, shown beside its model.
DEFAULT_ROLES = {DEFAULT_MODEL: "the default of q4k generate, Engine.open(), load_model()",
                 CHAT_MODEL: "the default of q4k chat and, when installed, of q4k serve"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models",
        help="list the models known by name (for --model NAME), installed or not",
        description="List the packaged models, which --model NAME, Engine.open(NAME), "
        "load_model(NAME) and load_tokenizer(NAME) take by name: what each is, whether its "
        "package is installed (else the command that installs it), and its file's path and "
        "size. A file that exists by that name always wins over the packaged model.",
    )
    parser.set_defaults(handler=_models)


def _models(args: argparse.Namespace) -> int:
    """Two lines a model (plain, so that a path copies whole): its name and what it is, then
    where its file is, or the command that installs it."""
    for model in PACKAGED_MODELS.values():
        role = f"; {DEFAULT_ROLES[model.name]}" if model.name in DEFAULT_ROLES else ""
        print(f"{model.name}  {model.summary}{role}")
        located = model.locate()
        if located is None:
            print(f"  not installed: {model.install}")
            continue
        path, size = located
        pending = "" if path.exists() else "; assembled from its package on first use"
        print(f"  installed: {path} ({size / 1e6:,.0f} MB{pending})")
    return 0
